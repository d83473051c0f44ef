//! Byte-level BPE encoding on plain string slices. `tokenizers`' pipeline carries every
//! character's alignment through normalization and pre-tokenization (the offsets of its
//! `Encoding`), which Ferry never reads and which cost more than the merges themselves: over
//! half of a request's CPU in the front went to tokenizing its prompt. Here the steps are the
//! same, without the alignments: the text is cut at the added tokens (as `tokenizers`' added
//! vocabulary cuts them), each run of text between them is split by the family's expressions in
//! order (a match and the text between two matches each a piece, empty pieces dropped: `Split`
//! with `Isolated`), and each piece's ids are taken from the encoder's cache of pieces, or
//! else its bytes are mapped to the byte-level alphabet and the BPE model gives them. The tests
//! check the ids against `tokenizers`' own pipeline on random texts for every family.
//!
//! The expressions run on a DFA (`regex-automata`), not on fancy-regex's backtracking machine
//! (which `tokenizers` uses, and which took two fifths of the time of encoding): their one
//! look-around, `\s+(?!\S)`, is rewritten. Greedy, it matches a run of whitespace whole at the
//! end of the text and, before anything else, the run less its last character (which must be
//! whitespace, so the run has two or more) — exactly what `\s+\s` matches, less its last
//! character unless it ends the text. The expression is compiled as several patterns in its
//! order of alternatives (the DFA's leftmost-first priority among patterns is that of
//! alternation), so a match says which alternative it is.

use std::sync::{Mutex, PoisonError, RwLock};

use rustc_hash::FxHashMap;
use tokenizers::models::bpe::BPE;
use tokenizers::{AddedToken, Model};

use crate::pre_tokenizer::PreTokenizer;

/// How many pieces' ids are kept (`tokenizers`' BPE keeps as many words), and the longest
/// piece kept, in bytes.
const CACHE_PIECES: usize = 10_000;
const CACHE_PIECE_BYTES: usize = 256;

/// The byte-level BPE encoder of one vocabulary.
pub(crate) struct ByteBpe {
    /// The model and the added tokens (and, in tests, the reference pipeline).
    inner: tokenizers::Tokenizer,
    /// The added tokens, cut out first.
    added: AddedTokens,
    /// The pre-tokenizer's expressions, applied in order.
    splitters: Vec<Splitter>,
    /// Each byte's character in the byte-level alphabet.
    alphabet: [char; 256],
    /// Pieces met before and their ids: the model's answer is a function of the piece alone,
    /// and asking it builds a `String` per token.
    cache: RwLock<FxHashMap<Box<str>, Box<[u32]>>>,
    /// The expressions' search caches, a set per encoding at once: taken once per text (the
    /// regex's own pool is asked once per match otherwise).
    scratch: Mutex<Vec<Vec<regex_automata::meta::Cache>>>,
}

impl ByteBpe {
    /// The encoder of `model` with `pre`'s expressions and `specials` as added tokens.
    pub(crate) fn new(
        model: BPE,
        pre: &PreTokenizer,
        specials: &[AddedToken],
    ) -> Result<Self, tokenizers::Error> {
        let mut inner = tokenizers::Tokenizer::new(model);
        // The whole pipeline only as the tests' reference: encoding splits by `splitters`.
        #[cfg(test)]
        inner.with_pre_tokenizer(Some(pre.build()?));
        inner.add_special_tokens(specials.to_vec())?;
        let added = AddedTokens::new(&inner, specials)?;
        let splitters = pre.regexes().iter().map(|r| Splitter::new(r)).collect::<Result<_, _>>()?;
        Ok(Self {
            inner,
            added,
            splitters,
            alphabet: byte_level_alphabet(),
            cache: RwLock::default(),
            scratch: Mutex::default(),
        })
    }

    /// Appends `text`'s ids to `ids`.
    pub(crate) fn encode(&self, text: &str, ids: &mut Vec<u32>) -> Result<(), tokenizers::Error> {
        let mut cut = Vec::new();
        self.added.cut(text, 0, &mut cut);
        let mut pieces = Vec::new();
        let mut next = Vec::new();
        let mut mapped = String::new();
        let mut fresh = Vec::new();
        let pooled = self.scratch.lock().unwrap_or_else(PoisonError::into_inner).pop();
        let mut scratch =
            pooled.unwrap_or_else(|| self.splitters.iter().map(|s| s.re.create_cache()).collect());
        let cache = self.cache.read().unwrap_or_else(PoisonError::into_inner);
        for run in cut {
            let run = match run {
                Cut::Token(id) => {
                    ids.push(id);
                    continue;
                }
                Cut::Text(run) => run,
            };
            pieces.clear();
            pieces.push(run);
            for (splitter, search) in self.splitters.iter().zip(&mut scratch) {
                next.clear();
                for piece in &pieces {
                    splitter.split_isolated(search, piece, &mut next);
                }
                std::mem::swap(&mut pieces, &mut next);
            }
            for &piece in &pieces {
                if let Some(known) = cache.get(piece) {
                    ids.extend_from_slice(known);
                    continue;
                }
                mapped.clear();
                mapped.extend(piece.bytes().map(|b| self.alphabet[usize::from(b)]));
                let from = ids.len();
                ids.extend(self.inner.get_model().tokenize(&mapped)?.iter().map(|t| t.id));
                if piece.len() <= CACHE_PIECE_BYTES && cache.len() + fresh.len() < CACHE_PIECES {
                    fresh.push((Box::<str>::from(piece), Box::<[u32]>::from(&ids[from..])));
                }
            }
        }
        drop(cache);
        self.scratch.lock().unwrap_or_else(PoisonError::into_inner).push(scratch);
        if !fresh.is_empty() {
            let mut cache = self.cache.write().unwrap_or_else(PoisonError::into_inner);
            let room = CACHE_PIECES.saturating_sub(cache.len());
            cache.extend(fresh.into_iter().take(room));
        }
        Ok(())
    }
}

/// A stretch of text, or an added token cut out of it.
enum Cut<'a> {
    Text(&'a str),
    Token(u32),
}

/// The added tokens, cut out of a text as `tokenizers`' added vocabulary cuts them
/// (`extract_and_normalize`, without its alignments): the control tokens first, leftmost and
/// then longest, then the user-defined ones in the text between them. GGUF's added tokens strip
/// no spaces and match inside words, and there is no normalizer.
struct AddedTokens {
    /// Each phase's matcher and its patterns' ids.
    phases: Vec<(aho_corasick::AhoCorasick, Vec<u32>)>,
}

impl AddedTokens {
    fn new(inner: &tokenizers::Tokenizer, specials: &[AddedToken]) -> Result<Self, String> {
        let mut phases = Vec::new();
        // Control tokens are not normalized, user-defined ones are (`AddedToken::from`).
        for normalized in [false, true] {
            let mut seen = std::collections::HashSet::new();
            let (mut patterns, mut ids) = (Vec::new(), Vec::new());
            for t in specials.iter().filter(|t| t.normalized == normalized) {
                if t.single_word || t.lstrip || t.rstrip {
                    return Err(format!("added token {:?} has matching options", t.content));
                }
                if t.content.is_empty() || !seen.insert(t.content.as_str()) {
                    continue;
                }
                let id = inner.token_to_id(&t.content).ok_or("an added token has no id")?;
                patterns.push(t.content.as_str());
                ids.push(id);
            }
            if patterns.is_empty() {
                continue;
            }
            let matcher = aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(&patterns)
                .map_err(|e| format!("added tokens: {e}"))?;
            phases.push((matcher, ids));
        }
        Ok(Self { phases })
    }

    /// `text` cut by the phases from `phase` on, non-empty stretches only.
    fn cut<'a>(&self, text: &'a str, phase: usize, out: &mut Vec<Cut<'a>>) {
        if text.is_empty() {
            return;
        }
        let Some((matcher, ids)) = self.phases.get(phase) else {
            out.push(Cut::Text(text));
            return;
        };
        let mut prev = 0;
        for m in matcher.find_iter(text) {
            self.cut(&text[prev..m.start()], phase + 1, out);
            out.push(Cut::Token(ids[m.pattern().as_usize()]));
            prev = m.end();
        }
        self.cut(&text[prev..], phase + 1, out);
    }
}

/// The one look-around the pre-tokenizers use, and what it is compiled as (module doc).
const LOOKAHEAD: &str = r"\s+(?!\S)";
const LOOKAHEAD_AS: &str = r"\s+\s";

/// One pre-tokenizer expression on a DFA.
struct Splitter {
    re: regex_automata::meta::Regex,
    /// The pattern standing for [`LOOKAHEAD`], if the expression has it.
    lookahead: Option<regex_automata::PatternID>,
}

impl Splitter {
    /// `expr` compiled; [`LOOKAHEAD`] is taken only as one of its top-level alternatives, and
    /// any other look-around is refused (the DFA's syntax has none).
    fn new(expr: &str) -> Result<Self, tokenizers::Error> {
        let mut patterns = Vec::new();
        let mut lookahead = None;
        match expr.split_once(&format!("|{LOOKAHEAD}")) {
            Some((before, after)) => {
                patterns.push(before);
                lookahead = Some(regex_automata::PatternID::must(1));
                patterns.push(LOOKAHEAD_AS);
                if !after.is_empty() {
                    let rest = after.strip_prefix('|').ok_or_else(|| {
                        format!("{LOOKAHEAD} is not an alternative of its own in {expr}")
                    })?;
                    patterns.push(rest);
                }
            }
            None => patterns.push(expr),
        }
        let re = regex_automata::meta::Regex::new_many(&patterns)
            .map_err(|e| format!("pre-tokenizer expression {expr}: {e}"))?;
        Ok(Self { re, lookahead })
    }

    /// `text` split: each match and each stretch between matches a piece, empty ones dropped.
    fn split_isolated<'a>(
        &self,
        search: &mut regex_automata::meta::Cache,
        text: &'a str,
        out: &mut Vec<&'a str>,
    ) {
        let mut prev = 0;
        let mut at = 0;
        while at <= text.len() {
            // Most of a text is matches end to end: a match starting where the last ended is
            // found by a forward scan alone (the leftmost-first match, as it starts leftmost);
            // only a gap asks the unanchored search, which also scans back for the start.
            let input = regex_automata::Input::new(text).range(at..);
            let anchored = input.clone().anchored(regex_automata::Anchored::Yes);
            let found = self.re.search_with(search, &anchored);
            let Some(m) = found.or_else(|| self.re.search_with(search, &input)) else {
                break;
            };
            let mut end = m.end();
            if Some(m.pattern()) == self.lookahead && end < text.len() {
                // Less the run's last character, which the look-ahead leaves for the next match.
                end = text[..end].char_indices().next_back().map_or(end, |(i, _)| i);
            }
            if prev < m.start() {
                out.push(&text[prev..m.start()]);
            }
            if m.start() < end {
                out.push(&text[m.start()..end]);
                at = end;
            } else {
                // An empty match: search on from the next character.
                at = end + text[end..].chars().next().map_or(1, char::len_utf8);
            }
            prev = end;
        }
        if prev < text.len() {
            out.push(&text[prev..]);
        }
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
