//! A batch flattened into the per-row arrays the GPU kernels read. Pure host code: it is the
//! whole of the CUDA forward's bookkeeping, so it is tested without a GPU.
//!
//! Rows are the batch's tokens in batch order (sequence 0's tokens, then sequence 1's, …), as
//! in the CPU forward. Each row knows its position and where its sequence's block table starts
//! in one concatenated table array, which is all the KV write and the attention need. Positions
//! and offsets are 64-bit, so no batch that passed validation can overflow them.

use crate::forward::paged::SeqSlice;

/// The device-side description of one batch.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BatchPlan {
    /// Token id of each row.
    pub tokens: Vec<u32>,
    /// Position of each row in its sequence.
    pub positions: Vec<u64>,
    /// For each row, where its sequence's block table starts in [`Self::tables`].
    pub row_table: Vec<u64>,
    /// Every sequence's block table, one after the other, in batch order.
    pub tables: Vec<u32>,
    /// For each sequence that wants logits, in batch order: the row of its last token.
    pub logit_rows: Vec<u32>,
}

/// The batch has more rows than the kernels index (`int`): over two billion tokens.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("a batch of {rows} tokens is more than the CUDA backend indexes ({max})")]
pub struct TooManyRows {
    /// Rows asked for.
    pub rows: usize,
    /// The limit.
    pub max: usize,
}

impl BatchPlan {
    /// Flattens a batch that has passed [`crate::forward::paged::check_geometry`].
    pub fn new(batch: &[SeqSlice]) -> Result<Self, TooManyRows> {
        let rows: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let max = i32::MAX as usize;
        if rows > max {
            return Err(TooManyRows { rows, max });
        }
        let mut plan = Self {
            tokens: Vec::with_capacity(rows),
            positions: Vec::with_capacity(rows),
            row_table: Vec::with_capacity(rows),
            tables: Vec::with_capacity(batch.iter().map(|s| s.block_table.len()).sum()),
            logit_rows: Vec::new(),
        };
        for s in batch {
            let table_start = plan.tables.len() as u64;
            plan.tables.extend_from_slice(s.block_table);
            for (i, &t) in s.tokens.iter().enumerate() {
                plan.tokens.push(t);
                plan.positions.push((s.start + i) as u64);
                plan.row_table.push(table_start);
            }
            // `rows <= i32::MAX` was checked above, so the row indices fit.
            let end = plan.tokens.len();
            plan.logit_rows.extend((end - s.logits.min(end)..end).map(|r| r as u32));
        }
        Ok(plan)
    }

    /// Rows (tokens) in the batch.
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_follow_batch_order_with_their_positions_tables_and_logit_rows() {
        let batch = [
            // A prefill chunk continuing at position 5, sampling.
            SeqSlice {
                tokens: &[7, 8, 9],
                start: 5,
                block_table: &[3, 1],
                logits: 1,
                adapter: None,
            },
            // A chunk that does not finish its prompt: no logits.
            SeqSlice { tokens: &[4, 4], start: 0, block_table: &[0], logits: 0, adapter: None },
            // A decode.
            SeqSlice {
                tokens: &[2],
                start: 12,
                block_table: &[6, 2, 5, 4],
                logits: 1,
                adapter: None,
            },
        ];
        let plan = BatchPlan::new(&batch).unwrap();
        assert_eq!(plan.tokens, [7, 8, 9, 4, 4, 2]);
        assert_eq!(plan.positions, [5, 6, 7, 0, 1, 12]);
        assert_eq!(plan.tables, [3, 1, 0, 6, 2, 5, 4]);
        assert_eq!(plan.row_table, [0, 0, 0, 2, 2, 3]);
        assert_eq!(plan.logit_rows, [2, 5]);
        assert_eq!(plan.rows(), 6);
    }

    #[test]
    fn a_batch_without_sampling_has_no_logit_rows() {
        let batch =
            [SeqSlice { tokens: &[1, 2], start: 0, block_table: &[0], logits: 0, adapter: None }];
        let plan = BatchPlan::new(&batch).unwrap();
        assert!(plan.logit_rows.is_empty());
        assert_eq!(plan.rows(), 2);
    }
}
