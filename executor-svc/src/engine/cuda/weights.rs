//! The model's weights on the GPU, dequantized once at load and stored as float16 or bfloat16
//! (half the memory and bandwidth of f32; products with `cublasGemmEx` on tensor cores,
//! accumulating in f32) or as f32 (`--dtype float32`: exactly the file's values, with `sgemm`).
//!
//! Dequantization is [`Matrix::row`] (`QWeight::dequantize_row`), the same code the CPU path
//! uses for its embeddings. The narrowing to 16 bits is exact where the format allows (an F16
//! file to float16, a BF16 file to bfloat16); otherwise each value is rounded to the nearest
//! (ties to even) and the largest rounding, relative to its matrix's largest value, is kept
//! and logged ([`DeviceWeights::rounding`]): a `Q8_0` or `Q4_K` value is a 16-bit scale times
//! a small integer, which float16's 11 bits hold only sometimes.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use rayon::prelude::*;

use super::CudaError;
use crate::executor_config::WeightDtype;
use crate::forward::LlamaWeights;
use crate::kernels::Matrix;

/// How the weights are stored on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// 32-bit floats.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
}

impl Storage {
    /// The storage `--dtype` asks for, for a model of `family` (`auto`: bfloat16 for Gemma,
    /// whose activations can pass float16's range, else float16).
    pub fn of(dtype: WeightDtype, family: &ferry_model::Family) -> Self {
        match dtype {
            WeightDtype::Float32 => Self::F32,
            WeightDtype::Bfloat16 => Self::Bf16,
            WeightDtype::Auto if family.post_norms => Self::Bf16,
            WeightDtype::Float16 | WeightDtype::Auto => Self::F16,
        }
    }

    /// Its name in the log.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::F16 => "float16",
            Self::Bf16 => "bfloat16",
        }
    }
}

/// A matrix's values on the device.
#[derive(Debug)]
pub enum MatrixData {
    /// f32.
    F32(CudaSlice<f32>),
    /// float16 or bfloat16, as `u16` bits.
    Half {
        /// The values' bits.
        bits: CudaSlice<u16>,
        /// bfloat16 rather than float16.
        bf16: bool,
    },
}

impl MatrixData {
    /// Bytes of device memory.
    pub fn num_bytes(&self) -> usize {
        match self {
            Self::F32(d) => d.num_bytes(),
            Self::Half { bits, .. } => bits.num_bytes(),
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(d) => d.len(),
            Self::Half { bits, .. } => bits.len(),
        }
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A dense row-major `[rows (outputs), cols (inputs)]` matrix in device memory.
#[derive(Debug)]
pub struct DeviceMatrix {
    /// The values.
    pub data: MatrixData,
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
    /// How the matrices are stored.
    pub storage: Storage,
    /// The largest rounding of a value to `storage`, relative to the largest value of its
    /// matrix (0: every value exact).
    pub rounding: f32,
}

impl DeviceWeights {
    /// The output head (the embeddings when tied).
    pub fn lm_head(&self) -> &DeviceMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Dequantizes `w` matrix by matrix, narrows it to `storage` and copies it to the device;
    /// host memory holds one dequantized matrix at a time.
    pub fn upload(
        stream: &Arc<CudaStream>,
        w: &LlamaWeights,
        storage: Storage,
    ) -> Result<Self, CudaError> {
        let vector = |v: &[f32]| stream.clone_htod(v).map_err(CudaError::driver("copying weights"));
        let rounding = std::cell::Cell::new(0f32);
        let matrix = |q: &dyn Matrix| {
            let (m, r) = upload_matrix(stream, q, &dequantize(q), storage)?;
            rounding.set(rounding.get().max(r));
            Ok::<_, CudaError>(m)
        };
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
        let lm_head = if tied {
            None
        } else {
            let (m, r) = upload_matrix(stream, &w.lm_head, &head_host, storage)?;
            rounding.set(rounding.get().max(r));
            Some(m)
        };
        let (embed, r) = upload_matrix(stream, &w.embed, &embed_host, storage)?;
        Ok(Self {
            embed,
            lm_head,
            norm: vector(&w.norm)?,
            layers,
            rope_freqs: vector(&w.rope_freqs)?,
            local_rope_freqs: w.local_rope_freqs.as_deref().map(vector).transpose()?,
            storage,
            rounding: rounding.get().max(r),
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

/// `host` (the dequantized `q`) on the device as `storage`, and the largest rounding that took
/// relative to the matrix's largest magnitude.
fn upload_matrix(
    stream: &Arc<CudaStream>,
    q: &dyn Matrix,
    host: &[f32],
    storage: Storage,
) -> Result<(DeviceMatrix, f32), CudaError> {
    let copy = CudaError::driver("copying weights");
    let (rows, cols) = (q.out_features(), q.in_features());
    let (data, rounding) = match storage {
        Storage::F32 => (MatrixData::F32(stream.clone_htod(host).map_err(copy)?), 0.0),
        Storage::F16 | Storage::Bf16 => {
            let bf16 = storage == Storage::Bf16;
            let (bits, rounding) = narrow(host, bf16);
            (MatrixData::Half { bits: stream.clone_htod(&bits).map_err(copy)?, bf16 }, rounding)
        }
    };
    Ok((DeviceMatrix { data, rows, cols }, rounding))
}

/// `values` rounded to float16 (`bf16`: bfloat16) bits, to the nearest with ties to even, and
/// the largest rounding relative to the largest magnitude (infinite where a value overflows).
pub fn narrow(values: &[f32], bf16: bool) -> (Vec<u16>, f32) {
    let round = |v: f32| {
        if bf16 {
            let b = half::bf16::from_f32(v);
            (b.to_bits(), b.to_f32())
        } else {
            let h = half::f16::from_f32(v);
            (h.to_bits(), h.to_f32())
        }
    };
    let scale = values.par_iter().map(|v| v.abs()).reduce(|| 0f32, f32::max);
    let (bits, errors): (Vec<u16>, Vec<f32>) = values
        .par_iter()
        .map(|&v| {
            let (b, back) = round(v);
            (b, (back - v).abs())
        })
        .unzip();
    let worst = errors.into_par_iter().reduce(|| 0f32, f32::max);
    (bits, if scale > 0.0 { worst / scale } else { 0.0 })
}
