//! `ferry serve`: the whole system in one process on loopback with no etcd — the front (gRPC
//! and OpenAI HTTP) and the scheduler on the addresses the user gives, an executor and a KV
//! agent on free loopback ports. This is the embedded default the README's first command
//! starts.
//!
//! The model is read once and shared: the front tokenizes with the same `ModelFile` whose
//! weights the executor loads, so the two cannot disagree (and the default model is fetched
//! once).

use std::net::SocketAddr;
use std::sync::Arc;

use ferry_executor_svc::ExecutorConfig;
use ferry_kv_transfer_svc::KvAgentConfig;
use ferry_model::ModelFile;
use ferry_scheduler_svc::config::{FrontArgs, FrontSettings, SchedulerArgs, SchedulerSettings};
use ferry_scheduler_svc::{Listeners, SchedulerRole};
use tokio::sync::watch;

/// The flags of `ferry serve`.
#[derive(Clone, Debug, clap::Args)]
pub struct ServeArgs {
    /// Address for the gRPC API (port 0 picks a free port).
    #[arg(long, env = "FERRY_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: String,
    /// Address for the OpenAI-compatible HTTP API (port 0 picks a free port).
    #[arg(long, env = "FERRY_HTTP_LISTEN", default_value = "127.0.0.1:8000")]
    pub http_listen: String,
    /// How the scheduler schedules.
    #[command(flatten)]
    pub scheduler: SchedulerArgs,
    /// The front's limits.
    #[command(flatten)]
    pub front: FrontArgs,
    /// The embedded executor (its `--model` is the front's too).
    #[command(flatten)]
    pub executor: ExecutorConfig,
    /// The embedded KV agent.
    #[command(flatten)]
    pub kv_agent: KvAgentConfig,
    /// Logs.
    #[command(flatten)]
    pub log: ferry_runtime::logging::LogArgs,
    /// Traces.
    #[command(flatten)]
    pub trace: ferry_runtime::telemetry::TraceArgs,
}

/// `ferry serve`'s flags, checked.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    scheduler: SchedulerSettings,
    front: FrontSettings,
    executor: ExecutorConfig,
    kv_agent: KvAgentConfig,
}

impl ServeArgs {
    /// Checks every flag of every part; the error names the flag.
    pub fn resolve(&self) -> anyhow::Result<ServeConfig> {
        self.executor.validate()?;
        self.kv_agent.validate()?;
        Ok(ServeConfig {
            scheduler: self.scheduler.resolve()?,
            front: self.front.resolve()?,
            executor: self.executor.clone(),
            kv_agent: self.kv_agent.clone(),
        })
    }
}

/// Where each embedded part listens, once bound.
#[derive(Clone, Copy, Debug)]
pub struct ServeAddrs {
    /// The front's gRPC API.
    pub grpc: SocketAddr,
    /// The OpenAI HTTP API.
    pub http: SocketAddr,
    /// The embedded executor.
    pub executor: SocketAddr,
    /// The embedded KV agent.
    pub kv_agent: SocketAddr,
}

/// Binds every part: the front's APIs at `listen` and `http_listen`, the executor and the KV
/// agent on free loopback ports.
pub async fn bind(listen: &str, http_listen: &str) -> anyhow::Result<(Bound, ServeAddrs)> {
    let (grpc, grpc_addr) = ferry_runtime::grpc::bind(listen).await?;
    let (http, http_addr) = ferry_runtime::grpc::bind(http_listen).await?;
    let (executor, executor_addr) = ferry_runtime::grpc::bind("127.0.0.1:0").await?;
    let (kv_agent, kv_addr) = ferry_runtime::grpc::bind("127.0.0.1:0").await?;
    let addrs =
        ServeAddrs { grpc: grpc_addr, http: http_addr, executor: executor_addr, kv_agent: kv_addr };
    Ok((Bound { front: Listeners { grpc, http: Some(http) }, executor, kv_agent }, addrs))
}

/// The bound listeners of every part.
pub struct Bound {
    front: Listeners,
    executor: tokio::net::TcpListener,
    kv_agent: tokio::net::TcpListener,
}

/// Runs every part for `model` until `shutdown` resolves; they drain together.
pub async fn run(
    config: ServeConfig,
    model: Arc<ModelFile>,
    bound: Bound,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let executor_url = format!("http://{}", bound.executor.local_addr()?);
    // The embedded executor's KV transfers go through the embedded agent.
    let mut executor = config.executor;
    executor.kv_agent = Some(bound.kv_agent.local_addr()?.to_string());
    let role = SchedulerRole {
        scheduler: config.scheduler,
        front: config.front,
        listed: vec![(executor_url.clone(), executor_url)],
        cluster: None,
    };
    // One stop signal fans out to every part, so they drain together.
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let parts = async {
        tokio::try_join!(
            ferry_executor_svc::run(
                executor,
                model.clone(),
                None,
                bound.executor,
                stopped(stop_rx.clone())
            ),
            ferry_kv_transfer_svc::run(
                config.kv_agent,
                None,
                bound.kv_agent,
                stopped(stop_rx.clone())
            ),
            ferry_scheduler_svc::run(role, model, bound.front, stopped(stop_rx.clone())),
        )
    };
    tokio::pin!(parts);
    tokio::select! {
        result = &mut parts => { result?; }
        () = shutdown => {
            let _ = stop_tx.send(true);
            parts.await?;
        }
    }
    Ok(())
}
