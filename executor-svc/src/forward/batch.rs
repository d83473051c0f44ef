//! What a forward runs over: each sequence's part of a batch ([`SeqSlice`]), and the checks a
//! batch passes before anything is written ([`check_tokens`], [`check_geometry`]); the errors
//! name the sequence at fault. Every backend checks its batches with these.

use std::collections::HashMap;

use ferry_model::lora::LoraAdapter;

/// One sequence's part of a batch.
#[derive(Clone, Copy, Debug)]
pub struct SeqSlice<'a> {
    /// Tokens computed this step.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` (tokens before it are already in the cache).
    pub start: usize,
    /// Where the sequence's positions live: block `i` holds `[i·bs, (i+1)·bs)`.
    pub block_table: &'a [u32],
    /// Return the logits of this many of its last tokens: 1 for a sequence that samples, all
    /// of them to score a prompt chunk, 0 for none.
    pub logits: usize,
    /// The LoRA adapter its projections add (see `lora`); `None`: the base model's.
    pub adapter: Option<&'a LoraAdapter>,
}

impl<'a> SeqSlice<'a> {
    /// A sequence of the base model (no adapter).
    #[must_use]
    pub fn base(tokens: &'a [u32], start: usize, block_table: &'a [u32], logits: usize) -> Self {
        Self { tokens, start, block_table, logits, adapter: None }
    }
}

/// A batch the cache cannot serve as asked. Checked before anything is written.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BatchError {
    /// A token id past the vocabulary.
    #[error("sequence {seq}: token id {token} is outside the vocabulary (size {vocab})")]
    Token {
        /// Index in the batch.
        seq: usize,
        /// The id.
        token: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A sequence with nothing to compute.
    #[error("sequence {seq}: no tokens to compute")]
    Empty {
        /// Index in the batch.
        seq: usize,
    },
    /// Logits asked for more rows than the sequence computes.
    #[error("sequence {seq}: logits of {logits} rows asked for, it computes {rows}")]
    TooManyLogits {
        /// Index in the batch.
        seq: usize,
        /// Rows asked for.
        logits: usize,
        /// Rows it computes.
        rows: usize,
    },
    /// Positions past what the block table covers, or past the model's length.
    #[error("sequence {seq}: positions up to {end} need {needed} blocks, its table has {have}")]
    TableTooShort {
        /// Index in the batch.
        seq: usize,
        /// One past the last position.
        end: usize,
        /// Blocks needed.
        needed: usize,
        /// Blocks in the table.
        have: usize,
    },
    /// A block id outside the pool.
    #[error("sequence {seq}: block {block} is out of range (pool has {num_blocks} blocks)")]
    BlockOutOfRange {
        /// Index in the batch.
        seq: usize,
        /// The id.
        block: u32,
        /// Pool size.
        num_blocks: usize,
    },
    /// The backend cannot run this batch (a looped model's stage on a backend without them).
    #[error("{0}")]
    Unsupported(&'static str),
    /// A block written by one sequence is also in another's table.
    #[error("block {block} is written by sequence {writer} but also held by sequence {other}")]
    SharedWrite {
        /// The block.
        block: u32,
        /// The sequence writing it.
        writer: usize,
        /// Another sequence holding it.
        other: usize,
    },
}

impl BatchError {
    /// The sequence at fault (for a shared block, the one writing it).
    pub fn sequence(&self) -> Option<usize> {
        match self {
            Self::Token { seq, .. }
            | Self::Empty { seq }
            | Self::TooManyLogits { seq, .. }
            | Self::TableTooShort { seq, .. }
            | Self::BlockOutOfRange { seq, .. } => Some(*seq),
            Self::SharedWrite { writer, .. } => Some(*writer),
            Self::Unsupported(_) => None,
        }
    }
}

/// Checks each sequence's tokens: some, in the vocabulary, and no more logit rows than
/// tokens (all a batch that touches no KV needs, a looped model's layer-less stage).
pub fn check_tokens(vocab_size: usize, batch: &[SeqSlice]) -> Result<(), BatchError> {
    for (seq, s) in batch.iter().enumerate() {
        if s.tokens.is_empty() {
            return Err(BatchError::Empty { seq });
        }
        if s.logits > s.tokens.len() {
            return Err(BatchError::TooManyLogits { seq, logits: s.logits, rows: s.tokens.len() });
        }
        if let Some(&token) = s.tokens.iter().find(|t| **t as usize >= vocab_size) {
            return Err(BatchError::Token { seq, token, vocab: vocab_size });
        }
    }
    Ok(())
}

/// Checks `batch` against a vocabulary and a block pool: its tokens ([`check_tokens`]), table
/// coverage, block range, and that no block written by one sequence is held by another.
pub fn check_geometry(
    vocab_size: usize,
    bs: usize,
    num_blocks: usize,
    batch: &[SeqSlice],
) -> Result<(), BatchError> {
    check_tokens(vocab_size, batch)?;
    let mut writer_of: HashMap<u32, usize> = HashMap::new();
    for (seq, s) in batch.iter().enumerate() {
        let end = s.start + s.tokens.len();
        let needed = end.div_ceil(bs);
        if needed > s.block_table.len() {
            return Err(BatchError::TableTooShort { seq, end, needed, have: s.block_table.len() });
        }
        if let Some(&block) = s.block_table.iter().find(|b| **b as usize >= num_blocks) {
            return Err(BatchError::BlockOutOfRange { seq, block, num_blocks });
        }
        for i in s.start / bs..needed {
            let block = s.block_table[i];
            if let Some(&other) = writer_of.get(&block) {
                if other != seq {
                    return Err(BatchError::SharedWrite { block, writer: seq, other });
                }
            }
            writer_of.insert(block, seq);
        }
    }
    for (seq, s) in batch.iter().enumerate() {
        for block in s.block_table {
            if let Some(&writer) = writer_of.get(block) {
                if writer != seq {
                    return Err(BatchError::SharedWrite { block: *block, writer, other: seq });
                }
            }
        }
    }
    Ok(())
}
