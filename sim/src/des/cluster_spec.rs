//! What to simulate: the cluster's executors and their GPUs, the model, each executor's
//! scheduling core, the router's placement rule, the latency objective, and the
//! disaggregation and KV-tier settings (each the counterpart of one of Ferry's flags).

use ferry_roofline::{SimHardware, SimModel};
use ferry_sched_core::SchedulerConfig;

/// How the router places new requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Router {
    /// Ferry's: the longest cached prefix (exact) less `route_load_tokens` per live request,
    /// then the lightest load ([`ferry_sched_core::routing::pick`]).
    KvAware,
    /// The fewest live requests.
    LeastLoad,
    /// Each executor in turn.
    RoundRobin,
}

/// A latency objective: a request meets it when both hold.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Slo {
    /// Longest time to first token, seconds.
    pub ttft: f64,
    /// Longest mean time per output token after the first, seconds.
    pub tpot: f64,
}

/// Another base model served beside [`ClusterSpec::model`] by executors of its own (Ferry's
/// `--extra-model`, or a scheduler of several `--model`s): requests for it go to its executors
/// only, as the front routes by `model` first.
#[derive(Debug, Clone)]
pub struct ModelPool {
    /// Its name in the report.
    pub name: String,
    /// Its executors (placed after those before it).
    pub executors: usize,
    /// Each one's GPUs.
    pub hardware: SimHardware,
    /// The model.
    pub model: SimModel,
    /// Each one's scheduling core (its `num_blocks` from this model's KV capacity).
    pub scheduler: SchedulerConfig,
    /// The fraction of the requests that ask for it (the rest ask for the first model).
    pub share: f64,
}

/// What to simulate.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// Executors (model replicas) of `model`, all alike.
    pub executors: usize,
    /// Each one's GPUs.
    pub hardware: SimHardware,
    /// The model.
    pub model: SimModel,
    /// Its name in the report.
    pub model_name: String,
    /// Each one's scheduling core (its `num_blocks` from the profile's KV capacity).
    pub scheduler: SchedulerConfig,
    /// The placement rule.
    pub router: Router,
    /// Tokens of cached prefix one more live request outweighs (the front's
    /// `--route-load-tokens`; [`ferry_sched_core::routing::LOAD_TOKENS`] by default).
    pub route_load_tokens: usize,
    /// The latency objective of the goodput figure.
    pub slo: Slo,
    /// Check every core's invariants after every step (slow; for tests).
    pub check_invariants: bool,
    /// How many of the executors (the first ones) only prefill; 0: none, no disaggregation.
    pub prefill_executors: usize,
    /// Shortest uncached prompt worth disaggregating (the front's
    /// `--disaggregation-min-tokens`).
    pub disaggregation_min_tokens: usize,
    /// Fixed cost of a KV transfer on top of its bytes, seconds.
    pub transfer_latency: f64,
    /// The KV tier, if any: each executor's node agent keeps the blocks its finished requests
    /// computed, and a new request reads its prefix from any agent instead of computing it.
    pub kv_tier: Option<KvTier>,
    /// Scheduler shards (pools): the executors are shared among them by Ferry's assignment
    /// ([`ferry_sched_core::shards::assign`]) and a request goes to the shard whose best
    /// executor the router would pick, then to that executor (the fronts' cross-shard
    /// router). 1: one scheduler drives every executor.
    pub shards: usize,
    /// What each shard's scheduler process spends per streamed token and per request; `None`:
    /// nothing (the control plane is never the bottleneck).
    pub control_plane: Option<ControlPlane>,
    /// Data-parallel groups stepped in rounds (`--dp-size`); `None`: executors step alone.
    pub data_parallel: Option<super::DataParallel>,
    /// The model is looped (`--looped-layers`); `None`: plain. Its cores schedule stages
    /// (`scheduler.looped`), and each stage step costs its layers (the roofline's
    /// `stage_cost`).
    pub looped: Option<LoopedSim>,
    /// Other base models, each with executors of its own and a share of the requests.
    pub extra_models: Vec<ModelPool>,
}

impl ClusterSpec {
    /// Every model's pool, the first model's first.
    pub fn pools(&self) -> Vec<ModelPool> {
        let first_share = 1.0 - self.extra_models.iter().map(|p| p.share).sum::<f64>();
        let first = ModelPool {
            name: self.model_name.clone(),
            executors: self.executors,
            hardware: self.hardware,
            model: self.model,
            scheduler: self.scheduler.clone(),
            share: first_share,
        };
        std::iter::once(first).chain(self.extra_models.iter().cloned()).collect()
    }

    /// Checks the extra models: each with executors and a share in (0, 1), the shares below 1
    /// together, and none of what is simulated for one model only (disaggregation, the KV
    /// tier, shards, data-parallel groups, a looped model).
    ///
    /// # Errors
    ///
    /// What does not hold.
    pub fn check_models(&self) -> Result<(), String> {
        if self.extra_models.is_empty() {
            return Ok(());
        }
        for p in &self.extra_models {
            if p.executors == 0 || !(p.share > 0.0 && p.share < 1.0) {
                return Err(format!(
                    "model {}: {} executors and a share of {}; it needs executors and a share \
                     in (0, 1)",
                    p.name, p.executors, p.share
                ));
            }
        }
        let shares: f64 = self.extra_models.iter().map(|p| p.share).sum();
        if shares >= 1.0 {
            return Err(format!(
                "the extra models' shares add up to {shares}: the first model needs some"
            ));
        }
        let single = [
            (self.prefill_executors > 0, "prefill executors"),
            (self.kv_tier.is_some(), "a KV tier"),
            (self.shards > 1, "shards"),
            (self.data_parallel.is_some(), "data-parallel groups"),
            (self.looped.is_some(), "a looped model"),
        ];
        match single.iter().find(|(on, _)| *on) {
            Some((_, what)) => Err(format!("several models with {what} are not simulated")),
            None => Ok(()),
        }
    }
}

/// A looped model as the simulation runs it: its split, and the exit threshold every request
/// asks for (the `sim` backend's exit score after loop `l` is `l / (l + 1)`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoopedSim {
    /// End of the prelude's layers.
    pub prelude_end: u32,
    /// Start of the coda's layers.
    pub coda_start: u32,
    /// The requests' exit threshold; `None`: every token runs its loops.
    pub exit_threshold: Option<f32>,
}

impl LoopedSim {
    /// What a step running `op` runs of a model of `num_layers` layers.
    pub fn span(
        &self,
        op: ferry_sched_core::Operation,
        num_layers: u32,
    ) -> ferry_roofline::StageSpan {
        use ferry_sched_core::Operation;
        let (layers, head) = match op {
            Operation::Whole => (num_layers, true),
            Operation::Prelude => (self.prelude_end, false),
            Operation::Recurrent => (self.coda_start - self.prelude_end, false),
            Operation::Coda => (num_layers - self.coda_start, true),
        };
        ferry_roofline::StageSpan { layers, head }
    }

    /// Whether a chain leaves the loop after loop `l` (below its last).
    pub fn exits_after(&self, l: u8) -> bool {
        self.exit_threshold.is_some_and(|t| f32::from(l) / (f32::from(l) + 1.0) >= t)
    }
}

/// A scheduler process's CPU cost, as `ferry-bench control-plane` measures it: a shard's
/// scheduler handles its executors' step results one after another, so a step's tokens reach
/// their clients (and its executor steps again) only once the shard's CPU has streamed them.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ControlPlane {
    /// CPU seconds per streamed token.
    pub token_secs: f64,
    /// CPU seconds per request (tokenizing, placing, its first and last events).
    pub request_secs: f64,
}

/// The KV tier as the simulation models it (Ferry's `--kv-tier-*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvTier {
    /// Blocks each node's agent keeps (least recently used dropped first).
    pub blocks_per_agent: usize,
    /// Read a prefix from the tier when it covers at least this many tokens more than the
    /// executor's own cache (the front's `--kv-tier-min-tokens`).
    pub min_tokens: usize,
    /// Host-to-GPU bandwidth of a read from the executor's own node, GB/s (a read from another
    /// node's agent takes the network's).
    pub host_gbps: f64,
}
