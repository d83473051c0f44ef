//! Ferry's KV transfer agent, one per node (DESIGN.md section 6): a bounded host-memory store
//! of KV blocks named by their hash-chain value, and the mover that pushes blocks to another
//! node's agent for prefill/decode disaggregation.
//!
//! The library is everything; `ferry-kv` only parses flags and calls [`run`]. The bytes the
//! agent exchanges with executors and other agents (frames, layouts, the shared-memory
//! protocol, the data channel's format and client) are `ferry-kv-wire`'s; the agent adds the
//! store, the transfer table, the gRPC service and the data channel's server side.

pub mod agent;
pub mod agent_config;
pub mod data_server;
pub mod peers;
pub mod service;
pub mod store;

use ferry_runtime::GrpcHost;

pub use agent_config::KvAgentConfig;

/// Serves the agent's gRPC API on `listener` until `shutdown` resolves; with `cluster`,
/// registered in etcd under `/ferry/<cluster>/kv/<node-id>` while it serves (withdrawn first
/// on shutdown, and the drain bounded by `drain`). `config` and `cluster` are checked by the
/// caller, at start-up.
pub async fn run(
    config: KvAgentConfig,
    cluster: Option<ferry_runtime::cluster::ClusterArgs>,
    ports: ferry_runtime::grpc::Ports,
    shutdown: ferry_runtime::Shutdown,
    drain: std::time::Duration,
) -> anyhow::Result<()> {
    let id = config.node_id.clone();
    let capacity = usize::try_from(config.store_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX);
    let agent = agent::Agent::new(id.clone(), capacity, config.shm_dir.clone());
    // Transfers nobody read before their deadline end (and give their blocks back).
    let reaper = {
        let agent = agent.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_millis(500));
            loop {
                tick.tick().await;
                agent.reap();
            }
        })
    };
    let side = data_server::side_channel(agent.clone());
    let service = service::KvAgentService::new(agent);
    let metrics = std::sync::Arc::new(service.metrics());
    let server = ferry_proto::v1::kv_transfer_server::KvTransferServer::new(service)
        .max_decoding_message_size(ferry_kv_wire::frames::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(ferry_kv_wire::frames::MAX_MESSAGE_BYTES);
    let host = GrpcHost::new()
        .bulk()
        .callers(ferry_runtime::tls::AGENT_CALLERS)
        .with_side_channel(side)
        .add_service(server)
        .with_metrics(metrics);
    let kind = ferry_runtime::cluster::MemberKind::KvAgent;
    let member = (cluster.as_ref(), kind, id.as_str(), None);
    let served =
        ferry_runtime::cluster::serve_registered(host, ports, member, shutdown, drain).await;
    reaper.abort();
    served?;
    Ok(())
}
