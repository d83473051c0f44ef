//! A cluster of simulated GPUs as real processes (issue 15): `ferry-executor --backend sim
//! --model-profile llama-3-8b` reads no model file, takes its step times and KV capacity from
//! the profiles, serves the model its scheduler tokenizes for, and is discovered through a real
//! etcd by a real scheduler whose front serves requests through it.

use std::time::Duration;

use ferry_proto::v1::{self, admin_client::AdminClient, executor_client::ExecutorClient};
use ferry_tests::streams::{assert_complete, metric, run_streams, wait_for};
use ferry_tests::{start_scheduler, Etcd, Service, TempDir};

/// A simulated H100 running Llama-3-8B, ten times faster than real time, with id `id` and
/// `extra` flags; its model folder is `models` (which it must leave empty).
fn start_sim(id: &str, extra: &[&str], models: &TempDir) -> Service {
    let mut args = vec!["--listen", "127.0.0.1:0", "--backend", "sim", "--executor-id", id];
    args.extend(["--model-profile", "llama-3-8b", "--hardware", "h100", "--time-scale", "0.1"]);
    args.extend(extra);
    let env = [("FERRY_MODEL_DIR", models.0.as_os_str())];
    Service::start_with_env("ferry-executor", &args, &env, 1).unwrap()
}

/// [`start_sim`], registered in `etcd`.
fn start_sim_executor(etcd: &Etcd, id: &str, models: &TempDir) -> Service {
    start_sim(id, &["--etcd-endpoints", &etcd.endpoints()], models)
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

/// A simulated node: a KV agent and a simulated executor with `role` using it.
fn start_sim_node(role: &str, models: &TempDir) -> (Service, Service) {
    let agent_args = ["--listen", "127.0.0.1:0", "--node-id", role, "--store-mib", "512"];
    let agent = Service::start("ferry-kv", &agent_args, 1).unwrap();
    let kv = agent.addr("grpc").to_string();
    let executor = start_sim(role, &["--role", role, "--kv-agent", &kv], models);
    (agent, executor)
}

/// A seeded request with a prompt of about 150 tokens of its own.
fn long_request(i: usize) -> v1::GenerateRequest {
    let prompt = format!(
        "Chronicle {i}. {}What happened next?",
        format!("In year {i} the town built a bridge, a mill and a school. ").repeat(8)
    );
    ferry_tests::streams::request(prompt, 16, Some(500 + i as u64))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_prefill_and_decode_executors_move_kv_of_the_profiles_size_through_agents() {
    let models = TempDir::new("sim-models").unwrap();
    let (p_agent, prefill) = start_sim_node("prefill", &models);
    let (d_agent, decode) = start_sim_node("decode", &models);
    let sched = start_scheduler(&[&prefill, &decode], &["--disaggregation-min-tokens", "64"]);
    let http = sched.addr("http");
    let up = wait_for(Duration::from_secs(30), || metric(http, "ferry_executors_connected") == 2.0);
    assert!(up.await.is_some(), "the scheduler drives both simulated executors");
    let n = 8;
    let outcomes =
        run_streams(sched.addr("grpc"), (0..n).map(long_request).collect(), 0, || {}).await;
    assert_complete(&outcomes, 16);
    assert_eq!(metric(http, "ferry_requests_disaggregated{"), n as f64);
    // Each moved its prompt's whole blocks: 2 MiB each for Llama-3-8B in bf16 (32 layers,
    // K and V, 16 tokens, 8 heads of 128).
    let mut admin = AdminClient::connect(format!("http://{}", sched.addr("grpc"))).await.unwrap();
    let transfers =
        admin.list_transfers(v1::ListTransfersRequest {}).await.unwrap().into_inner().transfers;
    assert!(transfers.iter().any(|t| t.bytes > 0), "{transfers:?}");
    assert!(transfers.iter().all(|t| t.bytes % (2 << 20) == 0), "{transfers:?}");
    // A seeded stream's tokens are a function of (seed, position): the same as on one
    // simulated executor, though its first token came from another.
    let (_, alone) = start_sim_node("both", &models);
    let single = start_scheduler(&[&alone], &[]);
    let up = wait_for(Duration::from_secs(30), || {
        metric(single.addr("http"), "ferry_executors_connected") == 1.0
    });
    assert!(up.await.is_some());
    let whole =
        run_streams(single.addr("grpc"), (0..n).map(long_request).collect(), 0, || {}).await;
    let tokens = |o: &[ferry_tests::streams::Outcome]| {
        o.iter().map(|x| x.tokens.clone()).collect::<Vec<_>>()
    };
    assert_eq!(tokens(&outcomes), tokens(&whole));
    for agent in [&p_agent, &d_agent] {
        let addr = agent.addr("grpc");
        let idle = wait_for(Duration::from_secs(15), || {
            metric(addr, "ferry_kv_transfers_in_progress{") == 0.0
                && metric(addr, "ferry_kv_store_pinned_bytes{") == 0.0
        });
        assert!(idle.await.is_some(), "agent {addr} still holds a transfer or pinned blocks");
    }
    assert!(std::fs::read_dir(&models.0).unwrap().next().is_none(), "no model fetched");
}
