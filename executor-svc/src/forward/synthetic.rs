//! Models of real shapes with random weights, made in memory on the spot: what a GPU check
//! measures speed with where the real files cannot travel (Llama 3 8B is 16 GB in f16). The
//! weights are drawn from a fixed-seed generator, scaled as an initialised model's are (so no
//! activation overflows), and quantized to the GGUF type asked for; the tokens they produce
//! mean nothing, the work per token is the real model's.

use candle_core::quantized::GgmlDType;
use ferry_model::lora::LoraAdapter;
use ferry_model::{Family, LlamaShape};
use rayon::prelude::*;

use super::llama::LayerWeights;
use super::{ops, LlamaWeights};
use crate::kernels::{QWeight, Stacked};

/// A shape to synthesize.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SyntheticShape {
    /// SmolLM2-135M: 30 layers, width 576, FFN 1,536, 9/3 heads, 49,152 tokens.
    Smollm2,
    /// Llama 3 8B: 32 layers, width 4,096, FFN 14,336, 32/8 heads, 128,256 tokens.
    Llama3_8b,
}

impl SyntheticShape {
    /// The shape's dimensions.
    pub fn shape(self) -> LlamaShape {
        let (layers, hidden, ff, heads, kv_heads, vocab, theta) = match self {
            Self::Smollm2 => (30, 576, 1536, 9, 3, 49_152, 100_000.0),
            Self::Llama3_8b => (32, 4096, 14_336, 32, 8, 128_256, 500_000.0),
        };
        let head_dim = hidden / heads;
        LlamaShape {
            family: Family::LLAMA,
            num_layers: layers,
            hidden,
            intermediate: ff,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            vocab_size: vocab,
            rope_theta: theta,
            rope_scale: 1.0,
            rope_dims: head_dim,
            rope_mscale: 1.0,
            rope_long: false,
            rms_eps: 1e-5,
            max_model_len: 8192,
            sliding_window: None,
            query_scale: 1.0 / (head_dim as f32).sqrt(),
            attn_softcap: None,
            final_softcap: None,
        }
    }
}

/// Random weights of `shape` in GGUF type `dtype` (`F16`, `Q8_0`, …), from `seed`.
pub fn synthesize(shape: LlamaShape, dtype: GgmlDType, seed: u64) -> Result<LlamaWeights, String> {
    let s = shape;
    let (h, q, kv, ff) = (s.hidden, s.q_dim(), s.kv_dim(), s.intermediate);
    let mut next_seed = seed;
    let mut matrix = |rows: usize, cols: usize| {
        next_seed = next_seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        random_matrix(rows, cols, dtype, next_seed)
    };
    let norm = |width: usize| vec![1f32; width];
    let mut layers = Vec::with_capacity(s.num_layers);
    for _ in 0..s.num_layers {
        let wqkv = matrix(q + 2 * kv, h)?;
        let w_gate_up = matrix(2 * ff, h)?;
        layers.push(LayerWeights {
            attn_norm: norm(h),
            wqkv: Stacked::new(&[&wqkv]).ok_or("stacking the QKV projection")?,
            qkv_bias: None,
            qk_norm: None,
            post_norms: None,
            wo: matrix(h, q)?,
            ffn_norm: norm(h),
            w_gate_up: Stacked::new(&[&w_gate_up]).ok_or("stacking the gate and up projections")?,
            w_down: matrix(h, ff)?,
        });
    }
    Ok(LlamaWeights {
        shape: s,
        embed: matrix(s.vocab_size, h)?,
        lm_head: matrix(s.vocab_size, h)?,
        layers,
        norm: norm(h),
        rope_freqs: ops::rope_frequencies(s.head_dim, s.rope_theta, s.rope_scale),
        local_rope_freqs: None,
    })
}

/// A `rows × cols` matrix of values uniform in ±√(3 / cols) (unit-variance outputs for
/// unit-variance inputs) in GGUF type `dtype`, its blocks written directly (rows in parallel):
/// `F16` values, or `Q8_0` / `Q4_0` codes under one scale.
fn random_matrix(rows: usize, cols: usize, dtype: GgmlDType, seed: u64) -> Result<QWeight, String> {
    let bound = (3.0 / cols as f32).sqrt();
    if !matches!(dtype, GgmlDType::F16 | GgmlDType::Q8_0 | GgmlDType::Q4_0) {
        return Err(format!("synthetic weights in {dtype:?} are not written"));
    }
    let (block_values, block_bytes) = (dtype.block_size(), dtype.type_size());
    if !cols.is_multiple_of(block_values) {
        return Err(format!("{cols} columns are not whole blocks of {block_values}"));
    }
    let row_bytes = cols / block_values * block_bytes;
    let mut bytes = vec![0u8; rows * row_bytes];
    bytes.par_chunks_mut(row_bytes).enumerate().for_each(|(r, row)| {
        let mut x = seed ^ (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut next = move || {
            // xorshift64*: fast, and plenty random for timing.
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as u32
        };
        match dtype {
            GgmlDType::F16 => {
                for v in row.chunks_exact_mut(2) {
                    let u = next() as f32 / (1u32 << 24) as f32;
                    v.copy_from_slice(&half::f16::from_f32((2.0 * u - 1.0) * bound).to_le_bytes());
                }
            }
            GgmlDType::Q8_0 => {
                let d = half::f16::from_f32(bound / 127.0).to_le_bytes();
                for block in row.chunks_exact_mut(block_bytes) {
                    block[..2].copy_from_slice(&d);
                    block[2..]
                        .iter_mut()
                        .for_each(|q| *q = ((next() % 255) as i32 - 127) as i8 as u8);
                }
            }
            _ => {
                let d = half::f16::from_f32(bound / 8.0).to_le_bytes();
                for block in row.chunks_exact_mut(block_bytes) {
                    block[..2].copy_from_slice(&d);
                    block[2..].iter_mut().for_each(|q| *q = next() as u8);
                }
            }
        }
    });
    QWeight::from_gguf(dtype, rows, cols, &bytes).map_err(|e| e.to_string())
}

/// A LoRA adapter of `rank` on every projection of every block of `shape`, random values from
/// `seed` (scaled so its update is a few percent of the base product's): what `ferry-executor
/// bench --lora-adapters` times requests through.
pub fn synthesize_adapter(shape: &LlamaShape, rank: usize, seed: u64) -> LoraAdapter {
    use ferry_model::lora::{LoraDelta, LoraFormat, LoraLayer, Module};
    let modules: &[Module] = if shape.family.fused {
        &[Module::Qkv, Module::O, Module::GateUp, Module::Down]
    } else {
        &[Module::Q, Module::K, Module::V, Module::O, Module::Gate, Module::Up, Module::Down]
    };
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut values = |n: usize, bound: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                let u = (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u32 << 24) as f32;
                (2.0 * u - 1.0) * bound
            })
            .collect()
    };
    let layers = (0..shape.num_layers)
        .map(|_| {
            let mut layer = LoraLayer::default();
            for &module in modules {
                let (product, col, inputs, outputs) = module.place(shape);
                let a = values(rank * inputs, (3.0 / inputs as f32).sqrt());
                let bt = values(rank * outputs, 0.02);
                let delta = LoraDelta {
                    module,
                    col,
                    in_features: inputs,
                    out_features: outputs,
                    a,
                    bt,
                    scale: 2.0,
                };
                layer.push(product, delta);
            }
            layer
        })
        .collect();
    let path = format!("synthetic-{seed}").into();
    LoraAdapter { id: LoraAdapter::next_id(), path, format: LoraFormat::Peft, layers }
}
