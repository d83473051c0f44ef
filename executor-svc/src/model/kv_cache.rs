//! The paged KV cache: a pool of fixed-size blocks in host memory. The scheduler owns the
//! allocation (block tables arrive with each step); this type only stores and addresses.
//!
//! Layout, one block after another, as DESIGN.md §6 fixes it for transfers: a block is
//! `layers × {K, V} × block_size × kv_heads × head_dim` f32 values, contiguous, so a block moves
//! between nodes as one slice.

use ferry_kv_transfer_svc::shm::PoolMemory;

use super::llama::LlamaShape;
use super::ops::KvRun;

/// Where the blocks live: memory of the process's own, or a pool in the region it shares with
/// its node's KV agent, which then sends exported blocks straight from it.
#[derive(Debug)]
enum Memory {
    Own(Vec<f32>),
    Shared(PoolMemory),
}

impl std::ops::Deref for Memory {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            Self::Own(v) => v,
            Self::Shared(pool) => pool.floats(),
        }
    }
}

impl std::ops::DerefMut for Memory {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            Self::Own(v) => v,
            Self::Shared(pool) => pool.floats_mut(),
        }
    }
}

/// KV memory for `num_blocks` blocks of `block_size` tokens.
#[derive(Debug)]
pub struct PagedKvCache {
    data: Memory,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    num_layers: usize,
    kv_dim: usize,
}

impl PagedKvCache {
    /// Bytes one cached token takes (all layers, K and V).
    pub fn bytes_per_token(shape: &LlamaShape) -> usize {
        shape.num_layers * 2 * shape.kv_dim() * std::mem::size_of::<f32>()
    }

    /// As many blocks as fit in `budget_bytes`.
    pub fn blocks_for_budget(shape: &LlamaShape, block_size: usize, budget_bytes: u64) -> usize {
        let per_block = (Self::bytes_per_token(shape) * block_size) as u64;
        (budget_bytes / per_block.max(1)) as usize
    }

    /// A zeroed cache.
    pub fn new(shape: &LlamaShape, block_size: usize, num_blocks: usize) -> Self {
        let floats = num_blocks * block_size * shape.num_layers * 2 * shape.kv_dim();
        Self {
            data: Memory::Own(vec![0.0; floats]),
            block_size,
            num_blocks,
            num_layers: shape.num_layers,
            kv_dim: shape.kv_dim(),
        }
    }

    /// A cache in `pool` (a shared region's KV pool, zeroed as a new file is), if it is
    /// exactly `num_blocks` blocks long; else the pool comes back.
    pub fn in_pool(
        shape: &LlamaShape,
        block_size: usize,
        num_blocks: usize,
        pool: PoolMemory,
    ) -> Result<Self, PoolMemory> {
        let floats = num_blocks * block_size * shape.num_layers * 2 * shape.kv_dim();
        if pool.floats().len() != floats {
            return Err(pool);
        }
        Ok(Self {
            data: Memory::Shared(pool),
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

    fn offset(&self, block: usize, layer: usize, kv: usize, slot: usize) -> usize {
        (((block * self.num_layers + layer) * 2 + kv) * self.block_size + slot) * self.kv_dim
    }

    /// Position `pos` of a sequence with `table`: (block, slot). The caller has checked that
    /// the table covers `pos`.
    #[inline]
    pub fn locate(&self, table: &[u32], pos: usize) -> (usize, usize) {
        (table[pos / self.block_size] as usize, pos % self.block_size)
    }

    /// Stores one token's keys and values for `layer`.
    pub fn write(&mut self, layer: usize, (block, slot): (usize, usize), k: &[f32], v: &[f32]) {
        let ko = self.offset(block, layer, 0, slot);
        self.data[ko..ko + self.kv_dim].copy_from_slice(k);
        let vo = self.offset(block, layer, 1, slot);
        self.data[vo..vo + self.kv_dim].copy_from_slice(v);
    }

    /// One token's keys (`kv = 0`) or values (`kv = 1`) for `layer`, all KV heads.
    #[inline]
    pub fn read(&self, layer: usize, kv: usize, (block, slot): (usize, usize)) -> &[f32] {
        let o = self.offset(block, layer, kv, slot);
        &self.data[o..o + self.kv_dim]
    }

    /// Positions `pos ..` to the end of `pos`'s block, for `layer`: keys and values, all KV
    /// heads, one position every `kv_dim` floats.
    #[inline]
    pub fn run(&self, layer: usize, table: &[u32], pos: usize) -> KvRun<'_> {
        let (block, slot) = self.locate(table, pos);
        let len = self.block_size - slot;
        let ko = self.offset(block, layer, 0, slot);
        let vo = self.offset(block, layer, 1, slot);
        KvRun {
            keys: &self.data[ko..ko + len * self.kv_dim],
            values: &self.data[vo..vo + len * self.kv_dim],
            stride: self.kv_dim,
            len,
        }
    }

    /// The raw contents of one block (for KV transfer).
    pub fn block(&self, block: usize) -> &[f32] {
        let len = self.num_layers * 2 * self.block_size * self.kv_dim;
        &self.data[block * len..(block + 1) * len]
    }

    /// Copies block `src`'s contents (every layer, keys and values) into block `dst`.
    pub fn copy_block(&mut self, src: usize, dst: usize) {
        let len = self.num_layers * 2 * self.block_size * self.kv_dim;
        self.data.copy_within(src * len..(src + 1) * len, dst * len);
    }

    /// Mutable raw contents of one block (for KV transfer).
    pub fn block_mut(&mut self, block: usize) -> &mut [f32] {
        let len = self.num_layers * 2 * self.block_size * self.kv_dim;
        &mut self.data[block * len..(block + 1) * len]
    }
}
