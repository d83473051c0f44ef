//! The paged KV cache: a pool of fixed-size blocks in host memory. The scheduler owns the
//! allocation (block tables arrive with each step); this type only stores and addresses.
//!
//! Layout, one block after another, as DESIGN.md §6 fixes it for transfers: a block is
//! `layers × {K, V} × block_size × kv_heads × head_dim` values, contiguous, so a block moves
//! between nodes as one slice. Values are f16 (the default, as llama.cpp's: half the memory,
//! so twice the tokens, and attention reads half the bytes) or f32 ([`KvDtype`]); an f16 value
//! is the f32 rounded to nearest, and attention reads it back exactly as f32.

use ferry_kv_wire::shm::PoolMemory;

use super::attention::{Elem, KvRun};
use super::llama::LlamaShape;

/// The element type of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvDtype {
    /// IEEE half precision.
    #[default]
    F16,
    /// 32-bit float.
    F32,
}

impl KvDtype {
    /// Bytes per value.
    pub const fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }

    /// Its name on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        }
    }

    /// As the transfer layout states it.
    pub fn proto(self) -> ferry_proto::v1::KvDtype {
        match self {
            KvDtype::F16 => ferry_proto::v1::KvDtype::F16,
            KvDtype::F32 => ferry_proto::v1::KvDtype::F32,
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f16" | "float16" | "half" => Ok(KvDtype::F16),
            "f32" | "float32" | "float" => Ok(KvDtype::F32),
            other => Err(format!("KV cache dtype {other:?} is not f16 or f32")),
        }
    }
}

/// Where the blocks live: memory of the process's own, or a pool in the region it shares with
/// its node's KV agent, which then sends exported blocks straight from it.
#[derive(Debug)]
enum Memory {
    F32(Vec<f32>),
    F16(Vec<u16>),
    Shared(PoolMemory),
}

/// KV memory for `num_blocks` blocks of `block_size` tokens.
#[derive(Debug)]
pub struct PagedKvCache {
    data: Memory,
    /// Element type.
    pub dtype: KvDtype,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    num_layers: usize,
    kv_dim: usize,
}

/// An element type the cache stores: f32, or f16 bits.
pub trait Stored: Elem {
    /// The cache type that holds it.
    const DTYPE: KvDtype;
}

impl Stored for f32 {
    const DTYPE: KvDtype = KvDtype::F32;
}

impl Stored for u16 {
    const DTYPE: KvDtype = KvDtype::F16;
}

impl PagedKvCache {
    /// Bytes one cached token takes (all layers, K and V).
    pub fn bytes_per_token(shape: &LlamaShape, dtype: KvDtype) -> usize {
        shape.num_layers * 2 * shape.kv_dim() * dtype.bytes()
    }

    /// As many blocks as fit in `budget_bytes`.
    pub fn blocks_for_budget(
        shape: &LlamaShape,
        dtype: KvDtype,
        block_size: usize,
        budget_bytes: u64,
    ) -> usize {
        let per_block = (Self::bytes_per_token(shape, dtype) * block_size) as u64;
        (budget_bytes / per_block.max(1)) as usize
    }

    /// A zeroed f32 cache (the reference forward's precision).
    pub fn new(shape: &LlamaShape, block_size: usize, num_blocks: usize) -> Self {
        Self::with_dtype(shape, KvDtype::F32, block_size, num_blocks)
    }

    /// A zeroed cache of `dtype`.
    pub fn with_dtype(
        shape: &LlamaShape,
        dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
    ) -> Self {
        let values = num_blocks * block_size * shape.num_layers * 2 * shape.kv_dim();
        Self {
            data: match dtype {
                KvDtype::F32 => Memory::F32(vec![0.0; values]),
                KvDtype::F16 => Memory::F16(vec![0; values]),
            },
            dtype,
            block_size,
            num_blocks,
            num_layers: shape.num_layers,
            kv_dim: shape.kv_dim(),
        }
    }

    /// A cache of `dtype` in `pool` (a shared region's KV pool, zeroed as a new file is), if
    /// it is exactly `num_blocks` blocks long; else the pool comes back.
    pub fn in_pool(
        shape: &LlamaShape,
        dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
        pool: PoolMemory,
    ) -> Result<Self, PoolMemory> {
        let values = num_blocks * block_size * shape.num_layers * 2 * shape.kv_dim();
        if pool.bytes().len() != values * dtype.bytes() {
            return Err(pool);
        }
        Ok(Self {
            data: Memory::Shared(pool),
            dtype,
            block_size,
            num_blocks,
            num_layers: shape.num_layers,
            kv_dim: shape.kv_dim(),
        })
    }

    /// Whether the blocks live in a region shared with the KV agent.
    pub fn is_shared(&self) -> bool {
        matches!(self.data, Memory::Shared(_))
    }

    fn bytes(&self) -> &[u8] {
        match &self.data {
            Memory::F32(v) => as_bytes(v),
            Memory::F16(v) => as_bytes(v),
            Memory::Shared(pool) => pool.bytes(),
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.data {
            Memory::F32(v) => as_bytes_mut(v),
            Memory::F16(v) => as_bytes_mut(v),
            Memory::Shared(pool) => pool.bytes_mut(),
        }
    }

    /// The cache for one forward: a view through which the forward's parts, running at once
    /// on disjoint sequences, write their tokens' keys and values and read their sequences'
    /// runs. It holds the only borrow of the cache while it lives.
    pub fn shared(&mut self) -> SharedKv<'_> {
        let (dtype, block_size, num_layers, kv_dim) =
            (self.dtype, self.block_size, self.num_layers, self.kv_dim);
        let bytes = self.bytes_mut();
        SharedKv {
            base: bytes.as_mut_ptr(),
            len: bytes.len(),
            dtype,
            block_size,
            num_layers,
            kv_dim,
            _cache: std::marker::PhantomData,
        }
    }

    fn block_bytes(&self) -> usize {
        self.num_layers * 2 * self.block_size * self.kv_dim * self.dtype.bytes()
    }

    /// The raw contents of one block, in the transfer layout (little-endian values).
    pub fn block(&self, block: usize) -> &[u8] {
        let len = self.block_bytes();
        &self.bytes()[block * len..(block + 1) * len]
    }

    /// Copies block `src`'s contents (every layer, keys and values) into block `dst`.
    pub fn copy_block(&mut self, src: usize, dst: usize) {
        let len = self.block_bytes();
        self.bytes_mut().copy_within(src * len..(src + 1) * len, dst * len);
    }

    /// Copies the keys and values of `layers` at position `src` (block, slot) to `dst`.
    pub fn copy_position(
        &mut self,
        layers: std::ops::Range<usize>,
        src: (usize, usize),
        dst: (usize, usize),
    ) {
        let kv = self.shared();
        // SAFETY: `&mut self`: no other user of the cache meanwhile.
        unsafe { kv.copy_position(layers, src, dst) };
    }

    /// Mutable raw contents of one block (for KV transfer).
    pub fn block_mut(&mut self, block: usize) -> &mut [u8] {
        let len = self.block_bytes();
        &mut self.bytes_mut()[block * len..(block + 1) * len]
    }
}

/// The f16 values (bits) nearest to `src`, rounding to nearest even.
pub fn to_f16(src: &[f32], dst: &mut [u16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_f32(s).to_bits();
    }
}

fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: f32 and u16 have no padding and any byte pattern read back is valid for them.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn as_bytes_mut<T: Copy>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as for `as_bytes`; the bytes are written back as f32 or u16 values, any pattern
    // of which is valid.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

/// A [`PagedKvCache`] as one forward uses it (see [`PagedKvCache::shared`]): its storage as a
/// raw pointer taken from the cache's only mutable borrow, so that parts of the forward on
/// other threads can write and read it at once — each on its own sequences' blocks, which the
/// batch's validation guarantees no other sequence writes (a block written this step belongs
/// to one sequence alone; blocks several hold, a shared prefix, are only read).
pub struct SharedKv<'a> {
    base: *mut u8,
    len: usize,
    /// Element type.
    pub dtype: KvDtype,
    /// Positions per block.
    pub block_size: usize,
    num_layers: usize,
    kv_dim: usize,
    _cache: std::marker::PhantomData<&'a mut PagedKvCache>,
}

// SAFETY: the view is a pointer into storage it borrows mutably; the threads that share it
// follow `write`'s and `run`'s contracts (no element written while another thread uses it).
unsafe impl Send for SharedKv<'_> {}
unsafe impl Sync for SharedKv<'_> {}

impl SharedKv<'_> {
    /// Position `pos` of a sequence with `table`: (block, slot). The caller has checked that
    /// the table covers `pos`.
    #[inline]
    pub fn locate(&self, table: &[u32], pos: usize) -> (usize, usize) {
        (table[pos / self.block_size] as usize, pos % self.block_size)
    }

    fn offset(&self, block: usize, layer: usize, kv: usize, slot: usize) -> usize {
        (((block * self.num_layers + layer) * 2 + kv) * self.block_size + slot) * self.kv_dim
    }

    /// `n` elements of type `T` from element `at`, checked against the storage.
    fn span<T>(&self, at: usize, n: usize) -> *mut T {
        let size = std::mem::size_of::<T>();
        assert!((at + n) * size <= self.len, "KV cache access past its end");
        // SAFETY: in bounds (just checked); the storage is aligned for its element type, the
        // only one read or written (`run` checks, `write` follows `dtype`).
        unsafe { self.base.add(at * size).cast() }
    }

    /// Stores one token's keys and values for `layer` (rounded to f16 in an f16 cache).
    ///
    /// # Safety
    /// No other thread reads or writes this position of `block` meanwhile (its sequence is
    /// this thread's, and no other sequence holds a block written this step).
    pub unsafe fn write(&self, layer: usize, (block, slot): (usize, usize), k: &[f32], v: &[f32]) {
        let n = self.kv_dim;
        for (kv, src) in [(0, k), (1, v)] {
            let at = self.offset(block, layer, kv, slot);
            // SAFETY: in bounds (`span` checks); no other thread uses these elements (the
            // caller's contract), and no reference to them is live in this one.
            unsafe {
                match self.dtype {
                    KvDtype::F32 => std::slice::from_raw_parts_mut(self.span::<f32>(at, n), n)
                        .copy_from_slice(&src[..n]),
                    KvDtype::F16 => to_f16(
                        &src[..n],
                        std::slice::from_raw_parts_mut(self.span::<u16>(at, n), n),
                    ),
                }
            }
        }
    }

    /// Copies the keys and values of `layers` at `src` (block, slot) to `dst`.
    ///
    /// # Safety
    /// No other thread uses either position meanwhile.
    pub unsafe fn copy_position(
        &self,
        layers: std::ops::Range<usize>,
        (sb, ss): (usize, usize),
        (db, ds): (usize, usize),
    ) {
        let size = self.dtype.bytes();
        let n = self.kv_dim * size;
        for layer in layers {
            for kv in 0..2 {
                let (from, to) = (self.offset(sb, layer, kv, ss), self.offset(db, layer, kv, ds));
                // SAFETY: both in bounds (`span` checks); distinct positions, so the runs do
                // not overlap unless equal; nothing else uses them (the caller's contract).
                unsafe {
                    std::ptr::copy(
                        self.span::<u8>(from * size, n),
                        self.span::<u8>(to * size, n),
                        n,
                    );
                }
            }
        }
    }

    /// Positions `pos ..` to the end of `pos`'s block, for `layer`: keys and values, all KV
    /// heads, one position every `kv_dim` values, as `T` (the cache's element type).
    ///
    /// # Safety
    /// No thread writes these positions while the run is in use.
    #[inline]
    pub unsafe fn run<T: Stored>(&self, layer: usize, table: &[u32], pos: usize) -> KvRun<'_, T> {
        assert_eq!(T::DTYPE, self.dtype, "KV cache read as the wrong type");
        let (block, slot) = self.locate(table, pos);
        let len = self.block_size - slot;
        let n = len * self.kv_dim;
        let (ko, vo) = (self.offset(block, layer, 0, slot), self.offset(block, layer, 1, slot));
        // SAFETY: in bounds (`span` checks); nothing writes them meanwhile (the contract).
        let (keys, values) = unsafe {
            (
                std::slice::from_raw_parts(self.span::<T>(ko, n).cast_const(), n),
                std::slice::from_raw_parts(self.span::<T>(vo, n).cast_const(), n),
            )
        };
        KvRun { keys, values, stride: self.kv_dim, len }
    }
}
