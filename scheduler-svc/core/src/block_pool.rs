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
//!
//! The executor keeps a copy of which block caches which hash, so that a new leader can adopt
//! its cached blocks ([`BlockPool::adopt`]): every registration and eviction is recorded
//! ([`BlockPool::take_changes`]) and goes out with the step built next, before any write to the
//! evicted block.

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
    /// Hashes registered (`Some`) and dropped by reallocation (`None`) since the last
    /// [`BlockPool::take_changes`], in order.
    changes: Vec<(BlockId, Option<BlockHash>)>,
}

/// What changed in the prefix cache since the last step, in the form the executor applies: the
/// evicted blocks before the step writes anything, the cached ones after it ran.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheChanges {
    /// Blocks that lost their hash (reallocated); they may be written from this step on.
    pub evicted: Vec<BlockId>,
    /// Blocks that cache a hash at the end of the step (their content computed by then).
    pub cached: Vec<(BlockId, BlockHash)>,
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
            changes: Vec::new(),
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
                self.changes.push((BlockId(b), None));
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
            self.changes.push((block, Some(hash)));
        }
    }

    /// Take `block` out of the prefix cache (its content is not what its hash names: the step
    /// that was to compute it did not), held or free; the executor is told as of an eviction.
    pub(crate) fn unregister(&mut self, block: BlockId) {
        let i = block.index();
        if let Some(h) = self.hash[i].take() {
            self.cached.remove(h);
            if self.ref_cnt[i] == 0 {
                self.cached_free -= 1;
                // No longer worth keeping: reused first.
                self.free.remove(block.0);
                self.free.push_front(FREE_LIST, block.0);
            }
            self.changes.push((block, None));
        }
    }

    /// Adopt free, unhashed `block` as caching `hash` (what an executor reported holding when
    /// this pool's session opened): it becomes cached free, evicted after the blocks freed
    /// before it. False, and no change, for a block out of range, held or hashed, for a hash
    /// already cached, or with caching off.
    pub(crate) fn adopt(&mut self, block: BlockId, hash: BlockHash) -> bool {
        let i = block.index();
        if !self.caching
            || i >= self.num_blocks()
            || self.ref_cnt[i] != 0
            || self.hash[i].is_some()
            || !self.cached.insert_if_absent(hash, block)
        {
            return false;
        }
        self.hash[i] = Some(hash);
        self.free.remove(block.0);
        self.free.push_back(FREE_LIST, block.0);
        self.cached_free += 1;
        true
    }

    /// The registrations and evictions since the last call, reduced to what the executor
    /// applies: each evicted block once (in `evicted` even if cached again since), and each
    /// block whose last change was a registration, with that hash.
    pub(crate) fn take_changes(&mut self, out: &mut CacheChanges) {
        out.evicted.clear();
        out.cached.clear();
        if self.changes.is_empty() {
            return;
        }
        // Stable: a block's changes stay in order.
        self.changes.sort_by_key(|&(b, _)| b);
        for run in self.changes.chunk_by(|a, b| a.0 == b.0) {
            let block = run[0].0;
            if run.iter().any(|(_, h)| h.is_none()) {
                out.evicted.push(block);
            }
            if let Some((_, Some(h))) = run.last() {
                out.cached.push((block, *h));
            }
        }
        self.changes.clear();
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

    #[test]
    fn changes_reach_the_executor_as_evictions_first_and_final_hashes() {
        let mut p = BlockPool::new(2, true);
        let mut got = Vec::new();
        let mut changes = CacheChanges::default();
        assert!(p.allocate(2, &mut got));
        p.register(got[0], BlockHash(1));
        p.register(got[1], BlockHash(1)); // stays private: not reported
        p.take_changes(&mut changes);
        assert_eq!(changes, CacheChanges { evicted: vec![], cached: vec![(got[0], BlockHash(1))] });
        // Freed, reallocated (evicted) and cached again under another hash in one step; then
        // registered and evicted in one step: the executor must end with no hash there.
        p.release(got[0]);
        p.release(got[1]);
        let mut again = Vec::new();
        assert!(p.allocate(2, &mut again));
        p.register(got[0], BlockHash(2));
        p.take_changes(&mut changes);
        assert_eq!(changes.evicted, vec![got[0]]);
        assert_eq!(changes.cached, vec![(got[0], BlockHash(2))]);
        p.release(got[0]);
        assert!(p.allocate(1, &mut again));
        p.take_changes(&mut changes);
        assert_eq!(changes, CacheChanges { evicted: vec![got[0]], cached: vec![] });
        p.check().unwrap();
    }

    #[test]
    fn adoption_takes_free_unhashed_blocks_only() {
        let mut p = BlockPool::new(3, true);
        assert!(p.adopt(BlockId(1), BlockHash(7)));
        assert!(!p.adopt(BlockId(1), BlockHash(8)), "already hashed");
        assert!(!p.adopt(BlockId(2), BlockHash(7)), "hash cached elsewhere");
        assert!(!p.adopt(BlockId(3), BlockHash(9)), "out of range");
        assert_eq!((p.num_free(), p.num_cached_free()), (3, 1));
        assert_eq!(p.lookup(BlockHash(7)), Some(BlockId(1)));
        // Unhashed blocks go first; the adopted one is evicted last.
        let mut got = Vec::new();
        assert!(p.allocate(2, &mut got));
        assert!(!got.contains(&BlockId(1)));
        assert!(!p.adopt(got[0], BlockHash(9)), "held");
        p.check().unwrap();
        let mut off = BlockPool::new(3, false);
        assert!(!off.adopt(BlockId(0), BlockHash(1)), "caching off");
    }
}
