//! The KV tier across nodes, as real processes (issue 14): executors write the blocks their
//! finished requests computed to their node's KV agent; a later request placed on another node
//! reads a long shared prefix from that agent instead of computing it, and answers exactly as
//! without the read; a scheduler started over the same nodes learns the tier from the agents.

use std::time::Duration;

use ferry_proto::v1;
use ferry_tests::streams::{
    assert_complete, assert_executor_idle, assert_same_streams, metric, run_streams, wait_for,
};
use ferry_tests::{signal, start_scheduler, start_serve, Etcd, Service};

const MAX_TOKENS: u32 = 12;

/// A node: its KV agent and an executor (role `both`) writing to it.
struct Node {
    agent: Service,
    executor: Service,
}

impl Node {
    fn start(name: &str) -> Self {
        Self::start_with(name, &[])
    }

    /// A node whose agent and executor also take `extra` flags (etcd registration).
    fn start_with(name: &str, extra: &[&str]) -> Self {
        let agent_args =
            [&["--listen", "127.0.0.1:0", "--node-id", name, "--store-mib", "256"][..], extra]
                .concat();
        let agent = Service::start("ferry-kv", &agent_args, 1).unwrap();
        let kv = agent.addr("grpc").to_string();
        let exec_args = [
            &["--listen", "127.0.0.1:0", "--executor-id", name, "--kv-agent", &kv][..],
            &["--kv-cache-mib", "256"],
            extra,
        ]
        .concat();
        let executor = Service::start("ferry-executor", &exec_args, 1).unwrap();
        Self { agent, executor }
    }

    fn stored_bytes(&self) -> f64 {
        metric(self.agent.addr("grpc"), "ferry_kv_store_used_bytes{")
    }
}

/// A request sharing a long prefix (~400 tokens) with the others, then a question of its own.
fn request(question: &str, seed: Option<u64>) -> v1::GenerateRequest {
    let prefix = "You are the archivist of a harbour town. The town keeps records of every ship: \
                  its name, its captain, its cargo, the day it came and the day it left. "
        .repeat(10);
    ferry_tests::streams::request(format!("{prefix}Question: {question}"), MAX_TOKENS, seed)
}

fn first() -> v1::GenerateRequest {
    request("Which ship came first?", None)
}

fn second() -> Vec<v1::GenerateRequest> {
    vec![
        request("Which captain stayed longest?", None),
        request("What cargo was rarest?", Some(11)),
    ]
}

/// Runs the first request through `scheduler` and waits until its blocks reach its node's
/// agent; that node's index in `nodes`.
async fn first_stored(scheduler: &Service, nodes: &[Node; 2]) -> usize {
    let out = run_streams(scheduler.addr("grpc"), vec![first()], 0, || {}).await;
    assert_complete(&out, MAX_TOKENS as usize);
    let http = scheduler.addr("http");
    let stored =
        wait_for(Duration::from_secs(20), || metric(http, "ferry_kv_tier_stored_blocks{") >= 20.0);
    assert!(stored.await.is_some(), "the first request's blocks never reached its agent");
    usize::from(nodes[0].stored_bytes() == 0.0)
}

/// The second requests' streams on a `serve` of its own: what every tier read must give.
async fn undisturbed_second() -> Vec<ferry_tests::streams::Outcome> {
    let serve = start_serve("256");
    let out = run_streams(serve.addr("grpc"), second(), 0, || {}).await;
    assert_complete(&out, MAX_TOKENS as usize);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_computed_on_one_node_is_read_from_its_agent_by_another() {
    let expected = undisturbed_second().await;
    let nodes = [Node::start("node-a"), Node::start("node-b")];
    // Adapter x too: the base model's blocks in the tier hold KV no adapter computes.
    let x = ferry_tests::generated::generated("lora", "lora_adapters.py", &[]).join("x");
    let x = format!("x={}", x.to_str().expect("a UTF-8 path"));
    let tier = ["--kv-tier-min-tokens", "32", "--enable-lora", "--lora-modules", x.as_str()];
    let scheduler = start_scheduler(&[&nodes[0].executor, &nodes[1].executor], &tier);
    let http = scheduler.addr("http");
    let running_series = |n: usize| {
        move || {
            ferry_tests::http(http, "GET", "/metrics", b"").is_ok_and(|(_, body)| {
                body.lines().filter(|l| l.starts_with("vllm:num_requests_running{")).count() == n
            })
        }
    };
    assert!(wait_for(Duration::from_mins(1), running_series(2)).await.is_some());

    // The first request runs on one node; when it finishes, its executor writes the blocks
    // it computed to that node's agent.
    let out = run_streams(scheduler.addr("grpc"), vec![first()], 0, || {}).await;
    assert_complete(&out, MAX_TOKENS as usize);
    let stored = wait_for(Duration::from_secs(20), || {
        metric(http, "ferry_kv_tier_stored_blocks{") >= 20.0
            && nodes.iter().any(|n| n.stored_bytes() > 0.0)
    });
    if stored.await.is_none() {
        let kv_lines = |addr| {
            let (_, body) = ferry_tests::http(addr, "GET", "/metrics", b"").unwrap();
            body.lines()
                .filter(|l| l.contains("kv") && !l.starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n")
        };
        panic!(
            "the first request's blocks never reached its agent\nscheduler:\n{}\nagent a:\n{}\nagent b:\n{}",
            kv_lines(http),
            kv_lines(nodes[0].agent.addr("grpc")),
            kv_lines(nodes[1].agent.addr("grpc"))
        );
    }
    let (a, b) = if nodes[0].stored_bytes() > 0.0 { (0, 1) } else { (1, 0) };
    assert_eq!(nodes[b].stored_bytes(), 0.0, "only the node that computed it stored it");

    // That node's executor dies; its agent (host memory) lives on.
    let mut nodes = nodes;
    signal(nodes[a].executor.pid(), "KILL").unwrap();
    assert!(nodes[a].executor.wait_exit().is_some());
    assert!(wait_for(Duration::from_mins(1), running_series(1)).await.is_some());

    // The first prompt through adapter x, on the surviving executor (which has not computed
    // it): it reads nothing from the tier, whose blocks are the base model's KV (the tier is
    // keyed by block hashes, which carry the adapter's salt).
    let mut through_x = first();
    through_x.model = "x".into();
    let out = run_streams(scheduler.addr("grpc"), vec![through_x], 0, || {}).await;
    assert_complete(&out, MAX_TOKENS as usize);
    assert_eq!(metric(http, "ferry_kv_tier_hits{"), 0.0, "an adapter read the base's blocks");

    // The next requests share the prefix: the surviving executor reads it from the dead
    // executor's agent, computes only the rest, and answers as if it had computed it all.
    let prompt_before = metric(http, "vllm:prompt_tokens_total{");
    let got = run_streams(scheduler.addr("grpc"), second(), 0, || {}).await;
    assert_complete(&got, MAX_TOKENS as usize);
    assert_same_streams(&got, &expected);
    let computed = metric(http, "vllm:prompt_tokens_total{") - prompt_before;
    let imported = metric(http, "ferry_kv_tier_imported_blocks{");
    assert!(metric(http, "ferry_kv_tier_hits{") >= 1.0, "no request read the tier");
    assert!(imported >= 20.0, "{imported} blocks read from the tier");
    assert_eq!(metric(http, "ferry_kv_tier_import_failures{"), 0.0);
    // Two prompts of ~360 tokens sharing ~350: without the read, the first would compute all
    // of its prompt (and the second hit it in the cache); with it, each computes its question.
    assert!(computed < 150.0, "{computed} prompt tokens computed: the prefix was recomputed");
    let sent = metric(nodes[a].agent.addr("grpc"), "ferry_kv_sent_bytes{");
    assert!(sent > 0.0, "the first node's agent sent nothing");
    assert_executor_idle(&nodes[b].executor).await;
}

/// Waits until the scheduler's `/metrics` at `http` has `n` series of the running gauge (one
/// per executor it drives) and `metric` equals `want`.
async fn wait_until(http: std::net::SocketAddr, executors: usize, metric_name: &str, want: f64) {
    let ok = wait_for(Duration::from_mins(1), || {
        ferry_tests::http(http, "GET", "/metrics", b"").is_ok_and(|(_, body)| {
            body.lines().filter(|l| l.starts_with("vllm:num_requests_running{")).count()
                == executors
        }) && metric(http, metric_name) == want
    });
    assert!(ok.await.is_some(), "never {executors} executors and {metric_name} = {want}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_agent_is_not_read_from_and_its_blocks_are_forgotten() {
    let expected = undisturbed_second().await;
    // Two nodes and a scheduler, all registered in etcd (leases of 2 s).
    let etcd = Etcd::start().unwrap();
    let endpoints = etcd.endpoints();
    let reg = ["--etcd-endpoints", endpoints.as_str(), "--lease-ttl", "2"];
    let mut nodes = [Node::start_with("node-a", &reg), Node::start_with("node-b", &reg)];
    let args = [
        &["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"][..],
        &reg,
        &["--kv-tier-min-tokens", "32"],
    ]
    .concat();
    let scheduler = Service::start("ferry-scheduler", &args, 2).unwrap();
    let http = scheduler.addr("http");
    wait_until(http, 2, "ferry_kv_agents_registered{", 2.0).await;

    // The first request's blocks reach its node's agent.
    let a = first_stored(&scheduler, &nodes).await;

    // That node's agent dies (its lease lapses), then its executor.
    assert!(metric(http, "ferry_kv_tier_indexed_blocks{") >= 20.0);
    signal(nodes[a].agent.pid(), "KILL").unwrap();
    assert!(nodes[a].agent.wait_exit().is_some());
    wait_until(http, 2, "ferry_kv_agents_registered{", 1.0).await;
    assert_eq!(metric(http, "ferry_kv_tier_indexed_blocks{"), 0.0, "its blocks are forgotten");
    signal(nodes[a].executor.pid(), "KILL").unwrap();
    assert!(nodes[a].executor.wait_exit().is_some());
    wait_until(http, 1, "ferry_kv_agents_registered{", 1.0).await;

    // The same prefix again: nothing is read from the dead agent (no read tried, none
    // failed); the prefix is computed and the streams are exact.
    let before = metric(http, "vllm:prompt_tokens_total{");
    let got = run_streams(scheduler.addr("grpc"), second(), 0, || {}).await;
    assert_complete(&got, MAX_TOKENS as usize);
    assert_same_streams(&got, &expected);
    assert_eq!(metric(http, "ferry_kv_tier_hits{"), 0.0, "a read from a dead agent was planned");
    assert_eq!(metric(http, "ferry_kv_tier_import_failures{"), 0.0);
    let computed = metric(http, "vllm:prompt_tokens_total{") - before;
    assert!(computed > 300.0, "{computed}: the prefix came from somewhere");
}

/// A scheduler that starts over the same nodes (the old one killed) knows nothing of the KV
/// tier until it asks the agents (`ListBlocks`) as it opens its sessions: then a prefix one
/// node's agent holds is read from it by the other node, as before the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_scheduler_learns_the_tier_from_the_agents() {
    let expected = undisturbed_second().await;
    let mut nodes = [Node::start("node-a"), Node::start("node-b")];
    let tier = ["--kv-tier-min-tokens", "32"];
    let mut old = start_scheduler(&[&nodes[0].executor, &nodes[1].executor], &tier);
    let http = old.addr("http");
    wait_until(http, 2, "ferry_kv_tier_indexed_blocks{", 0.0).await;
    let a = first_stored(&old, &nodes).await;
    signal(old.pid(), "KILL").unwrap();
    assert!(old.wait_exit().is_some());

    // The new scheduler's index is filled from the agents as its sessions open.
    let scheduler = start_scheduler(&[&nodes[0].executor, &nodes[1].executor], &tier);
    let http = scheduler.addr("http");
    let learned =
        wait_for(Duration::from_mins(1), || metric(http, "ferry_kv_tier_indexed_blocks{") >= 20.0);
    assert!(learned.await.is_some(), "the new scheduler never learned the agent's blocks");
    assert_eq!(metric(http, "ferry_kv_tier_stored_blocks{"), 0.0, "it stored nothing itself");

    // The node that computed the prefix loses its executor; the other reads the prefix from
    // the agent, exactly.
    signal(nodes[a].executor.pid(), "KILL").unwrap();
    assert!(nodes[a].executor.wait_exit().is_some());
    wait_until(http, 1, "ferry_kv_tier_import_failures{", 0.0).await;
    let got = run_streams(scheduler.addr("grpc"), second(), 0, || {}).await;
    assert_complete(&got, MAX_TOKENS as usize);
    assert_same_streams(&got, &expected);
    assert!(metric(http, "ferry_kv_tier_hits{") >= 1.0, "no request read the tier");
    assert!(metric(http, "ferry_kv_tier_imported_blocks{") >= 20.0);
    assert_eq!(metric(http, "ferry_kv_tier_import_failures{"), 0.0);
}
