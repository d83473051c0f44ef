//! Parallel sampling at admission (see [`crate::Fork`]): whether a sample of several waits for
//! its source's prompt KV, and how it forks from it — a reference to each of the source's full
//! blocks of that KV and a copy of the partial block after them.
//!
//! Invariant kept: a sample forks only from a live, unfinished source that is still the request
//! it was added with (the same prompt allocation: an id can be reused once its request
//! retires) and that computed its prompt but the last token in an earlier step, not in the one
//! being built.

use std::sync::Arc;

use crate::request::RequestStatus;
use crate::types::{BlockId, RequestId};

use super::Scheduler;

impl Scheduler {
    /// A sample of several that has never run waits while its source runs and has not yet
    /// computed its prompt (but the last token) in an earlier step: it will fork from that KV.
    /// It waits for nothing else: not for a source that waits itself (it may be queued behind
    /// the sample, or preempted), finished or retired.
    pub(super) fn awaits_fork(&self, idx: u32) -> bool {
        let r = &self.requests[idx];
        let Some(source) = r.cold.fork_of else { return false };
        if r.cold.times.first_scheduled.is_some() || r.prompt.len() < 2 {
            return false;
        }
        self.fork_source(idx, source).is_some_and(|s| {
            self.requests[s].status == RequestStatus::Active
                && self.computed_before_step(s) < r.prompt.len() - 1
        })
    }

    /// The live, unfinished source `idx` forks from, if it is still the request it was added
    /// with (the same prompt allocation: an id can be reused once its request retires).
    fn fork_source(&self, idx: u32, source: RequestId) -> Option<u32> {
        let s = self.requests.index_of(source)?;
        let (r, src) = (&self.requests[idx], &self.requests[s]);
        (Arc::ptr_eq(&r.prompt, &src.prompt) && !src.status.is_finished()).then_some(s)
    }

    /// Tokens of `idx` computed by steps before the one being built.
    fn computed_before_step(&self, idx: u32) -> usize {
        let r = &self.requests[idx];
        if self.scheduled_in_build(idx) {
            r.num_computed - self.draft.work_at(r.sched_index).num_tokens
        } else {
            r.num_computed
        }
    }

    /// How a sample of several that holds no KV forks from its source now, if it can: the
    /// source computed the prompt but its last token in an earlier step and still holds it.
    pub(super) fn fork_point(&self, idx: u32) -> Option<ForkPlan> {
        let r = &self.requests[idx];
        let point = r.prompt.len().checked_sub(1).filter(|&p| p > 0)?;
        let source = self.fork_source(idx, r.cold.fork_of?)?;
        let s = &self.requests[source];
        if self.computed_before_step(source) < point
            || s.block_table.len() * self.cfg.block_size < point
        {
            return None;
        }
        let bs = self.cfg.block_size;
        let shared = point / bs;
        let copy = (point % bs != 0).then(|| s.block_table[shared]);
        Some(ForkPlan { source, shared, copy })
    }

    /// Start `idx`'s table with a reference to each of its source's shared full blocks.
    pub(super) fn take_fork(&mut self, idx: u32, fork: ForkPlan) {
        debug_assert!(self.requests[idx].block_table.is_empty(), "a fork only starts a table");
        for i in 0..fork.shared {
            let b = self.requests[fork.source].block_table[i];
            self.pool.touch(b);
            self.requests[idx].block_table.push(b);
        }
        let registered = self.requests[fork.source].registered().min(fork.shared);
        let r = &mut self.requests[idx];
        r.num_computed = r.prompt.len() - 1;
        r.set_registered(registered);
        r.cold.fork_of = None;
        self.counters.forks += 1;
        self.counters.fork_shared_blocks += fork.shared as u64;
    }
}

/// How a sample forks from its source: the source's first `shared` blocks are shared, and its
/// block `copy` (partly filled with the forked KV), if any, is copied into a new block.
#[derive(Debug, Clone, Copy)]
pub(super) struct ForkPlan {
    /// The source's arena entry.
    pub(super) source: u32,
    /// Full blocks shared.
    pub(super) shared: usize,
    /// The source's partial block after them.
    pub(super) copy: Option<BlockId>,
}
