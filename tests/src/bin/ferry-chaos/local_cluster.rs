//! The cluster under test: a three-member etcd, two schedulers (leader and standby), a front,
//! and executors each with its node's KV agent, all real processes on ports of their own. Each
//! can be killed and started again with the same flags; the cluster says who leads, when it is
//! ready, and what the executors still hold.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use ferry_proto::v1;
use ferry_tests::streams::try_metric as metric;
use ferry_tests::{free_port, signal, Etcd, Service};

use crate::Args;

/// A process the soak can kill and start again with the same flags.
pub(crate) struct Proc {
    bin: &'static str,
    args: Vec<String>,
    expect: usize,
    pub(crate) running: Option<Service>,
}

impl Proc {
    fn start(bin: &'static str, args: Vec<String>, expect: usize) -> Result<Self> {
        let mut p = Self { bin, args, expect, running: None };
        p.restart()?;
        Ok(p)
    }

    pub(crate) fn restart(&mut self) -> Result<()> {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        self.running = Some(Service::start(self.bin, &args, self.expect)?);
        Ok(())
    }

    pub(crate) fn service(&self) -> &Service {
        self.running.as_ref().expect("running")
    }

    pub(crate) fn kill(&mut self) -> Result<()> {
        if let Some(s) = self.running.take() {
            signal(s.pid(), "KILL")?;
        }
        Ok(())
    }
}

/// The cluster under test.
pub(crate) struct Cluster {
    pub(crate) etcd: Etcd,
    pub(crate) schedulers: Vec<Proc>,
    /// Executors and their agents, by node.
    pub(crate) nodes: Vec<(Proc, Proc)>,
    pub(crate) front: Service,
}

impl Cluster {
    pub(crate) fn start(args: &Args) -> Result<Self> {
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
    pub(crate) fn leader(&self) -> Option<usize> {
        self.schedulers.iter().position(|s| {
            s.running
                .as_ref()
                .is_some_and(|s| metric(s.addr("http"), "ferry_scheduler_leader{") == Some(1.0))
        })
    }

    /// Waits until a leader drives every executor.
    pub(crate) async fn wait_ready(&self, limit: Duration) -> Result<()> {
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

/// Blocks and requests the executors still hold once the load is over (waiting up to `limit`
/// for them to reach zero).
pub(crate) async fn leftovers(c: &Cluster, limit: Duration) -> (u64, u64) {
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
