//! Several base models behind one front. SmolLM2 (a vocabulary of 49152) and a tiny Llama whose
//! byte-level vocabulary has 262 tokens (`other_vocab.py`): the same text is other token ids in
//! each, so a request tokenized, sampled or detokenized with the other model's vocabulary would
//! answer differently (or be refused: SmolLM2's ids are past the tiny model's vocabulary).
//!
//! `ferry serve --extra-model tiny.gguf` answers each model, requests interleaved, exactly as a
//! `ferry serve` of that model alone does: text, log-probabilities and prompt token counts. A
//! scheduler of both models driving one executor per model (each matched to its model by the
//! fingerprint its executor states) answers 503 naming the model whose executor was killed with
//! `kill -9`, and goes on serving the other. In a cluster (etcd, a front in its own process),
//! the front serves both models and a LoRA adapter as the leader scheduler does.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use ferry_tests::generated::generated;
use ferry_tests::{greedy_completion, http, start_scheduler, Service};
use serde_json::{json, Value};

use crate::cluster::wait_ready;

/// The tiny model's file (served as `tiny`).
fn tiny() -> PathBuf {
    generated("other-vocab", "other_vocab.py", &[]).join("tiny.gguf")
}

fn serve(extra: &[&str]) -> Service {
    let listen = ["serve", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"];
    let args = [&listen[..], &["--kv-cache-mib", "64"], extra].concat();
    // grpc, http, and an executor and a KV agent per model.
    let parts = 4 + 2 * extra.iter().filter(|a| **a == "--extra-model").count();
    Service::start("ferry", &args, parts).expect("ferry serve")
}

/// What a greedy completion answers: its text, each token's log-probability, the prompt's
/// token count.
#[derive(Debug, Clone, PartialEq)]
struct Answer {
    text: String,
    logprobs: Vec<f64>,
    prompt_tokens: u64,
}

const PROMPT: &str = "hello hello world, the ferry sails at noon";

fn complete(addr: SocketAddr, model: &str) -> Answer {
    let (text, logprobs, v) = greedy_completion(addr, model, PROMPT, 12);
    Answer { text, logprobs, prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap() }
}

fn assert_same(got: &Answer, want: &Answer, what: &str) {
    assert_eq!((&got.text, got.prompt_tokens), (&want.text, want.prompt_tokens), "{what}");
    let diff =
        got.logprobs.iter().zip(&want.logprobs).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(diff < 1e-4, "{what}: log-probabilities differ by {diff}");
}

#[test]
fn one_front_answers_each_model_with_its_own_vocabulary() {
    let tiny = tiny();
    let tiny = tiny.to_str().unwrap();
    let mut alone_smol = serve(&[]);
    let mut alone_tiny = serve(&["--model", tiny]);
    let mut both = serve(&["--extra-model", tiny]);
    let smol_name = "SmolLM2-135M-Instruct";
    let want_smol = complete(alone_smol.addr("http"), smol_name);
    let want_tiny = complete(alone_tiny.addr("http"), "tiny");
    // The same text is other tokens in each vocabulary: 262 byte-level tokens need more.
    assert!(
        want_tiny.prompt_tokens > want_smol.prompt_tokens,
        "the vocabularies split the prompt alike: {want_tiny:?} {want_smol:?}"
    );
    assert_ne!(want_tiny.text, want_smol.text);

    let addr = both.addr("http");
    let (status, text) = http(addr, "GET", "/v1/models", b"").unwrap();
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&text).unwrap();
    let ids: Vec<&str> =
        models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, [smol_name, "tiny"]);
    // Interleaved, concurrent: each answered by its own model, as it answers alone.
    let answers: Vec<(&str, Answer)> = std::thread::scope(|s| {
        let handles: Vec<_> = [smol_name, "tiny", "tiny", smol_name, "tiny", smol_name]
            .map(|m| s.spawn(move || (m, complete(addr, m))))
            .into_iter()
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (model, got) in &answers {
        let want = if *model == "tiny" { &want_tiny } else { &want_smol };
        assert_same(got, want, model);
    }
    // A request naming no model gets the first (`--model`'s); an unknown one is a 404 that
    // lists both.
    let body = json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let (status, text) =
        http(addr, "POST", "/v1/completions", body.to_string().as_bytes()).unwrap();
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (v["model"].as_str(), v["choices"][0]["text"].as_str()),
        (Some(smol_name), Some(want_smol.text.as_str()))
    );
    let body = json!({"model": "zz", "prompt": PROMPT});
    let (status, text) =
        http(addr, "POST", "/v1/completions", body.to_string().as_bytes()).unwrap();
    assert_eq!(status, 404, "{text}");
    assert!(text.contains(smol_name) && text.contains("tiny"), "{text}");
    for svc in [&mut alone_smol, &mut alone_tiny, &mut both] {
        svc.terminate(Duration::from_secs(10)).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_whose_executors_are_gone_answers_503_naming_it() {
    let tiny = tiny();
    let tiny = tiny.to_str().unwrap();
    let exec = |model: Option<&str>, id: &str| {
        let mut args = vec!["--listen", "127.0.0.1:0", "--kv-cache-mib", "64", "--executor-id", id];
        args.extend(model.map(|m| ["--model", m]).into_iter().flatten());
        Service::start("ferry-executor", &args, 1).unwrap()
    };
    let smol_exec = exec(None, "exec-smol");
    let mut tiny_exec = exec(Some(tiny), "exec-tiny");
    let smol = ferry_model::fetch::default_model_path().unwrap();
    let smol_name = "SmolLM2-135M-Instruct";
    let models = ["--model", smol.to_str().unwrap(), "--model", tiny];
    let names = ["--served-model-name", smol_name, "--served-model-name", "tiny"];
    let models = [&models[..], &names].concat();
    let sched = start_scheduler(&[&tiny_exec, &smol_exec], &models);
    wait_ready(&sched, &[&smol_exec, &tiny_exec]).await;
    let addr = sched.addr("http");
    let (smol_before, tiny_before) =
        tokio::task::spawn_blocking(move || (complete(addr, smol_name), complete(addr, "tiny")))
            .await
            .unwrap();
    assert!(tiny_before.prompt_tokens > smol_before.prompt_tokens, "each its own tokenizer");

    ferry_tests::signal(tiny_exec.pid(), "KILL").unwrap();
    assert!(tiny_exec.wait_exit().is_some_and(|s| !s.success()), "the tiny model's executor died");
    let (status, text, smol_after) = tokio::task::spawn_blocking(move || {
        // The scheduler notices the lost session when its stream ends: wait for the refusal.
        let body = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 4});
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let (status, text) = loop {
            let answer =
                http(addr, "POST", "/v1/completions", body.to_string().as_bytes()).unwrap();
            if answer.0 != 200 || std::time::Instant::now() > deadline {
                break answer;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        (status, text, complete(addr, smol_name))
    })
    .await
    .unwrap();
    assert_eq!(status, 503, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains(r#"model "tiny""#), "the refusal names the model: {message}");
    assert_eq!(smol_after, smol_before, "the other model is served as before");
}

/// The cluster's shape (as the Helm chart deploys it): executors of two models registered in
/// etcd, a scheduler of both, and a front in its own process of both with a LoRA adapter on
/// the first. Through the front, each model and the adapter answer as the scheduler answers
/// them itself: the front sends the leader the adapter's name with the prompt's tokens
/// (without it the leader would run the base model), and each model's tokens go to that
/// model's executor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_front_in_its_own_process_serves_both_models_and_an_adapter_through_the_leader() {
    let etcd = ferry_tests::Etcd::start().unwrap();
    let endpoints = etcd.endpoints();
    let lora = generated("lora", "lora_adapters.py", &[]);
    let (base, x) = (lora.join("base.gguf"), lora.join("x"));
    let (base, x, tiny) = (base.to_str().unwrap(), x.to_str().unwrap(), tiny());
    let tiny = tiny.to_str().unwrap();
    let exec = |model: &str, id: &str| {
        let args = ["--listen", "127.0.0.1:0", "--kv-cache-mib", "64", "--executor-id", id];
        let cluster = ["--model", model, "--etcd-endpoints", &endpoints, "--kv-cache-dtype", "f32"];
        Service::start("ferry-executor", &[&args[..], &cluster].concat(), 1).unwrap()
    };
    let execs = [exec(base, "exec-base"), exec(tiny, "exec-tiny")];
    let x_module = format!("x={x}");
    let models = ["--model", base, "--model", tiny, "--enable-lora", "--lora-modules", &x_module];
    let sched = crate::cluster::start_scheduler_with(&etcd, "s0", "2", &models);
    wait_ready(&sched, &[&execs[0], &execs[1]]).await;
    let front = crate::cluster::start_front_with(&etcd, &models);
    let up = || crate::cluster::health(&front) == 200;
    let up = ferry_tests::streams::wait_for(Duration::from_secs(10), up).await;
    assert!(up.is_some(), "the front finds the leader");
    let (via_sched, via_front) = (sched.addr("http"), front.addr("http"));
    tokio::task::spawn_blocking(move || {
        let mut answers = Vec::new();
        for model in ["base", "x", "tiny"] {
            let want = complete(via_sched, model);
            assert_same(&complete(via_front, model), &want, model);
            answers.push(want);
        }
        assert_ne!(answers[0].text, answers[1].text, "the adapter changes the answer");
        assert!(answers[2].prompt_tokens > answers[0].prompt_tokens, "each its own tokenizer");
        // Its leaders would not learn of an adapter loaded on the front: refused, saying so.
        let body = json!({"lora_name": "x2", "lora_path": "x"}).to_string();
        let (status, text) =
            http(via_front, "POST", "/v1/load_lora_adapter", body.as_bytes()).unwrap();
        assert_eq!(status, 400, "{text}");
        assert!(text.contains("--lora-modules"), "{text}");
    })
    .await
    .unwrap();
}
