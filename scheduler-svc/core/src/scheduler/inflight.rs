//! Steps in flight: the record of every step built and sent whose result has not been applied,
//! and the step numbering.
//!
//! Why: applying a result must find, without looking anything up by id, every request the step
//! referenced (to append its token, drop its in-flight reference and maybe retire it), and must
//! refuse a result for a step that is not the oldest one in flight. A [`StepRecord`] keeps that
//! list in plan order, so in the usual case the sampled tokens are matched to requests by
//! position. "Is step N still in flight" is also what decides whether released blocks must be
//! fenced ([`InflightSteps::in_flight`]).
//!
//! Lifetime: a record is opened when a step starts being built ([`InflightSteps::open`]), joins
//! the queue when the step is sent ([`InflightSteps::push`]) and leaves it when the step's
//! result is applied; its vectors are then recycled for a later step, so steady-state steps
//! allocate no records.
//!
//! Invariants kept (see [`InflightSteps::check`]): the records in flight are exactly the steps
//! `last_applied + 1 ..= last_built`, in order, at most `max_steps_in_flight` of them; each
//! record's `samples` counts its sampling entries; recycled records are empty. (That each
//! request's `inflight_refs` equals the records naming it is checked by `check_invariants`.)

use std::collections::VecDeque;

use crate::types::{RequestId, StepId};

/// One request referenced by a built step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecordEntry {
    /// Arena entry (valid while the step is in flight: the request cannot retire before).
    pub(crate) idx: u32,
    /// The request's id, to match the result without touching the request.
    pub(crate) id: RequestId,
    /// The step samples a token for it.
    pub(crate) samples: bool,
    /// Draft tokens its `Verify` work carries (0 for other work): the result brings one to
    /// `1 + drafts` tokens for it.
    pub(crate) drafts: u16,
}

/// One built step whose result has not been applied yet.
#[derive(Debug, Default)]
pub(crate) struct StepRecord {
    pub(crate) step_id: StepId,
    /// Every request the step references: first its scheduled work, in plan order (parallel
    /// to `StepPlan::scheduled`), then the requests with a KV op.
    pub(crate) entries: Vec<RecordEntry>,
    /// Entries that sample a token (the number of tokens the result must carry, plus up to
    /// one per draft token of a verification).
    pub(crate) samples: usize,
    /// Entries that verify draft tokens.
    pub(crate) verifies: usize,
}

impl StepRecord {
    /// Empty the record for reuse (keeps its allocation).
    pub(crate) fn recycle(&mut self) {
        self.entries.clear();
        self.samples = 0;
        self.verifies = 0;
    }
}

/// Built steps awaiting their results, oldest first, and the step counters.
#[derive(Debug, Default)]
pub(crate) struct InflightSteps {
    records: VecDeque<StepRecord>,
    /// Records of applied steps, emptied, for the next steps.
    spare: Vec<StepRecord>,
    /// The last step opened (steps are numbered from 1; 0: none yet).
    last_built: u64,
    /// The last step whose result was applied (0: none yet).
    last_applied: u64,
    /// Epoch marks for validating a result out of plan order (two per attempt).
    outcome_epoch: u64,
}

impl InflightSteps {
    /// Steps built and not applied.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.records.len()
    }

    /// True if no step awaits its result.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// True if `step` (a request's last step, if any) was built and is not applied yet: blocks
    /// the request releases now must wait behind the fence of that step.
    #[inline]
    pub(crate) fn in_flight(&self, step: Option<StepId>) -> bool {
        step.is_some_and(|s| s.0 > self.last_applied)
    }

    /// Number the next step and hand out an empty record for it (recycled when possible).
    pub(crate) fn open(&mut self) -> StepRecord {
        self.last_built += 1;
        let mut record = self.spare.pop().unwrap_or_default();
        record.recycle();
        record.step_id = StepId(self.last_built);
        record
    }

    /// The step of `record` (the last one opened) was sent: await its result.
    pub(crate) fn push(&mut self, record: StepRecord) {
        debug_assert_eq!(record.step_id.0, self.last_built, "steps are sent in the order built");
        self.records.push_back(record);
    }

    /// The oldest step awaiting its result (the only one a result may be applied to).
    #[inline]
    pub(crate) fn oldest(&self) -> Option<&StepRecord> {
        self.records.front()
    }

    /// True if `step` awaits its result.
    pub(crate) fn contains(&self, step: StepId) -> bool {
        self.records.iter().any(|r| r.step_id == step)
    }

    /// Take the oldest record out: its result is being applied.
    pub(crate) fn pop_oldest(&mut self) -> Option<StepRecord> {
        let record = self.records.pop_front()?;
        self.last_applied = record.step_id.0;
        Some(record)
    }

    /// Keep a record whose result was applied for a later step.
    pub(crate) fn recycle(&mut self, mut record: StepRecord) {
        record.recycle();
        self.spare.push(record);
    }

    /// A fresh pair of epoch marks `(expected, seen)`, distinct from every earlier pair, for
    /// checking a result out of plan order.
    pub(crate) fn next_outcome_epoch(&mut self) -> (u64, u64) {
        self.outcome_epoch += 2;
        (self.outcome_epoch, self.outcome_epoch + 1)
    }

    /// The records in flight, oldest first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &StepRecord> + '_ {
        self.records.iter()
    }

    /// Verify the records' own invariants.
    pub(crate) fn check(&self, max_steps_in_flight: usize) -> Result<(), String> {
        if self.records.len() > max_steps_in_flight {
            return Err(format!(
                "{} steps in flight, at most {max_steps_in_flight}",
                self.records.len()
            ));
        }
        let mut want = self.last_applied;
        for r in &self.records {
            want += 1;
            if r.step_id.0 != want {
                return Err(format!("{} in flight where step-{want} was expected", r.step_id));
            }
            let sampling = r.entries.iter().filter(|e| e.samples).count();
            if sampling != r.samples {
                return Err(format!(
                    "{} counts {} samples, {sampling} entries",
                    r.step_id, r.samples
                ));
            }
            let verifying = r.entries.iter().filter(|e| e.drafts > 0).count();
            if verifying != r.verifies || r.entries.iter().any(|e| e.drafts > 0 && !e.samples) {
                return Err(format!(
                    "{} counts {} verifications, {verifying} entries (each must sample)",
                    r.step_id, r.verifies
                ));
            }
        }
        if want != self.last_built {
            return Err(format!(
                "steps {}..={} in flight but step-{} was the last built",
                self.last_applied + 1,
                want,
                self.last_built
            ));
        }
        if self.spare.iter().any(|r| !r.entries.is_empty()) {
            return Err("a recycled step record still has entries".into());
        }
        Ok(())
    }
}
