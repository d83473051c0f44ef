//! Admitting waiting requests into the step being built: in queue order while slots, budget
//! and blocks allow, at most `lookahead` of them, stopping at the first that does not fit
//! (head-of-line: a large request is not overtaken forever by small ones). A request waiting
//! for its LoRA adapter (`lifecycle`) is passed over, and not counted in the lookahead. A request's first
//! work is planned from what it holds already (yielded or imported KV), from the prefix cache,
//! or from the KV it forks from (see `fork`); KV idled by other waiting requests is reclaimed
//! when that is what it takes.
//!
//! Invariants kept: a request is admitted only when its first work fits the remaining budget
//! and the free blocks, counting the free cached blocks its prefix hits take out of the free
//! list; a prefix hit never covers the whole sequence (the last token is computed to sample).

use crate::request::Decision;
use crate::types::Timestamp;
use crate::work_queues::WorkKey;

use super::fork::ForkPlan;
use super::Scheduler;

impl Scheduler {
    /// Admit waiting requests in queue order while slots, budget and blocks allow, looking at
    /// no more than `lookahead` of them.
    pub(super) fn admit_waiting(&mut self, now: Timestamp) {
        let mut cur = self.waiting.first();
        let mut scanned = 0;
        while let Some(idx) = cur {
            if scanned >= self.cfg.lookahead || self.draft.budget() == 0 {
                break;
            }
            if !self.slots.has_free() {
                self.requests[idx].decision = Decision::NoSlot;
                break;
            }
            cur = self.waiting.next_after(idx);
            if self.awaits_adapter(idx) {
                // vLLM's rule: later requests (of held adapters, or none) may go first. Not
                // counted against the lookahead: requests behind it may be the ones whose
                // progress frees an adapter (preempted holders waiting to resume).
                self.requests[idx].decision = Decision::LoraWait;
                self.counters.lora_waits += 1;
                continue;
            }
            scanned += 1;
            if self.requests[idx].inflight_refs > 0 {
                // Its in-flight samples must land before it can resume.
                self.requests[idx].decision = Decision::InFlight;
                continue;
            }
            if self.awaits_fork(idx) {
                self.requests[idx].decision = Decision::ForkWait;
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
        let holds = !self.requests[idx].block_table.is_empty();
        // Prefix-cache lookup for a request that holds no KV: full blocks only, and never the
        // whole sequence (the last token must be computed to sample from it).
        let fork = if holds { None } else { self.fork_point(idx) };
        // A looped request's KV depends on its loops: it neither hits nor fills the cache.
        let looped = self.requests[idx].looped;
        let (hit_blocks, evictable_hits) = if holds || fork.is_some() || looped {
            (0, 0)
        } else {
            let max_hit = (self.requests[idx].num_tokens() - 1) / bs;
            self.prefix_lookup(idx, max_hit)
        };
        let r = &self.requests[idx];
        debug_assert!(holds || r.num_computed == 0, "no blocks but computed tokens");
        debug_assert_eq!(r.placeholders, 0, "admitting with samples in flight");
        let computed = match fork {
            _ if holds => r.num_computed,
            Some(_) => r.prompt.len() - 1,
            None => hit_blocks * bs,
        };
        let remaining = r.num_tokens().saturating_sub(computed);
        let cap = r.fork_cap(computed);
        let chunked = self.cfg.enable_chunked_prefill
            || remaining > self.cfg.max_num_batched_tokens
            || cap < remaining;
        let (key, n) = if looped && remaining == 1 && computed >= r.prompt.len() {
            (WorkKey::DecodePrelude, 1)
        } else if looped {
            let n = if self.cfg.enable_chunked_prefill {
                remaining.min(self.cfg.chunk_cap()).min(self.draft.budget())
            } else {
                remaining
            };
            (WorkKey::PromptPrelude, n)
        } else if remaining == 1 && computed >= r.prompt.len() {
            (WorkKey::Decode, 1)
        } else if chunked {
            let n = remaining.min(self.cfg.chunk_cap()).min(self.draft.budget()).min(cap);
            (WorkKey::PromptChunk, n)
        } else {
            (WorkKey::Prompt, remaining)
        };
        let have = match fork {
            _ if holds => r.block_table.len(),
            Some(f) => f.shared,
            None => hit_blocks,
        };
        let need = (self.cfg.blocks_for(computed + n) * usize::from(r.planes)).saturating_sub(have);
        AdmissionPlan {
            holds,
            hit_blocks,
            fork,
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
            if plan.n == 0 || plan.n > self.draft.budget() {
                self.requests[idx].decision = Decision::NoBudget;
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
                Some(h) if free + self.fences.fenced() < plan.blocks_taken => {
                    self.reclaim(h, plan.blocks_taken - free);
                }
                _ => {
                    self.requests[idx].decision = Decision::NoBlocks;
                    return false;
                }
            }
        };
        if let Some(fork) = plan.fork {
            self.take_fork(idx, fork);
        } else if !plan.holds {
            self.take_prefix_hits(idx, plan.hit_blocks);
            let r = &mut self.requests[idx];
            let first_admission = r.cold.times.first_scheduled.is_none();
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
        let r = &mut self.requests[idx];
        r.decision = Decision::Admitted;
        r.visited_step = self.draft.step().0;
        self.commit_work(idx, plan.key, plan.n, plan.need);
        if let Some(ForkPlan { source, shared, copy: Some(src) }) = plan.fork {
            // The first new block holds the rest of the forked KV: the executor copies it
            // before the step's forward writes the sample's first position in it.
            let r = &self.requests[idx];
            self.draft.copy_block(source, src, r.id, r.block_table[shared]);
            self.counters.fork_copied_blocks += 1;
        }
        true
    }

    /// Prefix-cache lookup over at most `max_blocks` leading full blocks of `idx`'s tokens:
    /// the number of hit blocks, and how many of them are free cached blocks (a hit on those
    /// takes them out of the free list, so they count against the free blocks).
    pub(super) fn prefix_lookup(&mut self, idx: u32, max_blocks: usize) -> (usize, usize) {
        if !self.cfg.enable_prefix_caching {
            return (0, 0);
        }
        let r = &mut self.requests[idx];
        r.update_block_hashes(self.cfg.block_size);
        let hashes = &r.cold.block_hashes[..max_blocks.min(r.cold.block_hashes.len())];
        let hits = self.pool.count_hits(hashes.iter().copied());
        let evictable = hashes[..hits]
            .iter()
            .filter(|&&h| self.pool.lookup(h).is_some_and(|b| self.pool.ref_count(b) == 0))
            .count();
        (hits, evictable)
    }

    /// Put the first `hits` cached blocks (found by `prefix_lookup`) into `idx`'s empty table.
    pub(super) fn take_prefix_hits(&mut self, idx: u32, hits: usize) {
        let r = &mut self.requests[idx];
        debug_assert!(r.block_table.is_empty(), "hits only start a table");
        for &h in &r.cold.block_hashes[..hits] {
            let b = self.pool.lookup(h).expect("prefix_lookup found it in this step");
            self.pool.touch(b);
            r.block_table.push(b);
        }
    }
}

/// The first work of a request being admitted and what it costs.
#[derive(Debug, Clone, Copy)]
struct AdmissionPlan {
    /// It already holds KV (yielded or imported) and needs no prefix lookup.
    holds: bool,
    /// Leading blocks found in the prefix cache.
    hit_blocks: usize,
    /// It forks from its source's prompt KV instead.
    fork: Option<ForkPlan>,
    /// Computed tokens once admitted (held KV or prefix hit).
    computed: usize,
    /// The kind of its first work.
    key: WorkKey,
    /// Tokens of its first work.
    n: usize,
    /// New blocks to allocate.
    need: usize,
    /// Free blocks the admission consumes (new blocks + revived cached ones).
    blocks_taken: usize,
}
