//! The agent's block store: KV blocks in host memory, named by layout and hash-chain value,
//! bounded in bytes and evicted least recently used first. A block pinned by a transfer in
//! progress is never evicted.
//!
//! Why names and not slots: a full block's content is named by its hash chain (the prefix
//! cache's own key), so the same block arriving twice is stored once, any node can say which
//! blocks it holds, and a reader asks for exactly the content it needs.
//!
//! Invariants ([`BlockStore::check`]):
//! - `used` is the sum of the stored blocks' sizes and never exceeds the capacity (an insert
//!   that finds no room among unpinned blocks is refused, it does not overcommit);
//! - the LRU order holds exactly the unpinned blocks, each once;
//! - a pinned block stays until unpinned.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;

/// A block's name: its layout's id and its hash-chain value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey {
    /// [`ferry_kv_wire::layout::BlockLayout::id`].
    pub layout: u64,
    /// The hash-chain value.
    pub hash: u64,
}

/// One stored block.
#[derive(Debug)]
struct Entry {
    data: Bytes,
    /// Transfers that need it to stay.
    pins: u32,
    /// Its place in the LRU order (when unpinned).
    tick: u64,
}

/// The store was full of pinned blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the block store is full: {needed} bytes needed, {pinned} of {capacity} bytes pinned by transfers in progress")]
pub struct StoreFull {
    /// Bytes the block needs.
    pub needed: usize,
    /// Bytes pinned.
    pub pinned: usize,
    /// The capacity.
    pub capacity: usize,
}

/// What an insert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    /// The block is new to the store.
    New,
    /// It was already there (its content is the same: same name).
    Existing,
}

/// A bounded block store.
#[derive(Debug)]
pub struct BlockStore {
    capacity: usize,
    used: usize,
    pinned_bytes: usize,
    entries: HashMap<BlockKey, Entry>,
    /// Unpinned blocks by last use, oldest first.
    lru: BTreeMap<u64, BlockKey>,
    tick: u64,
    hits: u64,
    misses: u64,
}

impl BlockStore {
    /// An empty store of `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            used: 0,
            pinned_bytes: 0,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            hits: 0,
            misses: 0,
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Stores `data` under `key` (pinned once if `pin`), evicting the least recently used
    /// unpinned blocks as needed. A block already stored is not replaced (same name, same
    /// content); it is pinned or touched.
    pub fn insert(&mut self, key: BlockKey, data: Bytes, pin: bool) -> Result<Inserted, StoreFull> {
        if self.entries.contains_key(&key) {
            if pin {
                self.pin(key);
            } else {
                self.touch(key);
            }
            return Ok(Inserted::Existing);
        }
        let needed = data.len();
        while self.used + needed > self.capacity {
            let Some((_, victim)) = self.lru.pop_first() else {
                return Err(StoreFull {
                    needed,
                    pinned: self.pinned_bytes,
                    capacity: self.capacity,
                });
            };
            let gone = self.entries.remove(&victim).expect("the LRU names stored blocks");
            self.used -= gone.data.len();
        }
        let tick = self.next_tick();
        self.used += needed;
        if pin {
            self.pinned_bytes += needed;
        } else {
            self.lru.insert(tick, key);
        }
        self.entries.insert(key, Entry { data, pins: u32::from(pin), tick });
        Ok(Inserted::New)
    }

    /// The block under `key` (counted as a hit or a miss), now the most recently used.
    pub fn get(&mut self, key: BlockKey) -> Option<Bytes> {
        let Some(e) = self.entries.get(&key) else {
            self.misses += 1;
            return None;
        };
        let data = e.data.clone();
        self.hits += 1;
        self.touch(key);
        Some(data)
    }

    /// Counts a lookup that found a block, or did not.
    pub fn count(&mut self, found: bool) {
        if found {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
    }

    /// The hashes of `layout`'s blocks, least recently used first: the `limit` most recent.
    pub fn list(&self, layout: u64, limit: usize) -> Vec<u64> {
        let mut blocks: Vec<(u64, u64)> = self
            .entries
            .iter()
            .filter(|(k, _)| k.layout == layout)
            .map(|(k, e)| (e.tick, k.hash))
            .collect();
        blocks.sort_unstable();
        let skip = blocks.len().saturating_sub(limit);
        blocks[skip..].iter().map(|&(_, hash)| hash).collect()
    }

    /// Whether `key` is stored (not counted).
    pub fn contains(&self, key: BlockKey) -> bool {
        self.entries.contains_key(&key)
    }

    fn touch(&mut self, key: BlockKey) {
        let tick = self.next_tick();
        let e = self.entries.get_mut(&key).expect("touch of a stored block");
        if e.pins == 0 {
            self.lru.remove(&e.tick);
            self.lru.insert(tick, key);
        }
        e.tick = tick;
    }

    /// Pins `key` once more; false if it is not stored.
    pub fn pin(&mut self, key: BlockKey) -> bool {
        let Some(e) = self.entries.get_mut(&key) else { return false };
        if e.pins == 0 {
            self.lru.remove(&e.tick);
            self.pinned_bytes += e.data.len();
        }
        e.pins += 1;
        true
    }

    /// Removes one pin of `key`; the last one makes it evictable again.
    pub fn unpin(&mut self, key: BlockKey) {
        let Some(e) = self.entries.get_mut(&key) else { return };
        debug_assert!(e.pins > 0, "unpin of an unpinned block");
        e.pins = e.pins.saturating_sub(1);
        if e.pins == 0 {
            self.pinned_bytes -= e.data.len();
            let tick = self.next_tick();
            let e = self.entries.get_mut(&key).expect("present above");
            e.tick = tick;
            self.lru.insert(tick, key);
        }
    }

    /// Removes `key` if it is stored and not pinned; true if it was removed.
    pub fn remove(&mut self, key: BlockKey) -> bool {
        match self.entries.get(&key) {
            Some(e) if e.pins == 0 => {
                let e = self.entries.remove(&key).expect("present above");
                self.lru.remove(&e.tick);
                self.used -= e.data.len();
                true
            }
            _ => false,
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes held.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Bytes held by pinned blocks.
    pub fn pinned_bytes(&self) -> usize {
        self.pinned_bytes
    }

    /// The capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks found and not found by `get` and `lookup` since start.
    pub fn hits_and_misses(&self) -> (u64, u64) {
        (self.hits, self.misses)
    }

    /// Checks the invariants in the module head.
    pub fn check(&self) -> Result<(), String> {
        let sum: usize = self.entries.values().map(|e| e.data.len()).sum();
        if sum != self.used || self.used > self.capacity {
            return Err(format!(
                "used {} != sum {sum} or over capacity {}",
                self.used, self.capacity
            ));
        }
        let pinned: usize =
            self.entries.values().filter(|e| e.pins > 0).map(|e| e.data.len()).sum();
        if pinned != self.pinned_bytes {
            return Err(format!("pinned bytes {} != {pinned}", self.pinned_bytes));
        }
        let unpinned = self.entries.values().filter(|e| e.pins == 0).count();
        if unpinned != self.lru.len() {
            return Err(format!("{unpinned} unpinned blocks but {} in the LRU", self.lru.len()));
        }
        for (tick, key) in &self.lru {
            match self.entries.get(key) {
                Some(e) if e.pins == 0 && e.tick == *tick => {}
                _ => return Err(format!("LRU entry {tick} -> {key:?} is stale")),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(hash: u64) -> BlockKey {
        BlockKey { layout: 1, hash }
    }

    fn block(n: usize) -> Bytes {
        Bytes::from(vec![7u8; n])
    }

    #[test]
    fn the_least_recently_used_unpinned_block_goes_first() {
        let mut s = BlockStore::new(300);
        for h in 1..=3 {
            assert_eq!(s.insert(key(h), block(100), false), Ok(Inserted::New));
        }
        assert!(s.get(key(1)).is_some()); // 1 is now the most recent
        s.insert(key(4), block(100), false).unwrap();
        assert!(!s.contains(key(2)), "2 was the least recently used");
        assert!(s.contains(key(1)) && s.contains(key(3)) && s.contains(key(4)));
        assert_eq!(s.insert(key(4), block(100), false), Ok(Inserted::Existing));
        assert_eq!((s.used(), s.len()), (300, 3));
        s.check().unwrap();
    }

    #[test]
    fn a_layouts_blocks_are_listed_least_recently_used_first() {
        let mut s = BlockStore::new(1000);
        for h in 1..=4 {
            s.insert(key(h), block(100), false).unwrap();
        }
        s.insert(BlockKey { layout: 2, hash: 9 }, block(100), false).unwrap();
        assert!(s.get(key(2)).is_some());
        assert_eq!(s.list(1, 10), [1, 3, 4, 2]);
        assert_eq!(s.list(1, 2), [4, 2], "the most recent");
        assert_eq!(s.list(2, 10), [9]);
        assert!(s.list(3, 10).is_empty());
    }

    #[test]
    fn pinned_blocks_stay_and_a_store_full_of_them_refuses() {
        let mut s = BlockStore::new(200);
        s.insert(key(1), block(100), true).unwrap();
        s.insert(key(2), block(100), true).unwrap();
        let full = s.insert(key(3), block(100), false).unwrap_err();
        assert_eq!(full, StoreFull { needed: 100, pinned: 200, capacity: 200 });
        assert!(full.to_string().contains("200 of 200 bytes pinned"));
        assert!(!s.remove(key(1)), "a pinned block is not removed");
        s.unpin(key(1));
        s.insert(key(3), block(100), false).unwrap();
        assert!(!s.contains(key(1)) && s.contains(key(2)), "1 was evicted once unpinned");
        s.check().unwrap();
    }

    #[test]
    fn random_operations_keep_the_invariants() {
        let mut s = BlockStore::new(1000);
        let mut x = 12345u64;
        let mut pins: HashMap<u64, u32> = HashMap::new();
        for _ in 0..20_000 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let h = (x >> 33) % 40;
            match (x >> 20) % 5 {
                0 | 1 => {
                    let pin = (x >> 8).is_multiple_of(3);
                    if s.insert(key(h), block(50 + (h as usize % 7) * 10), pin).is_ok() && pin {
                        *pins.entry(h).or_default() += 1;
                    }
                }
                2 => {
                    let _ = s.get(key(h));
                }
                3 => {
                    if let Some(n) = pins.get_mut(&h).filter(|n| **n > 0) {
                        *n -= 1;
                        s.unpin(key(h));
                    }
                }
                _ => {
                    s.remove(key(h));
                }
            }
            s.check().unwrap();
            for (h, n) in &pins {
                if *n > 0 {
                    assert!(s.contains(key(*h)), "pinned block {h} was lost");
                }
            }
        }
        let (hits, misses) = s.hits_and_misses();
        assert!(hits > 0 && misses > 0, "the workload exercised both");
    }
}
