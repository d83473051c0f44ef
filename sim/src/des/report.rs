//! What a run measured: throughput, goodput against the SLO, latency percentiles, prefix-cache,
//! preemption, disaggregation and KV-tier figures ([`Report`]), with the distributions and the
//! timeline behind them for plots ([`Detail`]).
//!
//! The figures are in virtual time except `wall_seconds` and `speedup`, so the same inputs give
//! the same report but for those two.

use crate::stats::Histogram;

use super::cluster_spec::{Router, Slo};
use super::Sim;

/// Percentiles of one latency, seconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Latency {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl Latency {
    fn of(h: &Histogram) -> Self {
        Self {
            mean: h.mean(),
            p50: h.quantile(0.5),
            p90: h.quantile(0.9),
            p99: h.quantile(0.99),
            max: h.max(),
        }
    }
}

/// What a run measured of one model's requests (with several models).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModelReport {
    /// The model.
    pub name: String,
    /// Its executors.
    pub executors: usize,
    /// Requests that asked for it.
    pub requests: u64,
    /// Requests its executors finished (all of `requests` but the refused: requests go only
    /// to their model's executors).
    pub finished: u64,
    /// Its output tokens per virtual second (over the run's makespan).
    pub output_tokens_per_s: f64,
    /// Its requests' arrival to first token.
    pub ttft: Latency,
}

/// What a run measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    /// Each model's part, with several models (none with one).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<ModelReport>,
    /// Executors simulated.
    pub executors: usize,
    /// Scheduler shards they were shared among.
    pub shards: usize,
    /// The busiest shard scheduler's CPU, as a fraction of the run (0 without a control-plane
    /// cost).
    pub scheduler_cpu_busy: f64,
    /// KV blocks per executor.
    pub blocks_per_executor: usize,
    /// The router.
    pub router: Router,
    /// Requests that arrived.
    pub requests: u64,
    /// Requests that finished.
    pub finished: u64,
    /// Requests an executor refused (longer than its `max_model_len`, or than its cache).
    pub rejected: u64,
    /// Virtual seconds from the first arrival to the last finish.
    pub makespan: f64,
    /// Data-parallel groups' rounds run (0 without groups).
    pub dp_rounds: u64,
    /// Steps whose prefills a data-parallel group's throttle held back.
    pub prefills_deferred: u64,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: u64,
    /// Output tokens of finished requests.
    pub output_tokens: u64,
    /// Output tokens per virtual second.
    pub output_tokens_per_s: f64,
    /// Finished requests per virtual second.
    pub requests_per_s: f64,
    /// Requests per virtual second that met the SLO.
    pub goodput: f64,
    /// The SLO.
    pub slo: Slo,
    /// Arrival to first token.
    pub ttft: Latency,
    /// Mean time per output token after the first, per request.
    pub tpot: Latency,
    /// Gap between consecutive tokens of a request.
    pub itl: Latency,
    /// Arrival to the last token.
    pub e2e: Latency,
    /// Prompt tokens served from a prefix cache over prompt tokens looked up.
    pub prefix_hit_rate: f64,
    /// Prompt tokens the executors computed (prefix-cache hits and imports excluded,
    /// recomputation after preemption included): above `prompt_tokens` less the hits, the
    /// excess is work preemption wasted.
    pub computed_prompt_tokens: u64,
    /// Preemptions, all executors.
    pub preemptions: u64,
    /// Steps, all executors.
    pub steps: u64,
    /// Fraction of the time executors were running a step.
    pub busy_fraction: f64,
    /// Mean fraction of KV blocks held, weighted by time, over busy executors.
    pub kv_usage_mean: f64,
    /// Largest fraction of KV blocks held by any executor at a step.
    pub kv_usage_max: f64,
    /// Requests whose prompt was computed on a prefill executor and moved.
    pub disaggregated: u64,
    /// Requests that read a prefix from the KV tier, and the tokens those reads covered.
    pub tier_reads: u64,
    /// See `tier_reads`.
    pub tier_read_tokens: u64,
    /// Tier reads that failed (their blocks were evicted from the agent before the read).
    pub tier_read_failures: u64,
    /// Blocks written to the KV tier.
    pub tier_writes: u64,
    /// KV bytes moved between executors.
    pub transfer_bytes: u64,
    /// Mean seconds a KV transfer took.
    pub transfer_seconds_mean: f64,
    /// Wall-clock seconds the simulation took.
    pub wall_seconds: f64,
    /// Virtual seconds simulated per wall-clock second.
    pub speedup: f64,
    /// The distributions and the timeline behind the figures (for plots; not in the JSON).
    #[serde(skip)]
    pub detail: Detail,
}

/// The distributions behind a report's percentiles, and what happened over time.
#[derive(Clone, PartialEq, Default)]
pub struct Detail {
    /// Time to first token.
    pub ttft: Histogram,
    /// Time per output token.
    pub tpot: Histogram,
    /// Inter-token gaps.
    pub itl: Histogram,
    /// End-to-end latency.
    pub e2e: Histogram,
    /// The run by windows of virtual time.
    pub timeline: Timeline,
}

impl std::fmt::Debug for Detail {
    /// Counts only: the histograms have thousands of buckets.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Detail")
            .field("ttft_samples", &self.ttft.count())
            .field("itl_samples", &self.itl.count())
            .field("timeline_windows", &self.timeline.tokens.len())
            .finish_non_exhaustive()
    }
}

/// A run by windows of [`Timeline::WINDOW`] virtual seconds.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Timeline {
    /// Tokens generated in each window.
    pub tokens: Vec<u64>,
    /// Requests in the cluster at the last step end of each window.
    pub live: Vec<u64>,
    /// Sum and count of executors' KV usage at their step ends in each window.
    pub kv: Vec<(f64, u64)>,
}

impl Timeline {
    /// Virtual seconds per window.
    pub const WINDOW: f64 = 1.0;

    fn at(&mut self, secs: f64) -> usize {
        let i = (secs / Self::WINDOW) as usize;
        if self.tokens.len() <= i {
            let last_live = self.live.last().copied().unwrap_or(0);
            self.tokens.resize(i + 1, 0);
            self.live.resize(i + 1, last_live);
            self.kv.resize(i + 1, (0.0, 0));
        }
        i
    }

    pub(super) fn step(&mut self, secs: f64, tokens: u64, live: u64, kv_usage: f64) {
        let i = self.at(secs);
        self.tokens[i] += tokens;
        self.live[i] = live;
        self.kv[i].0 += kv_usage;
        self.kv[i].1 += 1;
    }
}

impl Sim<'_> {
    /// The report of the run so far, which took `wall_seconds` of wall-clock time.
    pub(super) fn report(&self, wall_seconds: f64) -> Report {
        let makespan =
            self.last_finish.saturating_sub(self.first_arrival.unwrap_or(0)) as f64 / 1e9;
        let per_s = |n: u64| if makespan > 0.0 { n as f64 / makespan } else { 0.0 };
        let (mut queries, mut hits, mut preemptions, mut steps, mut computed) = (0, 0, 0, 0, 0);
        let mut deferred = 0;
        for x in &self.execs {
            let s = x.core.stats();
            deferred += s.prefills_deferred;
            computed += s.prompt_tokens;
            queries += s.prefix_cache_queries;
            hits += s.prefix_cache_hits;
            preemptions += s.num_preemptions;
            steps += s.steps;
        }
        let execs = self.execs.len() as f64;
        let models = if self.pools.len() == 1 {
            Vec::new()
        } else {
            let part = |(p, c): (&super::ModelPool, &super::ModelCounts)| ModelReport {
                name: p.name.clone(),
                executors: p.executors,
                requests: c.requests,
                finished: c.finished,
                output_tokens_per_s: per_s(c.output_tokens),
                ttft: Latency::of(&c.ttft),
            };
            self.pools.iter().zip(&self.by_model).map(part).collect()
        };
        Report {
            models,
            executors: self.execs.len(),
            shards: self.spec.shards,
            scheduler_cpu_busy: if makespan > 0.0 {
                self.cpu_busy.iter().fold(0.0, |a: f64, &b| a.max(b)) / makespan
            } else {
                0.0
            },
            blocks_per_executor: self.spec.scheduler.num_blocks,
            router: self.spec.router,
            requests: self.arrived,
            finished: self.finished,
            rejected: self.rejected,
            makespan,
            dp_rounds: self.dp_rounds,
            prefills_deferred: deferred,
            prompt_tokens: self.prompt_tokens,
            output_tokens: self.output_tokens,
            output_tokens_per_s: per_s(self.output_tokens),
            requests_per_s: per_s(self.finished),
            goodput: per_s(self.met_slo),
            slo: self.spec.slo,
            ttft: Latency::of(&self.ttft),
            tpot: Latency::of(&self.tpot),
            itl: Latency::of(&self.itl),
            e2e: Latency::of(&self.e2e),
            prefix_hit_rate: if queries > 0 { hits as f64 / queries as f64 } else { 0.0 },
            computed_prompt_tokens: computed,
            preemptions,
            steps,
            busy_fraction: if makespan > 0.0 { self.busy_secs / (makespan * execs) } else { 0.0 },
            kv_usage_mean: if self.busy_secs > 0.0 {
                self.kv_weighted / self.busy_secs
            } else {
                0.0
            },
            kv_usage_max: self.kv_max,
            disaggregated: self.disaggregated,
            tier_reads: self.tier_reads,
            tier_read_tokens: self.tier_read_tokens,
            tier_read_failures: self.tier_read_failures,
            tier_writes: self.tier_writes,
            transfer_bytes: self.transfer_bytes,
            transfer_seconds_mean: if self.transfers_done > 0 {
                self.transfer_secs / self.transfers_done as f64
            } else {
                0.0
            },
            wall_seconds,
            speedup: if wall_seconds > 0.0 { makespan / wall_seconds } else { 0.0 },
            detail: Detail {
                ttft: self.ttft.clone(),
                tpot: self.tpot.clone(),
                itl: self.itl.clone(),
                e2e: self.e2e.clone(),
                timeline: self.timeline.clone(),
            },
        }
    }
}
