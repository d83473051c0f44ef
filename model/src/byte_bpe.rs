//! Byte-level BPE encoding on plain string slices. `tokenizers`' pipeline carries every
//! character's alignment through normalization and pre-tokenization (the offsets of its
//! `Encoding`), which Ferry never reads and which cost more than the merges themselves: over
//! half of a request's CPU in the front went to tokenizing its prompt. Here the steps are the
//! same, without the alignments: the text is cut at the added tokens by `tokenizers`' own
//! added vocabulary (so its matching rules hold exactly), each run of text between them is
//! split by the family's expressions in order (a match and the text between two matches each a
//! piece, empty pieces dropped: `Split` with `Isolated`), each piece's bytes are mapped to the
//! byte-level alphabet, and the BPE model (with its cache of words) gives the piece's ids.
//! The tests check the ids against `tokenizers`' own pipeline on random texts for every family.

use tokenizers::models::bpe::BPE;
use tokenizers::{Model, NormalizerWrapper, OffsetReferential, OffsetType};

use crate::pre_tokenizer::PreTokenizer;

/// The byte-level BPE encoder of one vocabulary.
pub(crate) struct ByteBpe {
    /// The model and the added tokens (and, in tests, the reference pipeline).
    inner: tokenizers::Tokenizer,
    /// The pre-tokenizer's expressions, applied in order.
    regexes: Vec<fancy_regex::Regex>,
    /// Each byte's character in the byte-level alphabet.
    alphabet: [char; 256],
}

impl ByteBpe {
    /// The encoder of `model` with `pre`'s expressions and `specials` as added tokens.
    pub(crate) fn new(
        model: BPE,
        pre: &PreTokenizer,
        specials: Vec<tokenizers::AddedToken>,
    ) -> Result<Self, tokenizers::Error> {
        let mut inner = tokenizers::Tokenizer::new(model);
        // The whole pipeline only as the tests' reference: encoding splits by `regexes`.
        #[cfg(test)]
        inner.with_pre_tokenizer(Some(pre.build()?));
        inner.add_special_tokens(specials)?;
        let regexes =
            pre.regexes().iter().map(|r| fancy_regex::Regex::new(r)).collect::<Result<_, _>>()?;
        Ok(Self { inner, regexes, alphabet: byte_level_alphabet() })
    }

    /// Appends `text`'s ids to `ids`.
    pub(crate) fn encode(&self, text: &str, ids: &mut Vec<u32>) -> Result<(), tokenizers::Error> {
        let added = self.inner.get_added_vocabulary();
        let cut = added.extract_and_normalize(None::<&NormalizerWrapper>, text);
        let mut pieces = Vec::new();
        let mut next = Vec::new();
        let mut mapped = String::new();
        for (run, _, tokens) in cut.get_splits(OffsetReferential::Normalized, OffsetType::None) {
            if let Some(tokens) = tokens {
                ids.extend(tokens.iter().map(|t| t.id));
                continue;
            }
            pieces.clear();
            pieces.push(run);
            for re in &self.regexes {
                next.clear();
                for piece in &pieces {
                    split_isolated(re, piece, &mut next);
                }
                std::mem::swap(&mut pieces, &mut next);
            }
            for piece in &pieces {
                mapped.clear();
                mapped.extend(piece.bytes().map(|b| self.alphabet[usize::from(b)]));
                ids.extend(self.inner.get_model().tokenize(&mapped)?.iter().map(|t| t.id));
            }
        }
        Ok(())
    }
}

/// `text` split by `re`: each match and each stretch between matches a piece, empty ones
/// dropped. An expression that gives up (fancy-regex's backtracking limit) ends the matches
/// there, the rest one piece, as `tokenizers` does.
fn split_isolated<'a>(re: &fancy_regex::Regex, text: &'a str, out: &mut Vec<&'a str>) {
    let mut prev = 0;
    for m in re.find_iter(text) {
        let Ok(m) = m else { break };
        if prev < m.start() {
            out.push(&text[prev..m.start()]);
        }
        if m.start() < m.end() {
            out.push(m.as_str());
        }
        prev = m.end();
    }
    if prev < text.len() {
        out.push(&text[prev..]);
    }
}

/// GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for the
/// characters from U+0100 on, in order.
pub(crate) fn byte_level_alphabet() -> [char; 256] {
    let mut alphabet = ['\0'; 256];
    let mut extra = 0u32;
    for (b, slot) in (0u32..).zip(alphabet.iter_mut()) {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            extra += 1;
            255 + extra
        };
        *slot = char::from_u32(c).expect("byte-level alphabet is valid chars");
    }
    alphabet
}

#[cfg(test)]
impl ByteBpe {
    /// `text`'s ids through `tokenizers`' whole pipeline: the reference.
    pub(crate) fn encode_reference(&self, text: &str) -> Vec<u32> {
        self.inner.encode_fast(text, false).unwrap().get_ids().to_vec()
    }
}
