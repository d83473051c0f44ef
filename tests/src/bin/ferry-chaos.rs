//! `ferry-chaos`: a chaos soak. Starts a cluster of real processes — a three-member etcd, two
//! schedulers (leader and standby), a front, executors each with its node's KV agent — drives
//! Poisson load through the front, and meanwhile hits the cluster with random faults, one at a
//! time: `kill -9` and restart of an executor, a KV agent, a scheduler (the leader more often
//! than not) or an etcd member; SIGSTOP pauses of an executor or the leader; etcd outages (every
//! member paused, or killed and restarted). Then it stops the load, lets the streams finish and
//! prints a summary: requests, completed, lost, streams whose tokens or text differ from an
//! undisturbed run of the same request, the longest stall, and the blocks left held. It exits
//! non-zero when anything was lost, differs or leaked.
//!
//! Every request is drawn from a fixed set (greedy or seeded sampling, `ignore_eos`), each run
//! once undisturbed before the faults start: that run is the reference. Faults and arrivals
//! follow `--seed`, so a run can be repeated (the machine's timing still varies).
//!
//! ```sh
//! cargo build --workspace --bins --profile ci
//! target/ci/ferry-chaos --duration 600    # the ten-minute soak; scripts/chaos does both
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use ferry_bench::loadgen::Rng;
use ferry_proto::v1::{self, generation_client::GenerationClient};
use ferry_tests::streams::try_metric as metric;
use ferry_tests::{free_port, signal, Etcd, Service};

/// A chaos soak of a local cluster of Ferry processes.
#[derive(Debug, Parser)]
#[command(name = "ferry-chaos", version, about)]
struct Args {
    /// How long the load and the faults run, in seconds.
    #[arg(long, default_value_t = 600)]
    duration: u64,
    /// Mean arrival rate of new requests (Poisson), per second.
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// Mean pause between one fault's end and the next one's start, in seconds.
    #[arg(long, default_value_t = 4.0)]
    fault_every: f64,
    /// Executors (each with its own KV agent).
    #[arg(long, default_value_t = 2)]
    executors: usize,
    /// Distinct requests the load draws from.
    #[arg(long, default_value_t = 24)]
    distinct: usize,
    /// Lease TTL of every member, seconds.
    #[arg(long, default_value_t = 2)]
    lease_ttl: u64,
    /// Seed of the arrivals, the requests drawn and the faults.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the summary as JSON too.
    #[arg(long)]
    json: bool,
    /// Instead of the soak, measure failover and drain: kill -9 the leader this many times,
    /// then SIGTERM it this many times, each under four streams, and print median and worst.
    #[arg(long)]
    measure: Option<usize>,
}

/// Uniform in `[lo, hi)` seconds.
fn secs(rng: &mut Rng, lo: f64, hi: f64) -> Duration {
    Duration::from_secs_f64(lo + (hi - lo) * rng.unit())
}

/// A process the soak can kill and start again with the same flags.
struct Proc {
    bin: &'static str,
    args: Vec<String>,
    expect: usize,
    running: Option<Service>,
}

impl Proc {
    fn start(bin: &'static str, args: Vec<String>, expect: usize) -> Result<Self> {
        let mut p = Self { bin, args, expect, running: None };
        p.restart()?;
        Ok(p)
    }

    fn restart(&mut self) -> Result<()> {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        self.running = Some(Service::start(self.bin, &args, self.expect)?);
        Ok(())
    }

    fn service(&self) -> &Service {
        self.running.as_ref().expect("running")
    }

    fn kill(&mut self) -> Result<()> {
        if let Some(s) = self.running.take() {
            signal(s.pid(), "KILL")?;
        }
        Ok(())
    }
}

/// The cluster under test.
struct Cluster {
    etcd: Etcd,
    schedulers: Vec<Proc>,
    /// Executors and their agents, by node.
    nodes: Vec<(Proc, Proc)>,
    front: Service,
}

impl Cluster {
    fn start(args: &Args) -> Result<Self> {
        let etcd = Etcd::cluster(3)?;
        let endpoints = etcd.endpoints();
        let ttl = args.lease_ttl.to_string();
        let cluster = ["--etcd-endpoints", &endpoints, "--lease-ttl", &ttl];
        let owned = |a: &[&str]| -> Vec<String> {
            a.iter().chain(&cluster).map(|s| (*s).to_string()).collect()
        };
        let mut nodes = Vec::new();
        for i in 0..args.executors {
            let name = format!("node-{i}");
            let agent_listen = format!("127.0.0.1:{}", free_port()?);
            let agent_args = ["--listen", &agent_listen, "--node-id", &name, "--store-mib", "64"];
            let agent = Proc::start("ferry-kv", owned(&agent_args), 1)?;
            let exec_args = [
                "--listen",
                "127.0.0.1:0",
                "--executor-id",
                &name,
                "--kv-cache-mib",
                "64",
                "--kv-agent",
                &agent_listen,
            ];
            let exec = Proc::start("ferry-executor", owned(&exec_args), 1)?;
            nodes.push((exec, agent));
        }
        let mut schedulers = Vec::new();
        for i in 0..2 {
            let id = format!("s{i}");
            let a =
                ["--scheduler-id", &id, "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"];
            schedulers.push(Proc::start("ferry-scheduler", owned(&a), 2)?);
        }
        let front_args: Vec<String> =
            ["front", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]
                .iter()
                .chain(&cluster)
                .map(|s| (*s).to_string())
                .collect();
        let front_args: Vec<&str> = front_args.iter().map(String::as_str).collect();
        let front = Service::start("ferry-scheduler", &front_args, 2)?;
        Ok(Self { etcd, schedulers, nodes, front })
    }

    /// The scheduler that leads now, if one says so.
    fn leader(&self) -> Option<usize> {
        self.schedulers.iter().position(|s| {
            s.running
                .as_ref()
                .is_some_and(|s| metric(s.addr("http"), "ferry_scheduler_leader{") == Some(1.0))
        })
    }

    /// Waits until a leader drives every executor.
    async fn wait_ready(&self, limit: Duration) -> Result<()> {
        let want = self.nodes.len() as f64;
        let ready = || {
            self.leader().is_some_and(|l| {
                let http = self.schedulers[l].service().addr("http");
                metric(http, "ferry_executors_connected").is_some_and(|n| n >= want)
            }) && ferry_tests::http(self.front.addr("http"), "GET", "/health", b"")
                .is_ok_and(|(code, _)| code == 200)
        };
        if ferry_tests::streams::wait_for(limit, ready).await.is_none() {
            bail!("the cluster was not ready within {limit:?}");
        }
        Ok(())
    }
}

/// One fault, applied and then healed.
#[derive(Clone, Copy, Debug)]
enum Fault {
    KillExecutor(usize),
    KillAgent(usize),
    KillScheduler { leader: bool },
    KillEtcdMember(usize),
    PauseExecutor(usize),
    PauseLeader,
    EtcdPaused,
    EtcdRestarted,
}

impl Fault {
    fn draw(rng: &mut Rng, nodes: usize) -> Self {
        match rng.below(10) {
            0 | 1 => Fault::KillExecutor(rng.below(nodes)),
            2 => Fault::KillAgent(rng.below(nodes)),
            3 | 4 => Fault::KillScheduler { leader: rng.below(4) != 0 },
            5 => Fault::KillEtcdMember(rng.below(3)),
            6 => Fault::PauseExecutor(rng.below(nodes)),
            7 => Fault::PauseLeader,
            8 => Fault::EtcdPaused,
            _ => Fault::EtcdRestarted,
        }
    }

    /// Whether it hits the streams in flight (the others hit the cluster's coordination).
    fn hits_streams(self) -> bool {
        matches!(
            self,
            Fault::KillExecutor(_)
                | Fault::KillScheduler { leader: true }
                | Fault::PauseExecutor(_)
                | Fault::PauseLeader
        )
    }

    fn label(self) -> &'static str {
        match self {
            Fault::KillExecutor(_) => "kill -9 executor",
            Fault::KillAgent(_) => "kill -9 KV agent",
            Fault::KillScheduler { leader: true } => "kill -9 leader scheduler",
            Fault::KillScheduler { leader: false } => "kill -9 standby scheduler",
            Fault::KillEtcdMember(_) => "kill -9 etcd member",
            Fault::PauseExecutor(_) => "SIGSTOP executor",
            Fault::PauseLeader => "SIGSTOP leader scheduler",
            Fault::EtcdPaused => "etcd outage (every member SIGSTOPped)",
            Fault::EtcdRestarted => "etcd outage (every member killed, restarted)",
        }
    }

    /// Applies the fault, holds it for a random while, heals it.
    fn run(self, c: &mut Cluster, rng: &mut Rng) -> Result<()> {
        let hold = secs(rng, 1.0, 5.0);
        match self {
            Fault::KillExecutor(i) => {
                c.nodes[i].0.kill()?;
                std::thread::sleep(hold);
                c.nodes[i].0.restart()?;
            }
            Fault::KillAgent(i) => {
                c.nodes[i].1.kill()?;
                std::thread::sleep(hold);
                c.nodes[i].1.restart()?;
            }
            Fault::KillScheduler { leader } => {
                let l = c.leader().unwrap_or(0);
                let i = if leader { l } else { 1 - l };
                c.schedulers[i].kill()?;
                std::thread::sleep(hold);
                c.schedulers[i].restart()?;
            }
            Fault::KillEtcdMember(i) => {
                c.etcd.kill(i)?;
                std::thread::sleep(hold);
                c.etcd.restart(i)?;
            }
            Fault::PauseExecutor(i) => {
                let pid = c.nodes[i].0.service().pid();
                signal(pid, "STOP")?;
                std::thread::sleep(hold);
                signal(pid, "CONT")?;
            }
            Fault::PauseLeader => {
                let Some(l) = c.leader() else { return Ok(()) };
                let pid = c.schedulers[l].service().pid();
                signal(pid, "STOP")?;
                std::thread::sleep(hold);
                signal(pid, "CONT")?;
            }
            Fault::EtcdPaused => {
                let pids: Vec<u32> = (0..3).filter_map(|i| c.etcd.pid(i)).collect();
                for &p in &pids {
                    signal(p, "STOP")?;
                }
                std::thread::sleep(hold * 2);
                for &p in &pids {
                    signal(p, "CONT")?;
                }
            }
            Fault::EtcdRestarted => {
                for i in 0..3 {
                    c.etcd.kill(i)?;
                }
                std::thread::sleep(hold * 2);
                c.etcd.restart_all()?;
            }
        }
        Ok(())
    }
}

/// A request sent: its index in the request set, and its stream's task.
type Running = (usize, tokio::task::JoinHandle<Stream>);

/// What one stream delivered.
#[derive(Default)]
struct Stream {
    tokens: Vec<u32>,
    text: String,
    finish: i32,
    error: String,
    /// When the request was sent, and when each event with tokens arrived.
    sent: Option<Instant>,
    arrived: Vec<Instant>,
}

async fn run_one(url: String, req: v1::GenerateRequest) -> Stream {
    run_watched(url, req, None).await
}

/// [`run_one`], telling `first` when the first token arrives.
async fn run_watched(
    url: String,
    req: v1::GenerateRequest,
    mut first: Option<tokio::sync::oneshot::Sender<()>>,
) -> Stream {
    let mut out = Stream { sent: Some(Instant::now()), ..Stream::default() };
    let stream = async {
        let mut client = GenerationClient::connect(url).await?;
        let mut stream = client.generate(req).await?.into_inner();
        while let Some(ev) = stream.message().await? {
            if !ev.token_ids.is_empty() {
                out.arrived.push(Instant::now());
                if let Some(tx) = first.take() {
                    let _ = tx.send(());
                }
            }
            out.tokens.extend(&ev.token_ids);
            out.text.push_str(&ev.text);
            if ev.finish_reason != 0 {
                out.finish = ev.finish_reason;
                out.error.clone_from(&ev.error);
            }
        }
        anyhow::Ok(())
    };
    if let Err(e) = stream.await {
        out.error = format!("stream broke: {e}");
    }
    out
}

/// The request set: prompts sharing some prefixes, greedy and seeded, 16 to 48 tokens.
fn request_set(n: usize, rng: &mut Rng) -> Vec<v1::GenerateRequest> {
    let towns = ["Amber", "Birch", "Cedar", "Dune", "Elm", "Fern"];
    (0..n)
        .map(|i| {
            let sampling = if i % 2 == 0 {
                v1::SamplingParams { temperature: 0.0, ..Default::default() }
            } else {
                v1::SamplingParams {
                    temperature: 0.8,
                    seed: Some(7000 + i as u64),
                    ..Default::default()
                }
            };
            let max_tokens = 16 + rng.below(33) as u32;
            v1::GenerateRequest {
                input: Some(v1::generate_request::Input::Prompt(format!(
                    "Story {i}: once upon a time, in a town called {}, there lived",
                    towns[i % towns.len()]
                ))),
                sampling: Some(sampling),
                stopping: Some(v1::StoppingCriteria {
                    max_tokens,
                    ignore_eos: true,
                    ..Default::default()
                }),
                ..Default::default()
            }
        })
        .collect()
}

/// The soak's outcome.
#[derive(Debug, Default)]
struct Summary {
    seconds: f64,
    faults: Vec<(String, usize)>,
    requests: usize,
    completed: usize,
    lost: usize,
    differing: usize,
    moved: u64,
    longest_stall_ms: u128,
    /// When (seconds into the soak) the longest stall began.
    longest_stall_at: f64,
    longest_first_token_ms: u128,
    leaked_blocks: u64,
    leaked_requests: u64,
}

impl Summary {
    fn ok(&self) -> bool {
        self.lost == 0
            && self.differing == 0
            && self.leaked_blocks == 0
            && self.leaked_requests == 0
    }

    fn print(&self, json: bool) {
        println!("chaos soak: {:.0} s", self.seconds);
        let faults: usize = self.faults.iter().map(|(_, n)| n).sum();
        println!("  faults: {faults}");
        for (label, n) in &self.faults {
            println!("    {n:>4}  {label}");
        }
        println!("  requests: {}", self.requests);
        println!("  completed: {}", self.completed);
        println!("  lost: {} (must be 0)", self.lost);
        println!("  differing from the undisturbed run: {} (must be 0)", self.differing);
        println!("  moved by the front: {}", self.moved);
        println!(
            "  longest stall between tokens: {} ms (from {:.1} s)",
            self.longest_stall_ms, self.longest_stall_at
        );
        println!("  longest wait for a first token: {} ms", self.longest_first_token_ms);
        println!(
            "  leaked: {} blocks, {} requests (must be 0)",
            self.leaked_blocks, self.leaked_requests
        );
        println!("  verdict: {}", if self.ok() { "PASS" } else { "FAIL" });
        if json {
            let faults: serde_json::Map<String, serde_json::Value> =
                self.faults.iter().map(|(l, n)| (l.clone(), (*n).into())).collect();
            let v = serde_json::json!({
                "seconds": self.seconds,
                "faults": faults,
                "requests": self.requests,
                "completed": self.completed,
                "lost": self.lost,
                "differing": self.differing,
                "moved": self.moved,
                "longest_stall_ms": self.longest_stall_ms,
                "longest_first_token_ms": self.longest_first_token_ms,
                "leaked_blocks": self.leaked_blocks,
                "leaked_requests": self.leaked_requests,
                "ok": self.ok(),
            });
            println!("{v}");
        }
    }
}

/// Blocks and requests the executors still hold once the load is over (waiting up to `limit`
/// for them to reach zero).
async fn leftovers(c: &Cluster, limit: Duration) -> (u64, u64) {
    let deadline = Instant::now() + limit;
    loop {
        let mut held = (0, 0);
        for (exec, _) in &c.nodes {
            let url = format!("http://{}", exec.service().addr("grpc"));
            let Ok(mut client) = v1::executor_client::ExecutorClient::connect(url).await else {
                continue;
            };
            if let Ok(d) = client.describe(v1::DescribeRequest {}).await {
                let d = d.into_inner();
                held.0 += u64::from(d.blocks_in_use);
                held.1 += u64::from(d.num_requests);
            }
        }
        if held == (0, 0) || Instant::now() > deadline {
            return held;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One leader fault's timings.
struct Timing {
    /// Signal to a new leader driving every executor.
    takeover: Duration,
    /// The longest gap a stream in flight saw across the fault.
    stall: Duration,
    /// Signal to the process's exit (a drain).
    exit: Option<Duration>,
}

/// Kills (`KILL`) or drains (`TERM`) the leader under four streams and times the takeover.
async fn leader_fault(c: &mut Cluster, url: &str, sig: &str) -> Result<Timing> {
    let leader = c.leader().context("no leader")?;
    let mut rng = Rng(7);
    let mut firsts = Vec::new();
    let mut streams = Vec::new();
    for mut req in request_set(4, &mut rng) {
        req.stopping.as_mut().expect("set").max_tokens = 96;
        let (tx, rx) = tokio::sync::oneshot::channel();
        firsts.push(rx);
        streams.push(tokio::spawn(run_watched(url.to_string(), req, Some(tx))));
    }
    for rx in firsts {
        let _ = rx.await;
    }
    let mut old = c.schedulers[leader].running.take().context("leader not running")?;
    let t0 = Instant::now();
    signal(old.pid(), sig)?;
    let want = c.nodes.len() as f64;
    let other = 1 - leader;
    let taken = || {
        c.schedulers[other].running.as_ref().is_some_and(|s| {
            metric(s.addr("http"), "ferry_scheduler_leader{") == Some(1.0)
                && metric(s.addr("http"), "ferry_executors_connected").is_some_and(|n| n >= want)
        })
    };
    let takeover = ferry_tests::streams::wait_for(Duration::from_secs(30), taken)
        .await
        .context("the standby did not take over within 30 s")?;
    let exit = if sig == "TERM" {
        old.wait_exit().context("the drained leader did not exit")?;
        Some(t0.elapsed())
    } else {
        None
    };
    drop(old);
    let mut stall = Duration::ZERO;
    for s in streams {
        let s = s.await?;
        if s.finish != v1::FinishReason::Length as i32 || !s.error.is_empty() {
            bail!("a stream failed across the fault: {}", s.error);
        }
        for w in s.arrived.windows(2) {
            if w[0] <= t0 + takeover && w[1] >= t0 {
                stall = stall.max(w[1] - w[0]);
            }
        }
    }
    // The old one comes back as the standby.
    c.schedulers[leader].restart()?;
    let candidates = || c.etcd.keys("/ferry/default/scheduler/").is_ok_and(|k| k.len() == 2);
    ferry_tests::streams::wait_for(Duration::from_secs(30), candidates)
        .await
        .context("the restarted scheduler did not stand by")?;
    Ok(Timing { takeover, stall, exit })
}

/// `--measure`: leader failover (kill -9) and drain (SIGTERM) times, `runs` of each.
async fn measure(c: &mut Cluster, url: &str, runs: usize) -> Result<()> {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let stats = |mut v: Vec<Duration>| {
        v.sort();
        format!("median {:.0} ms, worst {:.0} ms", ms(v[v.len() / 2]), ms(v[v.len() - 1]))
    };
    for (sig, what) in
        [("KILL", "failover (kill -9 of the leader)"), ("TERM", "drain (SIGTERM to the leader)")]
    {
        let mut timings = Vec::new();
        for i in 0..runs {
            let t = leader_fault(c, url, sig).await?;
            eprintln!(
                "ferry-chaos: {what} {}: takeover {:.0} ms, stall {:.0} ms{}",
                i + 1,
                ms(t.takeover),
                ms(t.stall),
                t.exit.map(|e| format!(", exit {:.0} ms", ms(e))).unwrap_or_default()
            );
            timings.push(t);
        }
        println!("{what}, {runs} runs:");
        println!(
            "  new leader drives every executor: {}",
            stats(timings.iter().map(|t| t.takeover).collect())
        );
        println!(
            "  longest gap in a stream across it: {}",
            stats(timings.iter().map(|t| t.stall).collect())
        );
        if sig == "TERM" {
            let exits = timings.iter().filter_map(|t| t.exit).collect();
            println!("  SIGTERM to the process's exit: {}", stats(exits));
        }
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.rate > 0.0 && args.executors >= 1 && args.distinct >= 1, "bad arguments");
    let mut rng = Rng(args.seed);
    eprintln!(
        "ferry-chaos: starting etcd (3 members), {} nodes, 2 schedulers, a front",
        args.executors
    );
    let mut cluster = Cluster::start(&args).context("starting the cluster")?;
    cluster.wait_ready(Duration::from_mins(1)).await?;
    let url = format!("http://{}", cluster.front.addr("grpc"));
    if let Some(runs) = args.measure {
        return measure(&mut cluster, &url, runs).await;
    }

    // The undisturbed run: each distinct request once, eight at a time.
    let set = request_set(args.distinct, &mut rng);
    eprintln!("ferry-chaos: the undisturbed run of {} distinct requests", set.len());
    let mut reference = Vec::new();
    for chunk in set.chunks(8) {
        let runs = chunk.iter().map(|r| tokio::spawn(run_one(url.clone(), r.clone())));
        for r in runs.collect::<Vec<_>>() {
            let s = r.await?;
            if s.finish != v1::FinishReason::Length as i32 || !s.error.is_empty() {
                bail!("an undisturbed request failed: {:?} {}", s.finish, s.error);
            }
            reference.push((s.tokens, s.text));
        }
    }

    // Load: Poisson arrivals, each a request drawn from the set.
    let moved_before = metric(cluster.front.addr("http"), "ferry_requests_moved").unwrap_or(0.0);
    let started = Instant::now();
    let duration = Duration::from_secs(args.duration);
    let streams: Arc<Mutex<Vec<Running>>> = Arc::default();
    let load = {
        let (streams, url, mut rng) = (streams.clone(), url.clone(), Rng(args.seed ^ 0x5eed));
        let set = set.clone();
        tokio::spawn(async move {
            while started.elapsed() < duration {
                tokio::time::sleep(rng.exp(1.0 / args.rate)).await;
                let k = rng.below(set.len());
                let task = tokio::spawn(run_one(url.clone(), set[k].clone()));
                streams.lock().expect("not poisoned").push((k, task));
            }
        })
    };

    // Faults, one at a time, on a thread of their own (they sleep and start processes).
    let in_flight = {
        let streams = streams.clone();
        move || streams.lock().expect("not poisoned").iter().any(|(_, t)| !t.is_finished())
    };
    let (faults, cluster) = tokio::task::spawn_blocking(move || {
        let mut counts: HashMap<&'static str, usize> = HashMap::new();
        let mut rng = Rng(args.seed ^ 0xfa017);
        while started.elapsed() + Duration::from_secs(6) < duration {
            std::thread::sleep(rng.exp(args.fault_every));
            let fault = Fault::draw(&mut rng, cluster.nodes.len());
            // Aimed at the load: a fault that hits streams waits (up to 10 s) for one in
            // flight, so that it tests something (at 1 request/s, the cluster is often idle).
            let aim = Instant::now() + Duration::from_secs(10);
            while fault.hits_streams() && !in_flight() && Instant::now() < aim {
                std::thread::sleep(Duration::from_millis(20));
            }
            eprintln!("ferry-chaos: {:>5.1} s  {}", started.elapsed().as_secs_f64(), fault.label());
            if let Err(e) = fault.run(&mut cluster, &mut rng) {
                eprintln!(
                    "ferry-chaos: the fault {} failed to apply or heal: {e:#}",
                    fault.label()
                );
            }
            *counts.entry(fault.label()).or_default() += 1;
        }
        (counts, cluster)
    })
    .await?;
    load.await?;
    eprintln!("ferry-chaos: load stopped; waiting for the streams to end");

    let mut summary = Summary { seconds: started.elapsed().as_secs_f64(), ..Summary::default() };
    let mut faults: Vec<(String, usize)> =
        faults.into_iter().map(|(l, n)| (l.to_string(), n)).collect();
    faults.sort();
    summary.faults = faults;
    let all = std::mem::take(&mut *streams.lock().expect("not poisoned"));
    for (k, task) in all {
        summary.count(k, &task.await?, &reference[k], started);
    }
    let moved = metric(cluster.front.addr("http"), "ferry_requests_moved").unwrap_or(0.0);
    summary.moved = (moved - moved_before) as u64;
    (summary.leaked_blocks, summary.leaked_requests) =
        leftovers(&cluster, Duration::from_secs(30)).await;
    summary.print(args.json);
    drop(cluster);
    if !summary.ok() {
        bail!("the soak lost, changed or leaked something");
    }
    Ok(())
}

impl Summary {
    /// Counts stream `s` of request `k`, whose undisturbed run gave `reference`.
    fn count(&mut self, k: usize, s: &Stream, reference: &(Vec<u32>, String), started: Instant) {
        let summary = self;
        summary.requests += 1;
        let complete = s.finish == v1::FinishReason::Length as i32 && s.error.is_empty();
        if complete {
            summary.completed += 1;
            if (&s.tokens, &s.text) != (&reference.0, &reference.1) {
                summary.differing += 1;
            }
        } else {
            summary.lost += 1;
            eprintln!("ferry-chaos: lost request {k}: finish {} {}", s.finish, s.error);
        }
        if let (Some(sent), Some(first)) = (s.sent, s.arrived.first()) {
            summary.longest_first_token_ms =
                summary.longest_first_token_ms.max((*first - sent).as_millis());
        }
        for w in s.arrived.windows(2) {
            let gap = (w[1] - w[0]).as_millis();
            if gap > summary.longest_stall_ms {
                summary.longest_stall_ms = gap;
                summary.longest_stall_at = w[0].saturating_duration_since(started).as_secs_f64();
            }
        }
    }
}
