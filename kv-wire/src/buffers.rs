//! Recycled receive buffers. A chunk read from the network goes into a buffer that a freed
//! block gave back, so its pages are already mapped: a fresh multi-megabyte buffer costs a
//! page fault (and a page of zeroing) per 4 KiB, about a fifth of the receive path's time on
//! loopback (`perf` under `ferry-bench kv`).
//!
//! A buffer handed out by [`BufferPool::take`] and frozen by [`BufferPool::freeze`] returns to
//! its pool when the last [`Bytes`] that shares it drops (a store eviction, a read's end).
//! Buffers are kept per exact length (a layout's block or chunk size: one or two sizes in
//! practice) and at most `limit` idle bytes in all; past it they are freed.
//!
//! An agent's pool is [`BufferPool::shared`]: buffers of its first [`SHARED_LENGTHS`] lengths
//! are slots of shared-memory regions ([`crate::shm::Staging`], up to `limit` bytes each,
//! pages reserved as slots are first used), so a local executor can copy a stored block
//! straight out of the agent's store ([`BufferPool::locate`] says where it is). Such a region
//! keeps its pages at the high-water mark of its use; when one is full, or cannot be made,
//! buffers come from the heap as before.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;

use crate::shm::{Slots, Staging};

/// Buffer lengths that get a shared-memory region of their own in an agent's pool.
pub const SHARED_LENGTHS: usize = 2;

/// A pool of idle buffers by length.
#[derive(Debug)]
pub struct BufferPool {
    idle: Mutex<Idle>,
    limit: usize,
    /// Where shared regions are made, and the region of each length.
    shared: Option<(PathBuf, Mutex<SharedRegions>)>,
}

/// The shared region of each buffer length (`None`: none could be made; not tried again).
type SharedRegions = HashMap<usize, Option<Arc<Staging>>>;

/// A buffer to fill: heap memory, or a slot of a shared region.
#[derive(Debug)]
pub enum Buffer {
    /// From the heap.
    Heap(Vec<u8>),
    /// One slot of a shared region.
    Shared(Slots),
}

impl std::ops::Deref for Buffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Heap(v) => v,
            Self::Shared(slot) => slot.block(0),
        }
    }
}

impl std::ops::DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Self::Heap(v) => v,
            Self::Shared(slot) => slot.block_mut(0),
        }
    }
}

/// A frozen shared slot inside [`Bytes`]; back to its region on drop.
struct SharedSlot(Slots);

impl AsRef<[u8]> for SharedSlot {
    fn as_ref(&self) -> &[u8] {
        self.0.block(0)
    }
}

#[derive(Debug, Default)]
struct Idle {
    by_len: HashMap<usize, Vec<Vec<u8>>>,
    bytes: usize,
}

/// A pooled buffer inside [`Bytes`]; gives itself back on drop.
struct Recycled {
    buf: Vec<u8>,
    pool: Weak<BufferPool>,
}

impl AsRef<[u8]> for Recycled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.give_back(std::mem::take(&mut self.buf));
        }
    }
}

impl BufferPool {
    /// A pool keeping at most `limit` idle bytes.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self { idle: Mutex::new(Idle::default()), limit, shared: None })
    }

    /// A pool whose buffers are slots of shared regions made in `dir` (see the module's
    /// documentation), each of at most `limit` bytes.
    pub fn shared(limit: usize, dir: PathBuf) -> Arc<Self> {
        let shared = Some((dir, Mutex::new(HashMap::new())));
        Arc::new(Self { idle: Mutex::new(Idle::default()), limit, shared })
    }

    /// A free slot of the shared region for `len`, made on first use.
    fn shared_slot(&self, len: usize) -> Option<Slots> {
        let (dir, regions) = self.shared.as_ref()?;
        let mut regions = regions.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let full = regions.len() >= SHARED_LENGTHS;
        let region = match regions.get(&len) {
            Some(region) => region.clone(),
            None if full || len == 0 => return None,
            None => {
                let slots = u32::try_from((self.limit / len).max(1)).unwrap_or(u32::MAX);
                let made = Staging::create(dir, len, slots)
                    .inspect_err(|e| {
                        tracing::warn!(
                            dir = %dir.display(),
                            error = %e,
                            "no shared region for the store's buffers: local executors' reads take a copy"
                        );
                    })
                    .ok();
                regions.insert(len, made.clone());
                made
            }
        }?;
        drop(regions);
        region.alloc(1)
    }

    /// The shared region and offset of `data`, if it is one whole slot of this pool's.
    pub fn locate(&self, data: &[u8]) -> Option<(Arc<Staging>, u64)> {
        let (_, regions) = self.shared.as_ref()?;
        let regions = regions.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let region = regions.get(&data.len())?.as_ref()?;
        region.locate(data).map(|offset| (region.clone(), offset))
    }

    /// Free slots of the shared region for buffers of `len` bytes, if there is one.
    pub fn shared_free(&self, len: usize) -> Option<usize> {
        let (_, regions) = self.shared.as_ref()?;
        let regions = regions.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        regions.get(&len)?.as_ref().map(|region| region.free_slots())
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Idle> {
        // Updates under the lock are a push or a pop: a panic cannot leave them half done.
        self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A buffer of exactly `len` bytes: a shared slot, a recycled one (either with its old
    /// content still in it: the caller overwrites all of it), else a new zeroed one.
    pub fn take(&self, len: usize) -> Buffer {
        if let Some(slot) = self.shared_slot(len) {
            return Buffer::Shared(slot);
        }
        let recycled = {
            let mut idle = self.idle();
            let buf = idle.by_len.get_mut(&len).and_then(Vec::pop);
            if buf.is_some() {
                idle.bytes -= len;
            }
            buf
        };
        Buffer::Heap(recycled.unwrap_or_else(|| vec![0u8; len]))
    }

    /// `buf` as [`Bytes`] that give it back to this pool when the last of them drops.
    pub fn freeze(self: &Arc<Self>, buf: Buffer) -> Bytes {
        match buf {
            Buffer::Heap(buf) => Bytes::from_owner(Recycled { buf, pool: Arc::downgrade(self) }),
            Buffer::Shared(slot) => Bytes::from_owner(SharedSlot(slot)),
        }
    }

    fn give_back(&self, buf: Vec<u8>) {
        let len = buf.len();
        let mut idle = self.idle();
        if len == 0 || idle.bytes + len > self.limit {
            return;
        }
        idle.bytes += len;
        idle.by_len.entry(len).or_default().push(buf);
    }

    /// Idle bytes held.
    pub fn idle_bytes(&self) -> usize {
        self.idle().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_buffer_is_handed_out_again_up_to_the_limit() {
        let pool = BufferPool::new(3 * 1024);
        let mut a = pool.take(1024);
        a[0] = 7;
        let ptr = a.as_ptr();
        let bytes = pool.freeze(a);
        let shared = bytes.slice(0..10);
        drop(bytes);
        assert_eq!(pool.idle_bytes(), 0, "a slice still shares the buffer");
        drop(shared);
        assert_eq!(pool.idle_bytes(), 1024);
        let again = pool.take(1024);
        assert_eq!((again.as_ptr(), again[0]), (ptr, 7), "the same buffer, not a new one");
        assert_eq!(pool.take(512).len(), 512, "another length gets a new buffer");
        // Past the limit, buffers are freed.
        let four: Vec<Bytes> = (0..4).map(|_| pool.freeze(pool.take(1024))).collect();
        drop(four);
        assert_eq!(pool.idle_bytes(), 3 * 1024);
        drop(again);
    }

    #[test]
    fn a_shared_pool_hands_out_slots_of_its_first_lengths_then_heap_memory() {
        let dir = std::env::temp_dir().join(format!("ferry-buffers-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pool = BufferPool::shared(2 * 4096, dir.clone());
        let (a, b) = (pool.take(4096), pool.take(4096));
        assert!(matches!((&a, &b), (Buffer::Shared(_), Buffer::Shared(_))));
        assert!(matches!(pool.take(4096), Buffer::Heap(_)), "the region is full: the heap");
        assert!(matches!(pool.take(1024), Buffer::Shared(_)), "a second length");
        assert!(matches!(pool.take(512), Buffer::Heap(_)), "only {SHARED_LENGTHS} lengths");
        let (a, b) = (pool.freeze(a), pool.freeze(b));
        let (region, offset) = pool.locate(&b).expect("a slot of the pool's region");
        assert_eq!((region.block_bytes(), offset % 4096), (4096, 0));
        assert!(pool.locate(&b[1..]).is_none(), "part of a slot is not one");
        assert!(pool.locate(&pool.freeze(pool.take(4096))).is_none(), "heap memory");
        assert_eq!(pool.shared_free(4096), Some(0));
        let part = a.slice(0..10);
        drop(a);
        assert_eq!(pool.shared_free(4096), Some(0), "a slice still holds the slot");
        drop((part, b));
        assert_eq!(pool.shared_free(4096), Some(2));
        drop(region);
        let _ = std::fs::remove_dir_all(dir);
    }
}
