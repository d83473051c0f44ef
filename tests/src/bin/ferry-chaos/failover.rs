//! `--measure`: instead of the soak, kill -9 or SIGTERM the leader under four streams, again
//! and again, and report how long the standby took to drive every executor, the longest gap a
//! stream saw, and (for SIGTERM) how long the drained leader took to exit.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry_bench::loadgen::Rng;
use ferry_proto::v1;
use ferry_tests::signal;
use ferry_tests::streams::try_metric as metric;

use crate::load::{request_set, run_watched};
use crate::local_cluster::Cluster;

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
pub(crate) async fn measure(c: &mut Cluster, url: &str, runs: usize) -> Result<()> {
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
