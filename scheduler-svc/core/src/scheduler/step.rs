//! Building one step: decodes, then running prompt work, then (if nothing was preempted) the
//! admission of waiting requests, then KV imports and exports.
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
use crate::plan::{CachedRequestData, KvOp, NewRequestData, ScheduledWork, StepPlan};
use crate::prefetch::prefetch;
use crate::request::{Decision, RequestStatus, StepMark, TransferState};
use std::sync::Arc;

use crate::types::{StepId, Timestamp, TokenId};
use crate::work_queues::WorkKey;

use super::preempt::Room;
use super::{Scheduler, StepRecord, IMPORT_QUEUE};

impl Scheduler {
    /// Build the next step. The plan is borrowed from the scheduler and rebuilt in place by the
    /// next call; its result must be applied with [`Scheduler::apply_result`] (in step order)
    /// before more than `max_steps_in_flight` steps are outstanding.
    pub fn schedule(&mut self, now: Timestamp) -> Result<&StepPlan, ScheduleError> {
        if self.inflight.len() >= self.cfg.max_steps_in_flight {
            return Err(ScheduleError::TooManyStepsInFlight(self.inflight.len()));
        }
        self.next_step += 1;
        let step = StepId(self.next_step);
        self.plan.clear(step);
        self.plan_followups.clear();
        self.plan_kv_slots.clear();
        let mut record = self.spare_records.pop().unwrap_or_default();
        record.recycle();
        record.step_id = step;
        self.building = Some(record);
        self.budget = self.cfg.max_num_batched_tokens;
        self.step_preempted = false;
        self.step_blocked = false;

        self.report_finished();
        self.schedule_running(WorkKey::Decode, now);
        self.schedule_running(WorkKey::Prompt, now);
        self.schedule_running(WorkKey::PromptChunk, now);
        if !self.step_preempted && !self.step_blocked {
            self.admit_waiting(now);
            self.start_imports();
        }
        self.start_exports();
        self.finalize();
        Ok(&self.plan)
    }

    /// The plan built by the last [`Scheduler::schedule`] call.
    pub fn last_plan(&self) -> &StepPlan {
        &self.plan
    }

    /// Put finished requests the executor knows into the plan and retire what can be.
    fn report_finished(&mut self) {
        let mut to_report = std::mem::take(&mut self.to_report);
        for &idx in &to_report {
            let id = {
                let r = self.req_mut(idx);
                r.finish_reported = true;
                r.id
            };
            self.plan.finished.push(id);
            self.try_retire(idx);
        }
        to_report.clear();
        self.to_report = to_report;
    }

    /// The kind of work `idx` needs next, or `None` if it must wait for a result.
    pub(super) fn next_work(&self, idx: u32) -> Option<WorkKey> {
        let r = self.req(idx);
        if r.output_capped(self.cfg.max_model_len) {
            return None;
        }
        let remaining = r.remaining();
        if remaining == 0 {
            None
        } else if remaining == 1 && r.num_computed >= r.prompt.len() {
            Some(WorkKey::Decode)
        } else if !self.cfg.enable_chunked_prefill && remaining <= self.cfg.max_num_batched_tokens {
            Some(WorkKey::Prompt)
        } else {
            Some(WorkKey::PromptChunk)
        }
    }

    /// Queue the next work of an `Active` request that has none pending.
    pub(super) fn requeue(&mut self, idx: u32) {
        if self.req(idx).status != RequestStatus::Active || self.work.pending(idx).is_some() {
            return;
        }
        if let Some(key) = self.next_work(idx) {
            self.work.enqueue(key, idx);
        }
    }

    /// Tokens a request gets for `key` work within the remaining budget (0: not this step).
    fn tokens_for(&self, idx: u32, key: WorkKey) -> usize {
        let remaining = self.req(idx).remaining();
        match key {
            WorkKey::Decode | WorkKey::Verify => remaining.min(1).min(self.budget),
            WorkKey::Prompt if remaining > self.budget => 0,
            WorkKey::Prompt => remaining,
            WorkKey::PromptChunk => remaining.min(self.cfg.chunk_cap()).min(self.budget),
        }
    }

    /// Schedule the running requests pending `key`, front to back, once each.
    fn schedule_running(&mut self, key: WorkKey, now: Timestamp) {
        let step = self.next_step;
        while let Some(idx) = self.work.front(key) {
            if self.req(idx).visited_step == step || self.budget == 0 {
                break;
            }
            self.work.remove(idx);
            self.req_mut(idx).visited_step = step;
            let n = self.tokens_for(idx, key);
            if n == 0 {
                self.req_mut(idx).decision = Decision::NoBudget;
                self.work.enqueue(key, idx);
                continue;
            }
            let need = {
                let r = self.req(idx);
                self.cfg.blocks_for(r.num_computed + n).saturating_sub(r.block_table.len())
            };
            if need > 0 {
                match self.make_room(idx, need, now) {
                    Room::Ready => {}
                    Room::FenceWait => {
                        self.step_blocked = true;
                        self.req_mut(idx).decision = Decision::FenceWait;
                        self.work.enqueue(key, idx);
                        continue;
                    }
                    Room::SelfPreempted => continue,
                }
            }
            self.commit_work(idx, key, n, need);
        }
    }

    /// Allocate `new_blocks`, count `n` tokens as computed, add the entry to the plan and queue
    /// the request's next work. The caller made sure the blocks are free.
    ///
    /// Everything a scheduled request needs for the step record happens here, in one visit;
    /// `finalize` only revisits the few with an executor diff or blocks to register.
    fn commit_work(&mut self, idx: u32, key: WorkKey, n: usize, new_blocks: usize) {
        let mut blocks = std::mem::take(&mut self.scratch_blocks);
        blocks.clear();
        let ok = self.pool.allocate(new_blocks, &mut blocks);
        debug_assert!(ok, "commit_work called without the blocks being free");
        let pos = self.plan.scheduled.len() as u32;
        let step = StepMark::of(StepId(self.next_step));
        let bs = self.cfg.block_size;
        let caching = self.cfg.enable_prefix_caching;
        let (id, samples, followup) = {
            let r = self.req_mut(idx);
            debug_assert_ne!(r.last_step, step, "scheduled twice in one step");
            r.block_table.extend_from_slice(&blocks);
            r.new_blocks_this_step = u32::try_from(blocks.len()).expect("at most num_blocks");
            r.num_computed += n;
            let samples = r.num_computed == r.num_tokens() + r.placeholders;
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
                || (caching && r.num_computed.min(r.num_tokens()) / bs > r.registered());
            (r.id, samples, followup)
        };
        self.scratch_blocks = blocks;
        let record = self.building.as_mut().expect("commit_work runs while building");
        record.entries.push(super::RecordEntry { idx, id, samples });
        record.samples += usize::from(samples);
        if followup {
            self.plan_followups.push(idx);
        }
        self.budget -= n;
        if key.is_prompt() {
            self.counters.prompt_tokens += n as u64;
        }
        self.plan.scheduled.push(ScheduledWork {
            id,
            work: key,
            num_tokens: n,
            samples_token: samples,
        });
        self.requeue(idx);
    }

    /// Admit waiting requests in queue order while slots, budget and blocks allow, looking at
    /// no more than `lookahead` of them.
    fn admit_waiting(&mut self, now: Timestamp) {
        let mut cur = self.waiting.first();
        let mut scanned = 0;
        while let Some(idx) = cur {
            if scanned >= self.cfg.lookahead || self.budget == 0 {
                break;
            }
            if !self.slots.has_free() {
                self.req_mut(idx).decision = Decision::NoSlot;
                break;
            }
            scanned += 1;
            cur = self.waiting.next_after(idx);
            if self.req(idx).inflight_refs > 0 {
                // Its in-flight samples must land before it can resume.
                self.req_mut(idx).decision = Decision::InFlight;
                continue;
            }
            if !self.try_admit(idx, now) {
                break;
            }
        }
    }

    /// What admitting `idx` now would take: its first work and the blocks for it.
    fn admission_plan(&mut self, idx: u32) -> AdmissionPlan {
        let bs = self.cfg.block_size;
        let holds = !self.req(idx).block_table.is_empty();
        // Prefix-cache lookup for a request that holds no KV: full blocks only, and never the
        // whole sequence (the last token must be computed to sample from it).
        let (hit_blocks, evictable_hits) = if holds {
            (0, 0)
        } else {
            let max_hit = (self.req(idx).num_tokens() - 1) / bs;
            self.prefix_lookup(idx, max_hit)
        };
        let r = self.req(idx);
        debug_assert!(holds || r.num_computed == 0, "no blocks but computed tokens");
        debug_assert_eq!(r.placeholders, 0, "admitting with samples in flight");
        let computed = if holds { r.num_computed } else { hit_blocks * bs };
        let remaining = r.num_tokens().saturating_sub(computed);
        let chunked =
            self.cfg.enable_chunked_prefill || remaining > self.cfg.max_num_batched_tokens;
        let (key, n) = if remaining == 1 && computed >= r.prompt.len() {
            (WorkKey::Decode, 1)
        } else if chunked {
            let n = remaining.min(self.cfg.chunk_cap()).min(self.budget);
            (WorkKey::PromptChunk, n)
        } else {
            (WorkKey::Prompt, remaining)
        };
        let have = if holds { r.block_table.len() } else { hit_blocks };
        let need = self.cfg.blocks_for(computed + n).saturating_sub(have);
        AdmissionPlan {
            holds,
            hit_blocks,
            computed,
            key,
            n,
            need,
            blocks_taken: need + evictable_hits,
        }
    }

    /// Admit `idx` if its first work fits (reclaiming KV idled by other waiting requests if
    /// that is what it takes); false if it does not fit this step.
    fn try_admit(&mut self, idx: u32, now: Timestamp) -> bool {
        let plan = loop {
            let plan = self.admission_plan(idx);
            if plan.n == 0 || plan.n > self.budget {
                self.req_mut(idx).decision = Decision::NoBudget;
                return false;
            }
            let free = self.pool.num_free();
            if plan.blocks_taken <= free {
                break plan;
            }
            // Blocks pinned by waiting requests are idle: take them from the tail, unless the
            // fence will release enough by the next step anyway.
            let holder = self.worst_holder_except(idx);
            match holder {
                Some(h) if free + self.fenced_blocks < plan.blocks_taken => {
                    self.reclaim(h, plan.blocks_taken - free);
                }
                _ => {
                    self.req_mut(idx).decision = Decision::NoBlocks;
                    return false;
                }
            }
        };
        if !plan.holds {
            self.take_prefix_hits(idx, plan.hit_blocks);
            let first_admission = self.req(idx).cold.times.first_scheduled.is_none();
            let r = self.req_mut(idx);
            r.num_computed = plan.computed;
            r.set_registered(plan.hit_blocks);
            if first_admission {
                r.cold.prefix_hit_tokens = plan.computed;
            }
            let queried = r.num_tokens() as u64;
            if self.cfg.enable_prefix_caching {
                self.counters.prefix_queries += queried;
                self.counters.prefix_hits += plan.computed as u64;
            }
        }
        self.activate(idx, now);
        self.req_mut(idx).decision = Decision::Admitted;
        self.req_mut(idx).visited_step = self.next_step;
        self.commit_work(idx, plan.key, plan.n, plan.need);
        true
    }

    /// Prefix-cache lookup over at most `max_blocks` leading full blocks of `idx`'s tokens:
    /// the number of hit blocks, and how many of them are free cached blocks (a hit on those
    /// takes them out of the free list, so they count against the free blocks).
    fn prefix_lookup(&mut self, idx: u32, max_blocks: usize) -> (usize, usize) {
        if !self.cfg.enable_prefix_caching {
            return (0, 0);
        }
        let bs = self.cfg.block_size;
        self.req_mut(idx).update_block_hashes(bs);
        let r = self.req(idx);
        let hashes = &r.cold.block_hashes[..max_blocks.min(r.cold.block_hashes.len())];
        let hits = self.pool.count_hits(hashes.iter().copied());
        let evictable = hashes[..hits]
            .iter()
            .filter(|&&h| self.pool.lookup(h).is_some_and(|b| self.pool.ref_count(b) == 0))
            .count();
        (hits, evictable)
    }

    /// Put the first `hits` cached blocks (found by `prefix_lookup`) into `idx`'s empty table.
    fn take_prefix_hits(&mut self, idx: u32, hits: usize) {
        debug_assert!(self.req(idx).block_table.is_empty(), "hits only start a table");
        for i in 0..hits {
            let h = self.req(idx).cold.block_hashes[i];
            let b = self.pool.lookup(h).expect("prefix_lookup found it in this step");
            self.pool.touch(b);
            self.req_mut(idx).block_table.push(b);
        }
    }

    /// Allocate blocks for queued KV imports, at most `max_kv_fetches` in progress.
    fn start_imports(&mut self) {
        let bs = self.cfg.block_size;
        while self.importing < self.cfg.max_kv_fetches {
            let Some(idx) = self.imports.front(IMPORT_QUEUE) else {
                break;
            };
            let tokens = self.req(idx).cold.import_tokens;
            // Blocks already cached locally need not travel.
            let (hit_blocks, evictable) = self.prefix_lookup(idx, tokens / bs);
            let need = self.cfg.blocks_for(tokens) - hit_blocks;
            if need + evictable > self.pool.num_free() {
                self.req_mut(idx).decision = Decision::NoBlocks;
                break;
            }
            self.imports.remove(idx);
            self.take_prefix_hits(idx, hit_blocks);
            let mut blocks = std::mem::take(&mut self.scratch_blocks);
            blocks.clear();
            let ok = self.pool.allocate(need, &mut blocks);
            debug_assert!(ok, "import blocks checked free");
            let r = self.req_mut(idx);
            r.block_table.extend_from_slice(&blocks);
            r.set_registered(hit_blocks);
            r.decision = Decision::Importing;
            let (tid, _) = r.cold.transfer.expect("a queued import has a transfer");
            r.cold.transfer = Some((tid, TransferState::Importing));
            let id = r.id;
            let full = (tokens / bs).min(r.cold.block_hashes.len());
            let hashes_start = hit_blocks.min(full);
            let block_ids = self.plan.push_blocks(&blocks);
            let r = self.slab[idx as usize].as_ref().expect("live");
            let block_hashes = self.plan.push_hashes(&r.cold.block_hashes[hashes_start..full]);
            self.scratch_blocks = blocks;
            self.plan.kv_ops.push(KvOp::Import {
                id,
                transfer_id: tid,
                block_ids,
                block_hashes,
                num_tokens: tokens,
            });
            self.plan_kv_slots.push(idx);
            self.importing += 1;
        }
    }

    /// Issue the export op of every request that became `Transferring` since the last step.
    fn start_exports(&mut self) {
        let bs = self.cfg.block_size;
        let pending = std::mem::take(&mut self.exports_pending);
        for &idx in &pending {
            let r = self.slab[idx as usize].as_mut().expect("live exporting request");
            let (tid, _) = r.cold.transfer.expect("a queued export has a transfer");
            r.cold.transfer = Some((tid, TransferState::Exporting));
            r.decision = Decision::Exporting;
            r.update_block_hashes(bs);
            let id = r.id;
            let num_tokens = r.num_computed.min(r.num_tokens());
            let full = (num_tokens / bs).min(r.cold.block_hashes.len());
            let r = self.slab[idx as usize].as_ref().expect("live");
            let block_ids = self.plan.push_blocks(&r.block_table);
            let block_hashes = self.plan.push_hashes(&r.cold.block_hashes[..full]);
            self.plan.kv_ops.push(KvOp::Export {
                id,
                transfer_id: tid,
                block_ids,
                block_hashes,
                num_tokens,
            });
            self.plan_kv_slots.push(idx);
        }
        let mut pending = pending;
        pending.clear();
        self.exports_pending = pending;
    }

    /// Compute the executor diff and register computed full blocks for the requests that need
    /// it, compact rolled-back entries, and record the step as in flight.
    fn finalize(&mut self) {
        let step = self.plan.step_id;
        let bs = self.cfg.block_size;
        // Two passes so the prefix-cache inserts, random accesses into a large table, are all
        // requested (prefetched) before the first one is made. Registration order is the
        // followup order either way, so which block wins a shared hash does not change.
        let mut to_register = 0;
        for k in 0..self.plan_followups.len() {
            self.prefetch_for_followup(k);
            let idx = self.plan_followups[k];
            if !self.scheduled_in_build(idx) {
                continue; // rolled back by a preemption later in the step
            }
            let tokens = self.plan.scheduled[self.req(idx).sched_index as usize].num_tokens;
            self.diff_for_executor(idx, tokens);
            let r = self.slab[idx as usize].as_mut().expect("scheduled request is live");
            let full = r.num_computed.min(r.num_tokens()) / bs;
            if self.cfg.enable_prefix_caching && full > r.registered() {
                r.update_block_hashes(bs);
                let upto = full.min(r.block_table.len()).min(r.cold.block_hashes.len());
                for &h in &r.cold.block_hashes[r.registered().min(upto)..upto] {
                    self.pool.prefetch_register(h);
                }
                prefetch(r.block_table.as_ptr().wrapping_add(r.registered()));
                self.plan_followups[to_register] = idx;
                to_register += 1;
            }
        }
        for k in 0..to_register {
            let idx = self.plan_followups[k];
            let r = self.slab[idx as usize].as_mut().expect("scheduled request is live");
            let full = r.num_computed.min(r.num_tokens()) / bs;
            let upto = full.min(r.block_table.len()).min(r.cold.block_hashes.len());
            for b in r.registered()..upto {
                self.pool.register(r.block_table[b], r.cold.block_hashes[b]);
            }
            r.set_registered(r.registered().max(upto));
        }
        self.plan_followups.truncate(to_register);
        let mut record = self.building.take().expect("finalize ends a build");
        // Drop rolled-back entries (tombstoned with zero tokens) from plan and record alike.
        // Only a preemption rolls work back, so a step without one skips the pass (at 16 k
        // running requests both lists have left L2 by now).
        if self.step_preempted {
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
        let total = self.cfg.max_num_batched_tokens - self.budget;
        for k in 0..self.plan_kv_slots.len() {
            let idx = self.plan_kv_slots[k];
            let r = self.req_mut(idx);
            r.inflight_refs += 1;
            r.last_step = StepMark::of(step);
            let id = r.id;
            record.entries.push(super::RecordEntry { idx, id, samples: false });
        }
        self.plan.total_tokens = total;
        self.inflight.push_back(record);
        self.counters.steps += 1;
    }

    /// Prefetch what `finalize` will touch for `plan_followups[k + AHEAD]` and beyond: most
    /// followups hash a block that just filled, which reads three lines no step loop has touched
    /// for a while (the cold part, the tail of its hash chain, the block's output tokens), each
    /// a dependent miss. Three stages, so each address is read from a line already requested.
    #[inline]
    fn prefetch_for_followup(&self, k: usize) {
        const AHEAD: usize = 8;
        let f = &self.plan_followups;
        if let Some(&j) = f.get(k + 3 * AHEAD) {
            self.prefetch_request(j);
        }
        let bs = self.cfg.block_size;
        if let Some(r) = f.get(k + 2 * AHEAD).and_then(|&j| self.slab[j as usize].as_ref()) {
            prefetch(&*r.cold as *const crate::request::RequestCold);
            // The last full block of known tokens, when it lies in the output.
            let full = r.num_tokens() / bs;
            if let Some(start) = (full.saturating_sub(1) * bs).checked_sub(r.prompt.len()) {
                let p = r.output.as_ptr().wrapping_add(start);
                prefetch(p);
                prefetch(p.wrapping_add(bs - 1));
            }
        }
        if let Some(r) = f.get(k + AHEAD).and_then(|&j| self.slab[j as usize].as_ref()) {
            let hashes = &r.cold.block_hashes;
            prefetch(hashes.as_ptr().wrapping_add(hashes.len().saturating_sub(1)));
        }
    }

    /// Add the executor-facing diff for a scheduled request: new, resumed, or new blocks.
    fn diff_for_executor(&mut self, idx: u32, scheduled_tokens: usize) {
        let r = self.slab[idx as usize].as_ref().expect("scheduled request is live");
        let computed_before = r.num_computed - scheduled_tokens;
        let table_len = r.block_table.len();
        if !r.exec.known {
            let prompt = r.prompt.clone();
            // Only a request that arrived with output has any before the executor knew it.
            let output: Arc<[TokenId]> = if r.output.is_empty() {
                self.empty_tokens.clone()
            } else {
                r.output.as_slice().into()
            };
            let id = r.id;
            let block_ids = self.plan.push_blocks(&r.block_table);
            self.plan.new_requests.push(NewRequestData {
                id,
                prompt,
                output,
                block_ids,
                num_computed_tokens: computed_before,
            });
        } else if r.exec.needs_resume {
            let id = r.id;
            let block_ids = self.plan.push_blocks(&r.block_table);
            let tokens = self.plan.push_tokens(&[&r.prompt, &r.output]);
            self.plan.cached_requests.push(CachedRequestData {
                id,
                resumed: true,
                block_ids,
                tokens,
                num_computed_tokens: computed_before,
            });
        } else if table_len > r.exec.sent_blocks as usize {
            let id = r.id;
            let block_ids = self.plan.push_blocks(&r.block_table[r.exec.sent_blocks as usize..]);
            self.plan.cached_requests.push(CachedRequestData {
                id,
                resumed: false,
                block_ids,
                tokens: Default::default(),
                num_computed_tokens: computed_before,
            });
        }
        let r = self.req_mut(idx);
        r.exec.known = true;
        r.exec.needs_resume = false;
        r.exec.sent_blocks = table_len as u32;
    }
}

/// The first work of a request being admitted and what it costs.
#[derive(Debug, Clone, Copy)]
struct AdmissionPlan {
    /// It already holds KV (yielded or imported) and needs no prefix lookup.
    holds: bool,
    /// Leading blocks found in the prefix cache.
    hit_blocks: usize,
    /// Computed tokens once admitted (held KV or prefix hit).
    computed: usize,
    key: WorkKey,
    /// Tokens of its first work.
    n: usize,
    /// New blocks to allocate.
    need: usize,
    /// Free blocks the admission consumes (new blocks + revived cached ones).
    blocks_taken: usize,
}

impl StepRecord {
    pub(super) fn recycle(&mut self) {
        self.entries.clear();
        self.samples = 0;
    }
}
