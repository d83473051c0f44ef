//! A model's dimensions as a GGUF file's `<architecture>.*` metadata states them: what the
//! executor sizes its weights and KV cache by, and what the front needs for the model's maximum
//! length. The architectures served differ from Llama only in data ([`Family`]): one forward
//! computes them all.

use crate::family::{served, Family};
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
    /// Dimensions of a head the rotary embedding turns, from its start (`rope.dimension_count`:
    /// the whole head, or a part, as Phi-4-mini's three quarters); the rest pass unrotated.
    pub rope_dims: usize,
    /// The rotation's sines and cosines times this (`rope.scaling.attn_factor`: `LongRoPE`'s
    /// attention scaling, ggml's `mscale`; 1 without).
    pub rope_mscale: f32,
    /// Which of a `LongRoPE` file's factor tables rotates (`rope_factors_long` or `_short`): the
    /// long one when the context served passes `rope.scaling.original_context_length`, as
    /// llama.cpp chooses with the model's whole context.
    pub rope_long: bool,
    /// RMS norm epsilon.
    pub rms_eps: f32,
    /// Longest context the model was trained for.
    pub max_model_len: usize,
    /// Mistral-style sliding window (`attention.sliding_window`): each token attends to the
    /// last this many positions, itself included (Hugging Face's `q - k < window`, llama.cpp's
    /// standard window); `None` attends to every earlier position. Which layers have it: the
    /// family's `window_pattern` ([`LlamaShape::layer_window`]).
    pub sliding_window: Option<usize>,
    /// The attention scores' factor: `1/√head_dim`, or the family's exception.
    pub query_scale: f32,
    /// Attention scores soft-capped at this (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// Logits soft-capped at this (Gemma 2).
    pub final_softcap: Option<f32>,
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
    // Checked below: at most the head size (or equal to it), or no expert.
    "rope.dimension_count",
    "attention.key_length",
    "attention.value_length",
    "expert_count",
    "expert_used_count",
    // Read by `rope_scale`.
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scale_linear",
    // The length a scaled model was trained at before its extension: chooses LongRoPE's
    // factors, information otherwise.
    "rope.scaling.original_context_length",
    // Read into `rope_mscale`.
    "rope.scaling.attn_factor",
    "rope.scaling.finetuned",
    // Read into `sliding_window`.
    "attention.sliding_window",
    // Read into the soft caps, where the family caps (refused elsewhere).
    "attn_logit_softcapping",
    "final_logit_softcapping",
];

fn unsupported(key: &str, value: &Value, reason: &str) -> ShapeError {
    ShapeError::Unsupported { key: key.into(), value: value.to_string(), reason: reason.into() }
}

/// Refuses any `<architecture>.*` key Ferry does not understand, and understood keys with
/// values the forward does not compute (a rotary part of the head, values of another size than
/// keys, experts): a file served without them answers wrongly, without an error.
fn check_understood(
    header: &GgufHeader,
    family: Family,
    head_dim: usize,
) -> Result<(), ShapeError> {
    let arch = family.name;
    let mut keys: Vec<&String> = header.metadata.keys().collect();
    keys.sort();
    let prefix = format!("{arch}.");
    let unknown =
        |k: &&String| k.strip_prefix(&prefix).is_some_and(|rest| !UNDERSTOOD.contains(&rest));
    if let Some(key) = keys.into_iter().find(unknown) {
        return Err(unsupported(key, &header.metadata[key], "a key Ferry does not know"));
    }
    let key = format!("{prefix}attention.value_length");
    if let Some(v) = header.get(&key) {
        if v.as_u32().map(|n| n as usize) != Some(head_dim) {
            let reason = format!("Ferry attends values as wide as keys ({head_dim})");
            return Err(unsupported(&key, v, &reason));
        }
    }
    let key = format!("{prefix}rope.dimension_count");
    if let Some(v) = header.get(&key) {
        if !v.as_u32().is_some_and(|n| n > 0 && n % 2 == 0 && n as usize <= head_dim) {
            let reason = format!("Ferry rotates an even part of a head of {head_dim}");
            return Err(unsupported(&key, v, &reason));
        }
    }
    if family.softcap.is_none() {
        for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
            let key = format!("{prefix}{key}");
            if let Some(v) = header.get(&key) {
                return Err(unsupported(&key, v, "this architecture's forward caps nothing"));
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

/// `key`'s value where the file has it: a positive, finite number, or an error naming the key.
fn positive(header: &GgufHeader, key: &str) -> Result<Option<f32>, ShapeError> {
    let Some(v) = header.get(key) else { return Ok(None) };
    match v.as_f32() {
        Some(f) if f.is_finite() && f > 0.0 => Ok(Some(f)),
        _ => Err(unsupported(key, v, "expected a positive number")),
    }
}

/// The linear rotary scale the file asks for (1: none); other scalings are refused.
fn rope_scale(header: &GgufHeader, arch: &str) -> Result<f32, ShapeError> {
    let factor = |key: &str| positive(header, &format!("{arch}.{key}"));
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

/// The family's soft caps of attention scores and logits, as the file sets them or by the
/// family's defaults; `None` for a family that caps nothing.
fn soft_caps(
    header: &GgufHeader,
    family: Family,
) -> Result<(Option<f32>, Option<f32>), ShapeError> {
    let Some((attn, last)) = family.softcap else { return Ok((None, None)) };
    let cap = |k: &str, default: f32| {
        Ok(Some(positive(header, &format!("{}.{k}", family.name))?.unwrap_or(default)))
    };
    Ok((cap("attn_logit_softcapping", attn)?, cap("final_logit_softcapping", last)?))
}

/// The attention scores' factor: `1/√head_dim`, but `1/√(width / heads)` for the layer counts
/// the family names (llama.cpp's rule for Gemma's 27B models, after Google's `gemma_pytorch`).
fn query_scale(family: Family, num_layers: usize, width_per_head: usize, head_dim: usize) -> f32 {
    let size =
        if family.wide_query_scale_at.contains(&num_layers) { width_per_head } else { head_dim };
    1.0 / (size as f32).sqrt()
}

/// The rotary embedding's part of a head, its `mscale`, and whether `LongRoPE`'s long factors
/// apply, for a model of `max_len` positions (`dims` already checked).
fn rotary(
    header: &GgufHeader,
    arch: &str,
    head_dim: usize,
    max_len: usize,
) -> Result<(usize, f32, bool), ShapeError> {
    let key = |k: &str| format!("{arch}.{k}");
    let dims = header.get(&key("rope.dimension_count")).and_then(Value::as_u32);
    let mscale = positive(header, &key("rope.scaling.attn_factor"))?.unwrap_or(1.0);
    let original = header.get(&key("rope.scaling.original_context_length")).and_then(Value::as_u32);
    Ok((
        dims.map_or(head_dim, |n| n as usize),
        mscale,
        original.is_some_and(|o| max_len > o as usize),
    ))
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
        check_understood(header, family, head_dim)?;
        let (attn_softcap, final_softcap) = soft_caps(header, family)?;
        let num_layers = u("block_count")?;
        let max_model_len = u("context_length")?;
        let (rope_dims, rope_mscale, rope_long) = rotary(header, arch, head_dim, max_model_len)?;
        let shape = Self {
            family,
            num_layers,
            hidden,
            intermediate: u("feed_forward_length")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rope_theta,
            rope_scale: rope_scale(header, arch)?,
            rope_dims,
            rope_mscale,
            rope_long,
            rms_eps: float(required(header, &eps_key)?, &eps_key)?,
            max_model_len,
            // 0: no window, as llama.cpp reads it.
            sliding_window: optional_u("attention.sliding_window")?
                .or(family.default_window)
                .filter(|&w| w > 0),
            query_scale: query_scale(family, num_layers, hidden / num_heads.max(1), head_dim),
            attn_softcap,
            final_softcap,
        };
        if family.window_pattern.is_some() && shape.sliding_window.is_none() {
            let reason = "missing: this architecture alternates windowed and global layers";
            return Err(ShapeError::Metadata {
                key: key("attention.sliding_window"),
                reason: reason.into(),
            });
        }
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

    /// Positions a token attends to at most in layer `l` (`usize::MAX` where it attends to
    /// its whole context).
    pub fn layer_window(&self, l: usize) -> usize {
        match (self.sliding_window, self.family.window_pattern) {
            (Some(w), Some(n)) if l % n < n - 1 => w,
            (Some(w), None) => w,
            _ => usize::MAX,
        }
    }

    /// Whether layer `l` rotates by the family's windowed-layer base (Gemma 3's local layers)
    /// rather than the file's.
    pub fn local_rope(&self, l: usize) -> bool {
        self.family.window_rope_base.is_some() && self.layer_window(l) != usize::MAX
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
    use crate::family::RopeStyle;
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
        assert_eq!((s.sliding_window, s.layer_window(7)), (Some(4096), 4096));
        let s = shape(smollm_as("qwen2").u32("qwen2.attention.sliding_window", 0)).unwrap();
        assert_eq!((s.sliding_window, s.layer_window(0)), (None, usize::MAX));
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

    /// Gemma 2 and 3: the window on the layers llama.cpp gives it, Gemma 3's local rotary
    /// layers, Gemma 2's soft caps (defaults, or the file's), the 27B query scale.
    #[test]
    fn gemma_files_alternate_windowed_and_global_layers_and_cap_as_llama_cpp_reads_them() {
        let gemma = |arch: &str| {
            smollm_as(arch)
                .u32(&format!("{arch}.attention.key_length"), 256)
                .u32(&format!("{arch}.attention.value_length"), 256)
                .u32(&format!("{arch}.rope.dimension_count"), 256)
        };
        let s = shape(gemma("gemma2")).unwrap();
        let windows: Vec<usize> = (0..4).map(|l| s.layer_window(l)).collect();
        assert_eq!(windows, [4096, usize::MAX, 4096, usize::MAX]);
        assert_eq!((s.attn_softcap, s.final_softcap), (Some(50.0), Some(30.0)));
        assert_eq!(s.query_scale, 1.0 / 16.0);
        assert!(!s.local_rope(0), "Gemma 2 rotates every layer alike");
        let b = gemma("gemma2").f32("gemma2.attn_logit_softcapping", 20.0);
        let s = shape(b.u32("gemma2.attention.sliding_window", 8)).unwrap();
        assert_eq!((s.attn_softcap, s.layer_window(0)), (Some(20.0), 8));
        // 46 layers: Gemma 2 27B, queries scaled by width / heads (576 / 9 = 64).
        let s = shape(gemma("gemma2").u32("gemma2.block_count", 46)).unwrap();
        assert_eq!(s.query_scale, 1.0 / 8.0);
        let err = shape(gemma("gemma2").f32("gemma2.final_logit_softcapping", -1.0)).unwrap_err();
        assert!(err.to_string().contains("gemma2.final_logit_softcapping"), "{err}");
        // Gemma 3: five windowed layers to a global one, the windowed ones on their own base;
        // no caps; the window is required.
        let s = shape(gemma("gemma3").u32("gemma3.attention.sliding_window", 512)).unwrap();
        let windows: Vec<usize> = (0..7).map(|l| s.layer_window(l)).collect();
        assert_eq!(windows, [512, 512, 512, 512, 512, usize::MAX, 512]);
        assert_eq!((s.local_rope(0), s.local_rope(5)), (true, false));
        assert_eq!((s.attn_softcap, s.final_softcap), (None, None));
        let err = shape(gemma("gemma3")).unwrap_err().to_string();
        assert!(err.contains("gemma3.attention.sliding_window") && err.contains("missing"));
        let b = gemma("gemma3").u32("gemma3.attention.sliding_window", 512);
        let err = shape(b.f32("gemma3.attn_logit_softcapping", 50.0)).unwrap_err().to_string();
        assert!(err.contains("gemma3.attn_logit_softcapping"), "{err}");
        // A family that caps nothing refuses the caps.
        let err = shape(smollm().f32("llama.final_logit_softcapping", 30.0)).unwrap_err();
        assert!(err.to_string().contains("llama.final_logit_softcapping"), "{err}");
    }

    /// Phi-3.5 / Phi-4-mini: `LongRoPE`'s long factors where the context passes the original,
    /// its attention factor, and a rotation of part of each head.
    #[test]
    fn longrope_and_a_partial_rotation_are_read_as_llama_cpp_reads_them() {
        let phi = || {
            smollm_as("phi3")
                .u32("phi3.rope.dimension_count", 48)
                .f32("phi3.rope.scaling.attn_factor", 1.25)
        };
        let s = shape(phi().u32("phi3.rope.scaling.original_context_length", 4096)).unwrap();
        assert_eq!((s.rope_dims, s.head_dim, s.rope_mscale, s.rope_long), (48, 64, 1.25, true));
        let s = shape(phi().u32("phi3.rope.scaling.original_context_length", 8192)).unwrap();
        assert!(!s.rope_long, "a context of 8192 does not pass an original 8192");
        let s = shape(smollm()).unwrap();
        assert_eq!((s.rope_dims, s.rope_mscale, s.rope_long), (64, 1.0, false));
        let err = shape(phi().f32("phi3.rope.scaling.attn_factor", 0.0)).unwrap_err();
        assert!(err.to_string().contains("phi3.rope.scaling.attn_factor"), "{err}");
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
            (smollm().u32("llama.attention.key_length", 32), "llama.rope.dimension_count"),
            (smollm().u32("llama.rope.dimension_count", 63), "llama.rope.dimension_count"),
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
