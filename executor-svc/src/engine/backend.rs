//! The model backends behind one trait: `cpu` (the real model through the paged forward) and
//! `sim` (the roofline timing model with deterministic tokens). The `cuda` backend, the real
//! model on a GPU, implements the same trait in `engine::cuda` (feature `cuda`).

use std::time::Duration;

use super::sim::{step_duration, SimBatchItem, SimClock, SimHardware, SimModel};
use crate::model::paged::{self, BatchError, ForwardScratch, SeqSlice};
use crate::model::{LlamaShape, LlamaWeights, PagedKvCache};

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
}

/// The real model on the CPU.
pub struct CpuBackend {
    weights: LlamaWeights,
    cache: PagedKvCache,
    scratch: ForwardScratch,
}

impl CpuBackend {
    /// A backend with a KV pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new(weights: LlamaWeights, block_size: usize, num_blocks: usize) -> Self {
        let cache = PagedKvCache::new(&weights.shape, block_size, num_blocks);
        Self { weights, cache, scratch: ForwardScratch::default() }
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
        Self { shape, block_size, num_blocks, hardware, model, clock }
    }
}

impl ModelBackend for SimBackend {
    fn facts(&self) -> BackendFacts {
        BackendFacts { shape: self.shape, block_size: self.block_size, num_blocks: self.num_blocks }
    }

    fn check(&self, batch: &[SeqSlice]) -> Result<(), BatchError> {
        paged::check_geometry(self.shape.vocab_size, self.block_size, self.num_blocks, batch)
    }

    fn run(&mut self, batch: &[SeqSlice]) -> Result<BatchOutput, BatchError> {
        self.check(batch)?;
        let items: Vec<SimBatchItem> = batch
            .iter()
            .map(|s| SimBatchItem {
                new_tokens: s.tokens.len() as u32,
                context_len: s.start as u32,
            })
            .collect();
        let duration = step_duration(&self.hardware, &self.model, &items);
        let sleep = self.clock.advance(duration);
        if !sleep.is_zero() {
            std::thread::sleep(sleep);
        }
        Ok(BatchOutput::Synthetic { duration })
    }
}
