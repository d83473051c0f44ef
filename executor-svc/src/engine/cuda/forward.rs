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

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, CudaStream};

use super::cache::DeviceKvCache;
use super::device::Gpu;
use super::launch::{int, Heads, PagedContext};
use super::plan::BatchPlan;
use super::weights::{DeviceMatrix, DeviceWeights};
use super::CudaError;
use crate::forward::LlamaShape;

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

/// `y[rows, w.rows] = x[rows, w.cols] · wᵀ`, plus the old `y` when `accumulate`.
fn linear(
    blas: &CudaBlas,
    w: &DeviceMatrix,
    x: &CudaSlice<f32>,
    rows: usize,
    y: &mut CudaSlice<f32>,
    accumulate: bool,
    during: &'static str,
) -> Result<(), CudaError> {
    assert!(
        x.len() >= rows * w.cols && y.len() >= rows * w.rows && w.data.len() >= w.rows * w.cols,
        "linear buffers too small"
    );
    // Row-major Y = X·Wᵀ is column-major Yᵀ = W·Xᵀ: cuBLAS sees W (stored `cols × rows`,
    // column-major) transposed, X as is.
    let cfg = GemmConfig {
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
    };
    // SAFETY: the three buffers hold the matrices the configuration describes (checked above)
    // and `y` is distinct from `w` and `x`.
    unsafe { blas.gemm(cfg, &w.data, x, y) }.map_err(CudaError::cublas(during))
}

/// `x += a·Wᵀ`, RMS-normed by `post_norm` first where the family norms a block's outputs
/// (the product alone into `proj`, normed into `normed`, then added; both `x`'s size).
#[allow(clippy::too_many_arguments)]
fn residual(
    gpu: &Gpu,
    w: &DeviceMatrix,
    a: &CudaSlice<f32>,
    post_norm: Option<&CudaSlice<f32>>,
    (x, proj, normed): (&mut CudaSlice<f32>, &mut CudaSlice<f32>, &mut CudaSlice<f32>),
    rows: usize,
    s: &LlamaShape,
    during: &'static str,
) -> Result<(), CudaError> {
    let Some(norm) = post_norm else {
        return linear(&gpu.blas, w, a, rows, x, true, during);
    };
    let (stream, k) = (&gpu.stream, &gpu.kernels);
    linear(&gpu.blas, w, a, rows, proj, false, during)?;
    k.rms_norm(stream, normed, proj, norm, rows, s.rms_eps)?;
    k.add_rows(stream, x, normed, (rows, s.hidden))
}

/// Runs the batch `plan` describes; returns the logits of the rows that want them (`vocab`
/// each, in batch order). The caller has validated the batch and bound the context.
pub fn forward(
    gpu: &Gpu,
    w: &DeviceWeights,
    s: &LlamaShape,
    cache: &mut DeviceKvCache,
    plan: &BatchPlan,
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

    k.gather_rows(stream, &mut a.x, &w.embed.data, &tokens, n, s.hidden)?;
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
        k.rms_norm(stream, &mut a.hn, &a.x, &layer.attn_norm, n, s.rms_eps)?;
        linear(&gpu.blas, &layer.wqkv, &a.hn, n, &mut a.qkv, false, "the QKV projection")?;
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
        let buffers = (&mut a.x, &mut a.proj, &mut a.hn);
        residual(gpu, &layer.wo, &a.attn, post.map(|p| &p.0), buffers, n, s, wo)?;
        k.rms_norm(stream, &mut a.hn, &a.x, &layer.ffn_norm, n, s.rms_eps)?;
        linear(&gpu.blas, &layer.w_gate_up, &a.hn, n, &mut a.gate_up, false, "the gate/up")?;
        let (act, width) = (s.family.activation, s.intermediate);
        k.gate_mul(stream, act, &mut a.ffn, &a.gate_up, (n, width))?;
        let buffers = (&mut a.x, &mut a.proj, &mut a.hn);
        residual(gpu, &layer.w_down, &a.ffn, post.map(|p| &p.1), buffers, n, s, down)?;
    }
    if m == 0 {
        gpu.finish()?;
        return Ok(Vec::new());
    }
    let logit_rows = stream.clone_htod(&plan.logit_rows).map_err(upload)?;
    k.gather_rows(stream, &mut head.last, &a.x, &logit_rows, m, s.hidden)?;
    k.rms_norm(stream, &mut head.last_norm, &head.last, &w.norm, m, s.rms_eps)?;
    linear(&gpu.blas, w.lm_head(), &head.last_norm, m, &mut head.logits, false, "the LM head")?;
    if let Some(c) = s.final_softcap {
        k.map(stream, (&k.softcap, "launching softcap"), &mut head.logits, c, m * s.vocab_size)?;
    }
    let logits = stream
        .clone_dtoh(&head.logits.slice(0..m * s.vocab_size))
        .map_err(CudaError::driver("copying the logits back"))?;
    gpu.finish()?;
    Ok(logits.chunks_exact(s.vocab_size).map(<[f32]>::to_vec).collect())
}
