//! The pre-tokenizers a GGUF file names in `tokenizer.ggml.pre`, as llama.cpp defines them
//! (`llama-vocab.cpp`): before byte-level BPE, the text is split by a sequence of regular
//! expressions, each splitting every piece the previous ones left (a match and the text between
//! two matches each become a piece). A name Ferry does not know is refused: splitting with the
//! wrong expressions tokenizes every prompt differently from the model's training, and the model
//! answers worse without any error to show it.

use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

/// GPT-2's expression, as llama.cpp writes it.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's, with llama.cpp's case-insensitive contractions spelled out.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's: Llama 3's with digits one by one.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-4o's (Phi-4-mini, Llama 4), as its tokenizer.json writes it: words with their case
/// runs and contractions, digits three at a time. llama.cpp follows it with a rewrite of its
/// letter classes (`[^a-z]`, `[^A-Z]`), which splits no piece of the original's further in
/// the texts tested; Ferry takes the published expression.
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A pre-tokenizer llama.cpp knows by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PreTokenizer {
    /// The family's name (the first of `names`).
    pub name: &'static str,
    /// The `tokenizer.ggml.pre` values that select it.
    names: &'static [&'static str],
    /// The expressions, applied in order.
    regexes: &'static [&'static str],
    /// Whether a word that is itself a token is taken whole, before any merge (Llama 3's BPE).
    pub ignore_merges: bool,
    /// Whether prompts start with BOS when the file does not say
    /// (`tokenizer.ggml.add_bos_token`).
    pub add_bos_default: bool,
}

/// Every pre-tokenizer Ferry serves.
pub const KNOWN: &[PreTokenizer] = &[
    PreTokenizer {
        name: "default",
        names: &["default"],
        regexes: &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreTokenizer {
        name: "gpt-2",
        names: &["gpt-2", "phi-2", "mpt", "olmo"],
        regexes: &[GPT2],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreTokenizer {
        name: "smollm",
        names: &["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"],
        regexes: &[r"\p{N}", GPT2],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreTokenizer {
        name: "llama-bpe",
        names: &["llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"],
        regexes: &[LLAMA3],
        ignore_merges: true,
        add_bos_default: true,
    },
    PreTokenizer {
        name: "qwen2",
        names: &["qwen2", "stablelm2", "deepseek-r1-qwen"],
        regexes: &[QWEN2],
        ignore_merges: false,
        add_bos_default: false,
    },
    PreTokenizer {
        name: "gpt-4o",
        names: &["gpt-4o", "llama4"],
        regexes: &[GPT4O],
        ignore_merges: false,
        add_bos_default: false,
    },
];

/// `tokenizer.ggml.pre` names no pre-tokenizer Ferry knows.
#[derive(Debug, thiserror::Error)]
#[error(
    "unsupported pre-tokenizer {0:?} (tokenizer.ggml.pre); Ferry splits text as llama.cpp does \
     for {names}",
    names = supported_names()
)]
pub struct UnknownPreTokenizer(pub String);

/// The names Ferry accepts, for messages.
pub fn supported_names() -> String {
    KNOWN.iter().flat_map(|p| p.names.iter().copied()).collect::<Vec<_>>().join(", ")
}

impl PreTokenizer {
    /// The pre-tokenizer `tokenizer.ggml.pre` names. A file without the key gets llama.cpp's
    /// choice for it, `default` (files converted before the key existed).
    pub fn named(pre: Option<&str>) -> Result<Self, UnknownPreTokenizer> {
        let pre = pre.unwrap_or("default");
        KNOWN
            .iter()
            .find(|p| p.names.contains(&pre))
            .copied()
            .ok_or_else(|| UnknownPreTokenizer(pre.to_string()))
    }

    /// The expressions, applied in order.
    pub(crate) fn regexes(&self) -> &'static [&'static str] {
        self.regexes
    }

    /// As a `tokenizers` pre-tokenizer: each expression's split (matches and the text between
    /// them kept, as llama.cpp's `unicode_regex_split`), then the byte-level alphabet.
    pub fn build(&self) -> Result<PreTokenizerWrapper, tokenizers::Error> {
        let mut steps = self
            .regexes
            .iter()
            .map(|r| {
                let split = Split::new(
                    SplitPattern::Regex((*r).to_string()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )?;
                Ok(PreTokenizerWrapper::Split(split))
            })
            .collect::<Result<Vec<_>, tokenizers::Error>>()?;
        steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)));
        Ok(PreTokenizerWrapper::Sequence(Sequence::new(steps)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_pre_tokenizer_builds_and_names_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for p in KNOWN {
            p.build().unwrap_or_else(|e| panic!("{}: {e}", p.name));
            for n in p.names {
                assert!(seen.insert(*n), "{n} selects two pre-tokenizers");
            }
            assert_eq!(PreTokenizer::named(Some(p.name)).unwrap(), *p);
        }
        assert_eq!(PreTokenizer::named(None).unwrap().name, "default");
    }

    /// Ferry's encodings against Hugging Face's `tokenizers` package (Python, its own regex
    /// engine) for vocabularies it trains with each family's published pre-tokenizer, written to
    /// GGUF by the `gguf` package, and for the default model's own vocabulary; and against the
    /// `sentencepiece` package for a SentencePiece BPE vocabulary with byte fallback. Each
    /// encoding decodes back to its text.
    #[test]
    fn encodings_equal_hugging_face_tokenizers_for_each_family_and_the_default_model() {
        let dir = std::env::temp_dir().join(format!("ferry-tokenizers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let model = crate::default_model_path().unwrap();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/reference_tokenizers.py");
        let status = std::process::Command::new("python3")
            .arg(script)
            .arg(&dir)
            .arg(&model)
            .status()
            .expect("python3 runs");
        assert!(
            status.success(),
            "{script} failed (needs pip's tokenizers and gguf: scripts/setup)"
        );
        let expected: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
        let texts: Vec<&str> =
            expected["texts"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        let families = expected["families"].as_object().unwrap();
        let mut checked = Vec::new();
        for (family, want) in families {
            let header =
                crate::GgufHeader::open(std::path::Path::new(want["gguf"].as_str().unwrap()))
                    .unwrap();
            let tok = crate::Tokenizer::from_gguf(&header).unwrap();
            let mut compared = 0;
            for (text, ids) in texts.iter().zip(want["ids"].as_array().unwrap()) {
                // Null: a text the reference cannot encode as llama.cpp does (special tokens
                // in a SentencePiece text).
                let Some(ids) = ids.as_array() else { continue };
                let ids: Vec<u32> = ids.iter().map(|i| i.as_u64().unwrap() as u32).collect();
                let got = tok.encode(text).unwrap();
                assert_eq!(got, ids, "{family}: {text:?}");
                // Decoding gives the text back (after BOS, and SentencePiece's leading space).
                let back = tok.decode(&got[usize::from(tok.add_bos)..]);
                let back =
                    if family == "spm" { back.strip_prefix(' ').unwrap_or(&back) } else { &back };
                assert_eq!(back, *text, "{family}: decoding");
                compared += 1;
            }
            assert!(compared >= texts.len() - 1, "{family}: {compared} texts compared");
            if family == "spm" {
                // As llama.cpp: special tokens in the text are matched whole, and the text
                // after one starts with a space, as the text's start does.
                let hi = tok.encode("hi").unwrap();
                let (bos, eos) = (tok.bos_token_id.unwrap(), tok.eos_token_id);
                let want: Vec<u32> =
                    [bos].into_iter().chain(hi.clone()).chain([eos]).chain(hi).collect();
                assert_eq!(tok.encode("<s>hi</s>hi").unwrap(), want);
            }
            checked.push(family.as_str());
        }
        std::fs::remove_dir_all(&dir).ok();
        checked.sort_unstable();
        let every = ["gpt-2", "gpt-4o", "llama-bpe", "qwen2", "smollm", "smollm-real", "spm"];
        assert_eq!(checked, every);
    }

    #[test]
    fn an_unknown_pre_tokenizer_is_refused_by_name() {
        let err = PreTokenizer::named(Some("deepseek-v3")).unwrap_err().to_string();
        assert!(err.contains("\"deepseek-v3\"") && err.contains("tokenizer.ggml.pre"), "{err}");
        assert!(err.contains("llama-bpe") && err.contains("qwen2"), "{err}");
    }
}
