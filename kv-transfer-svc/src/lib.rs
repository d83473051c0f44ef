//! Ferry's KV transfer agent, one per node (DESIGN.md section 6): a bounded host-memory store
//! of KV blocks named by their hash-chain value, and the mover that pushes blocks to another
//! node's agent for prefill/decode disaggregation.
//!
//! The library is everything; `ferry-kv` only parses flags and calls [`run`].

pub mod config;
pub mod service;

use ferry_runtime::GrpcHost;
use tokio::net::TcpListener;

pub use config::KvAgentConfig;

/// Serves the agent's gRPC API on `listener` until `shutdown` resolves; with `cluster`,
/// registered in etcd under `/ferry/<cluster>/kv/<node-id>` while it serves (withdrawn first
/// on shutdown). `config` and `cluster` are checked by the caller, at start-up.
pub async fn run(
    config: KvAgentConfig,
    cluster: Option<ferry_runtime::cluster::ClusterArgs>,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let id = config.node_id.clone();
    let service = service::KvAgentService::new(config);
    let metrics = std::sync::Arc::new(service.metrics());
    let host = GrpcHost::new()
        .add_service(ferry_proto::v1::kv_transfer_server::KvTransferServer::new(service))
        .with_metrics(metrics);
    let kind = ferry_runtime::cluster::MemberKind::KvAgent;
    ferry_runtime::cluster::serve_registered(host, listener, cluster.as_ref(), kind, &id, shutdown)
        .await?;
    Ok(())
}
