//! The paged KV cache in device memory: the CPU cache's layout (`forward::kv_cache`), one block
//! after another, each `layers × {K, V} × block_size × kv_dim` f32 values, so the handshake's
//! KV layout (and a future block transfer) is the same whichever backend holds the blocks.
//! The scheduler owns allocation; this type only sizes and holds the memory.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::CudaError;
use crate::forward::LlamaShape;

/// KV memory for `num_blocks` blocks of `block_size` tokens, on the device.
#[derive(Debug)]
pub struct DeviceKvCache {
    /// The values, zeroed at allocation.
    pub data: CudaSlice<f32>,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Layers per block.
    pub num_layers: usize,
}

impl DeviceKvCache {
    /// Allocates a zeroed cache sized as the CPU backend's would be.
    pub fn new(
        stream: &Arc<CudaStream>,
        shape: &LlamaShape,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, CudaError> {
        let floats = [block_size, shape.num_layers, 2, shape.kv_dim()]
            .iter()
            .try_fold(num_blocks, |acc, d| acc.checked_mul(*d))
            .ok_or_else(|| {
                CudaError::Unsupported(format!(
                    "a KV cache of {num_blocks} blocks of {block_size} tokens overflows usize"
                ))
            })?;
        let data = stream
            .alloc_zeros::<f32>(floats)
            .map_err(CudaError::driver("allocating the KV cache"))?;
        Ok(Self { data, block_size, num_blocks, num_layers: shape.num_layers })
    }
}
