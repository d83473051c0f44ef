//! The CUDA kernels of the forward, as CUDA C compiled at run time with NVRTC, so that building
//! Ferry needs no CUDA toolkit and no `nvcc`. cuBLAS does the matrix products; these kernels do
//! everything between them.
//!
//! Each kernel mirrors one step of the CPU forward (`forward::ops`, `forward::paged`): the same
//! formulas with the same association of operations, compiled without fused multiply-add
//! contraction (`--fmad=false`), so the two paths differ only where summation order differs and
//! in the device's `expf`, `tanhf` and `sincosf`. Layouts are the CPU path's: activations
//! are row-major `rows × width`; the KV cache is block-major,
//! `block × layer × {K, V} × slot × kv_dim`; a fused QKV row is `[q | k | v]`.
//!
//! Invariants the host keeps (checked at load or by batch validation, never in the kernels):
//! widths and row counts fit in `int` (positions and table offsets are 64-bit); block ids and
//! token ids are in range; `head_dim` is even and at most [`MAX_HEAD_DIM`]; `blockDim.x` is a
//! multiple of 32 wherever a kernel reduces.
//!
//! Run in CI under the CPU emulation of CUDA ([`crate::engine::cuda_emulation`]: the same source, compiled
//! for the host, each block's threads meeting at real barriers), where the forward matches the
//! CPU backend's logits to a few parts in a million (`tests.rs`). Not yet run on a GPU.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use super::CudaError;

/// Largest head size the attention kernel holds per lane (`MAX_HEAD_DIM / 32` values each).
pub const MAX_HEAD_DIM: usize = 256;

/// Threads per block of the row kernels (a multiple of the warp size).
pub const ROW_THREADS: u32 = 256;

/// Warps per block of the attention kernel: they split a sequence's positions between them.
pub const ATTN_WARPS: u32 = 4;

/// Query heads an attention block serves from one read of their KV head's keys and values: a
/// group of up to this many shares one block (Llama 3 8B's 4, Qwen 2.5's 7, Llama 3 70B's 8);
/// a larger group takes several blocks per KV head.
pub const ATTN_GROUP: u32 = 8;

/// The kernels' source (`kernels.cu`). `MAX_HEAD_DIM`, `ATTN_WARPS` and `ATTN_GROUP` are
/// prepended as `#define`s by [`source`] so the host and the device agree on them.
const BODY: &str = include_str!("kernels.cu");

/// The full CUDA C source, with the host's constants.
pub fn source() -> String {
    format!(
        "#define MAX_HEAD_DIM {MAX_HEAD_DIM}\n#define ATTN_WARPS {ATTN_WARPS}\n\
         #define ATTN_GROUP {ATTN_GROUP}\n{BODY}"
    )
}

/// Compiles [`source`] to PTX. Needs only the NVRTC library, not a GPU or a driver.
pub fn compile() -> Result<Ptx, CudaError> {
    let opts = CompileOptions {
        // Plain multiplies and adds, as the CPU path does (see the module comment).
        fmad: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        name: Some("ferry_forward.cu".into()),
        ..Default::default()
    };
    compile_ptx_with_opts(source(), opts).map_err(|e| CudaError::Compile(describe_compile(&e)))
}

/// NVRTC's error with its log as text (the `Debug` form prints the log as escaped bytes).
fn describe_compile(e: &cudarc::nvrtc::CompileError) -> String {
    match e {
        cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}: {}", log.to_string_lossy())
        }
        other => format!("{other:?}"),
    }
}

/// The loaded kernels, one handle each.
#[derive(Debug)]
pub struct Kernels {
    /// Keeps the module loaded for as long as the handles live.
    _module: Arc<CudaModule>,
    /// [`BODY`]'s `gather_rows`.
    pub gather_rows: CudaFunction,
    /// [`BODY`]'s `rms_norm`.
    pub rms_norm: CudaFunction,
    /// [`BODY`]'s `rope`.
    pub rope: CudaFunction,
    /// [`BODY`]'s `add_bias`.
    pub add_bias: CudaFunction,
    /// [`BODY`]'s `head_norm`.
    pub head_norm: CudaFunction,
    /// [`BODY`]'s `kv_write_f32` and `kv_write_f16`: by the cache's element type.
    pub kv_write: [CudaFunction; 2],
    /// [`BODY`]'s `attention_f32` and `attention_f16`: by the cache's element type.
    pub attention: [CudaFunction; 2],
    /// [`BODY`]'s `to_half`.
    pub to_half: CudaFunction,
    /// [`BODY`]'s `gather_rows_half`.
    pub gather_rows_half: CudaFunction,
    /// [`BODY`]'s `gate_mul`.
    pub gate_mul: CudaFunction,
    /// [`BODY`]'s `scale`.
    pub scale: CudaFunction,
    /// [`BODY`]'s `softcap`.
    pub softcap: CudaFunction,
    /// [`BODY`]'s `add_rows`.
    pub add_rows: CudaFunction,
    /// [`BODY`]'s `lora_add`.
    pub lora_add: CudaFunction,
}

impl Kernels {
    /// Compiles the kernels and loads them into `ctx`.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        let module =
            ctx.load_module(compile()?).map_err(CudaError::driver("loading the kernels"))?;
        let f = |name: &str| {
            module.load_function(name).map_err(CudaError::driver("finding a kernel in the module"))
        };
        Ok(Self {
            gather_rows: f("gather_rows")?,
            rms_norm: f("rms_norm")?,
            rope: f("rope")?,
            add_bias: f("add_bias")?,
            head_norm: f("head_norm")?,
            kv_write: [f("kv_write_f32")?, f("kv_write_f16")?],
            attention: [f("attention_f32")?, f("attention_f16")?],
            to_half: f("to_half")?,
            gather_rows_half: f("gather_rows_half")?,
            gate_mul: f("gate_mul")?,
            scale: f("scale")?,
            softcap: f("softcap")?,
            add_rows: f("add_rows")?,
            lora_add: f("lora_add")?,
            _module: module,
        })
    }
}
