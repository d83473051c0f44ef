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

/// Serves the agent's gRPC API on `listener` until `shutdown` resolves.
pub async fn run(
    config: KvAgentConfig,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    config.validate()?;
    let service = service::KvAgentService::new(config);
    GrpcHost::new()
        .add_service(ferry_proto::v1::kv_transfer_server::KvTransferServer::new(service))
        .serve(listener, shutdown)
        .await?;
    Ok(())
}
