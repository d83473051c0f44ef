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
    #[error("unsupported architecture {0:?} (general.architecture; Ferry serves llama)")]
    Architecture(String),
    /// A metadata key asks for something the forward does not do: served anyway, the model
    /// would answer wrongly.
    #[error("GGUF metadata {key} = {value}: {reason}")]
    Unsupported {
        /// The key.
        key: String,
        /// Its value.
        value: String,
        /// What Ferry does not do.
        reason: String,
    },
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
    /// Linear rotary scaling: every frequency times this (`1 / llama.rope.scaling.factor`;
    /// 1 without scaling).
    pub rope_scale: f32,
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

/// The `llama.*` keys the forward reads or that change nothing it computes.
const UNDERSTOOD: &[&str] = &[
    "llama.block_count",
    "llama.context_length",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.vocab_size",
    "llama.rope.freq_base",
    // Checked below: equal to the head size, or no expert.
    "llama.rope.dimension_count",
    "llama.attention.key_length",
    "llama.attention.value_length",
    "llama.expert_count",
    "llama.expert_used_count",
    // Read by `rope_scale`.
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "llama.rope.scale_linear",
    // The length a scaled model was trained at before its extension: information only.
    "llama.rope.scaling.original_context_length",
    "llama.rope.scaling.finetuned",
];

fn unsupported(key: &str, value: &Value, reason: &str) -> ShapeError {
    ShapeError::Unsupported { key: key.into(), value: value.to_string(), reason: reason.into() }
}

/// Refuses any `llama.*` key Ferry does not understand, and understood keys with values the
/// forward does not compute (a rotary part of the head, a head size that is not width /
/// heads, experts): a file served without them answers wrongly, without an error.
fn check_understood(header: &GgufHeader, head_dim: usize) -> Result<(), ShapeError> {
    let mut keys: Vec<&String> = header.metadata.keys().collect();
    keys.sort();
    if let Some(key) =
        keys.into_iter().find(|k| k.starts_with("llama.") && !UNDERSTOOD.contains(&k.as_str()))
    {
        return Err(unsupported(key, &header.metadata[key], "a key Ferry does not know"));
    }
    for key in
        ["llama.rope.dimension_count", "llama.attention.key_length", "llama.attention.value_length"]
    {
        if let Some(v) = header.get(key) {
            if v.as_u32().map(|n| n as usize) != Some(head_dim) {
                let reason = format!("Ferry computes heads of width / heads = {head_dim}");
                return Err(unsupported(key, v, &reason));
            }
        }
    }
    for key in ["llama.expert_count", "llama.expert_used_count"] {
        if let Some(v) = header.get(key) {
            if v.as_u32() != Some(0) {
                return Err(unsupported(key, v, "mixture-of-experts models are not served"));
            }
        }
    }
    Ok(())
}

/// The linear rotary scale the file asks for (1: none); other scalings are refused.
fn rope_scale(header: &GgufHeader) -> Result<f32, ShapeError> {
    let factor = |key: &str| -> Result<Option<f32>, ShapeError> {
        let Some(v) = header.get(key) else { return Ok(None) };
        match v.as_f32() {
            Some(f) if f.is_finite() && f > 0.0 => Ok(Some(f)),
            _ => Err(unsupported(key, v, "expected a positive number")),
        }
    };
    let key = "llama.rope.scaling.type";
    let factor = match header.get(key) {
        None => factor("llama.rope.scale_linear")?,
        Some(v) => match v.as_str().ok_or_else(|| wrong_type(key, "a string", v))? {
            "none" => factor("llama.rope.scale_linear")?,
            "linear" => factor("llama.rope.scaling.factor")?,
            _ => {
                let reason = "Ferry rotates without scaling or with linear scaling";
                return Err(unsupported(key, v, reason));
            }
        },
    };
    Ok(factor.map_or(1.0, |f| 1.0 / f))
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
        let head_dim = hidden.checked_div(num_heads).unwrap_or(0);
        check_understood(header, head_dim)?;
        let shape = Self {
            num_layers: u("llama.block_count")?,
            hidden,
            intermediate: u("llama.feed_forward_length")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rope_theta,
            rope_scale: rope_scale(header)?,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::tests::Builder;

    /// SmolLM2-135M's keys (a head of 64).
    fn smollm() -> Builder {
        Builder::new()
            .string("general.architecture", "llama")
            .u32("llama.block_count", 30)
            .u32("llama.context_length", 8192)
            .u32("llama.embedding_length", 576)
            .u32("llama.feed_forward_length", 1536)
            .u32("llama.attention.head_count", 9)
            .u32("llama.attention.head_count_kv", 3)
            .f32("llama.rope.freq_base", 100_000.0)
            .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
            .u32("llama.vocab_size", 49152)
            .u32("llama.rope.dimension_count", 64)
    }

    fn shape(b: Builder) -> Result<LlamaShape, ShapeError> {
        let bytes = b.build();
        let header = GgufHeader::read(&mut std::io::Cursor::new(&bytes), bytes.len() as u64)
            .expect("a readable header");
        LlamaShape::from_gguf(&header)
    }

    #[test]
    fn the_default_models_keys_give_its_shape_unscaled() {
        let s = shape(smollm()).unwrap();
        assert_eq!((s.num_layers, s.hidden, s.head_dim, s.kv_dim()), (30, 576, 64, 192));
        assert_eq!((s.rope_theta, s.rope_scale), (100_000.0, 1.0));
    }

    #[test]
    fn linear_rope_scaling_divides_the_frequencies_by_its_factor() {
        let b = smollm().string("llama.rope.scaling.type", "linear");
        let s = shape(b.f32("llama.rope.scaling.factor", 4.0)).unwrap();
        assert_eq!(s.rope_scale, 0.25);
        let s = shape(smollm().f32("llama.rope.scale_linear", 2.0)).unwrap();
        assert_eq!(s.rope_scale, 0.5);
        let none = smollm().string("llama.rope.scaling.type", "none");
        assert_eq!(shape(none).unwrap().rope_scale, 1.0);
    }

    /// Each key that would change what the model computes, and that Ferry does not compute, is
    /// refused naming the key: never served wrongly.
    #[test]
    fn what_the_forward_does_not_compute_is_refused_naming_the_key() {
        let cases = [
            (smollm().string("llama.rope.scaling.type", "yarn"), "llama.rope.scaling.type"),
            (smollm().u32("llama.rope.dimension_count_x", 1), "llama.rope.dimension_count_x"),
            (
                smollm().u32("llama.attention.sliding_window", 4096),
                "llama.attention.sliding_window",
            ),
            (smollm().u32("llama.expert_count", 8), "llama.expert_count"),
            (smollm().u32("llama.attention.key_length", 128), "llama.attention.key_length"),
            (smollm().f32("llama.rope.scaling.factor_x", 8.0), "llama.rope.scaling.factor_x"),
        ];
        for (b, key) in cases {
            let err = shape(b).unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
        // A head size equal to width / heads, said explicitly, is fine; no experts too.
        let b = smollm().u32("llama.attention.key_length", 64).u32("llama.expert_count", 0);
        assert!(shape(b).is_ok());
        let qwen = smollm().string("general.architecture", "qwen9");
        let err = shape(qwen).unwrap_err().to_string();
        assert!(err.contains("\"qwen9\"") && err.contains("general.architecture"), "{err}");
    }
}
