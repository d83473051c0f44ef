//! Every request limit is a flag: `ferry serve` started with small limits refuses each request
//! past one with 400 (or 413 / `OUT_OF_RANGE` for a request too large to read), naming the
//! flag and the limit, and serves the rest; an executor's `--max-live-requests` turns new
//! requests away with 429 / `RESOURCE_EXHAUSTED` while it is full and takes them once it has
//! room.

// Each test is one end-to-end scenario, read top to bottom; splitting one would scatter it.
#![allow(clippy::too_many_lines)]

use ferry_proto::v1::{self, generation_client::GenerationClient};
use ferry_tests::{http, signal, start_scheduler, Service};

fn ids(n: usize) -> String {
    vec!["42"; n].join(",")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_limit_is_a_flag_that_refuses_what_is_past_it() {
    let args = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--kv-cache-mib",
        "64",
        "--max-model-len",
        "44",
        "--max-prompt-tokens",
        "40",
        "--max-output-tokens",
        "8",
        "--max-stop-strings",
        "2",
        "--max-stop-string-bytes",
        "8",
        "--max-stop-token-ids",
        "2",
        "--max-logprobs",
        "2",
        "--max-request-bytes",
        "4096",
    ];
    let svc = Service::start("ferry", &args, 4).unwrap();
    let h = svc.addr("http");
    let (status, models) = http(h, "GET", "/v1/models", b"").unwrap();
    assert_eq!(status, 200);
    assert!(models.contains(r#""max_model_len":44"#), "{models}");
    let cases: Vec<(String, &str)> = vec![
        (
            format!(r#"{{"prompt":[{}],"max_tokens":1}}"#, ids(41)),
            "at most 40 (--max-prompt-tokens)",
        ),
        (r#"{"prompt":"hi","max_tokens":9}"#.into(), "8 (--max-output-tokens)"),
        (r#"{"prompt":"hi","stop":["a","b","c"]}"#.into(), "at most 2 (--max-stop-strings)"),
        (r#"{"prompt":"hi","stop":["123456789"]}"#.into(), "at most 8 (--max-stop-string-bytes)"),
        (r#"{"prompt":"hi","stop_token_ids":[1,2,3]}"#.into(), "at most 2 (--max-stop-token-ids)"),
        (r#"{"prompt":"hi","max_tokens":1,"logprobs":3}"#.into(), "at most 2 (--max-logprobs)"),
        (
            format!(r#"{{"prompt":[{}],"max_tokens":8}}"#, ids(40)),
            "exceeds the model's maximum length of 44",
        ),
    ];
    for (body, needle) in &cases {
        let (status, text) = http(h, "POST", "/v1/completions", body.as_bytes()).unwrap();
        assert_eq!(status, 400, "{body}: {text}");
        assert!(text.contains(needle), "{body}: {text} should say {needle:?}");
    }
    let chat = r#"{"messages":[{"role":"user","content":"hi"}],"logprobs":true,"top_logprobs":3}"#;
    let (status, text) = http(h, "POST", "/v1/chat/completions", chat.as_bytes()).unwrap();
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("--max-logprobs"), "{text}");
    // A body past --max-request-bytes is not read: 413 (a few tries: see serve_generation).
    let big = format!(r#"{{"prompt":"{}"}}"#, "a".repeat(5000));
    let too_large = (0..3).find_map(|_| http(h, "POST", "/v1/completions", big.as_bytes()).ok());
    assert_eq!(too_large.map(|r| r.0), Some(413));
    // A gRPC message past it is refused by the transport, naming the limit.
    let mut client =
        GenerationClient::connect(format!("http://{}", svc.addr("grpc"))).await.unwrap();
    let big = v1::GenerateRequest {
        input: Some(v1::generate_request::Input::PromptTokenIds(v1::TokenIds {
            ids: vec![40_000; 2000],
        })),
        ..Default::default()
    };
    let status = client.generate(big).await.unwrap_err();
    assert!(status.message().contains("4096"), "{status}");
    // Within every limit: served.
    let ok = r#"{"prompt":"The capital of France is","max_tokens":2,"temperature":0,"logprobs":2,"stop":["xyz"],"stop_token_ids":[7]}"#;
    let (status, body) = http(h, "POST", "/v1/completions", ok.as_bytes()).unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""text":" Paris."#), "{body}");
    let (status, body) =
        http(h, "POST", "/v1/completions", br#"{"prompt":"hi","temperature":0}"#).unwrap();
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() <= 8, "no max_tokens: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_executor_turns_new_requests_away_until_it_has_room() {
    let args = ["--listen", "127.0.0.1:0", "--kv-cache-mib", "64", "--max-live-requests", "2"];
    let exec = Service::start("ferry-executor", &args, 1).unwrap();
    let sched = start_scheduler(&[&exec], &[]);
    let mut client =
        GenerationClient::connect(format!("http://{}", sched.addr("grpc"))).await.unwrap();
    let request = |text: &str| v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Prompt(text.into())),
        stopping: Some(v1::StoppingCriteria {
            max_tokens: 8,
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let drain = |mut stream: tonic::Streaming<v1::GenerateEvent>| async move {
        let mut tokens = 0;
        while let Some(ev) = stream.message().await.unwrap() {
            tokens += ev.token_ids.len();
        }
        tokens
    };
    // Served while it has room (and the scheduler's session is up before the executor stops).
    assert_eq!(drain(client.generate(request("Zero")).await.unwrap().into_inner()).await, 8);
    // The executor stopped: two requests are taken and stay live, a third finds it full.
    signal(exec.pid(), "STOP").unwrap();
    let first = client.generate(request("One")).await.unwrap().into_inner();
    let second = client.generate(request("Two")).await.unwrap().into_inner();
    let status = client.generate(request("Three")).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status}");
    assert!(status.message().contains("--max-live-requests"), "{status}");
    let (code, body) =
        http(sched.addr("http"), "POST", "/v1/completions", br#"{"prompt":"Four"}"#).unwrap();
    assert_eq!(code, 429, "{body}");
    signal(exec.pid(), "CONT").unwrap();
    assert_eq!((drain(first).await, drain(second).await), (8, 8));
    // Room again: served.
    assert_eq!(drain(client.generate(request("Three")).await.unwrap().into_inner()).await, 8);
}

/// A scheduler whose largest possible step is past an executor's `--max-step-bytes` does not
/// drive it (its steps could not be decoded); one whose steps fit does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_drives_an_executor_only_if_its_largest_step_fits() {
    let args = ["--listen", "127.0.0.1:0", "--kv-cache-mib", "64", "--max-step-bytes", "262144"];
    let exec = Service::start("ferry-executor", &args, 1).unwrap();
    let body = br#"{"prompt":"The capital of France is","max_tokens":2,"temperature":0}"#;
    // 256 requests of up to 8192 tokens: megabytes.
    let wide = start_scheduler(&[&exec], &["--executor-connect-timeout", "1"]);
    let (code, text) = http(wide.addr("http"), "POST", "/v1/completions", body).unwrap();
    assert_eq!(code, 503, "{text}");
    assert!(text.contains("no executor serving model"), "{text}");
    // One request of up to 8192 tokens and a structured-output grammar: about 120 KB.
    let narrow = start_scheduler(&[&exec], &["--max-num-seqs", "1"]);
    let (code, text) = http(narrow.addr("http"), "POST", "/v1/completions", body).unwrap();
    assert_eq!(code, 200, "{text}");
    assert!(text.contains(r#""text":" Paris."#), "{text}");
}
