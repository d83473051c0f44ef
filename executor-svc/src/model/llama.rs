//! The Llama architecture as a GGUF file describes it: its shape from the `llama.*` metadata
//! and its weights, dequantized once at load into the layout the forward passes use.
//!
//! GGUF stores Q and K projections permuted for llama.cpp's rotary embedding, which rotates
//! *adjacent* pairs (x[2i], x[2i+1]); the forwards here use that convention too.

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};

use crate::kernels::{KernelError, QWeight};

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A metadata key is missing or has the wrong type.
    #[error("GGUF metadata {key}: {reason}")]
    Metadata {
        /// The key.
        key: String,
        /// What was wrong.
        reason: String,
    },
    /// Not a Llama model.
    #[error("unsupported architecture {0:?} (only llama is supported)")]
    Architecture(String),
    /// The shape is inconsistent.
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
    /// Reading the file failed.
    #[error("reading the model: {0}")]
    Io(#[from] std::io::Error),
}

/// The dimensions of a Llama model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaShape {
    /// Transformer blocks.
    pub num_layers: usize,
    /// Residual width.
    pub hidden: usize,
    /// Feed-forward width.
    pub intermediate: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention).
    pub num_kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Rotary embedding base.
    pub rope_theta: f32,
    /// RMS norm epsilon.
    pub rms_eps: f32,
    /// Longest context the model was trained for.
    pub max_model_len: usize,
}

impl LlamaShape {
    /// Reads the shape from `llama.*` metadata.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self, LoadError> {
        let md = &content.metadata;
        let get = |key: &str| {
            md.get(key)
                .ok_or_else(|| LoadError::Metadata { key: key.into(), reason: "missing".into() })
        };
        let wrap = |key: &str| {
            let key = key.to_string();
            move |e: candle_core::Error| LoadError::Metadata {
                key: key.clone(),
                reason: e.to_string(),
            }
        };
        let arch =
            get("general.architecture")?.to_string().map_err(wrap("general.architecture"))?;
        if arch != "llama" {
            return Err(LoadError::Architecture(arch.clone()));
        }
        let u = |key: &str| -> Result<usize, LoadError> {
            Ok(get(key)?.to_u32().map_err(wrap(key))? as usize)
        };
        let hidden = u("llama.embedding_length")?;
        let num_heads = u("llama.attention.head_count")?;
        let num_kv_heads = match md.get("llama.attention.head_count_kv") {
            Some(v) => v.to_u32().map_err(wrap("llama.attention.head_count_kv"))? as usize,
            None => num_heads,
        };
        let vocab_size = match md.get("llama.vocab_size") {
            Some(v) => v.to_u32().map_err(wrap("llama.vocab_size"))? as usize,
            None => {
                get("tokenizer.ggml.tokens")?.to_vec().map_err(wrap("tokenizer.ggml.tokens"))?.len()
            }
        };
        let rope_theta = match md.get("llama.rope.freq_base") {
            Some(v) => v.to_f32().map_err(wrap("llama.rope.freq_base"))?,
            None => 10_000.0,
        };
        let shape = Self {
            num_layers: u("llama.block_count")?,
            hidden,
            intermediate: u("llama.feed_forward_length")?,
            num_heads,
            num_kv_heads,
            head_dim: hidden.checked_div(num_heads).unwrap_or(0),
            vocab_size,
            rope_theta,
            rms_eps: get("llama.attention.layer_norm_rms_epsilon")?
                .to_f32()
                .map_err(wrap("llama.attention.layer_norm_rms_epsilon"))?,
            max_model_len: u("llama.context_length")?,
        };
        if num_heads == 0
            || num_kv_heads == 0
            || hidden % num_heads != 0
            || num_heads % num_kv_heads != 0
        {
            return Err(LoadError::Shape(format!("{shape:?}")));
        }
        Ok(shape)
    }

    /// Width of the K (or V) projection: kv_heads × head_dim.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// One transformer block's weights. Matrices are `[out, in]` in their GGUF quantization.
#[derive(Debug)]
pub struct LayerWeights {
    /// RMS norm before attention.
    pub attn_norm: Vec<f32>,
    /// Query, key and value projections stacked: `[hidden + 2·kv_dim, hidden]`.
    pub wqkv: QWeight,
    /// Output projection `[hidden, hidden]`.
    pub wo: QWeight,
    /// RMS norm before the feed-forward.
    pub ffn_norm: Vec<f32>,
    /// Gate and up projections stacked: `[2·intermediate, hidden]`.
    pub w_gate_up: QWeight,
    /// Down projection `[hidden, intermediate]`.
    pub w_down: QWeight,
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
}

impl LlamaWeights {
    /// Loads every tensor of `content` from `reader`: matrices keep their quantized blocks,
    /// norm weights become f32.
    pub fn load<R: std::io::Read + std::io::Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
    ) -> Result<Self, LoadError> {
        let shape = LlamaShape::from_gguf(content)?;
        let device = Device::Cpu;
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
        let (h, kv, ff) = (shape.hidden, shape.kv_dim(), shape.intermediate);
        let mut layers = Vec::with_capacity(shape.num_layers);
        let mut norms = Vec::new();
        for i in 0..shape.num_layers {
            let p = format!("blk.{i}");
            norms.push((format!("{p}.attn_norm.weight"), format!("{p}.ffn_norm.weight")));
            layers.push((
                matrix(format!("{p}.attn_q.weight"), &[h, h])?,
                matrix(format!("{p}.attn_k.weight"), &[kv, h])?,
                matrix(format!("{p}.attn_v.weight"), &[kv, h])?,
                matrix(format!("{p}.attn_output.weight"), &[h, h])?,
                matrix(format!("{p}.ffn_gate.weight"), &[ff, h])?,
                matrix(format!("{p}.ffn_up.weight"), &[ff, h])?,
                matrix(format!("{p}.ffn_down.weight"), &[h, ff])?,
            ));
        }
        let embed = matrix("token_embd.weight".into(), &[shape.vocab_size, h])?;
        let lm_head = if content.tensor_infos.contains_key("output.weight") {
            matrix("output.weight".into(), &[shape.vocab_size, h])?
        } else {
            embed.clone()
        };
        let mut vector = |name: &str| -> Result<Vec<f32>, LoadError> {
            let wrap = |source| LoadError::Tensor { name: name.to_string(), source };
            read(name, &[h])?
                .dequantize(&device)
                .and_then(|t| t.to_dtype(DType::F32))
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(wrap)
        };
        let norm = vector("output_norm.weight")?;
        let layers = layers
            .into_iter()
            .zip(norms)
            .map(|((wq, wk, wv, wo, w_gate, w_up, w_down), (an, fnn))| {
                let stack = |parts: &[&QWeight], what: &str| {
                    QWeight::concat(parts).ok_or_else(|| {
                        LoadError::Shape(format!("{an}: {what} differ in format or width"))
                    })
                };
                Ok(LayerWeights {
                    attn_norm: vector(&an)?,
                    wqkv: stack(&[&wq, &wk, &wv], "Q, K and V")?,
                    wo,
                    ffn_norm: vector(&fnn)?,
                    w_gate_up: stack(&[&w_gate, &w_up], "gate and up")?,
                    w_down,
                })
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        let rope_freqs = super::ops::rope_frequencies(shape.head_dim, shape.rope_theta);
        Ok(Self { shape, embed, layers, norm, lm_head, rope_freqs })
    }
}
