//! `serve`: the whole system in one process on loopback with no etcd — the front (gRPC and
//! OpenAI HTTP) and the scheduler on the addresses the user gives, an executor and a KV agent on free loopback ports.
//! This is the embedded default the README's first command starts.

use ferry_executor_svc::ExecutorConfig;
use ferry_kv_transfer_svc::KvAgentConfig;
use tokio::sync::watch;

use crate::config::SchedulerConfig;

/// Where each embedded part listens, once bound.
#[derive(Clone, Copy, Debug)]
pub struct ServeAddrs {
    /// The front's gRPC API.
    pub grpc: std::net::SocketAddr,
    /// The OpenAI HTTP API.
    pub http: std::net::SocketAddr,
    /// The embedded executor.
    pub executor: std::net::SocketAddr,
    /// The embedded KV agent.
    pub kv_agent: std::net::SocketAddr,
}

/// Runs every part until `shutdown` resolves; `on_ready` receives the bound addresses.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    listen: &str,
    http_listen: &str,
    mut scheduler: SchedulerConfig,
    executor: ExecutorConfig,
    kv_agent: KvAgentConfig,
    on_ready: impl FnOnce(ServeAddrs),
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    scheduler.validate()?;
    executor.validate()?;
    kv_agent.validate()?;
    let model = executor.model.clone();
    let (grpc_listener, grpc) = ferry_runtime::grpc::bind(listen).await?;
    let (http_listener, http) = ferry_runtime::grpc::bind(http_listen).await?;
    let (exec_listener, exec_addr) = ferry_runtime::grpc::bind("127.0.0.1:0").await?;
    let (kv_listener, kv_addr) = ferry_runtime::grpc::bind("127.0.0.1:0").await?;
    scheduler.executors = vec![format!("http://{exec_addr}")];
    on_ready(ServeAddrs { grpc, http, executor: exec_addr, kv_agent: kv_addr });

    // One stop signal fans out to every part, so they drain together.
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let parts = async {
        tokio::try_join!(
            ferry_executor_svc::run(executor, exec_listener, stopped(stop_rx.clone())),
            ferry_kv_transfer_svc::run(kv_agent, kv_listener, stopped(stop_rx.clone())),
            crate::run(
                scheduler,
                model,
                None,
                grpc_listener,
                Some(http_listener),
                stopped(stop_rx.clone())
            ),
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
