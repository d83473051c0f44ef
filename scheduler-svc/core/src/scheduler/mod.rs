//! The scheduler: owns every request, queue, slot and block of one executor and turns them into
//! step plans.
//!
//! Why split in files: this module holds the state and the transitions every path shares
//! (add, abort, finish, retire, block release with fences); `step` builds a step, `preempt`
//! frees blocks for a running request, `apply` folds a step result back in, `invariants`
//! checks the whole state, `view` exposes stats and per-request listings.
//!
//! Life of a request: `Waiting` (or `Receiving`) → admitted into a slot → `Active` with at most
//! one pending `WorkKey` → `Finished` (or `Transferring` → `Finished`) → *retired* once its
//! finish was reported to the executor and no in-flight step references it; only then is its
//! slot released and its id reusable.
//!
//! Fences: a block released while a built-but-unapplied step may still read or write it is not
//! returned to the pool until that step's result is applied (`fence`), so an executor running
//! step N never sees a block reused by step N+1.

mod apply;
mod invariants;
mod preempt;
mod step;
mod view;

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::block_pool::BlockPool;
use crate::config::{ConfigError, PreemptionPolicy, SchedulerConfig};
use crate::error::{AbortError, AddError};
use crate::lists::Lists;
use crate::outcome::{FinishStats, FinishedRequest};
use crate::plan::StepPlan;
use crate::prefetch::prefetch;
use crate::request::{Decision, FinishReason, NewRequest, Request, RequestStatus, TransferState};
use crate::slots::AdmissionSlots;
use crate::types::{BlockId, RequestId, StepId, Timestamp, TokenId, TransferId};
use crate::waiting::WaitingQueue;
use crate::work_queues::WorkQueues;

pub use invariants::InvariantViolation;
pub use view::{RequestView, SchedulerStats};

const IMPORT_QUEUE: u32 = 0;

/// One request referenced by a built step.
#[derive(Debug, Clone, Copy)]
struct RecordEntry {
    /// Slab index (valid while the step is in flight: the request cannot retire before).
    idx: u32,
    /// The request's id, to match the result without touching the request.
    id: RequestId,
    /// The step samples a token for it.
    samples: bool,
}

/// One built step whose result has not been applied yet.
#[derive(Debug, Default)]
struct StepRecord {
    step_id: StepId,
    /// Every request the step references: first its scheduled work, in plan order (parallel
    /// to `StepPlan::scheduled`), then the requests with a KV op.
    entries: Vec<RecordEntry>,
    samples: usize,
}

/// Monotonic counters for metrics (vLLM-style names in the service layer).
#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    prefix_queries: u64,
    prefix_hits: u64,
    preemptions: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
    steps: u64,
    finished: u64,
}

/// The scheduling core of one executor. Synchronous, owns all its state, takes time as input.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    slab: Vec<Option<Request>>,
    free_entries: Vec<u32>,
    by_id: FxHashMap<RequestId, u32>,
    work: WorkQueues,
    waiting: WaitingQueue,
    imports: Lists,
    /// `Active` requests (victim candidates), with `Request::active_pos` as back-index.
    active: Vec<u32>,
    /// `Waiting` requests holding blocks (reclaim candidates), `Request::holder_pos` back-index.
    holders: Vec<u32>,
    slots: AdmissionSlots,
    pool: BlockPool,
    fence: VecDeque<(StepId, Vec<BlockId>)>,
    fenced_blocks: usize,
    spare_block_vecs: Vec<Vec<BlockId>>,
    inflight: VecDeque<StepRecord>,
    spare_records: Vec<StepRecord>,
    transfers: FxHashMap<TransferId, u32>,
    transferring: usize,
    importing: usize,
    to_report: Vec<u32>,
    exports_pending: Vec<u32>,
    plan: StepPlan,
    /// The record of the step being built (entries parallel to `plan.scheduled`).
    building: Option<StepRecord>,
    /// Scheduled requests whose executor diff or prefix-cache registration is due at finalize.
    plan_followups: Vec<u32>,
    /// Requests given a KV op in the step being built.
    plan_kv_slots: Vec<u32>,
    next_step: u64,
    last_applied: u64,
    arrival_seq: u64,
    admit_seq: u64,
    outcome_epoch: u64,
    budget: usize,
    step_preempted: bool,
    step_blocked: bool,
    counters: Counters,
    scratch_blocks: Vec<BlockId>,
    /// The shared empty token list new requests without prior output carry (no allocation).
    empty_tokens: std::sync::Arc<[TokenId]>,
}

impl Scheduler {
    /// A scheduler with an empty cache; fails on an invalid configuration.
    pub fn new(cfg: SchedulerConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        Ok(Scheduler {
            pool: BlockPool::new(cfg.num_blocks, cfg.enable_prefix_caching),
            slots: AdmissionSlots::new(cfg.max_num_seqs),
            waiting: WaitingQueue::new(cfg.preemption_policy == PreemptionPolicy::Priority),
            cfg,
            slab: Vec::new(),
            free_entries: Vec::new(),
            by_id: FxHashMap::default(),
            work: WorkQueues::new(),
            imports: Lists::new(1),
            active: Vec::new(),
            holders: Vec::new(),
            fence: VecDeque::new(),
            fenced_blocks: 0,
            spare_block_vecs: Vec::new(),
            inflight: VecDeque::new(),
            spare_records: Vec::new(),
            transfers: FxHashMap::default(),
            transferring: 0,
            importing: 0,
            to_report: Vec::new(),
            exports_pending: Vec::new(),
            plan: StepPlan::default(),
            building: None,
            plan_followups: Vec::new(),
            plan_kv_slots: Vec::new(),
            next_step: 0,
            last_applied: 0,
            arrival_seq: 0,
            admit_seq: 0,
            outcome_epoch: 0,
            budget: 0,
            step_preempted: false,
            step_blocked: false,
            counters: Counters::default(),
            scratch_blocks: Vec::new(),
            empty_tokens: std::sync::Arc::from(Vec::new()),
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// True while a request with this id exists (not yet retired); its id is not reusable.
    pub fn contains(&self, id: RequestId) -> bool {
        self.by_id.contains_key(&id)
    }

    /// Add a request. It enters `Waiting`, or `Receiving` if it has a KV import.
    pub fn add_request(&mut self, req: NewRequest) -> Result<(), AddError> {
        self.validate_new(&req)?;
        self.arrival_seq += 1;
        let import = req.kv_import;
        let req_export = req.kv_export;
        let priority = req.priority;
        let id = req.id;
        let mut r = Request::new(req, self.arrival_seq, self.cfg.block_size);
        let idx = match self.free_entries.pop() {
            Some(i) => i,
            None => {
                self.slab.push(None);
                (self.slab.len() - 1) as u32
            }
        };
        if let Some(imp) = import {
            r.status = RequestStatus::Receiving;
            r.cold.transfer = Some((imp.transfer_id, TransferState::ImportQueued));
            r.cold.import_tokens = imp.num_tokens;
            r.decision = Decision::ImportQueued;
            self.transfers.insert(imp.transfer_id, idx);
            self.imports.push_back(IMPORT_QUEUE, idx);
        } else if let Some(tid) = req_export {
            r.cold.transfer = Some((tid, TransferState::ExportPlanned));
            self.transfers.insert(tid, idx);
            self.waiting.push_back(idx, priority);
        } else {
            self.waiting.push_back(idx, priority);
        }
        self.slab[idx as usize] = Some(r);
        self.by_id.insert(id, idx);
        Ok(())
    }

    fn validate_new(&self, req: &NewRequest) -> Result<(), AddError> {
        let id = req.id;
        let prompt_len = req.prompt.len();
        let max_model_len = self.cfg.max_model_len;
        if prompt_len == 0 {
            return Err(AddError::EmptyPrompt(id));
        }
        if prompt_len >= max_model_len {
            return Err(AddError::PromptTooLong { id, prompt_len, max_model_len });
        }
        if req.max_tokens == 0 {
            return Err(AddError::ZeroMaxTokens(id));
        }
        if prompt_len.saturating_add(req.max_tokens) > max_model_len {
            return Err(AddError::MaxTokensPastModelLen {
                id,
                prompt_len,
                max_tokens: req.max_tokens,
                max_model_len,
            });
        }
        if req.min_tokens > req.max_tokens {
            return Err(AddError::MinTokensAboveMax(id));
        }
        if req.output.len() >= req.max_tokens {
            return Err(AddError::OutputComplete {
                id,
                output_len: req.output.len(),
                max_tokens: req.max_tokens,
            });
        }
        if !req.output.is_empty() && (req.kv_import.is_some() || req.kv_export.is_some()) {
            return Err(AddError::OutputWithTransfer(id));
        }
        if self.by_id.contains_key(&id) {
            return Err(AddError::DuplicateId(id));
        }
        // KV is computed for every token but the last sampled one.
        let blocks_needed = self.cfg.blocks_for(prompt_len + req.max_tokens - 1);
        if blocks_needed > self.cfg.num_blocks {
            return Err(AddError::NeverFits { id, blocks_needed, num_blocks: self.cfg.num_blocks });
        }
        if !self.cfg.enable_chunked_prefill && prompt_len > self.cfg.max_num_batched_tokens {
            return Err(AddError::PromptOverBudget {
                id,
                prompt_len,
                budget: self.cfg.max_num_batched_tokens,
            });
        }
        if let Some(imp) = req.kv_import {
            let invalid = |reason| Err(AddError::InvalidImport { id, reason });
            if self.cfg.max_kv_fetches == 0 {
                return invalid("KV imports are disabled (max_kv_fetches = 0)");
            }
            if imp.num_tokens == 0 || imp.num_tokens >= prompt_len {
                return invalid("must cover 1..prompt_len-1 tokens");
            }
            if req.kv_export.is_some() {
                return invalid("a prefill-only request cannot import its KV");
            }
        }
        let transfer_ids = req.kv_import.map(|i| i.transfer_id).into_iter().chain(req.kv_export);
        for transfer_id in transfer_ids {
            if self.transfers.contains_key(&transfer_id) {
                return Err(AddError::DuplicateTransfer { id, transfer_id });
            }
        }
        Ok(())
    }

    /// Abort a request in any state, also with a step in flight. Its resources are released
    /// (blocks behind the fence of the in-flight step; a KV transfer in progress keeps its
    /// blocks until reported) and its id becomes reusable once it retires.
    pub fn abort(&mut self, id: RequestId, now: Timestamp) -> Result<FinishedRequest, AbortError> {
        let &idx = self.by_id.get(&id).ok_or(AbortError::Unknown(id))?;
        if self.req(idx).status.is_finished() {
            return Err(AbortError::AlreadyFinished(id));
        }
        Ok(self.finish(idx, FinishReason::Abort, now))
    }

    // ---- shared helpers -------------------------------------------------------------------

    #[inline]
    fn req(&self, idx: u32) -> &Request {
        self.slab[idx as usize]
            .as_ref()
            .expect("slab index held by a queue or record names a live entry")
    }

    #[inline]
    fn req_mut(&mut self, idx: u32) -> &mut Request {
        self.slab[idx as usize]
            .as_mut()
            .expect("slab index held by a queue or record names a live entry")
    }

    /// Prefetch the hot lines of `idx`'s request (a hint: no effect on behaviour).
    #[inline]
    fn prefetch_request(&self, idx: u32) {
        self.prefetch_request_lines(idx, &[0, 1, 2]);
    }

    /// Prefetch cache lines `lines` of `idx`'s record (see [`Request`]'s layout).
    #[inline]
    fn prefetch_request_lines(&self, idx: u32, lines: &[usize]) {
        if let Some(slot) = self.slab.get(idx as usize) {
            let r: *const u8 = (slot as *const Option<Request>).cast();
            for &line in lines {
                prefetch(r.wrapping_add(64 * line));
            }
        }
    }

    #[inline]
    fn in_flight(&self, step: Option<StepId>) -> bool {
        step.is_some_and(|s| s.0 > self.last_applied)
    }

    /// True if `idx` has work in the step being built.
    #[inline]
    fn scheduled_in_build(&self, idx: u32) -> bool {
        self.building.is_some() && self.req(idx).last_step.get() == Some(StepId(self.next_step))
    }

    fn set_active(&mut self, idx: u32) {
        let pos = self.active.len() as u32;
        self.active.push(idx);
        self.req_mut(idx).cold.active_pos = pos;
    }

    fn unset_active(&mut self, idx: u32) {
        let pos = self.req(idx).cold.active_pos;
        if pos == u32::MAX {
            return;
        }
        self.active.swap_remove(pos as usize);
        if let Some(&moved) = self.active.get(pos as usize) {
            self.req_mut(moved).cold.active_pos = pos;
        }
        self.req_mut(idx).cold.active_pos = u32::MAX;
    }

    /// Keep `holders` = waiting requests with a non-empty block table.
    fn sync_holder(&mut self, idx: u32) {
        let r = self.req(idx);
        let should = r.status == RequestStatus::Waiting && !r.block_table.is_empty();
        let is = r.cold.holder_pos != u32::MAX;
        if should && !is {
            let pos = self.holders.len() as u32;
            self.holders.push(idx);
            self.req_mut(idx).cold.holder_pos = pos;
        } else if !should && is {
            let pos = r.cold.holder_pos;
            self.holders.swap_remove(pos as usize);
            if let Some(&moved) = self.holders.get(pos as usize) {
                self.req_mut(moved).cold.holder_pos = pos;
            }
            self.req_mut(idx).cold.holder_pos = u32::MAX;
        }
    }

    /// Shrink the request's block table to `keep` blocks (tail first, so the prefix stays
    /// cached longest). Blocks an in-flight step may use go behind the fence. Returns how many
    /// blocks became free right now.
    fn release_blocks(&mut self, idx: u32, keep: usize) -> usize {
        let bs = self.cfg.block_size;
        debug_assert!(!self.scheduled_in_build(idx), "release of a request scheduled in this step");
        let fenced = self.in_flight(self.req(idx).last_step.get());
        let step = self.req(idx).last_step.get();
        let mut freed_now = 0;
        let mut tail = std::mem::take(&mut self.scratch_blocks);
        {
            let r = self.req_mut(idx);
            if r.block_table.len() <= keep {
                self.scratch_blocks = tail;
                return 0;
            }
            tail.clear();
            tail.extend(r.block_table.drain(keep..).rev());
            r.num_computed = r.num_computed.min(keep * bs);
            r.set_registered(r.registered().min(keep));
            r.exec.sent_blocks = r.exec.sent_blocks.min(keep as u32);
        }
        if fenced {
            let step = step.expect("in_flight implies a step");
            // One bucket per step, ordered by step (fences drain from the front).
            let pos = match self.fence.iter().position(|(s, _)| *s >= step) {
                Some(p) if self.fence[p].0 == step => p,
                Some(p) => {
                    let v = self.spare_block_vecs.pop().unwrap_or_default();
                    self.fence.insert(p, (step, v));
                    p
                }
                None => {
                    let v = self.spare_block_vecs.pop().unwrap_or_default();
                    self.fence.push_back((step, v));
                    self.fence.len() - 1
                }
            };
            let bucket = &mut self.fence[pos].1;
            bucket.extend_from_slice(&tail);
            self.fenced_blocks += tail.len();
        } else {
            for &b in &tail {
                self.pool.release(b);
                if self.pool.ref_count(b) == 0 {
                    freed_now += 1;
                }
            }
        }
        self.scratch_blocks = tail;
        self.sync_holder(idx);
        freed_now
    }

    /// Return fenced blocks of every step up to `step` to the pool.
    fn release_fence(&mut self, step: StepId) {
        while let Some((s, _)) = self.fence.front() {
            if *s > step {
                break;
            }
            let (_, mut blocks) = self.fence.pop_front().expect("front exists");
            for &b in &blocks {
                self.pool.release(b);
            }
            self.fenced_blocks -= blocks.len();
            blocks.clear();
            self.spare_block_vecs.push(blocks);
        }
    }

    /// Move a request to `Finished(reason)`: drop its pending work, queue position and active
    /// membership, release its blocks (unless a KV transfer in progress still uses them) and
    /// queue its finish for the executor. It keeps its slot until it retires.
    fn finish(&mut self, idx: u32, reason: FinishReason, now: Timestamp) -> FinishedRequest {
        let was = self.req(idx).status;
        debug_assert!(!was.is_finished(), "finishing a finished request");
        if was == RequestStatus::Transferring {
            self.transferring -= 1;
        }
        self.work.remove(idx);
        self.waiting.remove(idx);
        self.imports.remove(idx);
        self.unset_active(idx);
        let transfer = self.req(idx).cold.transfer;
        match transfer {
            Some((
                tid,
                TransferState::ImportQueued
                | TransferState::ExportPlanned
                | TransferState::ExportQueued,
            )) => {
                self.transfers.remove(&tid);
                self.exports_pending.retain(|&i| i != idx);
                self.req_mut(idx).cold.transfer = None;
            }
            Some((_, TransferState::Importing | TransferState::Exporting)) | None => {}
        }
        {
            let r = self.req_mut(idx);
            r.status = RequestStatus::Finished(reason);
            r.decision = Decision::Finished;
            r.cold.times.finished = Some(now);
        }
        // Blocks under an in-progress transfer stay until the transfer is reported.
        if self.req(idx).cold.transfer.is_none() {
            self.release_blocks(idx, 0);
        }
        self.sync_holder(idx);
        if self.req(idx).exec.known {
            self.to_report.push(idx);
        }
        self.counters.finished += 1;
        let finished = self.finished_record(idx, reason, now);
        self.try_retire(idx);
        finished
    }

    fn finished_record(&self, idx: u32, reason: FinishReason, now: Timestamp) -> FinishedRequest {
        let r = self.req(idx);
        let arrival = r.cold.times.arrival;
        FinishedRequest {
            id: r.id,
            reason,
            stats: FinishStats {
                prompt_tokens: r.prompt.len(),
                output_tokens: r.output.len(),
                prefix_hit_tokens: r.cold.prefix_hit_tokens,
                num_preemptions: r.num_preemptions,
                queue_time: r.cold.times.first_scheduled.map(|t| t.secs_since(arrival)),
                time_to_first_token: r.cold.times.first_token.map(|t| t.secs_since(arrival)),
                e2e_latency: now.secs_since(arrival),
            },
        }
    }

    /// Retire a finished request once nothing references it: release its slot, free its entry,
    /// make its id reusable.
    fn try_retire(&mut self, idx: u32) {
        let r = self.req(idx);
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
        let id = r.id;
        if r.has_slot {
            self.slots.release();
        }
        self.by_id.remove(&id);
        self.slab[idx as usize] = None;
        self.free_entries.push(idx);
    }

    /// Make a request `Active` in a free slot (caller checked one is free).
    fn activate(&mut self, idx: u32, now: Timestamp) {
        let got = self.slots.acquire();
        debug_assert!(got, "activate without a free slot");
        self.waiting.remove(idx);
        self.admit_seq += 1;
        let seq = self.admit_seq;
        {
            let r = self.req_mut(idx);
            r.status = RequestStatus::Active;
            r.has_slot = true;
            r.admit_seq = seq;
            r.cold.times.first_scheduled.get_or_insert(now);
            r.reserve_output();
        }
        self.sync_holder(idx);
        self.set_active(idx);
    }

    /// Give up the slot and go back to the front of the waiting queue (preemption or yield).
    fn deactivate_to_waiting(&mut self, idx: u32) {
        self.work.remove(idx);
        self.unset_active(idx);
        let (has_slot, priority) = {
            let r = self.req(idx);
            (r.has_slot, r.priority)
        };
        if has_slot {
            self.slots.release();
        }
        {
            let r = self.req_mut(idx);
            r.has_slot = false;
            r.status = RequestStatus::Waiting;
            if r.exec.known {
                r.exec.needs_resume = true;
            }
        }
        self.waiting.push_front(idx, priority);
        self.sync_holder(idx);
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // Every held block must be accounted for by a live request or a fence; a mismatch here
        // is a leak that `check_invariants` would also report.
        if cfg!(debug_assertions) && !std::thread::panicking() {
            let held = self.pool.num_blocks() - self.pool.num_free();
            let in_tables: usize = self.slab.iter().flatten().map(|r| r.block_table.len()).sum();
            debug_assert!(
                held <= in_tables + self.fenced_blocks,
                "{held} blocks held but only {} in tables/fences: leak",
                in_tables + self.fenced_blocks
            );
        }
    }
}
