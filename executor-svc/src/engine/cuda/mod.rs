//! The `cuda` backend: the real model on an NVIDIA GPU, through cudarc (driver API, cuBLAS,
//! NVRTC) loaded at run time, so the build needs no CUDA toolkit and a machine without a GPU
//! gets a clear error instead of a crash.
//!
//! It keeps the CPU backend's contract exactly: the same batch validation
//! (`paged::check_geometry`, before any device memory is touched), the same KV pool geometry
//! and block-major layout, the same forward semantics (variable-length batch mixing prefill
//! chunks and decodes, positions from each sequence's `start`, block tables, logits only for
//! sequences that sample, in batch order). Logits are close to the CPU's, not bit-identical:
//! both multiply f32 activations by the same dequantized weights, but the GPU sums in cuBLAS's
//! and its kernels' order, not the CPU's fixed FMA order (within a few parts in a million of
//! the largest logit under the emulation, `tests.rs`).
//!
//! [`super::cuda_emulation`] is test infrastructure, not part of the backend: a CPU emulation of
//! the CUDA libraries, under which CI runs this backend.
//!
//! Pieces: [`probe`] finds the libraries, [`device`] opens the GPU, [`kernels`] holds the CUDA C
//! and [`launch`] its typed launches, [`weights`] and [`cache`] own device memory, [`plan`]
//! flattens a batch, [`forward`] runs it, [`lora`] adds LoRA adapters' updates.

pub mod cache;
pub mod device;
pub mod forward;
pub mod kernels;
pub mod launch;
pub mod lora;
pub mod plan;
pub mod probe;
pub mod weights;

#[cfg(test)]
mod emulation_tests;
#[cfg(test)]
mod tests;

use cudarc::cublas::result::CublasError;
use cudarc::driver::DriverError;

use self::cache::{DeviceKvCache, KvData};
use self::device::{guarded, Gpu};
use self::forward::Scratch;
use self::kernels::MAX_HEAD_DIM;
use self::plan::BatchPlan;
use self::probe::CudaLibrary;
use self::weights::DeviceWeights;
pub use self::weights::Storage;
use super::backend::{from_le_bytes, to_le_bytes, BackendFacts, BatchOutput, ModelBackend};
use crate::forward::paged::{self, BatchError, SeqSlice};
use crate::forward::{KvDtype, LlamaShape, LlamaWeights};
use crate::gpu_sizing::{gpu_kv_blocks, GpuMemory, KvBlocks};

/// Why the CUDA backend could not start (or, in [`CudaBackend::run`], why the device failed).
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The NVIDIA driver library is not installed or cannot be loaded: no usable GPU here.
    #[error("no CUDA driver found ({file} could not be loaded: {reason}); run with --backend cpu")]
    NoDriver {
        /// The library file looked for.
        file: String,
        /// The dynamic loader's message.
        reason: String,
    },
    /// The driver is there but a CUDA library the backend needs is not.
    #[error(
        "the CUDA driver is present but {library} is not ({file} could not be loaded: \
         {reason}); install the CUDA 12 runtime libraries or run with --backend cpu"
    )]
    MissingLibrary {
        /// Which library.
        library: CudaLibrary,
        /// The library file looked for.
        file: String,
        /// The dynamic loader's message.
        reason: String,
    },
    /// The requested GPU does not exist.
    #[error(
        "there is no CUDA device {ordinal}: the driver sees {count} (--cuda-device counts from 0)"
    )]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver reports.
        count: i32,
    },
    /// A driver call failed.
    #[error("CUDA driver error while {during}: {source}")]
    Driver {
        /// What the backend was doing.
        during: &'static str,
        /// The driver's error code.
        #[source]
        source: DriverError,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS error in {during}: {source}")]
    Cublas {
        /// What the backend was doing.
        during: &'static str,
        /// cuBLAS's status.
        #[source]
        source: CublasError,
    },
    /// NVRTC rejected the kernels.
    #[error("compiling the CUDA kernels with NVRTC failed: {0}")]
    Compile(String),
    /// A CUDA library panicked (caught; see [`device::guarded`]).
    #[error("the CUDA libraries panicked while {during}: {message}")]
    Panicked {
        /// What the backend was doing.
        during: &'static str,
        /// The panic's message.
        message: String,
    },
    /// The fraction of the device's memory given holds no KV block.
    #[error(transparent)]
    Sizing(#[from] crate::executor_config::ConfigError),
    /// The model or pool is outside what this backend handles.
    #[error("the CUDA backend cannot run this model: {0}")]
    Unsupported(String),
}

impl CudaError {
    /// Wraps a driver error with what was being done.
    pub fn driver(during: &'static str) -> impl Fn(DriverError) -> Self + Copy {
        move |source| Self::Driver { during, source }
    }

    /// Wraps a cuBLAS error with what was being done.
    pub fn cublas(during: &'static str) -> impl Fn(CublasError) -> Self + Copy {
        move |source| Self::Cublas { during, source }
    }
}

impl std::fmt::Display for CudaLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Driver => "the NVIDIA driver",
            Self::Nvrtc => "NVRTC",
            Self::Cublas => "cuBLAS",
        })
    }
}

/// Checks that the kernels can handle `shape` and that every size the kernels and cuBLAS take
/// as `int` fits one.
fn check_shape(shape: &LlamaShape, block_size: usize, num_blocks: usize) -> Result<(), CudaError> {
    let s = shape;
    if s.head_dim == 0 || s.head_dim % 2 == 1 || s.head_dim > MAX_HEAD_DIM {
        return Err(CudaError::Unsupported(format!(
            "head size {} (the kernels take an even size up to {MAX_HEAD_DIM})",
            s.head_dim
        )));
    }
    // (Not `is_multiple_of`: the workspace supports Rust 1.85, which lacks it.)
    if s.num_heads == 0
        || s.num_kv_heads == 0
        || s.num_heads / s.num_kv_heads * s.num_kv_heads != s.num_heads
    {
        return Err(CudaError::Unsupported(format!(
            "{} query heads over {} key/value heads",
            s.num_heads, s.num_kv_heads
        )));
    }
    if block_size == 0 || num_blocks == 0 {
        return Err(CudaError::Unsupported("an empty KV pool".into()));
    }
    let widest = [
        s.q_dim() + 2 * s.kv_dim(),
        2 * s.intermediate,
        s.vocab_size,
        s.num_layers,
        block_size,
        s.num_heads + s.num_kv_heads,
    ];
    if widest.iter().any(|&d| d > i32::MAX as usize) {
        return Err(CudaError::Unsupported(format!("a dimension past i32::MAX in {shape:?}")));
    }
    Ok(())
}

/// The real model on a CUDA GPU.
pub struct CudaBackend {
    shape: LlamaShape,
    scratch: Scratch,
    adapters: lora::DeviceAdapters,
    cache: DeviceKvCache,
    weights: DeviceWeights,
    gpu: Gpu,
}

/// The element types the backend computes with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Precision {
    /// The weights on the device (and the rounding of the products' inputs).
    pub weights: Storage,
    /// The KV cache's values.
    pub kv: KvDtype,
}

impl Precision {
    /// f32 weights and KV: the file's values exactly, as the CPU backend multiplies them.
    pub const F32: Self = Self { weights: Storage::F32, kv: KvDtype::F32 };
}

impl CudaBackend {
    /// [`Self::with_precision`] in f32 throughout ([`Precision::F32`]).
    pub fn new(
        weights: &LlamaWeights,
        block_size: usize,
        blocks: impl Into<KvBlocks>,
        ordinal: usize,
    ) -> Result<Self, CudaError> {
        Self::with_precision(weights, block_size, blocks, ordinal, Precision::F32)
    }

    /// Opens GPU `ordinal`, uploads `weights` (dequantized, then stored as `precision`
    /// says) and allocates a KV pool of `blocks` blocks of `block_size` tokens on it (a count,
    /// or as many as fit in a fraction of the device's memory once the weights are there).
    /// Fails with [`CudaError::NoDriver`] on a machine without the NVIDIA driver, before any
    /// CUDA call.
    pub fn with_precision(
        weights: &LlamaWeights,
        block_size: usize,
        blocks: impl Into<KvBlocks>,
        ordinal: usize,
        precision: Precision,
    ) -> Result<Self, CudaError> {
        let shape = weights.shape;
        let blocks = blocks.into();
        check_shape(&shape, block_size, if let KvBlocks::Count(n) = blocks { n } else { 1 })?;
        let gpu = Gpu::open(ordinal)?;
        let (device_weights, cache) = guarded("uploading the model", || {
            let w = DeviceWeights::upload(&gpu.stream, weights, precision.weights)?;
            let num_blocks = match blocks {
                KvBlocks::Count(n) => n,
                KvBlocks::GpuFraction(fraction) => {
                    gpu.finish()?;
                    let (free, total) = gpu
                        .ctx
                        .mem_get_info()
                        .map_err(CudaError::driver("reading the device's free memory"))?;
                    let memory = GpuMemory { total: total as u64, free: free as u64 };
                    gpu_kv_blocks(&shape, precision.kv, block_size, fraction, memory)?
                }
            };
            let cache =
                DeviceKvCache::new(&gpu.stream, &shape, precision.kv, block_size, num_blocks)?;
            gpu.finish()?;
            Ok((w, cache))
        })?;
        tracing::info!(
            device = %gpu.name(),
            ordinal,
            weight_mib = device_weights.bytes() >> 20,
            weights = device_weights.storage.name(),
            weight_rounding = device_weights.rounding,
            kv_cache_mib = cache.data.num_bytes() >> 20,
            kv_dtype = ?cache.data.dtype(),
            "CUDA backend ready"
        );
        let (scratch, adapters) = (Scratch::default(), lora::DeviceAdapters::default());
        Ok(Self { shape, scratch, adapters, cache, weights: device_weights, gpu })
    }
}

impl ModelBackend for CudaBackend {
    fn facts(&self) -> BackendFacts {
        BackendFacts {
            shape: self.shape,
            block_size: self.cache.block_size,
            num_blocks: self.cache.num_blocks,
        }
    }

    fn check(&self, batch: &[SeqSlice]) -> Result<(), BatchError> {
        if batch.iter().filter_map(|s| s.adapter).any(|a| a.rank() > lora::MAX_RANK) {
            return Err(BatchError::Unsupported(
                "a LoRA adapter of a rank past the CUDA backend's 256",
            ));
        }
        paged::check_geometry(
            self.shape.vocab_size,
            self.cache.block_size,
            self.cache.num_blocks,
            batch,
        )
    }

    /// Runs the batch on the GPU.
    ///
    /// A device failure here (a faulting kernel, lost device, out of memory for a batch) ends
    /// the engine thread with a panic, on purpose: a CUDA context that faulted is unusable, the
    /// trait's [`BatchError`] only describes bad batches, and a stopped engine is how the
    /// service reports an executor that can no longer serve (its RPCs turn UNAVAILABLE and the
    /// scheduler drops it).
    fn run(&mut self, batch: &[SeqSlice]) -> Result<BatchOutput, BatchError> {
        // Out-of-range blocks or tokens would be out-of-bounds device writes: check first.
        self.check(batch)?;
        if batch.is_empty() {
            return Ok(BatchOutput::Logits(Vec::new()));
        }
        let result = BatchPlan::new(batch)
            .map_err(|e| CudaError::Unsupported(e.to_string()))
            .and_then(|plan| {
                self.gpu.bind()?;
                let rows = self.adapters.prepare(&self.gpu, batch)?;
                forward::forward(
                    &self.gpu,
                    (&self.weights, &self.shape),
                    &mut self.cache,
                    (&plan, (&self.adapters, &rows)),
                    &mut self.scratch,
                )
            });
        match result {
            Ok(logits) => Ok(BatchOutput::Logits(logits)),
            Err(e) => {
                tracing::error!(error = %e, "CUDA forward failed; stopping the engine");
                panic!("the CUDA backend failed during a step and cannot continue: {e}");
            }
        }
    }

    /// Device to host: the block's values, then as little-endian bytes.
    fn read_block(&mut self, block: usize, out: &mut [u8]) -> Result<(), String> {
        let range = self.block_range(block)?;
        self.gpu.bind().map_err(|e| e.to_string())?;
        let failed =
            |e: cudarc::driver::DriverError| format!("copying block {block} from the GPU: {e}");
        let stream = &self.gpu.stream;
        match &self.cache.data {
            KvData::F32(d) => {
                let values = stream.clone_dtoh(&d.slice(range)).map_err(failed)?;
                to_le_bytes(&values, out, f32::to_le_bytes)
            }
            KvData::F16(d) => {
                let values = stream.clone_dtoh(&d.slice(range)).map_err(failed)?;
                to_le_bytes(&values, out, u16::to_le_bytes)
            }
        }
    }

    /// On the device, block to block (a sample of several starting its own copy of the
    /// partial block its prompt ends in).
    fn copy_block(&mut self, src: usize, dst: usize) {
        let (from, to) = (self.block_range(src), self.block_range(dst));
        let (from, to) = (from.expect("checked in range"), to.expect("checked in range"));
        self.gpu.bind().expect("binding the CUDA context");
        let stream = &self.gpu.stream;
        match &mut self.cache.data {
            KvData::F32(d) => copy_within(stream, d, from, to),
            KvData::F16(d) => copy_within(stream, d, from, to),
        }
        .unwrap_or_else(|e| panic!("copying block {src} into block {dst} on the GPU: {e}"));
    }

    /// Host to device: the little-endian bytes as values, into the block.
    fn write_block(&mut self, block: usize, data: &[u8]) -> Result<(), String> {
        let range = self.block_range(block)?;
        let failed =
            |e: cudarc::driver::DriverError| format!("copying block {block} to the GPU: {e}");
        self.gpu.bind().map_err(|e| e.to_string())?;
        let stream = &self.gpu.stream;
        match &mut self.cache.data {
            KvData::F32(d) => {
                let mut values = vec![0f32; range.len()];
                from_le_bytes(data, &mut values, f32::from_le_bytes)?;
                stream.memcpy_htod(&values, &mut d.slice_mut(range)).map_err(failed)
            }
            KvData::F16(d) => {
                let mut values = vec![0u16; range.len()];
                from_le_bytes(data, &mut values, u16::from_le_bytes)?;
                stream.memcpy_htod(&values, &mut d.slice_mut(range)).map_err(failed)
            }
        }
    }
}

/// Copies `data[from]` to `data[to]` on the device (two distinct, equally long ranges).
fn copy_within<T: cudarc::driver::DeviceRepr>(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    data: &mut cudarc::driver::CudaSlice<T>,
    from: std::ops::Range<usize>,
    to: std::ops::Range<usize>,
) -> Result<(), cudarc::driver::DriverError> {
    let len = from.len();
    if from.start < to.start {
        let (low, mut high) = data.split_at_mut(to.start);
        stream.memcpy_dtod(&low.slice(from), &mut high.slice_mut(0..len))
    } else {
        let (mut low, high) = data.split_at_mut(from.start);
        stream.memcpy_dtod(&high.slice(0..len), &mut low.slice_mut(to))
    }
}

impl CudaBackend {
    /// Bytes of device memory the weights take.
    pub fn weight_bytes(&self) -> usize {
        self.weights.bytes()
    }

    /// The device's name and its peak memory bandwidth in bytes per second, from the driver's
    /// memory clock and bus width (double data rate): a decode step's roofline.
    pub fn device_bandwidth(&self) -> Result<(String, f64), CudaError> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let read = CudaError::driver("reading the device's attributes");
        let clock_khz =
            self.gpu.ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE).map_err(read)?;
        let bus_bits =
            self.gpu.ctx.attribute(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH).map_err(read)?;
        let bytes_per_s = f64::from(clock_khz) * 1e3 * 2.0 * f64::from(bus_bits) / 8.0;
        Ok((self.gpu.name(), bytes_per_s))
    }
}

impl CudaBackend {
    /// The values of block `block` in the device cache.
    fn block_range(&self, block: usize) -> Result<std::ops::Range<usize>, String> {
        if block >= self.cache.num_blocks {
            return Err(format!("block {block} is out of range"));
        }
        let len = self.cache.data.len() / self.cache.num_blocks;
        Ok(block * len..(block + 1) * len)
    }
}
