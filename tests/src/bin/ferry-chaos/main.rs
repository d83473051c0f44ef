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
//!
//! The parts: `local_cluster` starts the processes and asks them how they are, `faults` draws
//! and applies the faults, `load` sends the requests and records their streams, `summary`
//! counts the outcome, and `failover` is the `--measure` mode. This file parses the flags and
//! runs the soak: the undisturbed run, then the load and the faults side by side.

mod failover;
mod faults;
mod load;
mod local_cluster;
mod summary;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use ferry_bench::loadgen::Rng;
use ferry_proto::v1;
use ferry_tests::streams::try_metric as metric;

use failover::measure;
use faults::Fault;
use load::{request_set, run_one, Running};
use local_cluster::{leftovers, Cluster};
use summary::Summary;

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
