//! The paged KV cache in device memory: the CPU cache's layout (`forward::kv_cache`), one block
//! after another, each `layers × {K, V} × block_size × kv_dim` values, f16 (the default, as on
//! the CPU) or f32, so the handshake's KV layout and a block's transfer bytes are the same
//! whichever backend holds the blocks. The scheduler owns allocation; this type only sizes and
//! holds the memory.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::CudaError;
use crate::forward::{KvDtype, LlamaShape};

/// The cache's values: f32, or f16 as its bits.
#[derive(Debug)]
pub enum KvData {
    /// 32-bit floats.
    F32(CudaSlice<f32>),
    /// IEEE half precision, as `u16` bits.
    F16(CudaSlice<u16>),
}

impl KvData {
    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(d) => d.len(),
            Self::F16(d) => d.len(),
        }
    }

    /// Whether it holds nothing (never, once allocated).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn num_bytes(&self) -> usize {
        match self {
            Self::F32(d) => d.num_bytes(),
            Self::F16(d) => d.num_bytes(),
        }
    }

    /// Which of a kernel pair (`_f32`, `_f16`) takes this cache: 0 or 1.
    pub fn kind(&self) -> usize {
        match self {
            Self::F32(_) => 0,
            Self::F16(_) => 1,
        }
    }

    /// The element type.
    pub fn dtype(&self) -> KvDtype {
        match self {
            Self::F32(_) => KvDtype::F32,
            Self::F16(_) => KvDtype::F16,
        }
    }
}

/// KV memory for `num_blocks` blocks of `block_size` tokens, on the device.
#[derive(Debug)]
pub struct DeviceKvCache {
    /// The values, zeroed at allocation.
    pub data: KvData,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Layers per block.
    pub num_layers: usize,
}

impl DeviceKvCache {
    /// Allocates a zeroed cache of `dtype` values sized as the CPU backend's would be.
    pub fn new(
        stream: &Arc<CudaStream>,
        shape: &LlamaShape,
        dtype: KvDtype,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, CudaError> {
        let values = [block_size, shape.num_layers, 2, shape.kv_dim()]
            .iter()
            .try_fold(num_blocks, |acc, d| acc.checked_mul(*d))
            .ok_or_else(|| {
                CudaError::Unsupported(format!(
                    "a KV cache of {num_blocks} blocks of {block_size} tokens overflows usize"
                ))
            })?;
        let during = CudaError::driver("allocating the KV cache");
        let data = match dtype {
            KvDtype::F32 => KvData::F32(stream.alloc_zeros::<f32>(values).map_err(during)?),
            KvDtype::F16 => KvData::F16(stream.alloc_zeros::<u16>(values).map_err(during)?),
        };
        Ok(Self { data, block_size, num_blocks, num_layers: shape.num_layers })
    }
}
