//! Tracing of a step's requests: each traced request has an `execute` span on this executor
//! (a child of its span at the scheduler) that counts its steps and tokens, and each step with
//! a traced request in its batch records a `step` span, its own trace, linked to theirs.

use ferry_proto::v1;

use super::batch::Planned;
use super::Engine;

/// A traced request's span on this executor and what it did here.
#[derive(Debug)]
pub(super) struct RequestTrace {
    pub(super) cx: opentelemetry::Context,
    pub(super) steps: u64,
    pub(super) tokens_computed: u64,
}

impl RequestTrace {
    /// Opens the `execute` span under the scheduler's `traceparent`; `None` when untraced.
    pub(super) fn start(traceparent: &str, id: u64) -> Option<Self> {
        use opentelemetry::trace::{TraceContextExt, Tracer};
        if traceparent.is_empty() {
            return None;
        }
        let parent = ferry_runtime::telemetry::from_traceparent(traceparent);
        if !parent.span().span_context().is_sampled() {
            return None;
        }
        let tracer = ferry_runtime::telemetry::tracer();
        let span = tracer
            .span_builder("execute")
            .with_attributes([opentelemetry::KeyValue::new("ferry.request_id", id as i64)])
            .start_with_context(&tracer, &parent);
        Some(Self { cx: parent.with_span(span), steps: 0, tokens_computed: 0 })
    }

    pub(super) fn end(self, how: &'static str) {
        use opentelemetry::trace::TraceContextExt;
        use opentelemetry::KeyValue;
        let span = self.cx.span();
        span.set_attribute(KeyValue::new("ferry.steps", self.steps as i64));
        span.set_attribute(KeyValue::new("ferry.tokens_computed", self.tokens_computed as i64));
        span.set_attribute(KeyValue::new("ferry.ended_by", how));
        span.end();
    }
}

impl Engine {
    /// Records a `step` span (its own trace) linked to the `execute` spans of the traced
    /// requests in the batch, with the batch's shape; nothing when none is traced.
    pub(super) fn trace_step(
        &mut self,
        step: &v1::Step,
        planned: &[Planned],
        started: std::time::SystemTime,
        forward_us: u64,
    ) {
        use opentelemetry::trace::{Link, Span, TraceContextExt, Tracer};
        use opentelemetry::KeyValue;
        let mut links = Vec::new();
        let (mut prefill, mut decode) = (0i64, 0i64);
        for p in planned {
            let is_decode = p.n == 1 && p.start + 1 == p.total && p.start > 0;
            if is_decode {
                decode += 1;
            } else {
                prefill += p.n as i64;
            }
            if let Some(t) = self.requests.get_mut(&p.id).and_then(|r| r.trace.as_mut()) {
                t.steps += 1;
                t.tokens_computed += p.n as u64;
                links.push(Link::with_context(t.cx.span().span_context().clone()));
            }
        }
        if links.is_empty() {
            return;
        }
        let tracer = ferry_runtime::telemetry::tracer();
        let mut span = tracer
            .span_builder("step")
            .with_start_time(started)
            .with_links(links)
            .with_attributes([
                KeyValue::new("ferry.step_id", step.step_id as i64),
                KeyValue::new("ferry.batch_size", planned.len() as i64),
                KeyValue::new("ferry.prefill_tokens", prefill),
                KeyValue::new("ferry.decode_tokens", decode),
                KeyValue::new("ferry.forward_us", forward_us as i64),
            ])
            .start_with_context(&tracer, &opentelemetry::Context::new());
        span.end();
    }
}
