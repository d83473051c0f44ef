//! The executor's Prometheus metrics (served at `GET /metrics` on its gRPC port): how busy the
//! engine is, how long it waits between steps (the scheduler keeping it idle), and its KV pool.

use ferry_runtime::prometheus::{Render, Text};

use crate::actor::EngineHandle;

/// `/metrics` of one executor.
pub struct ExecutorMetrics {
    /// The served model (`model_name` on every series).
    pub model_name: String,
    /// This executor's id (`executor`).
    pub executor_id: String,
    /// Blocks in the KV pool.
    pub num_blocks: u32,
    /// The engine thread.
    pub engine: EngineHandle,
}

impl Render for ExecutorMetrics {
    fn render(&self, t: &mut Text) {
        let labels = [("model_name", self.model_name.as_str()), ("executor", &self.executor_id)];
        let published = self.engine.published();
        let s = *published.stats.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        t.counter(
            "ferry_executor_busy_seconds",
            "Time spent running steps.",
            &labels,
            s.busy_us as f64 / 1e6,
        );
        t.counter(
            "ferry_executor_idle_seconds",
            "Time between a step's end and the next step's start while requests were held.",
            &labels,
            s.idle_us as f64 / 1e6,
        );
        t.counter("ferry_executor_steps", "Steps run.", &labels, s.steps_executed as f64);
        t.gauge("ferry_executor_requests", "Requests held.", &labels, f64::from(s.num_requests));
        t.gauge(
            "ferry_executor_kv_blocks_in_use",
            "KV blocks referenced by held requests.",
            &labels,
            f64::from(s.blocks_in_use),
        );
        t.gauge(
            "ferry_executor_kv_blocks",
            "KV blocks in the pool.",
            &labels,
            f64::from(self.num_blocks),
        );
        let name = "ferry_executor_kv_transfers";
        let help = "KV transfers started, by the path their blocks took to the node's agent.";
        t.family(name, "counter", help);
        let paths = [
            ("shared_memory", s.kv_paths.shared_memory),
            ("socket", s.kv_paths.socket),
            ("pool", s.kv_paths.pool),
        ];
        for (path, n) in paths {
            t.sample(name, &[("path", path), labels[0], labels[1]], n as f64);
        }
        published.step_seconds.render(
            t,
            "ferry_executor_step_duration_seconds",
            "Time to run one step (forward and sampling).",
            &labels,
        );
    }
}
