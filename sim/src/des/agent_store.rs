//! A node agent's store of KV blocks, as the simulation models the KV tier: blocks by hash,
//! bounded, the least recently stored dropped first.
//!
//! Invariant: it never holds more than the capacity it was last given (`put` evicts down to it).

use std::collections::{BTreeMap, HashMap};

use ferry_sched_core::BlockHash;

/// A node agent's store of blocks, least recently used first out.
#[derive(Default)]
pub(super) struct AgentStore {
    used: HashMap<BlockHash, u64>,
    order: BTreeMap<u64, BlockHash>,
    tick: u64,
}

impl AgentStore {
    /// Stores `hash` as the most recently used, dropping the least recently used past
    /// `capacity`.
    pub(super) fn put(&mut self, hash: BlockHash, capacity: usize) {
        self.tick += 1;
        if let Some(old) = self.used.insert(hash, self.tick) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, hash);
        while self.used.len() > capacity {
            let Some((_, h)) = self.order.pop_first() else { break };
            self.used.remove(&h);
        }
    }

    /// Leading `hashes` held.
    pub(super) fn run(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.used.contains_key(h)).count()
    }

    /// Whether every one of `hashes` is held.
    pub(super) fn holds_all(&self, hashes: &[BlockHash]) -> bool {
        hashes.iter().all(|h| self.used.contains_key(h))
    }
}
