//! Folding a step result back in: sampled tokens, stop checks, KV transfer reports, fences.
//!
//! Validation comes first and changes nothing observable, so a bad result (unknown step, out of
//! order, a token for a request that did not sample, a missing or duplicate token, an unknown
//! transfer) is rejected whole and can be retried corrected. A request the executor refused
//! samples nothing and finishes with an error, alone. Then, in order: tokens are
//! appended (and dropped for requests finished since the step was built — their step slot is
//! still accounted), stop rules run, in-flight references drop, the step's fence is lifted,
//! KV reports resolve, and requests that can retire do.

use crate::error::ApplyError;
use crate::outcome::{RequestEvent, SampledToken, StepOutcome};
use crate::prefetch::prefetch;
use crate::request::{Decision, FinishReason, RequestStatus, TransferState};
use crate::types::{RequestId, Timestamp, TransferId};
use crate::work_queues::Operation;

use super::inflight::{RecordEntry, StepRecord};
use super::Scheduler;

impl Scheduler {
    /// Apply the executor's result for the oldest in-flight step; events go to `events`
    /// (appended, not cleared).
    ///
    /// # Errors
    ///
    /// [`ApplyError`] if the result does not match the oldest step in flight (another step,
    /// a token missing, unexpected or twice, an unknown transfer); nothing changes then, so a
    /// corrected result can be applied.
    pub fn apply_result(
        &mut self,
        outcome: &StepOutcome,
        now: Timestamp,
        events: &mut Vec<RequestEvent>,
    ) -> Result<(), ApplyError> {
        let in_plan_order = self.validate_outcome(outcome)?;
        let record = self.steps.pop_oldest().expect("validated: a step is in flight");
        self.fences.lift_through(record.step_id, &mut self.pool);
        // Transfers first: none of them belongs to a request that samples in this step.
        for kv in &outcome.kv_results {
            self.resolve_transfer(kv.transfer_id, kv.ok, now, events);
        }
        // Refused requests end here, alone; their step slots drop below with everyone's. The
        // blocks they registered themselves (past their prefix-cache hits) leave the cache: a
        // block is registered when its step is built, and the refused step may not have
        // computed it.
        for &id in &outcome.refused {
            if let Some(idx) = self.requests.index_of(id) {
                let r = &self.requests[idx];
                let own = (r.cold.prefix_hit_tokens / self.cfg.block_size).min(r.registered());
                for b in own..r.registered().min(r.block_table.len()) {
                    self.pool.unregister(r.block_table[b]);
                }
                if !self.requests[idx].status.is_finished() {
                    let done = self.finish(idx, FinishReason::Error, now);
                    events.push(RequestEvent::Finished(Box::new(done)));
                }
            }
        }
        if self.cfg.looped.is_some() {
            // Chains first: a coda's result completes its chain, whose loops its token reports.
            for e in &record.entries {
                let exited = outcome.exited.contains(&e.id);
                let chain = &mut self.requests[e.idx].cold.chain;
                if chain.applied(record.step_id.0, exited) {
                    let c = &mut self.counters;
                    c.chains_completed += 1;
                    c.chain_loops += u64::from(chain.last_loops);
                    c.chains_exited_early += u64::from(chain.last_loops < chain.max_loops);
                }
            }
        }
        if !in_plan_order {
            let drafts = drafts_by_id(&record.entries);
            for group in outcome.sampled.chunk_by(|a, b| a.id == b.id) {
                let id = group[0].id;
                let idx = self.requests.index_of(id).expect("validated: id is live");
                let n = drafts.get(&id).copied().unwrap_or(0);
                self.apply_sampled(idx, id, group, n, now, events);
            }
        }
        // One pass over the step's requests. Each still holds this step's reference until its
        // turn, so nothing above retired it.
        let mut next = 0;
        for k in 0..record.entries.len() {
            self.prefetch_for_apply(&record.entries, k);
            let RecordEntry { idx, id, samples, drafts } = record.entries[k];
            if !in_plan_order && samples && outcome.refused.contains(&id) {
                self.requests[idx].placeholders -= 1; // refused: no token comes
            }
            if in_plan_order && samples {
                // The usual case: tokens in plan order, so the record names each slot (a
                // verification's one to 1 + drafts tokens in a row).
                let len = group_len(&outcome.sampled[next..], id, drafts);
                debug_assert!(len > 0, "validated: tokens for each sampling entry");
                let group = &outcome.sampled[next..next + len];
                next += len;
                self.apply_sampled(idx, id, group, drafts, now, events);
            }
            self.requests[idx].inflight_refs -= 1;
            self.requeue(idx);
            self.try_retire(idx);
        }
        self.steps.recycle(record);
        Ok(())
    }

    /// Prefetch what applying `entries[k + AHEAD]` will touch: its request's first two lines
    /// (all that applying a token reads) now, and the tail of its `output` buffer (a separate
    /// allocation, the costliest miss of the loop) once the request's first line, which holds
    /// the buffer's address, has had time to arrive.
    #[inline]
    fn prefetch_for_apply(&self, entries: &[RecordEntry], k: usize) {
        const AHEAD: usize = 8;
        if let Some(e) = entries.get(k + 2 * AHEAD) {
            self.requests.prefetch_lines(e.idx, &[0, 1]);
        }
        if let Some(r) = entries.get(k + AHEAD).and_then(|e| self.requests.get(e.idx)) {
            prefetch(r.output.as_ptr().wrapping_add(r.output.len()));
        }
    }

    /// Report the end of a KV transfer outside a step result (deadline, dead agent). Call it
    /// only when the executor no longer touches the transfer's blocks.
    ///
    /// # Errors
    ///
    /// [`ApplyError::UnknownTransfer`] if no transfer with this id is in progress.
    pub fn kv_transfer_finished(
        &mut self,
        transfer_id: TransferId,
        ok: bool,
        now: Timestamp,
        events: &mut Vec<RequestEvent>,
    ) -> Result<(), ApplyError> {
        if !self.transfer_in_progress(transfer_id) {
            return Err(ApplyError::UnknownTransfer(transfer_id));
        }
        self.resolve_transfer(transfer_id, ok, now, events);
        Ok(())
    }

    fn transfer_in_progress(&self, tid: TransferId) -> bool {
        self.transfers.request_of(tid).is_some_and(|idx| {
            matches!(
                self.requests[idx].cold.transfer,
                Some((t, TransferState::Importing | TransferState::Exporting)) if t == tid
            )
        })
    }

    /// Check a result against the oldest in-flight step without changing anything. Returns
    /// true if the sampled tokens are in plan order (the fast path).
    fn validate_outcome(&mut self, outcome: &StepOutcome) -> Result<bool, ApplyError> {
        let step = outcome.step_id;
        let Some(front) = self.steps.oldest() else {
            return Err(ApplyError::UnknownStep(step));
        };
        if front.step_id != step {
            if self.steps.contains(step) {
                return Err(ApplyError::OutOfOrder { got: step, expected: front.step_id });
            }
            return Err(ApplyError::UnknownStep(step));
        }
        for (i, kv) in outcome.kv_results.iter().enumerate() {
            let dup = outcome.kv_results[..i].iter().any(|o| o.transfer_id == kv.transfer_id);
            if dup || !self.transfer_in_progress(kv.transfer_id) {
                return Err(ApplyError::UnknownTransfer(kv.transfer_id));
            }
        }
        let record = self.steps.oldest().expect("checked above");
        for &id in &outcome.exited {
            // Only a request whose loop is this step's stage in flight may exit (one that was
            // preempted since has no stage in flight: its report is stale and ignored).
            let entry = record.entries.iter().find(|e| e.id == id);
            let Some(e) = entry else { return Err(ApplyError::UnexpectedExit { step, id }) };
            let r = &self.requests[e.idx];
            let ran_another_stage = matches!(r.cold.chain.in_flight,
                Some((s, op)) if s == step.0 && op != Operation::Recurrent);
            if !r.looped || ran_another_stage {
                return Err(ApplyError::UnexpectedExit { step, id });
            }
        }
        if outcome.refused.is_empty() {
            if record.verifies == 0 && outcome.sampled.len() == record.samples {
                let sampling = record.entries.iter().filter(|e| e.samples);
                let in_order = sampling.zip(&outcome.sampled).all(|(e, s)| e.id == s.id);
                if in_order {
                    return Ok(true);
                }
            } else if record.verifies > 0 && grouped_in_plan_order(record, &outcome.sampled) {
                return Ok(true);
            }
        }
        // Any order: two marks per attempt, "expected to sample" and "seen"; a fresh epoch
        // each time so a rejected attempt leaves nothing behind.
        let (expected, seen) = self.steps.next_outcome_epoch();
        let record = self.steps.oldest().expect("checked above");
        // A refused request samples nothing.
        let mut want = 0;
        for e in record.entries.iter().filter(|e| e.samples && !outcome.refused.contains(&e.id)) {
            self.requests[e.idx].cold.outcome_mark = expected;
            want += 1;
        }
        // A request's tokens come in a row: one, or for a verification up to 1 + drafts.
        let drafts = drafts_by_id(&record.entries);
        let mut groups = 0usize;
        for group in outcome.sampled.chunk_by(|a, b| a.id == b.id) {
            let id = group[0].id;
            let Some(idx) = self.requests.index_of(id) else {
                return Err(ApplyError::UnexpectedToken { step, id });
            };
            let r = &mut self.requests[idx];
            if r.cold.outcome_mark == seen {
                return Err(ApplyError::DuplicateToken { step, id });
            }
            if r.cold.outcome_mark != expected {
                return Err(ApplyError::UnexpectedToken { step, id });
            }
            let most = 1 + usize::from(drafts.get(&id).copied().unwrap_or(0));
            if group.len() > most {
                if most == 1 {
                    return Err(ApplyError::DuplicateToken { step, id });
                }
                return Err(ApplyError::TooManyTokens { step, id, got: group.len(), most });
            }
            r.cold.outcome_mark = seen;
            groups += 1;
        }
        if groups != want {
            return Err(ApplyError::MissingTokens { step, missing: want.saturating_sub(groups) });
        }
        Ok(false)
    }

    /// Apply the tokens live request `idx` (named `id`) sampled in one step: one, or for a
    /// verification of `drafts` draft tokens the ones it accepted and the one after them. A
    /// stop among them drops the rest. The rejected drafts' KV slots are free to be written
    /// again: its computed tokens go back to its known tokens but the last (the blocks stay,
    /// as in vLLM: the next tokens are written to them).
    fn apply_sampled(
        &mut self,
        idx: u32,
        id: RequestId,
        tokens: &[SampledToken],
        drafts: u16,
        now: Timestamp,
        events: &mut Vec<RequestEvent>,
    ) {
        self.requests[idx].placeholders -= 1;
        for s in tokens {
            self.append_token(idx, id, s.token, now, events);
        }
        if drafts > 0 {
            let accepted = tokens.len() - 1;
            let c = &mut self.counters;
            c.spec_drafts += 1;
            c.spec_draft_tokens += u64::from(drafts);
            c.spec_accepted_tokens += accepted as u64;
            for n in &mut c.spec_accepted_per_position[..accepted] {
                *n += 1;
            }
            let r = &mut self.requests[idx];
            if !r.status.is_finished() {
                r.num_computed = r.num_computed.min(r.num_tokens() - 1);
            }
            let most = self.cfg.speculative.map_or(1, |s| s.num_speculative_tokens);
            r.cold.verified(accepted, usize::from(drafts), most);
        }
    }

    /// Append a sampled token to live request `idx` (named `id`, passed in so that applying a
    /// token reads only the request's first two lines) and run its stop rules.
    fn append_token(
        &mut self,
        idx: u32,
        id: RequestId,
        token: u32,
        now: Timestamp,
        events: &mut Vec<RequestEvent>,
    ) {
        let max_model_len = self.cfg.max_model_len;
        let looped = self.cfg.looped.is_some();
        let r = &mut self.requests[idx];
        if !matches!(r.status, RequestStatus::Active | RequestStatus::Waiting) {
            return; // finished (or aborted) since the step was built: drop it
        }
        r.output.push(token);
        if r.output.len() == 1 {
            r.cold.times.first_token.get_or_insert(now);
        }
        debug_assert_eq!(r.id, id, "the record names the request in its slot");
        let index = r.output.len() - 1;
        let prefill_only = r.prefill_only;
        let stop = r.check_stop(max_model_len);
        self.counters.generation_tokens += 1;
        let loops = if looped { r.cold.chain.last_loops } else { 0 };
        events.push(RequestEvent::Token { id, token, index, loops });
        if let Some(reason) = stop {
            // Done with its first token (EOS, a stop token, max_tokens 1): nothing to hand on,
            // a prefill-only request included (its export id is released).
            let done = self.finish(idx, reason, now);
            events.push(RequestEvent::Finished(Box::new(done)));
        } else if prefill_only {
            self.start_transfer_out(idx, events);
        }
    }

    /// A prefill-only request's prompt is done: it becomes `Transferring`, keeps slot and
    /// blocks, and its export op goes out with the next step.
    fn start_transfer_out(&mut self, idx: u32, events: &mut Vec<RequestEvent>) {
        debug_assert_eq!(self.requests[idx].status, RequestStatus::Active);
        self.work.remove(idx);
        self.unset_active(idx);
        self.transfers.queue_export(idx);
        let r = &mut self.requests[idx];
        let (tid, _) = r.cold.transfer.expect("a prefill-only request has its export id reserved");
        r.status = RequestStatus::Transferring;
        r.cold.transfer = Some((tid, TransferState::ExportQueued));
        r.decision = Decision::Exporting;
        let id = r.id;
        events.push(RequestEvent::ExportStarted { id, transfer_id: tid });
    }

    /// The end of an import or export (validated to be in progress).
    fn resolve_transfer(
        &mut self,
        tid: TransferId,
        ok: bool,
        now: Timestamp,
        events: &mut Vec<RequestEvent>,
    ) {
        let idx = self.transfers.release(tid).expect("validated: transfer in progress");
        let r = &mut self.requests[idx];
        let (_, state) = r.cold.transfer.take().expect("validated: transfer in progress");
        let aborted = r.status.is_finished();
        match state {
            TransferState::Importing => {
                self.transfers.import_ended();
                if aborted {
                    self.release_blocks(idx, 0);
                } else {
                    let id = self.requests[idx].id;
                    events.push(RequestEvent::Imported { id, transfer_id: tid, ok });
                    self.finish_import(idx, ok, now);
                }
            }
            TransferState::Exporting => {
                self.release_blocks(idx, 0);
                if !aborted {
                    let reason = if ok { FinishReason::Transferred } else { FinishReason::Error };
                    let done = self.finish(idx, reason, now);
                    events.push(RequestEvent::Finished(Box::new(done)));
                }
            }
            TransferState::ImportQueued
            | TransferState::ExportPlanned
            | TransferState::ExportQueued => {
                debug_assert!(false, "validated: only in-progress transfers resolve");
            }
        }
        self.try_retire(idx);
    }

    /// An import ended: with its KV the request resumes (now if a slot is free, else from the
    /// front of the waiting queue holding its blocks); without, it is prefilled locally.
    fn finish_import(&mut self, idx: u32, ok: bool, now: Timestamp) {
        let bs = self.cfg.block_size;
        if ok {
            let caching = self.cfg.enable_prefix_caching;
            let r = &mut self.requests[idx];
            r.num_computed = r.cold.import_tokens;
            if caching {
                r.update_block_hashes(bs);
                let full =
                    (r.num_computed / bs).min(r.block_table.len()).min(r.cold.block_hashes.len());
                for b in r.registered()..full {
                    self.pool.register(r.block_table[b], r.cold.block_hashes[b]);
                }
                r.set_registered(r.registered().max(full));
            }
        } else {
            self.release_blocks(idx, 0);
        }
        let r = &mut self.requests[idx];
        let priority = r.priority;
        r.status = RequestStatus::Waiting;
        if ok && self.slots.has_free() && !self.awaits_adapter(idx) {
            self.activate(idx, now);
            self.requests[idx].decision = Decision::Admitted;
            self.requeue(idx);
        } else {
            self.requests[idx].decision = Decision::Queued;
            self.waiting.push_front(idx, priority);
            self.sync_holder(idx);
        }
    }
}

/// How many of `sampled`'s leading tokens belong to `id`, at most `1 + drafts`.
fn group_len(sampled: &[SampledToken], id: RequestId, drafts: u16) -> usize {
    let most = 1 + usize::from(drafts);
    sampled.iter().take(most).take_while(|s| s.id == id).count()
}

/// True if `sampled` holds, in plan order, one to `1 + drafts` tokens for each sampling entry
/// of `record` and nothing else.
fn grouped_in_plan_order(record: &StepRecord, sampled: &[SampledToken]) -> bool {
    let mut next = 0;
    for e in record.entries.iter().filter(|e| e.samples) {
        let len = group_len(&sampled[next..], e.id, e.drafts);
        if len == 0 {
            return false;
        }
        next += len;
    }
    next == sampled.len()
}

/// The draft counts of a step's verifications, by request (for a result out of plan order).
fn drafts_by_id(entries: &[RecordEntry]) -> rustc_hash::FxHashMap<RequestId, u16> {
    entries.iter().filter(|e| e.drafts > 0).map(|e| (e.id, e.drafts)).collect()
}
