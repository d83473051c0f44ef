//! The KV tier's write path in the core (DESIGN.md §6): the full blocks a finishing request
//! computed itself are queued to be copied to the node's KV agent, where a later request on
//! any node can import them instead of recomputing. At most
//! [`SchedulerConfig::kv_tier_store_blocks_per_step`](crate::SchedulerConfig) go out per step
//! (the executor copies them at the start of that step, before its forward), and a queued
//! block goes out only while the prefix cache still names it by its hash — once it was
//! evicted and reused its content is another block's, and it is dropped from the queue.
//!
//! Blocks the request found in the prefix cache or imported are not queued: whoever computed
//! them queued them (or they arrived through the node's agent, which keeps them).

use std::collections::VecDeque;

use super::Scheduler;
use crate::block_hash::BlockHash;
use crate::types::BlockId;

/// Most blocks waiting to be stored; past it the oldest are dropped (the tier is a cache).
const MAX_PENDING: usize = 1 << 16;

/// Blocks waiting to be written to the node's agent.
#[derive(Debug, Default)]
pub(crate) struct TierStores {
    pending: VecDeque<(BlockId, BlockHash)>,
}

impl Scheduler {
    /// Blocks wait to be written to the KV tier: the next step carries some, even when no
    /// request is left (a drained core still has this to send).
    #[must_use]
    pub fn tier_stores_pending(&self) -> bool {
        !self.tier.pending.is_empty()
    }

    /// Queue the full blocks request `idx` computed itself for the KV tier (call before its
    /// blocks are released).
    pub(super) fn queue_tier_store(&mut self, idx: u32) {
        if self.cfg.kv_tier_store_blocks_per_step == 0 || !self.cfg.enable_prefix_caching {
            return;
        }
        let r = &self.requests[idx];
        let bs = self.cfg.block_size;
        let first = r.cold.prefix_hit_tokens.max(r.cold.import_tokens).div_ceil(bs);
        let last = r.registered().min(r.cold.block_hashes.len()).min(r.block_table.len());
        if first >= last {
            return;
        }
        let pending = &mut self.tier.pending;
        pending.extend((first..last).map(|i| (r.block_table[i], r.cold.block_hashes[i])));
        while pending.len() > MAX_PENDING {
            pending.pop_front();
        }
    }

    /// Put up to the per-step number of queued blocks, still cached, into the plan.
    pub(super) fn store_tier_blocks(&mut self) {
        let max = self.cfg.kv_tier_store_blocks_per_step;
        if max == 0 || self.tier.pending.is_empty() {
            return;
        }
        let (mut blocks, mut hashes) = (Vec::new(), Vec::new());
        while blocks.len() < max {
            let Some((block, hash)) = self.tier.pending.pop_front() else { break };
            if self.pool.lookup(hash) == Some(block) {
                blocks.push(block);
                hashes.push(hash);
            }
        }
        if !blocks.is_empty() {
            self.draft.store(&blocks, &hashes);
        }
    }
}
