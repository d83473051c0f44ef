//! The faults the soak hits the cluster with, one at a time: `kill -9` and restart of a
//! process, SIGSTOP pauses, etcd outages. Each is drawn from the soak's seed, applied, held for a
//! random while and healed.

use std::time::Duration;

use anyhow::Result;
use ferry_bench::loadgen::Rng;
use ferry_tests::signal;

use crate::local_cluster::Cluster;

/// Uniform in `[lo, hi)` seconds.
fn secs(rng: &mut Rng, lo: f64, hi: f64) -> Duration {
    Duration::from_secs_f64(lo + (hi - lo) * rng.unit())
}

/// One fault, applied and then healed.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Fault {
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
    pub(crate) fn draw(rng: &mut Rng, nodes: usize) -> Self {
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
    pub(crate) fn hits_streams(self) -> bool {
        matches!(
            self,
            Fault::KillExecutor(_)
                | Fault::KillScheduler { leader: true }
                | Fault::PauseExecutor(_)
                | Fault::PauseLeader
        )
    }

    pub(crate) fn label(self) -> &'static str {
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
    pub(crate) fn run(self, c: &mut Cluster, rng: &mut Rng) -> Result<()> {
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
