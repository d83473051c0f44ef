//! Tracing (issue 7): a real OTLP/gRPC trace receiver inside the test collects the spans that a
//! front process, a scheduler process and an executor process export for one request, and
//! checks they form one trace under the caller's `traceparent`, parented and linked as
//! `docs/ARCHITECTURE.md` describes.

// Each test is one end-to-end scenario, read top to bottom; splitting one would scatter it.
#![allow(clippy::too_many_lines)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_tests::{http, Etcd, Service};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::Span;

/// A received span and the service that sent it.
#[derive(Clone, Debug)]
struct Received {
    service: String,
    span: Span,
}

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Received>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| attr(&r.attributes, "service.name"))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    spans.push(Received { service: service.clone(), span });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Collector {
    /// Waits (up to 10 s) until spans `(service, name)` of every entry in `want` arrived in
    /// trace `trace_id`; the trace's spans so far.
    async fn wait_for(&self, trace_id: &str, want: &[(&str, &str)]) -> Vec<Received> {
        let mut ours = Vec::new();
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            ours = self
                .spans
                .lock()
                .unwrap()
                .iter()
                .filter(|r| hex(&r.span.trace_id) == trace_id)
                .cloned()
                .collect();
            if want
                .iter()
                .all(|(svc, name)| ours.iter().any(|r| r.service == *svc && r.span.name == *name))
            {
                break;
            }
        }
        ours
    }
}

/// The span `name` that `service` sent, among `ours`.
fn find(ours: &[Received], service: &str, name: &str) -> Span {
    ours.iter()
        .find(|r| r.service == service && r.span.name == name)
        .unwrap_or_else(|| {
            let got: Vec<_> = ours.iter().map(|r| (&r.service, &r.span.name)).collect();
            panic!("no {name} span from {service}; got {got:?}")
        })
        .span
        .clone()
}

fn attr(attrs: &[KeyValue], key: &str) -> Option<String> {
    let v = attrs.iter().find(|kv| kv.key == key)?.value.as_ref()?.value.as_ref()?;
    Some(match v {
        Value::StringValue(s) => s.clone(),
        Value::IntValue(i) => i.to_string(),
        Value::BoolValue(b) => b.to_string(),
        Value::DoubleValue(d) => d.to_string(),
        other => format!("{other:?}"),
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        use std::fmt::Write;
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// A trace receiver on a free port: its collected spans and its OTLP endpoint.
async fn start_collector() -> (Collector, String) {
    // Export quickly so the test need not wait for the default 5 s batch delay.
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "100");
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let otlp = format!("http://{}", listener.local_addr().unwrap());
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(collector.clone()))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    tokio::spawn(server);
    (collector, otlp)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_front_scheduler_and_executor() {
    let (collector, otlp) = start_collector().await;

    // Three processes: an executor, a scheduler that leads the pool, a front.
    let etcd = Etcd::start().unwrap();
    let endpoints = etcd.endpoints();
    let common = ["--etcd-endpoints", &endpoints, "--otlp-endpoint", &otlp];
    let exec_args = [&["--listen", "127.0.0.1:0", "--kv-cache-mib", "64"], &common[..]].concat();
    let _exec = Service::start("ferry-executor", &exec_args, 1).unwrap();
    let sched_args =
        [&["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"], &common[..]].concat();
    let sched = Service::start("ferry-scheduler", &sched_args, 2).unwrap();
    let front_args =
        [&["front", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"], &common[..]]
            .concat();
    let front = Service::start("ferry-scheduler", &front_args, 2).unwrap();
    for svc in [&sched, &front] {
        let up = (0..400).any(|_| {
            std::thread::sleep(Duration::from_millis(25));
            http(svc.addr("http"), "GET", "/health", b"").map_or(0, |r| r.0) == 200
        });
        assert!(up, "not ready");
    }

    // One request through the front's OpenAI API, under a trace the caller started.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let body =
        br#"{"model":"SmolLM2-135M-Instruct","prompt":"Hello","max_tokens":6,"ignore_eos":true}"#;
    let traceparent = format!("00-{trace_id}-{caller_span}-01");
    let headers = [("traceparent", traceparent.as_str())];
    let (status, response) =
        ferry_tests::http_with(front.addr("http"), "POST", "/v1/completions", &headers, body)
            .unwrap();
    assert_eq!(status, 200, "{response}");

    // Wait for every process to export the request's spans.
    let want = ["generate", "tokenize", "request", "queue", "execute"];
    let ours = collector
        .wait_for(
            trace_id,
            &[
                ("ferry-front", "generate"),
                ("ferry-scheduler", "generate"),
                ("ferry-executor", "execute"),
                ("ferry-scheduler", "queue"),
            ],
        )
        .await;
    let find = |service: &str, name: &str| find(&ours, service, name);
    for name in want {
        assert!(ours.iter().any(|r| r.span.name == name), "no {name} span");
    }
    // Parents: caller → front generate → front request → scheduler generate → tokenize,
    // request → queue, and the executor's execute under the scheduler's request.
    let f_gen = find("ferry-front", "generate");
    assert_eq!(hex(&f_gen.parent_span_id), caller_span);
    let f_req = find("ferry-front", "request");
    assert_eq!(f_req.parent_span_id, f_gen.span_id);
    let s_gen = find("ferry-scheduler", "generate");
    assert_eq!(s_gen.parent_span_id, f_req.span_id, "the front's context crossed to the scheduler");
    let s_tok = find("ferry-scheduler", "tokenize");
    assert_eq!(s_tok.parent_span_id, s_gen.span_id);
    let s_req = find("ferry-scheduler", "request");
    assert_eq!(s_req.parent_span_id, s_gen.span_id);
    let queue = find("ferry-scheduler", "queue");
    assert_eq!(queue.parent_span_id, s_req.span_id);
    assert!(queue.end_time_unix_nano >= queue.start_time_unix_nano);
    let exec = find("ferry-executor", "execute");
    assert_eq!(exec.parent_span_id, s_req.span_id, "the step carried the request's context");
    assert_eq!(attr(&exec.attributes, "ferry.steps").as_deref(), Some("6"));
    // The finish reason and the events on the scheduler's request span.
    assert_eq!(attr(&s_req.attributes, "ferry.finish_reason").as_deref(), Some("length"));
    assert_eq!(attr(&f_gen.attributes, "ferry.finish_reason").as_deref(), Some("length"));
    let events: Vec<_> = s_req.events.iter().map(|e| e.name.as_str()).collect();
    assert!(events.contains(&"first_token") && events.contains(&"admitted"), "{events:?}");

    // Step spans (their own traces) link to the execute span, with the batch's shape.
    let steps: Vec<Span> = collector
        .spans
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.span.name == "step")
        .filter(|r| r.span.links.iter().any(|l| l.span_id == exec.span_id))
        .map(|r| r.span.clone())
        .collect();
    assert_eq!(steps.len(), 6, "one step span per step the request took part in");
    let first =
        steps.iter().find(|s| attr(&s.attributes, "ferry.prefill_tokens").as_deref() != Some("0"));
    let first = first.expect("a prefill step");
    assert_eq!(attr(&first.attributes, "ferry.batch_size").as_deref(), Some("1"));
    assert!(steps
        .iter()
        .any(|s| attr(&s.attributes, "ferry.decode_tokens").as_deref() == Some("1")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_transfer_is_traced_under_its_request_through_both_agents() {
    let (collector, otlp) = start_collector().await;
    // A prefill node and a decode node, each an agent and an executor, and a scheduler that
    // disaggregates every prompt of 16 tokens or more; all export spans.
    let trace = ["--otlp-endpoint", otlp.as_str()];
    let node = |role: &str| {
        let agent_args = [&["--listen", "127.0.0.1:0", "--node-id", role][..], &trace].concat();
        let agent = Service::start("ferry-kv", &agent_args, 1).unwrap();
        let kv = agent.addr("grpc").to_string();
        let exec_args = [
            &["--listen", "127.0.0.1:0", "--role", role, "--kv-agent", &kv, "--kv-cache-mib", "64"]
                [..],
            &trace,
        ]
        .concat();
        let executor = Service::start("ferry-executor", &exec_args, 1).unwrap();
        (agent, executor)
    };
    let (p_agent, p_exec) = node("prefill");
    let (d_agent, d_exec) = node("decode");
    let extra = [&["--disaggregation-min-tokens", "16"][..], &trace].concat();
    let sched = ferry_tests::start_scheduler(&[&p_exec, &d_exec], &extra);
    let http_addr = sched.addr("http");
    let both = (0..400).any(|_| {
        std::thread::sleep(Duration::from_millis(25));
        http(http_addr, "GET", "/metrics", b"").is_ok_and(|(_, body)| {
            body.lines().filter(|l| l.starts_with("vllm:num_requests_running{")).count() == 2
        })
    });
    assert!(both, "the scheduler never drove both executors");

    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let traceparent = format!("00-{trace_id}-b7ad6b7169203331-01");
    let body = br#"{"model":"SmolLM2-135M-Instruct","prompt":"The lighthouse keeper climbed the stairs every evening at dusk to light the lamp above the bay","max_tokens":4,"ignore_eos":true}"#;
    let headers = [("traceparent", traceparent.as_str())];
    let (status, response) =
        ferry_tests::http_with(http_addr, "POST", "/v1/completions", &headers, body).unwrap();
    assert_eq!(status, 200, "{response}");

    // Executor P's export, P's agent forwarding it, D's agent receiving it, executor D's
    // import and D's agent serving the read: one trace, each hop under the one before.
    let want = [
        ("ferry-executor", "kv_export"),
        ("ferry-kv", "kv_forward"),
        ("ferry-kv", "kv_receive"),
        ("ferry-executor", "kv_import"),
        ("ferry-kv", "kv_read"),
        ("ferry-scheduler", "request"),
    ];
    let ours = collector.wait_for(trace_id, &want).await;
    let find = |service: &str, name: &str| find(&ours, service, name);
    let request = find("ferry-scheduler", "request");
    let export = find("ferry-executor", "kv_export");
    let forward = find("ferry-kv", "kv_forward");
    let receive = find("ferry-kv", "kv_receive");
    let import = find("ferry-executor", "kv_import");
    let read = find("ferry-kv", "kv_read");
    assert_eq!(export.parent_span_id, request.span_id, "the export is under its request");
    assert_eq!(import.parent_span_id, request.span_id, "the import is under its request");
    assert_eq!(forward.parent_span_id, export.span_id, "executor → its agent");
    assert_eq!(receive.parent_span_id, forward.span_id, "agent → agent");
    assert_eq!(read.parent_span_id, import.span_id, "executor → its agent");
    let tid = attr(&export.attributes, "ferry.transfer_id");
    assert!(tid.is_some());
    for span in [&forward, &receive, &import, &read] {
        assert_eq!(attr(&span.attributes, "ferry.transfer_id"), tid, "{}", span.name);
    }
    assert!(attr(&receive.attributes, "ferry.bytes").is_some_and(|b| b != "0"));
    drop((p_agent, d_agent));
}
