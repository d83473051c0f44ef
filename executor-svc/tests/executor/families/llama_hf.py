#!/usr/bin/env python3
"""Tiny Llama-family models written as GGUF files the way llama.cpp's converter writes them,
and their logits from a forward written here after Hugging Face's `modeling_llama.py`,
`modeling_qwen2.py`, `modeling_qwen3.py` and `modeling_phi3.py` (numpy, f64, HF's layout:
unpermuted Q/K, `rotate_half` rotary embedding, HF's rope scalings and sliding-window mask
`q - k < window`; Qwen 2 is Llama with biases on Q, K and V, Qwen 3 with each Q and K head
RMS-normed, Phi-3 with Q, K and V in one `qkv_proj` and gate and up in one `gate_up_proj`,
and their GGUF files keep HF's Q/K layout; Gemma 2 and 3 after `modeling_gemma2.py` and
`modeling_gemma3.py`: scaled embeddings, `1 + w` norms, post-norms, GeGLU, soft caps, windowed
and global layers, Gemma 3's local rotary base). Nothing here is Ferry's: the weights are quantized
and read back by the `gguf` package.

    llama_hf.py OUT_DIR

writes OUT_DIR/<variant>.gguf and OUT_DIR/expected.json:
{"variants": {"<variant>": {"gguf": path, "tokens": [...], "logits": [[...] per position],
  "unscaled_logits": [[...]] (the same weights without the variant's rope scaling or window),
  "greedy": [...] (8 tokens after `tokens`), "ablations": {what: [last position's logits without
  it]}}}, "refused": {"<variant>": [path, what it names]}}
"""
import json
import sys

import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from formats import random_k_blocks  # noqa: E402

HIDDEN, FF, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
HEAD = HIDDEN // HEADS
K_QUANTS = {Q.Q4_K: 2.7e-4, Q.Q5_K: 1.3e-4, Q.Q6_K: 6e-5}
# The matrices of a file, as `build`'s `types` names them.
PARTS = ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
         "ffn_down", "output")


def set_dims(hidden, ff, head=None, layers=2):
    """The widths of the next model (k-quants need inputs in multiples of 256; Qwen 3's and
    Gemma's heads are wider than width / heads; Gemma 3 needs six layers for a global one)."""
    global HIDDEN, FF, HEAD, LAYERS
    HIDDEN, FF, HEAD, LAYERS = hidden, ff, head or hidden // HEADS, layers
EPS = 1e-5
TOKENS = [5, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 84, 104, 101]


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
    bs += list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


MERGES = ["h e", "l l"]
VOCAB = [bytes_to_unicode()[b] for b in range(256)] + ["he", "ll"]
VOCAB += ["<|endoftext|>", "<s>", "<pad>", "<unk>"]


def permute(w, n_head):
    """llama.cpp's converter: Q/K rows reordered for rotation of adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantized(rng, rows, cols, qtype):
    """(the bytes the file holds, the weights they stand for, f64): a legacy or float type
    quantized from normal weights by the package, a k-quant as random blocks it dequantizes."""
    if qtype in K_QUANTS:
        data = random_k_blocks(rng, qtype, rows, cols, K_QUANTS[qtype])
    elif qtype == Q.Q2_K:
        # A type Ferry does not serve: random blocks, for a refusal.
        _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, size=(rows, cols // 256 * block_bytes), dtype=np.uint8)
        return data, None
    else:
        w = rng.normal(0, 1 / np.sqrt(cols), (rows, cols)).astype(np.float32)
        data = gguf.quants.quantize(w, qtype)
    return data, gguf.quants.dequantize(data, qtype).astype(np.float64)


def llama3_inv_freq(inv_freq, factor, low, high, old_len):
    """HF's `_compute_llama3_parameters`."""
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * np.pi / inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, out)


def llama3_factors(inv_freq, factor, low, high, old_len):
    """llama.cpp's converter: the `rope_freqs` tensor, per pair."""
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for f in inv_freq:
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def rms_norm(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def gelu_tanh(x):
    """PyTorch's `gelu(approximate="tanh")`, Gemma's `gelu_pytorch_tanh`."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def cap(x, c):
    """Gemma 2's soft-capping: `c · tanh(x / c)`; none for `c` None."""
    return x if c is None else np.tanh(x / c) * c


def rotary(inv_freq, n, mscale=1.0):
    """HF's cos and sin (times LongRoPE's `attention_scaling`, `mscale`)."""
    pos = np.arange(n, dtype=np.float64)
    freqs = np.outer(pos, inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb)[:, None, :] * mscale, np.sin(emb)[:, None, :] * mscale


def rope(x, cos, sin):
    """HF's `apply_rotary_pos_emb` on the first `cos.shape[-1]` dimensions of each head (all of
    them, or Phi-4-mini's `partial_rotary_factor`), the rest passed through."""
    r = cos.shape[-1]
    xr = x[..., :r]
    return np.concatenate([xr * cos + rotate_half(xr) * sin, x[..., r:]], axis=-1)


def forward(m, tokens, inv_freq, window=None, gemma=None):
    """Logits at every position (HF's LlamaForCausalLM, no cache); with a sliding `window`,
    query i attends to keys j with i - j < window. `gemma` (a dict) makes it HF's
    Gemma2ForCausalLM / Gemma3ForCausalLM: embeddings times sqrt(width), Gemma's norms (`1 + w`,
    the file holding `1 + w`), outputs post-normed before each residual add, GeGLU, scores
    scaled by `query_pre_attn_scalar ** -0.5` and soft-capped at `attn_cap`, logits at
    `final_cap`, the window on the layers of `pattern` (`layer_types`), those layers rotated by
    `local_inv_freq` (Gemma 3's `rope_local_base_freq`). Without `gemma` but with options
    (`{"mscale": ...}`): Phi-3's LongRoPE attention scaling; the rotated part of a head is
    always `2 · len(inv_freq)` wide."""
    n = len(tokens)
    g = gemma or {}
    gemma = g.get("gemma", False)
    x = m["embed"][tokens] * (np.sqrt(HIDDEN) if gemma else 1.0)
    cos_sin = rotary(inv_freq, n, g.get("mscale", 1.0))
    causal = np.triu(np.full((n, n), -np.inf), 1)
    windowed = causal.copy()
    if window is not None:
        windowed[np.subtract.outer(np.arange(n), np.arange(n)) >= window] = -np.inf
    for i, l in enumerate(m["layers"]):
        # Gemma's `layer_types`: full attention on the last layer of each `pattern`.
        local = "pattern" not in g or i % g["pattern"] < g["pattern"] - 1
        mask = windowed if local else causal
        cos, sin = rotary(g["local_inv_freq"], n) if local and "local_inv_freq" in g else cos_sin
        h = rms_norm(x, l["attn_norm"])
        bias = lambda name: l.get(name, 0.0)
        q = (h @ l["q"].T + bias("bq")).reshape(n, HEADS, HEAD)
        k = (h @ l["k"].T + bias("bk")).reshape(n, KV_HEADS, HEAD)
        v = (h @ l["v"].T + bias("bv")).reshape(n, KV_HEADS, HEAD)
        if "q_norm" in l:  # Qwen 3: each head RMS-normed over its own dimensions
            q, k = rms_norm(q, l["q_norm"]), rms_norm(k, l["k_norm"])
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        group = HEADS // KV_HEADS
        out = np.zeros((n, HEADS, HEAD))
        for hd in range(HEADS):
            s = cap(q[:, hd] @ k[:, hd // group].T / np.sqrt(HEAD), g.get("attn_cap")) + mask
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[:, hd] = p @ v[:, hd // group]
        o = out.reshape(n, HEADS * HEAD) @ l["o"].T
        x = x + (rms_norm(o, l["post_attention_norm"]) if gemma else o)
        h = rms_norm(x, l["ffn_norm"])
        gate, u = h @ l["gate"].T, h @ l["up"].T
        act = gelu_tanh(gate) if gemma else gate / (1 + np.exp(-gate))
        down = (act * u) @ l["down"].T
        x = x + (rms_norm(down, l["post_ffw_norm"]) if gemma else down)
    return cap(rms_norm(x, m["norm"]) @ m["output"].T, g.get("final_cap"))


def build(path, rng, theta, tied, scaling=None, rope_freqs=None, extra=None, types=None,
          arch="llama", biases=("q", "k", "v"), window=None, caps=None, longrope=None,
          rot=None):
    """Writes the GGUF file; returns the model the reference computes with. A `qwen2` file has
    the Q, K and V `biases` named, a `qwen3` file Q and K head norms, a `phi3` file Q, K and V
    in one `attn_qkv` and gate and up in one `ffn_up`; all three keep Q/K unpermuted, as
    llama.cpp's converter writes them; `gemma2` and `gemma3` files have post-norms (and Gemma 3
    Q and K head norms), their norm weights holding `1 + w`. `window`: a sliding window in the
    metadata; `caps`: Gemma 2's (attention, final) soft caps; `longrope`: Phi-3's LongRoPE
    (`short` and `long` factors per pair, the `orig` context, the `attn_factor`), as its
    converter writes it; `rot`: the rotated part of a head (Phi-4-mini's partial rotation)."""
    w = gguf.GGUFWriter(path, arch)
    gemma = arch in ("gemma2", "gemma3")
    qwen2, hf_layout = arch == "qwen2", arch in ("qwen2", "qwen3", "phi3") or gemma
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(EPS)
    w.add_vocab_size(len(VOCAB))
    w.add_rope_dimension_count(rot or HEAD)
    if HEAD != HIDDEN // HEADS:
        w.add_key_length(HEAD)
        w.add_value_length(HEAD)
    if window is not None:
        w.add_sliding_window(window)
    if longrope is not None:
        w.add_rope_scaling_orig_ctx_len(longrope["orig"])
        w.add_rope_scaling_attn_factors(longrope["attn_factor"])
        w.add_tensor("rope_factors_long.weight", longrope["long"])
        w.add_tensor("rope_factors_short.weight", longrope["short"])
    if caps is not None:
        w.add_attn_logit_softcapping(caps[0])
        w.add_final_logit_softcapping(caps[1])
    if scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if hf_layout else "gpt-2")  # Qwen 3's files name qwen2's
    w.add_token_list(VOCAB)
    w.add_token_types([1] * 258 + [3] * 4)
    w.add_token_merges(MERGES)
    w.add_eos_token_id(258)
    w.add_bos_token_id(259)
    w.add_add_bos_token(False)

    types = types or {}

    def matrix(name, rows, cols, n_head=None):
        # The tensor's kind: "attn_q" of "blk.0.attn_q.weight", "token_embd", "output".
        qtype = types.get(name.split(".")[-2], Q.Q8_0)
        data, ref = quantized(rng, rows, cols, qtype)
        w.add_tensor(name, permute(data, n_head) if n_head else data, raw_dtype=qtype)
        return ref

    def vector(name, n, mean=1.0, sd=0.1):
        v = (mean + rng.normal(0, sd, n)).astype(np.float32)
        w.add_tensor(name, v)
        return v.astype(np.float64)

    m = {"embed": matrix("token_embd.weight", len(VOCAB), HIDDEN), "layers": []}
    for i in range(LAYERS):
        p = f"blk.{i}"
        layer = {}
        if qwen2:  # biases of the size of the projections' outputs, as the file orders them
            for b, n in (("q", HEADS * HEAD), ("k", KV_HEADS * HEAD), ("v", KV_HEADS * HEAD)):
                if b in biases:
                    layer["b" + b] = vector(f"{p}.attn_{b}.bias", n, mean=0.0, sd=0.5)
        if gemma:
            layer["post_attention_norm"] = vector(f"{p}.post_attention_norm.weight", HIDDEN)
            layer["post_ffw_norm"] = vector(f"{p}.post_ffw_norm.weight", HIDDEN)
        if arch in ("qwen3", "gemma3"):  # weights far from 1, so that a forward without them differs
            layer["q_norm"] = vector(f"{p}.attn_q_norm.weight", HEAD, sd=0.5)
            layer["k_norm"] = vector(f"{p}.attn_k_norm.weight", HEAD, sd=0.5)
        if arch == "phi3":  # fused, as HF's qkv_proj and gate_up_proj: split for the forward
            q_dim, kv_dim = HEADS * HEAD, KV_HEADS * HEAD
            layer["attn_norm"] = vector(f"{p}.attn_norm.weight", HIDDEN)
            qkv = matrix(f"{p}.attn_qkv.weight", q_dim + 2 * kv_dim, HIDDEN)
            layer |= {"q": qkv[:q_dim], "k": qkv[q_dim:q_dim + kv_dim], "v": qkv[q_dim + kv_dim:]}
            layer["o"] = matrix(f"{p}.attn_output.weight", HIDDEN, q_dim)
            layer["ffn_norm"] = vector(f"{p}.ffn_norm.weight", HIDDEN)
            gate_up = matrix(f"{p}.ffn_up.weight", 2 * FF, HIDDEN)
            layer |= {"gate": gate_up[:FF], "up": gate_up[FF:]}
            layer["down"] = matrix(f"{p}.ffn_down.weight", HIDDEN, FF)
            m["layers"].append(layer)
            continue
        m["layers"].append(
            layer | {
                "attn_norm": vector(f"{p}.attn_norm.weight", HIDDEN),
                "q": matrix(f"{p}.attn_q.weight", HEADS * HEAD, HIDDEN, None if hf_layout else HEADS),
                "k": matrix(f"{p}.attn_k.weight", KV_HEADS * HEAD, HIDDEN,
                            None if hf_layout else KV_HEADS),
                "v": matrix(f"{p}.attn_v.weight", KV_HEADS * HEAD, HIDDEN),
                "o": matrix(f"{p}.attn_output.weight", HIDDEN, HEADS * HEAD),
                "ffn_norm": vector(f"{p}.ffn_norm.weight", HIDDEN),
                "gate": matrix(f"{p}.ffn_gate.weight", FF, HIDDEN),
                "up": matrix(f"{p}.ffn_up.weight", FF, HIDDEN),
                "down": matrix(f"{p}.ffn_down.weight", HIDDEN, FF),
            }
        )
    m["norm"] = vector("output_norm.weight", HIDDEN)
    m["window"] = window or None  # 0: none, as llama.cpp reads it
    m["output"] = m["embed"] if tied else matrix("output.weight", len(VOCAB), HIDDEN)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    if extra is not None:
        w.add_tensor(extra, np.zeros(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return m


def greedy(m, tokens, inv_freq, n, gemma=None):
    tokens = list(tokens)
    out = []
    for _ in range(n):
        nxt = int(np.argmax(forward(m, tokens, inv_freq, m["window"], gemma)[-1]))
        out.append(nxt)
        tokens.append(nxt)
    return out


def main():
    out_dir = sys.argv[1]
    variants, refused = {}, {}

    def run(name, m, inv_freq, plain_inv_freq, gemma=None, ablations=None):
        """`ablations`: {what: the gemma options without it}, each computed too; the test
        checks that each changes the logits (so a forward ignoring it would fail)."""
        variants[name] = {
            "gguf": f"{out_dir}/{name}.gguf",
            "tokens": TOKENS,
            "logits": forward(m, TOKENS, inv_freq, m["window"], gemma).tolist(),
            "unscaled_logits": forward(m, TOKENS, plain_inv_freq, None, gemma).tolist(),
            "greedy": greedy(m, TOKENS, inv_freq, 8, gemma),
            "ablations": {what: forward(m, TOKENS, f[0] if f else inv_freq, window, g)[-1].tolist()
                          for what, (window, g, *f) in (ablations or {}).items()},
        }

    inv = lambda theta: 1.0 / theta ** (np.arange(0, HEAD, 2, dtype=np.float64) / HEAD)

    def mixed(name, seed, *types):
        """A plain Llama file, untied, whose matrices have `types` in the order of `PARTS`."""
        m = build(f"{out_dir}/{name}.gguf", np.random.default_rng(seed), 10000.0, tied=False,
                  types=dict(zip(PARTS, types, strict=True)))
        run(name, m, inv(10000.0), inv(10000.0))

    # Plain Llama 2 style, tied output.
    m = build(f"{out_dir}/llama.gguf", np.random.default_rng(1), 10000.0, tied=True)
    run("llama", m, inv(10000.0), inv(10000.0))
    # Llama 3.1 style: untied output and llama3 rope scaling, with an original context short
    # enough that it changes the tiny model's angles at these positions.
    scale = dict(factor=8.0, low=1.0, high=4.0, old_len=16)
    factors = llama3_factors(inv(500000.0), **scale)
    m = build(f"{out_dir}/llama3.gguf", np.random.default_rng(2), 500000.0, tied=False, rope_freqs=factors)
    run("llama3", m, llama3_inv_freq(inv(500000.0), **scale), inv(500000.0))
    # Linear rope scaling (factor 4: positions / 4).
    m = build(f"{out_dir}/linear.gguf", np.random.default_rng(3), 10000.0, tied=True, scaling=4.0)
    run("linear", m, inv(10000.0) / 4.0, inv(10000.0))
    # Every legacy type in one file, Q, K and V (and gate and up) each in another: stacked
    # products over parts of different types.
    mixed("mixed", 5, Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.Q4_1, Q.Q8_0, Q.Q5_1, Q.Q4_0, Q.Q5_0, Q.Q8_0)
    # A Q4_K_M-like file: Q4_K with Q6_K values, down projections and output, and a Q5_K up
    # projection, at widths of multiples of 256.
    set_dims(256, 512)
    mixed("k-quants", 6, Q.Q4_K, Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q4_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q6_K)
    # A matrix of a type Ferry does not compute in (Q2_K): refused when the file is opened.
    path = f"{out_dir}/q2_k.gguf"
    build(path, np.random.default_rng(11), 10000.0, tied=True, types={"ffn_up": Q.Q2_K})
    refused["a Q2_K matrix"] = [path, "blk.0.ffn_up.weight is of type Q2_K"]
    set_dims(64, 128)
    # Unquantized weights, the three float types mixed (as a converter's F16 or BF16 output
    # with some tensors kept F32), Q, K and V of different types.
    mixed("floats", 10, Q.BF16, Q.F16, Q.BF16, Q.F32, Q.F16, Q.BF16, Q.F16, Q.BF16, Q.F32)
    # Qwen 2.5 style: biases on Q, K and V, HF's Q/K layout rotated in halves, untied output.
    m = build(f"{out_dir}/qwen2.gguf", np.random.default_rng(7), 1000000.0, tied=False, arch="qwen2")
    run("qwen2", m, inv(1000000.0), inv(1000000.0))
    # A Qwen 2 file without one of its biases.
    path = f"{out_dir}/qwen2-no-k-bias.gguf"
    build(path, np.random.default_rng(8), 1000000.0, tied=True, arch="qwen2", biases=("q", "v"))
    refused["qwen2 without a bias"] = [path, "blk.0.attn_k.bias"]
    # Qwen 3 style: heads twice width / heads (its key length), each Q and K head RMS-normed
    # before the NEOX rotation, no biases.
    set_dims(64, 128, head=32)
    m = build(f"{out_dir}/qwen3.gguf", np.random.default_rng(9), 1000000.0, tied=True, arch="qwen3")
    run("qwen3", m, inv(1000000.0), inv(1000000.0))
    set_dims(64, 128)
    # Phi-3 style: fused Q, K, V and gate, up, the NEOX rotation, and a sliding window of 5
    # positions (Phi-3 mini's is 2047), which the 18 tokens pass.
    m = build(f"{out_dir}/phi3.gguf", np.random.default_rng(12), 10000.0, tied=False, arch="phi3",
              window=5)
    run("phi3", m, inv(10000.0), inv(10000.0))
    # Gemma 2 style: GeGLU, scaled embeddings, post-norms, soft caps low enough to matter here
    # (Gemma 2's are 50 and 30), a window of 5 on the first layer of each pair, tied output.
    gemma2 = {"gemma": True, "attn_cap": 1.5, "final_cap": 2.0, "pattern": 2}
    m = build(f"{out_dir}/gemma2.gguf", np.random.default_rng(13), 10000.0, tied=True,
              arch="gemma2", window=5, caps=(1.5, 2.0))
    run("gemma2", m, inv(10000.0), inv(10000.0), gemma2, {
        "the window": (None, gemma2),
        "the attention cap": (5, gemma2 | {"attn_cap": None}),
        "the final cap": (5, gemma2 | {"final_cap": None}),
        "the global layers": (5, gemma2 | {"pattern": 1000}),
    })
    # Gemma 3 style: Q and K head norms, heads of 64 (wider than width / heads), five windowed
    # layers rotating at base 10000 to a global one at 1e6 with linear scaling 8, no caps.
    set_dims(64, 128, head=64, layers=6)
    gemma3 = {"gemma": True, "pattern": 6, "local_inv_freq": inv(10000.0)}
    m = build(f"{out_dir}/gemma3.gguf", np.random.default_rng(14), 1000000.0, tied=True,
              arch="gemma3", window=5, scaling=8.0)
    run("gemma3", m, inv(1000000.0) / 8.0, inv(1000000.0) / 8.0, gemma3, {
        "the window": (None, gemma3),
        "the local rotary base": (5, {"gemma": True, "pattern": 6}),
        "the global layer": (5, gemma3 | {"pattern": 1000}),
    })
    set_dims(64, 128)
    # Phi-3.5 / Phi-4-mini style LongRoPE: a factor per pair dividing its frequency, the long
    # ones because the file's context (256) passes the original (8), cos and sin times the
    # attention factor; and, as Phi-4-mini, three quarters of each head rotated and a window
    # of 0 (none).
    rot, lr_rng = 12, np.random.default_rng(16)
    short = (1 + lr_rng.uniform(0, 0.5, rot // 2)).astype(np.float32)
    long = (1 + lr_rng.uniform(1, 8, rot // 2)).astype(np.float32)
    attn_factor = float(np.float32(np.sqrt(1 + np.log(256 / 8) / np.log(8))))
    m = build(f"{out_dir}/phi3-longrope.gguf", np.random.default_rng(15), 10000.0, tied=True,
              arch="phi3", window=0, rot=rot,
              longrope={"short": short, "long": long, "orig": 8, "attn_factor": attn_factor})
    base = 1.0 / 10000.0 ** (np.arange(0, rot, 2, dtype=np.float64) / rot)
    longrope = {"mscale": attn_factor}
    run("phi3-longrope", m, base / long, base / long, longrope, {
        "the long factors": (None, longrope, base / short),
        "the attention factor": (None, {}),
    })
    # A tensor the llama forward does not compute (Qwen 2's bias).
    path = f"{out_dir}/bias.gguf"
    build(path, np.random.default_rng(4), 10000.0, tied=True, extra="blk.0.attn_q.bias")
    refused["bias"] = [path, "blk.0.attn_q.bias"]
    with open(f"{out_dir}/expected.json", "w") as f:
        json.dump({"variants": variants, "refused": refused}, f)


if __name__ == "__main__":
    main()
