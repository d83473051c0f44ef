//! Read-only views for metrics, the admin listing and the router.
//!
//! Why: the service layer exports vLLM-style gauges and counters, lists requests for operators,
//! and the router asks each core how much of a prompt it already caches; none of that may
//! mutate scheduling state, so it all lives behind `&self`.

use crate::block_hash::hash_block;
use crate::block_hash::BlockHash;
use crate::request::{Decision, Request, RequestStatus, RequestTimes};
use crate::types::{BlockId, RequestId, TokenId};
use crate::work_queues::WorkKey;

use super::Scheduler;

/// Gauges and counters for metrics (the vLLM metric each one feeds, where one exists).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SchedulerStats {
    /// Requests holding a slot and running (vLLM `vllm:num_requests_running`).
    pub num_running: usize,
    /// Requests waiting for admission (vLLM `vllm:num_requests_waiting`).
    pub num_waiting: usize,
    /// Requests receiving their KV.
    pub num_receiving: usize,
    /// Requests exporting their KV.
    pub num_transferring: usize,
    /// Slots in use (running, transferring, unretired finished).
    pub slots_held: usize,
    /// Fraction of blocks held; cached free blocks count as free (`vllm:kv_cache_usage_perc`).
    pub kv_usage: f64,
    /// Free blocks that still cache a prefix.
    pub cached_free_blocks: usize,
    /// Blocks waiting behind an in-flight step's fence.
    pub fenced_blocks: usize,
    /// Prompt tokens looked up in the prefix cache (vLLM `vllm:prefix_cache_queries_total`).
    pub prefix_cache_queries: u64,
    /// Of those, tokens found (vLLM `vllm:prefix_cache_hits_total`).
    pub prefix_cache_hits: u64,
    /// Preemptions so far (vLLM `vllm:num_preemptions_total`).
    pub num_preemptions: u64,
    /// Steps that held prefills back for a data-parallel group's throttle (prompt work was
    /// queued or requests waited, and the step ran decodes only).
    pub prefills_deferred: u64,
    /// Times a request waited for its LoRA adapter (`max_loras` others held; a request counts
    /// once per step it waited).
    pub lora_waits: u64,
    /// Prefill tokens computed (hits excluded) (vLLM `vllm:prompt_tokens_total`).
    pub prompt_tokens: u64,
    /// Output tokens appended (vLLM `vllm:generation_tokens_total`).
    pub generation_tokens: u64,
    /// Steps built.
    pub steps: u64,
    /// Steps built whose result is not applied yet.
    pub steps_in_flight: usize,
    /// Requests finished (any reason).
    pub requests_finished: u64,
    /// Verifications applied (vLLM `vllm:spec_decode_num_drafts_total`).
    pub spec_drafts: u64,
    /// Draft tokens they carried (vLLM `vllm:spec_decode_num_draft_tokens_total`).
    pub spec_draft_tokens: u64,
    /// Draft tokens accepted (vLLM `vllm:spec_decode_num_accepted_tokens_total`).
    pub spec_accepted_tokens: u64,
    /// Verifications that accepted the draft token at each position, from the first (vLLM
    /// `vllm:spec_decode_num_accepted_tokens_per_pos`).
    pub spec_accepted_per_position: [u64; crate::scheduler_config::MAX_SPECULATIVE_TOKENS],
    /// Samples of a parallel-sampling request that forked from their source's prompt KV.
    pub forks: u64,
    /// Blocks those forks took a reference to instead of computing (prompt blocks shared).
    pub fork_shared_blocks: u64,
    /// Partial blocks those forks copied.
    pub fork_copied_blocks: u64,
    /// A looped model's chains (a prompt chunk or a decoded token through every stage) that
    /// completed their coda.
    pub chains_completed: u64,
    /// Recurrent loops those chains ran.
    pub chain_loops: u64,
    /// Those of them that exited before their `max_loops`.
    pub chains_exited_early: u64,
    /// Chains dropped mid-way by a preemption (recomputed from their prelude).
    pub chains_dropped: u64,
}

/// One request, as the admin listing shows it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestView {
    /// The request.
    pub id: RequestId,
    /// Lifecycle status.
    pub status: RequestStatus,
    /// Pending work, if any.
    pub pending_work: Option<WorkKey>,
    /// Holds an admission slot.
    pub has_slot: bool,
    /// Blocks in its table.
    pub blocks_held: usize,
    /// Tokens whose KV is computed or scheduled.
    pub num_computed_tokens: usize,
    /// Prompt tokens.
    pub num_prompt_tokens: usize,
    /// Output tokens so far.
    pub num_output_tokens: usize,
    /// Times preempted.
    pub num_preemptions: u32,
    /// Its priority.
    pub priority: i32,
    /// The last scheduling decision about it.
    pub last_decision: Decision,
}

impl Scheduler {
    /// Current gauges and counters.
    #[must_use]
    pub fn stats(&self) -> SchedulerStats {
        let n = self.pool.num_blocks();
        let c = &self.counters;
        let receiving = self.transfers.queued_imports() + self.transfers.importing();
        SchedulerStats {
            num_running: self.active.len(),
            num_waiting: self.waiting.len(),
            num_receiving: receiving,
            num_transferring: self.transfers.transferring(),
            slots_held: self.slots.held(),
            kv_usage: (n - self.pool.num_free()) as f64 / n as f64,
            cached_free_blocks: self.pool.num_cached_free(),
            fenced_blocks: self.fences.fenced(),
            prefix_cache_queries: c.prefix_queries,
            prefix_cache_hits: c.prefix_hits,
            num_preemptions: c.preemptions,
            prefills_deferred: c.prefills_deferred,
            lora_waits: c.lora_waits,
            prompt_tokens: c.prompt_tokens,
            generation_tokens: c.generation_tokens,
            steps: c.steps,
            steps_in_flight: self.steps.len(),
            requests_finished: c.finished,
            spec_drafts: c.spec_drafts,
            spec_draft_tokens: c.spec_draft_tokens,
            spec_accepted_tokens: c.spec_accepted_tokens,
            spec_accepted_per_position: c.spec_accepted_per_position,
            forks: c.forks,
            fork_shared_blocks: c.fork_shared_blocks,
            fork_copied_blocks: c.fork_copied_blocks,
            chains_completed: c.chains_completed,
            chain_loops: c.chain_loops,
            chains_exited_early: c.chains_exited_early,
            chains_dropped: c.chains_dropped,
        }
    }

    /// The admin view of one request (`None` once retired).
    #[must_use]
    pub fn request_view(&self, id: RequestId) -> Option<RequestView> {
        let idx = self.requests.index_of(id)?;
        Some(self.view_of(idx, &self.requests[idx]))
    }

    /// Every live request, in arena entry order (O(requests); for the admin listing).
    pub fn request_views(&self) -> impl Iterator<Item = RequestView> + '_ {
        self.requests.iter().map(|(idx, r)| self.view_of(idx, r))
    }

    fn view_of(&self, idx: u32, r: &Request) -> RequestView {
        RequestView {
            id: r.id,
            status: r.status,
            pending_work: self.work.pending(idx),
            has_slot: r.has_slot,
            blocks_held: r.block_table.len(),
            num_computed_tokens: r.num_computed,
            num_prompt_tokens: r.prompt.len(),
            num_output_tokens: r.output.len(),
            num_preemptions: r.num_preemptions,
            priority: r.priority,
            last_decision: r.decision,
        }
    }

    /// A request's timestamps so far (arrival, first scheduled, first token, preemptions).
    #[must_use]
    pub fn request_times(&self, id: RequestId) -> Option<&RequestTimes> {
        let idx = self.requests.index_of(id)?;
        Some(&self.requests[idx].cold.times)
    }

    /// A request's block table (block ids in token order).
    #[must_use]
    pub fn block_table(&self, id: RequestId) -> Option<&[BlockId]> {
        let idx = self.requests.index_of(id)?;
        Some(&self.requests[idx].block_table)
    }

    /// Hashes of a request's full blocks computed so far (the names the KV transfer uses).
    #[must_use]
    pub fn block_hashes(&self, id: RequestId) -> Option<&[BlockHash]> {
        let idx = self.requests.index_of(id)?;
        Some(&self.requests[idx].cold.block_hashes)
    }

    /// How many of `hashes` (a prompt's full blocks' hash chain, as [`crate::extend_block_hashes`]
    /// computes it) this cache holds from the first on: [`Scheduler::prefix_hit_tokens`] in
    /// blocks, for a caller that asks many caches about one prompt and hashes it once. The
    /// caller leaves out the block holding the prompt's last token.
    #[must_use]
    pub fn cached_prefix_blocks(&self, hashes: &[BlockHash]) -> usize {
        if !self.cfg.enable_prefix_caching {
            return 0;
        }
        hashes.iter().take_while(|h| self.pool.lookup(**h).is_some()).count()
    }

    /// How many leading tokens of `prompt` (under `salt`) this cache would serve as a prefix
    /// hit right now: full blocks only, never the last token (the router's placement signal).
    /// Allocation-free; does not touch the hit counters.
    #[must_use]
    pub fn prefix_hit_tokens(&self, prompt: &[TokenId], salt: u64) -> usize {
        if !self.cfg.enable_prefix_caching || prompt.is_empty() {
            return 0;
        }
        let bs = self.cfg.block_size;
        let max_blocks = (prompt.len() - 1) / bs;
        let mut parent = None;
        let mut hits = 0;
        for chunk in prompt.chunks_exact(bs).take(max_blocks) {
            let h = hash_block(parent, chunk, salt);
            if self.pool.lookup(h).is_none() {
                break;
            }
            hits += 1;
            parent = Some(h);
        }
        hits * bs
    }
}
