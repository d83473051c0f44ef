//! One request's spans at the front: `generate` (the whole call, a child of the caller's
//! `traceparent`), `tokenize`, and `request` (its life in the scheduler, the parent of the
//! executors' `execute` spans) with a `queue` child from arrival to first scheduled, events
//! for the first token, preemptions and moves, and the finish reason on both.
//!
//! With tracing off these are OpenTelemetry's no-op spans: nothing is recorded or sent.

use std::time::{Duration, SystemTime};

use ferry_runtime::telemetry;
use ferry_sched_core::FinishStats;
use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue};

use crate::request::RequestSpec;

/// The spans of one request.
pub struct RequestTrace {
    generate: Context,
    request: Option<Context>,
    arrived: SystemTime,
}

impl RequestTrace {
    /// Opens `generate` under `parent` (the caller's context) for a request from the API key
    /// `key_id` (empty when the APIs are open).
    pub fn start(parent: &Context, request_id: &str, key_id: &str) -> Self {
        let tracer = telemetry::tracer();
        let mut attributes = vec![KeyValue::new("ferry.request_id", request_id.to_string())];
        if !key_id.is_empty() {
            attributes.push(KeyValue::new("ferry.api_key_id", key_id.to_string()));
        }
        let span = tracer
            .span_builder("generate")
            .with_kind(SpanKind::Server)
            .with_attributes(attributes)
            .start_with_context(&tracer, parent);
        Self { generate: parent.with_span(span), request: None, arrived: SystemTime::now() }
    }

    /// Runs `f` inside a `tokenize` span.
    pub fn tokenize<T>(&self, f: impl FnOnce() -> T) -> T {
        let tracer = telemetry::tracer();
        let mut span = tracer.start_with_context("tokenize", &self.generate);
        let out = f();
        opentelemetry::trace::Span::end(&mut span);
        out
    }

    /// Opens the `request` span (placement onward) of `spec`: its prompt's tokens, and the LoRA
    /// adapter it runs with if any. Returns its `traceparent` for the executors' spans (empty
    /// when untraced).
    pub fn open_request(&mut self, spec: &RequestSpec) -> String {
        let tracer = telemetry::tracer();
        let mut attributes = vec![KeyValue::new("ferry.prompt_tokens", spec.prompt.len() as i64)];
        if let Some(lora) = &spec.lora {
            attributes.push(KeyValue::new("ferry.lora_adapter", lora.name.clone()));
        }
        let span = tracer
            .span_builder("request")
            .with_attributes(attributes)
            .start_with_context(&tracer, &self.generate);
        let cx = self.generate.with_span(span);
        let tp = telemetry::traceparent(&cx);
        self.request = Some(cx);
        tp
    }

    /// The trace id, for log lines (empty when untraced).
    pub fn trace_id(&self) -> String {
        let cx = self.generate.span().span_context().clone();
        if cx.is_valid() {
            cx.trace_id().to_string()
        } else {
            String::new()
        }
    }

    /// The context to propagate to a scheduler (the `request` span once open).
    pub fn context(&self) -> &Context {
        self.request.as_ref().unwrap_or(&self.generate)
    }

    /// An event on the `request` span.
    pub fn event(&self, name: &'static str, attributes: Vec<KeyValue>) {
        self.context().span().add_event(name, attributes);
    }

    /// Ends both spans with `reason` (vLLM's finish reasons: stop, length, abort, error).
    pub fn finish(self, reason: &str, executor: &str, stats: Option<&FinishStats>) {
        if let Some(req) = &self.request {
            let span = req.span();
            span.set_attribute(KeyValue::new("ferry.finish_reason", reason.to_string()));
            span.set_attribute(KeyValue::new("ferry.executor", executor.to_string()));
            if let Some(s) = stats {
                span.set_attribute(KeyValue::new("ferry.output_tokens", s.output_tokens as i64));
                span.set_attribute(KeyValue::new(
                    "ferry.preemptions",
                    i64::from(s.num_preemptions),
                ));
                span.set_attribute(KeyValue::new(
                    "ferry.cached_prompt_tokens",
                    s.prefix_hit_tokens as i64,
                ));
                if let Some(q) = s.queue_time {
                    let admitted = self.arrived + Duration::from_secs_f64(q.max(0.0));
                    let tracer = telemetry::tracer();
                    let mut queue = tracer
                        .span_builder("queue")
                        .with_start_time(self.arrived)
                        .start_with_context(&tracer, req);
                    opentelemetry::trace::Span::end_with_timestamp(&mut queue, admitted);
                    span.add_event_with_timestamp("admitted", admitted, Vec::new());
                }
            }
            if reason == "error" {
                span.set_status(Status::error("the request failed"));
            }
            span.end();
        }
        let span = self.generate.span();
        span.set_attribute(KeyValue::new("ferry.finish_reason", reason.to_string()));
        if reason == "error" {
            span.set_status(Status::error("the request failed"));
        }
        span.end();
    }

    /// Ends `generate` for a request refused before it was placed.
    pub fn refused(self, why: &str) {
        let span = self.generate.span();
        span.set_status(Status::error(why.to_string()));
        span.end();
    }
}
