//! The scheduler's and front's Prometheus metrics, under vLLM's names where one exists so the
//! dashboards operators already have for vLLM work (`vllm:num_requests_running`, …), and
//! Ferry's own (`ferry_*`) for what vLLM has no name for.
//!
//! Counters are fed as events happen (the step loops add the core's counter deltas after each
//! result; the front records request latencies); gauges are read from the live links at scrape
//! time. Every series carries `model_name`, as vLLM's do; per-executor gauges also `executor`.

use std::sync::Arc;

use ferry_proto::v1::KvFailure;
use ferry_runtime::metrics::{self, Counter, Histogram, Render, Text};
use ferry_sched_core::{FinishReason, SchedulerStats};
use tokio::sync::watch;

use crate::executors::ExecutorSet;

/// Finish reasons as vLLM's `vllm:request_success_total` labels them.
const REASONS: [&str; 4] = ["stop", "length", "abort", "error"];

/// Everything a scheduler process (or a front) counts.
pub struct SchedulerMetrics {
    /// Prefill tokens computed.
    pub prompt_tokens: Counter,
    /// Tokens generated.
    pub generation_tokens: Counter,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: Counter,
    /// Of those, found.
    pub prefix_hits: Counter,
    /// Preemptions.
    pub preemptions: Counter,
    success: [Counter; 4],
    /// Requests moved to another executor or scheduler after a failure.
    pub requests_moved: Counter,
    /// Executor sessions opened (first connections and reconnections).
    pub sessions_opened: Counter,
    /// Requests an executor refused (each failed alone).
    pub requests_refused: Counter,
    /// Time to first token, seconds.
    pub ttft: Histogram,
    /// Time between tokens, seconds.
    pub itl: Histogram,
    /// Arrival to finish, seconds.
    pub e2e: Histogram,
    /// Arrival to first scheduled, seconds.
    pub queue_time: Histogram,
    /// Step sent to result applied, seconds (all executors).
    pub step_duration: Histogram,
    /// KV transfers (exports and imports) an executor reported done.
    pub kv_transfers: Counter,
    /// KV transfers an executor reported failed, by [`KV_FAILURES`] index.
    pub kv_transfer_failures: [Counter; KV_FAILURES.len()],
    /// Bytes of KV the executors reported moved.
    pub kv_transfer_bytes: Counter,
    /// Duration of each KV transfer an executor reported done, seconds.
    pub kv_transfer_seconds: Histogram,
    /// Requests prefilled on a prefill executor and handed to a decode executor.
    pub disaggregated: Counter,
    /// Of those, handoffs whose decode executor recomputed the prompt (the KV did not arrive).
    pub handoffs_recomputed: Counter,
    /// Blocks executors wrote to their agents' stores (the KV tier).
    pub tier_stored_blocks: Counter,
    /// Writes to the KV tier that failed.
    pub tier_store_failures: Counter,
    /// Blocks imported from a KV-tier store instead of computed.
    pub tier_imported_blocks: Counter,
    /// KV-tier reads that failed (the prompt was computed instead).
    pub tier_import_failures: Counter,
    /// Requests placed with a KV-tier read of their prompt's prefix.
    pub tier_hits: Counter,
}

impl SchedulerMetrics {
    /// All zero.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            preemptions: Counter::default(),
            success: Default::default(),
            requests_moved: Counter::default(),
            sessions_opened: Counter::default(),
            requests_refused: Counter::default(),
            ttft: Histogram::new(metrics::TTFT_BUCKETS),
            itl: Histogram::new(metrics::ITL_BUCKETS),
            e2e: Histogram::new(metrics::REQUEST_BUCKETS),
            queue_time: Histogram::new(metrics::REQUEST_BUCKETS),
            step_duration: Histogram::new(metrics::STEP_BUCKETS),
            kv_transfers: Counter::default(),
            kv_transfer_failures: Default::default(),
            kv_transfer_bytes: Counter::default(),
            kv_transfer_seconds: Histogram::new(metrics::REQUEST_BUCKETS),
            disaggregated: Counter::default(),
            handoffs_recomputed: Counter::default(),
            tier_stored_blocks: Counter::default(),
            tier_store_failures: Counter::default(),
            tier_imported_blocks: Counter::default(),
            tier_import_failures: Counter::default(),
            tier_hits: Counter::default(),
        })
    }

    /// Counts a KV transfer an executor reported ended.
    pub fn kv_transfer(&self, result: &ferry_proto::v1::KvOperationResult) {
        if result.ok {
            self.kv_transfers.add(1);
            self.kv_transfer_bytes.add(result.bytes);
            self.kv_transfer_seconds.observe(result.duration_us as f64 / 1e6);
        } else {
            self.kv_transfer_failures[kv_failure(result.failure).0].add(1);
        }
    }

    /// Adds what the core counted between two snapshots of its stats.
    pub fn add_core_deltas(&self, before: &SchedulerStats, after: &SchedulerStats) {
        let d = |a: u64, b: u64| b.saturating_sub(a);
        self.prompt_tokens.add(d(before.prompt_tokens, after.prompt_tokens));
        self.generation_tokens.add(d(before.generation_tokens, after.generation_tokens));
        self.prefix_queries.add(d(before.prefix_cache_queries, after.prefix_cache_queries));
        self.prefix_hits.add(d(before.prefix_cache_hits, after.prefix_cache_hits));
        self.preemptions.add(d(before.num_preemptions, after.num_preemptions));
    }

    /// Counts a request that ended for `label`.
    pub fn finished(&self, label: FinishLabel) {
        self.success[label as usize].add(1);
    }

    /// Requests that ended for `label` so far.
    pub fn finished_count(&self, label: FinishLabel) -> u64 {
        self.success[label as usize].get()
    }
}

/// Why a KV transfer failed, as `ferry_kv_transfer_failures{reason}` labels it (`other`: an
/// executor that did not say).
pub const KV_FAILURES: [(KvFailure, &str); 10] = [
    (KvFailure::Unspecified, "other"),
    (KvFailure::Deadline, "deadline"),
    (KvFailure::Cancelled, "cancelled"),
    (KvFailure::Checksum, "checksum"),
    (KvFailure::AgentUnavailable, "agent_unavailable"),
    (KvFailure::Layout, "layout"),
    (KvFailure::StoreFull, "store_full"),
    (KvFailure::Malformed, "malformed"),
    (KvFailure::Executor, "executor"),
    (KvFailure::NotFound, "not_found"),
];

/// The place in [`KV_FAILURES`] of a reported `KvFailure` code, and its label (`other` for
/// a code this scheduler does not know).
pub fn kv_failure(code: i32) -> (usize, &'static str) {
    KV_FAILURES
        .iter()
        .position(|(f, _)| *f as i32 == code)
        .map_or((0, "other"), |i| (i, KV_FAILURES[i].1))
}

/// How a request ended, in vLLM's words (`vllm:request_success_total{finished_reason}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishLabel {
    /// An EOS, a stop token or a stop string.
    Stop = 0,
    /// `max_tokens` or the model's length.
    Length = 1,
    /// The client went away or asked to abort.
    Abort = 2,
    /// It could not be run (its executor was lost and none took it, or an error).
    Error = 3,
}

impl FinishLabel {
    /// vLLM's label value.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishLabel::Stop => "stop",
            FinishLabel::Length => "length",
            FinishLabel::Abort => "abort",
            FinishLabel::Error => "error",
        }
    }
}

impl From<FinishReason> for FinishLabel {
    fn from(reason: FinishReason) -> Self {
        match reason {
            FinishReason::Stop(_) => FinishLabel::Stop,
            FinishReason::Length => FinishLabel::Length,
            FinishReason::Abort => FinishLabel::Abort,
            FinishReason::Error | FinishReason::Transferred => FinishLabel::Error,
        }
    }
}

/// What `/metrics` shows: the counters, and gauges read from the live state.
pub struct MetricsView {
    /// The served model (every series' `model_name`).
    pub model_name: String,
    /// The counters.
    pub metrics: Arc<SchedulerMetrics>,
    /// The executors driven here (none for a front alone).
    pub executors: Option<Arc<ExecutorSet>>,
    /// Leadership, with etcd.
    pub leading: Option<watch::Receiver<Option<u64>>>,
    /// The API keys, when the client APIs need one.
    pub keys: Option<Arc<crate::front::keys::ApiKeys>>,
}

impl Render for MetricsView {
    fn render(&self, t: &mut Text) {
        let m = [("model_name", self.model_name.as_str())];
        self.render_executors(t, &m);
        self.render_leadership(t, &m);
        self.render_totals(t, &m);
        self.render_keys(t, &m);
    }
}

impl MetricsView {
    /// Per-API-key counters, labelled with the key's id (never the key).
    fn render_keys(&self, t: &mut Text, m: &[(&str, &str); 1]) {
        use crate::front::keys::{ApiKey, Limit};
        type Pick = fn(&ApiKey) -> f64;
        let Some(keys) = &self.keys else { return };
        t.counter(
            "ferry_api_unauthenticated",
            "Calls refused for want of a valid API key.",
            m,
            keys.unauthenticated.get() as f64,
        );
        let per_key: [(&str, &str, &str, Pick); 3] = [
            ("ferry_api_key_requests", "counter", "Requests admitted, by API key id.", |k| {
                k.admitted.get() as f64
            }),
            (
                "ferry_api_key_tokens",
                "counter",
                "Tokens charged (prompt + max_tokens), by API key id.",
                |k| k.tokens.get() as f64,
            ),
            ("ferry_api_key_running", "gauge", "Requests running, by API key id.", |k| {
                f64::from(k.running())
            }),
        ];
        for (name, kind, help, pick) in per_key {
            t.family(name, kind, help);
            for k in keys.keys() {
                t.sample(name, &[m[0], ("api_key", &k.id)], pick(k));
            }
        }
        let name = "ferry_api_key_refused";
        t.family(name, "counter", "Requests refused over a limit, by API key id and limit.");
        for k in keys.keys() {
            for limit in Limit::ALL {
                let labels = [m[0], ("api_key", &*k.id), ("limit", limit.label())];
                t.sample(name, &labels, k.refused[limit as usize].get() as f64);
            }
        }
    }

    /// Per-executor gauges, read from the live links.
    fn render_executors(&self, t: &mut Text, m: &[(&str, &str); 1]) {
        if let Some(set) = &self.executors {
            type Pick = fn(&SchedulerStats) -> f64;
            let links = set.alive();
            let stats: Vec<(String, SchedulerStats)> =
                links.iter().map(|l| (l.name.to_string(), l.stats())).collect();
            let gauges: [(&str, &str, Pick); 3] = [
                ("vllm:num_requests_running", "Requests running on the executor.", |s| {
                    s.num_running as f64
                }),
                ("vllm:num_requests_waiting", "Requests waiting to be admitted.", |s| {
                    s.num_waiting as f64
                }),
                (
                    "vllm:kv_cache_usage_perc",
                    "Fraction of KV cache blocks in use (1 = full).",
                    |s| s.kv_usage,
                ),
            ];
            for (name, help, pick) in gauges {
                t.family(name, "gauge", help);
                for (exec, s) in &stats {
                    t.sample(name, &[m[0], ("executor", exec)], pick(s));
                }
            }
            t.gauge("ferry_executors_connected", "Executor sessions up.", m, links.len() as f64);
        }
    }

    /// Whether this process leads its pool, and under which epoch.
    fn render_leadership(&self, t: &mut Text, m: &[(&str, &str); 1]) {
        if let Some(leading) = &self.leading {
            let epoch = *leading.borrow();
            t.gauge(
                "ferry_scheduler_leader",
                "1 while this scheduler leads its pool (holds its etcd election lease).",
                m,
                f64::from(u8::from(epoch.is_some())),
            );
            t.gauge(
                "ferry_scheduler_epoch",
                "The leadership epoch (election revision) while leading, else 0.",
                m,
                epoch.unwrap_or(0) as f64,
            );
        }
    }

    /// KV transfers, disaggregation and the KV tier.
    fn render_kv(&self, t: &mut Text, m: &[(&str, &str); 1]) {
        let counters: [(&str, &str, &Counter); 9] = [
            (
                "ferry_kv_transfers",
                "KV transfers (exports and imports) executors reported done.",
                &self.metrics.kv_transfers,
            ),
            (
                "ferry_kv_transfer_bytes",
                "Bytes of KV executors reported moved.",
                &self.metrics.kv_transfer_bytes,
            ),
            (
                "ferry_requests_disaggregated",
                "Requests prefilled on a prefill executor and handed to a decode executor.",
                &self.metrics.disaggregated,
            ),
            (
                "ferry_handoffs_recomputed",
                "Handoffs whose decode executor recomputed the prompt (its KV did not arrive).",
                &self.metrics.handoffs_recomputed,
            ),
            (
                "ferry_kv_tier_stored_blocks",
                "KV blocks executors wrote to their node's agent (the KV tier).",
                &self.metrics.tier_stored_blocks,
            ),
            (
                "ferry_kv_tier_store_failures",
                "Writes of KV blocks to an agent that failed.",
                &self.metrics.tier_store_failures,
            ),
            (
                "ferry_kv_tier_hits",
                "Requests placed to read their prompt's prefix from a KV-tier store.",
                &self.metrics.tier_hits,
            ),
            (
                "ferry_kv_tier_imported_blocks",
                "KV blocks read from a KV-tier store instead of computed.",
                &self.metrics.tier_imported_blocks,
            ),
            (
                "ferry_kv_tier_import_failures",
                "KV-tier reads that failed (the prompt was computed instead).",
                &self.metrics.tier_import_failures,
            ),
        ];
        for (name, help, c) in counters {
            t.counter(name, help, m, c.get() as f64);
        }
        if let Some(set) = &self.executors {
            t.gauge(
                "ferry_kv_tier_indexed_blocks",
                "KV blocks the KV tier's index says the agents hold.",
                m,
                set.tier.total() as f64,
            );
        }
        if let Some(n) = self.executors.as_ref().and_then(|set| set.agents.count()) {
            t.gauge(
                "ferry_kv_agents_registered",
                "KV agents registered in etcd (transfers go only to these).",
                m,
                n as f64,
            );
        }
        t.family(
            "ferry_kv_transfer_failures",
            "counter",
            "KV transfers executors reported failed, by reason.",
        );
        for ((_, reason), c) in KV_FAILURES.iter().zip(&self.metrics.kv_transfer_failures) {
            t.sample("ferry_kv_transfer_failures", &[m[0], ("reason", reason)], c.get() as f64);
        }
    }

    /// Counters and histograms.
    fn render_totals(&self, t: &mut Text, m: &[(&str, &str); 1]) {
        let counters: [(&str, &str, &Counter); 8] = [
            ("vllm:prompt_tokens_total", "Prefill tokens computed.", &self.metrics.prompt_tokens),
            ("vllm:generation_tokens_total", "Tokens generated.", &self.metrics.generation_tokens),
            (
                "vllm:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
                &self.metrics.prefix_queries,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache.",
                &self.metrics.prefix_hits,
            ),
            ("vllm:num_preemptions_total", "Requests preempted.", &self.metrics.preemptions),
            (
                "ferry_requests_moved",
                "Requests moved after their executor or scheduler failed.",
                &self.metrics.requests_moved,
            ),
            (
                "ferry_executor_sessions_opened",
                "Executor sessions opened (reconnections included).",
                &self.metrics.sessions_opened,
            ),
            (
                "ferry_requests_refused",
                "Requests an executor refused (each failed alone, its session kept).",
                &self.metrics.requests_refused,
            ),
        ];
        for (name, help, c) in counters {
            t.counter(name, help, m, c.get() as f64);
        }
        self.render_kv(t, m);
        t.family("vllm:request_success_total", "counter", "Finished requests by finish reason.");
        for (reason, c) in REASONS.iter().zip(&self.metrics.success) {
            t.sample(
                "vllm:request_success_total",
                &[m[0], ("finished_reason", reason)],
                c.get() as f64,
            );
        }
        let histograms: [(&str, &str, &Histogram); 6] = [
            ("vllm:time_to_first_token_seconds", "Time to first token.", &self.metrics.ttft),
            ("vllm:inter_token_latency_seconds", "Time between tokens.", &self.metrics.itl),
            (
                "vllm:e2e_request_latency_seconds",
                "Request latency, arrival to finish.",
                &self.metrics.e2e,
            ),
            (
                "vllm:request_queue_time_seconds",
                "Time waiting before first scheduled.",
                &self.metrics.queue_time,
            ),
            (
                "ferry_step_duration_seconds",
                "Step sent to its result applied.",
                &self.metrics.step_duration,
            ),
            (
                "ferry_kv_transfer_seconds",
                "Duration of each KV transfer an executor reported done.",
                &self.metrics.kv_transfer_seconds,
            ),
        ];
        for (name, help, h) in histograms {
            h.render(t, name, help, m);
        }
    }
}
