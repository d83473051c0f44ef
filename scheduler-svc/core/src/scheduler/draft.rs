//! The step being built: its plan, its in-flight record, its token budget and what the build
//! has learnt so far (a preemption, a wait on the fence).
//!
//! Why a type of its own: this state means something only during one `schedule()` call. It is
//! reset when the call opens the draft ([`StepDraft::open`]) and sealed when it ends
//! ([`StepDraft::close`]); afterwards only the plan is read (it is what `schedule` returns, and
//! it stays readable until the next call). Keeping it apart from the requests and the pool
//! makes the per-step bookkeeping one thing with one set of rules, and lets the builder borrow
//! a request and the draft at the same time.
//!
//! All vectors are kept between steps and cleared, never freed, so a steady-state step
//! allocates nothing here (a new request's prompt is shared, not copied).
//!
//! Invariants kept: every scheduled entry's tokens were taken from the budget, and a rollback
//! gives them back, so `budget + tokens scheduled = max_num_batched_tokens` throughout; the
//! record's entries are parallel to the plan's scheduled work (a rolled-back entry is a
//! zero-token tombstone in both until `close` compacts them away); a request is scheduled at
//! most once. Once closed ([`StepDraft::check`]): no tombstone is left, `total_tokens` is the
//! sum over the batch and within the budget, and no request appears twice.

use std::sync::Arc;

use crate::block_hash::BlockHash;
use crate::plan::{
    BlockCopy, CachedRequestData, KvOp, NewRequestData, ScheduledWork, Span, StepPlan,
};
use crate::types::{BlockId, RequestId, StepId, TokenId, TransferId};
use crate::work_queues::WorkKey;

use super::inflight::{RecordEntry, StepRecord};

/// The plan and bookkeeping of the step being built.
#[derive(Debug)]
pub(crate) struct StepDraft {
    /// The plan: being built while open, the last step sent once closed.
    plan: StepPlan,
    /// The step's record while open (entries parallel to `plan.scheduled`).
    record: Option<StepRecord>,
    /// Scheduled requests whose executor diff or prefix-cache registration is due at finalize.
    followups: Vec<u32>,
    /// Requests given a KV op in this step (their record entries go after the scheduled ones).
    kv_entries: Vec<RecordEntry>,
    /// Requests whose blocks the step's block copies read.
    copy_sources: Vec<u32>,
    /// Tokens the step may still schedule.
    budget: usize,
    /// A request was preempted in this step (so a rollback may have left tombstones).
    preempted: bool,
    /// A request was skipped to wait for fenced blocks.
    fence_waited: bool,
    /// The shared empty token list new requests without prior output carry (no allocation).
    empty_tokens: Arc<[TokenId]>,
}

impl StepDraft {
    /// A closed draft with an empty plan, for a step budget of `max_tokens`.
    pub(crate) fn new(max_tokens: usize) -> Self {
        StepDraft {
            plan: StepPlan::default(),
            record: None,
            followups: Vec::new(),
            kv_entries: Vec::new(),
            copy_sources: Vec::new(),
            budget: max_tokens,
            preempted: false,
            fence_waited: false,
            empty_tokens: Arc::from(Vec::new()),
        }
    }

    /// Start building the step of `record` (fresh from [`super::inflight::InflightSteps::open`])
    /// with `budget` tokens.
    pub(crate) fn open(&mut self, record: StepRecord, budget: usize) {
        debug_assert!(self.record.is_none(), "a step is already being built");
        self.plan.clear(record.step_id);
        self.followups.clear();
        self.kv_entries.clear();
        self.copy_sources.clear();
        self.record = Some(record);
        self.budget = budget;
        self.preempted = false;
        self.fence_waited = false;
    }

    /// The step being built (or, once closed, the last one built).
    #[inline]
    pub(crate) fn step(&self) -> StepId {
        self.plan.step_id
    }

    /// True while a step is being built.
    #[inline]
    pub(crate) fn is_open(&self) -> bool {
        self.record.is_some()
    }

    /// The plan: being built while open, the last step sent once closed.
    #[inline]
    pub(crate) fn plan(&self) -> &StepPlan {
        &self.plan
    }

    /// Where the closed step's prefix-cache changes go.
    #[inline]
    pub(crate) fn cache_changes(&mut self) -> &mut crate::plan::CacheChanges {
        &mut self.plan.cache
    }

    /// Tokens the step may still schedule.
    #[inline]
    pub(crate) fn budget(&self) -> usize {
        self.budget
    }

    /// True unless the step preempted or waited for the fence: only then may it admit
    /// waiting requests (admitting would take the blocks the running ones need).
    #[inline]
    pub(crate) fn admits(&self) -> bool {
        !self.preempted && !self.fence_waited
    }

    /// A running request was skipped to wait for fenced blocks.
    pub(crate) fn fence_wait(&mut self) {
        self.fence_waited = true;
    }

    /// A request was preempted in this step; `known` is its id if the executor has it (it
    /// must drop the request from its batch).
    pub(crate) fn preempted(&mut self, known: Option<RequestId>) {
        if let Some(id) = known {
            self.plan.preempted.push(id);
        }
        self.preempted = true;
    }

    /// A finished request the executor must forget.
    pub(crate) fn finished(&mut self, id: RequestId) {
        self.plan.finished.push(id);
    }

    /// Where the next scheduled work goes in the plan.
    #[inline]
    pub(crate) fn next_position(&self) -> u32 {
        // At most one entry per live request, and arena entries are `u32`.
        self.plan.scheduled.len() as u32
    }

    /// The work scheduled at `pos`.
    #[inline]
    pub(crate) fn work_at(&self, pos: u32) -> ScheduledWork {
        self.plan.scheduled[pos as usize]
    }

    /// Schedule `work` for request `idx` (at [`StepDraft::next_position`]), taking its tokens
    /// from the budget; `followup` if its executor diff or block registration is due at
    /// finalize.
    #[inline]
    pub(crate) fn add_work(&mut self, idx: u32, work: ScheduledWork, followup: bool) {
        let record = self.record.as_mut().expect("work is added while a step is being built");
        let samples = work.samples_token;
        let drafts = u16::try_from(work.draft.len).expect("at most MAX_SPECULATIVE_TOKENS drafts");
        record.entries.push(RecordEntry { idx, id: work.id, samples, drafts });
        record.samples += usize::from(samples);
        record.verifies += usize::from(drafts > 0);
        if followup {
            self.followups.push(idx);
        }
        self.budget -= work.num_tokens;
        self.plan.scheduled.push(work);
    }

    /// Undo the work at `pos`: its tokens go back to the budget and it becomes a tombstone
    /// (zero tokens) until `close`. Returns the work as it was.
    pub(crate) fn rollback(&mut self, pos: u32) -> ScheduledWork {
        let work = self.plan.scheduled[pos as usize];
        self.plan.scheduled[pos as usize].num_tokens = 0;
        let record = self.record.as_mut().expect("rollback happens while a step is being built");
        record.samples -= usize::from(work.samples_token);
        record.verifies -= usize::from(work.draft.len > 0);
        self.budget += work.num_tokens;
        work
    }

    /// The requests due a diff or block registration, for finalize to work through (give the
    /// vector back with [`StepDraft::recycle_followups`]).
    pub(crate) fn take_followups(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.followups)
    }

    /// Give back the vector [`StepDraft::take_followups`] handed out, to reuse its allocation.
    pub(crate) fn recycle_followups(&mut self, mut followups: Vec<u32>) {
        followups.clear();
        self.followups = followups;
    }

    /// Copy a verification's draft tokens into the plan.
    pub(crate) fn push_draft(&mut self, draft: &[TokenId]) -> Span {
        self.plan.push_tokens(&[draft])
    }

    /// A request the executor sees for the first time, with its whole table.
    pub(crate) fn new_request(
        &mut self,
        id: RequestId,
        prompt: &Arc<[TokenId]>,
        output: &[TokenId],
        blocks: &[BlockId],
        num_computed_tokens: usize,
        max_loops: u8,
    ) {
        // Only a request that arrived with output has any before the executor knew it.
        let output = if output.is_empty() { self.empty_tokens.clone() } else { output.into() };
        let block_ids = self.plan.push_blocks(blocks);
        self.plan.new_requests.push(NewRequestData {
            id,
            prompt: prompt.clone(),
            output,
            block_ids,
            num_computed_tokens,
            max_loops,
        });
    }

    /// The step runs `op` (a looped model's stage).
    pub(crate) fn set_operation(&mut self, op: crate::work_queues::Operation) {
        self.plan.operation = op;
    }

    /// A preempted request the executor knows, resumed: its whole table and all its tokens.
    pub(crate) fn resumed_request(
        &mut self,
        id: RequestId,
        blocks: &[BlockId],
        tokens: &[&[TokenId]],
        num_computed_tokens: usize,
    ) {
        let block_ids = self.plan.push_blocks(blocks);
        let tokens = self.plan.push_tokens(tokens);
        self.plan.cached_requests.push(CachedRequestData {
            id,
            resumed: true,
            block_ids,
            tokens,
            num_computed_tokens,
        });
    }

    /// Blocks appended to the table of a request the executor knows.
    pub(crate) fn new_blocks(
        &mut self,
        id: RequestId,
        blocks: &[BlockId],
        num_computed_tokens: usize,
    ) {
        let block_ids = self.plan.push_blocks(blocks);
        self.plan.cached_requests.push(CachedRequestData {
            id,
            resumed: false,
            block_ids,
            tokens: Span::default(),
            num_computed_tokens,
        });
    }

    /// The import op of request `idx`: fill `blocks` (hashes of the full ones new to this
    /// node: `hashes`) with `num_tokens` tokens' KV arriving through `transfer_id`.
    pub(crate) fn import(
        &mut self,
        idx: u32,
        id: RequestId,
        transfer_id: TransferId,
        blocks: &[BlockId],
        hashes: &[BlockHash],
        num_tokens: usize,
    ) {
        let block_ids = self.plan.push_blocks(blocks);
        let block_hashes = self.plan.push_hashes(hashes);
        self.plan.kv_ops.push(KvOp::Import {
            id,
            transfer_id,
            block_ids,
            block_hashes,
            num_tokens,
        });
        self.kv_entries.push(RecordEntry { idx, id, samples: false, drafts: 0 });
    }

    /// The export op of request `idx`: send `blocks` (`num_tokens` tokens' KV; hashes of the
    /// full blocks: `hashes`) through `transfer_id`.
    pub(crate) fn export(
        &mut self,
        idx: u32,
        id: RequestId,
        transfer_id: TransferId,
        blocks: &[BlockId],
        hashes: &[BlockHash],
        num_tokens: usize,
    ) {
        let block_ids = self.plan.push_blocks(blocks);
        let block_hashes = self.plan.push_hashes(hashes);
        self.plan.kv_ops.push(KvOp::Export {
            id,
            transfer_id,
            block_ids,
            block_hashes,
            num_tokens,
        });
        self.kv_entries.push(RecordEntry { idx, id, samples: false, drafts: 0 });
    }

    /// The KV-tier op: copy `blocks` (full, named by `hashes`) to the node's agent.
    pub(crate) fn store(&mut self, blocks: &[BlockId], hashes: &[BlockHash]) {
        let block_ids = self.plan.push_blocks(blocks);
        let block_hashes = self.plan.push_hashes(hashes);
        self.plan.kv_ops.push(KvOp::Store { block_ids, block_hashes });
    }

    /// Copy block `src` of request `source` into block `dst` of request `id` before the step's
    /// forward.
    pub(crate) fn copy_block(&mut self, source: u32, src: BlockId, id: RequestId, dst: BlockId) {
        self.plan.block_copies.push(BlockCopy { id, src, dst });
        if !self.copy_sources.contains(&source) {
            self.copy_sources.push(source); // a source's samples fork together: a short list
        }
    }

    /// The requests whose blocks this step's copies read.
    pub(crate) fn copy_sources(&self) -> &[u32] {
        &self.copy_sources
    }

    /// The step references request `idx` without work or a KV op (a block copy reads its
    /// blocks): its blocks are fenced until the step is applied.
    pub(crate) fn reference(&mut self, idx: u32, id: RequestId) {
        self.kv_entries.push(RecordEntry { idx, id, samples: false, drafts: 0 });
    }

    /// The requests given a KV op (or referenced) in this step.
    pub(crate) fn kv_requests(&self) -> impl Iterator<Item = u32> + '_ {
        self.kv_entries.iter().map(|e| e.idx)
    }

    /// Seal the step: drop rolled-back tombstones, total the tokens, append the KV-op entries
    /// to the record and hand the record over (it goes in flight). `max_tokens` is the budget
    /// the draft was opened with.
    pub(crate) fn close(&mut self, max_tokens: usize) -> StepRecord {
        let mut record = self.record.take().expect("close ends an open step");
        // Drop rolled-back entries (tombstoned with zero tokens) from plan and record alike.
        // Only a preemption rolls work back, so a step without one skips the pass (at 16 k
        // running requests both lists have left L2 by now).
        if self.preempted {
            let mut w = 0;
            for i in 0..self.plan.scheduled.len() {
                let work = self.plan.scheduled[i];
                if work.num_tokens > 0 {
                    self.plan.scheduled[w] = work;
                    record.entries[w] = record.entries[i];
                    w += 1;
                }
            }
            self.plan.scheduled.truncate(w);
            record.entries.truncate(w);
        }
        debug_assert!(self.plan.scheduled.iter().all(|w| w.num_tokens > 0), "tombstone left");
        // Every scheduled token was taken from the budget, and a rollback gave its tokens back.
        self.plan.total_tokens = max_tokens - self.budget;
        record.entries.extend_from_slice(&self.kv_entries);
        record
    }

    /// Verify the closed draft's invariants (rule 5 of DESIGN §3 for its plan).
    pub(crate) fn check(&self, max_tokens: usize) -> Result<(), String> {
        if self.is_open() {
            return Err(format!("{} is still being built", self.plan.step_id));
        }
        let plan = &self.plan;
        let sum: usize = plan.scheduled.iter().map(|w| w.num_tokens).sum();
        if sum != plan.total_tokens {
            return Err(format!("total_tokens {} != sum {sum}", plan.total_tokens));
        }
        if sum > max_tokens {
            return Err(format!("{sum} tokens > budget {max_tokens}"));
        }
        if sum + self.budget != max_tokens {
            return Err(format!("{sum} tokens scheduled + {} left != {max_tokens}", self.budget));
        }
        if plan.scheduled.iter().any(|w| w.num_tokens == 0) {
            return Err("a rolled-back entry was left in the plan".into());
        }
        for w in &plan.scheduled {
            let is_verify = w.work == WorkKey::Verify;
            if is_verify != (w.draft.len > 0)
                || (is_verify && (w.num_tokens != 1 + w.draft.len as usize || !w.samples_token))
            {
                return Err(format!(
                    "{}: {:?} work of {} tokens with {} draft tokens (a verify computes its last \
                     token and each draft token, and samples)",
                    w.id, w.work, w.num_tokens, w.draft.len
                ));
            }
        }
        let mut ids: Vec<_> = plan.scheduled.iter().map(|w| w.id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err("a request is scheduled twice in one step".into());
        }
        Ok(())
    }
}

/// Rule 5 shown to catch its violation through `check_invariants` (the other rules' negative
/// tests are in `invariants.rs`): a step whose plan claims more tokens than it scheduled, and
/// one that spends more than the budget.
#[cfg(test)]
mod tests {
    use crate::{NewRequest, RequestId, Scheduler, SchedulerConfig, Timestamp};

    fn scheduled() -> Scheduler {
        let cfg = SchedulerConfig { block_size: 4, num_blocks: 16, ..SchedulerConfig::default() };
        let mut s = Scheduler::new(cfg).unwrap();
        s.add_request(NewRequest::new(RequestId(1), vec![3; 6], 4, Timestamp(0))).unwrap();
        s.schedule(Timestamp(0)).unwrap();
        s.check_invariants().expect("the starting state is consistent");
        s
    }

    #[test]
    fn a_plan_whose_total_is_not_its_sum_breaks_rule_5() {
        let mut s = scheduled();
        s.draft.plan.total_tokens += 1;
        let v = s.check_invariants().expect_err("the violation went unnoticed");
        assert_eq!(v.rule, 5, "{}", v.detail);
        assert!(v.detail.contains("total_tokens 7 != sum 6"), "{}", v.detail);
    }

    #[test]
    fn a_step_over_its_budget_breaks_rule_5() {
        let mut s = scheduled();
        s.draft.plan.scheduled[0].num_tokens += 4096;
        s.draft.plan.total_tokens += 4096;
        let v = s.check_invariants().expect_err("the violation went unnoticed");
        assert_eq!(v.rule, 5, "{}", v.detail);
        assert!(v.detail.contains("tokens > budget 2048"), "{}", v.detail);
    }
}
