//! Prometheus metrics in the text exposition format (version 0.0.4), served at `GET /metrics`
//! on a service's own gRPC port (HTTP/1.1 is accepted beside gRPC's HTTP/2).
//!
//! Why hand-written: a service's metrics are a few counters, gauges and histograms updated on
//! hot paths with one atomic add each; rendering them is a few dozen lines. The families are
//! written by the service itself ([`Render`]), so gauges are read from live state at scrape
//! time instead of being mirrored.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Something that writes its metric families in the text format.
pub trait Render: Send + Sync + 'static {
    /// Appends every family to `out`.
    fn render(&self, out: &mut Text);
}

/// Several renderers, one after the other.
pub struct All(pub Vec<Arc<dyn Render>>);

impl Render for All {
    fn render(&self, out: &mut Text) {
        for r in &self.0 {
            r.render(out);
        }
    }
}

/// A text-format document being written.
#[derive(Default)]
pub struct Text {
    out: String,
}

impl Text {
    /// The document so far.
    pub fn finish(self) -> String {
        self.out
    }

    /// Starts a family: `# HELP` and `# TYPE` lines.
    pub fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    /// One sample: `name{labels} value`. `labels` are `(key, value)` pairs, escaped here.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        write_labels(&mut self.out, labels, None);
        let _ = writeln!(self.out, " {}", fmt_value(value));
    }

    /// A whole counter family with one sample.
    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.family(name, "counter", help);
        self.sample(name, labels, value);
    }

    /// A whole gauge family with one sample.
    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.family(name, "gauge", help);
        self.sample(name, labels, value);
    }
}

fn fmt_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{v}")
    }
}

fn write_labels(out: &mut String, labels: &[(&str, &str)], le: Option<&str>) {
    if labels.is_empty() && le.is_none() {
        return;
    }
    out.push('{');
    let mut first = true;
    for (k, v) in labels.iter().copied().chain(le.map(|le| ("le", le))) {
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(k);
        out.push_str("=\"");
        for c in v.chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '"' => out.push_str("\\\""),
                '\n' => out.push_str("\\n"),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    out.push('}');
}

/// A monotonically increasing count.
#[derive(Default, Debug)]
pub struct Counter(AtomicU64);

impl Counter {
    /// A count of zero (usable in a `static`).
    pub const fn new() -> Self {
        Self(AtomicU64::new(0))
    }
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    /// The count.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A histogram with fixed upper bounds (seconds, typically), as Prometheus's.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Non-cumulative counts per bound, plus one for +Inf.
    buckets: Vec<AtomicU64>,
    /// Sum in nanounits (so it adds atomically).
    sum_nanos: AtomicU64,
}

impl Histogram {
    /// A histogram over `bounds` (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }
    }

    /// Records one value (negative values count as 0).
    pub fn observe(&self, v: f64) {
        let v = if v.is_finite() { v.max(0.0) } else { 0.0 };
        let i = self.bounds.iter().position(|b| v <= *b).unwrap_or(self.bounds.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add((v * 1e9) as u64, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).sum()
    }

    /// Writes the samples (`_bucket`, `_sum`, `_count`) of this histogram under `labels`; the
    /// family line is the caller's (one family may hold several label sets).
    pub fn samples(&self, text: &mut Text, name: &str, labels: &[(&str, &str)]) {
        let mut cumulative = 0;
        let bucket = format!("{name}_bucket");
        for (i, b) in self.buckets.iter().enumerate() {
            cumulative += b.load(Ordering::Relaxed);
            let le = self.bounds.get(i).map_or_else(|| "+Inf".to_string(), |b| fmt_value(*b));
            text.out.push_str(&bucket);
            write_labels(&mut text.out, labels, Some(&le));
            let _ = writeln!(text.out, " {cumulative}");
        }
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        text.sample(&format!("{name}_sum"), labels, sum);
        text.sample(&format!("{name}_count"), labels, cumulative as f64);
    }

    /// A whole histogram family with one label set.
    pub fn render(&self, text: &mut Text, name: &str, help: &str, labels: &[(&str, &str)]) {
        text.family(name, "histogram", help);
        self.samples(text, name, labels);
    }
}

/// vLLM's buckets for time to first token, seconds.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for inter-token latency, seconds.
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's buckets for request-level latencies (end to end, queue), seconds.
pub const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// vLLM's 1-2-5 buckets for per-request token counts (prompt, generation, `max_tokens`).
pub const TOKEN_BUCKETS: &[f64] = &[
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    50.0,
    100.0,
    200.0,
    500.0,
    1000.0,
    2000.0,
    5000.0,
    10000.0,
    20000.0,
    50000.0,
    100_000.0,
    200_000.0,
    500_000.0,
    1_000_000.0,
];
/// Buckets for step-level durations, seconds.
pub const STEP_BUCKETS: &[f64] =
    &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

/// An axum router answering `GET /metrics` with what `metrics` renders.
pub fn router(metrics: Arc<dyn Render>) -> axum::Router {
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let metrics = metrics.clone();
            async move {
                let mut text = Text::default();
                metrics.render(&mut text);
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    text.finish(),
                )
            }
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_labels_escaped() {
        let h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(7.0);
        let mut t = Text::default();
        h.render(&mut t, "x_seconds", "help", &[("model_name", "a\"b")]);
        let s = t.finish();
        assert!(s.contains("x_seconds_bucket{model_name=\"a\\\"b\",le=\"0.1\"} 1\n"), "{s}");
        assert!(s.contains("x_seconds_bucket{model_name=\"a\\\"b\",le=\"1\"} 2\n"), "{s}");
        assert!(s.contains("x_seconds_bucket{model_name=\"a\\\"b\",le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_seconds_count{model_name=\"a\\\"b\"} 3\n"), "{s}");
        assert!(s.contains("x_seconds_sum{model_name=\"a\\\"b\"} 7.55\n"), "{s}");
    }
}
