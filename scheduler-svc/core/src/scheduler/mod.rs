//! The scheduler: owns every request, queue, slot and block of one executor and turns them into
//! step plans.
//!
//! State, split by how long it lives (each part in its own module, with its invariants in its
//! head and a `check` that `check_invariants` calls):
//! - for the scheduler's lifetime: the configuration, the [`BlockPool`], the admission slots,
//!   the work queues and the waiting queue, the active and holder sets, the counters;
//! - per request, from `add_request` until it retires: its record in the [`RequestArena`]
//!   (`arena`), addressed by the `u32` entry every queue, set and step record holds;
//! - until a KV transfer is reported: [`KvTransfers`] (`transfers`): transfer id → request,
//!   the import queue, the exports due in the next step, the in-progress counts;
//! - until a step's result is applied: [`InflightSteps`] (`inflight`), the record of each step
//!   sent and the step numbering, and [`BlockFences`] (`fences`), the blocks released while a
//!   step that may use them is in flight;
//! - until the next step is built: the finished requests whose finish it reports
//!   (`to_report`);
//! - for one `schedule()` call: [`StepDraft`] (`draft`), the plan being built with its record,
//!   token budget and scratch lists (the plan itself stays readable until the next call).
//!
//! The parts are fields of [`Scheduler`], not nested in each other, so a transition can hold
//! a request from the arena and the draft (or the pool, or the fences) at once without copying
//! through a scratch buffer; the transitions themselves are methods on `Scheduler`, by path:
//! this module holds the ones every path shares (add, abort, finish, retire, block release),
//! `step` builds a step (`admission` admits waiting requests into it, `fork` forks parallel
//! samples from their source's KV), `preempt` frees blocks for a running request, `apply`
//! folds a step result back in, `invariants` checks the whole state (each part's own rules,
//! then how the parts agree), `view` exposes stats and per-request listings.
//!
//! Life of a request: `Waiting` (or `Receiving`) → admitted into a slot → `Active` with at most
//! one pending `WorkKey` → `Finished` (or `Transferring` → `Finished`) → *retired* once its
//! finish was reported to the executor, no in-flight step references it and no KV transfer is
//! in progress; only then is its slot released, its arena entry freed and its id reusable.
//!
//! Fences: a block released while a built-but-unapplied step may still read or write it is not
//! returned to the pool until that step's result is applied (see `fences`), so an executor
//! running step N never sees a block reused by step N+1.

mod admission;
mod apply;
mod arena;
mod draft;
mod fences;
mod fork;
mod inflight;
mod invariants;
mod lifecycle;
mod preempt;
mod step;
mod throttle;
mod tier;
mod transfers;
mod view;

use crate::block_hash::BlockHash;
use crate::block_pool::BlockPool;
use crate::error::{AbortError, AddError};
use crate::outcome::{FinishStats, FinishedRequest};
use crate::request::{
    Decision, FinishReason, Fork, NewRequest, Request, RequestStatus, TransferState,
};
use crate::scheduler_config::{ConfigError, PreemptionPolicy, SchedulerConfig};
use crate::slots::AdmissionSlots;
use crate::types::{BlockId, RequestId, Timestamp};
use crate::waiting::WaitingQueue;
use crate::work_queues::WorkQueues;

use arena::RequestArena;
use draft::StepDraft;
use fences::BlockFences;
use inflight::InflightSteps;
use lifecycle::HeldAdapters;
use throttle::PrefillThrottle;
use tier::TierStores;
use transfers::KvTransfers;

pub use invariants::InvariantViolation;
pub use view::{RequestView, SchedulerStats};

/// Monotonic counters for metrics (vLLM-style names in the service layer).
#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    prefix_queries: u64,
    prefix_hits: u64,
    preemptions: u64,
    prefills_deferred: u64,
    lora_waits: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
    steps: u64,
    finished: u64,
    spec_drafts: u64,
    spec_draft_tokens: u64,
    spec_accepted_tokens: u64,
    spec_accepted_per_position: [u64; crate::scheduler_config::MAX_SPECULATIVE_TOKENS],
    forks: u64,
    fork_shared_blocks: u64,
    fork_copied_blocks: u64,
    chains_completed: u64,
    chain_loops: u64,
    chains_exited_early: u64,
    chains_dropped: u64,
}

/// The scheduling core of one executor. Synchronous, owns all its state, takes time as input.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    /// Every live request, by arena entry (the `u32` every queue and set below holds).
    requests: RequestArena,
    /// Pending work of `Active` requests, one queue per `WorkKey`.
    work: WorkQueues,
    /// `Waiting` requests in admission order.
    waiting: WaitingQueue,
    /// `Active` requests (victim candidates), with `RequestCold::active_pos` as back-index.
    active: Vec<u32>,
    /// `Waiting` requests holding blocks (reclaim candidates), `RequestCold::holder_pos`
    /// back-index.
    holders: Vec<u32>,
    slots: AdmissionSlots,
    pool: BlockPool,
    /// Released blocks an unapplied step may still use.
    fences: BlockFences,
    /// Steps built and not applied, and the step numbering.
    steps: InflightSteps,
    /// Transfer ids, queued imports, pending exports.
    transfers: KvTransfers,
    /// Blocks waiting to be written to the node's KV agent (the KV tier).
    tier: TierStores,
    /// The step being built (and, between calls, the last plan).
    draft: StepDraft,
    /// Finished requests the executor knows, to be reported by the next step.
    to_report: Vec<u32>,
    /// Arrival and admission order, the victim ranks' tie-breakers.
    arrival_seq: u64,
    admit_seq: u64,
    counters: Counters,
    /// The data-parallel prefill throttle's state (`throttle`).
    throttle: PrefillThrottle,
    /// The LoRA adapters the executor holds for the requests it knows (`lifecycle`).
    adapters: HeldAdapters,
}

impl Scheduler {
    /// A scheduler with an empty cache.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] if the configuration is invalid (see [`SchedulerConfig::validate`]).
    pub fn new(cfg: SchedulerConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        Ok(Scheduler {
            pool: BlockPool::new(cfg.num_blocks, cfg.enable_prefix_caching),
            slots: AdmissionSlots::new(cfg.max_num_seqs),
            waiting: WaitingQueue::new(cfg.preemption_policy == PreemptionPolicy::Priority),
            draft: StepDraft::new(cfg.max_num_batched_tokens),
            cfg,
            requests: RequestArena::default(),
            work: WorkQueues::new(),
            active: Vec::new(),
            holders: Vec::new(),
            fences: BlockFences::default(),
            steps: InflightSteps::default(),
            transfers: KvTransfers::default(),
            tier: TierStores::default(),
            to_report: Vec::new(),
            arrival_seq: 0,
            admit_seq: 0,
            counters: Counters::default(),
            throttle: PrefillThrottle::default(),
            adapters: HeldAdapters::default(),
        })
    }

    /// Adopt the cached blocks an executor reported when this core's session opened, as
    /// cached free blocks (a warm prefix cache across a leader change). Only a core that holds
    /// nothing and has built no step adopts; a block that is out of range, named twice, or whose
    /// hash another block already caches is skipped. Returns how many were adopted.
    pub fn adopt_cached_blocks(
        &mut self,
        blocks: impl IntoIterator<Item = (BlockId, BlockHash)>,
    ) -> usize {
        if !self.requests.is_empty() || self.counters.steps > 0 {
            return 0;
        }
        blocks.into_iter().filter(|&(b, h)| self.pool.adopt(b, h)).count()
    }

    /// The configuration in force.
    #[must_use]
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// True while a request with this id exists (not yet retired); its id is not reusable.
    #[must_use]
    pub fn contains(&self, id: RequestId) -> bool {
        self.requests.contains(id)
    }

    /// Add a request. It enters `Waiting`, or `Receiving` if it has a KV import.
    ///
    /// # Errors
    ///
    /// [`AddError`] if the request is malformed, could never run on this cache, or reuses a
    /// live request id or transfer id; nothing is added then.
    pub fn add_request(&mut self, mut req: NewRequest) -> Result<(), AddError> {
        self.validate_new(&req)?;
        self.arrival_seq += 1;
        let import = req.kv_import;
        let export = req.kv_export;
        let priority = req.priority;
        if let Fork::Of(source) = req.fork {
            // The same tokens in one allocation: the fork finds its source by it, too.
            let s = self.requests.index_of(source).expect("validate_fork checked it is live");
            req.prompt = self.requests[s].prompt.clone();
        }
        let looped = self.cfg.looped.map(|m| {
            let loops = req.max_loops.unwrap_or(m.max_loops);
            (loops, m.planes(loops))
        });
        let mut r = Request::new(req, self.arrival_seq, self.cfg.block_size, looped);
        if let Some(imp) = import {
            r.status = RequestStatus::Receiving;
            r.cold.transfer = Some((imp.transfer_id, TransferState::ImportQueued));
            r.cold.import_tokens = imp.num_tokens;
            r.decision = Decision::ImportQueued;
        } else if let Some(tid) = export {
            r.cold.transfer = Some((tid, TransferState::ExportPlanned));
        }
        self.adapters.arrive(r.cold.adapter);
        let idx = self.requests.insert(r);
        if let Some(imp) = import {
            self.transfers.queue_import(imp.transfer_id, idx);
        } else {
            if let Some(tid) = export {
                self.transfers.reserve_export(tid, idx);
            }
            self.waiting.push_back(idx, priority);
        }
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
        // A continuation may import its prompt's KV (a disaggregated request moves to its
        // decode executor with the first token); a prefill-only request is always new.
        if !req.output.is_empty() && req.kv_export.is_some() {
            return Err(AddError::OutputWithTransfer(id));
        }
        if self.requests.contains(id) {
            return Err(AddError::DuplicateId(id));
        }
        let planes = self.validate_looped(req)?;
        // KV is computed for every token but the last sampled one.
        let blocks_needed = self.cfg.blocks_for(prompt_len + req.max_tokens - 1) * planes;
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
        self.validate_fork(req)?;
        let transfer_ids = req.kv_import.map(|i| i.transfer_id).into_iter().chain(req.kv_export);
        for transfer_id in transfer_ids {
            if self.transfers.contains(transfer_id) {
                return Err(AddError::DuplicateTransfer { id, transfer_id });
            }
        }
        Ok(())
    }

    /// A looped model's request asks for 1..=the model's loops and neither moves KV between
    /// nodes nor forks; a plain model's asks for no loops. Its KV planes per row.
    fn validate_looped(&self, req: &NewRequest) -> Result<usize, AddError> {
        let looped = |reason: String| Err(AddError::Looped { id: req.id, reason });
        if let Some(t) = req.exit_threshold.filter(|t| !(*t > 0.0 && *t <= 1.0)) {
            return looped(format!("exit_threshold must be in (0, 1], got {t}"));
        }
        let Some(model) = self.cfg.looped else {
            if let Some(loops) = req.max_loops {
                return looped(format!("max_loops {loops} asked of a model that does not loop"));
            }
            if req.exit_threshold.is_some() {
                return looped("exit_threshold asked of a model that does not loop".into());
            }
            return Ok(1);
        };
        let loops = req.max_loops.unwrap_or(model.max_loops);
        if !(1..=model.max_loops).contains(&loops) {
            return looped(format!("max_loops must be 1..={}, got {loops}", model.max_loops));
        }
        if req.kv_import.is_some() || req.kv_export.is_some() {
            return looped("a looped model's request cannot move its KV between nodes".into());
        }
        if req.fork != Fork::None {
            return looped("a looped model's request cannot share a prompt's KV (n > 1)".into());
        }
        Ok(usize::from(model.planes(loops)))
    }

    /// A sample's fork must name a live source with its prompt and salt; neither side may move
    /// KV between nodes or arrive with output (the fork shares a prompt computed here).
    fn validate_fork(&self, req: &NewRequest) -> Result<(), AddError> {
        let invalid = |reason| Err(AddError::InvalidFork { id: req.id, reason });
        if req.fork == Fork::None {
            return Ok(());
        }
        if req.kv_import.is_some() || req.kv_export.is_some() {
            return invalid("a sample of several cannot import or export its KV");
        }
        if !req.output.is_empty() {
            return invalid("a sample of several cannot arrive with output");
        }
        let Fork::Of(source) = req.fork else { return Ok(()) };
        let Some(s) = self.requests.index_of(source).map(|i| &self.requests[i]) else {
            return invalid("its source is not a live request");
        };
        if !s.cold.fork_source || s.status.is_finished() {
            return invalid("its source is not an unfinished Fork::Source");
        }
        if s.prompt != req.prompt || s.cold.salt != req.cache_salt {
            return invalid("its prompt or cache salt differs from its source's");
        }
        Ok(())
    }

    /// Abort a request in any state, also with a step in flight. Its resources are released
    /// (blocks behind the fence of the in-flight step; a KV transfer in progress keeps its
    /// blocks until reported) and its id becomes reusable once it retires.
    ///
    /// # Errors
    ///
    /// [`AbortError`] if no live request has this id or it has already finished.
    pub fn abort(&mut self, id: RequestId, now: Timestamp) -> Result<FinishedRequest, AbortError> {
        let idx = self.requests.index_of(id).ok_or(AbortError::Unknown(id))?;
        if self.requests[idx].status.is_finished() {
            return Err(AbortError::AlreadyFinished(id));
        }
        Ok(self.finish(idx, FinishReason::Abort, now))
    }

    // ---- shared helpers -------------------------------------------------------------------

    /// True if `idx` has work in the step being built.
    #[inline]
    fn scheduled_in_build(&self, idx: u32) -> bool {
        self.draft.is_open() && self.requests[idx].last_step.get() == Some(self.draft.step())
    }

    fn set_active(&mut self, idx: u32) {
        let pos = u32::try_from(self.active.len()).expect("arena entries are u32");
        self.active.push(idx);
        self.requests[idx].cold.active_pos = pos;
    }

    fn unset_active(&mut self, idx: u32) {
        let pos = self.requests[idx].cold.active_pos;
        if pos == u32::MAX {
            return;
        }
        self.active.swap_remove(pos as usize);
        if let Some(&moved) = self.active.get(pos as usize) {
            self.requests[moved].cold.active_pos = pos;
        }
        self.requests[idx].cold.active_pos = u32::MAX;
    }

    /// Keep `holders` = waiting requests with a non-empty block table.
    fn sync_holder(&mut self, idx: u32) {
        let r = &self.requests[idx];
        let should = r.status == RequestStatus::Waiting && !r.block_table.is_empty();
        let is = r.cold.holder_pos != u32::MAX;
        if should && !is {
            let pos = u32::try_from(self.holders.len()).expect("arena entries are u32");
            self.holders.push(idx);
            self.requests[idx].cold.holder_pos = pos;
        } else if !should && is {
            let pos = r.cold.holder_pos;
            self.holders.swap_remove(pos as usize);
            if let Some(&moved) = self.holders.get(pos as usize) {
                self.requests[moved].cold.holder_pos = pos;
            }
            self.requests[idx].cold.holder_pos = u32::MAX;
        }
    }

    /// Shrink the request's block table to `keep` blocks (tail first, so the prefix stays
    /// cached longest). Blocks an in-flight step may use go behind the fence. Returns how many
    /// blocks became free right now.
    fn release_blocks(&mut self, idx: u32, keep: usize) -> usize {
        let bs = self.cfg.block_size;
        debug_assert!(!self.scheduled_in_build(idx), "release of a request scheduled in this step");
        let r = &mut self.requests[idx];
        // Whole rows: a looped request's table holds one block per plane for each row.
        let planes = usize::from(r.planes);
        let keep = keep / planes * planes;
        if r.block_table.len() <= keep {
            return 0;
        }
        r.num_computed = r.num_computed.min(keep / planes * bs);
        if r.looped && r.cold.chain.tokens > 0 {
            // Its rows are gone (it finished, or lost its tail waiting): so is its chain.
            r.cold.chain.drop_chain();
        }
        r.set_registered(r.registered().min(keep));
        r.exec.sent_blocks = r.exec.sent_blocks.min(keep as u32);
        let step = r.last_step.get();
        let tail = r.block_table.drain(keep..).rev();
        let mut freed_now = 0;
        if self.steps.in_flight(step) {
            self.fences.hold(step.expect("in_flight implies a step"), tail);
        } else {
            for b in tail {
                self.pool.release(b);
                if self.pool.ref_count(b) == 0 {
                    freed_now += 1;
                }
            }
        }
        self.sync_holder(idx);
        freed_now
    }

    /// Move a request to `Finished(reason)`: drop its pending work, queue position and active
    /// membership, release its blocks (unless a KV transfer in progress still uses them) and
    /// queue its finish for the executor. It keeps its slot until it retires.
    fn finish(&mut self, idx: u32, reason: FinishReason, now: Timestamp) -> FinishedRequest {
        let was = self.requests[idx].status;
        debug_assert!(!was.is_finished(), "finishing a finished request");
        if was == RequestStatus::Transferring {
            self.transfers.left_transferring();
        }
        self.work.remove(idx);
        self.waiting.remove(idx);
        self.unset_active(idx);
        let r = &mut self.requests[idx];
        match r.cold.transfer {
            Some((
                tid,
                TransferState::ImportQueued
                | TransferState::ExportPlanned
                | TransferState::ExportQueued,
            )) => {
                // Not started: nothing on the executor uses its blocks yet.
                self.transfers.cancel(tid, idx);
                r.cold.transfer = None;
            }
            Some((_, TransferState::Importing | TransferState::Exporting)) | None => {}
        }
        r.status = RequestStatus::Finished(reason);
        r.decision = Decision::Finished;
        r.cold.times.finished = Some(now);
        // Blocks under an in-progress transfer stay until the transfer is reported (an export
        // sends them on; only a request that exports none is written to the KV tier).
        if r.cold.transfer.is_none() {
            if !r.prefill_only {
                self.queue_tier_store(idx);
            }
            self.release_blocks(idx, 0);
        }
        self.sync_holder(idx);
        if self.requests[idx].exec.known {
            self.to_report.push(idx);
        }
        self.counters.finished += 1;
        let finished = self.finished_record(idx, reason, now);
        self.try_retire(idx);
        finished
    }

    fn finished_record(&self, idx: u32, reason: FinishReason, now: Timestamp) -> FinishedRequest {
        let r = &self.requests[idx];
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
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // Every held block must be accounted for by a live request or a fence; a mismatch here
        // is a leak that `check_invariants` would also report.
        if cfg!(debug_assertions) && !std::thread::panicking() {
            let held = self.pool.num_blocks() - self.pool.num_free();
            let in_tables: usize = self.requests.iter().map(|(_, r)| r.block_table.len()).sum();
            debug_assert!(
                held <= in_tables + self.fences.fenced(),
                "{held} blocks held but only {} in tables/fences: leak",
                in_tables + self.fences.fenced()
            );
        }
    }
}
