//! Scheduler shards (issue 44): two scheduler pools in one cluster, each with its own leader
//! (and one a standby), share four simulated executors by the shards' assignment; a front in
//! its own process follows both and sends each request to the shard whose executors cache the
//! longest prefix of it, then the least loaded; a shard's leader killed moves only that
//! shard's streams; a shard that joins gets executors and work.

use std::time::Duration;

use ferry_proto::v1::{self, admin_client::AdminClient, generation_client::GenerationClient};
use ferry_tests::streams::{assert_complete, assert_same_streams, metric, run_streams, wait_for};
use ferry_tests::{signal, Etcd, Service, TempDir};

/// A simulated H100 running Llama-3-8B at half real time, registered in `etcd`.
fn start_sim(etcd: &Etcd, id: &str, models: &TempDir) -> Service {
    let endpoints = etcd.endpoints();
    let args = [
        "--listen",
        "127.0.0.1:0",
        "--backend",
        "sim",
        "--executor-id",
        id,
        "--model-profile",
        "llama-3-8b",
        "--time-scale",
        "0.5",
        "--etcd-endpoints",
        &endpoints,
    ];
    let env = [("FERRY_MODEL_DIR", models.0.as_os_str())];
    Service::start_with_env("ferry-executor", &args, &env, 1).unwrap()
}

/// A scheduler `id` campaigning for `pool` (leadership lease 2 s).
fn start_shard(etcd: &Etcd, pool: &str, id: &str) -> Service {
    crate::cluster::start_scheduler_with(etcd, id, "2", &["--pool", pool])
}

fn connected(s: &Service) -> f64 {
    metric(s.addr("http"), "ferry_executors_connected")
}

fn leads(s: &Service) -> bool {
    metric(s.addr("http"), "ferry_scheduler_leader{") == 1.0
}

/// A system prompt of about 400 tokens, its own for each `i`.
fn system_prompt(i: usize) -> String {
    let words: Vec<String> = (0..130).map(|j| format!("rule{i}x{j}")).collect();
    format!("System prompt {i}. Follow these rules: {}.", words.join(" "))
}

fn chat(i: usize, question: &str, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Prompt(format!(
            "{}\nUser: {question}\nAssistant:",
            system_prompt(i)
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

/// Runs `req` at `target`'s gRPC API to its end: the prompt tokens its server reports cached.
async fn cached_tokens(target: &Service, req: v1::GenerateRequest) -> u32 {
    let mut client =
        GenerationClient::connect(format!("http://{}", target.addr("grpc"))).await.unwrap();
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut cached = None;
    while let Some(ev) = stream.message().await.unwrap() {
        if let Some(u) = ev.usage {
            cached = Some(u.cached_prompt_tokens);
        }
    }
    cached.expect("the last event carries the usage")
}

/// Requests `sched` holds now (its admin API).
async fn held(sched: std::net::SocketAddr) -> usize {
    let mut admin = AdminClient::connect(format!("http://{sched}")).await.unwrap();
    admin
        .list_requests(v1::ListRequestsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .requests
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_shards_route_by_prefix_fail_alone_and_take_in_a_third() {
    let etcd = Etcd::start().unwrap();
    let models = TempDir::new("shard-models").unwrap();
    let execs: Vec<Service> =
        (0..4).map(|i| start_sim(&etcd, &format!("gpu-{i}"), &models)).collect();
    let a = start_shard(&etcd, "a", "a-0");
    assert!(wait_for(Duration::from_secs(30), || leads(&a)).await.is_some(), "a-0 leads pool a");
    let a_standby = start_shard(&etcd, "a", "a-1");
    let b = start_shard(&etcd, "b", "b-0");
    let front = crate::cluster::start_front(&etcd);

    // Two pools up (a with a standby): two executors each, none driven twice.
    let split = || connected(&a) == 2.0 && connected(&b) == 2.0;
    assert!(wait_for(Duration::from_secs(30), split).await.is_some(), "the executors split 2/2");
    assert_eq!(connected(&a_standby), 0.0, "a standby drives nothing");

    // Prefix routing: each system prompt is first asked of one shard directly (a for even,
    // b for odd); the same prompt through the front then finds its cached prefix, so it went
    // to that shard (the other caches nothing of it).
    for i in 0..6 {
        let home = if i % 2 == 0 { &a } else { &b };
        let first = cached_tokens(home, chat(i, "hello", 4)).await;
        assert_eq!(first, 0, "prompt {i} is new");
    }
    for i in 0..6 {
        let cached = cached_tokens(&front, chat(i, "and again?", 4)).await;
        assert!(cached >= 384, "prompt {i} through the front: {cached} cached");
    }

    // A shard's leader dies mid-load: only its streams move (to its standby or the other
    // shard), none lost or changed.
    let requests = |n| (0..n).map(|i| chat(100 + i, "tell me a story", 300)).collect::<Vec<_>>();
    let undisturbed = run_streams(front.addr("grpc"), requests(8), 0, || {}).await;
    assert_complete(&undisturbed, 300);
    let moved_before = metric(front.addr("http"), "ferry_requests_moved");
    let on_a = std::sync::Mutex::new(0);
    let pid = a.pid();
    let kill = || {
        let (held_a, held_b) = held_now(&a, &b);
        assert_eq!(held_a + held_b, 8, "every stream runs on a shard");
        assert!(held_a > 0 && held_b > 0, "both shards carry streams: {held_a} and {held_b}");
        *on_a.lock().unwrap() = held_a;
        signal(pid, "KILL").unwrap();
    };
    let outcomes = run_streams(front.addr("grpc"), requests(8), 4, kill).await;
    assert_complete(&outcomes, 300);
    assert_same_streams(&outcomes, &undisturbed);
    let moved = metric(front.addr("http"), "ferry_requests_moved") - moved_before;
    assert_eq!(moved as usize, *on_a.lock().unwrap(), "exactly the dead leader's streams moved");
    let taken = || leads(&a_standby) && connected(&a_standby) == 2.0;
    assert!(wait_for(Duration::from_secs(30), taken).await.is_some(), "a-1 leads pool a");
    drop(a);

    // A third shard joins: the four executors spread 2/1/1 and it serves requests.
    let c = start_shard(&etcd, "c", "c-0");
    let spread = || {
        let counts = [connected(&a_standby), connected(&b), connected(&c)];
        counts.iter().sum::<f64>() == 4.0 && counts.iter().all(|&n| n >= 1.0)
    };
    assert!(wait_for(Duration::from_secs(30), spread).await.is_some(), "c gets executors");
    let served_before = metric(c.addr("http"), "vllm:request_success_total");
    let outcomes = run_streams(front.addr("grpc"), requests(8), 0, || {}).await;
    assert_complete(&outcomes, 300);
    assert_same_streams(&outcomes, &undisturbed);
    let served = metric(c.addr("http"), "vllm:request_success_total") - served_before;
    assert!(served >= 1.0, "the new shard served none of 8 concurrent streams");
    drop(execs);
}

/// Requests each shard holds now (asked from a fault closure, which cannot await).
fn held_now(a: &Service, b: &Service) -> (usize, usize) {
    let (a, b) = (a.addr("grpc"), b.addr("grpc"));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    std::thread::spawn(move || rt.block_on(async { (held(a).await, held(b).await) }))
        .join()
        .unwrap()
}
