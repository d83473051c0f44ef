//! SentencePiece vocabularies as llama.cpp encodes them (`tokenizer.ggml.model = llama`:
//! Llama 2, Mistral, Phi-3, Gemma): a space before the text (`add_space_prefix`) and after each
//! special token, spaces as `▁`, then the text's characters merged pair by pair — always the
//! adjacent pair whose concatenation is the vocabulary's highest-scored token, the leftmost on
//! a tie — until no pair is a token; a character left that is no token becomes its UTF-8 bytes'
//! `<0xXX>` tokens (byte fallback). This is SentencePiece's BPE encoding, and llama.cpp's
//! `llm_tokenizer_spm_session`.

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap};

/// The space SentencePiece writes as `▁` (U+2581).
pub(crate) const SPACE: char = '\u{2581}';

/// A SentencePiece vocabulary: each piece's id and score, and the byte tokens.
#[derive(Debug)]
pub(crate) struct Spm {
    /// Piece text (spaces as `▁`) to id; the first id where a text repeats.
    ids: HashMap<String, u32>,
    /// Each id's score (higher merges first).
    scores: Vec<f32>,
    /// `<0xXX>`'s id for each byte, where the vocabulary has it.
    bytes: [Option<u32>; 256],
    /// The unknown token, for a byte with no token of its own.
    unknown: Option<u32>,
}

/// One symbol of the text being merged: bytes `at .. at + len` (0 once merged into its left
/// neighbour), and its neighbours in the chain.
#[derive(Clone, Copy)]
struct Symbol {
    at: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of `left` and `right`, `len` bytes together, ordered by score then by the
/// leftmost position.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Bigram {
    /// The greater bigram merges first: the higher score, then the smaller `left`.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| Reverse(self.left).cmp(&Reverse(other.left)))
    }
}

impl Spm {
    /// The vocabulary of `tokens` (as GGUF stores them) with their `scores`; `unknown` is the
    /// unknown token's id, if any.
    pub(crate) fn new(tokens: &[String], scores: Vec<f32>, unknown: Option<u32>) -> Self {
        let mut ids = HashMap::with_capacity(tokens.len());
        for (id, t) in tokens.iter().enumerate() {
            ids.entry(t.clone()).or_insert(id as u32);
        }
        let mut bytes = [None; 256];
        for (b, slot) in bytes.iter_mut().enumerate() {
            *slot = ids.get(&format!("<0x{b:02X}>")).copied();
        }
        Self { ids, scores, bytes, unknown }
    }

    /// The byte a `<0xXX>` token stands for.
    pub(crate) fn byte_of(token: &str) -> Option<u8> {
        let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
        (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
    }

    /// Appends the ids of `text`, a run of text between special tokens (`space_first`: after
    /// the start or a special token, where a space is prefixed when the vocabulary asks).
    pub(crate) fn encode(&self, text: &str, space_first: bool, out: &mut Vec<u32>) {
        let mut escaped = String::with_capacity(text.len() + 3);
        if space_first {
            escaped.push(SPACE);
        }
        escaped.extend(text.chars().map(|c| if c == ' ' { SPACE } else { c }));
        let text = escaped.as_str();
        let mut symbols: Vec<Symbol> = Vec::new();
        for (i, (at, c)) in text.char_indices().enumerate() {
            let len = c.len_utf8();
            let next = (at + len < text.len()).then_some(i + 1);
            symbols.push(Symbol { at, len, prev: i.checked_sub(1), next });
        }
        let mut queue = BinaryHeap::new();
        let candidate = |symbols: &[Symbol], left: Option<usize>, right: Option<usize>| {
            let (left, right) = (left?, right?);
            let (l, r) = (symbols[left], symbols[right]);
            let id = *self.ids.get(&text[l.at..l.at + l.len + r.len])?;
            let score = *self.scores.get(id as usize)?;
            Some(Bigram { score, left, right, len: l.len + r.len })
        };
        for i in 1..symbols.len() {
            queue.extend(candidate(&symbols, Some(i - 1), Some(i)));
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            // Stale: one side already merged elsewhere.
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue;
            }
            symbols[b.left].len += r.len;
            symbols[b.right].len = 0;
            symbols[b.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(b.left);
            }
            queue.extend(candidate(&symbols, symbols[b.left].prev, Some(b.left)));
            queue.extend(candidate(&symbols, Some(b.left), symbols[b.left].next));
        }
        let mut at = (!symbols.is_empty()).then_some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.at..s.at + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                // A character no token covers: its bytes.
                None => out
                    .extend(piece.bytes().filter_map(|b| self.bytes[b as usize].or(self.unknown))),
            }
            at = s.next;
        }
    }
}
