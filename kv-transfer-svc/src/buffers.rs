//! Recycled receive buffers. A chunk read from the network goes into a buffer that a freed
//! block gave back, so its pages are already mapped: a fresh multi-megabyte buffer costs a
//! page fault (and a page of zeroing) per 4 KiB, about a fifth of the receive path's time on
//! loopback (`perf` under `ferry-bench kv`).
//!
//! A buffer handed out by [`BufferPool::take`] and frozen by [`BufferPool::freeze`] returns to
//! its pool when the last [`Bytes`] that shares it drops (a store eviction, a read's end).
//! Buffers are kept per exact length (a layout's block or chunk size: one or two sizes in
//! practice) and at most `limit` idle bytes in all; past it they are freed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;

/// A pool of idle buffers by length.
#[derive(Debug)]
pub struct BufferPool {
    idle: Mutex<Idle>,
    limit: usize,
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
        Arc::new(Self { idle: Mutex::new(Idle::default()), limit })
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Idle> {
        // Updates under the lock are a push or a pop: a panic cannot leave them half done.
        self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A buffer of exactly `len` bytes: a recycled one (its old content still in it: the
    /// caller overwrites all of it), else a new zeroed one.
    pub fn take(&self, len: usize) -> Vec<u8> {
        let recycled = {
            let mut idle = self.idle();
            let buf = idle.by_len.get_mut(&len).and_then(Vec::pop);
            if buf.is_some() {
                idle.bytes -= len;
            }
            buf
        };
        recycled.unwrap_or_else(|| vec![0u8; len])
    }

    /// `buf` as [`Bytes`] that give it back to this pool when the last of them drops.
    pub fn freeze(self: &Arc<Self>, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Recycled { buf, pool: Arc::downgrade(self) })
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
}
