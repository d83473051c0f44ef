//! The serving forward on the GPU: the CPU's `forward::paged::forward`, step for step, over the
//! same variable-length batch (prefill chunks and decodes, no padding), with cuBLAS for the
//! products and [`super::kernels`] for the rest.
//!
//! One pass runs all the batch's rows through every layer; each row's keys and values go into
//! the cache at its own position through its sequence's block table *before* attention, so a
//! prefill chunk attends to itself causally, exactly as on the CPU. Residual additions ride on
//! the products (`beta = 1`: `x += a·Wᵀ`). Logits are computed only for the last row of each
//! sequence that samples, and come back in batch order.

use std::sync::Arc;

use std::ffi::c_void;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::{Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::cache::DeviceKvCache;
use super::device::Gpu;
use super::launch::{int, Heads, PagedContext};
use super::lora::{AdapterRows, DeviceAdapters};
use super::plan::BatchPlan;
use super::weights::{DeviceMatrix, DeviceWeights, MatrixData};
use super::CudaError;
use crate::forward::LlamaShape;
use ferry_model::lora::Product;

/// Activation buffers for a number of rows, reused across steps and grown when a larger batch
/// arrives (never shrunk: the largest batch sets the high-water mark, as on the CPU).
#[derive(Debug)]
struct Activations {
    rows: usize,
    /// The residual stream `rows × hidden`.
    x: CudaSlice<f32>,
    /// A normalised copy of `x`.
    hn: CudaSlice<f32>,
    /// Fused `[q | k | v]` rows.
    qkv: CudaSlice<f32>,
    /// Attention output `rows × hidden`.
    attn: CudaSlice<f32>,
    /// A projection's output before its post-norm, `rows × hidden` (Gemma).
    proj: CudaSlice<f32>,
    /// Fused `[gate | up]` rows.
    gate_up: CudaSlice<f32>,
    /// `act(gate) · up`, `rows × intermediate`.
    ffn: CudaSlice<f32>,
    /// A product's input rounded to the weights' half precision (unused with f32 weights).
    half: CudaSlice<u16>,
}

/// Buffers of the output head, for the rows that want logits.
#[derive(Debug)]
struct HeadBuffers {
    rows: usize,
    /// The residual rows that want logits.
    last: CudaSlice<f32>,
    /// `last` after the final norm.
    last_norm: CudaSlice<f32>,
    /// `rows × vocab`.
    logits: CudaSlice<f32>,
}

/// Device buffers reused across steps.
#[derive(Debug, Default)]
pub struct Scratch {
    act: Option<Activations>,
    head: Option<HeadBuffers>,
}

fn zeros(stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<f32>, CudaError> {
    stream.alloc_zeros::<f32>(len.max(1)).map_err(CudaError::driver("allocating activations"))
}

impl Scratch {
    /// Buffers for `rows` rows and `logit_rows` logit rows, grown if needed.
    fn buffers(
        &mut self,
        stream: &Arc<CudaStream>,
        s: &LlamaShape,
        rows: usize,
        logit_rows: usize,
    ) -> Result<(&mut Activations, &mut HeadBuffers), CudaError> {
        let (h, q_dim, ff) = (s.hidden, s.q_dim(), s.intermediate);
        let qkv_w = q_dim + 2 * s.kv_dim();
        if self.act.as_ref().is_none_or(|a| a.rows < rows) {
            // Free the old buffers first so peak memory is one set, not two.
            self.act = None;
            self.act = Some(Activations {
                rows,
                x: zeros(stream, rows * h)?,
                hn: zeros(stream, rows * h)?,
                qkv: zeros(stream, rows * qkv_w)?,
                attn: zeros(stream, rows * q_dim)?,
                proj: zeros(stream, rows * h)?,
                gate_up: zeros(stream, rows * 2 * ff)?,
                ffn: zeros(stream, rows * ff)?,
                // The widest input of a product: the hidden state, attention output or FFN's.
                half: stream
                    .alloc_zeros::<u16>((rows * h.max(q_dim).max(ff)).max(1))
                    .map_err(CudaError::driver("allocating activations"))?,
            });
        }
        let wanted = logit_rows.max(1);
        if self.head.as_ref().is_none_or(|b| b.rows < wanted) {
            self.head = None;
            self.head = Some(HeadBuffers {
                rows: wanted,
                last: zeros(stream, wanted * h)?,
                last_norm: zeros(stream, wanted * h)?,
                logits: zeros(stream, wanted * s.vocab_size)?,
            });
        }
        match (self.act.as_mut(), self.head.as_mut()) {
            (Some(a), Some(b)) => Ok((a, b)),
            _ => unreachable!("both buffer sets were allocated just above"),
        }
    }
}

/// `y[rows, w.rows] = x[rows, w.cols] · wᵀ`, plus the old `y` when `accumulate`. With
/// half-precision weights, `x` is first rounded to their type in `half` and the product runs
/// on tensor cores (`cublasGemmEx`), accumulating in f32 into the f32 `y`.
#[allow(clippy::too_many_arguments)]
fn linear(
    gpu: &Gpu,
    w: &DeviceMatrix,
    x: &CudaSlice<f32>,
    rows: usize,
    (y, half): (&mut CudaSlice<f32>, &mut CudaSlice<u16>),
    accumulate: bool,
    during: &'static str,
) -> Result<(), CudaError> {
    assert!(
        x.len() >= rows * w.cols && y.len() >= rows * w.rows && w.data.len() >= w.rows * w.cols,
        "linear buffers too small"
    );
    let blas = &gpu.blas;
    let (weights, bf16) = match &w.data {
        MatrixData::F32(data) => {
            let cfg = sgemm_config(w, rows, accumulate);
            // SAFETY: the three buffers hold the matrices the configuration describes
            // (checked above) and `y` is distinct from `w` and `x`.
            return unsafe { blas.gemm(cfg, data, x, y) }.map_err(CudaError::cublas(during));
        }
        MatrixData::Half { bits, bf16 } => {
            gpu.kernels.to_half(&gpu.stream, half, x, rows * w.cols, *bf16)?;
            (bits, *bf16)
        }
    };
    let kind = if bf16 { cudaDataType::CUDA_R_16BF } else { cudaDataType::CUDA_R_16F };
    let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
    let stream = &gpu.stream;
    let (a, _a) = weights.device_ptr(stream);
    let (b, _b) = half.device_ptr(stream);
    let (c, _c) = y.device_ptr_mut(stream);
    // SAFETY: as `sgemm_config` describes: W is `w.rows × w.cols` (stored transposed for
    // cuBLAS), the rounded input `rows × w.cols`, Y `rows × w.rows` (checked above; `half`
    // holds the widest input); alpha and beta are f32, as the f32 compute type wants; `y` is
    // distinct from both inputs.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            int(w.rows),
            int(rows),
            int(w.cols),
            (&raw const alpha).cast(),
            a as *const c_void,
            kind,
            int(w.cols),
            b as *const c_void,
            kind,
            int(w.cols),
            (&raw const beta).cast(),
            c as *mut c_void,
            cudaDataType::CUDA_R_32F,
            int(w.rows),
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(CudaError::cublas(during))
}

/// cuBLAS's view of `Y = X·Wᵀ` for f32 weights.
fn sgemm_config(w: &DeviceMatrix, rows: usize, accumulate: bool) -> GemmConfig<f32> {
    // Row-major Y = X·Wᵀ is column-major Yᵀ = W·Xᵀ: cuBLAS sees W (stored `cols × rows`,
    // column-major) transposed, X as is.
    GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: int(w.rows),
        n: int(rows),
        k: int(w.cols),
        alpha: 1.0f32,
        lda: int(w.cols),
        ldb: int(w.cols),
        beta: if accumulate { 1.0 } else { 0.0 },
        ldc: int(w.rows),
    }
}

/// The buffers [`residual`] works in: the residual stream, a product's output, its normed
/// copy, and the product's rounded input.
type Residual<'a> = (
    &'a mut CudaSlice<f32>,
    &'a mut CudaSlice<f32>,
    &'a mut CudaSlice<f32>,
    &'a mut CudaSlice<u16>,
);

/// `x += a·Wᵀ` (with the adapters' updates of the product on their rows), RMS-normed by
/// `post_norm` first where the family norms a block's outputs (the product alone into `proj`,
/// normed into `normed`, then added; both `x`'s size).
#[allow(clippy::too_many_arguments)]
fn residual(
    gpu: &Gpu,
    (w, lora): (&DeviceMatrix, Lora<'_>),
    a: &CudaSlice<f32>,
    post_norm: Option<&CudaSlice<f32>>,
    (x, proj, normed, half): Residual<'_>,
    rows: usize,
    s: &LlamaShape,
    during: &'static str,
) -> Result<(), CudaError> {
    let Some(norm) = post_norm else {
        linear(gpu, w, a, rows, (x, half), true, during)?;
        return lora.apply(gpu, a, (x, w.rows));
    };
    let (stream, k) = (&gpu.stream, &gpu.kernels);
    linear(gpu, w, a, rows, (proj, half), false, during)?;
    lora.apply(gpu, a, (proj, w.rows))?;
    k.rms_norm(stream, normed, proj, norm, rows, s.rms_eps)?;
    k.add_rows(stream, x, normed, (rows, s.hidden))
}

/// The adapters' updates of one product of one block, for the rows that have them.
#[derive(Clone, Copy)]
struct Lora<'a> {
    adapters: &'a DeviceAdapters,
    rows: &'a [AdapterRows],
    at: (usize, Product),
}

impl Lora<'_> {
    /// Adds the updates to `out` (rows `width` wide), computed from the product's input `x`.
    fn apply(
        self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        (out, width): (&mut CudaSlice<f32>, usize),
    ) -> Result<(), CudaError> {
        if self.rows.is_empty() {
            return Ok(());
        }
        self.adapters.apply(gpu, self.rows, self.at, x, (out, width))
    }
}

/// Runs the batch `plan` describes, with the adapters' updates on the rows `rows` lists (none:
/// empty); returns the logits of the rows that want them (`vocab` each, in batch order). The
/// caller has validated the batch and bound the context.
pub fn forward(
    gpu: &Gpu,
    (w, s): (&DeviceWeights, &LlamaShape),
    cache: &mut DeviceKvCache,
    (plan, (adapters, rows)): (&BatchPlan, (&DeviceAdapters, &[AdapterRows])),
    scratch: &mut Scratch,
) -> Result<Vec<Vec<f32>>, CudaError> {
    let (stream, k) = (&gpu.stream, &gpu.kernels);
    let n = plan.rows();
    let m = plan.logit_rows.len();
    let heads =
        Heads { num_heads: s.num_heads, num_kv_heads: s.num_kv_heads, head_dim: s.head_dim };
    let upload = CudaError::driver("copying the batch to the device");
    let tokens = stream.clone_htod(&plan.tokens).map_err(upload)?;
    let positions = stream.clone_htod(&plan.positions).map_err(upload)?;
    let row_table = stream.clone_htod(&plan.row_table).map_err(upload)?;
    let tables = stream.clone_htod(&plan.tables).map_err(upload)?;
    let (a, head) = scratch.buffers(stream, s, n, m)?;

    match &w.embed.data {
        MatrixData::F32(embed) => k.gather_rows(stream, &mut a.x, embed, &tokens, n, s.hidden)?,
        MatrixData::Half { bits, bf16 } => {
            k.gather_rows_half(stream, &mut a.x, (bits, *bf16), &tokens, n, s.hidden)?;
        }
    }
    if s.family.embed_scale {
        k.map(
            stream,
            (&k.scale, "launching scale"),
            &mut a.x,
            (s.hidden as f32).sqrt(),
            n * s.hidden,
        )?;
    }
    for (l, layer) in w.layers.iter().enumerate() {
        let lora = |p: Product| Lora { adapters, rows, at: (l, p) };
        k.rms_norm(stream, &mut a.hn, &a.x, &layer.attn_norm, n, s.rms_eps)?;
        let qkv = (&mut a.qkv, &mut a.half);
        linear(gpu, &layer.wqkv, &a.hn, n, qkv, false, "the QKV projection")?;
        lora(Product::Qkv).apply(gpu, &a.hn, (&mut a.qkv, layer.wqkv.rows))?;
        if let Some(bias) = &layer.qkv_bias {
            k.add_bias(stream, &mut a.qkv, bias, n)?;
        }
        if let Some((q_norm, k_norm)) = &layer.qk_norm {
            k.head_norm(stream, &mut a.qkv, (q_norm, k_norm), n, heads, s.rms_eps)?;
        }
        let freqs = match &w.local_rope_freqs {
            Some(local) if s.local_rope(l) => local,
            _ => &w.rope_freqs,
        };
        k.rope(stream, &mut a.qkv, &positions, (freqs, s.family.rope, s.rope_mscale), n, heads)?;
        let ctx = PagedContext {
            rows: n,
            heads,
            positions: &positions,
            row_table: &row_table,
            tables: &tables,
            layer: l,
            num_layers: cache.num_layers,
            block_size: cache.block_size,
        };
        k.kv_write(stream, &mut cache.data, &a.qkv, &ctx)?;
        let attention = (s.query_scale, s.layer_window(l), s.attn_softcap);
        k.paged_attention(stream, &mut a.attn, &a.qkv, &cache.data, &ctx, attention)?;
        let post = layer.post_norms.as_ref();
        let (wo, down) = ("the output projection", "the down projection");
        let buffers = (&mut a.x, &mut a.proj, &mut a.hn, &mut a.half);
        let wo_lora = (&layer.wo, lora(Product::O));
        residual(gpu, wo_lora, &a.attn, post.map(|p| &p.0), buffers, n, s, wo)?;
        k.rms_norm(stream, &mut a.hn, &a.x, &layer.ffn_norm, n, s.rms_eps)?;
        let gate_up = (&mut a.gate_up, &mut a.half);
        linear(gpu, &layer.w_gate_up, &a.hn, n, gate_up, false, "the gate/up")?;
        lora(Product::GateUp).apply(gpu, &a.hn, (&mut a.gate_up, layer.w_gate_up.rows))?;
        let (act, width) = (s.family.activation, s.intermediate);
        k.gate_mul(stream, act, &mut a.ffn, &a.gate_up, (n, width))?;
        let buffers = (&mut a.x, &mut a.proj, &mut a.hn, &mut a.half);
        let down_lora = (&layer.w_down, lora(Product::Down));
        residual(gpu, down_lora, &a.ffn, post.map(|p| &p.1), buffers, n, s, down)?;
    }
    if m == 0 {
        gpu.finish()?;
        return Ok(Vec::new());
    }
    let logit_rows = stream.clone_htod(&plan.logit_rows).map_err(upload)?;
    k.gather_rows(stream, &mut head.last, &a.x, &logit_rows, m, s.hidden)?;
    k.rms_norm(stream, &mut head.last_norm, &head.last, &w.norm, m, s.rms_eps)?;
    let logits = (&mut head.logits, &mut a.half);
    linear(gpu, w.lm_head(), &head.last_norm, m, logits, false, "the LM head")?;
    if let Some(c) = s.final_softcap {
        k.map(stream, (&k.softcap, "launching softcap"), &mut head.logits, c, m * s.vocab_size)?;
    }
    let logits = stream
        .clone_dtoh(&head.logits.slice(0..m * s.vocab_size))
        .map_err(CudaError::driver("copying the logits back"))?;
    gpu.finish()?;
    Ok(logits.chunks_exact(s.vocab_size).map(<[f32]>::to_vec).collect())
}
