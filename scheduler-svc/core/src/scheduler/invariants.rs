//! `check_invariants()` and `check_drained()`: the whole-state checks tests run after every
//! schedule and every apply.
//!
//! Why a full recount instead of trusting counters: each check recomputes from first
//! principles (walk the slab, the queues, the block tables, the fences) and compares with
//! what the incremental code maintains, so a bookkeeping bug anywhere shows up at the first
//! step it happens. O(requests + blocks): for tests and debugging, not the hot path.

use rustc_hash::FxHashMap;
use thiserror::Error;

use crate::request::{RequestStatus, TransferState};
use crate::work_queues::WorkKey;

use super::{Scheduler, IMPORT_QUEUE};

/// A broken invariant, with the number of the rule (DESIGN §3) and a description.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invariant {rule} violated: {detail}")]
pub struct InvariantViolation {
    /// Which rule (1–7 as in DESIGN §3; 0 for internal bookkeeping).
    pub rule: u8,
    /// What was found.
    pub detail: String,
}

fn fail<T>(rule: u8, detail: impl Into<String>) -> Result<T, InvariantViolation> {
    Err(InvariantViolation { rule, detail: detail.into() })
}

impl Scheduler {
    /// Check every invariant of the current state.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.check_slots()?;
        self.check_queues()?;
        self.check_blocks()?;
        self.check_plan()?;
        self.check_bookkeeping()
    }

    /// 1. slots ≤ max; every Active request holds a slot; every slot belongs to a live Active,
    ///    Transferring or unretired Finished request.
    fn check_slots(&self) -> Result<(), InvariantViolation> {
        let mut held = 0;
        for r in self.slab.iter().flatten() {
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
        Ok(())
    }

    /// 2. at most one pending WorkKey per request, index and queues agree, only Active requests
    ///    have pending work; 3. Waiting requests are exactly the waiting queue.
    fn check_queues(&self) -> Result<(), InvariantViolation> {
        self.work.check().map_err(|d| InvariantViolation { rule: 2, detail: d })?;
        self.waiting.check().map_err(|d| InvariantViolation { rule: 3, detail: d })?;
        self.imports.check().map_err(|d| InvariantViolation { rule: 3, detail: d })?;
        for key in WorkKey::ALL {
            for idx in self.work.iter(key) {
                let Some(r) = &self.slab[idx as usize] else {
                    return fail(2, format!("{key:?} queue holds a retired entry"));
                };
                if r.status != RequestStatus::Active {
                    return fail(2, format!("{} pending {key:?} while {:?}", r.id, r.status));
                }
            }
        }
        let mut waiting = 0;
        for (i, slot) in self.slab.iter().enumerate() {
            let Some(r) = slot else { continue };
            let idx = i as u32;
            let in_waiting = self.waiting.contains(idx);
            let is_waiting = r.status == RequestStatus::Waiting;
            if in_waiting != is_waiting {
                return fail(
                    3,
                    format!("{} {:?} but in waiting queue: {in_waiting}", r.id, r.status),
                );
            }
            waiting += usize::from(is_waiting);
            if is_waiting && self.work.pending(idx).is_some() {
                return fail(3, format!("{} waiting with pending work", r.id));
            }
            let queued_import = matches!(r.cold.transfer, Some((_, TransferState::ImportQueued)));
            if queued_import != self.imports.list_of(idx).is_some_and(|l| l == IMPORT_QUEUE) {
                return fail(3, format!("{} import queue membership disagrees", r.id));
            }
        }
        if waiting != self.waiting.len() {
            return fail(3, "waiting queue holds entries that are not live Waiting requests");
        }
        Ok(())
    }

    /// 4. free + held = total; each block's count = tables holding it + fence holds;
    /// 6. computed tokens fit the table.
    fn check_blocks(&self) -> Result<(), InvariantViolation> {
        self.pool.check().map_err(|d| InvariantViolation { rule: 4, detail: d })?;
        let n = self.pool.num_blocks();
        let mut holds = vec![0u32; n];
        let bs = self.cfg.block_size;
        for r in self.slab.iter().flatten() {
            for b in &r.block_table {
                holds[b.index()] += 1;
            }
            if r.num_computed > r.block_table.len() * bs {
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
            if r.num_computed > r.num_tokens() + r.placeholders {
                return fail(6, format!("{} computed past its tokens", r.id));
            }
        }
        let mut fenced = 0;
        for (_, blocks) in &self.fence {
            for b in blocks {
                holds[b.index()] += 1;
            }
            fenced += blocks.len();
        }
        if fenced != self.fenced_blocks {
            return fail(4, format!("fence holds {fenced}, counter {}", self.fenced_blocks));
        }
        let mut held = 0;
        for (i, &h) in holds.iter().enumerate() {
            let rc = self.pool.ref_count(crate::types::BlockId(i as u32));
            if rc != h {
                return fail(4, format!("block {i}: ref_cnt {rc} but {h} holders"));
            }
            held += usize::from(h > 0);
        }
        if held + self.pool.num_free() != n {
            return fail(4, format!("{held} held + {} free != {n}", self.pool.num_free()));
        }
        Ok(())
    }

    /// 5. the last plan's tokens ≤ budget and = sum over the batch; one entry per request.
    fn check_plan(&self) -> Result<(), InvariantViolation> {
        let sum: usize = self.plan.scheduled.iter().map(|w| w.num_tokens).sum();
        if sum != self.plan.total_tokens {
            return fail(5, format!("total_tokens {} != sum {sum}", self.plan.total_tokens));
        }
        if sum > self.cfg.max_num_batched_tokens {
            return fail(5, format!("{sum} tokens > budget {}", self.cfg.max_num_batched_tokens));
        }
        let mut ids: Vec<_> = self.plan.scheduled.iter().map(|w| w.id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return fail(5, "a request is scheduled twice in one step");
        }
        Ok(())
    }

    /// Internal bookkeeping: id map, active/holder sets, in-flight references, transfers.
    fn check_bookkeeping(&self) -> Result<(), InvariantViolation> {
        let live = self.slab.iter().flatten().count();
        if live != self.by_id.len() {
            return fail(0, format!("{live} entries, {} ids", self.by_id.len()));
        }
        for (id, &idx) in &self.by_id {
            if self.slab[idx as usize].as_ref().map(|r| r.id) != Some(*id) {
                return fail(0, format!("{id} maps to the wrong entry"));
            }
        }
        let mut refs: FxHashMap<u32, u32> = FxHashMap::default();
        for rec in &self.inflight {
            for e in &rec.entries {
                *refs.entry(e.idx).or_default() += 1;
            }
        }
        let mut importing = 0;
        for (i, slot) in self.slab.iter().enumerate() {
            let Some(r) = slot else { continue };
            let idx = i as u32;
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
                if self.transfers.get(&tid) != Some(&idx) {
                    return fail(0, format!("{} transfer {tid} not mapped", r.id));
                }
                importing += usize::from(state == TransferState::Importing);
            }
            if r.status == RequestStatus::Transferring && !r.has_slot {
                return fail(1, format!("{} Transferring without its slot", r.id));
            }
        }
        if importing != self.importing || importing > self.cfg.max_kv_fetches {
            return fail(0, format!("{importing} imports in progress, counter {}", self.importing));
        }
        if self.transfers.len()
            != self.slab.iter().flatten().filter(|r| r.cold.transfer.is_some()).count()
        {
            return fail(0, "transfer map has entries without a request");
        }
        for (pos, &idx) in self.active.iter().enumerate() {
            if self.req(idx).cold.active_pos as usize != pos {
                return fail(0, "active set back-index broken");
            }
        }
        for (pos, &idx) in self.holders.iter().enumerate() {
            if self.req(idx).cold.holder_pos as usize != pos {
                return fail(0, "holder set back-index broken");
            }
        }
        Ok(())
    }

    /// True when nothing is left: no request, no step in flight, no slot, no held block (cached
    /// free blocks aside), empty queues.
    pub fn is_drained(&self) -> bool {
        self.check_drained().is_ok()
    }

    /// 7. at drain: no slots, no held blocks, empty queues — with what is left if not.
    pub fn check_drained(&self) -> Result<(), InvariantViolation> {
        if !self.by_id.is_empty() {
            return fail(7, format!("{} requests not retired", self.by_id.len()));
        }
        if !self.inflight.is_empty() {
            return fail(7, format!("{} steps in flight", self.inflight.len()));
        }
        if self.slots.held() != 0 {
            return fail(7, format!("{} slots held", self.slots.held()));
        }
        let held = self.pool.num_blocks() - self.pool.num_free();
        if held != 0 || self.fenced_blocks != 0 {
            return fail(7, format!("{held} blocks held, {} fenced", self.fenced_blocks));
        }
        let queued: usize = WorkKey::ALL.iter().map(|&k| self.work.len(k)).sum();
        if queued != 0 || self.waiting.len() != 0 || self.imports.len(IMPORT_QUEUE) != 0 {
            return fail(7, "queues not empty");
        }
        Ok(())
    }
}
