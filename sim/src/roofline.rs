//! The roofline timing model (DESIGN.md section 5): how long a GPU executor would take for a
//! step and how many KV blocks it would hold, so many simulated GPUs can run on one machine —
//! as `sim` executors against the real control plane, or in virtual time in [`crate::des`].
//!
//! A step is the batch's new tokens, each item with its cached context. With `tp` the
//! tensor-parallel degree, `ce`/`be` the compute and bandwidth efficiencies:
//!
//! ```text
//! duration = overhead + max(compute, memory) + communication
//! compute  = FLOPs / (tflops * 1e12 * ce * tp)
//!   FLOPs  = 2 * active_layer_params * layers * new_tokens   (projections and MLP; a
//!                                                             mixture of experts counts the
//!                                                             experts each token runs)
//!          + 2 * hidden * vocab * items                       (LM head, one row per item)
//!          + 4 * layers * heads * head_dim * attended         (QK^T and PV)
//!   attended = sum over items of n * c + n * (n + 1) / 2     (causal, n new, c cached)
//! memory   = (weights_read + kv_bytes_per_token * (c + n)) / (bandwidth * 1e9 * be * tp)
//!                                                             (read the context, write the new)
//!   weights_read = every weight of a dense model; of a mixture of experts, the shared weights
//!                  and the experts the step's tokens touch: E * (1 - (1 - k/E)^tokens) of E
//!                  per layer in expectation when each token picks k of E uniformly
//! communication (tp > 1 only, not overlapped)
//!          = 2 * layers * (allreduce_latency
//!                          + 2 * (tp - 1) / tp * hidden * new_tokens * 2 bytes / interconnect)
//! ```
//!
//! Weights and KV heads are sharded evenly over the `tp` GPUs, which is why `tp` divides both
//! terms; the communication is a ring all-reduce of bf16 activations after attention and after
//! the MLP of every layer. Kernel launch gaps and the sampler are folded into `overhead_us` and
//! the efficiencies.
//!
//! Unlike the per-request roofline of the simulator this one's design came from (Opal: a
//! batch's time as the max of its longest prefill and its decodes), a step is costed as one
//! batch: prefill chunks and decodes share one read of the weights, and their FLOPs add up. The model guarantees: no panic for any input (a degenerate
//! configuration gives `Duration::MAX`, not a division by zero; [`SimHardware::validate`] says
//! why), and monotonicity: more new tokens or a longer context never make a step faster.
//!
//! Tokens come from [`sim_token`], a hash of (seed, position) like the real sampler's draws, so
//! a simulated request is reproducible across preemption and failover.

use std::time::Duration;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// One simulated GPU and its group: peak rates, how much of them real kernels get, and costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimHardware {
    /// Dense bf16 tensor throughput per GPU, in TFLOP/s.
    pub tflops: f64,
    /// Memory bandwidth per GPU, in GB/s.
    pub mem_bandwidth_gbps: f64,
    /// Memory per GPU, in bytes.
    pub mem_bytes: u64,
    /// GPUs a model is sharded over (tensor parallelism); at least 1.
    pub tensor_parallel: u32,
    /// Fraction of `tflops` that matmuls reach, in (0, 1].
    pub compute_efficiency: f64,
    /// Fraction of `mem_bandwidth_gbps` that streaming reads reach, in (0, 1].
    pub bandwidth_efficiency: f64,
    /// Fixed cost of a step (scheduling, launches, sampling), in microseconds.
    pub overhead_us: f64,
    /// GPU-to-GPU bandwidth per direction (`NVLink` or `PCIe`), in GB/s; used when tp > 1.
    pub interconnect_gbps: f64,
    /// Fixed latency of one all-reduce, in microseconds; used when tp > 1.
    pub allreduce_latency_us: f64,
    /// Node-to-node bandwidth per GPU (what a KV transfer between nodes gets), in GB/s.
    pub network_gbps: f64,
}

/// A bad [`SimHardware`] or [`SimModel`] field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimConfigError {
    /// The field's value is out of its range.
    #[error("simulator field `{field}` is {value}, expected {expected}")]
    Invalid {
        /// The field's name.
        field: &'static str,
        /// The value found.
        value: f64,
        /// The allowed range, in words.
        expected: &'static str,
    },
}

impl SimHardware {
    /// NVIDIA A100 SXM 80 GB: 312 TFLOP/s, 2039 GB/s, `NVLink` 3 (300 GB/s per direction).
    pub fn a100_80g() -> Self {
        Self {
            tflops: 312.0,
            mem_bandwidth_gbps: 2039.0,
            mem_bytes: 80 * GIB,
            tensor_parallel: 1,
            compute_efficiency: 0.6,
            bandwidth_efficiency: 0.8,
            overhead_us: 200.0,
            interconnect_gbps: 300.0,
            allreduce_latency_us: 10.0,
            network_gbps: 25.0,
        }
    }

    /// NVIDIA H100 SXM 80 GB: 989 TFLOP/s, 3350 GB/s, `NVLink` 4 (450 GB/s per direction).
    pub fn h100_80g() -> Self {
        Self {
            tflops: 989.0,
            mem_bandwidth_gbps: 3350.0,
            mem_bytes: 80 * GIB,
            tensor_parallel: 1,
            compute_efficiency: 0.6,
            bandwidth_efficiency: 0.8,
            overhead_us: 150.0,
            interconnect_gbps: 450.0,
            allreduce_latency_us: 8.0,
            network_gbps: 50.0,
        }
    }

    /// NVIDIA L4 24 GB: 121 TFLOP/s, 300 GB/s, `PCIe` 4 x16 between GPUs (~25 GB/s usable).
    pub fn l4() -> Self {
        Self {
            tflops: 121.0,
            mem_bandwidth_gbps: 300.0,
            mem_bytes: 23_034 * MIB,
            tensor_parallel: 1,
            compute_efficiency: 0.6,
            bandwidth_efficiency: 0.8,
            overhead_us: 200.0,
            interconnect_gbps: 25.0,
            allreduce_latency_us: 20.0,
            network_gbps: 12.5,
        }
    }

    /// The same GPUs, `tensor_parallel` of them per model replica.
    #[must_use]
    pub fn with_tensor_parallel(self, tensor_parallel: u32) -> Self {
        Self { tensor_parallel, ..self }
    }

    /// Checks every field is usable, naming the first that is not.
    pub fn validate(&self) -> Result<(), SimConfigError> {
        positive("tflops", self.tflops)?;
        positive("mem_bandwidth_gbps", self.mem_bandwidth_gbps)?;
        positive("mem_bytes", self.mem_bytes as f64)?;
        positive("tensor_parallel", f64::from(self.tensor_parallel))?;
        fraction("compute_efficiency", self.compute_efficiency)?;
        fraction("bandwidth_efficiency", self.bandwidth_efficiency)?;
        non_negative("overhead_us", self.overhead_us)?;
        non_negative("allreduce_latency_us", self.allreduce_latency_us)?;
        if self.tensor_parallel > 1 {
            positive("interconnect_gbps", self.interconnect_gbps)?;
        }
        positive("network_gbps", self.network_gbps)?;
        Ok(())
    }

    fn tp(&self) -> f64 {
        f64::from(self.tensor_parallel.max(1))
    }
}

fn positive(field: &'static str, value: f64) -> Result<(), SimConfigError> {
    let ok = value.is_finite() && value > 0.0;
    ok.then_some(()).ok_or(SimConfigError::Invalid { field, value, expected: "a number > 0" })
}

fn non_negative(field: &'static str, value: f64) -> Result<(), SimConfigError> {
    let ok = value.is_finite() && value >= 0.0;
    ok.then_some(()).ok_or(SimConfigError::Invalid { field, value, expected: "a number >= 0" })
}

fn fraction(field: &'static str, value: f64) -> Result<(), SimConfigError> {
    let ok = value > 0.0 && value <= 1.0;
    ok.then_some(()).ok_or(SimConfigError::Invalid { field, value, expected: "a number in (0, 1]" })
}

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
    fn total_params(&self) -> f64 {
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

/// One request's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimBatchItem {
    /// Tokens computed in this step (the prompt chunk for a prefill, 1 for a decode).
    pub new_tokens: u32,
    /// Tokens already in the KV cache before this step.
    pub context_len: u32,
}

impl SimBatchItem {
    /// A prefill of `tokens` prompt tokens with nothing cached.
    pub fn prefill(tokens: u32) -> Self {
        Self { new_tokens: tokens, context_len: 0 }
    }

    /// One decode token after `context_len` cached ones.
    pub fn decode(context_len: u32) -> Self {
        Self { new_tokens: 1, context_len }
    }
}

/// A step's duration broken into the model's terms (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepCost {
    /// The fixed per-step cost.
    pub overhead: Duration,
    /// Time at the compute roof.
    pub compute: Duration,
    /// Time at the memory-bandwidth roof.
    pub memory: Duration,
    /// Tensor-parallel all-reduces.
    pub communication: Duration,
}

impl StepCost {
    /// The step's duration: overhead + max(compute, memory) + communication, saturating.
    pub fn total(&self) -> Duration {
        self.overhead
            .saturating_add(self.compute.max(self.memory))
            .saturating_add(self.communication)
    }

    /// Whether compute, not memory bandwidth, limits the step.
    pub fn is_compute_bound(&self) -> bool {
        self.compute > self.memory
    }
}

/// The cost of one step; a step with no new tokens costs only the overhead.
pub fn step_cost(hw: &SimHardware, model: &SimModel, items: &[SimBatchItem]) -> StepCost {
    let overhead = seconds(hw.overhead_us * 1e-6);
    let (mut tokens, mut rows, mut attended, mut kv_tokens) = (0.0, 0.0, 0.0, 0.0);
    for item in items.iter().filter(|i| i.new_tokens > 0) {
        let (n, c) = (f64::from(item.new_tokens), f64::from(item.context_len));
        tokens += n;
        rows += 1.0;
        attended += n * c + n * (n + 1.0) / 2.0;
        kv_tokens += n + c;
    }
    if tokens == 0.0 {
        return StepCost { overhead, ..StepCost::default() };
    }
    let tp = hw.tp();
    let layers = f64::from(model.num_layers);
    let hidden = f64::from(model.hidden);
    let flops = 2.0 * model.active_layer_params() * layers * tokens
        + 2.0 * hidden * f64::from(model.vocab_size) * rows
        + 4.0 * layers * f64::from(model.num_heads) * f64::from(model.head_dim) * attended;
    let bytes = model.weight_bytes_read(tokens) + model.kv_bytes_per_token() as f64 * kv_tokens;
    let communication = if tp > 1.0 {
        let ring_bytes = 2.0 * (tp - 1.0) / tp * hidden * tokens * 2.0;
        let one = hw.allreduce_latency_us * 1e-6 + ring_bytes / (hw.interconnect_gbps * 1e9);
        seconds(2.0 * layers * one)
    } else {
        Duration::ZERO
    };
    StepCost {
        overhead,
        compute: seconds(flops / (hw.tflops * 1e12 * hw.compute_efficiency * tp)),
        memory: seconds(bytes / (hw.mem_bandwidth_gbps * 1e9 * hw.bandwidth_efficiency * tp)),
        communication,
    }
}

/// How long the simulated executor takes for a step: [`step_cost`]'s total.
pub fn step_duration(hw: &SimHardware, model: &SimModel, items: &[SimBatchItem]) -> Duration {
    step_cost(hw, model, items).total()
}

/// Seconds as a `Duration` without panicking: NaN or overflow (a zero rate in a bad
/// configuration) saturate to `Duration::MAX`, negatives to zero.
fn seconds(s: f64) -> Duration {
    if s.is_nan() {
        return Duration::MAX;
    }
    Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX)
}

/// KV cache blocks of `block_size` tokens that fit in each GPU's memory, capped at
/// `gpu_memory_utilization` (clamped to [0, 1]) as vLLM caps it, after the GPU's shard of the
/// weights and `activation_bytes` of workspace per GPU (see [`activation_bytes`]). Every GPU of
/// a TP group holds its shard of every block, so this is also the group's block count.
pub fn kv_capacity_blocks(
    hw: &SimHardware,
    model: &SimModel,
    block_size: u32,
    gpu_memory_utilization: f64,
    activation_bytes: u64,
) -> u64 {
    let tp = hw.tp();
    let utilization =
        if gpu_memory_utilization.is_nan() { 0.0 } else { gpu_memory_utilization.clamp(0.0, 1.0) };
    let free = hw.mem_bytes as f64 * utilization
        - model.weight_bytes as f64 / tp
        - activation_bytes as f64;
    let block_bytes = f64::from(block_size) * model.kv_bytes_per_token() as f64 / tp;
    if free <= 0.0 || block_bytes <= 0.0 {
        return 0;
    }
    (free / block_bytes).floor() as u64
}

/// Peak activation workspace per GPU of a step of `max_batched_tokens` tokens and `max_seqs`
/// sampled rows, as vLLM's memory profiling run finds it, roughly: the widest intermediates
/// of one layer alive at once in bf16 (the residual stream and its normalised copy, Q/K/V,
/// the attention output, the MLP's gate and up halves: activations are not kept across
/// layers), sharded over the TP group, plus f32 logits for every sampled row.
pub fn activation_bytes(
    model: &SimModel,
    tensor_parallel: u32,
    max_batched_tokens: u32,
    max_seqs: u32,
) -> u64 {
    let tp = f64::from(tensor_parallel.max(1));
    let hidden = f64::from(model.hidden);
    let q = f64::from(model.num_heads) * f64::from(model.head_dim);
    let kv = f64::from(model.num_kv_heads) * f64::from(model.head_dim);
    let experts = if model.is_moe() { f64::from(model.experts_per_token) } else { 1.0 };
    let mlp = 2.0 * f64::from(model.intermediate) * experts;
    let per_token = (2.0 * hidden + (q + 2.0 * kv + q) / tp + mlp / tp) * 2.0;
    let logits = f64::from(max_seqs) * f64::from(model.vocab_size) * 4.0 / tp;
    (f64::from(max_batched_tokens) * per_token + logits) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1e3
    }

    #[test]
    fn more_tokens_or_context_is_never_faster() {
        let (hw, model) = (SimHardware::h100_80g(), SimModel::llama2_7b());
        let mut last = Duration::ZERO;
        for tokens in [1, 2, 16, 128, 512, 2048, 8192] {
            let d = step_duration(&hw, &model, &[SimBatchItem::prefill(tokens)]);
            assert!(d >= last, "{tokens} tokens took {d:?} < {last:?}");
            last = d;
        }
        let mut last = Duration::ZERO;
        for context in [0, 100, 1000, 4000, 32_000, 128_000] {
            let batch = vec![SimBatchItem::decode(context); 32];
            let d = step_duration(&hw, &model, &batch);
            assert!(d >= last, "context {context} took {d:?} < {last:?}");
            last = d;
        }
        let mut last = Duration::ZERO;
        for batch in [1, 2, 8, 64, 256] {
            let d = step_duration(&hw, &model, &vec![SimBatchItem::decode(512); batch]);
            assert!(d >= last, "batch {batch} took {d:?} < {last:?}");
            last = d;
        }
    }

    #[test]
    fn single_decode_of_7b_on_h100_is_memory_bound_and_a_few_ms() {
        let cost = step_cost(
            &SimHardware::h100_80g(),
            &SimModel::llama2_7b(),
            &[SimBatchItem::decode(512)],
        );
        assert!(!cost.is_compute_bound(), "{cost:?}");
        let total = ms(cost.total());
        assert!((2.0..20.0).contains(&total), "{total} ms");
    }

    #[test]
    fn prefill_of_2048_tokens_is_compute_bound() {
        let cost = step_cost(
            &SimHardware::h100_80g(),
            &SimModel::llama2_7b(),
            &[SimBatchItem::prefill(2048)],
        );
        assert!(cost.is_compute_bound(), "{cost:?}");
        // ~28 TFLOP at ~600 effective TFLOP/s.
        assert!((20.0..100.0).contains(&ms(cost.total())), "{cost:?}");
    }

    #[test]
    fn tensor_parallelism_speeds_up_big_batches_and_costs_communication() {
        let model = SimModel::llama2_7b();
        let tp1 = SimHardware::a100_80g();
        let tp2 = tp1.with_tensor_parallel(2);
        let decode = vec![SimBatchItem::decode(1024); 64];
        let prefill = [SimBatchItem::prefill(4096)];
        for batch in [&decode[..], &prefill[..]] {
            let (one, two) = (step_cost(&tp1, &model, batch), step_cost(&tp2, &model, batch));
            assert!(two.total() < one.total(), "{one:?} vs {two:?}");
            assert_eq!(one.communication, Duration::ZERO);
            assert!(two.communication > Duration::ZERO);
        }
    }

    #[test]
    fn an_empty_step_costs_the_overhead() {
        let hw = SimHardware::l4();
        let model = SimModel::llama2_7b();
        let expected = Duration::from_micros(200);
        assert_eq!(step_duration(&hw, &model, &[]), expected);
        assert_eq!(
            step_duration(&hw, &model, &[SimBatchItem { new_tokens: 0, context_len: 9 }]),
            expected
        );
    }

    #[test]
    fn a_broken_configuration_saturates_instead_of_panicking() {
        let model = SimModel::llama2_7b();
        let broken =
            SimHardware { tflops: 0.0, mem_bandwidth_gbps: f64::NAN, ..SimHardware::h100_80g() };
        assert_eq!(step_duration(&broken, &model, &[SimBatchItem::prefill(8)]), Duration::MAX);
        let no_gpus = SimHardware::h100_80g().with_tensor_parallel(0);
        assert_eq!(
            step_duration(&no_gpus, &model, &[SimBatchItem::decode(5)]),
            step_duration(&SimHardware::h100_80g(), &model, &[SimBatchItem::decode(5)])
        );
        assert!(matches!(broken.validate(), Err(SimConfigError::Invalid { field: "tflops", .. })));
        assert!(matches!(
            no_gpus.validate(),
            Err(SimConfigError::Invalid { field: "tensor_parallel", .. })
        ));
        let bad_eff = SimHardware { compute_efficiency: 1.5, ..SimHardware::l4() };
        assert!(bad_eff.validate().unwrap_err().to_string().contains("compute_efficiency"));
        for hw in [SimHardware::a100_80g(), SimHardware::h100_80g(), SimHardware::l4()] {
            assert_eq!(hw.validate(), Ok(()));
            assert_eq!(hw.with_tensor_parallel(8).validate(), Ok(()));
        }
        assert_eq!(model.validate(), Ok(()));
        let headless = SimModel::llama(2, 64, 128, 0, 0, 100, 2.0);
        assert!(headless.validate().is_err());
        let _ = step_duration(&SimHardware::l4(), &headless, &[SimBatchItem::prefill(3)]);
    }

    #[test]
    fn kv_capacity_is_sane() {
        let (hw, model) = (SimHardware::h100_80g(), SimModel::llama2_7b());
        // 7B bf16: 13.5 GB of weights, 512 KiB of KV per token, 8 MiB per 16-token block.
        assert_eq!(model.kv_bytes_per_token(), 512 * 1024);
        assert!((13.0e9..14.0e9).contains(&(model.weight_bytes as f64)), "{}", model.weight_bytes);
        let blocks = kv_capacity_blocks(&hw, &model, 16, 0.9, 0);
        assert!((7000..8500).contains(&blocks), "{blocks}");
        assert!(kv_capacity_blocks(&hw, &model, 16, 0.5, 0) < blocks);
        assert!(kv_capacity_blocks(&hw, &model, 32, 0.9, 0) <= blocks / 2);
        // A shard of the weights frees room: two GPUs hold more than twice the blocks.
        assert!(kv_capacity_blocks(&hw.with_tensor_parallel(2), &model, 16, 0.9, 0) > 2 * blocks);
        // 70B-sized weights do not fit one L4; nonsense inputs give zero.
        let huge = SimModel { weight_bytes: 140_000_000_000, ..model };
        assert_eq!(kv_capacity_blocks(&SimHardware::l4(), &huge, 16, 0.9, 0), 0);
        assert_eq!(kv_capacity_blocks(&hw, &model, 0, 0.9, 0), 0);
        assert_eq!(kv_capacity_blocks(&hw, &model, 16, f64::NAN, 0), 0);
        assert_eq!(
            kv_capacity_blocks(&hw, &model, 16, 7.0, 0),
            kv_capacity_blocks(&hw, &model, 16, 1.0, 0)
        );
    }

    /// Two batches of Llama-3-8B (bf16) on an H100, worked by hand from the module doc's
    /// formulas. The model: 32 layers, hidden 4096, MLP 14336, 32 query and 8 KV heads of 128,
    /// vocabulary 128256; per layer 4096 x (2 x 4096 + 2 x 1024) = 41,943,040 attention and
    /// 3 x 4096 x 14336 = 176,160,768 MLP parameters (218,103,808); weights
    /// (218,103,808 x 32 + 2 x 128256 x 4096) x 2 bytes = 16,059,990,016 bytes; KV
    /// 2 x 32 x 8 x 128 x 2 = 131,072 bytes a token. The GPU: 989.4 TFLOP/s at 60 %,
    /// 3350 GB/s at 80 %, 150 µs a step.
    #[test]
    fn step_times_equal_the_hand_worked_roofline() {
        let p = crate::profile::Profiles::built_in();
        let model = p.model("llama-3-8b").unwrap().to_sim().unwrap();
        let hw = p.hardware("h100").unwrap().to_sim("bf16", 1).unwrap();
        assert_eq!(model.weight_bytes, 16_059_990_016);
        assert_eq!(model.kv_bytes_per_token(), 131_072);
        let close = |got: Duration, secs: f64| {
            assert!((got.as_secs_f64() - secs).abs() < 1e-9, "{got:?} vs {secs} s");
        };
        // One decode after 1,000 cached tokens: attended 1 x 1000 + 1 = 1001.
        // FLOPs = 2 x 218,103,808 x 32 x 1 + 2 x 4096 x 128256 x 1 + 4 x 32 x 32 x 128 x 1001
        //       = 13,958,643,712 + 1,050,673,152 + 524,812,288 = 15,534,129,152
        //   compute = 15,534,129,152 / (989.4e12 x 0.6) = 26.17 µs
        // bytes = 16,059,990,016 + 131,072 x 1001 = 16,191,193,088
        //   memory = 16,191,193,088 / (3350e9 x 0.8) = 6.041490 ms: memory-bound
        // total = 0.15 ms + 6.041490 ms = 6.191490 ms
        let one = step_cost(&hw, &model, &[SimBatchItem::decode(1000)]);
        assert!(!one.is_compute_bound());
        close(one.compute, 15_534_129_152.0 / (989.4e12 * 0.6));
        close(one.memory, 16_191_193_088.0 / (3350e9 * 0.8));
        close(one.total(), 150e-6 + 16_191_193_088.0 / (3350e9 * 0.8));
        assert_eq!(one.communication, Duration::ZERO);
        // A 2,048-token prompt chunk with 32 decodes after 512 cached tokens, one batch:
        // tokens 2080, rows 33; attended 2048 x 2049 / 2 + 32 x 513 = 2,114,592;
        // KV touched 2048 + 32 x 513 = 18,464 tokens.
        // FLOPs = 13,958,643,712 x 2080 + 1,050,673,152 x 33 + 524,288 x 2,114,592
        //       = 30,177,306,345,472 -> compute 50.834355 ms: compute-bound
        // bytes = 16,059,990,016 + 131,072 x 18,464 = 18,480,103,424 -> memory 6.895561 ms
        // total = 0.15 ms + 50.834355 ms = 50.984355 ms (not the Opal seed's max of the
        // prefill's time and the decodes' time: they share one pass over the weights).
        let mut batch = vec![SimBatchItem::decode(512); 32];
        batch.push(SimBatchItem::prefill(2048));
        let mixed = step_cost(&hw, &model, &batch);
        assert!(mixed.is_compute_bound());
        close(mixed.compute, 30_177_306_345_472.0 / (989.4e12 * 0.6));
        close(mixed.memory, 18_480_103_424.0 / (3350e9 * 0.8));
        close(mixed.total(), 150e-6 + 30_177_306_345_472.0 / (989.4e12 * 0.6));
    }

    #[test]
    fn a_mixture_of_experts_computes_its_active_experts_and_reads_those_it_touches() {
        let p = crate::profile::Profiles::built_in();
        let moe = p.model("mixtral-8x7b").unwrap().to_sim().unwrap();
        let dense = SimModel { num_experts: 0, experts_per_token: 0, ..moe };
        // Two of eight experts a token: active parameters a layer are attention + 2 MLPs.
        assert!(
            (moe.active_layer_params() - (moe.attention_params() + 2.0 * moe.mlp_params())).abs()
                < 1.0
        );
        // One token touches 2 experts of 8 a layer: 1 - (1 - 2/8)^1 = 1/4 of the experts.
        let all = moe.weight_bytes as f64;
        let per_param = all / (moe.layer_params() * 32.0 + 2.0 * 32_000.0 * 4096.0);
        let experts = moe.mlp_params() * 32.0 * per_param * 8.0;
        assert!((moe.weight_bytes_read(1.0) - (all - experts + experts / 4.0)).abs() < 1e3);
        // Many tokens touch them all; a dense model always reads everything.
        assert!((moe.weight_bytes_read(4096.0) - all).abs() / all < 1e-9);
        assert_eq!(dense.weight_bytes_read(1.0), dense.weight_bytes as f64);
        // A decode of the MoE is faster than of a dense model of the same total size.
        let hw = p.hardware("h100").unwrap().to_sim("bf16", 2).unwrap();
        let (m, d) = (
            step_duration(&hw, &moe, &[SimBatchItem::decode(100)]),
            step_duration(
                &hw,
                &SimModel { weight_bytes: moe.weight_bytes, ..dense },
                &[SimBatchItem::decode(100)],
            ),
        );
        assert!(m < d, "{m:?} vs {d:?}");
        let bad = SimModel { experts_per_token: 9, ..moe };
        assert!(bad.validate().unwrap_err().to_string().contains("experts_per_token"));
    }

    #[test]
    fn kv_capacity_leaves_room_for_activations() {
        let p = crate::profile::Profiles::built_in();
        let model = p.model("llama-3-8b").unwrap().to_sim().unwrap();
        let hw = p.hardware("h100").unwrap().to_sim("bf16", 1).unwrap();
        let act = activation_bytes(&model, 1, 8192, 256);
        // 8192 tokens x (2 x 4096 + 4096 + 2 x 1024 + 4096 + 2 x 14336) x 2 bytes
        // + 256 x 128256 x 4 bytes of logits.
        assert_eq!(act, 8192 * (8192 + 4096 + 2048 + 4096 + 28_672) * 2 + 256 * 128_256 * 4);
        let with = kv_capacity_blocks(&hw, &model, 16, 0.9, act);
        let without = kv_capacity_blocks(&hw, &model, 16, 0.9, 0);
        assert_eq!(without - with, (act as f64 / (16.0 * 131_072.0)).ceil() as u64);
    }
}
