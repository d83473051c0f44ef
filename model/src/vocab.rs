//! A GGUF vocabulary as the tokenizer reads it: the metadata (tokens, their types, the ids
//! that end a generation), the encoder its model names — byte-level BPE through `tokenizers`
//! or SentencePiece ([`crate::spm`]) — and each token's bytes for decoding.

use std::collections::HashMap;

use tokenizers::models::bpe::BPE;
use tokenizers::AddedToken;

use crate::byte_bpe::{byte_level_alphabet, ByteBpe};
use crate::gguf::{GgufHeader, Value};
use crate::pre_tokenizer::{PreTokenizer, UnknownPreTokenizer};
use crate::spm::{self, Spm};

/// Why a tokenizer could not be built or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A metadata key is missing or has the wrong type.
    #[error("GGUF metadata {key}: {reason}")]
    Metadata {
        /// The key.
        key: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// The tokenizer model is neither byte-level BPE nor SentencePiece.
    #[error(
        "unsupported tokenizer model {0:?} (tokenizer.ggml.model; byte-level BPE, \"gpt2\", and \
         SentencePiece, \"llama\", are served)"
    )]
    Unsupported(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer Ferry does not know.
    #[error(transparent)]
    PreTokenizer(#[from] UnknownPreTokenizer),
    /// The `tokenizers` crate failed.
    #[error("tokenizer: {0}")]
    Tokenizers(String),
    /// The chat template failed to compile or render.
    #[error("chat template: {0}")]
    Template(String),
}

/// GGUF token types (llama.cpp's `llama_token_type`).
pub(crate) const TOKEN_TYPE_UNKNOWN: i32 = 2;
pub(crate) const TOKEN_TYPE_CONTROL: i32 = 3;
pub(crate) const TOKEN_TYPE_USER_DEFINED: i32 = 4;
pub(crate) const TOKEN_TYPE_BYTE: i32 = 6;

/// The texts of the tokens llama.cpp takes as the end of a generation in any vocabulary (its
/// `llama_vocab::impl::load`), made control tokens where a file left them normal.
pub const END_OF_GENERATION_TEXTS: [&str; 12] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// The metadata keys of the other tokens that end a generation.
pub(crate) const END_OF_GENERATION_KEYS: [&str; 5] = [
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
];

/// `tokenizer.ggml.token_type`, one per token (all normal when absent).
pub(crate) fn token_types(header: &GgufHeader, n: usize) -> Result<Vec<i32>, TokenizerError> {
    let key = "tokenizer.ggml.token_type";
    let Some(v) = header.get(key) else { return Ok(vec![1; n]) };
    let items = v.as_array().ok_or_else(|| bad(key, "an array", v))?;
    let types = items
        .iter()
        .map(|t| t.as_i32().ok_or_else(|| bad(key, "an integer", t)))
        .collect::<Result<Vec<_>, _>>()?;
    if types.len() != n {
        let reason = format!("{} types for {n} tokens", types.len());
        return Err(TokenizerError::Metadata { key, reason });
    }
    Ok(types)
}

/// The token id at `key`, which must lie in a vocabulary of `n` tokens.
pub(crate) fn token_id(
    header: &GgufHeader,
    key: &'static str,
    n: usize,
) -> Result<Option<u32>, TokenizerError> {
    let Some(v) = header.get(key) else { return Ok(None) };
    let id = v.as_u32().ok_or_else(|| bad(key, "a token id", v))?;
    if id as usize >= n {
        let reason = format!("token id {id} is past the vocabulary's {n} tokens");
        return Err(TokenizerError::Metadata { key, reason });
    }
    Ok(Some(id))
}

/// The end-of-generation set (see [`crate::Tokenizer::eog_token_ids`]), EOS first; the tokens found
/// by their text become control tokens in `types`, as llama.cpp overrides them.
pub(crate) fn end_of_generation(
    header: &GgufHeader,
    eos: u32,
    tokens: &[String],
    types: &mut [i32],
) -> Result<Vec<u32>, TokenizerError> {
    let mut rest = Vec::new();
    for key in END_OF_GENERATION_KEYS {
        rest.extend(token_id(header, key, tokens.len())?);
    }
    for (id, text) in tokens.iter().enumerate() {
        if END_OF_GENERATION_TEXTS.contains(&text.as_str()) {
            types[id] = TOKEN_TYPE_CONTROL;
            rest.push(id as u32);
        }
    }
    rest.sort_unstable();
    rest.dedup();
    rest.retain(|&id| id != eos);
    Ok(std::iter::once(eos).chain(rest).collect())
}

pub(crate) fn meta<'a>(
    header: &'a GgufHeader,
    key: &'static str,
) -> Result<&'a Value, TokenizerError> {
    header.get(key).ok_or(TokenizerError::Metadata { key, reason: "missing".into() })
}

pub(crate) fn bad(key: &'static str, want: &str, got: &Value) -> TokenizerError {
    TokenizerError::Metadata { key, reason: format!("expected {want}, found {}", got.type_name()) }
}

/// `key`'s value as an array of strings.
pub(crate) fn strings(
    header: &GgufHeader,
    key: &'static str,
) -> Result<Vec<String>, TokenizerError> {
    let v = meta(header, key)?;
    let items = v.as_array().ok_or_else(|| bad(key, "an array of strings", v))?;
    items
        .iter()
        .map(|item| item.as_str().map(str::to_string).ok_or_else(|| bad(key, "a string", item)))
        .collect()
}

/// How text becomes ids: byte-level BPE (`tokenizers`' model and added tokens), or SentencePiece as llama.cpp
/// encodes it.
pub(crate) enum Encoder {
    /// `tokenizer.ggml.model = gpt2`.
    Bpe(Box<ByteBpe>),
    /// `tokenizer.ggml.model = llama`.
    Spm {
        /// The vocabulary and its scores.
        spm: Box<Spm>,
        /// Whether a space goes before the text and after each special token
        /// (`tokenizer.ggml.add_space_prefix`, true unless the file says otherwise).
        add_space_prefix: bool,
        /// The tokens matched whole in a text (control, user-defined and unknown), longest
        /// first, as llama.cpp partitions a text by them.
        specials: Vec<(String, u32)>,
    },
}

/// The byte-level BPE encoder of `tokens` (with the pre-tokenizer `tokenizer.ggml.pre` names),
/// and whether its family adds BOS by default.
pub(crate) fn bpe(
    header: &GgufHeader,
    tokens: &[String],
    types: &[i32],
) -> Result<(Encoder, bool), TokenizerError> {
    let key = "tokenizer.ggml.pre";
    let pre = match header.get(key) {
        Some(v) => Some(v.as_str().ok_or_else(|| bad(key, "a string", v))?),
        None => None,
    };
    bpe_for(header, (tokens, types), PreTokenizer::named(pre)?)
}

/// [`bpe`] with the pre-tokenizer `pre`, whatever the file names.
fn bpe_for(
    header: &GgufHeader,
    (tokens, types): (&[String], &[i32]),
    pre: PreTokenizer,
) -> Result<(Encoder, bool), TokenizerError> {
    let merges: Vec<(String, String)> = strings(header, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())).ok_or_else(|| {
                TokenizerError::Metadata {
                    key: "tokenizer.ggml.merges",
                    reason: format!("merge {m:?} has no space"),
                }
            })
        })
        .collect::<Result<_, _>>()?;
    let tokenizers_err = |e: tokenizers::Error| TokenizerError::Tokenizers(e.to_string());
    let vocab: tokenizers::models::bpe::Vocab =
        tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let model = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(tokenizers_err)?;
    let specials: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, t)| **t == TOKEN_TYPE_CONTROL || **t == TOKEN_TYPE_USER_DEFINED)
        .map(|(tok, t)| AddedToken::from(tok.clone(), *t == TOKEN_TYPE_CONTROL))
        .collect();
    let bpe = ByteBpe::new(model, &pre, &specials).map_err(tokenizers_err)?;
    Ok((Encoder::Bpe(Box::new(bpe)), pre.add_bos_default))
}

/// The SentencePiece encoder of `tokens` (`tokenizer.ggml.scores` their merge order); BOS is
/// added by default, as llama.cpp does for these vocabularies.
pub(crate) fn spm(
    header: &GgufHeader,
    tokens: &[String],
    types: &[i32],
) -> Result<(Encoder, bool), TokenizerError> {
    let key = "tokenizer.ggml.scores";
    let v = meta(header, key)?;
    let items = v.as_array().ok_or_else(|| bad(key, "an array of numbers", v))?;
    let scores: Vec<f32> = items
        .iter()
        .map(|s| s.as_f32().ok_or_else(|| bad(key, "a number", s)))
        .collect::<Result<_, _>>()?;
    if scores.len() != tokens.len() {
        let reason = format!("{} scores for {} tokens", scores.len(), tokens.len());
        return Err(TokenizerError::Metadata { key, reason });
    }
    let unknown = token_id(header, "tokenizer.ggml.unknown_token_id", tokens.len())?;
    let key = "tokenizer.ggml.add_space_prefix";
    let add_space_prefix = match header.get(key) {
        Some(v) => v.as_bool().ok_or_else(|| bad(key, "a boolean", v))?,
        None => true,
    };
    let mut specials: Vec<(String, u32)> = tokens
        .iter()
        .zip(types)
        .enumerate()
        .filter(|(_, (text, t))| {
            !text.is_empty()
                && matches!(**t, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED | TOKEN_TYPE_UNKNOWN)
        })
        .map(|(id, (text, _))| (text.clone(), id as u32))
        .collect();
    specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
    let spm = Box::new(Spm::new(tokens, scores, unknown));
    Ok((Encoder::Spm { spm, add_space_prefix, specials }, true))
}

/// Each token's bytes as decoded output reads them: a byte-level BPE token's characters mapped
/// back to bytes, a SentencePiece token's `▁` a space and a byte token its byte, special
/// tokens their text.
pub(crate) fn token_bytes(byte_level: bool, tokens: &[String], types: &[i32]) -> Vec<Vec<u8>> {
    let unicode_to_byte = byte_level_decoder_table();
    let normal = |tok: &str| -> Vec<u8> {
        if byte_level {
            tok.chars()
                .flat_map(|c| match unicode_to_byte.get(&c) {
                    Some(b) => vec![*b],
                    None => c.to_string().into_bytes(),
                })
                .collect()
        } else {
            tok.replace(spm::SPACE, " ").into_bytes()
        }
    };
    tokens
        .iter()
        .zip(types)
        .map(|(tok, &t)| match t {
            TOKEN_TYPE_CONTROL => tok.as_bytes().to_vec(),
            TOKEN_TYPE_USER_DEFINED if byte_level => tok.as_bytes().to_vec(),
            TOKEN_TYPE_BYTE if !byte_level => {
                Spm::byte_of(tok).map_or_else(|| normal(tok), |b| vec![b])
            }
            _ => normal(tok),
        })
        .collect()
}

/// `text` cut at every occurrence of the special tokens, longest first (llama.cpp's
/// `tokenizer_st_partition`): `Ok(text)` for a run of text, `Err(id)` for a token.
pub(crate) fn partition<'a>(
    text: &'a str,
    specials: &[(String, u32)],
) -> Vec<Result<&'a str, u32>> {
    // An empty text has no part (no space to prefix), as in llama.cpp.
    let mut parts = if text.is_empty() { Vec::new() } else { vec![Ok(text)] };
    for (special, id) in specials {
        if !parts.iter().any(|p| p.is_ok_and(|t| t.contains(special.as_str()))) {
            continue;
        }
        let mut next = Vec::with_capacity(parts.len() + 2);
        for part in parts {
            let Ok(mut rest) = part else {
                next.push(part);
                continue;
            };
            while let Some(i) = rest.find(special.as_str()) {
                if i > 0 {
                    next.push(Ok(&rest[..i]));
                }
                next.push(Err(*id));
                rest = &rest[i + special.len()..];
            }
            if !rest.is_empty() {
                next.push(Ok(rest));
            }
        }
        parts = next;
    }
    parts
}

/// GPT-2's byte-level alphabet, reversed: the printable stand-in char of each byte → the byte.
pub(crate) fn byte_level_decoder_table() -> HashMap<char, u8> {
    (0..=255u8).zip(byte_level_alphabet()).map(|(b, c)| (c, b)).collect()
}

#[cfg(test)]
mod tests {
    use super::{bpe_for, strings, token_types, Encoder};
    use crate::pre_tokenizer::KNOWN;

    /// Random texts from fragments that reach every branch of the expressions (letters in
    /// both cases, contractions, digit runs, punctuation, spaces, tabs and line breaks in runs,
    /// other scripts, emoji, the added tokens whole and cut): encoded by Ferry's path and by
    /// `tokenizers`' whole pipeline, over the default model's vocabulary with every family's
    /// pre-tokenizer, the ids are the same.
    #[test]
    fn byte_level_bpe_equals_the_tokenizers_pipeline_on_random_texts() {
        const FRAGMENTS: &[&str] = &[
            "Hello",
            "world",
            "WORLD",
            "the",
            " ",
            "  ",
            "   ",
            "\t",
            "\n",
            "\n\n",
            "\r\n",
            "'s",
            "'T",
            "'re",
            "'ll",
            "'d",
            "don't",
            "1",
            "42",
            "2026",
            "1234567",
            "3.14",
            "!",
            "?!",
            "...",
            "$",
            "+",
            "<=>",
            "^~|",
            "(",
            ")",
            "{\"a\": 1}",
            "_",
            "-",
            "/",
            "é",
            "naïve",
            "中文",
            "日本語",
            "Ελληνικά",
            "مرحبا",
            "🦀",
            "👍🏽",
            "\u{a0}",
            "\u{2028}",
            "<|im_start|>",
            "<|im_end|>",
            "<|endoftext|>",
            "<|im_",
            "start|>",
            "<",
            "|",
        ];
        let path = crate::default_model_path().unwrap();
        let header = crate::GgufHeader::open(&path).unwrap();
        let tokens = strings(&header, "tokenizer.ggml.tokens").unwrap();
        let types = token_types(&header, tokens.len()).unwrap();
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move |n: usize| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as usize % n
        };
        let mut used = vec![false; FRAGMENTS.len()];
        let (mut texts, mut added_hits) = (0, 0);
        for pre in KNOWN {
            let (Encoder::Bpe(bpe), _) = bpe_for(&header, (&tokens, &types), *pre).unwrap() else {
                panic!("byte-level BPE expected");
            };
            for _ in 0..400 {
                let mut text = String::new();
                for _ in 0..=next(24) {
                    let k = next(FRAGMENTS.len());
                    used[k] = true;
                    text.push_str(FRAGMENTS[k]);
                }
                let mut ids = Vec::new();
                bpe.encode(&text, &mut ids).unwrap();
                assert_eq!(ids, bpe.encode_reference(&text), "{}: {text:?}", pre.name);
                added_hits += usize::from(text.contains("<|im_start|>"));
                texts += 1;
            }
        }
        assert!(used.iter().all(|&u| u), "every fragment drawn");
        assert!(added_hits > 100, "added tokens in {added_hits} texts");
        assert_eq!(texts, 400 * KNOWN.len());
    }
}
