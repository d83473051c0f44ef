//! Speculative decoding through `ferry serve` (issue 20): with `--speculative-config` (vLLM's
//! n-gram method) 32 streams, half greedy and half seeded at temperature 0.8, deliver exactly
//! the tokens they deliver without it, though a KV cache too small for all of them preempts
//! and recomputes some; drafts were verified and accepted (vLLM's `spec_decode` counters), and
//! every block is free afterwards.

use std::time::Duration;

use ferry_proto::v1;

use ferry_tests::streams::{
    assert_complete, assert_executor_idle_at, assert_same_streams, metric, request, run_streams,
    try_metric, wait_for,
};
use ferry_tests::{serve_args, Service};

/// `ferry serve` with `extra` flags, once its executor is connected.
async fn serve(kv_mib: &str, extra: &[&str]) -> Service {
    let mut args = serve_args(kv_mib).to_vec();
    args.extend(extra);
    let svc = Service::start("ferry", &args, 4).expect("ferry serve");
    let http = svc.addr("http");
    let up = wait_for(Duration::from_mins(1), || {
        try_metric(http, "ferry_executors_connected") == Some(1.0)
    });
    assert!(up.await.is_some(), "serve's executor never connected");
    svc
}

/// Prompts that repeat themselves, as a request to quote or edit text does: the model's
/// answers repeat them too, so n-gram drafts are often right.
fn prompts() -> Vec<String> {
    let animals = ["cat", "dog", "fox", "owl", "bee", "cow", "elk", "ant"];
    let things = ["mat", "log", "box", "rug"];
    (0..32)
        .map(|i| {
            let line = format!(
                "the {} sat on the {} and the {} looked at the {}.",
                animals[i % 8],
                things[i % 4],
                animals[(i + 3) % 8],
                things[(i / 4) % 4]
            );
            format!("Copy this line four times, exactly:\n{line}\n{line}\n")
        })
        .collect()
}

const MAX_TOKENS: usize = 48;

fn requests() -> Vec<v1::GenerateRequest> {
    prompts()
        .into_iter()
        .enumerate()
        .map(|(i, p)| request(p, MAX_TOKENS as u32, (i % 2 == 1).then_some(i as u64)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculation_changes_no_stream_greedy_or_seeded_across_preemption() {
    // Without speculation, room for every stream.
    let plain = serve("256", &[]).await;
    let want = run_streams(plain.addr("grpc"), requests(), 0, || {}).await;
    assert_complete(&want, MAX_TOKENS);
    assert_eq!(metric(plain.addr("http"), "vllm:spec_decode_num_drafts_total"), 0.0);
    drop(plain);

    // With it, and a cache that holds a few streams at a time (6 MiB of f16 KV, about 270
    // tokens).
    let config = r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}"#;
    let spec = serve("6", &["--speculative-config", config]).await;
    let got = run_streams(spec.addr("grpc"), requests(), 0, || {}).await;
    assert_complete(&got, MAX_TOKENS);
    assert_same_streams(&got, &want);

    let http = spec.addr("http");
    let drafts = metric(http, "vllm:spec_decode_num_drafts_total");
    let draft_tokens = metric(http, "vllm:spec_decode_num_draft_tokens_total");
    let accepted = metric(http, "vllm:spec_decode_num_accepted_tokens_total");
    let first = metric(http, "vllm:spec_decode_num_accepted_tokens_per_pos{position=\"0\"");
    let preemptions = metric(http, "vllm:num_preemptions_total");
    eprintln!(
        "{drafts} verifications, {draft_tokens} draft tokens, {accepted} accepted \
         ({first} at the first position), {preemptions} preemptions"
    );
    assert!(drafts > 0.0 && accepted > 0.0, "no draft was verified and accepted");
    assert!(accepted < draft_tokens, "no draft token was rejected: the test shows too little");
    assert!(first > 0.0 && first <= drafts);
    assert_eq!(
        metric(http, "vllm:spec_decode_num_accepted_tokens_per_pos"),
        accepted,
        "per-position counts add up to the accepted tokens"
    );
    assert!(preemptions > 0.0, "the small cache preempted nothing: the test shows too little");
    // Every block back in the free pool, on the scheduler's side and the executor's.
    let free = wait_for(Duration::from_secs(10), || {
        try_metric(http, "vllm:kv_cache_usage_perc") == Some(0.0)
    });
    assert!(free.await.is_some(), "blocks still held after every stream ended");
    assert_executor_idle_at(spec.addr("executor")).await;
}
