//! The weights of a Llama-family model (llama, qwen2, qwen3, phi3, gemma2, gemma3:
//! `ferry_model::Family`) as a GGUF
//! file holds them, loaded once into the layout the forward passes use (the shape comes from
//! `ferry-model`, which reads the header).
//!
//! GGUF stores Llama's Q and K projections permuted for llama.cpp's rotary embedding, which
//! rotates *adjacent* pairs (x[2i], x[2i+1]); Qwen's keep Hugging Face's layout, rotated in
//! halves. The forwards rotate as the family's `RopeStyle` says.

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};
pub use ferry_model::LlamaShape;

use crate::kernels::{KernelError, QWeight, Stacked};

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A tensor's shape differs from what the model's shape implies.
    #[error("inconsistent model shape: {0}")]
    Shape(String),
    /// Reading or converting a tensor failed.
    #[error("tensor {name}: {source}")]
    Tensor {
        /// The tensor.
        name: String,
        /// The cause.
        #[source]
        source: candle_core::Error,
    },
    /// A weight has no quantized kernel.
    #[error("tensor {name}: {source}")]
    Kernel {
        /// The tensor.
        name: String,
        /// The cause.
        #[source]
        source: KernelError,
    },
    /// The file has a tensor the forward would not use: a model served without it answers
    /// wrongly (a bias, a norm, another architecture's part).
    #[error("tensor {name} is not part of the {arch} forward Ferry computes")]
    Unexpected {
        /// The tensor.
        name: String,
        /// The file's architecture.
        arch: &'static str,
    },
    /// Reading the file failed.
    #[error("reading the model: {0}")]
    Io(#[from] std::io::Error),
}

/// Gemma's norms of a block's attention and feed-forward outputs.
const POST_NORMS: [&str; 2] = ["post_attention_norm.weight", "post_ffw_norm.weight"];

/// The tensors of a model of `shape`, with the optional ones the file has.
fn expected_tensors(shape: &LlamaShape) -> impl Fn(&str) -> bool {
    const BIASES: [&str; 3] = ["attn_q.bias", "attn_k.bias", "attn_v.bias"];
    const QK_NORMS: [&str; 2] = ["attn_q_norm.weight", "attn_k_norm.weight"];
    const GLOBAL: [&str; 4] =
        ["token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"];
    const PER_LAYER: [&str; 9] = [
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    ];
    // Phi-3's: Q, K and V in one matrix, gate and up in another.
    const FUSED: [&str; 6] = [
        "attn_norm.weight",
        "attn_qkv.weight",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    ];
    const LONGROPE: [&str; 2] = ["rope_factors_long.weight", "rope_factors_short.weight"];
    let f = shape.family;
    let (layers, biases, norms, post) = (shape.num_layers, f.qkv_bias, f.qk_norm, f.post_norms);
    let longrope = f.longrope;
    let per_layer: &[&str] = if f.fused { &FUSED } else { &PER_LAYER };
    move |name: &str| {
        GLOBAL.contains(&name)
            || longrope && LONGROPE.contains(&name)
            || name.strip_prefix("blk.").and_then(|rest| rest.split_once('.')).is_some_and(
                |(i, part)| {
                    i.parse::<usize>().is_ok_and(|i| i < layers)
                        && (per_layer.contains(&part)
                            || biases && BIASES.contains(&part)
                            || norms && QK_NORMS.contains(&part)
                            || post && POST_NORMS.contains(&part))
                },
            )
    }
}

/// Block `p`'s parts of the stacked Q, K, V and gate, up matrices, as the file holds them
/// (each part, or the family's fused matrices), read by `matrix(name, dims)`.
#[allow(clippy::type_complexity)]
fn stacked_parts(
    shape: &LlamaShape,
    p: &str,
    matrix: &mut impl FnMut(String, &[usize]) -> Result<QWeight, LoadError>,
) -> Result<(Vec<QWeight>, Vec<QWeight>), LoadError> {
    let (h, q, kv, ff) = (shape.hidden, shape.q_dim(), shape.kv_dim(), shape.intermediate);
    Ok(if shape.family.fused {
        (
            vec![matrix(format!("{p}.attn_qkv.weight"), &[q + 2 * kv, h])?],
            vec![matrix(format!("{p}.ffn_up.weight"), &[2 * ff, h])?],
        )
    } else {
        (
            vec![
                matrix(format!("{p}.attn_q.weight"), &[q, h])?,
                matrix(format!("{p}.attn_k.weight"), &[kv, h])?,
                matrix(format!("{p}.attn_v.weight"), &[kv, h])?,
            ],
            vec![
                matrix(format!("{p}.ffn_gate.weight"), &[ff, h])?,
                matrix(format!("{p}.ffn_up.weight"), &[ff, h])?,
            ],
        )
    })
}

/// The rotary frequencies of `shape`'s model, one per rotated pair: scaled by a factor per
/// pair that divides its frequency where the file has one — Llama 3's (llama.cpp's
/// `rope_freqs`, from `rope_scaling` "llama3") or `LongRoPE`'s long or short table (Phi-3), in
/// llama.cpp's order of preference — read by `vector(name, len)`.
fn rope_frequencies(
    shape: &LlamaShape,
    content: &gguf_file::Content,
    vector: &mut impl FnMut(&str, usize) -> Result<Vec<f32>, LoadError>,
) -> Result<Vec<f32>, LoadError> {
    let mut freqs =
        super::ops::rope_frequencies(shape.rope_dims, shape.rope_theta, shape.rope_scale);
    let longrope =
        if shape.rope_long { "rope_factors_long.weight" } else { "rope_factors_short.weight" };
    let has = |name: &&str| content.tensor_infos.contains_key(*name);
    if let Some(name) = ["rope_freqs.weight", longrope].into_iter().find(has) {
        let factors = vector(name, freqs.len())?;
        for (f, factor) in freqs.iter_mut().zip(factors) {
            *f /= factor;
        }
    }
    Ok(freqs)
}

/// One transformer block's weights. Matrices are `[out, in]` in their GGUF quantization.
#[derive(Debug)]
pub struct LayerWeights {
    /// RMS norm before attention.
    pub attn_norm: Vec<f32>,
    /// Query, key and value projections stacked: `[q_dim + 2·kv_dim, hidden]`.
    pub wqkv: Stacked,
    /// Their biases, `[q_dim + 2·kv_dim]`, where the family has them (Qwen 2).
    pub qkv_bias: Option<Vec<f32>>,
    /// The RMS norm weights of every query head and of every key head, `[head_dim]` each,
    /// where the family norms them (Qwen 3).
    pub qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// The RMS norms of the attention's and the feed-forward's outputs before each joins the
    /// residual stream, `[hidden]` each, where the family has them (Gemma).
    pub post_norms: Option<(Vec<f32>, Vec<f32>)>,
    /// Output projection `[hidden, q_dim]`.
    pub wo: QWeight,
    /// RMS norm before the feed-forward.
    pub ffn_norm: Vec<f32>,
    /// Gate and up projections stacked: `[2·intermediate, hidden]`.
    pub w_gate_up: Stacked,
    /// Down projection `[hidden, intermediate]`.
    pub w_down: QWeight,
}

/// One of a block's two outputs, before it joins the residual stream.
#[derive(Clone, Copy, Debug)]
pub enum BlockOutput {
    /// The attention's output projection.
    Attention,
    /// The feed-forward's down projection.
    FeedForward,
}

impl LayerWeights {
    /// RMS-norms rows of `output` in place by the block's norm of that output, where the
    /// family has one (Gemma's `post_attention_norm`, `post_ffw_norm`).
    pub fn post_norm(&self, which: BlockOutput, output: &mut [f32], eps: f32) {
        if let Some((attention, feed_forward)) = &self.post_norms {
            let weight = match which {
                BlockOutput::Attention => attention,
                BlockOutput::FeedForward => feed_forward,
            };
            super::ops::rms_norm(output, weight, eps);
        }
    }

    /// One fused `[q | k | v]` row made ready for attention as the family says: its bias
    /// added, each query and key head RMS-normed, then rotated by the row's `angles`.
    pub fn prepare_qkv(&self, row: &mut [f32], shape: &LlamaShape, angles: &[(f32, f32)]) {
        use super::ops::{add_bias, rms_norm_row, rope_rotate};
        add_bias(row, self.qkv_bias.as_deref());
        let (q, kv, hd) = (shape.q_dim(), shape.kv_dim(), shape.head_dim);
        if let Some((q_norm, k_norm)) = &self.qk_norm {
            let (qs, ks) = row[..q + kv].split_at_mut(q);
            qs.chunks_exact_mut(hd).for_each(|head| rms_norm_row(head, q_norm, shape.rms_eps));
            ks.chunks_exact_mut(hd).for_each(|head| rms_norm_row(head, k_norm, shape.rms_eps));
        }
        for head in row[..q + kv].chunks_exact_mut(hd) {
            rope_rotate(head, angles, shape.family.rope);
        }
    }
}

/// All weights of a Llama model.
#[derive(Debug)]
pub struct LlamaWeights {
    /// The shape.
    pub shape: LlamaShape,
    /// Token embeddings `[vocab, hidden]`.
    pub embed: QWeight,
    /// The blocks.
    pub layers: Vec<LayerWeights>,
    /// Final RMS norm.
    pub norm: Vec<f32>,
    /// Output head `[vocab, hidden]` (the embeddings when tied).
    pub lm_head: QWeight,
    /// Rotary frequencies, one per pair of a head's dimensions.
    pub rope_freqs: Vec<f32>,
    /// The windowed layers' own rotary frequencies, where the family has them (Gemma 3).
    pub local_rope_freqs: Option<Vec<f32>>,
}

impl LlamaWeights {
    /// Token `t`'s embedding into `row`, scaled by √width where the family scales it (Gemma;
    /// one f32 product per element, as llama.cpp's `ggml_scale` and Hugging Face's f32
    /// `normalizer`).
    pub fn embed_row(&self, t: usize, row: &mut [f32]) {
        self.embed.dequantize_row(t, row);
        if self.shape.family.embed_scale {
            let scale = (self.shape.hidden as f32).sqrt();
            for v in row.iter_mut() {
                *v *= scale;
            }
        }
    }

    /// Whether layer `l` rotates by [`Self::local_rope_freqs`] (Gemma 3's windowed layers).
    pub fn local_rope(&self, l: usize) -> bool {
        self.local_rope_freqs.is_some() && self.shape.local_rope(l)
    }

    /// The rotary frequencies of layer `l`.
    pub fn layer_rope_freqs(&self, l: usize) -> &[f32] {
        match &self.local_rope_freqs {
            Some(local) if self.local_rope(l) => local,
            _ => &self.rope_freqs,
        }
    }

    /// Logits as the model gives them: soft-capped where it caps them (Gemma 2:
    /// `c · tanh(x / c)`, in Hugging Face's order).
    pub fn finish_logits(&self, logits: &mut [f32]) {
        if let Some(c) = self.shape.final_softcap {
            for v in logits.iter_mut() {
                *v = (*v / c).tanh() * c;
            }
        }
    }
}

impl LlamaWeights {
    /// Loads every tensor of `content` from `reader` for a model of `shape`: matrices keep
    /// their quantized blocks, norm weights become f32.
    pub fn load<R: std::io::Read + std::io::Seek>(
        shape: LlamaShape,
        content: &gguf_file::Content,
        reader: &mut R,
    ) -> Result<Self, LoadError> {
        let device = Device::Cpu;
        let expected = expected_tensors(&shape);
        let mut names: Vec<&String> = content.tensor_infos.keys().collect();
        names.sort();
        if let Some(name) = names.into_iter().find(|n| !expected(n)) {
            return Err(LoadError::Unexpected { name: name.clone(), arch: shape.family.name });
        }
        let mut read = |name: &str, dims: &[usize]| {
            let t = content
                .tensor(reader, name, &device)
                .map_err(|source| LoadError::Tensor { name: name.to_string(), source })?;
            if t.shape().dims() != dims {
                return Err(LoadError::Shape(format!(
                    "{name} is {:?}, expected {dims:?}",
                    t.shape().dims()
                )));
            }
            Ok(t)
        };
        let mut matrix = |name: String, dims: &[usize]| -> Result<QWeight, LoadError> {
            let t = read(&name, dims)?;
            QWeight::from_qtensor(&t).map_err(|source| LoadError::Kernel { name, source })
        };
        let (h, q, kv, ff) = (shape.hidden, shape.q_dim(), shape.kv_dim(), shape.intermediate);
        let mut layers = Vec::with_capacity(shape.num_layers);
        let mut prefixes = Vec::with_capacity(shape.num_layers);
        for i in 0..shape.num_layers {
            let p = format!("blk.{i}");
            let (qkv, gate_up) = stacked_parts(&shape, &p, &mut matrix)?;
            let wo = matrix(format!("{p}.attn_output.weight"), &[h, q])?;
            layers.push((qkv, wo, gate_up, matrix(format!("{p}.ffn_down.weight"), &[h, ff])?));
            prefixes.push(p);
        }
        let embed = matrix("token_embd.weight".into(), &[shape.vocab_size, h])?;
        let lm_head = if content.tensor_infos.contains_key("output.weight") {
            matrix("output.weight".into(), &[shape.vocab_size, h])?
        } else {
            embed.clone()
        };
        let mut vector = |name: &str, len: usize| -> Result<Vec<f32>, LoadError> {
            let wrap = |source| LoadError::Tensor { name: name.to_string(), source };
            read(name, &[len])?
                .dequantize(&device)
                .and_then(|t| t.to_dtype(DType::F32))
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(wrap)
        };
        let norm = vector("output_norm.weight", h)?;
        let rope_freqs = rope_frequencies(&shape, content, &mut vector)?;
        let layers = layers
            .into_iter()
            .zip(prefixes)
            .map(|((qkv, wo, gate_up, w_down), p)| {
                let stack = |parts: &[QWeight], what: &str| {
                    Stacked::new(&parts.iter().collect::<Vec<_>>())
                        .ok_or_else(|| LoadError::Shape(format!("{p}: {what} differ in width")))
                };
                let mut vector = |part: &str, len| vector(&format!("{p}.{part}"), len);
                let qkv_bias = if shape.family.qkv_bias {
                    let mut bias = vector("attn_q.bias", q)?;
                    bias.extend(vector("attn_k.bias", kv)?);
                    bias.extend(vector("attn_v.bias", kv)?);
                    Some(bias)
                } else {
                    None
                };
                // Two norm weights where the family has them.
                let mut pair = |on: bool, a: &str, b: &str, len| -> Result<_, LoadError> {
                    Ok(if on { Some((vector(a, len)?, vector(b, len)?)) } else { None })
                };
                let f = shape.family;
                let (qk, post) = (["attn_q_norm.weight", "attn_k_norm.weight"], POST_NORMS);
                let qk_norm = pair(f.qk_norm, qk[0], qk[1], shape.head_dim)?;
                let post_norms = pair(f.post_norms, post[0], post[1], h)?;
                Ok(LayerWeights {
                    attn_norm: vector("attn_norm.weight", h)?,
                    post_norms,
                    wqkv: stack(&qkv, "Q, K and V")?,
                    qkv_bias,
                    qk_norm,
                    wo,
                    ffn_norm: vector("ffn_norm.weight", h)?,
                    w_gate_up: stack(&gate_up, "gate and up")?,
                    w_down,
                })
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        // Gemma 3's windowed layers: their own base, unscaled (llama.cpp's
        // `rope_freq_base_train_swa`, `rope_freq_scale_train_swa`).
        let local_rope_freqs = shape
            .family
            .window_rope_base
            .map(|base| super::ops::rope_frequencies(shape.rope_dims, base, 1.0));
        Ok(Self { shape, embed, layers, norm, lm_head, rope_freqs, local_rope_freqs })
    }
}
