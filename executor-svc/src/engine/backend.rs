//! The model backends behind one trait: `cpu` (the real model through the paged forward) and
//! `sim` (the roofline timing model with deterministic tokens). The `cuda` backend, the real
//! model on a GPU, implements the same trait in `engine::cuda` (feature `cuda`).

use ferry_kv_wire::shm::PoolMemory;
use std::ops::Range;
use std::time::Duration;

use super::simulated_gpu::{SimBatchItem, SimClock, SimHardware, SimModel};
use crate::forward::paged::{self, BatchError, ForwardScratch, SeqSlice};
use crate::forward::stages::{self, StageOutput, StageRun};
use crate::forward::{KvDtype, LlamaShape, LlamaWeights, PagedKvCache};
use ferry_roofline::{stage_cost, StageSpan};

/// What a backend returns for a batch.
#[derive(Debug)]
pub enum BatchOutput {
    /// Logits (`vocab` each) of the sequences that asked for them, in batch order.
    Logits(Vec<Vec<f32>>),
    /// No model ran: the engine picks deterministic tokens (the `sim` backend).
    Synthetic {
        /// How long the simulated step took (already slept in real-time mode).
        duration: Duration,
    },
}

/// The static facts a backend states in the handshake.
#[derive(Clone, Copy, Debug)]
pub struct BackendFacts {
    /// Model shape.
    pub shape: LlamaShape,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the KV pool.
    pub num_blocks: usize,
}

/// Runs batches of sequences through a model with a paged KV cache.
pub trait ModelBackend: Send {
    /// Shape, block size and pool size.
    fn facts(&self) -> BackendFacts;
    /// Checks a batch without touching memory.
    fn check(&self, batch: &[SeqSlice]) -> Result<(), BatchError>;
    /// Runs a batch (the caller has checked it). [`BatchError`] describes only bad batches: a
    /// backend whose device fails mid-batch (the CUDA backend) panics, which ends the engine
    /// thread and turns the executor's RPCs UNAVAILABLE.
    fn run(&mut self, batch: &[SeqSlice]) -> Result<BatchOutput, BatchError>;
    /// Copies KV block `block` (checked in range) into `out`, in the transfer layout (the
    /// cache's element type, little-endian, `layers × {K,V} × block_size × kv_dim`).
    fn read_block(&mut self, block: usize, out: &mut [u8]) -> Result<(), String>;
    /// Writes `data` (the transfer layout) into KV block `block`.
    fn write_block(&mut self, block: usize, data: &[u8]) -> Result<(), String>;
    /// Copies KV block `src` into block `dst`, every layer, keys and values (both checked in
    /// range and distinct): a sample of several starting its own copy of the partial block
    /// its shared prompt ends in. A device failure panics, as in [`ModelBackend::run`].
    fn copy_block(&mut self, src: usize, dst: usize);
    /// Whether the KV pool lives in the region shared with the KV agent (see
    /// [`crate::engine::kv::KvOps`]): an export then names its blocks where they are.
    fn kv_in_shared_pool(&self) -> bool {
        false
    }
    /// The end-of-sequence token a simulating backend serves now, if its handshake set one
    /// (see [`super::simulated_gpu::SimIdentity`]); `None`: the engine's.
    fn sim_eos(&self) -> Option<u32> {
        None
    }
    /// Whether it computes logits (a simulating backend does not: it returns
    /// [`BatchOutput::Synthetic`]).
    fn computes_logits(&self) -> bool {
        true
    }
    /// Runs one stage of a looped model over `batch` (its block tables those of the stage's
    /// KV plane; see [`super::looped`]).
    fn run_stage(
        &mut self,
        _batch: &[SeqSlice],
        _run: &StageRun,
    ) -> Result<StageResult, BatchError> {
        Err(BatchError::Unsupported("this backend does not run looped models' stages"))
    }
    /// Copies one position's keys and values in `layers` from `src` to `dst` (block, slot),
    /// both checked in range: a looped chain's token that left the loop.
    fn copy_kv_position(
        &mut self,
        _layers: Range<usize>,
        _src: (usize, usize),
        _dst: (usize, usize),
    ) {
    }
}

/// What a looped model's stage produced.
#[derive(Debug)]
pub enum StageResult {
    /// The model ran: hidden states or logits.
    Computed(StageOutput),
    /// No model ran (the `sim` backend): how long the simulated stage took.
    Synthetic {
        /// Its simulated time (already slept in real-time mode).
        duration: Duration,
    },
}

/// `values` as little-endian bytes into `out` (the transfer layout; lengths checked), each by
/// `bytes` (`f32::to_le_bytes`, `u16::to_le_bytes`).
pub fn to_le_bytes<T: Copy, const N: usize>(
    values: &[T],
    out: &mut [u8],
    bytes: impl Fn(T) -> [u8; N],
) -> Result<(), String> {
    if out.len() != values.len() * N {
        return Err(format!("a block is {} bytes, not {}", values.len() * N, out.len()));
    }
    for (v, b) in values.iter().zip(out.chunks_exact_mut(N)) {
        b.copy_from_slice(&bytes(*v));
    }
    Ok(())
}

/// Little-endian `data` into `values` (lengths checked), each by `value` (`f32::from_le_bytes`,
/// `u16::from_le_bytes`).
pub fn from_le_bytes<T, const N: usize>(
    data: &[u8],
    values: &mut [T],
    value: impl Fn([u8; N]) -> T,
) -> Result<(), String> {
    if data.len() != values.len() * N {
        return Err(format!("a block is {} bytes, not {}", values.len() * N, data.len()));
    }
    for (v, b) in values.iter_mut().zip(data.chunks_exact(N)) {
        *v = value(b.try_into().expect("chunks of N"));
    }
    Ok(())
}

/// The real model on the CPU.
pub struct CpuBackend {
    weights: LlamaWeights,
    cache: PagedKvCache,
    scratch: ForwardScratch,
}

impl CpuBackend {
    /// A backend with an f32 KV pool of `num_blocks` blocks of `block_size` tokens (the
    /// reference forward's precision, which the tests compare with).
    pub fn new(weights: LlamaWeights, block_size: usize, num_blocks: usize) -> Self {
        Self::with_dtype(weights, KvDtype::F32, block_size, num_blocks)
    }

    /// A backend whose KV pool holds `dtype` values.
    pub fn with_dtype(
        weights: LlamaWeights,
        dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
    ) -> Self {
        let cache = PagedKvCache::with_dtype(&weights.shape, dtype, block_size, num_blocks);
        Self { weights, cache, scratch: ForwardScratch::default() }
    }

    /// The same with the pool in `pool` (a region shared with the KV agent) when it fits
    /// exactly; else in memory of its own.
    pub fn in_pool(
        weights: LlamaWeights,
        dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
        pool: PoolMemory,
    ) -> Self {
        if let Ok(cache) =
            PagedKvCache::in_pool(&weights.shape, dtype, block_size, num_blocks, pool)
        {
            return Self { weights, cache, scratch: ForwardScratch::default() };
        }
        tracing::warn!("the shared KV pool does not fit the cache: using private memory");
        Self::with_dtype(weights, dtype, block_size, num_blocks)
    }
}

/// Swaps a block's values between this machine's byte order and the transfer layout's
/// (little-endian): nothing to do on a little-endian machine.
fn swap_to_little_endian(bytes: &mut [u8], width: usize) {
    if cfg!(target_endian = "big") {
        for v in bytes.chunks_exact_mut(width) {
            v.reverse();
        }
    }
}

impl ModelBackend for CpuBackend {
    fn facts(&self) -> BackendFacts {
        BackendFacts {
            shape: self.weights.shape,
            block_size: self.cache.block_size,
            num_blocks: self.cache.num_blocks,
        }
    }

    fn check(&self, batch: &[SeqSlice]) -> Result<(), BatchError> {
        paged::validate(&self.weights, &self.cache, batch)
    }

    fn run(&mut self, batch: &[SeqSlice]) -> Result<BatchOutput, BatchError> {
        paged::forward(&self.weights, &mut self.cache, batch, &mut self.scratch)
            .map(BatchOutput::Logits)
    }

    fn read_block(&mut self, block: usize, out: &mut [u8]) -> Result<(), String> {
        if block >= self.cache.num_blocks {
            return Err(format!("block {block} is out of range"));
        }
        let src = self.cache.block(block);
        if out.len() != src.len() {
            return Err(format!("a block is {} bytes, not {}", src.len(), out.len()));
        }
        out.copy_from_slice(src);
        swap_to_little_endian(out, self.cache.dtype.bytes());
        Ok(())
    }

    fn write_block(&mut self, block: usize, data: &[u8]) -> Result<(), String> {
        if block >= self.cache.num_blocks {
            return Err(format!("block {block} is out of range"));
        }
        let width = self.cache.dtype.bytes();
        let dst = self.cache.block_mut(block);
        if data.len() != dst.len() {
            return Err(format!("a block is {} bytes, not {}", dst.len(), data.len()));
        }
        dst.copy_from_slice(data);
        swap_to_little_endian(dst, width);
        Ok(())
    }

    fn copy_block(&mut self, src: usize, dst: usize) {
        self.cache.copy_block(src, dst);
    }

    fn run_stage(&mut self, batch: &[SeqSlice], run: &StageRun) -> Result<StageResult, BatchError> {
        stages::forward_stage(&self.weights, &mut self.cache, batch, &mut self.scratch, run)
            .map(StageResult::Computed)
    }

    fn copy_kv_position(&mut self, layers: Range<usize>, src: (usize, usize), dst: (usize, usize)) {
        self.cache.copy_position(layers, src, dst);
    }

    fn kv_in_shared_pool(&self) -> bool {
        // The pool's bytes are the transfer layout's only on a little-endian machine.
        cfg!(target_endian = "little") && self.cache.is_shared()
    }
}

/// A simulated GPU: checks batches like the real one, takes the roofline time, no model.
pub struct SimBackend {
    shape: LlamaShape,
    block_size: usize,
    num_blocks: usize,
    hardware: SimHardware,
    model: SimModel,
    /// Real or virtual time.
    pub clock: SimClock,
    /// Wall-clock seconds per simulated second, in real time.
    time_scale: f64,
    /// The model served, when it is the scheduler's (a simulated model profile).
    identity: Option<std::sync::Arc<super::simulated_gpu::SimIdentity>>,
}

impl SimBackend {
    /// A simulator of `hardware` running a model of `shape` with `model`'s byte counts.
    pub fn new(
        shape: LlamaShape,
        model: SimModel,
        hardware: SimHardware,
        block_size: usize,
        num_blocks: usize,
        clock: SimClock,
    ) -> Self {
        Self {
            shape,
            block_size,
            num_blocks,
            hardware,
            model,
            clock,
            time_scale: 1.0,
            identity: None,
        }
    }

    /// The same, sleeping `scale` wall-clock seconds per simulated second in real time.
    #[must_use]
    pub fn with_time_scale(self, scale: f64) -> Self {
        Self { time_scale: scale, ..self }
    }

    /// The same, serving the vocabulary and end token `identity` holds (each handshake sets
    /// them) instead of `shape`'s.
    #[must_use]
    pub fn with_identity(
        self,
        identity: std::sync::Arc<super::simulated_gpu::SimIdentity>,
    ) -> Self {
        Self { identity: Some(identity), ..self }
    }
}

impl SimBackend {
    /// How long `span` of the model takes over `batch` by the roofline (every layer and the
    /// head: a plain step's `step_duration`), slept in real-time mode.
    fn simulate(&mut self, batch: &[SeqSlice], span: StageSpan) -> Duration {
        let items: Vec<SimBatchItem> = batch
            .iter()
            .map(|s| SimBatchItem {
                new_tokens: s.tokens.len() as u32,
                context_len: s.start as u32,
            })
            .collect();
        let duration = stage_cost(&self.hardware, &self.model, &items, span).total();
        let sleep = self.clock.advance(duration).mul_f64(self.time_scale);
        if !sleep.is_zero() {
            std::thread::sleep(sleep);
        }
        duration
    }
}

impl ModelBackend for SimBackend {
    fn facts(&self) -> BackendFacts {
        let mut shape = self.shape;
        if let Some(id) = &self.identity {
            shape.vocab_size = id.vocab_size() as usize;
        }
        BackendFacts { shape, block_size: self.block_size, num_blocks: self.num_blocks }
    }

    fn check(&self, batch: &[SeqSlice]) -> Result<(), BatchError> {
        let vocab = self.facts().shape.vocab_size;
        paged::check_geometry(vocab, self.block_size, self.num_blocks, batch)
    }

    fn sim_eos(&self) -> Option<u32> {
        self.identity.as_ref().and_then(|id| id.eos())
    }

    fn computes_logits(&self) -> bool {
        false
    }

    fn run(&mut self, batch: &[SeqSlice]) -> Result<BatchOutput, BatchError> {
        self.check(batch)?;
        let whole = StageSpan { layers: self.model.num_layers, head: true };
        Ok(BatchOutput::Synthetic { duration: self.simulate(batch, whole) })
    }

    /// A stage's time: the roofline's for the stage's layers, and the output head only in the
    /// coda.
    fn run_stage(&mut self, batch: &[SeqSlice], run: &StageRun) -> Result<StageResult, BatchError> {
        if !run.layers.is_empty() {
            self.check(batch)?;
        }
        let span = StageSpan { layers: run.layers.len() as u32, head: run.logits };
        Ok(StageResult::Synthetic { duration: self.simulate(batch, span) })
    }

    /// The simulator holds no KV: a block reads as zeros (of the real size, so transfers move
    /// the real number of bytes).
    fn read_block(&mut self, block: usize, out: &mut [u8]) -> Result<(), String> {
        if block >= self.num_blocks {
            return Err(format!("block {block} is out of range"));
        }
        out.fill(0);
        Ok(())
    }

    /// The simulator holds no KV: nothing to copy.
    fn copy_block(&mut self, _src: usize, _dst: usize) {}

    /// The simulator holds no KV: an imported block is dropped.
    fn write_block(&mut self, block: usize, _data: &[u8]) -> Result<(), String> {
        if block >= self.num_blocks {
            return Err(format!("block {block} is out of range"));
        }
        Ok(())
    }
}
