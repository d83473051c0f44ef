//! Observability (issue 7): Prometheus `/metrics` on every service, in the text format and
//! moving as requests run; health SERVING, then `NOT_SERVING` during a drain.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use ferry_proto::v1::{self, generation_client::GenerationClient};
use ferry_tests::{http, start_serve, Service};
use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient};

/// A scrape, parsed: sample (`name{labels}`) → value, and each family's declared type.
struct Scrape {
    samples: HashMap<String, f64>,
    types: HashMap<String, String>,
}

impl Scrape {
    /// The sum of every sample of `name` whose labels contain all of `with`.
    fn sum(&self, name: &str, with: &[&str]) -> f64 {
        self.samples
            .iter()
            .filter(|(k, _)| {
                let base = k.split('{').next().unwrap();
                base == name && with.iter().all(|w| k.contains(w))
            })
            .map(|(_, v)| v)
            .sum()
    }
}

/// Fetches `/metrics` and checks it is valid Prometheus text: every line a comment or a sample
/// `name{labels} value`, names legal, values numbers, each sample's family typed before it,
/// histogram buckets cumulative and ending in `+Inf` equal to `_count`.
fn scrape(addr: SocketAddr) -> Scrape {
    let (status, body) = http(addr, "GET", "/metrics", b"").unwrap();
    assert_eq!(status, 200, "{body}");
    let mut samples = HashMap::new();
    let mut types = HashMap::new();
    for line in body.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE name kind");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "{line}"
            );
            assert!(types.insert(name.to_string(), kind.to_string()).is_none(), "dup {name}");
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        assert!(!line.starts_with('#'), "unknown comment: {line}");
        let (series, value) = line.rsplit_once(' ').expect("sample has a value");
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in {line}")),
        };
        let name = series.split('{').next().unwrap();
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad name {name}"
        );
        if series.contains('{') {
            assert!(series.ends_with('}'), "unclosed labels: {line}");
        }
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s).filter(|f| types.get(*f).is_some_and(|k| k == "histogram"))
            })
            .unwrap_or(name);
        assert!(types.contains_key(family), "sample before its TYPE: {line}");
        assert!(samples.insert(series.to_string(), value).is_none(), "duplicate series {series}");
    }
    // Histograms: buckets cumulative, +Inf == _count.
    for (family, kind) in &types {
        if kind != "histogram" {
            continue;
        }
        let mut buckets: Vec<(f64, f64)> = samples
            .iter()
            .filter(|(k, _)| k.starts_with(&format!("{family}_bucket{{")))
            .map(|(k, v)| {
                let le = k.split("le=\"").nth(1).unwrap().split('"').next().unwrap();
                (if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap() }, *v)
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "{family} not cumulative");
        let count = Scrape { samples: samples.clone(), types: HashMap::new() }
            .sum(&format!("{family}_count"), &[]);
        assert_eq!(buckets.last().map(|b| b.1), Some(count), "{family}: +Inf != _count");
    }
    Scrape { samples, types }
}

#[test]
fn metrics_use_vllm_names_and_move_as_requests_run() {
    let svc = start_serve("64");
    let (h, exec, kv) = (svc.addr("http"), svc.addr("executor"), svc.addr("kv"));
    let before = scrape(h);
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "ferry_step_duration_seconds",
    ] {
        assert!(before.types.contains_key(name), "{name} missing");
    }
    let exec_before = scrape(exec);
    for _ in 0..3 {
        // Over two 16-token blocks, so the second and third find the first's in the cache.
        let body = br#"{"model":"SmolLM2-135M-Instruct","prompt":"The sky over the old harbour town was grey and low that morning, and the fishing boats stayed tied up along the stone quay while the gulls","max_tokens":8,"ignore_eos":true}"#;
        let (status, text) = http(h, "POST", "/v1/completions", body).unwrap();
        assert_eq!(status, 200, "{text}");
    }
    let after = scrape(h);
    let delta = |name: &str, with: &[&str]| after.sum(name, with) - before.sum(name, with);
    assert_eq!(delta("vllm:generation_tokens_total", &[]), 24.0);
    assert!(delta("vllm:prompt_tokens_total", &[]) >= 3.0);
    assert_eq!(delta("vllm:request_success_total", &["finished_reason=\"length\""]), 3.0);
    assert_eq!(delta("vllm:time_to_first_token_seconds_count", &[]), 3.0);
    assert_eq!(delta("vllm:inter_token_latency_seconds_count", &[]), 21.0);
    assert_eq!(delta("vllm:e2e_request_latency_seconds_count", &[]), 3.0);
    assert_eq!(delta("vllm:request_queue_time_seconds_count", &[]), 3.0);
    assert!(delta("ferry_step_duration_seconds_count", &[]) >= 8.0);
    assert!(delta("vllm:prefix_cache_queries_total", &[]) >= 3.0);
    assert!(
        delta("vllm:prefix_cache_hits_total", &[]) > 0.0,
        "the same prompt thrice hits the cache"
    );
    assert_eq!(after.sum("vllm:num_requests_running", &[]), 0.0);
    assert_eq!(after.sum("vllm:kv_cache_usage_perc", &[]), 0.0);
    // vLLM's per-request histograms.
    assert_eq!(delta("vllm:request_prompt_tokens_count", &[]), 3.0);
    assert_eq!(delta("vllm:request_generation_tokens_sum", &[]), 24.0);
    assert_eq!(delta("vllm:request_max_num_generation_tokens_sum", &[]), 24.0);
    assert_eq!(delta("vllm:request_prefill_time_seconds_count", &[]), 3.0);
    assert_eq!(delta("vllm:request_decode_time_seconds_count", &[]), 3.0);
    assert_eq!(delta("vllm:time_per_output_token_seconds_count", &[]), 21.0);
    vllm_dashboard_finds_a_series_for_every_query(&after);

    // The executor and the KV agent serve /metrics on their gRPC ports.
    // The executor learns of a request's end in the step after its last token, which may
    // come after the client has its answer.
    let start = std::time::Instant::now();
    let exec_after = loop {
        let s = scrape(exec);
        if s.sum("ferry_executor_kv_blocks_in_use", &[]) == 0.0 {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "finished requests' blocks kept");
        std::thread::sleep(Duration::from_millis(20));
    };
    let d = |name: &str| exec_after.sum(name, &[]) - exec_before.sum(name, &[]);
    assert!(d("ferry_executor_steps") >= 8.0);
    assert!(d("ferry_executor_busy_seconds") > 0.0);
    assert!(d("ferry_executor_step_duration_seconds_count") >= 8.0);
    assert!(exec_after.types.contains_key("ferry_executor_idle_seconds"));
    let kv_scrape = scrape(kv);
    assert!(kv_scrape.sum("ferry_kv_store_capacity_bytes", &[]) > 0.0);
    dashboard_queries_only_exported_metrics(&[&after, &exec_after, &kv_scrape]);
    // And the scheduler's gRPC port too.
    assert!(scrape(svc.addr("grpc")).types.contains_key("vllm:generation_tokens_total"));

    // The admin view over gRPC (real grpcurl): a running request, its WorkKey, blocks and the
    // reason for the last decision; and the executor's gauges.
    let long = br#"{"model":"SmolLM2-135M-Instruct","prompt":"Count slowly:","max_tokens":300,"ignore_eos":true,"stream":true}"#;
    let (status, _stream) = ferry_tests::http_open(h, "/v1/completions", long).unwrap();
    assert_eq!(status, 200);
    let grpc = svc.addr("grpc").to_string();
    let listed =
        ferry_tests::grpcurl_ok(&["-plaintext", &grpc, "ferry.v1.Admin/ListRequests"]).unwrap();
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let r = &listed["requests"][0];
    assert_eq!(r["status"], "ACTIVE", "{listed}");
    assert_eq!(r["workKey"], "DECODE", "{listed}");
    assert_eq!(r["hasSlot"], true, "{listed}");
    assert!(r["blocks"].as_u64().unwrap() >= 1, "{listed}");
    assert!(r["lastDecision"].as_str().unwrap().starts_with("Scheduled: "), "{listed}");
    let execs =
        ferry_tests::grpcurl_ok(&["-plaintext", &grpc, "ferry.v1.Admin/ListExecutors"]).unwrap();
    let execs: serde_json::Value = serde_json::from_str(&execs).unwrap();
    assert_eq!(execs["executors"][0]["running"], 1, "{execs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reports_not_serving_while_draining() {
    let exec =
        Service::start("ferry-executor", &["--listen", "127.0.0.1:0", "--kv-cache-mib", "64"], 1)
            .unwrap();
    let target = exec.addr("grpc").to_string();
    let args = ["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--executor", &target];
    let mut sched = Service::start("ferry-scheduler", &args, 2).unwrap();
    let url = format!("http://{}", sched.addr("grpc"));
    let channel = tonic::transport::Endpoint::from_shared(url.clone()).unwrap().connect().await;
    let mut health = HealthClient::new(channel.unwrap());
    let check = |service: &str| tonic_health::pb::HealthCheckRequest { service: service.into() };
    let status = health.check(check("ferry.v1.Generation")).await.unwrap().into_inner().status;
    assert_eq!(status, ServingStatus::Serving as i32);
    let mut watch = health.watch(check("")).await.unwrap().into_inner();
    assert_eq!(watch.message().await.unwrap().unwrap().status, ServingStatus::Serving as i32);

    // A long request keeps the drain going while we look.
    let mut client = GenerationClient::connect(url).await.unwrap();
    let req = v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Prompt("Once upon a time".into())),
        stopping: Some(v1::StoppingCriteria {
            max_tokens: 120,
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut stream = client.generate(req).await.unwrap().into_inner();
    assert!(stream.message().await.unwrap().is_some());
    ferry_tests::signal(sched.pid(), "TERM").unwrap();
    let next = tokio::time::timeout(Duration::from_secs(10), watch.message()).await;
    let status = next.expect("no health update after SIGTERM").unwrap().unwrap().status;
    assert_eq!(status, ServingStatus::NotServing as i32);
    drop(watch);
    let mut tokens = 1;
    while let Some(ev) = stream.message().await.unwrap() {
        tokens += ev.token_ids.len();
    }
    assert!(tokens >= 120, "the in-flight request finished during the drain");
    assert!(sched.terminate(Duration::from_secs(30)).unwrap().success());
}

/// The series vLLM's published Grafana dashboard queries
/// (`examples/online_serving/prometheus_grafana/grafana.json` in vLLM's repository, as of
/// commit e88892c), each selected by `model_name` as the dashboard does.
const VLLM_DASHBOARD_SERIES: &[&str] = &[
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
];

/// What that dashboard queries and Ferry cannot have, with why.
const VLLM_DASHBOARD_ABSENT: &[(&str, &str)] = &[
    (
        "vllm:num_requests_swapped",
        "requests swapped to host memory: vLLM v1 dropped swapping; a preempted Ferry request \
         is recomputed or, under --preemption-mode yield, keeps its blocks on the device",
    ),
    (
        "vllm:cpu_cache_usage_perc",
        "vLLM v0's swap space; Ferry's host-memory KV is the node's KV agent, a shared tier \
         with its own metrics (ferry_kv_store_*), not a per-executor swap space",
    ),
];

/// Every query of vLLM's own dashboard finds a series here, with the served model's
/// `model_name`, except the two it cannot have ([`VLLM_DASHBOARD_ABSENT`]).
fn vllm_dashboard_finds_a_series_for_every_query(scrape: &Scrape) {
    let model = "model_name=\"SmolLM2-135M-Instruct\"";
    for name in VLLM_DASHBOARD_SERIES {
        assert!(
            scrape.samples.keys().any(|k| k.split('{').next() == Some(name) && k.contains(model)),
            "vLLM's dashboard queries {name}{{{model}}}, which Ferry does not export"
        );
    }
    for (name, why) in VLLM_DASHBOARD_ABSENT {
        assert!(!why.is_empty());
        assert!(!scrape.types.contains_key(*name), "{name} is exported after all");
    }
}

/// Every metric the Grafana dashboard (`helm/ferry/dashboards/ferry.json`) queries is one the
/// services export (a histogram's `_bucket` counts as its family).
fn dashboard_queries_only_exported_metrics(scrapes: &[&Scrape]) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../helm/ferry/dashboards/ferry.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut used = Vec::new();
    for panel in json["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            // Metric names: identifiers that start with `vllm:` or `ferry_`.
            let mut rest = expr;
            while let Some(i) = rest.find("vllm:").into_iter().chain(rest.find("ferry_")).min() {
                let name: String = rest[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                rest = &rest[i + name.len()..];
                used.push(name);
            }
        }
    }
    assert!(used.len() >= 16, "the dashboard queries too little: {used:?}");
    // Exported only by schedulers that campaign through etcd (checked in tests/cluster.rs).
    let cluster_only = ["ferry_scheduler_leader", "ferry_scheduler_epoch"];
    for name in used {
        let family = name.strip_suffix("_bucket").unwrap_or(&name);
        if cluster_only.contains(&family) {
            continue;
        }
        assert!(
            scrapes.iter().any(|s| s.types.contains_key(family)),
            "the dashboard queries {name}, which no service exports"
        );
    }
}
