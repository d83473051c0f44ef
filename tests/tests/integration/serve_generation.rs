//! `ferry serve` — front, scheduler, executor and KV agent in one process — answering
//! real requests over gRPC: the France question, stop strings, greedy determinism under
//! concurrency, bad input refused with the right code, and an aborted stream freeing its KV.

// Each test is one end-to-end scenario, read top to bottom; splitting one would scatter it.
#![allow(clippy::too_many_lines)]

use std::time::Duration;

use ferry_proto::v1::{self, executor_client::ExecutorClient, generation_client::GenerationClient};
use ferry_tests::{start_serve, Service};
use tonic::transport::Channel;

async fn generate(
    client: &mut GenerationClient<Channel>,
    req: v1::GenerateRequest,
) -> Result<(String, Vec<v1::GenerateEvent>), tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    let (mut text, mut events) = (String::new(), Vec::new());
    while let Some(ev) = stream.message().await? {
        text.push_str(&ev.text);
        events.push(ev);
    }
    Ok((text, events))
}

fn chat(messages: &[(&str, &str)], max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Chat(v1::Chat {
            messages: messages
                .iter()
                .map(|(r, c)| v1::ChatMessage {
                    role: r.to_string(),
                    content: c.to_string(),
                    ..Default::default()
                })
                .collect(),
            add_generation_prompt: true,
            ..Default::default()
        })),
        stopping: Some(v1::StoppingCriteria { max_tokens, ..Default::default() }),
        ..Default::default()
    }
}

fn prompt(text: &str, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Prompt(text.into())),
        stopping: Some(v1::StoppingCriteria { max_tokens, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

/// Separate processes: an executor with a 64 MiB cache, and a scheduler pointed at it with
/// `extra` flags.
fn start_split(extra: &[&str]) -> (Service, Service) {
    let exec =
        Service::start("ferry-executor", &["--listen", "127.0.0.1:0", "--kv-cache-mib", "64"], 1)
            .unwrap();
    let target = exec.addr("grpc").to_string();
    let sched = start_scheduler(&[&target], extra);
    (exec, sched)
}

/// A scheduler on free ports driving the executors at `targets`, with `extra` flags.
fn start_scheduler(targets: &[&str], extra: &[&str]) -> Service {
    let mut args = vec!["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"];
    for t in targets {
        args.extend(["--executor", t]);
    }
    args.extend_from_slice(extra);
    Service::start("ferry-scheduler", &args, 2).unwrap()
}

/// Waits until the executor holds no request and no block.
async fn wait_until_idle(exec: &mut ExecutorClient<Channel>) -> v1::ExecutorDescription {
    for _ in 0..200 {
        let d = exec.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
        if d.num_requests == 0 && d.blocks_in_use == 0 {
            return d;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    exec.describe(v1::DescribeRequest {}).await.unwrap().into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_answers_over_grpc() {
    let svc = start_serve("128");
    let mut client =
        GenerationClient::connect(format!("http://{}", svc.addr("grpc"))).await.unwrap();
    let mut exec =
        ExecutorClient::connect(format!("http://{}", svc.addr("executor"))).await.unwrap();

    // The France question, greedy, as the model answers it.
    let (text, events) = generate(
        &mut client,
        chat(
            &[
                ("system", "You are a helpful assistant."),
                ("user", "What is the capital of France?"),
            ],
            32,
        ),
    )
    .await
    .unwrap();
    assert_eq!(text, "The capital of France is Paris.");
    let last = events.last().unwrap();
    assert_eq!(last.finish_reason(), v1::FinishReason::Stop);
    let usage = last.usage.unwrap();
    assert_eq!(
        usage.completion_tokens as usize,
        events.iter().map(|e| e.token_ids.len()).sum::<usize>()
    );

    // A stop string ends the request and is not returned.
    let mut req = prompt("The capital of France is", 12);
    req.stopping.as_mut().unwrap().stop = vec![".".into()];
    let (text, events) = generate(&mut client, req).await.unwrap();
    assert_eq!(text, " Paris");
    assert_eq!(events.last().unwrap().stop_reason, ".");

    // 64 concurrent streams with ignore_eos: exact lengths, and greedy outputs equal to the
    // same requests run one at a time.
    let subjects = [
        "the sea",
        "a city",
        "the moon",
        "an old house",
        "a river",
        "winter",
        "a robot",
        "the forest",
    ];
    let prompts: Vec<String> = (0..64)
        .map(|i| format!("Story {i}: a short tale about {}.", subjects[i % subjects.len()]))
        .collect();
    let mut alone = Vec::new();
    for p in &prompts {
        let (text, events) = generate(&mut client, prompt(p, 12)).await.unwrap();
        let last = events.last().unwrap();
        assert_eq!(last.usage.unwrap().completion_tokens, 12);
        assert_eq!(last.finish_reason(), v1::FinishReason::Length);
        alone.push(text);
    }
    let together = futures_join(prompts.iter().map(|p| {
        let mut c = client.clone();
        let req = prompt(p, 12);
        async move {
            let (text, events) = generate(&mut c, req).await.unwrap();
            assert_eq!(events.last().unwrap().usage.unwrap().completion_tokens, 12);
            text
        }
    }))
    .await;
    assert_eq!(together, alone, "batching changed greedy outputs");

    // Bad input: clear codes, and the service keeps serving.
    let bad_model = v1::GenerateRequest { model: "gpt-4".into(), ..prompt("Hi", 4) };
    assert_eq!(generate(&mut client, bad_model).await.unwrap_err().code(), tonic::Code::NotFound);
    let too_long = generate(&mut client, prompt("Hi", 100_000)).await.unwrap_err();
    assert_eq!(too_long.code(), tonic::Code::InvalidArgument);
    let listed = client.list_models(v1::ListModelsRequest {}).await.unwrap().into_inner().models;
    assert_eq!(
        (listed[0].architecture.as_str(), &listed[0].weight_types[..]),
        ("llama", &["Q4_1".to_string(), "Q8_0".to_string()][..])
    );
    let served = listed[0].max_model_len;
    assert!(served < 8192, "the KV cache of 128 MiB caps the length below the model's 8192");
    assert!(too_long.message().contains(&served.to_string()), "{too_long}");
    let mut bad_temp = prompt("Hi", 4);
    bad_temp.sampling = Some(v1::SamplingParams { temperature: -1.0, ..Default::default() });
    assert_eq!(
        generate(&mut client, bad_temp).await.unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    let empty = v1::GenerateRequest { input: None, ..Default::default() };
    assert_eq!(
        generate(&mut client, empty).await.unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    // A continuation (prior output tokens) must stay in the vocabulary and leave something to
    // generate; a valid one streams only the tokens after the prior ones.
    let mut bad_token = prompt("Hi", 4);
    bad_token.output_token_ids = vec![1, 10_000_000];
    let err = generate(&mut client, bad_token).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("10000000") && err.message().contains("vocabulary"), "{err}");
    let mut nothing_left = prompt("Hi", 2);
    nothing_left.output_token_ids = vec![1, 2];
    let err = generate(&mut client, nothing_left).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("max_tokens 2"), "{err}");
    let mut greedy = prompt("The capital of France is", 6);
    greedy.sampling = Some(v1::SamplingParams { temperature: 0.0, ..Default::default() });
    let (_, whole) = generate(&mut client, greedy.clone()).await.unwrap();
    let whole: Vec<u32> = whole.iter().flat_map(|e| e.token_ids.clone()).collect();
    let mut continued = greedy;
    continued.output_token_ids = whole[..2].to_vec();
    let (_, rest) = generate(&mut client, continued).await.unwrap();
    let rest: Vec<u32> = rest.iter().flat_map(|e| e.token_ids.clone()).collect();
    assert_eq!(rest, whole[2..], "a continuation goes on exactly where it stopped");

    // A client that drops its stream mid-way aborts the request; its blocks are freed.
    let mut stream =
        client.generate(prompt("Tell me a long story", 2000)).await.unwrap().into_inner();
    for _ in 0..3 {
        stream.message().await.unwrap().unwrap();
    }
    drop(stream);
    let idle = wait_until_idle(&mut exec).await;
    assert_eq!((idle.num_requests, idle.blocks_in_use), (0, 0), "an abandoned stream leaked");

    // An explicit Abort ends the stream with ABORT.
    let mut req = prompt("Count to a thousand:", 2000);
    req.request_id = "to-abort".into();
    let mut stream = client.generate(req).await.unwrap().into_inner();
    stream.message().await.unwrap().unwrap();
    assert!(
        client
            .abort(v1::AbortRequest { request_id: "to-abort".into() })
            .await
            .unwrap()
            .into_inner()
            .found
    );
    let mut last = None;
    while let Some(ev) = stream.message().await.unwrap() {
        last = Some(ev);
    }
    assert_eq!(last.unwrap().finish_reason(), v1::FinishReason::Abort);
    let idle = wait_until_idle(&mut exec).await;
    assert_eq!((idle.num_requests, idle.blocks_in_use), (0, 0));
    drop(svc);
}

/// Runs futures concurrently and returns their outputs in order.
async fn futures_join<F: std::future::Future<Output = String> + Send + 'static>(
    futs: impl Iterator<Item = F>,
) -> Vec<String> {
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

#[test]
fn serve_speaks_the_openai_http_api() {
    use ferry_tests::http;
    let svc = start_serve("64");
    let h = svc.addr("http");
    assert_eq!(http(h, "GET", "/health", b"").unwrap().0, 200);
    let (status, models) = http(h, "GET", "/v1/models", b"").unwrap();
    assert_eq!(status, 200);
    assert!(models.contains("\"SmolLM2-135M-Instruct\""), "{models}");
    // What the file is: its architecture and its matrices' types, most tensors first.
    let listed: serde_json::Value = serde_json::from_str(&models).unwrap();
    assert_eq!(listed["data"][0]["architecture"], "llama", "{models}");
    assert_eq!(listed["data"][0]["weight_types"], serde_json::json!(["Q4_1", "Q8_0"]), "{models}");

    let chat = br#"{"model":"SmolLM2-135M-Instruct","temperature":0,"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"What is the capital of France?"}]}"#;
    let (status, body) = http(h, "POST", "/v1/chat/completions", chat).unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""content":"The capital of France is Paris.""#), "{body}");
    assert!(body.contains(r#""finish_reason":"stop""#), "{body}");

    // Streaming chat: the deltas add up to the same answer, then usage, then [DONE].
    let stream = br#"{"temperature":0,"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"What is the capital of France?"}]}"#;
    let (status, body) = http(h, "POST", "/v1/chat/completions", stream).unwrap();
    assert_eq!(status, 200);
    let mut text = String::new();
    let datas: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(*datas.last().unwrap(), "[DONE]");
    for d in &datas[..datas.len() - 1] {
        let v: serde_json::Value = serde_json::from_str(d).unwrap();
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(c);
        }
    }
    assert_eq!(text, "The capital of France is Paris.");
    assert!(datas[datas.len() - 2].contains("\"usage\""), "{body}");

    // Bad input: the status and a message that says what was wrong.
    for (path, body, want, needle) in [
        (
            "/v1/completions",
            &br#"{"prompt":"hi","max_tokens":99999}"#[..],
            400,
            "maximum length of",
        ),
        ("/v1/completions", &b"{not json"[..], 400, "invalid request body"),
        // A route not served: OpenAI's error shape, naming what is.
        ("/v1/embeddings", &br#"{"input":"hi"}"#[..], 404, "POST /v1/embeddings is not served"),
        ("/v1/models", &b"{}"[..], 405, "POST is not allowed on /v1/models"),
        (
            "/v1/chat/completions",
            &br#"{"model":"gpt-4","messages":[{"role":"user","content":"hi"}]}"#[..],
            404,
            "not served",
        ),
        ("/v1/completions", &br#"{"prompt":"hi","n":65}"#[..], 400, "at most 64, got 65"),
        (
            "/v1/completions",
            &br#"{"prompt":"hi","n":2,"best_of":3,"stream":true}"#[..],
            400,
            "cannot be streamed",
        ),
        ("/v1/completions", &br#"{"prompt":"hi","max_tokens":0}"#[..], 400, "at least 1"),
        // A value of the wrong kind names its field and the kind expected.
        (
            "/v1/completions",
            &br#"{"prompt":"hi","max_tokens":-3}"#[..],
            400,
            "max_tokens: invalid value: integer `-3`, expected a non-negative integer",
        ),
        (
            "/v1/chat/completions",
            &br#"{"messages":[{"role":"user","content":"hi"}],"top_p":"high"}"#[..],
            400,
            "top_p: invalid type: string",
        ),
        ("/v1/completions", &br#"{"prompt":""}"#[..], 400, "empty"),
        ("/v1/completions", &br#"{"prompt":"hi","temperature":-2}"#[..], 400, "temperature"),
        // Fields Ferry does not implement: refused by name, never served as if absent.
        // A grammar llguidance refuses, and two constraints at once.
        (
            "/v1/chat/completions",
            &br#"{"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"nonsense"}}}}"#[..],
            400,
            "structured output: ",
        ),
        (
            "/v1/completions",
            &br#"{"prompt":"hi","guided_regex":"a+","guided_choice":["a"]}"#[..],
            400,
            "only use one kind of structured outputs constraint",
        ),
        (
            "/v1/chat/completions",
            &br#"{"messages":[{"role":"user","content":"hi"}],"functions":[{"name":"f"}]}"#[..],
            400,
            "functions = ",
        ),
        (
            "/v1/chat/completions",
            &br#"{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":{"type":"function","function":{"name":"g"}}}"#[..],
            400,
            "which is not in tools",
        ),
        (
            "/v1/chat/completions",
            &br#"{"messages":[{"role":"user","content":"hi"}],"best_of":3}"#[..],
            400,
            "best_of = 3",
        ),
        (
            "/v1/chat/completions",
            &br#"{"messages":[{"role":"user","content":"hi"}],"guided_regex":"a","guided_whitespace_pattern":" "}"#[..],
            400,
            "guided_whitespace_pattern applies to JSON constraints",
        ),
        (
            "/v1/completions",
            &br#"{"prompt":"hi","logit_bias":{"1":500}}"#[..],
            400,
            "logit_bias for token 1 is 500; it must be in [-100, 100]",
        ),
        (
            "/v1/completions",
            &br#"{"prompt":"hi","logit_bias":{"word":5}}"#[..],
            400,
            "is not a token id",
        ),
        (
            "/v1/completions",
            &br#"{"prompt":"hi","allowed_token_ids":[99999999]}"#[..],
            400,
            "allowed_token_ids contains out-of-vocab token id 99999999",
        ),
        (
            "/v1/chat/completions",
            &br#"{"messages":[{"role":"user","content":"hi","function_call":{"name":"f"}}]}"#[..],
            400,
            "messages[0].function_call",
        ),
        // Values vLLM refuses.
        ("/v1/completions", &br#"{"prompt":"hi","top_p":0}"#[..], 400, "top_p must be in (0, 1]"),
        ("/v1/completions", &br#"{"prompt":"hi","top_k":-5}"#[..], 400, "top_k must be"),
        // Under the default first-come-first-served policy a priority would be ignored.
        (
            "/v1/completions",
            &br#"{"prompt":"hi","priority":-3}"#[..],
            400,
            "--scheduling-policy priority",
        ),
        (
            "/v1/completions",
            &br#"{"prompt":"hi","repetition_penalty":0}"#[..],
            400,
            "repetition_penalty must be greater than zero",
        ),
        ("/v1/completions", &br#"{"prompt":"hi","stop":["a",""]}"#[..], 400, "empty string"),
        (
            "/v1/chat/completions",
            &br#"{"messages":[{"role":"user","content":"hi"}],"top_logprobs":2}"#[..],
            400,
            "needs logprobs = true",
        ),
    ] {
        let (status, text) = http(h, "POST", path, body).unwrap();
        assert_eq!(status, want, "{path} {text}");
        assert!(text.contains(needle), "{text} should mention {needle:?}");
    }
    // No-op values of unimplemented fields, and fields Ferry has never heard of, are accepted;
    // add_generation_prompt is honoured (without it the prompt lacks the assistant header).
    let prompt_tokens = |extra: &str| {
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"hi"}}],"max_tokens":1,"temperature":0{extra}}}"#
        );
        let (status, text) = http(h, "POST", "/v1/chat/completions", body.as_bytes()).unwrap();
        assert_eq!(status, 200, "{extra}: {text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let with = prompt_tokens(
        r#","tools":[],"echo":false,"best_of":1,"response_format":{"type":"text"},"some_future_field":7"#,
    );
    let without = prompt_tokens(r#","add_generation_prompt":false"#);
    assert!(without < with, "add_generation_prompt false: {without} tokens, true: {with}");
    // Logprobs in the completions shape: one per token, the top alternatives best first.
    let (status, body) = http(
        h,
        "POST",
        "/v1/completions",
        br#"{"prompt":"The capital of France is","max_tokens":3,"temperature":0,"logprobs":2}"#,
    )
    .unwrap();
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3, "{body}");
    assert_eq!(lp["tokens"][0], " Paris");
    let first = lp["token_logprobs"][0].as_f64().unwrap();
    assert!(first < 0.0 && first > -5.0, "{body}");
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2, "{body}");
    // The server answers 413 once it has read past the limit and closes; the rest of the body
    // then meets a closed socket, which can reset the connection before the answer is read
    // (a race in TCP, not in the server): a few attempts make the check deterministic.
    let big = vec![b'a'; 5 * 1024 * 1024];
    let too_large = (0..3).find_map(|_| http(h, "POST", "/v1/completions", &big).ok());
    assert_eq!(too_large.map(|r| r.0), Some(413));
    // Still serving.
    let (status, body) = http(
        h,
        "POST",
        "/v1/completions",
        br#"{"prompt":"The capital of France is","max_tokens":2,"temperature":0}"#,
    )
    .unwrap();
    assert_eq!(status, 200);
    assert!(body.contains(r#""text":" Paris."#), "{body}");

    // The load generator against this server, and in process, writing its JSON report.
    let dir = std::env::temp_dir().join(format!("ferry-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, extra) in [
        ("served", vec!["--target", &h.to_string()]),
        ("in-process", vec!["--in-process", "--kv-cache-mib", "64"]),
    ]
    .iter()
    .map(|(n, e)| (*n, e.iter().map(std::string::ToString::to_string).collect::<Vec<_>>()))
    {
        let json = dir.join(format!("{name}.json"));
        let mut args: Vec<String> = [
            "serve",
            "--requests",
            "4",
            "--concurrency",
            "2",
            "--prompt-len",
            "10:20",
            "--output-len",
            "4",
        ]
        .iter()
        .map(std::string::ToString::to_string)
        .collect();
        args.extend(extra);
        args.extend(["--json".to_string(), json.display().to_string()]);
        let out = std::process::Command::new(ferry_tests::binary("ferry-bench").unwrap())
            .args(&args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(
            (report["completed"].as_u64(), report["output_tokens"].as_u64()),
            (Some(4), Some(16)),
            "{name}: {report}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_full_queue_answers_429_and_no_executor_503() {
    use ferry_tests::http;
    // Separate processes, with room for 2 requests.
    let (_exec, sched) = start_split(&["--max-queued-requests", "2"]);
    let h = sched.addr("http");
    let long = br#"{"prompt":"Tell me everything","max_tokens":1000,"ignore_eos":true,"temperature":0,"stream":true}"#;
    // Two streams held open fill the queue; a third request is refused with Retry-After.
    let (s1, c1) = ferry_tests::http_open(h, "/v1/completions", long).unwrap();
    let (s2, c2) = ferry_tests::http_open(h, "/v1/completions", long).unwrap();
    assert_eq!((s1, s2), (200, 200));
    let (status, body) =
        http(h, "POST", "/v1/completions", br#"{"prompt":"hi","max_tokens":1}"#).unwrap();
    assert_eq!(status, 429, "{body}");
    assert!(body.contains("limit 2"), "{body}");
    // Dropping the streams aborts their requests and frees the queue.
    drop((c1, c2));
    let mut again = 0;
    for _ in 0..200 {
        again = http(h, "POST", "/v1/completions", br#"{"prompt":"hi","max_tokens":1}"#).unwrap().0;
        if again == 200 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(again, 200, "the queue did not free up after the clients left");

    // A scheduler whose executor is unreachable starts, and says 503.
    let lonely = start_scheduler(&["127.0.0.1:1"], &["--executor-connect-timeout", "1"]);
    let h = lonely.addr("http");
    assert_eq!(http(h, "GET", "/health", b"").unwrap().0, 503);
    let (status, body) =
        http(h, "POST", "/v1/completions", br#"{"prompt":"hi","max_tokens":1}"#).unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("no executor"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_prefers_the_executor_with_the_longest_cached_prefix() {
    let e0 = Service::start(
        "ferry-executor",
        &["--listen", "127.0.0.1:0", "--kv-cache-mib", "64", "--executor-id", "e0"],
        1,
    )
    .unwrap();
    let e1 = Service::start(
        "ferry-executor",
        &["--listen", "127.0.0.1:0", "--kv-cache-mib", "64", "--executor-id", "e1"],
        1,
    )
    .unwrap();
    let (a0, a1) = (e0.addr("grpc").to_string(), e1.addr("grpc").to_string());
    let sched = start_scheduler(&[&a0, &a1], &[]);
    let mut client =
        GenerationClient::connect(format!("http://{}", sched.addr("grpc"))).await.unwrap();
    let long = |text: &str| prompt(text, 400);
    // X occupies the first executor; A (a long shared prefix) goes to the idle second one.
    let mut x = client.generate(long("Keep talking about anything")).await.unwrap().into_inner();
    x.message().await.unwrap().unwrap();
    let shared =
        "You are a careful assistant. Answer briefly and precisely, with one fact per line. "
            .repeat(4);
    let (_, a) = generate(&mut client, prompt(&format!("{shared}Question: what is water?"), 2))
        .await
        .unwrap();
    assert_eq!(a.last().unwrap().usage.unwrap().cached_prompt_tokens, 0);
    // Y makes the loads equal again (one long request each).
    let mut y = client.generate(long("Tell another long story")).await.unwrap().into_inner();
    y.message().await.unwrap().unwrap();
    // B shares A's prefix: with equal loads it must go where that prefix is cached.
    let (_, b) = generate(&mut client, prompt(&format!("{shared}Question: what is fire?"), 2))
        .await
        .unwrap();
    let cached = b.last().unwrap().usage.unwrap().cached_prompt_tokens;
    assert!(cached >= 64, "B should reuse A's cached prefix, got {cached} cached tokens");
    drop((x, y));
}

#[test]
fn a_killed_executor_fails_its_requests_and_is_taken_back_when_restarted() {
    use ferry_tests::http;
    let (exec, sched) = start_split(&[]);
    let h = sched.addr("http");
    assert_eq!(http(h, "GET", "/health", b"").unwrap().0, 200);
    // A long request is running when the executor dies (kill -9).
    let (status, stream) = ferry_tests::http_open(
        h,
        "/v1/completions",
        br#"{"prompt":"Count:","max_tokens":1000,"ignore_eos":true,"stream":true}"#,
    )
    .unwrap();
    assert_eq!(status, 200);
    ferry_tests::signal(exec.pid(), "KILL").unwrap();
    // Its stream ends (with an error event) instead of hanging.
    let rest = stream.read_rest().unwrap();
    assert!(rest.contains("\"finish_reason\":\"error\"") || rest.contains("error"), "{rest}");
    // The scheduler says so: health and new requests answer 503.
    let mut health = 0;
    for _ in 0..100 {
        health = http(h, "GET", "/health", b"").unwrap().0;
        if health == 503 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(health, 503);
    let (status, body) =
        http(h, "POST", "/v1/completions", br#"{"prompt":"hi","max_tokens":2}"#).unwrap();
    assert_eq!(status, 503, "{body}");
    // An executor restarted at the same address is taken back without restarting the scheduler.
    let addr = exec.addr("grpc").to_string();
    drop(exec);
    let _back =
        Service::start("ferry-executor", &["--listen", &addr, "--kv-cache-mib", "64"], 1).unwrap();
    let back = (0..300).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(50));
        http(h, "GET", "/health", b"").unwrap().0 == 200
    });
    assert!(back, "the scheduler did not reconnect to the restarted executor");
    let (status, body) =
        http(h, "POST", "/v1/completions", br#"{"prompt":"hi","max_tokens":2}"#).unwrap();
    assert_eq!(status, 200, "{body}");
}

#[test]
fn sigterm_lets_in_flight_requests_finish_before_exiting() {
    let mut svc = start_serve("64");
    let h = svc.addr("http");
    let body = br#"{"prompt":"Count:","max_tokens":120,"ignore_eos":true,"temperature":0,"stream":true,"stream_options":{"include_usage":true}}"#;
    let (status, stream) = ferry_tests::http_open(h, "/v1/completions", body).unwrap();
    assert_eq!(status, 200);
    ferry_tests::signal(svc.pid(), "TERM").unwrap();
    let rest = stream.read_rest().unwrap();
    assert!(rest.contains(r#""completion_tokens":120"#), "the in-flight request was cut: {rest}");
    assert!(svc.terminate(std::time::Duration::from_secs(30)).unwrap().success());
}

/// A scheduler that tokenizes for one model and an executor that runs another: the executor
/// refuses the session (fingerprints differ), and the scheduler serves nothing with it — 503,
/// never text from the wrong vocabulary.
#[test]
fn a_scheduler_and_an_executor_with_different_models_refuse_each_other() {
    use ferry_tests::http;
    // Another model file: the default one with bytes appended (same header, another size, so
    // another fingerprint).
    let dir = ferry_tests::TempDir::new("other-model").unwrap();
    let other = dir.0.join("other.gguf");
    std::fs::copy(ferry_model::default_model_path().unwrap(), &other).unwrap();
    let mut f = std::fs::OpenOptions::new().append(true).open(&other).unwrap();
    std::io::Write::write_all(&mut f, &[0u8; 64]).unwrap();
    drop(f);
    let (exec, sched) = start_split(&["--model", other.to_str().unwrap()]);
    let h = sched.addr("http");
    assert_eq!(http(h, "GET", "/health", b"").unwrap().0, 503, "no executor may be in use");
    let (status, body) =
        http(h, "POST", "/v1/completions", br#"{"prompt":"hi","max_tokens":1}"#).unwrap();
    assert_eq!(status, 503, "{body}");
    // The executor opened no session for it.
    let described = ferry_tests::grpcurl_ok(&[
        "-plaintext",
        &exec.addr("grpc").to_string(),
        "ferry.v1.Executor/Describe",
    ])
    .unwrap();
    assert!(!described.contains("sessionId"), "{described}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_priority_policy_a_more_important_request_is_admitted_first() {
    // One admission slot: while a long request holds it, a request of priority 5 and then one
    // of priority -5 wait; the second, more important (lower number), must run first.
    let (_exec, sched) = start_split(&["--scheduling-policy", "priority", "--max-num-seqs", "1"]);
    let mut client =
        GenerationClient::connect(format!("http://{}", sched.addr("grpc"))).await.unwrap();
    let mut holder = client.generate(prompt("Once upon a time", 128)).await.unwrap().into_inner();
    holder.message().await.unwrap().expect("the first request runs");
    let finished = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiting = Vec::new();
    let http = sched.addr("http");
    let queued = move || {
        let (_, body) = ferry_tests::http(http, "GET", "/metrics", b"").unwrap();
        ferry_tests::streams::sum_samples(&body, "vllm:num_requests_waiting").unwrap_or(0.0)
    };
    for (sent, priority) in [5, -5].into_iter().enumerate() {
        let mut req = prompt(&format!("Request of priority {priority}:"), 4);
        req.priority = priority;
        let (mut c, finished) = (client.clone(), finished.clone());
        waiting.push(tokio::spawn(async move {
            generate(&mut c, req).await.expect("served");
            finished.lock().unwrap().push(priority);
        }));
        // Each is queued (behind the holder) before the next is sent.
        let ahead = (sent + 1) as f64;
        let queued_in_time =
            ferry_tests::streams::wait_for(Duration::from_secs(30), || queued() >= ahead).await;
        assert!(queued_in_time.is_some(), "request of priority {priority} never queued");
    }
    while holder.message().await.unwrap().is_some() {}
    for w in waiting {
        w.await.unwrap();
    }
    assert_eq!(*finished.lock().unwrap(), [-5, 5], "the lower priority number ran first");
}

/// `logit_bias` and `allowed_token_ids` change a greedy answer as OpenAI and vLLM define them;
/// `echo` puts the prompt before it.
#[test]
fn vllm_request_fields_shape_the_answer() {
    use ferry_tests::http;
    let tok = ferry_model::ModelFile::open(None).unwrap().tokenizer;
    let id = |word: &str| {
        let ids = tok.encode(word).unwrap();
        assert_eq!(tok.decode(&ids[ids.len() - 1..]), word, "{word} is one token");
        ids[ids.len() - 1]
    };
    let (london, rome) = (id(" London"), id(" Rome"));
    let svc = start_serve("64");
    let ask = |extra: String| {
        let body = format!(
            r#"{{"prompt":"The capital of France is","max_tokens":1,"temperature":0{extra}}}"#
        );
        let (status, text) =
            http(svc.addr("http"), "POST", "/v1/completions", body.as_bytes()).unwrap();
        assert_eq!(status, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    assert_eq!(ask(String::new()), " Paris");
    assert_eq!(ask(format!(r#","logit_bias":{{"{london}":100}}"#)), " London");
    let paris = id(" Paris");
    assert_ne!(ask(format!(r#","logit_bias":{{"{paris}":-100}}"#)), " Paris");
    let only = ask(format!(r#","allowed_token_ids":[{london},{rome}]"#));
    assert!(only == " London" || only == " Rome", "{only:?}");
    assert_eq!(ask(r#","echo":true"#.into()), "The capital of France is Paris");
    let without_paris = ask(r#","bad_words":["Paris"]"#.into());
    assert!(!without_paris.contains("Paris"), "{without_paris:?}");

    // prompt_logprobs: the prompt's last token is scored as it would be sampled, every time
    // (the second time its prefix is cached, and still computed); with echo, logprobs start
    // with the prompt's.
    let completion = |body: &str| -> serde_json::Value {
        let (status, text) =
            http(svc.addr("http"), "POST", "/v1/completions", body.as_bytes()).unwrap();
        assert_eq!(status, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    };
    let sampled = completion(
        r#"{"prompt":"The capital of France is","max_tokens":1,"temperature":0,"logprobs":1}"#,
    );
    let sampled = sampled["choices"][0]["logprobs"]["token_logprobs"][0].as_f64().unwrap();
    let prompt_len = tok.encode("The capital of France is Paris").unwrap().len();
    for _ in 0..2 {
        let scored = completion(
            r#"{"prompt":"The capital of France is Paris","max_tokens":1,"temperature":0,"prompt_logprobs":2}"#,
        );
        let entries = scored["choices"][0]["prompt_logprobs"].as_array().unwrap().clone();
        assert_eq!(entries.len(), prompt_len, "{scored}");
        assert!(entries[0].is_null());
        let last = entries[prompt_len - 1].as_object().unwrap();
        let paris = last[&paris.to_string()]["logprob"].as_f64().unwrap();
        assert!((paris - sampled).abs() < 1e-4, "scored {paris}, sampled {sampled}");
        // Each entry: the prompt token's own and the two most likely.
        assert!(entries[1..].iter().all(|e| (2..=3).contains(&e.as_object().unwrap().len())));
    }
    let echoed = completion(
        r#"{"prompt":"The capital of France is","max_tokens":1,"temperature":0,"logprobs":1,"echo":true}"#,
    );
    let lp = &echoed["choices"][0]["logprobs"];
    assert_eq!(echoed["choices"][0]["text"], "The capital of France is Paris");
    assert_eq!(lp["tokens"].as_array().unwrap().len(), prompt_len, "{echoed}");
    assert!(lp["token_logprobs"][0].is_null() && lp["token_logprobs"][1].is_f64(), "{echoed}");
    let (status, text) = http(
        svc.addr("http"),
        "POST",
        "/v1/completions",
        br#"{"prompt":"x","prompt_logprobs":21}"#,
    )
    .unwrap();
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("`prompt_logprobs` is 21, expected at most 20"), "{text}");

    // skip_special_tokens false: control tokens in the text, the one that ends it only with
    // include_stop_str_in_output.
    let h = svc.addr("http");
    let chat = |extra: &str| {
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"What is the capital of France?"}}],"max_tokens":24,"temperature":0{extra}}}"#
        );
        let (status, text) = http(h, "POST", "/v1/chat/completions", body.as_bytes()).unwrap();
        assert_eq!(status, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
    };
    let plain = chat("");
    assert_eq!(plain, "The capital of France is Paris.");
    assert_eq!(chat(r#","skip_special_tokens":false"#), plain);
    let with_end = chat(r#","skip_special_tokens":false,"include_stop_str_in_output":true"#);
    assert_eq!(with_end, format!("{plain}<|im_end|>"));
    let past_end = chat(r#","skip_special_tokens":false,"ignore_eos":true"#);
    assert!(past_end.starts_with(&with_end) && past_end.contains("<|im_start|>"), "{past_end}");
    assert!(!chat(r#","ignore_eos":true"#).contains("<|im"));

    // Chat echo: a continued assistant message comes back whole (vLLM's echo).
    let body = br#"{"messages":[{"role":"user","content":"What is the capital of France?"},{"role":"assistant","content":"The capital of France is"}],"max_tokens":2,"temperature":0,"echo":true,"continue_final_message":true,"add_generation_prompt":false}"#;
    let (status, text) = http(h, "POST", "/v1/chat/completions", body).unwrap();
    assert_eq!(status, 200, "{text}");
    assert!(text.contains(r#""content":"The capital of France is Paris."#), "{text}");

    // guided_whitespace_pattern: JSON with the pattern's whitespace between its tokens.
    let body = br#"{"messages":[{"role":"user","content":"A person as JSON"}],"max_tokens":60,"temperature":0,"guided_json":{"type":"object","properties":{"name":{"type":"string","maxLength":8},"age":{"type":"integer","maximum":99}},"required":["name","age"],"additionalProperties":false},"guided_whitespace_pattern":"\n  "}"#;
    let (status, text) = http(h, "POST", "/v1/chat/completions", body).unwrap();
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let parsed: serde_json::Value = serde_json::from_str(content).expect(content);
    assert!(parsed["age"].is_u64() && content.contains("\n  \""), "{content:?}");

    // truncate_prompt_tokens keeps the prompt's last tokens.
    let usage = |body: &str| {
        let (status, text) = http(h, "POST", "/v1/completions", body.as_bytes()).unwrap();
        (status, text)
    };
    let prompt = r#""prompt":"one two three four five six seven","max_tokens":2,"temperature":0"#;
    let (_, text) = usage(&format!(r#"{{{prompt},"truncate_prompt_tokens":3}}"#));
    assert!(text.contains(r#""prompt_tokens":3,"#), "{text}");
    let (_, text) = usage(&format!(r#"{{{prompt},"truncate_prompt_tokens":-1}}"#));
    assert!(text.contains(r#""prompt_tokens":7,"#), "{text}");
    for (bad, needle) in [
        ("0", "truncate_prompt_tokens must be an integer >= 1 or -1, got 0"),
        ("-2", "got -2"),
        ("100000000", "is more than the longest prompt this server takes"),
    ] {
        let (status, text) = usage(&format!(r#"{{{prompt},"truncate_prompt_tokens":{bad}}}"#));
        assert_eq!(status, 400, "{text}");
        assert!(text.contains(needle), "{text}");
    }

    // continuous_usage_stats: every chunk counts the tokens so far.
    let (status, text) = usage(&format!(
        r#"{{{prompt},"stream":true,"stream_options":{{"include_usage":true,"continuous_usage_stats":true}}}}"#
    ));
    assert_eq!(status, 200, "{text}");
    let counts: Vec<u64> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| {
            let v: serde_json::Value = serde_json::from_str(d).unwrap();
            assert_eq!(v["usage"]["prompt_tokens"], 7, "{d}");
            v["usage"]["completion_tokens"].as_u64().unwrap()
        })
        .collect();
    assert_eq!(counts, [1, 2, 2, 2], "token, token, finish, usage chunk: {text}");
}
