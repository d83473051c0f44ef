//! The model's weights on the GPU, dequantized once at load to f32.
//!
//! Why f32 and not the GGUF blocks: cuBLAS multiplies dense matrices, and f32 with `sgemm` is
//! the simplest exact-enough choice (SmolLM2-135M takes ~0.55 GB). The price is memory and
//! bandwidth, four to eight times the quantized size; quantized GPU kernels or f16 with
//! `cublasGemmEx` can replace this without changing the forward around it.
//!
//! Dequantization is [`Matrix::row`] (`QWeight::dequantize_row`), the same code the CPU path uses for its
//! embeddings, so the GPU multiplies exactly the values the GGUF file stores.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use rayon::prelude::*;

use super::CudaError;
use crate::forward::LlamaWeights;
use crate::kernels::Matrix;

/// A dense row-major `[rows (outputs), cols (inputs)]` f32 matrix in device memory.
#[derive(Debug)]
pub struct DeviceMatrix {
    /// The values.
    pub data: CudaSlice<f32>,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
}

/// One transformer block on the device.
#[derive(Debug)]
pub struct DeviceLayer {
    /// RMS norm before attention.
    pub attn_norm: CudaSlice<f32>,
    /// Fused Q, K, V projection `[q_dim + 2·kv_dim, hidden]`.
    pub wqkv: DeviceMatrix,
    /// Its bias, where the family has one (Qwen 2).
    pub qkv_bias: Option<CudaSlice<f32>>,
    /// The query and key heads' RMS norm weights, where the family has them (Qwen 3).
    pub qk_norm: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// The RMS norms of the attention's and feed-forward's outputs, where the family has them
    /// (Gemma).
    pub post_norms: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// Output projection `[hidden, q_dim]`.
    pub wo: DeviceMatrix,
    /// RMS norm before the feed-forward.
    pub ffn_norm: CudaSlice<f32>,
    /// Fused gate and up projection `[2·intermediate, hidden]`.
    pub w_gate_up: DeviceMatrix,
    /// Down projection `[hidden, intermediate]`.
    pub w_down: DeviceMatrix,
}

/// All weights on the device.
#[derive(Debug)]
pub struct DeviceWeights {
    /// Token embeddings `[vocab, hidden]`.
    pub embed: DeviceMatrix,
    /// The output head, or `None` when it equals the embeddings (tied weights are stored once).
    pub lm_head: Option<DeviceMatrix>,
    /// Final RMS norm.
    pub norm: CudaSlice<f32>,
    /// The blocks.
    pub layers: Vec<DeviceLayer>,
    /// Rotary frequencies, one per pair of a head's dimensions (the CPU path's values).
    pub rope_freqs: CudaSlice<f32>,
    /// The windowed layers' own rotary frequencies, where the family has them (Gemma 3).
    pub local_rope_freqs: Option<CudaSlice<f32>>,
}

impl DeviceWeights {
    /// The output head (the embeddings when tied).
    pub fn lm_head(&self) -> &DeviceMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Dequantizes `w` matrix by matrix and copies it to the device; host memory holds one
    /// dequantized matrix at a time.
    pub fn upload(stream: &Arc<CudaStream>, w: &LlamaWeights) -> Result<Self, CudaError> {
        let vector = |v: &[f32]| stream.clone_htod(v).map_err(CudaError::driver("copying weights"));
        let matrix = |q: &dyn Matrix| upload_matrix(stream, q, &dequantize(q));
        let layers = w
            .layers
            .iter()
            .map(|l| {
                Ok(DeviceLayer {
                    attn_norm: vector(&l.attn_norm)?,
                    wqkv: matrix(&l.wqkv)?,
                    qkv_bias: l.qkv_bias.as_deref().map(vector).transpose()?,
                    qk_norm: match &l.qk_norm {
                        Some((q, k)) => Some((vector(q)?, vector(k)?)),
                        None => None,
                    },
                    post_norms: match &l.post_norms {
                        Some((a, f)) => Some((vector(a)?, vector(f)?)),
                        None => None,
                    },
                    wo: matrix(&l.wo)?,
                    ffn_norm: vector(&l.ffn_norm)?,
                    w_gate_up: matrix(&l.w_gate_up)?,
                    w_down: matrix(&l.w_down)?,
                })
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        let embed_host = dequantize(&w.embed);
        let head_host = dequantize(&w.lm_head);
        // A model with tied embeddings loads the same tensor twice; keep one copy on the GPU.
        let tied = embed_host.len() == head_host.len()
            && embed_host.iter().zip(&head_host).all(|(a, b)| a.to_bits() == b.to_bits());
        let lm_head =
            if tied { None } else { Some(upload_matrix(stream, &w.lm_head, &head_host)?) };
        Ok(Self {
            embed: upload_matrix(stream, &w.embed, &embed_host)?,
            lm_head,
            norm: vector(&w.norm)?,
            layers,
            rope_freqs: vector(&w.rope_freqs)?,
            local_rope_freqs: w.local_rope_freqs.as_deref().map(vector).transpose()?,
        })
    }

    /// Bytes of device memory the weights take.
    pub fn bytes(&self) -> usize {
        let m = |m: &DeviceMatrix| m.data.num_bytes();
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.attn_norm.num_bytes()
                    + l.ffn_norm.num_bytes()
                    + l.qkv_bias.as_ref().map_or(0, CudaSlice::num_bytes)
                    + l.qk_norm.as_ref().map_or(0, |(q, k)| q.num_bytes() + k.num_bytes())
                    + l.post_norms.as_ref().map_or(0, |(a, f)| a.num_bytes() + f.num_bytes())
                    + m(&l.wqkv)
                    + m(&l.wo)
                    + m(&l.w_gate_up)
                    + m(&l.w_down)
            })
            .sum();
        layers
            + m(&self.embed)
            + self.lm_head.as_ref().map_or(0, m)
            + self.norm.num_bytes()
            + self.rope_freqs.num_bytes()
            + self.local_rope_freqs.as_ref().map_or(0, CudaSlice::num_bytes)
    }
}

/// `w` as dense row-major f32.
pub fn dequantize(w: &dyn Matrix) -> Vec<f32> {
    let (rows, cols) = (w.out_features(), w.in_features());
    let mut out = vec![0f32; rows * cols];
    out.par_chunks_mut(cols.max(1)).enumerate().for_each(|(r, row)| w.row(r, row));
    out
}

fn upload_matrix(
    stream: &Arc<CudaStream>,
    q: &dyn Matrix,
    host: &[f32],
) -> Result<DeviceMatrix, CudaError> {
    let data = stream.clone_htod(host).map_err(CudaError::driver("copying weights"))?;
    Ok(DeviceMatrix { data, rows: q.out_features(), cols: q.in_features() })
}
