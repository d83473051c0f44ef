//! The KV block pool of one executor: reference counts, the free list, and the prefix cache.
//!
//! Why: blocks are the scarcest resource; the pool decides which physical block holds which
//! tokens, lets requests with the same prefix share full blocks (content-addressed by
//! [`BlockHash`]), and keeps freed full blocks around as cache until their space is needed.
//!
//! Block states: *held* (`ref_cnt > 0`, in one or more block tables or fenced by an in-flight
//! step) or *free* (`ref_cnt == 0`, in the free list). A free block may still carry a hash and
//! be found by prefix lookups ("cached free"); it loses its hash only when it is reallocated
//! (evicted). The free list is an LRU: freed blocks without a hash go to the front (they are
//! worthless, reuse them first), freed cached blocks to the back, and allocation takes from the
//! front, so the least recently freed cached block is evicted first.
//!
//! Invariants kept (see [`BlockPool::check`]): free + held = total; a block is in the free list
//! iff its count is zero; the hash map and the per-block hashes agree (one block per hash).

use crate::block_hash::BlockHash;
use crate::lists::Lists;
use crate::prefix_index::PrefixIndex;
use crate::types::BlockId;

const FREE_LIST: u32 = 0;

/// Fixed-size pool of KV blocks with reference counts and a prefix cache.
#[derive(Debug, Clone)]
pub(crate) struct BlockPool {
    ref_cnt: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    free: Lists,
    cached: PrefixIndex,
    cached_free: usize,
    caching: bool,
}

impl BlockPool {
    /// `num_blocks` free blocks; `caching` enables content-addressed sharing.
    pub(crate) fn new(num_blocks: usize, caching: bool) -> Self {
        let mut free = Lists::new(1);
        free.ensure_elements(num_blocks);
        for b in 0..num_blocks as u32 {
            free.push_back(FREE_LIST, b);
        }
        BlockPool {
            ref_cnt: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            free,
            // At most one hash per block: sized once so registering never rehashes mid-step.
            cached: PrefixIndex::with_max_keys(if caching { num_blocks } else { 0 }),
            cached_free: 0,
            caching,
        }
    }

    /// Total blocks.
    #[inline]
    pub(crate) fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    /// Free blocks, cached ones included (they are evicted on demand).
    #[inline]
    pub(crate) fn num_free(&self) -> usize {
        self.free.len(FREE_LIST)
    }

    /// Free blocks that still carry a hash (the evictable part of the prefix cache).
    #[inline]
    pub(crate) fn num_cached_free(&self) -> usize {
        self.cached_free
    }

    /// Reference count of `block`.
    #[inline]
    pub(crate) fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_cnt[block.index()]
    }

    /// The hash `block` is registered under, if any.
    #[cfg(test)]
    pub(crate) fn hash_of(&self, block: BlockId) -> Option<BlockHash> {
        self.hash[block.index()]
    }

    /// The block caching `hash`, if any.
    #[inline]
    pub(crate) fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        if self.caching {
            self.cached.get(hash)
        } else {
            None
        }
    }

    /// Take `n` fresh blocks (evicting cached free blocks as needed) into `out`, each with count
    /// one. All or nothing: false (and no change) if fewer than `n` are free.
    pub(crate) fn allocate(&mut self, n: usize, out: &mut Vec<BlockId>) -> bool {
        if n > self.num_free() {
            return false;
        }
        for _ in 0..n {
            let b = self.free.pop_front(FREE_LIST).expect("free list holds num_free() blocks");
            if let Some(h) = self.hash[b as usize].take() {
                self.cached.remove(h);
                self.cached_free -= 1;
            }
            self.ref_cnt[b as usize] = 1;
            out.push(BlockId(b));
        }
        true
    }

    /// Add a reference to a block found by prefix lookup (revives it if it was free).
    pub(crate) fn touch(&mut self, block: BlockId) {
        let i = block.index();
        if self.ref_cnt[i] == 0 {
            self.free.remove(block.0);
            if self.hash[i].is_some() {
                self.cached_free -= 1;
            }
        }
        self.ref_cnt[i] += 1;
    }

    /// Drop one reference; at zero the block becomes free (and stays cached if it has a hash).
    pub(crate) fn release(&mut self, block: BlockId) {
        let i = block.index();
        debug_assert!(self.ref_cnt[i] > 0, "release of free block {i}: double free");
        if self.ref_cnt[i] == 0 {
            return;
        }
        self.ref_cnt[i] -= 1;
        if self.ref_cnt[i] == 0 {
            if self.hash[i].is_some() {
                self.free.push_back(FREE_LIST, block.0);
                self.cached_free += 1;
            } else {
                self.free.push_front(FREE_LIST, block.0);
            }
        }
    }

    /// Register a held, full, computed block under `hash` so later requests can share it.
    /// A hash already cached by another block leaves this one unregistered (it stays private).
    pub(crate) fn register(&mut self, block: BlockId, hash: BlockHash) {
        if !self.caching || self.hash[block.index()].is_some() {
            return;
        }
        debug_assert!(self.ref_cnt[block.index()] > 0, "registering a free block");
        if self.cached.insert_if_absent(hash, block) {
            self.hash[block.index()] = Some(hash);
        }
    }

    /// Ask for the memory registering `hash` will touch (a hint; see `prefix_index`).
    #[inline]
    pub(crate) fn prefetch_register(&self, hash: BlockHash) {
        if self.caching {
            self.cached.prefetch(hash);
        }
    }

    /// Number of leading `hashes` that are cached, in blocks.
    pub(crate) fn count_hits(&self, hashes: impl IntoIterator<Item = BlockHash>) -> usize {
        if !self.caching {
            return 0;
        }
        hashes.into_iter().take_while(|&h| self.cached.get(h).is_some()).count()
    }

    /// Verify the pool's own invariants.
    pub(crate) fn check(&self) -> Result<(), String> {
        self.free.check()?;
        let mut free = 0;
        let mut cached_free = 0;
        for (i, &rc) in self.ref_cnt.iter().enumerate() {
            let listed = self.free.list_of(i as u32).is_some();
            if (rc == 0) != listed {
                return Err(format!("block {i}: ref_cnt {rc} but free-listed={listed}"));
            }
            if rc == 0 {
                free += 1;
                if self.hash[i].is_some() {
                    cached_free += 1;
                }
            }
            if let Some(h) = self.hash[i] {
                if self.cached.get(h) != Some(BlockId(i as u32)) {
                    return Err(format!("block {i} has a hash the cache maps elsewhere"));
                }
            }
        }
        if free != self.num_free() || cached_free != self.cached_free {
            return Err("free counters disagree with block states".into());
        }
        self.cached.check()?;
        for (h, b) in self.cached.iter() {
            if self.hash[b.index()] != Some(h) {
                return Err(format!("cache maps {h:?} to block {} without that hash", b.0));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_release_and_lru_eviction() {
        let mut p = BlockPool::new(4, true);
        let mut got = Vec::new();
        assert!(p.allocate(3, &mut got));
        assert!(!p.allocate(2, &mut got), "all or nothing");
        assert_eq!(got.len(), 3);
        p.register(got[0], BlockHash(10));
        p.register(got[1], BlockHash(11));
        p.register(got[2], BlockHash(10)); // duplicate content stays private
        assert_eq!(p.hash_of(got[2]), None);
        for &b in &got {
            p.release(b);
        }
        assert_eq!(p.num_free(), 4);
        assert_eq!(p.num_cached_free(), 2);
        assert_eq!(p.count_hits([BlockHash(10), BlockHash(11), BlockHash(12)]), 2);
        // A hit revives a cached free block.
        p.touch(got[0]);
        assert_eq!(p.ref_count(got[0]), 1);
        assert_eq!(p.num_free(), 3);
        // Allocation takes unhashed blocks first, then the least recently freed cached one.
        let mut more = Vec::new();
        assert!(p.allocate(3, &mut more));
        assert_eq!(p.lookup(BlockHash(11)), None, "evicted when its space was needed");
        assert_eq!(p.lookup(BlockHash(10)), Some(got[0]), "held blocks are never evicted");
        p.check().unwrap();
    }
}
