//! A looped model in real processes: `ferry serve --looped-layers 10:20` answers a request at
//! `max_loops = 1` exactly as the plain model does, reports each token's loops, lets tokens
//! leave the loop at an exit threshold and refuses loops it does not run; and streams with
//! several loops (and exits) continue exactly when the executor running them is killed with
//! `kill -9` mid-way and they move to another.

use std::time::Duration;

use ferry_proto::v1;
use ferry_tests::streams::{assert_complete, assert_streams_survive_a_kill_9, run_streams};
use ferry_tests::{http, start_scheduler, Service};
use serde_json::{json, Value};

use crate::cluster::wait_ready;

const LOOPED: [&str; 4] = ["--looped-layers", "10:20", "--max-loops", "3"];

fn serve(extra: &[&str]) -> Service {
    let listen = ["serve", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"];
    Service::start("ferry", &[&listen[..], extra].concat(), 4).expect("ferry serve")
}

/// The completion of `prompt` (greedy, 12 tokens) with `extra` fields: its status and JSON.
fn complete(svc: &Service, prompt: &str, extra: &Value) -> (u16, Value) {
    let mut body =
        json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let (status, text) =
        http(svc.addr("http"), "POST", "/v1/completions", body.to_string().as_bytes()).unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}")))
}

fn loops_of(answer: &Value) -> Vec<u64> {
    let loops = answer["choices"][0]["recurrent_loops"].as_array();
    loops
        .unwrap_or_else(|| panic!("no recurrent_loops in {answer}"))
        .iter()
        .map(|l| l.as_u64().unwrap())
        .collect()
}

#[test]
fn ferry_serve_runs_a_looped_model_equal_to_the_plain_one_at_one_loop() {
    let mut looped = serve(&LOOPED);
    let mut plain = serve(&[]);
    let prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"];
    for prompt in prompts {
        let (status, want) = complete(&plain, prompt, &json!({}));
        assert_eq!(status, 200, "{want}");
        assert!(want["choices"][0].get("recurrent_loops").is_none(), "a plain model loops not");
        let (status, got) = complete(&looped, prompt, &json!({"max_loops": 1}));
        assert_eq!(status, 200, "{got}");
        assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"], "{prompt:?}");
        assert_eq!(loops_of(&got), vec![1; 12]);
        // The model's loops by default; tokens leave early at a threshold.
        let (_, three) = complete(&looped, prompt, &json!({}));
        assert_eq!(loops_of(&three), vec![3; 12]);
        assert_ne!(three["choices"][0]["text"], want["choices"][0]["text"], "3 loops differ");
        let (_, early) = complete(&looped, prompt, &json!({"exit_threshold": 0.9}));
        let loops = loops_of(&early);
        assert!(loops.iter().all(|l| (1..=3).contains(l)), "{loops:?}");
        assert!(loops.iter().any(|&l| l < 3), "no token left early at 0.9: {loops:?}");
    }
    // Loops the model does not run, and loops asked of a plain model: 400s naming the limit.
    let (status, err) = complete(&looped, "Hi", &json!({"max_loops": 4}));
    assert_eq!(status, 400, "{err}");
    assert!(err.to_string().contains("max_loops must be 1..=3, got 4"), "{err}");
    for field in [json!({"max_loops": 2}), json!({"exit_threshold": 0.5})] {
        let (status, err) = complete(&plain, "Hi", &field);
        assert_eq!(status, 400, "{err}");
        assert!(err.to_string().contains("does not loop"), "{err}");
    }
    let (status, err) = complete(&looped, "Hi", &json!({"exit_threshold": 1.5}));
    assert_eq!(status, 400, "{err}");
    looped.terminate(Duration::from_secs(10)).unwrap();
    plain.terminate(Duration::from_secs(10)).unwrap();
}

const STREAMS: usize = 6;
const TOKENS: u32 = 40;

fn requests() -> Vec<v1::GenerateRequest> {
    (0..STREAMS)
        .map(|i| {
            let prompt = format!("Story {i}: the ferry left the harbour at dawn, and");
            let seed = (i % 2 == 1).then_some(i as u64);
            let mut r = ferry_tests::streams::request(prompt, TOKENS, seed);
            let sampling = r.sampling.as_mut().unwrap();
            sampling.max_loops = Some(3);
            sampling.exit_threshold = (i % 3 != 0).then_some(0.93);
            r
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn looped_streams_moved_by_a_kill_9_of_their_executor_continue_exactly() {
    let exec = |id: &str| {
        let args = ["--listen", "127.0.0.1:0", "--kv-cache-mib", "256", "--executor-id", id];
        Service::start("ferry-executor", &[&args[..], &LOOPED].concat(), 1).unwrap()
    };
    let execs = [exec("exec-a"), exec("exec-b")];
    let sched = start_scheduler(&[&execs[0], &execs[1]], &[]);
    wait_ready(&sched, &[&execs[0], &execs[1]]).await;
    let undisturbed = run_streams(sched.addr("grpc"), requests(), 0, || {}).await;
    assert_complete(&undisturbed, TOKENS as usize);

    let tokens = TOKENS as usize;
    assert_streams_survive_a_kill_9(&sched, &execs, (requests(), 6), &undisturbed, tokens).await;
}

/// A simulated executor serves a looped model too: stage steps timed by the roofline's stage
/// costs, and the simulator's exit score after loop `l`, `l / (l + 1)`, so a threshold of 0.7
/// lets every token leave at loop 3 (0.75) and none at 2 (0.67).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulated_executor_runs_a_looped_models_stages_and_exits() {
    let models = ferry_tests::TempDir::new("looped-sim").unwrap();
    let mut args = vec!["--listen", "127.0.0.1:0", "--backend", "sim", "--executor-id", "sim"];
    args.extend(["--model-profile", "llama-3-8b", "--hardware", "h100", "--time-scale", "0.1"]);
    args.extend(["--looped-layers", "8:24", "--max-loops", "4"]);
    let env = [("FERRY_MODEL_DIR", models.0.as_os_str())];
    let exec = Service::start_with_env("ferry-executor", &args, &env, 1).unwrap();
    let sched = start_scheduler(&[&exec], &[]);
    wait_ready(&sched, &[&exec]).await;
    for (extra, want) in
        [(json!({}), 4), (json!({"max_loops": 2}), 2), (json!({"exit_threshold": 0.7}), 3)]
    {
        let (status, answer) = complete(&sched, "Simulated stages", &extra);
        assert_eq!(status, 200, "{answer}");
        assert_eq!(loops_of(&answer), vec![want; 12], "{extra}");
    }
    let url = format!("http://{}", exec.addr("grpc"));
    let mut client = v1::executor_client::ExecutorClient::connect(url).await.unwrap();
    let d = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
    // Prompt chains and 12 decode chains per request, each a prelude, its loops and a coda.
    assert!(d.steps_executed >= 3 * 12 * 4, "{} steps", d.steps_executed);
    assert!(d.simulated_us > 0, "the stages took simulated time");
}
