//! A model's dimensions as a GGUF file's `<architecture>.*` metadata states them: what the
//! executor sizes its weights and KV cache by, and what the front needs for the model's maximum
//! length. The architectures served differ from Llama only in data ([`Family`]): one forward
//! computes them all.

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
    /// An architecture Ferry does not serve.
    #[error("unsupported architecture {0:?} (general.architecture; Ferry serves {served})", served = served())]
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

/// How the rotary embedding pairs a head's dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pair `i` is (x\[2i\], x\[2i+1\]): llama.cpp's "normal" rotation. GGUF Llama files hold
    /// Q and K permuted for it (llama.cpp's converter).
    Adjacent,
    /// Pair `i` is (x\[i\], x\[i + d/2\]): llama.cpp's "NEOX" rotation, Hugging Face's
    /// `rotate_half`. Qwen 2 files keep Hugging Face's Q and K layout.
    Halves,
}

/// What an architecture's forward does differently from Llama's: data, read by every backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Family {
    /// `general.architecture`, and the prefix of its metadata keys.
    pub name: &'static str,
    /// Its rotary pairing.
    pub rope: RopeStyle,
    /// Whether Q, K and V projections add a bias (`attn_q.bias`, `attn_k.bias`, `attn_v.bias`).
    pub qkv_bias: bool,
    /// Whether each query and key head is RMS-normed before its rotation (`attn_q_norm`,
    /// `attn_k_norm`: one weight per head dimension, shared by the heads).
    pub qk_norm: bool,
    /// Whether the file holds Q, K and V as one matrix (`attn_qkv`) and gate and up as one
    /// (`ffn_up`, gate rows first): the stacked matrices the forward multiplies by anyway.
    pub fused: bool,
}

impl Family {
    /// Llama 1-3 and the models in its layout (SmolLM, Mistral without a sliding window).
    pub const LLAMA: Self = Self {
        name: "llama",
        rope: RopeStyle::Adjacent,
        qkv_bias: false,
        qk_norm: false,
        fused: false,
    };
    /// Qwen 2 and 2.5: Llama with biases on Q, K and V and the NEOX rotation.
    pub const QWEN2: Self =
        Self { name: "qwen2", rope: RopeStyle::Halves, qkv_bias: true, ..Self::LLAMA };
    /// Qwen 3 (dense): Llama with the NEOX rotation and each Q and K head RMS-normed first; its
    /// heads are usually not width / heads wide (`attention.key_length`).
    pub const QWEN3: Self =
        Self { name: "qwen3", rope: RopeStyle::Halves, qk_norm: true, ..Self::LLAMA };
    /// Phi-3 and 3.5 (mini, medium): Llama with the NEOX rotation, Q, K and V in one matrix and
    /// gate and up in another, usually a sliding window.
    pub const PHI3: Self =
        Self { name: "phi3", rope: RopeStyle::Halves, fused: true, ..Self::LLAMA };
    /// Every architecture served.
    pub const ALL: [Self; 4] = [Self::LLAMA, Self::QWEN2, Self::QWEN3, Self::PHI3];

    /// The family whose `general.architecture` is `name`.
    pub fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name == name)
    }
}

/// The architectures served, for messages: "llama, qwen2, qwen3".
pub fn served() -> String {
    Family::ALL.map(|f| f.name).join(", ")
}

/// The dimensions of a model of one of the [`Family`]s.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaShape {
    /// The architecture.
    pub family: Family,
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
    /// Size of one head: `attention.key_length`, or width / heads.
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
    /// Mistral-style sliding window (`attention.sliding_window`): each token attends to the
    /// last this many positions, itself included (Hugging Face's `q - k < window`, llama.cpp's
    /// standard window); `None` attends to every earlier position.
    pub sliding_window: Option<usize>,
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

/// The `<architecture>.*` keys the forward reads or that change nothing it computes (after
/// the prefix).
const UNDERSTOOD: &[&str] = &[
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "vocab_size",
    "rope.freq_base",
    // Checked below: equal to the head size, or no expert.
    "rope.dimension_count",
    "attention.key_length",
    "attention.value_length",
    "expert_count",
    "expert_used_count",
    // Read by `rope_scale`.
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scale_linear",
    // The length a scaled model was trained at before its extension: information only.
    "rope.scaling.original_context_length",
    "rope.scaling.finetuned",
    // Read into `sliding_window`.
    "attention.sliding_window",
];

fn unsupported(key: &str, value: &Value, reason: &str) -> ShapeError {
    ShapeError::Unsupported { key: key.into(), value: value.to_string(), reason: reason.into() }
}

/// Refuses any `<architecture>.*` key Ferry does not understand, and understood keys with
/// values the forward does not compute (a rotary part of the head, values of another size than
/// keys, experts): a file served without them answers wrongly, without an error.
fn check_understood(header: &GgufHeader, arch: &str, head_dim: usize) -> Result<(), ShapeError> {
    let mut keys: Vec<&String> = header.metadata.keys().collect();
    keys.sort();
    let prefix = format!("{arch}.");
    let unknown =
        |k: &&String| k.strip_prefix(&prefix).is_some_and(|rest| !UNDERSTOOD.contains(&rest));
    if let Some(key) = keys.into_iter().find(unknown) {
        return Err(unsupported(key, &header.metadata[key], "a key Ferry does not know"));
    }
    for key in ["rope.dimension_count", "attention.value_length"] {
        let key = format!("{prefix}{key}");
        if let Some(v) = header.get(&key) {
            if v.as_u32().map(|n| n as usize) != Some(head_dim) {
                let reason = format!("Ferry rotates and attends whole heads of {head_dim}");
                return Err(unsupported(&key, v, &reason));
            }
        }
    }
    for key in ["expert_count", "expert_used_count"] {
        let key = format!("{prefix}{key}");
        if let Some(v) = header.get(&key) {
            if v.as_u32() != Some(0) {
                return Err(unsupported(&key, v, "mixture-of-experts models are not served"));
            }
        }
    }
    Ok(())
}

/// The linear rotary scale the file asks for (1: none); other scalings are refused.
fn rope_scale(header: &GgufHeader, arch: &str) -> Result<f32, ShapeError> {
    let factor = |key: &str| -> Result<Option<f32>, ShapeError> {
        let key = format!("{arch}.{key}");
        let Some(v) = header.get(&key) else { return Ok(None) };
        match v.as_f32() {
            Some(f) if f.is_finite() && f > 0.0 => Ok(Some(f)),
            _ => Err(unsupported(&key, v, "expected a positive number")),
        }
    };
    let key = format!("{arch}.rope.scaling.type");
    let factor = match header.get(&key) {
        None => factor("rope.scale_linear")?,
        Some(v) => match v.as_str().ok_or_else(|| wrong_type(&key, "a string", v))? {
            "none" => factor("rope.scale_linear")?,
            "linear" => factor("rope.scaling.factor")?,
            _ => {
                let reason = "Ferry rotates without scaling or with linear scaling";
                return Err(unsupported(&key, v, reason));
            }
        },
    };
    Ok(factor.map_or(1.0, |f| 1.0 / f))
}

impl LlamaShape {
    /// Reads the shape from `general.architecture` and that architecture's metadata.
    pub fn from_gguf(header: &GgufHeader) -> Result<Self, ShapeError> {
        let arch_value = required(header, "general.architecture")?;
        let arch = arch_value
            .as_str()
            .ok_or_else(|| wrong_type("general.architecture", "a string", arch_value))?;
        let family = Family::named(arch).ok_or_else(|| ShapeError::Architecture(arch.into()))?;
        let key = |k: &str| format!("{arch}.{k}");
        let count = |v: &Value, key: &str| {
            v.as_u32().map(|n| n as usize).ok_or_else(|| wrong_type(key, "a 32-bit count", v))
        };
        let u = |k: &str| {
            let k = key(k);
            count(required(header, &k)?, &k)
        };
        let optional_u = |k: &str| {
            let k = key(k);
            header.get(&k).map(|v| count(v, &k)).transpose()
        };
        let float = |v: &Value, key: &str| v.as_f32().ok_or_else(|| wrong_type(key, "a number", v));
        let hidden = u("embedding_length")?;
        let num_heads = u("attention.head_count")?;
        let num_kv_heads = optional_u("attention.head_count_kv")?.unwrap_or(num_heads);
        let vocab_size = if let Some(n) = optional_u("vocab_size")? {
            n
        } else {
            let key = "tokenizer.ggml.tokens";
            let tokens = required(header, key)?;
            tokens.as_array().ok_or_else(|| wrong_type(key, "an array", tokens))?.len()
        };
        let theta_key = key("rope.freq_base");
        let rope_theta = match header.get(&theta_key) {
            Some(v) => float(v, &theta_key)?,
            None => 10_000.0,
        };
        let eps_key = key("attention.layer_norm_rms_epsilon");
        // Without a key length, heads are width / heads wide, which must divide.
        let head_dim = match optional_u("attention.key_length")? {
            Some(n) => n,
            None if num_heads > 0 && hidden % num_heads == 0 => hidden / num_heads,
            None => {
                return Err(ShapeError::Inconsistent(format!(
                    "width {hidden} is not a multiple of {num_heads} heads, and no {} gives \
                     the head size",
                    key("attention.key_length")
                )))
            }
        };
        check_understood(header, arch, head_dim)?;
        let shape = Self {
            family,
            num_layers: u("block_count")?,
            hidden,
            intermediate: u("feed_forward_length")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rope_theta,
            rope_scale: rope_scale(header, arch)?,
            rms_eps: float(required(header, &eps_key)?, &eps_key)?,
            max_model_len: u("context_length")?,
            // 0: no window, as llama.cpp reads it.
            sliding_window: optional_u("attention.sliding_window")?.filter(|&w| w > 0),
        };
        if num_heads == 0
            || num_kv_heads == 0
            || head_dim == 0
            || head_dim % 2 != 0
            || num_heads % num_kv_heads != 0
        {
            return Err(ShapeError::Inconsistent(format!("{shape:?}")));
        }
        Ok(shape)
    }

    /// Positions a token attends to at most (`usize::MAX` without a sliding window).
    pub fn window(&self) -> usize {
        self.sliding_window.unwrap_or(usize::MAX)
    }

    /// Width of the K (or V) projection: `kv_heads` × `head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Width of the Q projection and of the attention's output: `heads` × `head_dim` (the
    /// residual width, but in families whose heads are not width / heads wide).
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::tests::Builder;

    /// SmolLM2-135M's keys (a head of 64).
    fn smollm() -> Builder {
        smollm_as("llama")
    }

    /// SmolLM2-135M's dimensions as architecture `arch` states them.
    fn smollm_as(arch: &str) -> Builder {
        let key = |k: &str| format!("{arch}.{k}");
        Builder::new()
            .string("general.architecture", arch)
            .u32(&key("block_count"), 30)
            .u32(&key("context_length"), 8192)
            .u32(&key("embedding_length"), 576)
            .u32(&key("feed_forward_length"), 1536)
            .u32(&key("attention.head_count"), 9)
            .u32(&key("attention.head_count_kv"), 3)
            .f32(&key("rope.freq_base"), 100_000.0)
            .f32(&key("attention.layer_norm_rms_epsilon"), 1e-5)
            .u32(&key("vocab_size"), 49152)
            .u32(&key("rope.dimension_count"), 64)
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
        assert_eq!(s.family, Family::LLAMA);
    }

    /// Another family's file is read from its own prefix, and gets its family's forward;
    /// another family's keys in it are not understood.
    #[test]
    fn a_qwen2_file_is_read_from_its_keys_and_rotates_halves_with_biases() {
        let s = shape(smollm_as("qwen2")).unwrap();
        assert_eq!((s.num_layers, s.hidden, s.head_dim, s.kv_dim()), (30, 576, 64, 192));
        assert_eq!((s.family.rope, s.family.qkv_bias), (RopeStyle::Halves, true));
        // A sliding window where the metadata asks for one (0: none, as llama.cpp reads it);
        // Gemma's alternating windows are not understood.
        let s = shape(smollm_as("qwen2").u32("qwen2.attention.sliding_window", 4096)).unwrap();
        assert_eq!((s.sliding_window, s.window()), (Some(4096), 4096));
        let s = shape(smollm_as("qwen2").u32("qwen2.attention.sliding_window", 0)).unwrap();
        assert_eq!((s.sliding_window, s.window()), (None, usize::MAX));
        let err = shape(smollm_as("qwen2").u32("qwen2.attention.sliding_window_pattern", 6));
        assert!(err.unwrap_err().to_string().contains("qwen2.attention.sliding_window_pattern"));
        let b = smollm_as("qwen2").string("qwen2.rope.scaling.type", "yarn");
        assert!(shape(b).unwrap_err().to_string().contains("qwen2.rope.scaling.type"));
        // Qwen 3: heads wider than width / heads, as its key length says.
        let b = smollm_as("qwen3").u32("qwen3.attention.key_length", 128);
        let s = shape(
            b.u32("qwen3.attention.value_length", 128).u32("qwen3.rope.dimension_count", 128),
        );
        let s = s.unwrap();
        assert_eq!((s.head_dim, s.q_dim(), s.kv_dim(), s.hidden), (128, 1152, 384, 576));
        assert!(s.family.qk_norm && !s.family.qkv_bias);
        let err = shape(smollm_as("llama").string("general.architecture", "qwen2")).unwrap_err();
        let err = err.to_string();
        assert!(err.contains("qwen2.embedding_length") && err.contains("missing"), "{err}");
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
                smollm().u32("llama.attention.sliding_window_pattern", 6),
                "llama.attention.sliding_window_pattern",
            ),
            (smollm().u32("llama.expert_count", 8), "llama.expert_count"),
            (smollm().u32("llama.attention.value_length", 128), "llama.attention.value_length"),
            (smollm().u32("llama.attention.key_length", 128), "llama.rope.dimension_count"),
            (smollm().f32("llama.rope.scaling.factor_x", 8.0), "llama.rope.scaling.factor_x"),
        ];
        for (b, key) in cases {
            let err = shape(b).unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
        // A head size equal to width / heads, said explicitly, is fine; no experts too.
        let b = smollm().u32("llama.attention.key_length", 64).u32("llama.expert_count", 0);
        assert!(shape(b).is_ok());
        // Width / heads must divide when no key length says the head size.
        let b = smollm().u32("llama.embedding_length", 577);
        let err = shape(b).unwrap_err().to_string();
        assert!(
            err.contains("inconsistent") && err.contains("llama.attention.key_length"),
            "{err}"
        );
        let qwen = smollm().string("general.architecture", "qwen9");
        let err = shape(qwen).unwrap_err().to_string();
        assert!(err.contains("\"qwen9\"") && err.contains("general.architecture"), "{err}");
        assert!(err.contains("llama, qwen2"), "the refusal lists what is served: {err}");
    }
}
