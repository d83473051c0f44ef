//! OpenTelemetry tracing: spans exported over OTLP/gRPC (Jaeger accepts it on port 4317), W3C
//! trace context carried across every hop (HTTP `traceparent`, gRPC metadata, and the
//! `traceparent` field a step carries for each new request).
//!
//! Why the OpenTelemetry API directly rather than through `tracing`: a request's spans are
//! built from times the scheduling core records (queue wait ends when the request is first
//! scheduled, which the front learns later), so they need explicit start and end times, and a
//! step's span needs links to the spans of every request in its batch.
//!
//! Without `--otlp-endpoint` no provider is installed: the global tracer is OpenTelemetry's
//! no-op, spans are never recorded or sent, and `traceparent` strings come out empty.

use std::collections::HashMap;
use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::{global, Context};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use opentelemetry_sdk::Resource;

/// The tracing flags every binary takes.
#[derive(Clone, Debug, clap::Args)]
pub struct TraceArgs {
    /// OTLP/gRPC endpoint to export spans to (e.g. `http://jaeger:4317`); tracing is off
    /// without one.
    #[arg(long = "otlp-endpoint", env = "FERRY_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Fraction of new traces recorded, 0 to 1 (a request that arrives with a sampled
    /// `traceparent` is recorded whatever this says).
    #[arg(long = "trace-sample-ratio", env = "FERRY_TRACE_SAMPLE_RATIO", default_value_t = 1.0)]
    pub trace_sample_ratio: f64,
}

/// Keeps the exporter running; dropping it flushes what is buffered.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown_with_timeout(Duration::from_secs(2));
        }
    }
}

impl TraceArgs {
    /// Checks the flags without installing anything.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.trace_sample_ratio) {
            return Err(format!(
                "--trace-sample-ratio must be between 0 and 1, got {}",
                self.trace_sample_ratio
            ));
        }
        if let Some(endpoint) = &self.otlp_endpoint {
            crate::address::dial_address("otlp-endpoint", endpoint).map_err(|e| e.to_string())?;
            if !endpoint.contains("://") {
                return Err(format!(
                    "--otlp-endpoint {endpoint:?} needs a scheme (http://HOST:4317 or https://)"
                ));
            }
        }
        Ok(())
    }

    /// Installs the global tracer provider for `service_name` (when an endpoint is given) and
    /// the W3C trace-context propagator. Call it inside the tokio runtime.
    pub fn init(&self, service_name: &str) -> Result<Telemetry, String> {
        self.validate()?;
        global::set_text_map_propagator(TraceContextPropagator::new());
        let Some(endpoint) = &self.otlp_endpoint else {
            return Ok(Telemetry { provider: None });
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .with_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| format!("--otlp-endpoint {endpoint:?}: {e}"))?;
        let sampler =
            Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(self.trace_sample_ratio)));
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(sampler)
            .with_resource(Resource::builder().with_service_name(service_name.to_string()).build())
            .build();
        global::set_tracer_provider(provider.clone());
        Ok(Telemetry { provider: Some(provider) })
    }
}

/// Ferry's tracer.
pub fn tracer() -> global::BoxedTracer {
    global::tracer("ferry")
}

struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

/// The trace context a gRPC call carries (the empty context if none).
pub fn extract_metadata(metadata: &tonic::metadata::MetadataMap) -> Context {
    global::get_text_map_propagator(|p| p.extract(&MetadataExtractor(metadata)))
}

/// Puts `cx` into an outgoing call's metadata.
pub fn inject_metadata(cx: &Context, metadata: &mut tonic::metadata::MetadataMap) {
    global::get_text_map_propagator(|p| p.inject_context(cx, &mut MetadataInjector(metadata)));
}

/// `cx` as a W3C `traceparent` string; empty when it holds no sampled span.
pub fn traceparent(cx: &Context) -> String {
    if !cx.span().span_context().is_valid() {
        return String::new();
    }
    let mut carrier = HashMap::new();
    global::get_text_map_propagator(|p| p.inject_context(cx, &mut carrier));
    carrier.remove("traceparent").unwrap_or_default()
}

/// The context a `traceparent` string names (the empty context for an empty or bad one).
pub fn from_traceparent(traceparent: &str) -> Context {
    if traceparent.is_empty() {
        return Context::new();
    }
    let carrier = HashMap::from([("traceparent".to_string(), traceparent.to_string())]);
    global::get_text_map_propagator(|p| p.extract(&carrier))
}

/// A span that one hop of a multi-hop operation (a KV transfer: executor → agent → agent)
/// opens under the `traceparent` it was handed, and whose own `traceparent` it hands on.
/// `None` (and nothing recorded) when the parent is absent or not sampled.
#[derive(Debug)]
pub struct HopSpan {
    cx: Context,
}

impl HopSpan {
    /// Opens span `name` with `attributes` under `traceparent`.
    pub fn start(
        traceparent: &str,
        name: &'static str,
        attributes: Vec<opentelemetry::KeyValue>,
    ) -> Option<Self> {
        use opentelemetry::trace::Tracer;
        let parent = from_traceparent(traceparent);
        if !parent.span().span_context().is_sampled() {
            return None;
        }
        let tracer = tracer();
        let span = tracer
            .span_builder(name)
            .with_attributes(attributes)
            .start_with_context(&tracer, &parent);
        Some(Self { cx: parent.with_span(span) })
    }

    /// This span as a `traceparent` for the next hop.
    pub fn traceparent(&self) -> String {
        traceparent(&self.cx)
    }

    /// Ends the span: ok, or failed with `error`.
    pub fn end(self, error: Option<&str>) {
        let span = self.cx.span();
        if let Some(e) = error {
            span.set_status(opentelemetry::trace::Status::error(e.to_string()));
        }
        span.end();
    }
}

/// Ends `span`, if there is one: ok, or failed with `error`.
pub fn end_hop(span: Option<HopSpan>, error: Option<&str>) {
    if let Some(span) = span {
        span.end(error);
    }
}

/// The `traceparent` of `span`, or empty.
pub fn hop_traceparent(span: Option<&HopSpan>) -> String {
    span.map(HopSpan::traceparent).unwrap_or_default()
}
