//! `check_invariants()` and `check_drained()`: the whole-state checks tests run after every
//! schedule and every apply.
//!
//! Why a full recount instead of trusting counters: each check recomputes from first
//! principles (walk the arena, the queues, the block tables, the fences, the step records) and
//! compares with what the incremental code maintains, so a bookkeeping bug anywhere shows up at
//! the first step it happens. O(requests + blocks): for tests and debugging, not the hot path.
//!
//! Two layers: each part checks its own rules (`RequestArena`, `WorkQueues`, `WaitingQueue`,
//! `BlockPool`, `BlockFences`, `InflightSteps`, `KvTransfers`, `StepDraft` each have a
//! `check`), and this module checks what no part can see alone: that the parts agree with each
//! other and with every request's record (reference counts = block tables + fences, in-flight
//! references = step records, transfer states = the transfer map and queues).

use rustc_hash::FxHashMap;
use thiserror::Error;

use crate::request::{RequestStatus, TransferState};
use crate::types::BlockId;
use crate::work_queues::WorkKey;

use super::Scheduler;

/// A broken invariant, with the number of the rule (DESIGN §3) and a description.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invariant {rule} violated: {detail}")]
pub struct InvariantViolation {
    /// Which rule (1–7 as in DESIGN §3, 8 for looped models' chains; 0 for internal
    /// bookkeeping).
    pub rule: u8,
    /// What was found.
    pub detail: String,
}

fn fail<T>(rule: u8, detail: impl Into<String>) -> Result<T, InvariantViolation> {
    Err(InvariantViolation { rule, detail: detail.into() })
}

/// Tag a part's own check with the rule it belongs to.
fn rule(rule: u8) -> impl Fn(String) -> InvariantViolation {
    move |detail| InvariantViolation { rule, detail }
}

impl Scheduler {
    /// Check every invariant of the current state: each part's own (arena, queues, pool,
    /// fences, steps in flight, transfers, the last plan), then how the parts agree.
    ///
    /// # Errors
    ///
    /// The first [`InvariantViolation`] found.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.check_slots()?;
        self.check_queues()?;
        self.check_blocks()?;
        self.draft.check(self.cfg.max_num_batched_tokens).map_err(rule(5))?;
        self.check_bookkeeping()
    }

    /// 1. slots ≤ max; every Active request holds a slot; every slot belongs to a live Active,
    ///    Transferring or unretired Finished request.
    fn check_slots(&self) -> Result<(), InvariantViolation> {
        let mut held = 0;
        for (_, r) in self.requests.iter() {
            match (r.status, r.has_slot) {
                (RequestStatus::Active, false) => {
                    return fail(1, format!("{} is Active without a slot", r.id))
                }
                (RequestStatus::Waiting | RequestStatus::Receiving, true) => {
                    return fail(1, format!("{} holds a slot while {:?}", r.id, r.status))
                }
                _ => {}
            }
            held += usize::from(r.has_slot);
        }
        if held != self.slots.held() {
            return fail(1, format!("{held} slot flags but counter says {}", self.slots.held()));
        }
        if held > self.slots.max() {
            return fail(1, format!("{held} slots held, max_num_seqs {}", self.slots.max()));
        }
        self.check_adapters()
    }

    /// 1 (adapters). The executor holds one adapter per adapter of the requests admitted at
    /// least once and not retired, counted as the core counts them, and at most `max_loras`;
    /// the adapters of the requests not admitted yet are counted too.
    fn check_adapters(&self) -> Result<(), InvariantViolation> {
        let (mut held, mut waiting) = (FxHashMap::default(), FxHashMap::default());
        for (_, r) in self.requests.iter() {
            if r.cold.adapter != 0 {
                let counts =
                    if r.cold.times.first_scheduled.is_some() { &mut held } else { &mut waiting };
                *counts.entry(r.cold.adapter).or_insert(0u32) += 1;
            }
        }
        for (what, recount, counted) in
            [("held", &held, &self.adapters.held), ("waiting", &waiting, &self.adapters.waiting)]
        {
            let counted = counted.counts();
            if recount.len() != counted.len()
                || recount.iter().any(|(a, n)| counted.get(a) != Some(n))
            {
                return fail(1, format!("{what} adapters {recount:?}, but counted {counted:?}"));
            }
        }
        if self.cfg.max_loras > 0 && held.len() > self.cfg.max_loras {
            let max = self.cfg.max_loras;
            return fail(1, format!("{} adapters held, max_loras {max}", held.len()));
        }
        Ok(())
    }

    /// 2. at most one pending `WorkKey` per request, index and queues agree, only Active requests
    ///    have pending work; 3. Waiting requests are exactly the waiting queue, and queued
    ///    imports exactly the import queue.
    fn check_queues(&self) -> Result<(), InvariantViolation> {
        self.work.check().map_err(rule(2))?;
        self.waiting.check().map_err(rule(3))?;
        for key in WorkKey::ALL {
            for idx in self.work.iter(key) {
                let Some(r) = self.requests.get(idx) else {
                    return fail(2, format!("{key:?} queue holds a retired entry"));
                };
                if r.status != RequestStatus::Active {
                    return fail(2, format!("{} pending {key:?} while {:?}", r.id, r.status));
                }
            }
        }
        let mut waiting = 0;
        for (idx, r) in self.requests.iter() {
            let queued = self.waiting.contains(idx);
            let is_waiting = r.status == RequestStatus::Waiting;
            if queued != is_waiting {
                return fail(3, format!("{} {:?} but in waiting queue: {queued}", r.id, r.status));
            }
            waiting += usize::from(is_waiting);
            if is_waiting && self.work.pending(idx).is_some() {
                return fail(3, format!("{} waiting with pending work", r.id));
            }
            let queued_import = matches!(r.cold.transfer, Some((_, TransferState::ImportQueued)));
            if queued_import != self.transfers.is_import_queued(idx) {
                return fail(3, format!("{} import queue membership disagrees", r.id));
            }
        }
        if waiting != self.waiting.len() {
            return fail(3, "waiting queue holds entries that are not live Waiting requests");
        }
        Ok(())
    }

    /// 4. free + held = total; each block's count = tables holding it + fence holds, and every
    ///    fence waits for a step in flight; 6. computed tokens fit the table.
    fn check_blocks(&self) -> Result<(), InvariantViolation> {
        self.pool.check().map_err(rule(4))?;
        self.fences.check().map_err(rule(4))?;
        let n = self.pool.num_blocks();
        let mut holds = vec![0u32; n];
        let bs = self.cfg.block_size;
        // Draft tokens of verifications in flight: computed (scheduled) but not known yet.
        let mut drafts: FxHashMap<u32, usize> = FxHashMap::default();
        for e in self.steps.iter().flat_map(|s| &s.entries).filter(|e| e.drafts > 0) {
            *drafts.entry(e.idx).or_default() += usize::from(e.drafts);
        }
        for (idx, r) in self.requests.iter() {
            for b in &r.block_table {
                holds[b.index()] += 1;
            }
            if r.block_table.len() % usize::from(r.planes) != 0 {
                return fail(6, format!("{} holds part of a row of KV planes", r.id));
            }
            if r.num_computed > r.table_rows() * bs {
                return fail(
                    6,
                    format!(
                        "{} has {} computed tokens but {} blocks",
                        r.id,
                        r.num_computed,
                        r.block_table.len()
                    ),
                );
            }
            let in_flight = drafts.get(&idx).copied().unwrap_or(0);
            if r.num_computed > r.num_tokens() + r.placeholders as usize + in_flight {
                return fail(
                    6,
                    format!(
                        "{} computed past its tokens ({} computed, {} known, {} samples and {} \
                         draft tokens in flight)",
                        r.id,
                        r.num_computed,
                        r.num_tokens(),
                        r.placeholders,
                        in_flight
                    ),
                );
            }
        }
        self.check_chains()?;
        for (step, b) in self.fences.iter() {
            if !self.steps.in_flight(Some(step)) {
                return fail(4, format!("block {} fenced by {step}, which is applied", b.0));
            }
            holds[b.index()] += 1;
        }
        let mut held = 0;
        for (b, &h) in (0u32..).map(BlockId).zip(&holds) {
            let rc = self.pool.ref_count(b);
            if rc != h {
                return fail(4, format!("block {}: ref_cnt {rc} but {h} holders", b.0));
            }
            held += usize::from(h > 0);
        }
        if held + self.pool.num_free() != n {
            return fail(4, format!("{held} held + {} free != {n}", self.pool.num_free()));
        }
        Ok(())
    }

    /// 8. A looped request: its chain's tokens are computed and were scheduled as one prelude;
    ///    it ran at most its loops; no stage of it is pending while one is in flight (a stage
    ///    runs only after the previous one's result), and a stage in flight is in a step in
    ///    flight; every step in flight ran one operation. Nothing of this for a plain request.
    fn check_chains(&self) -> Result<(), InvariantViolation> {
        for (idx, r) in self.requests.iter() {
            let c = &r.cold.chain;
            if !r.looped {
                if c.tokens > 0 || c.in_flight.is_some() {
                    return fail(8, format!("{} is not looped but has a chain", r.id));
                }
                continue;
            }
            if c.tokens as usize > r.num_computed {
                return fail(
                    8,
                    format!("{} chain of {} tokens, {} computed", r.id, c.tokens, r.num_computed),
                );
            }
            if c.loops > c.max_loops || (c.tokens == 0 && (c.loops > 0 || c.coda)) {
                return fail(8, format!("{} chain {c:?} out of its bounds", r.id));
            }
            let pending = self.work.pending(idx);
            if let Some((step, op)) = c.in_flight {
                if pending.is_some() {
                    return fail(8, format!("{} has {pending:?} pending while {op:?} runs", r.id));
                }
                if !self.steps.in_flight(Some(crate::types::StepId(step))) {
                    return fail(
                        8,
                        format!("{} has {op:?} in flight in step {step}, applied", r.id),
                    );
                }
            }
            if let Some(key) = pending {
                if key.operation() == crate::work_queues::Operation::Whole {
                    return fail(8, format!("{} is looped but pending {key:?}", r.id));
                }
            }
        }
        let plan = self.draft.plan();
        if let Some(w) = plan.scheduled.iter().find(|w| w.work.operation() != plan.operation) {
            return fail(8, format!("{} runs {:?} with {w:?} in it", plan.step_id, plan.operation));
        }
        for rec in self.steps.iter() {
            let ops: std::collections::BTreeSet<_> = rec
                .entries
                .iter()
                .filter_map(|e| self.requests.get(e.idx))
                .filter_map(|r| r.cold.chain.in_flight.filter(|&(s, _)| s == rec.step_id.0))
                .map(|(_, op)| op)
                .collect();
            if ops.len() > 1 {
                return fail(8, format!("{} runs several operations: {ops:?}", rec.step_id));
            }
        }
        Ok(())
    }

    /// Internal bookkeeping: the arena and its id index, active/holder sets, in-flight
    /// references, transfers.
    fn check_bookkeeping(&self) -> Result<(), InvariantViolation> {
        self.requests.check().map_err(rule(0))?;
        self.steps.check(self.cfg.max_steps_in_flight).map_err(rule(0))?;
        self.transfers.check(self.cfg.max_kv_fetches).map_err(rule(0))?;
        let mut refs: FxHashMap<u32, u32> = FxHashMap::default();
        for rec in self.steps.iter() {
            for e in &rec.entries {
                *refs.entry(e.idx).or_default() += 1;
            }
        }
        let (mut importing, mut transferring, mut with_transfer) = (0, 0, 0);
        for (idx, r) in self.requests.iter() {
            let want = refs.get(&idx).copied().unwrap_or(0);
            if u32::from(r.inflight_refs) != want {
                return fail(
                    0,
                    format!("{} inflight_refs {} but {want} records", r.id, r.inflight_refs),
                );
            }
            let active = r.status == RequestStatus::Active;
            if active != (r.cold.active_pos != u32::MAX) {
                return fail(0, format!("{} active-set membership disagrees", r.id));
            }
            let holder = r.status == RequestStatus::Waiting && !r.block_table.is_empty();
            if holder != (r.cold.holder_pos != u32::MAX) {
                return fail(0, format!("{} holder-set membership disagrees", r.id));
            }
            if r.status == RequestStatus::Receiving
                && !matches!(
                    r.cold.transfer,
                    Some((_, TransferState::ImportQueued | TransferState::Importing))
                )
            {
                return fail(0, format!("{} Receiving without an import", r.id));
            }
            if let Some((tid, state)) = r.cold.transfer {
                if self.transfers.request_of(tid) != Some(idx) {
                    return fail(0, format!("{} transfer {tid} not mapped", r.id));
                }
                importing += usize::from(state == TransferState::Importing);
                with_transfer += 1;
                let queued = self.transfers.exports_pending().contains(&idx);
                if queued != (state == TransferState::ExportQueued) {
                    return fail(0, format!("{} export {tid} {state:?}, pending: {queued}", r.id));
                }
            }
            if r.status == RequestStatus::Transferring {
                transferring += 1;
                if !r.has_slot {
                    return fail(1, format!("{} Transferring without its slot", r.id));
                }
            }
        }
        if importing != self.transfers.importing() {
            return fail(
                0,
                format!("{importing} imports in progress, counter {}", self.transfers.importing()),
            );
        }
        if transferring != self.transfers.transferring() {
            return fail(
                0,
                format!(
                    "{transferring} requests Transferring, counter {}",
                    self.transfers.transferring()
                ),
            );
        }
        if self.transfers.len() != with_transfer {
            return fail(0, "transfer map has entries without a request");
        }
        for (pos, &idx) in self.active.iter().enumerate() {
            if self.requests[idx].cold.active_pos as usize != pos {
                return fail(0, "active set back-index broken");
            }
        }
        for (pos, &idx) in self.holders.iter().enumerate() {
            if self.requests[idx].cold.holder_pos as usize != pos {
                return fail(0, "holder set back-index broken");
            }
        }
        Ok(())
    }

    /// True when nothing is left: no request, no step in flight, no slot, no held block (cached
    /// free blocks aside), empty queues.
    #[must_use]
    pub fn is_drained(&self) -> bool {
        self.check_drained().is_ok()
    }

    /// 7. at drain: no slots, no held blocks, empty queues — with what is left if not.
    ///
    /// # Errors
    ///
    /// An [`InvariantViolation`] of rule 7 naming what is left.
    pub fn check_drained(&self) -> Result<(), InvariantViolation> {
        if !self.requests.is_empty() {
            return fail(7, format!("{} requests not retired", self.requests.len()));
        }
        if !self.steps.is_empty() {
            return fail(7, format!("{} steps in flight", self.steps.len()));
        }
        if self.slots.held() != 0 {
            return fail(7, format!("{} slots held", self.slots.held()));
        }
        let held = self.pool.num_blocks() - self.pool.num_free();
        if held != 0 || self.fences.fenced() != 0 {
            return fail(7, format!("{held} blocks held, {} fenced", self.fences.fenced()));
        }
        let queued: usize = WorkKey::ALL.iter().map(|&k| self.work.len(k)).sum();
        if queued != 0 || self.waiting.len() != 0 || self.transfers.queued_imports() != 0 {
            return fail(7, "queues not empty");
        }
        Ok(())
    }
}

/// Each rule shown to catch its violation: a consistent state (one request running with a step
/// in flight, one waiting for a slot) is broken in one place, and `check_invariants` (or
/// `check_drained`) must name that rule. Rule 5 (the step's budget) is shown in `draft.rs`,
/// where the plan can be reached.
#[cfg(test)]
mod tests {
    use crate::request::RequestStatus;
    use crate::types::BlockId;
    use crate::work_queues::WorkKey;
    use crate::{NewRequest, RequestId, Scheduler, SchedulerConfig, Timestamp};

    /// Request 1 running (Active, a slot, blocks, a step in flight), request 2 waiting (one
    /// slot only), every invariant holding. Returns the scheduler and both arena entries.
    fn consistent() -> (Scheduler, u32, u32) {
        let cfg = SchedulerConfig {
            block_size: 4,
            num_blocks: 16,
            max_num_seqs: 1,
            max_num_batched_tokens: 64,
            max_model_len: 64,
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::new(cfg).unwrap();
        for id in [1, 2] {
            let prompt = vec![id as u32 + 1; 6];
            s.add_request(NewRequest::new(RequestId(id), prompt, 4, Timestamp(0))).unwrap();
        }
        s.schedule(Timestamp(0)).unwrap();
        s.check_invariants().expect("the starting state is consistent");
        let running = s.requests.index_of(RequestId(1)).unwrap();
        let waiting = s.requests.index_of(RequestId(2)).unwrap();
        assert_eq!(s.requests[running].status, RequestStatus::Active);
        assert_eq!(s.requests[waiting].status, RequestStatus::Waiting);
        (s, running, waiting)
    }

    /// `check_invariants` must report `rule`, saying `says`.
    fn assert_breaks(s: &Scheduler, rule: u8, says: &str) {
        let v = s.check_invariants().expect_err("the violation went unnoticed");
        assert_eq!(v.rule, rule, "{}", v.detail);
        assert!(v.detail.contains(says), "{}", v.detail);
    }

    #[test]
    fn an_active_request_without_a_slot_breaks_rule_1() {
        let (mut s, running, _) = consistent();
        s.requests[running].has_slot = false;
        assert_breaks(&s, 1, "Active without a slot");
    }

    #[test]
    fn a_waiting_request_holding_a_slot_breaks_rule_1() {
        let (mut s, _, waiting) = consistent();
        s.requests[waiting].has_slot = true;
        assert_breaks(&s, 1, "holds a slot while Waiting");
    }

    #[test]
    fn a_slot_counter_that_disagrees_breaks_rule_1() {
        let (mut s, _, _) = consistent();
        s.slots.release();
        assert_breaks(&s, 1, "slot flags but counter says 0");
    }

    #[test]
    fn pending_work_of_a_waiting_request_breaks_rule_2() {
        let (mut s, _, waiting) = consistent();
        s.work.enqueue(WorkKey::Decode, waiting);
        assert_breaks(&s, 2, "pending Decode while Waiting");
    }

    #[test]
    fn a_waiting_request_missing_from_the_queue_breaks_rule_3() {
        let (mut s, _, waiting) = consistent();
        assert!(s.waiting.remove(waiting));
        assert_breaks(&s, 3, "in waiting queue: false");
    }

    #[test]
    fn a_block_held_without_its_count_breaks_rule_4() {
        let (mut s, running, _) = consistent();
        let free = (0..16).map(BlockId).find(|&b| s.pool.ref_count(b) == 0).unwrap();
        s.requests[running].block_table.push(free);
        assert_breaks(&s, 4, &format!("block {}: ref_cnt 0 but 1 holders", free.0));
    }

    #[test]
    fn computed_tokens_past_the_block_table_break_rule_6() {
        let (mut s, running, _) = consistent();
        let r = &mut s.requests[running];
        r.num_computed = r.block_table.len() * 4 + 1;
        assert_breaks(&s, 6, "computed tokens but");
    }

    #[test]
    fn in_flight_references_without_a_step_break_the_bookkeeping() {
        let (mut s, _, waiting) = consistent();
        s.requests[waiting].inflight_refs += 1;
        assert_breaks(&s, 0, "inflight_refs 1 but 0 records");
    }

    #[test]
    fn a_broken_active_set_index_breaks_the_bookkeeping() {
        let (mut s, running, _) = consistent();
        s.requests[running].cold.active_pos = 7;
        assert_breaks(&s, 0, "active set back-index broken");
    }

    #[test]
    fn work_left_at_the_end_breaks_rule_7() {
        let (s, _, _) = consistent();
        let v = s.check_drained().expect_err("two live requests are not drained");
        assert_eq!(v.rule, 7, "{}", v.detail);
        assert!(v.detail.contains("2 requests not retired"), "{}", v.detail);
        assert!(!s.is_drained());
    }

    /// [`consistent`] on a looped model (2 loops): request 1's prelude in flight.
    fn looped() -> (Scheduler, u32) {
        let cfg = SchedulerConfig {
            block_size: 4,
            num_blocks: 64,
            max_model_len: 64,
            looped: Some(crate::LoopedModel::new(2)),
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::new(cfg).unwrap();
        s.add_request(NewRequest::new(RequestId(1), vec![3; 6], 4, Timestamp(0))).unwrap();
        s.schedule(Timestamp(0)).unwrap();
        s.check_invariants().expect("the starting state is consistent");
        let idx = s.requests.index_of(RequestId(1)).unwrap();
        (s, idx)
    }

    #[test]
    fn a_stage_pending_while_one_is_in_flight_breaks_rule_8() {
        let (mut s, idx) = looped();
        s.work.enqueue(WorkKey::PromptRecurrent, idx);
        assert_breaks(&s, 8, "pending while Prelude runs");
    }

    #[test]
    fn more_loops_than_asked_or_plain_work_for_a_looped_request_break_rule_8() {
        let (mut s, idx) = looped();
        s.requests[idx].cold.chain.loops = 3;
        assert_breaks(&s, 8, "out of its bounds");
        let (mut s, idx) = looped();
        s.requests[idx].cold.chain.in_flight = None;
        s.work.enqueue(WorkKey::Decode, idx);
        assert_breaks(&s, 8, "is looped but pending Decode");
    }
}
