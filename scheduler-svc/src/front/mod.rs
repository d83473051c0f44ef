//! The front: the client API (`ferry.v1.Generation`; the OpenAI HTTP API translates to it).
//! It checks and tokenizes requests ([`prepare`]), places each where it runs ([`placement`]),
//! and streams its text back ([`stream`]: stop strings applied, a lost request moved). A client
//! that goes away aborts its request, which frees its blocks.
//!
//! The request path by file: `http/openai.rs` (OpenAI JSON) → this module's `generate` →
//! `prepare.rs` (tokenize, check) → `placement.rs` (pick an executor link) →
//! `link/step_loop.rs` (the core schedules it; steps go to the executor) → back as link events
//! → `stream.rs` (detokenize, `text.rs`) → the client.
//!
//! Failover: the front journals each live stream — its spec and the tokens already delivered.
//! When where it runs is lost, the continuation (prompt + delivered tokens, as prior output) is
//! placed again; seeded sampling and greedy decoding continue exactly, so the client sees one
//! stream with no repeated and no missing token.

pub mod adapters;
mod admission;
pub mod client_stream;
mod disagg;
mod generation;
pub mod keys;
pub mod models;
pub mod placement;
pub mod prepare;
pub mod remote;
pub(crate) mod router;
mod settings;
pub mod shards;
pub mod stream;
#[cfg(test)]
pub(crate) mod tests;
pub mod text;
pub mod trace;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::executors::ExecutorSet;
use crate::metrics::{CounterView, SchedulerMetrics};
pub use adapters::{LoraModule, LoraSettings};
pub use admission::MAX_SAMPLES;
use models::Models;
use placement::Placement;
pub use prepare::RequestLimits;
pub use settings::FrontSettings;

/// Where a front sends its requests.
pub enum Route {
    /// Executors this process drives (the scheduler role, and `serve`).
    Local(Arc<ExecutorSet>),
    /// The scheduler shards' leaders, followed through etcd (a front in its own process).
    Remote(Arc<shards::Shards>),
}

/// Shared front state.
pub struct Front {
    models: Models,
    route: Route,
    metrics: Arc<SchedulerMetrics>,
    settings: FrontSettings,
    /// The next id a request gets in an executor's core (each placement takes one).
    next_id: std::sync::atomic::AtomicU64,
    /// The next KV transfer id (prefill/decode handoffs).
    next_transfer: std::sync::atomic::AtomicU64,
    /// Live requests by client request id.
    live: Mutex<HashMap<String, Live>>,
    /// Set when the process begins to drain: `/health` says so from then on.
    draining: std::sync::atomic::AtomicBool,
    /// A scheduler's standing in its pool (with etcd): a standby refuses requests naming the
    /// leader.
    standing: std::sync::OnceLock<Arc<crate::standby::Standing>>,
}

/// A live request: where it runs now, and whose it is.
struct Live {
    placement: Placement,
    /// The id of the API key that created it (`None` when the APIs are open).
    owner: Option<Arc<str>>,
    /// The first sample of a request with several: how many (its others are live under
    /// [`admission::sample_id`]); 0 otherwise.
    samples: usize,
}

/// The gRPC face of the front.
#[derive(Clone)]
pub struct GenerationService {
    front: Arc<Front>,
}

impl GenerationService {
    /// A front serving `models` through `route` under `settings`.
    pub fn new(models: Models, route: Route, settings: FrontSettings) -> Self {
        let metrics = match &route {
            Route::Local(set) => set.metrics.clone(),
            Route::Remote(_) => SchedulerMetrics::new(),
        };
        let front = Front {
            models,
            route,
            metrics,
            settings,
            next_id: std::sync::atomic::AtomicU64::new(1),
            next_transfer: disagg::transfer_ids(),
            live: Mutex::default(),
            draining: std::sync::atomic::AtomicBool::new(false),
            standing: std::sync::OnceLock::new(),
        };
        Self { front: Arc::new(front) }
    }

    /// The served models.
    pub fn models(&self) -> &Models {
        &self.front.models
    }

    /// What `/metrics` shows for this front (and the executors it drives), with `leading`
    /// when the process campaigns for leadership: the executors' gauges, leadership, the
    /// counters and the API keys', in that order.
    pub fn metrics_view(
        &self,
        leading: Option<tokio::sync::watch::Receiver<Option<u64>>>,
    ) -> ferry_runtime::prometheus::All {
        use ferry_runtime::prometheus::Render;
        // The front's own counters are the default model's (vLLM's `model_name` label); the
        // executors' gauges and the adapters' counters are each labelled with their model.
        let model_name = self.front.models.default_model().name().to_string();
        let mut parts: Vec<Arc<dyn Render>> = Vec::new();
        if let Route::Local(set) = &self.front.route {
            let names = self.front.models.iter();
            let names = names.map(|m| (m.file.fingerprint.clone(), m.name().to_string()));
            parts.push(Arc::new(set.gauges(names.collect())));
        }
        if let Some(leading) = leading {
            let model_name = model_name.clone();
            parts.push(Arc::new(crate::metrics::LeadershipView { model_name, leading }));
        }
        let metrics = self.front.metrics.clone();
        parts.push(Arc::new(CounterView { model_name: model_name.clone(), metrics }));
        for m in self.front.models.iter() {
            let adapters = m.adapters.clone();
            let lora = adapters::AdapterMetrics { model_name: m.name().to_string(), adapters };
            parts.push(Arc::new(lora));
        }
        if let Some(keys) = &self.front.settings.keys {
            parts.push(Arc::new(keys::KeyMetrics { model_name, keys: keys.clone() }));
        }
        ferry_runtime::prometheus::All(parts)
    }

    /// Makes this front a scheduler's, which stands by while `standing` says so: requests
    /// and `/health` are then answered with where the leader is.
    pub fn stand_by(&self, standing: Arc<crate::standby::Standing>) {
        let _ = self.front.standing.set(standing);
    }

    /// What a caller is told while this process stands by for its pool's leader.
    pub fn standby_notice(&self) -> Option<String> {
        self.front.standby_notice()
    }

    /// From now on `/health` answers 503 "draining" (the drain's first step).
    pub fn begin_drain(&self) {
        self.front.draining.store(true, Ordering::SeqCst);
    }

    /// Whether this process is draining.
    pub fn is_draining(&self) -> bool {
        self.front.draining.load(Ordering::SeqCst)
    }

    /// The API keys callers must present (`None`: the client APIs are open).
    pub fn keys(&self) -> Option<&Arc<keys::ApiKeys>> {
        self.front.settings.keys.as_ref()
    }

    /// What one request may ask for.
    pub fn limits(&self) -> &RequestLimits {
        &self.front.settings.limits
    }

    /// Whether this front sends its requests to the schedulers' leaders (a front in its own
    /// process) rather than to executors it drives.
    pub fn is_remote(&self) -> bool {
        matches!(self.front.route, Route::Remote(_))
    }

    /// Whether requests can run now: an executor session is up (a remote front: a leader is
    /// known).
    pub fn has_executors(&self) -> bool {
        match &self.front.route {
            Route::Local(set) => !set.alive().is_empty(),
            Route::Remote(shards) => shards.any_led(),
        }
    }
}
