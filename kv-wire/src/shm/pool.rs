//! An executor's KV pool inside its staging region: the pool's blocks come first in the
//! region, so the agent reads the blocks an export names straight from where the KV cache
//! keeps them instead of from a copy in a slot.
//!
//! Invariant: the pool's memory is handed out once, as one [`PoolMemory`], when the region is
//! made; every `&`/`&mut` access to it in this process goes through that value.

use std::path::Path;
use std::sync::Arc;

use super::staging::{Slots, Staging};

/// An executor's KV pool in its region: the memory its KV cache lives in, shared with the
/// agent, which reads the blocks an export names straight from it.
#[derive(Debug)]
pub struct PoolMemory {
    /// Keeps the mapping.
    _region: Arc<Staging>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a region's pool is handed out once, when it is made; `&`/`&mut` access follows
// Rust's rules through it.
unsafe impl Send for PoolMemory {}
unsafe impl Sync for PoolMemory {}

impl PoolMemory {
    /// The pool's bytes (page-aligned, `blocks × block_bytes` long).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping lives as long as `region`; only this value hands out references
        // to it in this process (the agent reads it from its own mapping).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The pool's bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `bytes`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The pool as f32 values (a KV cache of f32 keys and values).
    pub fn floats(&self) -> &[f32] {
        // SAFETY: as for `bytes`; the mapping is page-aligned and any bit pattern is an f32.
        unsafe { std::slice::from_raw_parts(self.ptr.cast(), self.len / 4) }
    }

    /// The pool as f32 values, to write.
    pub fn floats_mut(&mut self) -> &mut [f32] {
        // SAFETY: as for `floats`, through the only mutable reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast(), self.len / 4) }
    }

    /// The pool as 16-bit values (a KV cache of f16 keys and values).
    pub fn halves(&self) -> &[u16] {
        // SAFETY: as for `floats`; any bit pattern is a u16.
        unsafe { std::slice::from_raw_parts(self.ptr.cast(), self.len / 2) }
    }

    /// The pool as 16-bit values, to write.
    pub fn halves_mut(&mut self) -> &mut [u16] {
        // SAFETY: as for `halves`, through the only mutable reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast(), self.len / 2) }
    }
}

impl Staging {
    /// A region whose first `pool_blocks` blocks are an executor's KV pool, reserved now
    /// (an error when the tmpfs has no room for them), followed by `slots` staging slots; and
    /// the pool's memory, for the executor's KV cache. An export then names the pool's blocks
    /// to the agent ([`Staging::pool_slots`]) instead of copying them into slots first.
    pub fn create_with_pool(
        dir: &Path,
        block_bytes: usize,
        pool_blocks: u32,
        slots: u32,
    ) -> std::io::Result<(Arc<Self>, PoolMemory)> {
        let region = Self::make(dir, block_bytes, pool_blocks, slots)?;
        let (ptr, len) = (region.map.as_mut_ptr(), pool_blocks as usize * block_bytes);
        Ok((region.clone(), PoolMemory { _region: region, ptr, len }))
    }

    /// Pool blocks `ids` as the slots of a transfer: an export sends them from the pool where
    /// they are. They stay the pool's (nothing is given back when the slots drop); the
    /// scheduler keeps an exported block unchanged until the export is reported, and the
    /// checksums published with each block let the receiver refuse one changed meanwhile (a
    /// transfer cut short by a session reset). `None` if one is not a pool block.
    pub fn pool_slots(self: &Arc<Self>, ids: &[u32]) -> Option<Slots> {
        if ids.is_empty() || ids.iter().any(|&b| b >= self.pool_blocks) {
            return None;
        }
        Some(Slots { staging: self.clone(), ids: ids.to_vec(), pooled: true })
    }
}
