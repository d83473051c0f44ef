#!/usr/bin/env python3
"""The reference for Ferry's tokenizers: BPE vocabularies trained here with Hugging Face's
`tokenizers` package, each family's pre-tokenizer written as its published tokenizer.json
defines it (not as Ferry or llama.cpp writes it), and a SentencePiece BPE vocabulary with byte
fallback trained with the `sentencepiece` package as Llama 2 and Mistral's were (identity
normalization, whitespace kept, digits split), saved as GGUF metadata with the `gguf` package,
and the ids `tokenizers` or `sentencepiece` gives for a fixed set of texts (for SentencePiece,
the texts without special tokens: `sentencepiece` matches none in a text, where llama.cpp does —
null there).

    reference_tokenizers.py OUT_DIR [REAL_MODEL.gguf]

writes OUT_DIR/<family>.gguf for each family and OUT_DIR/expected.json:
{"texts": [...], "families": {"<family>": {"gguf": path, "ids": [[...], ...]}}}.
With REAL_MODEL (SmolLM2's GGUF), the family "smollm-real" is that file's own vocabulary under
SmolLM2's published pre-tokenizer.
"""
import json
import sys

import io

import gguf
import sentencepiece
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

TEXTS = [
    "Hello, world! I'm here; THEY'RE there, we'll see. It's 2024-12-05 at 13:45.",
    "1234567890 12 345 6789 3.14159 1,000,000",
    "  leading spaces,\ttabs\t\tand\n\nnewlines\r\n end   ",
    "emoji \U0001F600\U0001F44D\U0001F3FD and CJK \u4f60\u597d\uff0c\u4e16\u754c\u3002 "
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \ud55c\uad6d\uc5b4",
    'fn main() {\n    let x = vec![1, 2, 3];\n    println!("{x:?}");\n}\n',
    "\u00dcn\u00efc\u00f6d\u00e9 fa\u00e7ade \u2014 na\u00efve caf\u00e9; "
    "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac; \u0440\u0443\u0441\u0441\u043a\u0438\u0439",
    "<|im_start|>user\nWhat's 17*23?<|im_end|>\n<|im_start|>assistant\n",
    "a  b   c    d\n\n\n   $100 + 5% = ^~|<=> don't DON'T you'LL",
    "",
]

# What the model cards' tokenizer.json files say.
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def split_then_bytes(regex):
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )


FAMILIES = {
    # GPT-2's tokenizer.json: byte level with its own expression.
    "gpt-2": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False),
    # SmolLM2's: digits one by one, then GPT-2's.
    "smollm": (
        lambda: pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        ),
        False,
    ),
    # Llama 3's (with `ignore_merges`, as its tokenizer.json sets).
    "llama-bpe": (lambda: split_then_bytes(LLAMA3), True),
    "qwen2": (lambda: split_then_bytes(QWEN2), False),
    # GPT-4o's (Phi-4-mini's tokenizer.json).
    "gpt-4o": (lambda: split_then_bytes(GPT4O), False),
}

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]

CORPUS = TEXTS * 3 + [
    "The quick brown fox jumps over the lazy dog. " * 5,
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and more numbers 42 4242 424242.",
    "def f(x):\n    return x * 2  # double\n\nclass A:\n    pass\n",
    "Il \u00e9tait une fois une petite fille. Es war einmal ein M\u00e4dchen.",
    "\u6625\u7720\u4e0d\u89c9\u6653\uff0c\u5904\u5904\u95fb\u557c\u9e1f\u3002",
]


def merges_of(tokenizer):
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def write_gguf(path, pre, tokens, types, merges, eos, bos, add_bos):
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(eos)
    w.add_bos_token_id(bos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def trained(family, out_dir):
    pre, ignore_merges = FAMILIES[family]
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    types = [3 if t in SPECIALS else 1 for t in tokens]
    path = f"{out_dir}/{family}.gguf"
    # Llama 3's files leave add_bos to llama.cpp's default for the family (true); the others
    # say false.
    add_bos = None if family == "llama-bpe" else False
    bos = vocab["<|begin_of_text|>"]
    write_gguf(path, family, tokens, types, merges_of(tok), vocab["<|endoftext|>"], bos, add_bos)
    ids = [([bos] if add_bos is None else []) + tok.encode(t).ids for t in TEXTS]
    return {"gguf": path, "ids": ids}


def sentencepiece_family(out_dir):
    """A SentencePiece BPE vocabulary with byte fallback (rare characters — the emoji, some CJK
    — left to their bytes), written as llama.cpp's converter writes Llama 2's."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=700, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, add_dummy_prefix=True,
        character_coverage=0.99, minloglevel=2,
    )
    sp = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]
    scores = [sp.get_score(i) for i in range(n)]

    def kind(i):
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 1

    path = f"{out_dir}/spm.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types([kind(i) for i in range(n)])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    byte_fallbacks = sum(sp.is_byte(i) for t in TEXTS for i in sp.encode(t))
    assert byte_fallbacks > 0, "no text falls back to bytes: the test would not cover it"
    ids = [None if "<|" in t else sp.encode(t) for t in TEXTS]
    return {"gguf": path, "ids": ids}


def field(reader, key):
    return reader.fields[key].contents()


def real(path):
    """SmolLM2's own vocabulary under its published pre-tokenizer."""
    r = gguf.GGUFReader(path)
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = FAMILIES["smollm"][0]()
    from tokenizers import AddedToken

    tok.add_special_tokens(
        [AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty in (3, 4)]
    )
    return {"gguf": path, "ids": [tok.encode(t).ids for t in TEXTS]}


def main():
    out_dir = sys.argv[1]
    families = {f: trained(f, out_dir) for f in FAMILIES}
    families["spm"] = sentencepiece_family(out_dir)
    if len(sys.argv) > 2:
        families["smollm-real"] = real(sys.argv[2])
    with open(f"{out_dir}/expected.json", "w") as f:
        json.dump({"texts": TEXTS, "families": families}, f)


if __name__ == "__main__":
    main()
