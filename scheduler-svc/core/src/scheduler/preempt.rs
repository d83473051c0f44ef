//! Making room: what happens when a running request cannot get the blocks its next work needs.
//!
//! Order of remedies, cheapest first:
//! 1. enough blocks are free → allocate;
//! 2. enough will be free once the in-flight step's fence drops → skip this request for one
//!    step (`FenceWait`) instead of preempting more: in asynchronous scheduling a victim's
//!    blocks are fenced, so preempting further would only cascade;
//! 3. reclaim KV held by *waiting* requests (yielded victims, imports without a slot), from the
//!    tail and only as many blocks as needed — they are not running, so nothing stalls
//!    (admission does the same for the request it admits, so idle KV can never block the
//!    head of the waiting queue forever);
//! 4. preempt a running request chosen by the policy; if the policy picks the requester itself
//!    (it ranks worst), it preempts itself rather than deadlock (vLLM semantics).
//!
//! Victim rank (largest goes first) is a strict total order: `(unprotected, policy key)`.
//! *Protected* = preempted `max_preemptions` times already (aging), or — under least-work-done —
//! within 5 % of `max_tokens`. Protection only ever switches on, so after finitely many events
//! the order among running requests is fixed; the best-ranked running request is then never a
//! victim while another runs, always gets budget (`max_num_batched_tokens >= max_num_seqs`),
//! and finishes — the liveness argument. A prefill-only request whose prompt is done is never a
//! victim: it needs no more blocks and leaves through its export.
//!
//! A victim already scheduled in this step gives back its token budget, its sample placeholder
//! and the blocks allocated for it in this step (they were never sent), so nothing leaks into
//! the plan. A step that preempted, or skipped a request for the fence, admits nobody.

use crate::request::{Decision, Request};
use crate::scheduler_config::{PreemptionMode, PreemptionPolicy};
use crate::types::Timestamp;
use crate::work_queues::Operation;

use super::Scheduler;

/// What `make_room` achieved for the requester.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Room {
    /// The blocks are free now.
    Ready,
    /// Wait a step for fenced blocks.
    FenceWait,
    /// The requester was preempted itself.
    SelfPreempted,
}

impl Scheduler {
    /// Victim rank of a running request: larger is preempted first.
    fn victim_rank(&self, r: &Request) -> (u8, i64, i64) {
        let near_completion = self.cfg.preemption_policy == PreemptionPolicy::LeastWorkDone
            && r.output.len() * 20 >= r.max_tokens as usize * 19;
        let protected = r.num_preemptions >= self.cfg.max_preemptions || near_completion;
        let tier = u8::from(!protected);
        match self.cfg.preemption_policy {
            PreemptionPolicy::Fcfs => (tier, r.admit_seq as i64, 0),
            PreemptionPolicy::Priority => (tier, i64::from(r.priority), r.arrival_seq as i64),
            PreemptionPolicy::LeastWorkDone => {
                (tier, -(r.num_computed as i64), r.arrival_seq as i64)
            }
        }
    }

    /// A request that may never be preempted (prefill-only with its prompt done).
    fn unpreemptable(r: &Request) -> bool {
        r.prefill_only && r.num_computed >= r.prompt.len()
    }

    /// Free `need` blocks for running request `idx`, by the remedies in the module doc.
    pub(super) fn make_room(&mut self, idx: u32, need: usize, now: Timestamp) -> Room {
        loop {
            let free = self.pool.num_free();
            if free >= need {
                return Room::Ready;
            }
            let fenced = self.fences.fenced();
            if fenced > 0 && free + fenced >= need {
                return Room::FenceWait;
            }
            if let Some(holder) = self.worst_holder_except(idx) {
                self.reclaim(holder, need - free);
                continue;
            }
            let victim = self.pick_victim(idx);
            self.preempt(victim, now);
            if victim == idx {
                return Room::SelfPreempted;
            }
        }
    }

    /// The waiting block holder (other than `except`) to reclaim from first (worst rank).
    pub(super) fn worst_holder_except(&self, except: u32) -> Option<u32> {
        self.holders
            .iter()
            .copied()
            .filter(|&h| h != except)
            .max_by_key(|&h| self.victim_rank(&self.requests[h]))
    }

    /// Take up to `blocks` blocks from the tail of waiting holder `holder`'s table; it will
    /// recompute the lost tail when admitted. Not a preemption (it already lost its slot).
    pub(super) fn reclaim(&mut self, holder: u32, blocks: usize) {
        let keep = self.requests[holder].block_table.len().saturating_sub(blocks);
        self.release_blocks(holder, keep);
        self.requests[holder].decision = Decision::Reclaimed;
    }

    /// The running request to preempt for `requester` (possibly itself).
    fn pick_victim(&self, requester: u32) -> u32 {
        self.active
            .iter()
            .copied()
            .filter(|&i| i == requester || !Self::unpreemptable(&self.requests[i]))
            .max_by_key(|&i| self.victim_rank(&self.requests[i]))
            .unwrap_or(requester)
    }

    /// Preempt `idx`: roll back this step's work for it, release its slot, and (recompute mode)
    /// its blocks; it goes to the front of the waiting queue.
    pub(super) fn preempt(&mut self, idx: u32, now: Timestamp) {
        self.rollback_scheduled(idx);
        let r = &mut self.requests[idx];
        if r.looped {
            // The executor forgets a preempted request, and with it the hidden state of the
            // chain in progress: the chain's tokens are recomputed from their prelude (their
            // rows stay allocated while the request holds its blocks).
            if r.cold.chain.tokens > 0 {
                r.num_computed -= r.cold.chain.tokens as usize;
                self.counters.chains_dropped += 1;
            }
            r.cold.chain.drop_chain();
        }
        let recompute = self.cfg.preemption_mode == PreemptionMode::Recompute;
        self.deactivate_to_waiting(idx);
        if recompute {
            self.release_blocks(idx, 0);
        }
        let r = &mut self.requests[idx];
        r.num_preemptions += 1;
        r.cold.times.preemptions.push(now);
        r.decision = if recompute { Decision::Preempted } else { Decision::Yielded };
        self.draft.preempted(r.exec.known.then_some(r.id));
        self.counters.preemptions += 1;
    }

    /// Undo the work scheduled for `idx` in the step being built, if any.
    fn rollback_scheduled(&mut self, idx: u32) {
        if !self.scheduled_in_build(idx) {
            return;
        }
        let work = self.draft.rollback(self.requests[idx].sched_index);
        if work.work.is_prompt() {
            self.counters.prompt_tokens -= work.num_tokens as u64;
        }
        let r = &mut self.requests[idx];
        r.last_step = r.prev_last_step;
        r.inflight_refs -= 1;
        let op = work.work.operation();
        if op != Operation::Whole {
            r.cold.chain.unschedule(op);
        }
        // Only a chain's prelude counts its tokens as computed.
        if matches!(op, Operation::Whole | Operation::Prelude) {
            r.num_computed -= work.num_tokens;
        }
        if work.samples_token {
            r.placeholders -= 1;
        }
        let n = r.new_blocks_this_step as usize;
        r.new_blocks_this_step = 0;
        let keep = r.block_table.len() - n;
        // Never sent to the executor: straight back to the pool.
        for b in r.block_table.drain(keep..) {
            self.pool.release(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::{SampledToken, StepOutcome};
    use crate::{NewRequest, RequestId, SchedulerConfig};

    /// Three running requests admitted in order 1, 2, 3 (prompts of 2, 4 and 6 tokens).
    fn running(policy: PreemptionPolicy) -> Scheduler {
        let mut core = Scheduler::new(SchedulerConfig {
            preemption_policy: policy,
            max_preemptions: 2,
            ..SchedulerConfig::default()
        })
        .unwrap();
        for id in 1..=3u64 {
            let prompt: Vec<u32> = (0..2 * id as u32).collect();
            let mut r = NewRequest::new(RequestId(id), prompt, 40, Timestamp(0));
            r.priority = 1;
            core.add_request(r).unwrap();
        }
        let plan = core.schedule(Timestamp(0)).unwrap();
        let outcome = StepOutcome {
            step_id: plan.step_id,
            sampled: plan.scheduled.iter().map(|w| SampledToken { id: w.id, token: 9 }).collect(),
            kv_results: vec![],
            refused: vec![],
            exited: Vec::new(),
        };
        core.apply_result(&outcome, Timestamp(0), &mut Vec::new()).unwrap();
        core
    }

    fn idx(core: &Scheduler, id: u64) -> u32 {
        core.requests.index_of(RequestId(id)).unwrap()
    }

    fn victim(core: &Scheduler, requester: u64) -> u64 {
        core.requests[core.pick_victim(idx(core, requester))].id.0
    }

    #[test]
    fn aging_protects_a_request_against_unprotected_ones_only() {
        let mut core = running(PreemptionPolicy::Fcfs);
        assert_eq!(victim(&core, 1), 3, "latest admitted");
        let three = idx(&core, 3);
        core.requests[three].num_preemptions = 2;
        assert_eq!(victim(&core, 1), 2, "3 is protected now");
        for id in [1, 2] {
            let i = idx(&core, id);
            core.requests[i].num_preemptions = 2;
        }
        assert_eq!(victim(&core, 1), 3, "among protected requests the policy decides again");
        let one = idx(&core, 1);
        core.requests[one].num_preemptions = 0;
        assert_eq!(victim(&core, 1), 1, "an unprotected requester gives way to itself");
    }

    #[test]
    fn priority_rank_is_priority_then_arrival() {
        let mut core = running(PreemptionPolicy::Priority);
        assert_eq!(victim(&core, 1), 3, "same priority: latest arrival");
        let one = idx(&core, 1);
        core.requests[one].priority = 7;
        assert_eq!(victim(&core, 2), 1);
    }

    #[test]
    fn least_work_done_protects_near_completion() {
        let mut core = running(PreemptionPolicy::LeastWorkDone);
        assert_eq!(victim(&core, 3), 1, "fewest computed tokens");
        let one = idx(&core, 1);
        core.requests[one].output = vec![9; 38]; // 38 of 40: within 5 %
        assert_eq!(victim(&core, 3), 2);
    }

    #[test]
    fn a_prefill_only_request_with_its_prompt_done_is_never_a_victim() {
        let mut core = running(PreemptionPolicy::Fcfs);
        let three = idx(&core, 3);
        core.requests[three].prefill_only = true;
        assert_eq!(victim(&core, 1), 2);
    }
}
