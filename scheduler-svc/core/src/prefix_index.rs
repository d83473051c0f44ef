//! The prefix cache's index: block hash → block, an open-addressing table sized once.
//!
//! Why not a `HashMap`: at thousands of running requests a step fills about one block per
//! sixteen requests, and registering each is a random access into a table of one slot per KV
//! block (tens of MiB) — one cache miss per insert, taken one after another. This table is laid
//! out so that the slot a hash lands in is known before the insert ([`PrefixIndex::prefetch`]),
//! letting the step builder ask for all of a step's slots first and overlap the misses. Keys are
//! already uniform 64-bit hashes, so they are used directly (Fibonacci-scrambled) with no
//! hasher, and a slot is one 16-byte key/value pair, so a probe stays in one cache line.
//!
//! Invariants kept: linear probing with backward-shift deletion (no tombstones), so every key
//! is reachable from its home slot without crossing an empty slot; at most one slot per key;
//! the table is at most two thirds full (capacity is fixed from the number of blocks, which
//! bounds the number of keys), so probes stay short and always end at an empty slot.

use crate::block_hash::BlockHash;
use crate::prefetch::prefetch;
use crate::types::BlockId;

const EMPTY: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Slot {
    key: u64,
    /// The block, or `EMPTY`.
    block: u32,
}

const VACANT: Slot = Slot { key: 0, block: EMPTY };

/// Block hash → block, for at most `max_keys` keys.
#[derive(Debug, Clone)]
pub(crate) struct PrefixIndex {
    slots: Vec<Slot>,
    shift: u32,
    len: usize,
}

impl PrefixIndex {
    /// A table for at most `max_keys` keys (one per KV block).
    pub(crate) fn with_max_keys(max_keys: usize) -> Self {
        // Load at most 2/3: short probes without doubling an already large table.
        let cap = (max_keys + max_keys / 2 + 1).next_power_of_two().max(8);
        PrefixIndex { slots: vec![VACANT; cap], shift: 64 - cap.trailing_zeros(), len: 0 }
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    /// Index of `key`'s slot, or of the empty slot where it would go.
    #[inline]
    fn probe(&self, key: u64) -> usize {
        let mut i = self.home(key);
        loop {
            let s = self.slots[i];
            if s.block == EMPTY || s.key == key {
                return i;
            }
            i = (i + 1) & self.mask();
        }
    }

    /// Ask for the cache line `hash`'s home slot is in (see the module doc).
    #[inline]
    pub(crate) fn prefetch(&self, hash: BlockHash) {
        prefetch(&raw const self.slots[self.home(hash.0)]);
    }

    /// The block registered under `hash`.
    #[inline]
    pub(crate) fn get(&self, hash: BlockHash) -> Option<BlockId> {
        let s = self.slots[self.probe(hash.0)];
        (s.block != EMPTY).then_some(BlockId(s.block))
    }

    /// Register `block` under `hash` unless the hash is taken; true if inserted.
    pub(crate) fn insert_if_absent(&mut self, hash: BlockHash, block: BlockId) -> bool {
        let i = self.probe(hash.0);
        if self.slots[i].block != EMPTY {
            return false;
        }
        assert!(self.len < self.slots.len() - 1, "prefix index over its sized capacity");
        self.slots[i] = Slot { key: hash.0, block: block.0 };
        self.len += 1;
        true
    }

    /// Remove `hash`; returns its block.
    pub(crate) fn remove(&mut self, hash: BlockHash) -> Option<BlockId> {
        let mut hole = self.probe(hash.0);
        let found = self.slots[hole];
        if found.block == EMPTY {
            return None;
        }
        // Backward shift: pull later entries of the run into the hole when their home is at or
        // before it, so no key is left behind an empty slot.
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s.block == EMPTY {
                break;
            }
            let home = self.home(s.key);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = VACANT;
        self.len -= 1;
        Some(BlockId(found.block))
    }

    /// Every (hash, block) pair, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (BlockHash, BlockId)> + '_ {
        self.slots.iter().filter(|s| s.block != EMPTY).map(|s| (BlockHash(s.key), BlockId(s.block)))
    }

    /// Verify that every key is reachable from its home slot and `len` is right.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut n = 0;
        for (i, s) in self.slots.iter().enumerate() {
            if s.block == EMPTY {
                continue;
            }
            n += 1;
            if self.probe(s.key) != i {
                return Err(format!("prefix index: key {:#x} unreachable from its home", s.key));
            }
        }
        if n != self.len {
            return Err(format!("prefix index: len {} but {n} keys", self.len));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn matches_a_hash_map_under_random_inserts_and_removes() {
        let mut idx = PrefixIndex::with_max_keys(64);
        let mut model = HashMap::new();
        let mut x = 1u64;
        for step in 0..20_000u32 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            // Few distinct keys, some sharing home slots, so runs wrap and shift.
            let key = BlockHash((x >> 58) | ((x >> 40 & 1) << 63));
            if x.is_multiple_of(3) || model.len() >= 64 {
                assert_eq!(idx.remove(key), model.remove(&key));
            } else {
                let inserted = idx.insert_if_absent(key, BlockId(step));
                assert_eq!(inserted, !model.contains_key(&key));
                model.entry(key).or_insert(BlockId(step));
            }
            assert_eq!(idx.get(key), model.get(&key).copied());
        }
        idx.check().unwrap();
        let mut all: Vec<_> = idx.iter().collect();
        all.sort();
        let mut expected: Vec<_> = model.into_iter().collect();
        expected.sort();
        assert_eq!(all, expected);
    }
}
