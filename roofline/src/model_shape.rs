//! A model's shape as far as timing and memory need it: layers, widths, heads, vocabulary,
//! experts, and the bytes of its weights and of one token's KV cache.
//!
//! The parameter counts here are the ones the step-cost formula multiplies (the formula is in
//! `step_cost`'s head) and the ones `weight_bytes` is set from, so the two always agree.
//! [`SimModel::validate`] names the first unusable field (sizes must be positive, and a mixture
//! of experts must run `1..=num_experts` experts a token).

use crate::validation::{positive, SimConfigError};

/// The shape of a decoder-only transformer, as far as timing and memory need it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimModel {
    /// Transformer blocks.
    pub num_layers: u32,
    /// Residual stream width.
    pub hidden: u32,
    /// MLP width (each of gate, up and down in a `SwiGLU` MLP); of one expert in a mixture of
    /// experts.
    pub intermediate: u32,
    /// Query heads.
    pub num_heads: u32,
    /// Key/value heads (fewer than `num_heads` with grouped-query attention).
    pub num_kv_heads: u32,
    /// Width of one head.
    pub head_dim: u32,
    /// Vocabulary size.
    pub vocab_size: u32,
    /// Bytes of all weights, embeddings and LM head included.
    pub weight_bytes: u64,
    /// Bytes of one cached K or V element (2 for bf16).
    pub kv_bytes_per_elem: u32,
    /// Experts per layer of a mixture of experts (0 for a dense model).
    pub num_experts: u32,
    /// Experts each token runs (0 for a dense model).
    pub experts_per_token: u32,
}

impl SimModel {
    /// A Llama-architecture model (`SwiGLU` MLP, grouped-query attention, untied LM head) with
    /// weights of `bytes_per_weight` bytes each (2 for bf16, ~0.56 for `Q4_1`) and a bf16 KV
    /// cache. Set `weight_bytes` afterwards for tied embeddings or a measured file size.
    pub fn llama(
        num_layers: u32,
        hidden: u32,
        intermediate: u32,
        num_heads: u32,
        num_kv_heads: u32,
        vocab_size: u32,
        bytes_per_weight: f64,
    ) -> Self {
        let mut model = Self {
            num_layers,
            hidden,
            intermediate,
            num_heads,
            num_kv_heads,
            head_dim: hidden.checked_div(num_heads).unwrap_or(0),
            vocab_size,
            weight_bytes: 0,
            kv_bytes_per_elem: 2,
            num_experts: 0,
            experts_per_token: 0,
        };
        model.set_weight_bytes(bytes_per_weight, false);
        model
    }

    /// Sets `weight_bytes` from the parameter count at `bytes_per_weight` each (embeddings
    /// counted once when `tied` to the LM head).
    pub fn set_weight_bytes(&mut self, bytes_per_weight: f64, tied: bool) {
        let embeddings = f64::from(self.vocab_size) * f64::from(self.hidden);
        let embeddings = if tied { embeddings } else { 2.0 * embeddings };
        let params = self.layer_params() * f64::from(self.num_layers) + embeddings;
        self.weight_bytes = (params * bytes_per_weight.max(0.0)) as u64;
    }

    /// Whether it is a mixture of experts.
    pub fn is_moe(&self) -> bool {
        self.num_experts > 0 && self.experts_per_token > 0
    }

    /// Llama-2-7B in bf16 (about 13.5 GB of weights).
    pub fn llama2_7b() -> Self {
        Self::llama(32, 4096, 11_008, 32, 32, 32_000, 2.0)
    }

    /// Checks the shape is usable, naming the first bad field.
    pub fn validate(&self) -> Result<(), SimConfigError> {
        positive("num_layers", f64::from(self.num_layers))?;
        positive("hidden", f64::from(self.hidden))?;
        positive("num_heads", f64::from(self.num_heads))?;
        positive("num_kv_heads", f64::from(self.num_kv_heads))?;
        positive("head_dim", f64::from(self.head_dim))?;
        positive("vocab_size", f64::from(self.vocab_size))?;
        positive("kv_bytes_per_elem", f64::from(self.kv_bytes_per_elem))?;
        if self.num_experts > 0 || self.experts_per_token > 0 {
            positive("num_experts", f64::from(self.num_experts))?;
            let (k, e) = (self.experts_per_token, self.num_experts);
            if k == 0 || k > e {
                return Err(SimConfigError::Invalid {
                    field: "experts_per_token",
                    value: f64::from(k),
                    expected: "1 to num_experts",
                });
            }
        }
        Ok(())
    }

    /// Matmul parameters of one layer's attention: the Q, K, V and O projections (and a
    /// mixture of experts' router).
    pub fn attention_params(&self) -> f64 {
        let hidden = f64::from(self.hidden);
        let q = f64::from(self.num_heads) * f64::from(self.head_dim);
        let kv = f64::from(self.num_kv_heads) * f64::from(self.head_dim);
        hidden * (2.0 * q + 2.0 * kv) + hidden * f64::from(self.num_experts)
    }

    /// Parameters of one MLP (one expert's, in a mixture of experts): gate, up and down.
    pub fn mlp_params(&self) -> f64 {
        3.0 * f64::from(self.hidden) * f64::from(self.intermediate)
    }

    /// Matmul parameters of one layer, every expert counted.
    pub fn layer_params(&self) -> f64 {
        self.attention_params() + self.mlp_params() * f64::from(self.num_experts.max(1))
    }

    /// Parameters one token runs through in one layer (its experts only).
    pub fn active_layer_params(&self) -> f64 {
        let experts = if self.is_moe() { self.experts_per_token } else { 1 };
        self.attention_params() + self.mlp_params() * f64::from(experts)
    }

    /// Bytes of weights a step of `tokens` new tokens reads: all of a dense model's; of a
    /// mixture of experts, all but the experts, plus the experts its tokens are expected to
    /// touch (each token picking `experts_per_token` of `num_experts` uniformly).
    pub fn weight_bytes_read(&self, tokens: f64) -> f64 {
        let total = self.weight_bytes as f64;
        if !self.is_moe() {
            return total;
        }
        let per_param = total / self.total_params().max(1.0);
        let (e, k) = (f64::from(self.num_experts), f64::from(self.experts_per_token));
        let touched = e * (1.0 - (1.0 - k / e).powf(tokens.max(0.0)));
        let experts = self.mlp_params() * f64::from(self.num_layers) * per_param;
        total - experts * e + experts * touched
    }

    /// Every parameter, embeddings (and LM head, as `weight_bytes` counted them) included.
    pub(crate) fn total_params(&self) -> f64 {
        self.layer_params() * f64::from(self.num_layers)
            + 2.0 * f64::from(self.vocab_size) * f64::from(self.hidden)
    }

    /// KV cache bytes of one token over all layers (K and V), summed over the TP group.
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * u64::from(self.num_layers)
            * u64::from(self.num_kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.kv_bytes_per_elem)
    }
}
