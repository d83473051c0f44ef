//! Parallel sampling through `ferry serve` (issue 20): `n` = 4 at temperature 1 with a seed
//! gives four different choices, the same ones every time — over HTTP and streamed over gRPC
//! with their index, and on a cache so small that samples are preempted and recompute. The
//! prompt is computed once (the other samples fork from its KV: `vllm:prompt_tokens_total`
//! counts it once plus one token per other sample), usage counts it once, and every block is
//! free afterwards. A client that leaves ends every sample.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use ferry_proto::v1::{self, generation_client::GenerationClient};
use serde_json::{json, Value};

use ferry_tests::streams::{assert_executor_idle_at, metric, try_metric, wait_for};
use ferry_tests::{http, serve_args, Service};

/// `ferry serve` with a KV cache of `kv_mib`, once its executor is connected.
async fn serve(kv_mib: &str) -> Service {
    let svc = Service::start("ferry", &serve_args(kv_mib), 4).expect("ferry serve");
    let http = svc.addr("http");
    let up = wait_for(Duration::from_mins(1), || {
        try_metric(http, "ferry_executors_connected") == Some(1.0)
    });
    assert!(up.await.is_some(), "serve's executor never connected");
    svc
}

/// A prompt of about a hundred tokens: several full KV blocks and a partial one.
fn prompt() -> String {
    "A traveller crossing the mountains at dusk stops at an inn, where the keeper tells a \
     story about the river below, the bridge that washed away in the spring flood, and the \
     ferryman who carried the whole village across, one boat at a time, for a week. Tell the \
     rest of the story in your own words:"
        .to_string()
}

const N: usize = 4;
const MAX_TOKENS: usize = 64;

fn body(stream: bool) -> Value {
    json!({
        "prompt": prompt(), "n": N, "temperature": 1.0, "seed": 11, "max_tokens": MAX_TOKENS,
        "ignore_eos": true, "stream": stream,
    })
}

/// The choices' texts of a non-streamed completion, by index, and its usage.
fn complete(addr: SocketAddr) -> (Vec<String>, Value) {
    let (status, text) =
        http(addr, "POST", "/v1/completions", body(false).to_string().as_bytes()).unwrap();
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), N, "{v}");
    let texts = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i, "{v}");
            assert_eq!(c["finish_reason"], "length", "{v}");
            c["text"].as_str().unwrap().to_string()
        })
        .collect();
    (texts, v["usage"].clone())
}

/// The same request streamed over gRPC: each sample's text and tokens by its event index.
async fn stream(grpc: SocketAddr) -> BTreeMap<u32, (String, usize)> {
    let mut client = GenerationClient::connect(format!("http://{grpc}")).await.unwrap();
    let req = v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Prompt(prompt())),
        sampling: Some(v1::SamplingParams {
            temperature: 1.0,
            seed: Some(11),
            ..Default::default()
        }),
        stopping: Some(v1::StoppingCriteria {
            max_tokens: MAX_TOKENS as u32,
            ignore_eos: true,
            ..Default::default()
        }),
        n: N as u32,
        ..Default::default()
    };
    let mut events = client.generate(req).await.unwrap().into_inner();
    let mut samples: BTreeMap<u32, (String, usize)> = BTreeMap::new();
    let mut finished = 0;
    while let Some(ev) = events.message().await.unwrap() {
        let s = samples.entry(ev.index).or_default();
        s.0.push_str(&ev.text);
        s.1 += ev.token_ids.len();
        finished += usize::from(ev.finish_reason != 0);
    }
    assert_eq!(finished, N, "each sample ends with its own final event");
    samples
}

async fn assert_all_free(svc: &Service) {
    let http = svc.addr("http");
    let free = wait_for(Duration::from_secs(10), || {
        try_metric(http, "vllm:kv_cache_usage_perc") == Some(0.0)
    });
    assert!(free.await.is_some(), "blocks still held after every sample ended");
    assert_executor_idle_at(svc.addr("executor")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_samples_fork_from_one_prompt_and_differ_reproducibly() {
    let svc = serve("256").await;
    let addr = svc.addr("http");
    let (texts, usage) = complete(addr);
    let distinct: std::collections::HashSet<&String> = texts.iter().collect();
    assert_eq!(distinct.len(), N, "four samples at temperature 1 differ: {texts:?}");

    // The prompt was computed once: the source all of it, each other sample its last token.
    let prompt_len = usage["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(usage["completion_tokens"], N * MAX_TOKENS, "{usage}");
    assert_eq!(metric(addr, "vllm:prompt_tokens_total") as usize, prompt_len + N - 1);
    assert_eq!(metric(addr, "ferry_parallel_sampling_forks_total") as usize, N - 1);
    let shared = metric(addr, "ferry_parallel_sampling_shared_blocks_total") as usize;
    let copied = metric(addr, "ferry_parallel_sampling_copied_blocks_total") as usize;
    let block = 16;
    assert_eq!(shared, (N - 1) * ((prompt_len - 1) / block), "full prompt blocks shared");
    assert_eq!(copied, (N - 1) * usize::from(!(prompt_len - 1).is_multiple_of(block)));
    assert_all_free(&svc).await;

    // A sample is what a request of its own with its seed (11 + its index, as vLLM's) gives:
    // the KV it forked (shared blocks and a copied one) is the KV it would have computed.
    for (i, want) in texts.iter().enumerate().skip(1) {
        let mut one = body(false);
        one["n"] = json!(1);
        one["seed"] = json!(11 + i);
        let (status, text) =
            http(addr, "POST", "/v1/completions", one.to_string().as_bytes()).unwrap();
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["choices"][0]["text"].as_str(), Some(want.as_str()), "sample {i}");
    }

    // The same request again: the same choices.
    assert_eq!(complete(addr).0, texts, "a seeded request's samples are reproducible");
    // Streamed over gRPC, each sample's events carry its index.
    let streamed = stream(svc.addr("grpc")).await;
    let by_index: Vec<String> = streamed.values().map(|(t, _)| t.clone()).collect();
    assert_eq!(by_index, texts);
    assert!(streamed.values().all(|&(_, n)| n == MAX_TOKENS));
    assert_all_free(&svc).await;
    drop(svc);

    // A cache of 6 MiB of f16 KV (17 blocks of 16 tokens) holds the shared prompt (4 blocks)
    // and two samples' own 5, not four: samples are preempted, recompute, and still give the
    // same choices.
    let small = serve("6").await;
    let (again, _) = complete(small.addr("http"));
    assert!(metric(small.addr("http"), "vllm:num_preemptions_total") > 0.0, "nothing preempted");
    assert!(metric(small.addr("http"), "ferry_parallel_sampling_forks_total") > 0.0);
    assert_eq!(again, texts, "preemption changed a sample");
    assert_all_free(&small).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_ends_every_sample() {
    let svc = serve("256").await;
    let mut client =
        GenerationClient::connect(format!("http://{}", svc.addr("grpc"))).await.unwrap();
    let req = v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Prompt(prompt())),
        sampling: Some(v1::SamplingParams { temperature: 1.0, ..Default::default() }),
        stopping: Some(v1::StoppingCriteria {
            max_tokens: 2000,
            ignore_eos: true,
            ..Default::default()
        }),
        n: N as u32,
        ..Default::default()
    };
    let mut events = client.generate(req).await.unwrap().into_inner();
    let first = events.message().await.unwrap().expect("a first event");
    assert!(!first.token_ids.is_empty());
    drop(events);
    let http = svc.addr("http");
    let aborted = wait_for(Duration::from_secs(20), || {
        try_metric(http, "vllm:request_success_total{finished_reason=\"abort\"") == Some(N as f64)
    });
    assert!(aborted.await.is_some(), "not every sample was aborted");
    assert_all_free(&svc).await;
}
