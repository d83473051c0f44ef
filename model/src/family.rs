//! What an architecture's forward does differently from Llama's, as data ([`Family`]): the
//! one forward of each backend reads it, so no architecture has a copy of the forward.

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

/// The feed-forward's gating: `act(gate) · up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu(g) = g / (1 + e⁻ᵍ)` (SwiGLU: Llama, Qwen, Phi).
    Silu,
    /// The tanh approximation of GELU, `g/2 · (1 + tanh(√(2/π) · (g + 0.044715 g³)))`
    /// (GeGLU: Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// What an architecture's forward does differently from Llama's: data, read by every backend.
/// (Its flags are independent parts of the forward, each present or not.)
#[allow(clippy::struct_excessive_bools)]
#[derive(Clone, Copy, Debug, PartialEq)]
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
    /// The feed-forward's gating.
    pub activation: Activation,
    /// Whether the embeddings are scaled by √width before the first block (Gemma).
    pub embed_scale: bool,
    /// Whether each block's attention and feed-forward outputs are RMS-normed before they join
    /// the residual stream (`post_attention_norm`, `post_ffw_norm`: Gemma 2 and 3).
    pub post_norms: bool,
    /// With a sliding window, every `n`-th layer (the last of each `n`) attends to its whole
    /// context and the others to the window (Gemma 2: 2, Gemma 3: 6, as llama.cpp sets them);
    /// `None`: every layer has the window.
    pub window_pattern: Option<usize>,
    /// The window when the metadata gives none (Gemma 2's 4096, as llama.cpp assumes).
    pub default_window: Option<usize>,
    /// The rotary base of the windowed layers where it is not the file's (Gemma 3's local
    /// layers: 10000, unscaled; its global layers take `rope.freq_base` and its scaling).
    pub window_rope_base: Option<f32>,
    /// Soft-capping of attention scores and of the logits, `c · tanh(x / c)`: the caps when
    /// the file gives none (`attn_logit_softcapping`, `final_logit_softcapping`: Gemma 2's 50
    /// and 30); `None`: the family caps nothing and those keys are refused.
    pub softcap: Option<(f32, f32)>,
    /// Whether the file may hold `LongRoPE`'s per-pair factor tables (`rope_factors_long`,
    /// `rope_factors_short`: Phi-3 and 3.5 at 128k, Phi-4-mini).
    pub longrope: bool,
    /// Layer counts whose models scale queries by `1/√(width / heads)` instead of
    /// `1/√head_dim` (Gemma's 27B models; llama.cpp tells them by their layer count, as no
    /// key states it).
    pub wide_query_scale_at: &'static [usize],
}

impl Family {
    /// Llama 1-3 and the models in its layout (SmolLM, Mistral without a sliding window).
    pub const LLAMA: Self = Self {
        name: "llama",
        rope: RopeStyle::Adjacent,
        qkv_bias: false,
        qk_norm: false,
        fused: false,
        activation: Activation::Silu,
        embed_scale: false,
        post_norms: false,
        window_pattern: None,
        default_window: None,
        window_rope_base: None,
        softcap: None,
        longrope: false,
        wide_query_scale_at: &[],
    };
    /// Qwen 2 and 2.5: Llama with biases on Q, K and V and the NEOX rotation.
    pub const QWEN2: Self =
        Self { name: "qwen2", rope: RopeStyle::Halves, qkv_bias: true, ..Self::LLAMA };
    /// Qwen 3 (dense): Llama with the NEOX rotation and each Q and K head RMS-normed first; its
    /// heads are usually not width / heads wide (`attention.key_length`).
    pub const QWEN3: Self =
        Self { name: "qwen3", rope: RopeStyle::Halves, qk_norm: true, ..Self::LLAMA };
    /// Phi-3, 3.5 (mini, medium) and Phi-4-mini: Llama with the NEOX rotation, Q, K and V in one
    /// matrix and gate and up in another, usually a sliding window (none in Phi-4-mini), `LongRoPE`
    /// factors at 128k, a part of each head rotated (Phi-4-mini).
    pub const PHI3: Self =
        Self { name: "phi3", rope: RopeStyle::Halves, fused: true, longrope: true, ..Self::LLAMA };
    /// Gemma 2: GeGLU, embeddings scaled by √width, every block's attention and feed-forward
    /// outputs RMS-normed before the residual add (norm weights hold Gemma's `1 + w`, as
    /// llama.cpp's converter writes them), the NEOX rotation, attention scores and logits
    /// soft-capped, and a 4096-position window on every other layer (the first of each pair).
    pub const GEMMA2: Self = Self {
        name: "gemma2",
        rope: RopeStyle::Halves,
        activation: Activation::GeluTanh,
        embed_scale: true,
        post_norms: true,
        window_pattern: Some(2),
        default_window: Some(4096),
        softcap: Some((50.0, 30.0)),
        wide_query_scale_at: &[46],
        ..Self::LLAMA
    };
    /// Gemma 3 (text): Gemma 2 without soft-capping, with each Q and K head RMS-normed, five
    /// windowed layers to each global one, and the windowed layers' own rotary base.
    pub const GEMMA3: Self = Self {
        name: "gemma3",
        qk_norm: true,
        window_pattern: Some(6),
        default_window: None,
        window_rope_base: Some(10_000.0),
        softcap: None,
        wide_query_scale_at: &[62],
        ..Self::GEMMA2
    };
    /// Every architecture served.
    pub const ALL: [Self; 6] =
        [Self::LLAMA, Self::QWEN2, Self::QWEN3, Self::PHI3, Self::GEMMA2, Self::GEMMA3];

    /// The family whose `general.architecture` is `name`.
    pub fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name == name)
    }
}

/// The architectures served, for messages: "llama, qwen2, qwen3".
pub fn served() -> String {
    Family::ALL.map(|f| f.name).join(", ")
}
