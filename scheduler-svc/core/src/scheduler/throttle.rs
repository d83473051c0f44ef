//! The prefill throttle of data-parallel groups (vLLM's `defer_prefills`): on a step the group
//! marks as throttled, the core runs its decodes and holds prefills back — the prompt work of
//! running requests and the admission of waiting ones — so a rank still prefilling does not
//! hold up ranks that only decode (every rank of a group steps together).
//!
//! Rule, computed once per step (vLLM v1 `Scheduler.schedule`):
//! `defer = throttle && !capacity_bound && some running request decodes`; after every step
//! that did not defer, `capacity_bound = some request still waits`. A backlog means prefill
//! capacity is the bottleneck, and holding prefills back would only idle the device; with no
//! decode to protect there is nothing to hold them back for.

use super::Scheduler;
use crate::work_queues::WorkKey;

/// What the throttle remembers between steps.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct PrefillThrottle {
    /// The last step that did not defer left requests waiting: prefill capacity is the
    /// bottleneck, so prefills are not deferred.
    capacity_bound: bool,
}

impl Scheduler {
    /// Whether this step defers prefills, given the group's `throttle` for it; counted as
    /// deferred when it holds something back (prompt work queued, or requests waiting).
    pub(super) fn defers_prefills(&mut self, throttle: bool) -> bool {
        let defer = throttle && !self.throttle.capacity_bound && self.any_decoding();
        if defer && (self.prompt_work_pending() || self.waiting.len() > 0) {
            self.counters.prefills_deferred += 1;
        }
        defer
    }

    /// After a step that did not defer: whether requests are still waiting.
    pub(super) fn note_prefill_capacity(&mut self, deferred: bool) {
        if !deferred {
            self.throttle.capacity_bound = self.waiting.len() > 0;
        }
    }

    /// Some running request has prompt work queued.
    fn prompt_work_pending(&self) -> bool {
        self.work.len(WorkKey::Prompt) + self.work.len(WorkKey::PromptChunk) > 0
    }

    /// Some running request is past its prompt (every known token but the last computed).
    fn any_decoding(&self) -> bool {
        self.active.iter().any(|&idx| {
            let r = &self.requests[idx];
            r.num_computed + 1 >= r.num_tokens()
        })
    }

    /// Whether the last step that did not defer left requests waiting (the throttle's
    /// override; for tests and views).
    #[must_use]
    pub fn prefill_capacity_bound(&self) -> bool {
        self.throttle.capacity_bound
    }
}
