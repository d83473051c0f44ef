//! Ferry's scheduler service (DESIGN.md sections 1–4): the front that speaks to clients, one
//! pure scheduling core (`ferry-sched-core`) per connected executor, and the glue that streams
//! each step to its executor.
//!
//! The library is everything; `ferry-scheduler` parses flags and calls [`run`] (the scheduler
//! role) or [`serve::run`] (the whole system in one process).

pub mod bench_core;
pub mod config;
pub mod front;
pub mod serve;

use ferry_runtime::GrpcHost;
use tokio::net::TcpListener;

pub use config::SchedulerConfig;

/// Serves the scheduler's gRPC API (the front's `Generation` service) on `listener` until
/// `shutdown` resolves.
pub async fn run(
    config: SchedulerConfig,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    config.validate()?;
    let front = front::GenerationService::new(config);
    GrpcHost::new()
        .add_service(ferry_proto::v1::generation_server::GenerationServer::new(front))
        .serve(listener, shutdown)
        .await?;
    Ok(())
}
