//! Building one step: decodes, then running prompt work, then (if nothing was preempted) the
//! admission of waiting requests (`admission`, with parallel samples' forks in `fork`), then KV
//! imports and exports.
//!
//! Cost: each phase pops only the work it looks at. A running request is visited at most once
//! per step (`visited_step`), re-queued at the back after it is scheduled (so queues rotate and
//! nobody is starved by position), and admission stops after `lookahead` waiting requests, at
//! the first one that does not fit (head-of-line: a large request is not overtaken forever by
//! small ones), or when slots or budget run out. Nothing here walks a whole queue, so a long
//! waiting queue does not make a step slower.
//!
//! Invariants kept: the plan's tokens never exceed the budget (`budget` is decremented before
//! an entry is pushed and given back on rollback); a request is scheduled at most once per
//! step; blocks are allocated before tokens are counted as computed.

use crate::error::ScheduleError;
use crate::plan::{ScheduledWork, Span, StepPlan};
use crate::prefetch::prefetch;
use crate::request::{Decision, RequestStatus, StepMark, TransferState};

use crate::looped::{LoopedModel, StagePolicy, StageSelection};
use crate::types::Timestamp;
use crate::work_queues::{Operation, WorkKey};

use super::preempt::Room;
use super::Scheduler;

impl Scheduler {
    /// Build the next step. The plan is borrowed from the scheduler and rebuilt in place by the
    /// next call; its result must be applied with [`Scheduler::apply_result`] (in step order)
    /// before more than `max_steps_in_flight` steps are outstanding.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::TooManyStepsInFlight`] if `max_steps_in_flight` steps await their
    /// results; nothing changes then.
    pub fn schedule(&mut self, now: Timestamp) -> Result<&StepPlan, ScheduleError> {
        self.schedule_throttled(now, false)
    }

    /// [`Scheduler::schedule`] for a step of a data-parallel group that the group marks as
    /// throttled (`throttle`: not one of its aligned prefill rounds): unless requests were
    /// left waiting by the last step that did not defer, or no running request decodes, the
    /// step runs decodes only — no prompt chunk, no admission (vLLM's `defer_prefills`; see
    /// `throttle`).
    ///
    /// # Errors
    ///
    /// As [`Scheduler::schedule`].
    pub fn schedule_throttled(
        &mut self,
        now: Timestamp,
        throttle: bool,
    ) -> Result<&StepPlan, ScheduleError> {
        if self.steps.len() >= self.cfg.max_steps_in_flight {
            return Err(ScheduleError::TooManyStepsInFlight(self.steps.len()));
        }
        let defer = self.defers_prefills(throttle);
        let record = self.steps.open();
        self.draft.open(record, self.cfg.max_num_batched_tokens);

        self.report_finished();
        if let Some(model) = self.cfg.looped {
            self.schedule_stages(model, defer, now);
        } else {
            self.schedule_running(WorkKey::Decode, now);
            self.schedule_running(WorkKey::Verify, now);
            if !defer {
                self.schedule_running(WorkKey::Prompt, now);
                self.schedule_running(WorkKey::PromptChunk, now);
            }
            if self.draft.admits() {
                if !defer {
                    self.admit_waiting(now);
                }
                self.start_imports();
            }
        }
        self.note_prefill_capacity(defer);
        self.start_exports();
        self.store_tier_blocks();
        self.finalize();
        Ok(self.draft.plan())
    }

    /// A looped model's step: the first operation in the selection's order that schedules
    /// something runs, over the whole batch (see `looped`). Under [`StagePolicy::Separate`] its
    /// prompt work runs only in a step without its decode work; admission starts chains, so it
    /// belongs to the prelude.
    fn schedule_stages(&mut self, model: LoopedModel, defer: bool, now: Timestamp) {
        let full = self.cfg.max_num_batched_tokens;
        let separate = model.policy == StagePolicy::Separate;
        for &op in self.stage_order(model.selection) {
            for key in LoopedModel::keys(op, defer).into_iter().flatten() {
                if separate && self.draft.budget() < full {
                    break;
                }
                self.schedule_running(key, now);
            }
            let scheduled = self.draft.budget() < full;
            if op == Operation::Prelude && !defer && self.draft.admits() && !(separate && scheduled)
            {
                self.admit_waiting(now);
            }
            if self.draft.budget() < full {
                self.draft.set_operation(op);
                return;
            }
        }
    }

    /// The operations a step tries, in order, until one schedules something.
    fn stage_order(&self, selection: StageSelection) -> &'static [Operation] {
        match selection {
            StageSelection::DeepestFirst => {
                &[Operation::Coda, Operation::Recurrent, Operation::Prelude]
            }
            // Chosen by which queues hold candidates, with no fall-through (see
            // `StageSelection::PreludeFirst`).
            StageSelection::PreludeFirst => {
                let prelude =
                    self.work.len(WorkKey::PromptPrelude) + self.work.len(WorkKey::DecodePrelude);
                let deep = self.work.len(WorkKey::PromptRecurrent)
                    + self.work.len(WorkKey::DecodeRecurrent);
                if prelude > 0 || self.waiting.len() > 0 {
                    &[Operation::Prelude]
                } else if deep > 0 {
                    &[Operation::Recurrent]
                } else {
                    &[Operation::Coda]
                }
            }
        }
    }

    /// The plan built by the last [`Scheduler::schedule`] call.
    #[must_use]
    pub fn last_plan(&self) -> &StepPlan {
        self.draft.plan()
    }

    /// Put finished requests the executor knows into the plan and retire what can be.
    fn report_finished(&mut self) {
        let mut to_report = std::mem::take(&mut self.to_report);
        for &idx in &to_report {
            let r = &mut self.requests[idx];
            r.finish_reported = true;
            self.draft.finished(r.id);
            self.try_retire(idx);
        }
        to_report.clear();
        self.to_report = to_report;
    }

    /// The kind of work `idx` needs next, or `None` if it must wait for a result.
    pub(super) fn next_work(&self, idx: u32) -> Option<WorkKey> {
        let r = &self.requests[idx];
        if r.output_capped(self.cfg.max_model_len) {
            return None;
        }
        if r.looped {
            return self.next_stage(idx);
        }
        let remaining = r.remaining();
        if remaining == 0 {
            None
        } else if remaining == 1 && r.num_computed >= r.prompt.len() {
            // A request that may speculate waits for its sample: a draft continues the last
            // token, so its next work is chosen (and proposed) when that token is known.
            let waits = r.placeholders > 0 && r.speculate && self.cfg.speculative.is_some();
            (!waits).then_some(WorkKey::Decode)
        } else if !self.cfg.enable_chunked_prefill
            && remaining <= self.cfg.max_num_batched_tokens
            && r.fork_cap(r.num_computed) >= remaining
        {
            Some(WorkKey::Prompt)
        } else {
            Some(WorkKey::PromptChunk)
        }
    }

    /// A looped request's next work: its chain's next stage, nothing while a stage of it is in
    /// flight, else the prelude of its next chain (a decode's, or a prompt chunk's).
    #[cold]
    #[inline(never)]
    fn next_stage(&self, idx: u32) -> Option<WorkKey> {
        let r = &self.requests[idx];
        let chain = &r.cold.chain;
        if chain.tokens > 0 {
            let start = r.num_computed - chain.tokens as usize;
            let prompt = chain.tokens > 1 || start < r.prompt.len();
            return chain.next_op().and_then(|op| WorkKey::stage(op, prompt));
        }
        match r.remaining() {
            0 => None,
            1 if r.num_computed >= r.prompt.len() => Some(WorkKey::DecodePrelude),
            _ => Some(WorkKey::PromptPrelude),
        }
    }

    /// Queue the next work of an `Active` request that has none pending: a decode becomes a
    /// `Verify` when the request has a draft proposal.
    pub(super) fn requeue(&mut self, idx: u32) {
        if self.requests[idx].status != RequestStatus::Active || self.work.pending(idx).is_some() {
            return;
        }
        if let Some(key) = self.next_work(idx) {
            let key =
                if key == WorkKey::Decode && self.propose(idx) { WorkKey::Verify } else { key };
            self.work.enqueue(key, idx);
        }
    }

    /// Propose draft tokens for decode-ready `idx` into its `draft` (see `speculation`); true if it
    /// has some. Only a request whose every token is known (no sample in flight) proposes: a
    /// proposal continues the last token, and the draft must leave room for the token the
    /// verification samples after it (`max_tokens`, the model's length). A request whose last
    /// verifications accepted fewer than half their drafts skips proposals for a while (1, 3,
    /// 7, … decodes, up to 63) and proposes half as many tokens (doubled again, up to the
    /// configured number, by each draft accepted whole), and
    /// none proposes while more than `disable_by_batch_size` run.
    fn propose(&mut self, idx: u32) -> bool {
        let Some(spec) = self.cfg.speculative else { return false };
        let r = &mut self.requests[idx];
        if !r.speculate {
            return false;
        }
        debug_assert_eq!(r.placeholders, 0, "next_work holds a speculating request's decode back");
        r.cold.draft.clear();
        if r.cold.spec_skip > 0 {
            r.cold.spec_skip -= 1; // its recent drafts failed: back off
            return false;
        }
        if spec.disable_by_batch_size.is_some_and(|n| self.active.len() > n) {
            return false;
        }
        let len = r.cold.draft_len(spec.num_speculative_tokens);
        let room = (r.max_tokens as usize)
            .saturating_sub(r.output.len() + 1)
            .min(self.cfg.max_model_len.saturating_sub(r.num_tokens() + 1))
            .min(len);
        crate::speculation::propose_ngram(
            &r.prompt,
            &r.output,
            spec.prompt_lookup_min,
            spec.prompt_lookup_max,
            room,
            &mut r.cold.draft,
        ) > 0
    }

    /// Tokens a request gets for `key` work within the remaining budget (0: not this step).
    fn tokens_for(&self, idx: u32, key: WorkKey) -> usize {
        let remaining = self.requests[idx].remaining();
        let budget = self.draft.budget();
        match key {
            WorkKey::Decode | WorkKey::DecodePrelude => remaining.min(1).min(budget),
            // The last token and each draft token, as far as the budget goes.
            WorkKey::Verify => (remaining + self.requests[idx].cold.draft.len()).min(budget),
            WorkKey::Prompt if remaining > budget => 0,
            WorkKey::Prompt => remaining,
            WorkKey::PromptChunk => {
                let r = &self.requests[idx];
                remaining.min(self.cfg.chunk_cap()).min(budget).min(r.fork_cap(r.num_computed))
            }
            WorkKey::PromptPrelude if !self.cfg.enable_chunked_prefill && remaining > budget => 0,
            WorkKey::PromptPrelude if !self.cfg.enable_chunked_prefill => remaining,
            WorkKey::PromptPrelude => remaining.min(self.cfg.chunk_cap()).min(budget),
            // A chain's later stages take all its tokens in one step, or wait.
            _ => {
                let chain = self.requests[idx].cold.chain.tokens as usize;
                if chain > budget {
                    0
                } else {
                    chain
                }
            }
        }
    }

    /// Schedule the running requests pending `key`, front to back, once each.
    fn schedule_running(&mut self, key: WorkKey, now: Timestamp) {
        let step = self.draft.step().0;
        while let Some(idx) = self.work.front(key) {
            if self.requests[idx].visited_step == step || self.draft.budget() == 0 {
                break;
            }
            self.work.remove(idx);
            self.requests[idx].visited_step = step;
            let n = self.tokens_for(idx, key);
            if n == 0 {
                self.requests[idx].decision = Decision::NoBudget;
                self.work.enqueue(key, idx);
                continue;
            }
            // A verification the budget cut short carries fewer draft tokens; cut to none, it
            // is a decode.
            let key = if key == WorkKey::Verify {
                let draft = &mut self.requests[idx].cold.draft;
                draft.truncate(n - 1);
                if draft.is_empty() {
                    WorkKey::Decode
                } else {
                    WorkKey::Verify
                }
            } else {
                key
            };
            let need = self.blocks_needed(idx, key, n);
            if need > 0 {
                match self.make_room(idx, need, now) {
                    Room::Ready => {}
                    Room::FenceWait => {
                        self.draft.fence_wait();
                        self.requests[idx].decision = Decision::FenceWait;
                        self.work.enqueue(key, idx);
                        continue;
                    }
                    Room::SelfPreempted => continue,
                }
            }
            self.commit_work(idx, key, n, need);
        }
    }

    /// New blocks `idx` needs for `n` tokens of `key` work: the rows its computed tokens reach,
    /// in every KV plane (one for a plain request); a looped chain's later stages need none.
    pub(super) fn blocks_needed(&self, idx: u32, key: WorkKey, n: usize) -> usize {
        // `key` is the caller's loop constant: the test costs a plain request nothing.
        if matches!(key.operation(), Operation::Recurrent | Operation::Coda) {
            return 0;
        }
        let r = &self.requests[idx];
        let blocks = self.cfg.blocks_for(r.num_computed + n) * usize::from(r.planes);
        blocks.saturating_sub(r.block_table.len())
    }

    /// Allocate `new_blocks`, count `n` tokens as computed, add the entry to the plan and queue
    /// the request's next work. The caller made sure the blocks are free.
    ///
    /// Everything a scheduled request needs for the step record happens here, in one visit;
    /// `finalize` only revisits the few with an executor diff or blocks to register.
    pub(super) fn commit_work(&mut self, idx: u32, key: WorkKey, n: usize, new_blocks: usize) {
        let pos = self.draft.next_position();
        let step = StepMark::of(self.draft.step());
        let bs = self.cfg.block_size;
        let caching = self.cfg.enable_prefix_caching;
        let r = &mut self.requests[idx];
        debug_assert_ne!(r.last_step, step, "scheduled twice in one step");
        let table_before = r.block_table.len();
        // Straight into the table, which was sized for the whole request when it was added.
        let ok = self.pool.allocate(new_blocks, &mut r.block_table);
        debug_assert!(ok, "commit_work called without the blocks being free");
        r.new_blocks_this_step =
            u32::try_from(r.block_table.len() - table_before).expect("at most num_blocks");
        // A verification computes past the known tokens (its draft) and always samples.
        let drafts = if key == WorkKey::Verify { n - 1 } else { 0 };
        let (samples, loop_index) = if key.operation() == Operation::Whole {
            r.num_computed += n;
            (r.num_computed == r.num_tokens() + r.placeholders as usize + drafts, 0)
        } else {
            looped_commit(r, key, n, step)
        };
        debug_assert!(samples || key != WorkKey::Verify, "a verify continues the last token");
        if samples {
            r.placeholders += 1;
        }
        r.sched_index = pos;
        r.prev_last_step = r.last_step;
        r.last_step = step;
        r.inflight_refs += 1;
        r.decision = Decision::Scheduled;
        let followup = !r.exec.known
            || r.exec.needs_resume
            || r.block_table.len() > r.exec.sent_blocks as usize
            || (caching && !r.looped && r.num_computed.min(r.num_tokens()) / bs > r.registered());
        let draft = if drafts > 0 {
            debug_assert_eq!(r.cold.draft.len(), drafts, "schedule_running cut the draft to n - 1");
            self.draft.push_draft(&r.cold.draft)
        } else {
            Span::default()
        };
        let work = ScheduledWork {
            id: r.id,
            work: key,
            num_tokens: n,
            samples_token: samples,
            draft,
            loop_index,
        };
        self.draft.add_work(idx, work, followup);
        if key.is_prompt() && matches!(key.operation(), Operation::Whole | Operation::Prelude) {
            self.counters.prompt_tokens += n as u64;
        }
        self.requeue(idx);
    }

    /// Allocate blocks for queued KV imports, at most `max_kv_fetches` in progress.
    fn start_imports(&mut self) {
        let bs = self.cfg.block_size;
        while self.transfers.importing() < self.cfg.max_kv_fetches {
            let Some(idx) = self.transfers.next_import() else {
                break;
            };
            let tokens = self.requests[idx].cold.import_tokens;
            // Blocks already cached locally need not travel.
            let (hit_blocks, evictable) = self.prefix_lookup(idx, tokens / bs);
            let need = self.cfg.blocks_for(tokens) - hit_blocks;
            if need + evictable > self.pool.num_free() {
                self.requests[idx].decision = Decision::NoBlocks;
                break;
            }
            self.transfers.start_import(idx);
            self.take_prefix_hits(idx, hit_blocks);
            let r = &mut self.requests[idx];
            let first_new = r.block_table.len();
            let ok = self.pool.allocate(need, &mut r.block_table);
            debug_assert!(ok, "import blocks checked free");
            r.set_registered(hit_blocks);
            r.decision = Decision::Importing;
            let (tid, _) = r.cold.transfer.expect("a queued import has a transfer");
            r.cold.transfer = Some((tid, TransferState::Importing));
            let full = (tokens / bs).min(r.cold.block_hashes.len());
            let hashes = &r.cold.block_hashes[hit_blocks.min(full)..full];
            self.draft.import(idx, r.id, tid, &r.block_table[first_new..], hashes, tokens);
        }
    }

    /// Issue the export op of every request that became `Transferring` since the last step.
    fn start_exports(&mut self) {
        let bs = self.cfg.block_size;
        for &idx in self.transfers.exports_pending() {
            let r = &mut self.requests[idx];
            let (tid, _) = r.cold.transfer.expect("a queued export has a transfer");
            r.cold.transfer = Some((tid, TransferState::Exporting));
            r.decision = Decision::Exporting;
            r.update_block_hashes(bs);
            let num_tokens = r.num_computed.min(r.num_tokens());
            let full = (num_tokens / bs).min(r.cold.block_hashes.len());
            let hashes = &r.cold.block_hashes[..full];
            self.draft.export(idx, r.id, tid, &r.block_table, hashes, num_tokens);
        }
        self.transfers.clear_exports_pending();
    }

    /// Compute the executor diff and register computed full blocks for the requests that need
    /// it, seal the draft (compacting rolled-back entries) and record the step as in flight.
    fn finalize(&mut self) {
        let step = StepMark::of(self.draft.step());
        let bs = self.cfg.block_size;
        // Two passes so the prefix-cache inserts, random accesses into a large table, are all
        // requested (prefetched) before the first one is made. Registration order is the
        // followup order either way, so which block wins a shared hash does not change.
        let mut followups = self.draft.take_followups();
        let mut to_register = 0;
        for k in 0..followups.len() {
            self.prefetch_for_followup(&followups, k);
            let idx = followups[k];
            if !self.scheduled_in_build(idx) {
                continue; // rolled back by a preemption later in the step
            }
            let tokens = self.draft.work_at(self.requests[idx].sched_index).num_tokens;
            self.diff_for_executor(idx, tokens);
            let r = &mut self.requests[idx];
            let full = r.num_computed.min(r.num_tokens()) / bs;
            if self.cfg.enable_prefix_caching && !r.looped && full > r.registered() {
                r.update_block_hashes(bs);
                let upto = full.min(r.block_table.len()).min(r.cold.block_hashes.len());
                for &h in &r.cold.block_hashes[r.registered().min(upto)..upto] {
                    self.pool.prefetch_register(h);
                }
                prefetch(r.block_table.as_ptr().wrapping_add(r.registered()));
                followups[to_register] = idx;
                to_register += 1;
            }
        }
        for &idx in &followups[..to_register] {
            let r = &mut self.requests[idx];
            let full = r.num_computed.min(r.num_tokens()) / bs;
            let upto = full.min(r.block_table.len()).min(r.cold.block_hashes.len());
            for b in r.registered()..upto {
                self.pool.register(r.block_table[b], r.cold.block_hashes[b]);
            }
            r.set_registered(r.registered().max(upto));
        }
        self.draft.recycle_followups(followups);
        // A source whose block is copied in this step but that has no work in it: the step
        // still reads its blocks, so it references the source (its blocks are fenced by it).
        for k in 0..self.draft.copy_sources().len() {
            let source = self.draft.copy_sources()[k];
            if !self.scheduled_in_build(source) {
                self.draft.reference(source, self.requests[source].id);
            }
        }
        let record = self.draft.close(self.cfg.max_num_batched_tokens);
        for idx in self.draft.kv_requests() {
            let r = &mut self.requests[idx];
            r.inflight_refs += 1;
            r.last_step = step;
        }
        self.steps.push(record);
        self.counters.steps += 1;
        self.pool.take_changes(self.draft.cache_changes());
    }

    /// Prefetch what `finalize` will touch for `followups[k + AHEAD]` and beyond: most
    /// followups hash a block that just filled, which reads three lines no step loop has touched
    /// for a while (the cold part, the tail of its hash chain, the block's output tokens), each
    /// a dependent miss. Three stages, so each address is read from a line already requested.
    #[inline]
    fn prefetch_for_followup(&self, followups: &[u32], k: usize) {
        const AHEAD: usize = 8;
        if let Some(&j) = followups.get(k + 3 * AHEAD) {
            self.requests.prefetch_lines(j, &[0, 1, 2]);
        }
        let bs = self.cfg.block_size;
        if let Some(r) = followups.get(k + 2 * AHEAD).and_then(|&j| self.requests.get(j)) {
            prefetch(&raw const *r.cold);
            // The last full block of known tokens, when it lies in the output.
            let full = r.num_tokens() / bs;
            if let Some(start) = (full.saturating_sub(1) * bs).checked_sub(r.prompt.len()) {
                let p = r.output.as_ptr().wrapping_add(start);
                prefetch(p);
                prefetch(p.wrapping_add(bs - 1));
            }
        }
        if let Some(r) = followups.get(k + AHEAD).and_then(|&j| self.requests.get(j)) {
            let hashes = &r.cold.block_hashes;
            prefetch(hashes.as_ptr().wrapping_add(hashes.len().saturating_sub(1)));
        }
    }

    /// Add the executor-facing diff for a scheduled request: new, resumed, or new blocks.
    fn diff_for_executor(&mut self, idx: u32, scheduled_tokens: usize) {
        let r = &mut self.requests[idx];
        let computed_before = r.num_computed - scheduled_tokens;
        let table_len = r.block_table.len();
        if !r.exec.known {
            let loops = r.cold.chain.max_loops;
            let (prompt, output, table) = (&r.prompt, &r.output, &r.block_table);
            self.draft.new_request(r.id, prompt, output, table, computed_before, loops);
        } else if r.exec.needs_resume {
            let tokens: [&[_]; 2] = [&r.prompt, &r.output];
            self.draft.resumed_request(r.id, &r.block_table, &tokens, computed_before);
        } else if table_len > r.exec.sent_blocks as usize {
            let new = &r.block_table[r.exec.sent_blocks as usize..];
            self.draft.new_blocks(r.id, new, computed_before);
        }
        r.exec.known = true;
        r.exec.needs_resume = false;
        r.exec.sent_blocks = table_len as u32;
    }
}

/// [`Scheduler::commit_work`]'s part for a looped request's stage `key` of `n` tokens in
/// `step`: a chain's tokens count as computed at its prelude (their rows are allocated then),
/// only its coda samples, and its chain notes the stage. Whether it samples, and the loop a
/// recurrent stage runs (0 otherwise). Out of line: plain requests never come here.
#[cold]
#[inline(never)]
fn looped_commit(
    r: &mut crate::request::Request,
    key: WorkKey,
    n: usize,
    step: StepMark,
) -> (bool, u8) {
    let op = key.operation();
    if op == Operation::Prelude {
        r.num_computed += n;
    }
    let samples =
        op == Operation::Coda && r.num_computed == r.num_tokens() + r.placeholders as usize;
    r.cold.chain.schedule(op, step.get().map_or(0, |s| s.0), n as u32);
    (samples, if op == Operation::Recurrent { r.cold.chain.loops } else { 0 })
}
