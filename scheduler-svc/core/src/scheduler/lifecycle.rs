//! A request's hold on execution resources over its life: a slot from admission
//! (`activate`) until it gives it up (`deactivate_to_waiting`: preemption or a yield) or
//! retires (`try_retire`), and its LoRA adapter, which the executor holds from the request's
//! first admission until it retires (preempted requests stay on the executor, adapter and all).
//!
//! With `max_loras`, a request that would make the executor hold one adapter more than that
//! waits (`Decision::LoraWait`), as vLLM's scheduler keeps a request of a new adapter waiting
//! while `max_loras` others run; later requests of held adapters (or none) may go first. The
//! executor then never has to refuse a request for want of room for its adapter.

use std::collections::HashMap;

use crate::request::RequestStatus;
use crate::types::Timestamp;

use super::Scheduler;

/// Requests by LoRA adapter (adapter 0, none, is not counted).
#[derive(Debug, Default)]
pub(super) struct AdapterCounts(HashMap<u64, u32>);

impl AdapterCounts {
    fn add(&mut self, adapter: u64) {
        if adapter != 0 {
            *self.0.entry(adapter).or_default() += 1;
        }
    }

    fn remove(&mut self, adapter: u64) {
        if adapter == 0 {
            return;
        }
        let n = self.0.get_mut(&adapter).expect("an adapter's request counted out twice");
        *n -= 1;
        if *n == 0 {
            self.0.remove(&adapter);
        }
    }

    /// The adapters, each with its requests.
    pub(super) fn counts(&self) -> &HashMap<u64, u32> {
        &self.0
    }

    /// The adapters, sorted.
    fn sorted(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.0.keys().copied().collect();
        ids.sort_unstable();
        ids
    }
}

/// The LoRA adapters of the live requests: those the executor holds (for the requests admitted
/// at least once: it knows them) and those of requests not admitted yet.
#[derive(Debug, Default)]
pub(super) struct HeldAdapters {
    pub(super) held: AdapterCounts,
    pub(super) waiting: AdapterCounts,
}

impl HeldAdapters {
    /// A request of `adapter` arrived.
    pub(super) fn arrive(&mut self, adapter: u64) {
        self.waiting.add(adapter);
    }
}

impl Scheduler {
    /// Whether waiting request `idx` must wait for its adapter: it has never run, the executor
    /// does not hold its adapter, and holds `max_loras` others.
    pub(super) fn awaits_adapter(&self, idx: u32) -> bool {
        let max = self.cfg.max_loras;
        if max == 0 {
            return false; // without a limit, admission never reads the request's cold part
        }
        let r = &self.requests[idx];
        let adapter = r.cold.adapter;
        adapter != 0
            && r.cold.times.first_scheduled.is_none()
            && !self.adapters.held.0.contains_key(&adapter)
            && self.adapters.held.0.len() >= max
    }

    /// The LoRA adapters the executor holds for requests now (vLLM's running adapters), and
    /// those of requests waiting for their first admission (its waiting adapters), each
    /// sorted; with `max_loras`, the first has at most that many.
    pub fn lora_adapters(&self) -> (Vec<u64>, Vec<u64>) {
        (self.adapters.held.sorted(), self.adapters.waiting.sorted())
    }

    /// Retire a finished request once nothing references it: release its slot, free its entry,
    /// make its id reusable.
    pub(super) fn try_retire(&mut self, idx: u32) {
        let r = &self.requests[idx];
        if !r.status.is_finished() {
            return; // the usual case, decided by line 1 alone
        }
        let reported = r.finish_reported || !r.exec.known;
        if !reported || r.inflight_refs > 0 || r.cold.transfer.is_some() {
            return;
        }
        debug_assert!(r.block_table.is_empty(), "retiring {} with blocks: leak", r.id);
        debug_assert!(
            self.work.pending(idx).is_none() && !self.waiting.contains(idx),
            "retiring {} still queued",
            r.id
        );
        if r.has_slot {
            self.slots.release();
        }
        if r.cold.times.first_scheduled.is_some() {
            self.adapters.held.remove(r.cold.adapter);
        } else {
            self.adapters.waiting.remove(r.cold.adapter);
        }
        self.requests.remove(idx);
    }

    /// Make a request `Active` in a free slot (caller checked one is free).
    pub(super) fn activate(&mut self, idx: u32, now: Timestamp) {
        let got = self.slots.acquire();
        debug_assert!(got, "activate without a free slot");
        self.waiting.remove(idx);
        self.admit_seq += 1;
        let r = &mut self.requests[idx];
        r.status = RequestStatus::Active;
        r.has_slot = true;
        r.admit_seq = self.admit_seq;
        if r.cold.times.first_scheduled.is_none() {
            // From its first admission the executor holds its adapter (until it retires).
            r.cold.times.first_scheduled = Some(now);
            self.adapters.waiting.remove(r.cold.adapter);
            self.adapters.held.add(r.cold.adapter);
        }
        r.reserve_output();
        self.sync_holder(idx);
        self.set_active(idx);
    }

    /// Give up the slot and go back to the front of the waiting queue (preemption or yield).
    pub(super) fn deactivate_to_waiting(&mut self, idx: u32) {
        self.work.remove(idx);
        self.unset_active(idx);
        let r = &mut self.requests[idx];
        if r.has_slot {
            self.slots.release();
        }
        r.has_slot = false;
        r.status = RequestStatus::Waiting;
        if r.exec.known {
            r.exec.needs_resume = true;
        }
        let priority = r.priority;
        self.waiting.push_front(idx, priority);
        self.sync_holder(idx);
    }
}
