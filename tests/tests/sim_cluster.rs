//! A cluster of simulated GPUs as real processes (issue 15): `ferry-executor --backend sim
//! --model-profile llama-3-8b` reads no model file, takes its step times and KV capacity from
//! the profiles, serves the model its scheduler tokenizes for, and is discovered through a real
//! etcd by a real scheduler whose front serves requests through it.

use std::time::Duration;

use ferry_proto::v1::{self, executor_client::ExecutorClient};
use ferry_tests::streams::{assert_complete, metric, run_streams, wait_for};
use ferry_tests::{Etcd, Service, TempDir};

/// A simulated H100 running Llama-3-8B, ten times faster than real time, registered in `etcd`;
/// its model folder is `models` (which it must leave empty).
fn start_sim_executor(etcd: &Etcd, id: &str, models: &TempDir) -> Service {
    let endpoints = etcd.endpoints();
    let args = [
        "--listen",
        "127.0.0.1:0",
        "--backend",
        "sim",
        "--model-profile",
        "llama-3-8b",
        "--hardware",
        "h100",
        "--time-scale",
        "0.1",
        "--executor-id",
        id,
        "--etcd-endpoints",
        &endpoints,
    ];
    let env = [("FERRY_MODEL_DIR", models.0.as_os_str())];
    Service::start_with_env("ferry-executor", &args, &env, 1).unwrap()
}

async fn describe(exec: &Service) -> v1::ExecutorDescription {
    let mut client =
        ExecutorClient::connect(format!("http://{}", exec.addr("grpc"))).await.unwrap();
    client.describe(v1::DescribeRequest {}).await.unwrap().into_inner()
}

fn request(i: usize, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Prompt(format!(
            "Request {i} to a simulated cluster: tell me about the {}",
            ["sea", "hills", "city", "stars"][i % 4]
        ))),
        sampling: Some(v1::SamplingParams {
            temperature: 0.8,
            seed: Some(i as u64),
            ..Default::default()
        }),
        stopping: Some(v1::StoppingCriteria { max_tokens, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_executors_without_a_model_file_serve_through_the_real_front() {
    let etcd = Etcd::start().unwrap();
    let models = TempDir::new("sim-models").unwrap();
    let execs: Vec<Service> = ["sim-a", "sim-b", "sim-c"]
        .iter()
        .map(|id| start_sim_executor(&etcd, id, &models))
        .collect();
    let endpoints = etcd.endpoints();
    let sched_args =
        ["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--etcd-endpoints", &endpoints];
    let sched = Service::start("ferry-scheduler", &sched_args, 2).unwrap();
    let http = sched.addr("http");
    let connected =
        wait_for(Duration::from_secs(30), || metric(http, "ferry_executors_connected") == 3.0)
            .await;
    assert!(connected.is_some(), "the scheduler drives the three simulated executors");

    // Each serves the scheduler's model (its fingerprint and vocabulary) with the profile's
    // KV capacity: 80 GiB x 0.9 less 16 GB of weights and the activations, in blocks of 16
    // tokens of 128 KiB.
    for exec in &execs {
        let info = describe(exec).await.info.unwrap();
        assert_eq!(info.backend, v1::Backend::Sim as i32);
        assert_eq!(info.model, "llama-3-8b");
        assert_eq!(info.vocab_size, 49_152, "the scheduler's vocabulary (SmolLM2's)");
        assert!(!info.model_fingerprint.starts_with("sim:"), "{}", info.model_fingerprint);
        assert!((28_000..29_500).contains(&info.num_blocks), "{}", info.num_blocks);
        let layout = info.kv_layout.unwrap();
        assert_eq!((layout.num_layers, layout.num_kv_heads, layout.head_dim), (32, 8, 128));
        assert_eq!(layout.dtype, v1::KvDtype::Bf16 as i32);
    }

    let requests: Vec<v1::GenerateRequest> = (0..24).map(|i| request(i, 24)).collect();
    let outcomes = run_streams(sched.addr("grpc"), requests.clone(), 0, || {}).await;
    assert_complete(&outcomes, 24);
    assert!(outcomes.iter().all(|o| o.tokens.iter().all(|&t| t < 49_152)));
    // Deterministic: the same requests give the same tokens wherever they run.
    let again = run_streams(sched.addr("grpc"), requests, 0, || {}).await;
    let tokens = |o: &[ferry_tests::streams::Outcome]| {
        o.iter().map(|x| x.tokens.clone()).collect::<Vec<_>>()
    };
    assert_eq!(tokens(&outcomes), tokens(&again));

    // The work spread over the simulated GPUs, each taking the roofline's time: a decode step
    // of Llama-3-8B on an H100 is about 6 ms of simulated time, slept at a tenth of it.
    let mut busy = 0;
    for exec in &execs {
        let d = describe(exec).await;
        if let Some(per_step_us) = d.simulated_us.checked_div(d.steps_executed) {
            busy += 1;
            assert!((5_000..40_000).contains(&per_step_us), "{per_step_us} µs a simulated step");
            let slept = d.busy_us as f64 / d.simulated_us as f64;
            assert!((0.095..0.5).contains(&slept), "{slept} wall seconds per simulated second");
        }
    }
    assert!(busy >= 2, "requests went to {busy} of 3 executors");
    let fetched: Vec<_> = std::fs::read_dir(&models.0).unwrap().collect();
    assert!(fetched.is_empty(), "a simulated executor fetched a model: {fetched:?}");
}
