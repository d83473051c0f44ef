//! The Llama architecture's dimensions as a GGUF file's `llama.*` metadata states them: what
//! the executor sizes its weights and KV cache by, and what the front needs for the model's
//! maximum length.

use crate::gguf::{GgufHeader, Value};

/// Why a model's shape could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ShapeError {
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
    /// The dimensions contradict each other.
    #[error("inconsistent model shape: {0}")]
    Inconsistent(String),
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

/// `key`'s value, or a `Metadata` error saying it is missing.
pub(crate) fn required<'a>(header: &'a GgufHeader, key: &str) -> Result<&'a Value, ShapeError> {
    header
        .get(key)
        .ok_or_else(|| ShapeError::Metadata { key: key.into(), reason: "missing".into() })
}

fn wrong_type(key: &str, want: &str, got: &Value) -> ShapeError {
    ShapeError::Metadata {
        key: key.into(),
        reason: format!("expected {want}, found {}", got.type_name()),
    }
}

impl LlamaShape {
    /// Reads the shape from `llama.*` metadata.
    pub fn from_gguf(header: &GgufHeader) -> Result<Self, ShapeError> {
        let arch_value = required(header, "general.architecture")?;
        let arch = arch_value
            .as_str()
            .ok_or_else(|| wrong_type("general.architecture", "a string", arch_value))?;
        if arch != "llama" {
            return Err(ShapeError::Architecture(arch.to_string()));
        }
        let count = |v: &Value, key: &str| {
            v.as_u32().map(|n| n as usize).ok_or_else(|| wrong_type(key, "a 32-bit count", v))
        };
        let u = |key: &str| count(required(header, key)?, key);
        let optional_u = |key: &str| header.get(key).map(|v| count(v, key)).transpose();
        let float = |v: &Value, key: &str| v.as_f32().ok_or_else(|| wrong_type(key, "a number", v));
        let hidden = u("llama.embedding_length")?;
        let num_heads = u("llama.attention.head_count")?;
        let num_kv_heads = optional_u("llama.attention.head_count_kv")?.unwrap_or(num_heads);
        let vocab_size = if let Some(n) = optional_u("llama.vocab_size")? {
            n
        } else {
            let key = "tokenizer.ggml.tokens";
            let tokens = required(header, key)?;
            tokens.as_array().ok_or_else(|| wrong_type(key, "an array", tokens))?.len()
        };
        let rope_theta = match header.get("llama.rope.freq_base") {
            Some(v) => float(v, "llama.rope.freq_base")?,
            None => 10_000.0,
        };
        let eps_key = "llama.attention.layer_norm_rms_epsilon";
        let shape = Self {
            num_layers: u("llama.block_count")?,
            hidden,
            intermediate: u("llama.feed_forward_length")?,
            num_heads,
            num_kv_heads,
            head_dim: hidden.checked_div(num_heads).unwrap_or(0),
            vocab_size,
            rope_theta,
            rms_eps: float(required(header, eps_key)?, eps_key)?,
            max_model_len: u("llama.context_length")?,
        };
        if num_heads == 0
            || num_kv_heads == 0
            || hidden % num_heads != 0
            || num_heads % num_kv_heads != 0
        {
            return Err(ShapeError::Inconsistent(format!("{shape:?}")));
        }
        Ok(shape)
    }

    /// Width of the K (or V) projection: `kv_heads` × `head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}
