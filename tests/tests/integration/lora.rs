//! LoRA adapters in real processes. `ferry serve --enable-lora --lora-modules x=x y=y` over the
//! F32 model `lora_adapters.py` writes answers each adapter as a `ferry serve` of the model with
//! that adapter merged into its weights does (log-probabilities within the rounding a merge does
//! differently), with the base model and both adapters in flight together; its prefix cache never
//! serves one adapter's (or the base model's) blocks to another, which would change the answer;
//! `/v1/models` lists the adapters with their parent; adapters are loaded and unloaded at run
//! time, and one that does not fit is refused naming why. Streams through adapters whose
//! executor is killed with `kill -9` continue exactly on another. An adapter's requests answer
//! the same disaggregated and speculating; with `--max-loras 1`, two adapters' requests at once
//! all answer (the scheduler holds one adapter's back) instead of failing.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use ferry_proto::v1;
use ferry_tests::generated::generated;
use ferry_tests::streams::{assert_complete, assert_streams_survive_a_kill_9, metric, run_streams};
use ferry_tests::{greedy_completion, http, start_scheduler, Service};
use serde_json::{json, Value};

use crate::cluster::wait_ready;

/// Largest difference between two servers' log-probabilities of the same token (the executor's
/// `lora` tests measure the logits' within 6e-5).
const TOLERANCE: f64 = 1e-3;

fn serve(model: &Path, extra: &[&str]) -> Service {
    let model = model.to_str().expect("a UTF-8 path");
    let listen = ["serve", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"];
    // An f32 cache: f16's rounding of the keys and values would amplify the merge's rounding.
    let model = ["--model", model, "--kv-cache-dtype", "f32"];
    // grpc, http, the executor and its agent; with --disaggregate, the prefill pair too.
    let parts = if extra.contains(&"--disaggregate") { 6 } else { 4 };
    Service::start("ferry", &[&listen[..], &model, extra].concat(), parts).expect("ferry serve")
}

fn post(svc: &Service, path: &str, body: &Value) -> (u16, String) {
    http(svc.addr("http"), "POST", path, body.to_string().as_bytes()).expect("an answer")
}

fn complete(svc: &Service, model: &str, prompt: &str) -> (String, Vec<f64>) {
    complete_at(svc.addr("http"), model, prompt)
}

/// A greedy completion of `prompt` by `model` (16 tokens, with each token's log-probability).
fn complete_at(addr: SocketAddr, model: &str, prompt: &str) -> (String, Vec<f64>) {
    let (text, logprobs, _) = greedy_completion(addr, model, prompt, 16);
    (text, logprobs)
}

/// [`complete_at`] of `PROMPT` by each of `models` at once, each with its model.
fn concurrently<'m>(addr: SocketAddr, models: &[&'m str]) -> Vec<(&'m str, (String, Vec<f64>))> {
    std::thread::scope(|s| {
        let handles: Vec<_> =
            models.iter().map(|&m| s.spawn(move || (m, complete_at(addr, m, PROMPT)))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn assert_close(got: &(String, Vec<f64>), want: &(String, Vec<f64>), what: &str) {
    assert_eq!(got.0, want.0, "{what}: text");
    let diff = got.1.iter().zip(&want.1).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(diff < TOLERANCE, "{what}: log-probabilities differ by {diff}");
}

/// A prompt of several full KV blocks, so a second request with it finds them cached.
const PROMPT: &str = "The history of the city begins with a small fishing village on the river, \
    where traders from the north and the south met every spring to exchange salt, furs and \
    amber. Over the centuries the village grew into a town, and the town into a city whose";

#[test]
fn ferry_serve_answers_each_adapter_as_its_merged_model_does() {
    let dir = generated("lora", "lora_adapters.py", &[]);
    let lora_flags = ["--enable-lora", "--lora-modules", "x=x", "y=y"];
    let mut lora = serve(&dir.join("base.gguf"), &lora_flags);
    let mut merged_x = serve(&dir.join("merged-x.gguf"), &[]);
    let mut merged_y = serve(&dir.join("merged-y.gguf"), &[]);
    let http_addr = lora.addr("http");
    let hits = || metric(http_addr, "vllm:prefix_cache_hits_total");

    // The base model fills the prefix cache with the prompt's blocks, and hits them again.
    let base = complete(&lora, "base", PROMPT);
    let before = hits();
    assert_eq!(complete(&lora, "base", PROMPT), base);
    assert!(hits() > before, "the base model's second request hits its cached prompt");
    // Each adapter answers as its merged model, never reading the base model's blocks.
    let before = hits();
    let x = complete(&lora, "x", PROMPT);
    assert_close(&x, &complete(&merged_x, "merged-x", PROMPT), "x");
    let y = complete(&lora, "y", PROMPT);
    assert_close(&y, &complete(&merged_y, "merged-y", PROMPT), "y");
    assert_eq!(hits(), before, "no adapter request hit another's (or the base's) blocks");
    assert_ne!(x.0, base.0, "adapter x changes the answer");
    // x and y once each so far, counted by name.
    let count = |a: &str| metric(http_addr, &format!("ferry_lora_requests{{adapter=\"{a}\"}}"));
    assert_eq!((count("x"), count("y")), (1.0, 1.0));
    // All three at once: one batch, each row its own.
    for (m, got) in concurrently(http_addr, &["base", "x", "y", "x", "base", "y"]) {
        let want = match m {
            "x" => &x,
            "y" => &y,
            _ => &base,
        };
        assert_close(&got, want, m);
    }
    check_models_and_runtime_loading(&lora, &x);
    for svc in [&mut lora, &mut merged_x, &mut merged_y] {
        svc.terminate(Duration::from_secs(10)).unwrap();
    }
}

/// With `--max-loras 1`, requests of two adapters at once all answer, each as it does alone:
/// the scheduler holds one adapter's requests back while the executor holds the other (vLLM's
/// rule) instead of sending them to be refused. `/metrics` shows vLLM's
/// `vllm:lora_requests_info` with the executor's limit.
#[test]
fn max_loras_pressure_holds_requests_back_instead_of_failing_them() {
    let dir = generated("lora", "lora_adapters.py", &[]);
    let flags = ["--enable-lora", "--max-loras", "1", "--lora-modules", "x=x", "y=y"];
    let mut svc = serve(&dir.join("base.gguf"), &flags);
    let addr = svc.addr("http");
    let (x, y) = (complete_at(addr, "x", PROMPT), complete_at(addr, "y", PROMPT));
    for (m, got) in concurrently(addr, &["x", "y", "x", "y", "y", "x"]) {
        assert_close(&got, if m == "x" { &x } else { &y }, m);
    }
    let (_, text) = http(addr, "GET", "/metrics", b"").unwrap();
    let info = text.lines().find(|l| l.starts_with("vllm:lora_requests_info{"));
    assert!(info.is_some_and(|l| l.contains(r#"max_lora="1""#)), "{text}");
    svc.terminate(Duration::from_secs(10)).unwrap();
}

/// An adapter's requests through prefill/decode disaggregation (the prompt computed on the
/// prefill executor, which reads the adapter, and its KV moved under the adapter's salt) and
/// through n-gram speculative decoding (drafts verified by the adapter's forward) answer as on
/// one executor decoding a token a step.
#[test]
fn adapter_requests_disaggregate_and_speculate_exactly() {
    let dir = generated("lora", "lora_adapters.py", &[]);
    let base = dir.join("base.gguf");
    let lora = ["--enable-lora", "--lora-modules", "x=x"];
    let mut plain = serve(&base, &lora);
    let want = complete(&plain, "x", PROMPT);
    plain.terminate(Duration::from_secs(10)).unwrap();

    let split = ["--disaggregate", "--disaggregation-min-tokens", "16"];
    let mut disagg = serve(&base, &[&lora[..], &split].concat());
    assert_close(&complete(&disagg, "x", PROMPT), &want, "x, disaggregated");
    let moved = metric(disagg.addr("http"), "ferry_requests_disaggregated");
    assert!(moved >= 1.0, "the request was not disaggregated");
    disagg.terminate(Duration::from_secs(10)).unwrap();

    let config = r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}"#;
    let mut spec = serve(&base, &[&lora[..], &["--speculative-config", config]].concat());
    assert_close(&complete(&spec, "x", PROMPT), &want, "x, speculating");
    let drafts = metric(spec.addr("http"), "vllm:spec_decode_num_drafts_total");
    assert!(drafts >= 1.0, "no draft was verified");
    spec.terminate(Duration::from_secs(10)).unwrap();
}

/// `/v1/models` lists the adapters with their parent; an adapter loaded at run time answers
/// (the GGUF form of x answers as x); one that does not fit is refused naming why; an unloaded
/// one is a 404.
fn check_models_and_runtime_loading(lora: &Service, x: &(String, Vec<f64>)) {
    let (status, text) = http(lora.addr("http"), "GET", "/v1/models", b"").unwrap();
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&text).unwrap();
    let data = models["data"].as_array().unwrap();
    let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["base", "x", "y"]);
    assert!(data[1..].iter().all(|m| m["parent"] == "base"), "{models}");
    let load = |name: &str, path: &str| {
        post(lora, "/v1/load_lora_adapter", &json!({"lora_name": name, "lora_path": path}))
    };
    let (status, text) = load("xg", "x.gguf");
    assert_eq!(status, 200, "{text}");
    assert_close(&complete(lora, "xg", PROMPT), x, "x loaded from its LoRA GGUF");
    let (status, text) = load("xg", "x.gguf");
    assert_eq!((status, text.contains("already been loaded")), (400, true), "{text}");
    let (status, text) = load("model", "base.gguf");
    assert_eq!((status, text.contains("not a LoRA GGUF")), (400, true), "{text}");
    let (status, text) = post(lora, "/v1/unload_lora_adapter", &json!({"lora_name": "xg"}));
    assert_eq!(status, 200, "{text}");
    let body = json!({"model": "xg", "prompt": "Hi", "max_tokens": 1});
    let (status, text) = post(lora, "/v1/completions", &body);
    assert_eq!(
        (status, text.contains("is not served here") && text.contains("base, x, y")),
        (404, true),
        "{text}"
    );
}

const STREAMS: usize = 6;
const TOKENS: u32 = 40;

/// Streams through adapters x and y and the base model (greedy and seeded) on two executors:
/// the busiest is killed with `kill -9` mid-way, and every stream it held moves to the other,
/// which reads the adapter it needs, and continues exactly as in an undisturbed run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_streams_moved_by_a_kill_9_of_their_executor_continue_exactly() {
    let dir = generated("lora", "lora_adapters.py", &[]);
    let modules = [dir.join("x"), dir.join("y")].map(|p| p.to_str().unwrap().to_string());
    let (x, y) = (format!("x={}", modules[0]), format!("y={}", modules[1]));
    let exec = |id: &str| {
        let args = ["--listen", "127.0.0.1:0", "--kv-cache-mib", "256", "--executor-id", id];
        Service::start("ferry-executor", &args, 1).unwrap()
    };
    let execs = [exec("exec-a"), exec("exec-b")];
    let lora = ["--enable-lora", "--lora-modules", x.as_str(), y.as_str()];
    let sched = start_scheduler(&[&execs[0], &execs[1]], &lora);
    wait_ready(&sched, &[&execs[0], &execs[1]]).await;
    let requests = || -> Vec<v1::GenerateRequest> {
        (0..STREAMS)
            .map(|i| {
                let prompt = format!("Story {i}: the ferry left the harbour at dawn, and");
                let seed = (i % 2 == 1).then_some(i as u64);
                let mut r = ferry_tests::streams::request(prompt, TOKENS, seed);
                r.model = ["x", "y", ""][i % 3].to_string();
                r
            })
            .collect()
    };
    let undisturbed = run_streams(sched.addr("grpc"), requests(), 0, || {}).await;
    assert_complete(&undisturbed, TOKENS as usize);
    let tokens = TOKENS as usize;
    assert_streams_survive_a_kill_9(&sched, &execs, (requests(), 6), &undisturbed, tokens).await;
}
