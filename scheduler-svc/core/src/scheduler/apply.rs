//! Folding a step result back in: sampled tokens, stop checks, KV transfer reports, fences.
//!
//! Validation comes first and changes nothing observable, so a bad result (unknown step, out of
//! order, a token for a request that did not sample, a missing or duplicate token, an unknown
//! transfer) is rejected whole and can be retried corrected. Then, in order: tokens are
//! appended (and dropped for requests finished since the step was built — their step slot is
//! still accounted), stop rules run, in-flight references drop, the step's fence is lifted,
//! KV reports resolve, and requests that can retire do.

use crate::error::ApplyError;
use crate::outcome::{RequestEvent, StepOutcome};
use crate::prefetch::prefetch;
use crate::request::{Decision, FinishReason, RequestStatus, TransferState};
use crate::types::{RequestId, Timestamp, TransferId};

use super::Scheduler;

impl Scheduler {
    /// Apply the executor's result for the oldest in-flight step; events go to `events`
    /// (appended, not cleared).
    pub fn apply_result(
        &mut self,
        outcome: &StepOutcome,
        now: Timestamp,
        events: &mut Vec<RequestEvent>,
    ) -> Result<(), ApplyError> {
        let in_plan_order = self.validate_outcome(outcome)?;
        let mut record = self.inflight.pop_front().expect("validated: a step is in flight");
        let step = record.step_id;
        self.last_applied = step.0;
        self.release_fence(step);
        // Transfers first: none of them belongs to a request that samples in this step.
        for kv in &outcome.kv_results {
            self.resolve_transfer(kv.transfer_id, kv.ok, now, events);
        }
        if !in_plan_order {
            for s in &outcome.sampled {
                let idx = *self.by_id.get(&s.id).expect("validated: id is live");
                self.req_mut(idx).placeholders -= 1;
                self.append_token(idx, s.id, s.token, now, events);
            }
        }
        // One pass over the step's requests. Each still holds this step's reference until its
        // turn, so nothing above retired it.
        let mut sampled = outcome.sampled.iter();
        for k in 0..record.entries.len() {
            self.prefetch_for_apply(&record.entries, k);
            let super::RecordEntry { idx, id, samples } = record.entries[k];
            if in_plan_order && samples {
                // The usual case: tokens in plan order, so the record names each slot.
                let s = sampled.next().expect("validated: one token per sampling entry");
                self.req_mut(idx).placeholders -= 1;
                self.append_token(idx, id, s.token, now, events);
            }
            self.req_mut(idx).inflight_refs -= 1;
            self.requeue(idx);
            self.try_retire(idx);
        }
        record.recycle();
        self.spare_records.push(record);
        Ok(())
    }

    /// Prefetch what applying `entries[k + AHEAD]` will touch: its request's first two lines
    /// (all that applying a token reads) now, and the tail of its `output` buffer (a separate
    /// allocation, the costliest miss of the loop) once the request's first line, which holds
    /// the buffer's address, has had time to arrive.
    #[inline]
    fn prefetch_for_apply(&self, entries: &[super::RecordEntry], k: usize) {
        const AHEAD: usize = 8;
        if let Some(e) = entries.get(k + 2 * AHEAD) {
            self.prefetch_request_lines(e.idx, &[0, 1]);
        }
        if let Some(e) = entries.get(k + AHEAD) {
            if let Some(r) = &self.slab[e.idx as usize] {
                prefetch(r.output.as_ptr().wrapping_add(r.output.len()));
            }
        }
    }

    /// Report the end of a KV transfer outside a step result (deadline, dead agent). Call it
    /// only when the executor no longer touches the transfer's blocks.
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
        self.transfers.get(&tid).is_some_and(|&idx| {
            matches!(
                self.req(idx).cold.transfer,
                Some((t, TransferState::Importing | TransferState::Exporting)) if t == tid
            )
        })
    }

    /// Check a result against the oldest in-flight step without changing anything. Returns
    /// true if the sampled tokens are in plan order (the fast path).
    fn validate_outcome(&mut self, outcome: &StepOutcome) -> Result<bool, ApplyError> {
        let step = outcome.step_id;
        let Some(front) = self.inflight.front() else {
            return Err(ApplyError::UnknownStep(step));
        };
        if front.step_id != step {
            if self.inflight.iter().any(|r| r.step_id == step) {
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
        let record = self.inflight.front().expect("checked above");
        if outcome.sampled.len() == record.samples {
            let sampling = record.entries.iter().filter(|e| e.samples);
            let in_order = sampling.zip(&outcome.sampled).all(|(e, s)| e.id == s.id);
            if in_order {
                return Ok(true);
            }
        }
        // Any order: two marks per attempt, "expected to sample" and "seen"; a fresh epoch
        // each time so a rejected attempt leaves nothing behind.
        self.outcome_epoch += 2;
        let expected = self.outcome_epoch;
        let seen = expected + 1;
        let record = self.inflight.front().expect("checked above");
        for e in &record.entries {
            if e.samples {
                self.slab[e.idx as usize]
                    .as_mut()
                    .expect("in-flight entries are live")
                    .cold
                    .outcome_mark = expected;
            }
        }
        let want = record.samples;
        for s in &outcome.sampled {
            let Some(&idx) = self.by_id.get(&s.id) else {
                return Err(ApplyError::UnexpectedToken { step, id: s.id });
            };
            let r = self.req_mut(idx);
            if r.cold.outcome_mark == seen {
                return Err(ApplyError::DuplicateToken { step, id: s.id });
            }
            if r.cold.outcome_mark != expected {
                return Err(ApplyError::UnexpectedToken { step, id: s.id });
            }
            r.cold.outcome_mark = seen;
        }
        if outcome.sampled.len() != want {
            return Err(ApplyError::MissingTokens {
                step,
                missing: want.saturating_sub(outcome.sampled.len()),
            });
        }
        Ok(false)
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
        let r = self.req_mut(idx);
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
        events.push(RequestEvent::Token { id, token, index });
        if prefill_only {
            self.start_transfer_out(idx, events);
        } else if let Some(reason) = stop {
            let done = self.finish(idx, reason, now);
            events.push(RequestEvent::Finished(Box::new(done)));
        }
    }

    /// A prefill-only request's prompt is done: it becomes `Transferring`, keeps slot and
    /// blocks, and its export op goes out with the next step.
    fn start_transfer_out(&mut self, idx: u32, events: &mut Vec<RequestEvent>) {
        debug_assert_eq!(self.req(idx).status, RequestStatus::Active);
        self.work.remove(idx);
        self.unset_active(idx);
        self.exports_pending.push(idx);
        self.transferring += 1;
        let r = self.req_mut(idx);
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
        let idx = self.transfers.remove(&tid).expect("validated: transfer in progress");
        let (_, state) =
            self.req_mut(idx).cold.transfer.take().expect("validated: transfer in progress");
        let aborted = self.req(idx).status.is_finished();
        match state {
            TransferState::Importing => {
                self.importing -= 1;
                if aborted {
                    self.release_blocks(idx, 0);
                } else {
                    let id = self.req(idx).id;
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
            let r = self.slab[idx as usize].as_mut().expect("live importing request");
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
        let priority = self.req(idx).priority;
        self.req_mut(idx).status = RequestStatus::Waiting;
        if ok && self.slots.has_free() {
            self.activate(idx, now);
            self.req_mut(idx).decision = Decision::Admitted;
            self.requeue(idx);
        } else {
            self.req_mut(idx).decision = Decision::Queued;
            self.waiting.push_front(idx, priority);
            self.sync_holder(idx);
        }
    }
}
