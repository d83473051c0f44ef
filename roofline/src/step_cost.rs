//! A step's cost in the roofline timing model (DESIGN.md section 5): how long a GPU executor
//! would take for a step, so many simulated GPUs can run on one machine —
//! as `sim` executors against the real control plane, or in virtual time in `ferry-sim`.
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
//! batch: prefill chunks and decodes share one read of the weights, and their FLOPs add up.
//! The model guarantees: no panic for any input (a degenerate configuration gives
//! `Duration::MAX`, not a division by zero; [`SimHardware::validate`] says why), and
//! monotonicity: more new tokens or a longer context never make a step faster.

use std::time::Duration;

use crate::hardware::SimHardware;
use crate::model_shape::SimModel;

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

/// What a looped model's stage runs of its model: some of its layers, and the output head or
/// not (only the coda has it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageSpan {
    /// Layers the stage runs.
    pub layers: u32,
    /// It ends with the output head (the coda).
    pub head: bool,
}

/// The cost of one stage of a looped model's step: the step's terms for the stage's layers
/// alone — their FLOPs, their share of the weights read (at the model's bytes per
/// parameter), their KV — and the output head's only when the stage has it.
pub fn stage_cost(
    hw: &SimHardware,
    model: &SimModel,
    items: &[SimBatchItem],
    span: StageSpan,
) -> StepCost {
    if span.layers == model.num_layers && span.head {
        return step_cost(hw, model, items);
    }
    let per_param = model.weight_bytes as f64 / model.total_params().max(1.0);
    let mut staged = SimModel { num_layers: span.layers, ..*model };
    if !span.head {
        staged.vocab_size = 0;
    }
    staged.weight_bytes = (per_param * staged.total_params()) as u64;
    step_cost(hw, &staged, items)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Profiles;
    use crate::validation::SimConfigError;

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1e3
    }

    #[test]
    fn a_looped_models_stages_cost_their_layers_share_and_add_up_to_a_step() {
        let (hw, model) = (SimHardware::h100_80g(), SimModel::llama2_7b());
        let batch = [SimBatchItem::decode(512); 8];
        let whole = step_cost(&hw, &model, &batch);
        let stage = |layers, head| stage_cost(&hw, &model, &batch, StageSpan { layers, head });
        let all = stage(model.num_layers, true);
        assert_eq!(all, whole, "every layer and the head is the plain step");
        let (prelude, loop_, coda) = (stage(2, false), stage(28, false), stage(2, true));
        assert!(loop_.total() > prelude.total() && coda.total() > prelude.total());
        // Without the fixed overhead, one loop's stages sum to the whole step's roofline terms
        // within the head's and the split's rounding.
        let body = |c: StepCost| c.total().saturating_sub(c.overhead);
        let parts = body(prelude) + body(loop_) + body(coda);
        let ratio = parts.as_secs_f64() / body(whole).as_secs_f64();
        assert!((0.97..1.03).contains(&ratio), "stages {parts:?} against a step {:?}", body(whole));
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

    /// Two batches of Llama-3-8B (bf16) on an H100, worked by hand from the module doc's
    /// formulas. The model: 32 layers, hidden 4096, MLP 14336, 32 query and 8 KV heads of 128,
    /// vocabulary 128256; per layer 4096 x (2 x 4096 + 2 x 1024) = 41,943,040 attention and
    /// 3 x 4096 x 14336 = 176,160,768 MLP parameters (218,103,808); weights
    /// (218,103,808 x 32 + 2 x 128256 x 4096) x 2 bytes = 16,059,990,016 bytes; KV
    /// 2 x 32 x 8 x 128 x 2 = 131,072 bytes a token. The GPU: 989.4 TFLOP/s at 60 %,
    /// 3350 GB/s at 80 %, 150 µs a step.
    #[test]
    fn step_times_equal_the_hand_worked_roofline() {
        let p = Profiles::built_in();
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
        let p = Profiles::built_in();
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
}
