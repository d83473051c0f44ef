//! A GPU executor's KV cache sized as a fraction of the device's memory (vLLM's
//! `--gpu-memory-utilization`): the executor may use that fraction of the GPU's total memory
//! for everything it holds; what is left of it once the weights are uploaded, less room for a
//! step's activations, becomes KV blocks.
//!
//! The memory in use is read from the driver after the upload (`cuMemGetInfo`: total − free),
//! so it counts the weights, the context and kernels, and any other process on the same GPU, as
//! vLLM's profile does. Pure arithmetic here, so it is tested without a GPU; the CUDA backend
//! calls it with the driver's figures.

use crate::executor_config::ConfigError;
use crate::forward::{KvDtype, LlamaShape, PagedKvCache};

/// Tokens of one step whose activations are kept free: four times the scheduler's default
/// `--max-num-batched-tokens` (2,048). A scheduler configured for larger steps on a GPU filled
/// to the fraction may run out of memory on its largest step; give `--kv-cache-mib` then.
pub const RESERVED_STEP_TOKENS: usize = 8192;
/// Rows of logits one step may sample, kept free as well (the scheduler's default
/// `--max-num-seqs` is 256; speculative verification samples several rows per request).
pub const RESERVED_LOGIT_ROWS: usize = 1024;

/// How many KV blocks a GPU backend allocates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvBlocks {
    /// This many (from `--kv-cache-mib`).
    Count(usize),
    /// As many as [`gpu_kv_blocks`] finds room for in this fraction of the device's memory.
    GpuFraction(f64),
}

impl From<usize> for KvBlocks {
    fn from(count: usize) -> Self {
        Self::Count(count)
    }
}

/// The device's memory as the driver reports it once the weights are on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuMemory {
    /// The device's memory, in bytes.
    pub total: u64,
    /// Free memory, in bytes.
    pub free: u64,
}

/// Bytes of the CUDA forward's f32 activations for a step of `rows` tokens of which
/// `logit_rows` sample: per token the residual, its norm and the attention output projection
/// (`hidden` each), the fused QKV, the attention, the fused gate-up and the FFN product; per
/// sampled row the last hidden state, its norm and the logits (`engine::cuda::forward::Scratch`
/// allocates exactly these).
pub fn activation_bytes(shape: &LlamaShape, rows: usize, logit_rows: usize) -> u64 {
    let s = shape;
    let per_row = 3 * s.hidden + (s.q_dim() + 2 * s.kv_dim()) + s.q_dim() + 3 * s.intermediate;
    let per_logit_row = 2 * s.hidden + s.vocab_size;
    ((rows * per_row + logit_rows * per_logit_row) * std::mem::size_of::<f32>()) as u64
}

/// How many KV blocks of `block_size` tokens fit in `utilization` of the device's memory, given
/// what is already in use and room for a step's activations; an error with the figures when
/// not even one does.
pub fn gpu_kv_blocks(
    shape: &LlamaShape,
    dtype: KvDtype,
    block_size: usize,
    utilization: f64,
    memory: GpuMemory,
) -> Result<usize, ConfigError> {
    let allowed = (memory.total as f64 * utilization) as u64;
    let used = memory.total.saturating_sub(memory.free);
    let activations = activation_bytes(shape, RESERVED_STEP_TOKENS, RESERVED_LOGIT_ROWS);
    // With a fraction of at most 1 this is never more than is free.
    let budget = allowed.saturating_sub(used + activations);
    match PagedKvCache::blocks_for_budget(shape, dtype, block_size, budget) {
        0 => Err(ConfigError::GpuMemory {
            utilization,
            total_mib: memory.total >> 20,
            used_mib: used >> 20,
            activations_mib: activations.div_ceil(1 << 20),
        }),
        blocks => Ok(blocks),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// Llama 3.1 8B's shape.
    fn llama_8b() -> LlamaShape {
        LlamaShape {
            family: ferry_model::Family::LLAMA,
            num_layers: 32,
            hidden: 4096,
            intermediate: 14336,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            vocab_size: 128_256,
            rope_theta: 500_000.0,
            rope_scale: 1.0,
            rope_dims: 128,
            rope_mscale: 1.0,
            rope_long: false,
            rms_eps: 1e-5,
            max_model_len: 131_072,
            sliding_window: None,
            query_scale: 1.0 / 128f32.sqrt(),
            attn_softcap: None,
            final_softcap: None,
        }
    }

    /// An 80 GiB GPU with an 8B model's f32 weights (~30 GiB) uploaded: 0.9 of it leaves about
    /// 38 GiB of KV, at 4 MiB per 16-token f32 block... exactly as the arithmetic says; a
    /// fraction that what is in use already exceeds is refused with the figures.
    #[test]
    fn the_fraction_left_after_the_weights_and_activations_becomes_blocks() {
        let s = llama_8b();
        let total = 80 * GIB;
        let memory = GpuMemory { total, free: total - 31 * GIB };
        let blocks = gpu_kv_blocks(&s, KvDtype::F32, 16, 0.9, memory).unwrap();
        let per_block = PagedKvCache::bytes_per_token(&s, KvDtype::F32) as u64 * 16;
        assert_eq!(per_block, 4 << 20, "32 layers × 2 × 1024 × 4 bytes × 16 tokens");
        let activations = activation_bytes(&s, RESERVED_STEP_TOKENS, RESERVED_LOGIT_ROWS);
        let want = ((total as f64 * 0.9) as u64 - 31 * GIB - activations) / per_block;
        assert_eq!(blocks as u64, want);
        assert!(blocks * 16 > 150_000, "{blocks} blocks hold over 150k tokens");
        // A second executor on the same GPU: what another process holds counts as used.
        let shared = GpuMemory { total, free: total - 70 * GIB };
        let err = gpu_kv_blocks(&s, KvDtype::F32, 16, 0.9, shared).unwrap_err().to_string();
        assert!(err.contains("--gpu-memory-utilization 0.9"), "{err}");
        assert!(err.contains("71680 MiB are in use"), "{err}");
    }

    #[test]
    fn activations_grow_with_the_step_and_the_sampled_rows() {
        let s = llama_8b();
        let one = activation_bytes(&s, 1, 0);
        assert_eq!(one, ((3 * 4096 + 6144 + 4096 + 3 * 14336) * 4) as u64);
        assert_eq!(activation_bytes(&s, 2, 0), 2 * one);
        assert_eq!(activation_bytes(&s, 1, 1) - one, ((2 * 4096 + 128_256) * 4) as u64);
    }
}
