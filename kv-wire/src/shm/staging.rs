//! A region this process made ([`Staging`]): an executor's staging region, or an agent's store
//! buffers of one length. It hands out [`Slots`], each slot to one transfer at a time, lowest
//! first so the region's pages stay at the high-water mark of its use; a slot's pages are
//! reserved when it is first handed out, and it returns to the free list when its [`Slots`]
//! drop (pool blocks excepted: they are never the free list's).

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use memmap2::{MmapOptions, MmapRaw};

use super::files::{lock, random, remove_orphans, reserve, MAKING};
use super::region::Regions;
use super::PREFIX;

/// A region of `slots` slots of `block_bytes` each that this process made: an executor's
/// staging region, or an agent's store buffers of one length.
#[derive(Debug)]
pub struct Staging {
    name: String,
    path: PathBuf,
    file: std::fs::File,
    pub(super) map: MmapRaw,
    block_bytes: usize,
    slots: Mutex<SlotState>,
    /// The agent's regions, mapped read-only as this executor reads blocks from them.
    peers: Regions,
    /// Blocks `0..pool_blocks` are an executor's KV pool (see [`Staging::create_with_pool`]);
    /// the staging slots follow them.
    pub(super) pool_blocks: u32,
}

#[derive(Debug)]
struct SlotState {
    /// Free slots, the lowest on top (handed out first, so the region grows in order).
    free: std::collections::BinaryHeap<std::cmp::Reverse<u32>>,
    /// Slots whose pages are reserved: `0..reserved`.
    reserved: u32,
}

// SAFETY: the mapping is shared memory; `Slots` hands each slot to one owner at a time.
unsafe impl Send for Staging {}
unsafe impl Sync for Staging {}

static REGIONS: AtomicU64 = AtomicU64::new(0);

impl Staging {
    /// A new region of `slots` slots of `block_bytes` in `dir`, locked for as long as this
    /// process runs; removes regions left behind by processes that no longer run.
    pub fn create(dir: &Path, block_bytes: usize, slots: u32) -> std::io::Result<Arc<Self>> {
        Self::make(dir, block_bytes, 0, slots)
    }

    /// The region, with its first `pool_blocks` blocks reserved now (see
    /// [`Staging::create_with_pool`]).
    pub(super) fn make(
        dir: &Path,
        block_bytes: usize,
        pool_blocks: u32,
        slots: u32,
    ) -> std::io::Result<Arc<Self>> {
        if block_bytes == 0 || slots == 0 {
            return Err(std::io::Error::other("a staging region needs slots of at least a byte"));
        }
        remove_orphans(dir);
        let n = REGIONS.fetch_add(1, Ordering::Relaxed);
        // Unique across PID namespaces too: processes of two containers may share a pid.
        let name = format!("{PREFIX}{}-{n}-{:016x}", std::process::id(), random());
        let path = dir.join(&name);
        // Made under a name no one looks for, locked, then renamed into place: a region is
        // never seen unlocked while its maker runs (see `remove_orphans`).
        let making = dir.join(format!("{MAKING}{name}"));
        // Readable by this user only: the agent runs as the executor's user.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&making)?;
        let total = pool_blocks.checked_add(slots).ok_or_else(|| {
            std::io::Error::other(format!("{pool_blocks} pool blocks and {slots} slots overflow"))
        })?;
        let len = block_bytes as u64 * u64::from(total);
        let pool_len = block_bytes as u64 * u64::from(pool_blocks);
        let made = lock(&file)
            .and_then(|()| file.set_len(len))
            .and_then(|()| {
                if pool_len == 0 || reserve(&file, 0, pool_len) {
                    Ok(())
                } else {
                    Err(std::io::Error::other(format!(
                        "no room in {} for a KV pool of {} MiB",
                        dir.display(),
                        pool_len >> 20
                    )))
                }
            })
            .and_then(|()| MmapOptions::new().map_raw(&file))
            .and_then(|map| std::fs::rename(&making, &path).map(|()| map));
        let map = match made {
            Ok(map) => map,
            Err(e) => {
                let _ = std::fs::remove_file(&making);
                return Err(e);
            }
        };
        let free = (pool_blocks..total).map(std::cmp::Reverse).collect();
        let slots = Mutex::new(SlotState { free, reserved: pool_blocks });
        let peers = Regions::read_only(dir.to_path_buf());
        Ok(Arc::new(Self { name, path, file, map, block_bytes, slots, peers, pool_blocks }))
    }

    /// The region's file name (what the agent is told).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes per slot.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn state(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.slots.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `n` slots, or `None` when fewer are free (or their pages cannot be reserved).
    pub fn alloc(self: &Arc<Self>, n: usize) -> Option<Slots> {
        let mut st = self.state();
        if n == 0 || st.free.len() < n {
            return None;
        }
        // The lowest free slots: the region's pages stay at the high-water mark of its use.
        let ids: Vec<u32> = (0..n).filter_map(|_| st.free.pop().map(|r| r.0)).collect();
        let top = ids.last().copied().unwrap_or(0) + 1;
        if top > st.reserved {
            let from = u64::from(st.reserved) * self.block_bytes as u64;
            let to = u64::from(top) * self.block_bytes as u64;
            if !reserve(&self.file, from, to - from) {
                st.free.extend(ids.into_iter().map(std::cmp::Reverse));
                return None;
            }
            st.reserved = top;
        }
        Some(Slots { staging: self.clone(), ids, pooled: false })
    }

    /// Regions of the agent's, in this region's directory, mapped read-only: where a staged
    /// read's shared blocks are.
    pub fn peers(&self) -> &Regions {
        &self.peers
    }

    /// The offset of the slot `data` is, if it is exactly one of this region's slots.
    pub fn locate(&self, data: &[u8]) -> Option<u64> {
        let (base, at) = (self.map.as_ptr() as usize, data.as_ptr() as usize);
        let offset = at.checked_sub(base)?;
        let whole = data.len() == self.block_bytes && offset % self.block_bytes == 0;
        (whole && offset + data.len() <= self.map.len()).then_some(offset as u64)
    }

    /// Free slots.
    pub fn free_slots(&self) -> usize {
        self.state().free.len()
    }

    fn give_back(&self, ids: &[u32]) {
        let mut st = self.state();
        st.free.extend(ids.iter().copied().map(std::cmp::Reverse));
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Slots of one transfer; back to the region when dropped (unless they are pool blocks).
#[derive(Debug)]
pub struct Slots {
    pub(super) staging: Arc<Staging>,
    pub(super) ids: Vec<u32>,
    /// Pool blocks ([`Staging::pool_slots`]), never the free list's.
    pub(super) pooled: bool,
}

impl Slots {
    /// Number of slots.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The region they are in.
    pub fn staging(&self) -> &Arc<Staging> {
        &self.staging
    }

    /// Byte offsets of the slots in the region, in order.
    pub fn offsets(&self) -> Vec<u64> {
        self.ids.iter().map(|&id| u64::from(id) * self.staging.block_bytes as u64).collect()
    }

    pub(super) fn ptr(&self, i: usize) -> *mut u8 {
        let at = self.ids[i] as usize * self.staging.block_bytes;
        // SAFETY: `at + block_bytes` is within the mapping (ids are below `slots`).
        unsafe { self.staging.map.as_mut_ptr().add(at) }
    }

    /// Slot `i`'s bytes.
    pub fn block(&self, i: usize) -> &[u8] {
        // SAFETY: the slot is this value's alone; the agent writes it only while a read it was
        // given runs, which has ended before anyone holds `Slots` again.
        unsafe { std::slice::from_raw_parts(self.ptr(i), self.staging.block_bytes) }
    }

    /// Slot `i`'s bytes, to fill.
    pub fn block_mut(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: as for `block`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(i), self.staging.block_bytes) }
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        if !self.pooled {
            self.staging.give_back(&self.ids);
        }
    }
}
