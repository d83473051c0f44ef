//! Block fences: KV blocks released while a built-but-unapplied step may still read or write
//! them, held back from the pool until that step's result is applied.
//!
//! Why: with asynchronous scheduling the executor may be running step N while the core builds
//! step N+1. A request preempted, aborted or reclaimed in between gives up blocks step N still
//! uses; if they went straight back to the pool, step N+1 could hand them to another request
//! and the executor would overwrite KV that step N reads. So such blocks wait in a bucket named
//! by the last step that referenced their request, and the bucket is emptied into the pool when
//! that step's result is applied ([`BlockFences::lift_through`]).
//!
//! Lifetime: a bucket lives from the first release behind step N until step N's result is
//! applied. Bucket vectors are recycled, so fencing allocates only while the number of steps in
//! flight grows past what it has been.
//!
//! Invariants kept (see [`BlockFences::check`]): buckets are ordered by step, one per step, and
//! none is empty; `fenced` is the number of blocks in all buckets; recycled vectors are empty.
//! Each fenced block holds one reference in the pool (checked with the block tables by
//! `check_invariants`), and every bucket's step is in flight.

use std::collections::VecDeque;

use crate::block_pool::BlockPool;
use crate::types::{BlockId, StepId};

/// Blocks waiting for the step that may use them to be applied, grouped by that step.
#[derive(Debug, Default)]
pub(crate) struct BlockFences {
    /// One bucket per step, ordered by step (lifted from the front).
    buckets: VecDeque<(StepId, Vec<BlockId>)>,
    /// Blocks in all buckets.
    fenced: usize,
    /// Emptied bucket vectors, kept for the next bucket.
    spare: Vec<Vec<BlockId>>,
}

impl BlockFences {
    /// Blocks behind a fence (they become free once their step is applied).
    #[inline]
    pub(crate) fn fenced(&self) -> usize {
        self.fenced
    }

    /// Hold `blocks` until the result of `step` is applied.
    pub(crate) fn hold(&mut self, step: StepId, blocks: impl Iterator<Item = BlockId>) {
        let pos = match self.buckets.iter().position(|(s, _)| *s >= step) {
            Some(p) if self.buckets[p].0 == step => p,
            Some(p) => {
                let v = self.spare.pop().unwrap_or_default();
                self.buckets.insert(p, (step, v));
                p
            }
            None => {
                let v = self.spare.pop().unwrap_or_default();
                self.buckets.push_back((step, v));
                self.buckets.len() - 1
            }
        };
        let bucket = &mut self.buckets[pos].1;
        let before = bucket.len();
        bucket.extend(blocks);
        self.fenced += bucket.len() - before;
        debug_assert!(!bucket.is_empty(), "a fence holds at least one block");
    }

    /// Return the blocks of every step up to `step` to `pool` (its result was applied).
    pub(crate) fn lift_through(&mut self, step: StepId, pool: &mut BlockPool) {
        while let Some((s, _)) = self.buckets.front() {
            if *s > step {
                break;
            }
            let (_, mut blocks) = self.buckets.pop_front().expect("front exists");
            for &b in &blocks {
                pool.release(b);
            }
            self.fenced -= blocks.len();
            blocks.clear();
            self.spare.push(blocks);
        }
    }

    /// Every fenced block, with the step it waits for.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (StepId, BlockId)> + '_ {
        self.buckets.iter().flat_map(|(s, blocks)| blocks.iter().map(move |&b| (*s, b)))
    }

    /// Verify the fences' own invariants.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut total = 0;
        for (i, (step, blocks)) in self.buckets.iter().enumerate() {
            if blocks.is_empty() {
                return Err(format!("fence bucket of {step} is empty"));
            }
            if i > 0 && self.buckets[i - 1].0 >= *step {
                return Err(format!("fence bucket of {step} out of step order"));
            }
            total += blocks.len();
        }
        if total != self.fenced {
            return Err(format!("fence buckets hold {total} blocks, counter {}", self.fenced));
        }
        if self.spare.iter().any(|v| !v.is_empty()) {
            return Err("a recycled fence vector still holds blocks".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_stay_in_step_order_and_lift_in_order() {
        let mut pool = BlockPool::new(8, false);
        let mut got = Vec::new();
        assert!(pool.allocate(4, &mut got));
        let mut f = BlockFences::default();
        f.hold(StepId(3), [got[0]].into_iter());
        f.hold(StepId(2), [got[1], got[2]].into_iter());
        f.hold(StepId(3), [got[3]].into_iter());
        assert_eq!(f.fenced(), 4);
        assert_eq!(f.iter().map(|(s, _)| s.0).collect::<Vec<_>>(), [2, 2, 3, 3]);
        f.check().unwrap();
        f.lift_through(StepId(2), &mut pool);
        assert_eq!((f.fenced(), pool.num_free()), (2, 6));
        f.lift_through(StepId(5), &mut pool);
        assert_eq!((f.fenced(), pool.num_free()), (0, 8));
        f.check().unwrap();
    }
}
