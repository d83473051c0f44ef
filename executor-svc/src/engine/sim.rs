//! The roofline timing model behind the `sim` backend (DESIGN.md section 5): how long a GPU
//! executor would take for a step, how many KV blocks it would hold, and which tokens it emits,
//! so many simulated GPUs can run on one machine and the scheduler can be exercised at scale.
//!
//! A step is the batch's new tokens, each item with its cached context. With `tp` the
//! tensor-parallel degree, `ce`/`be` the compute and bandwidth efficiencies:
//!
//! ```text
//! duration = overhead + max(compute, memory) + communication
//! compute  = FLOPs / (tflops * 1e12 * ce * tp)
//!   FLOPs  = 2 * layer_params * new_tokens                   (projections and MLP)
//!          + 2 * hidden * vocab * items                       (LM head, one row per item)
//!          + 4 * layers * heads * head_dim * attended         (QK^T and PV)
//!   attended = sum over items of n * c + n * (n + 1) / 2     (causal, n new, c cached)
//! memory   = (weight_bytes + kv_bytes_per_token * (c + n)) / (bandwidth * 1e9 * be * tp)
//!                                                             (read the context, write the new)
//! communication (tp > 1 only, not overlapped)
//!          = 2 * layers * (allreduce_latency
//!                          + 2 * (tp - 1) / tp * hidden * new_tokens * 2 bytes / interconnect)
//! ```
//!
//! Weights and KV heads are sharded evenly over the `tp` GPUs, which is why `tp` divides both
//! terms; the communication is a ring all-reduce of bf16 activations after attention and after
//! the MLP of every layer. Activations, kernel launch gaps and the sampler are folded into
//! `overhead_us` and the efficiencies. The model guarantees: no panic for any input (a degenerate
//! configuration gives `Duration::MAX`, not a division by zero; [`SimHardware::validate`] says
//! why), and monotonicity: more new tokens or a longer context never make a step faster.
//!
//! Tokens come from [`sim_token`], a hash of (seed, position) like the real sampler's draws, so
//! a simulated request is reproducible across preemption and failover.

use std::time::Duration;

use super::sampling::position_hash;

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
    /// MLP width (each of gate, up and down in a `SwiGLU` MLP).
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
        };
        let embeddings = 2.0 * f64::from(vocab_size) * f64::from(hidden);
        let params = model.layer_params() * f64::from(num_layers) + embeddings;
        model.weight_bytes = (params * bytes_per_weight.max(0.0)) as u64;
        model
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
        positive("kv_bytes_per_elem", f64::from(self.kv_bytes_per_elem))
    }

    /// Matmul parameters of one layer: Q, K, V, O projections and the three MLP matrices.
    pub fn layer_params(&self) -> f64 {
        let hidden = f64::from(self.hidden);
        let q = f64::from(self.num_heads) * f64::from(self.head_dim);
        let kv = f64::from(self.num_kv_heads) * f64::from(self.head_dim);
        hidden * (2.0 * q + 2.0 * kv) + 3.0 * hidden * f64::from(self.intermediate)
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
    let flops = 2.0 * model.layer_params() * layers * tokens
        + 2.0 * hidden * f64::from(model.vocab_size) * rows
        + 4.0 * layers * f64::from(model.num_heads) * f64::from(model.head_dim) * attended;
    let bytes = model.weight_bytes as f64 + model.kv_bytes_per_token() as f64 * kv_tokens;
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
/// `gpu_memory_utilization` (clamped to [0, 1]), after the GPU's shard of the weights. Every
/// GPU of a TP group holds its shard of every block, so this is also the group's block count.
/// Activation workspace is not deducted: the headroom above `gpu_memory_utilization` covers it.
pub fn kv_capacity_blocks(
    hw: &SimHardware,
    model: &SimModel,
    block_size: u32,
    gpu_memory_utilization: f64,
) -> u64 {
    let tp = hw.tp();
    let utilization =
        if gpu_memory_utilization.is_nan() { 0.0 } else { gpu_memory_utilization.clamp(0.0, 1.0) };
    let free = hw.mem_bytes as f64 * utilization - model.weight_bytes as f64 / tp;
    let block_bytes = f64::from(block_size) * model.kv_bytes_per_token() as f64 / tp;
    if free <= 0.0 || block_bytes <= 0.0 {
        return 0;
    }
    (free / block_bytes).floor() as u64
}

/// The simulated token at `position` of a request seeded with `seed`: uniform over
/// `0..vocab_size` and a function of (seed, position) only. It may be the model's EOS id, which
/// ends the request early; use [`sim_token_except`] to rule that out. A vocabulary of 0 yields 0.
pub fn sim_token(seed: u64, position: u64, vocab_size: u32) -> u32 {
    // Salted so a simulated request's tokens are not its sampler draws in disguise.
    let hash = position_hash(seed ^ 0x5EED_0F51_u64, position);
    // Multiply-shift maps the hash onto 0..vocab_size without a modulo; the result is < vocab.
    ((u128::from(hash) * u128::from(vocab_size)) >> 64) as u32
}

/// As [`sim_token`], but never `avoid` (typically EOS): uniform over the other ids. When
/// `avoid` is the only id (a vocabulary of 1) or outside the vocabulary, it is [`sim_token`].
pub fn sim_token_except(seed: u64, position: u64, vocab_size: u32, avoid: u32) -> u32 {
    if avoid >= vocab_size || vocab_size < 2 {
        return sim_token(seed, position, vocab_size);
    }
    let token = sim_token(seed, position, vocab_size - 1);
    if token >= avoid {
        token + 1
    } else {
        token
    }
}

/// Where a simulated executor's time goes. Pure: it never reads a clock or sleeps itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimClock {
    /// Steps take wall-clock time: the caller sleeps for what [`SimClock::advance`] returns.
    RealTime,
    /// Steps take no wall-clock time; a virtual clock accumulates their durations.
    Virtual {
        /// Virtual time since the clock started.
        now: Duration,
    },
}

impl SimClock {
    /// A virtual clock at time zero.
    pub fn virtual_at_zero() -> Self {
        Self::Virtual { now: Duration::ZERO }
    }

    /// Accounts for a step of `step`; returns how long the caller must sleep (the step in real
    /// time, zero in virtual time). Virtual time saturates rather than overflows.
    pub fn advance(&mut self, step: Duration) -> Duration {
        match self {
            Self::RealTime => step,
            Self::Virtual { now } => {
                *now = now.saturating_add(step);
                Duration::ZERO
            }
        }
    }

    /// The virtual time, or `None` in real time (where the caller's `Instant` is the clock).
    pub fn now(&self) -> Option<Duration> {
        match self {
            Self::RealTime => None,
            Self::Virtual { now } => Some(*now),
        }
    }
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
        let blocks = kv_capacity_blocks(&hw, &model, 16, 0.9);
        assert!((7000..8500).contains(&blocks), "{blocks}");
        assert!(kv_capacity_blocks(&hw, &model, 16, 0.5) < blocks);
        assert!(kv_capacity_blocks(&hw, &model, 32, 0.9) <= blocks / 2);
        // A shard of the weights frees room: two GPUs hold more than twice the blocks.
        assert!(kv_capacity_blocks(&hw.with_tensor_parallel(2), &model, 16, 0.9) > 2 * blocks);
        // 70B-sized weights do not fit one L4; nonsense inputs give zero.
        let huge = SimModel { weight_bytes: 140_000_000_000, ..model };
        assert_eq!(kv_capacity_blocks(&SimHardware::l4(), &huge, 16, 0.9), 0);
        assert_eq!(kv_capacity_blocks(&hw, &model, 0, 0.9), 0);
        assert_eq!(kv_capacity_blocks(&hw, &model, 16, f64::NAN), 0);
        assert_eq!(
            kv_capacity_blocks(&hw, &model, 16, 7.0),
            kv_capacity_blocks(&hw, &model, 16, 1.0)
        );
    }

    #[test]
    fn tokens_are_deterministic_in_range_and_spread() {
        let vocab = 49_152;
        let tokens: Vec<u32> = (0..10_000).map(|p| sim_token(3, p, vocab)).collect();
        assert!(tokens.iter().all(|&t| t < vocab));
        assert_eq!(tokens, (0..10_000).map(|p| sim_token(3, p, vocab)).collect::<Vec<_>>());
        let distinct: std::collections::HashSet<_> = tokens.iter().collect();
        assert!(distinct.len() > 8000, "{}", distinct.len());
        assert_ne!(tokens, (0..10_000).map(|p| sim_token(4, p, vocab)).collect::<Vec<_>>());
        for vocab in [1, 2, 3, 7] {
            assert!((0..1000).all(|p| sim_token(9, p, vocab) < vocab));
        }
        assert_eq!(sim_token(1, 2, 0), 0);
    }

    #[test]
    fn tokens_can_avoid_eos() {
        let (vocab, eos) = (5, 2);
        let mut seen = [0u32; 5];
        for position in 0..5000 {
            seen[sim_token_except(11, position, vocab, eos) as usize] += 1;
        }
        assert_eq!(seen[2], 0);
        assert!(seen.iter().enumerate().all(|(t, &n)| t == 2 || n > 1000), "{seen:?}");
        assert!((0..100).any(|p| sim_token(11, p, vocab) == eos));
        assert_eq!(sim_token_except(1, 1, 1, 0), 0);
        assert_eq!(sim_token_except(1, 1, 10, 99), sim_token(1, 1, 10));
    }

    #[test]
    fn clocks_account_for_steps() {
        let step = Duration::from_millis(7);
        let mut real = SimClock::RealTime;
        assert_eq!(real.advance(step), step);
        assert_eq!(real.now(), None);
        let mut virt = SimClock::virtual_at_zero();
        assert_eq!(virt.advance(step), Duration::ZERO);
        assert_eq!(virt.advance(step), Duration::ZERO);
        assert_eq!(virt.now(), Some(2 * step));
        virt.advance(Duration::MAX);
        assert_eq!(virt.now(), Some(Duration::MAX));
    }
}
