//! Ferry's scheduler service (DESIGN.md sections 1–4): the front that speaks to clients, one
//! pure scheduling core (`ferry-sched-core`) per connected executor, and the glue that streams
//! each step to its executor.
//!
//! The library is everything; `ferry-scheduler` parses flags and calls [`run`] (the scheduler
//! role) or [`serve::run`] (the whole system in one process).

pub mod bench_core;
pub mod config;
pub mod front;
pub mod link;
pub mod serve;

use std::path::PathBuf;
use std::time::Duration;

use ferry_runtime::GrpcHost;
use tokio::net::TcpListener;

pub use config::SchedulerConfig;

/// How long start-up keeps trying to reach each executor (they may still be loading a model).
const CONNECT_PATIENCE: Duration = Duration::from_secs(60);

/// Serves the scheduler's gRPC API (the front's `Generation` service) on `listener` until
/// `shutdown` resolves. `model` is the GGUF whose tokenizer the front uses (the default model
/// when `None`).
pub async fn run(
    config: SchedulerConfig,
    model: Option<PathBuf>,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    config.validate()?;
    let (name, tokenizer, max_model_len) = tokio::task::spawn_blocking(move || {
        ferry_executor_svc::model::load_tokenizer(model.as_deref()).map_err(anyhow::Error::from)
    })
    .await??;
    let mut links = Vec::new();
    for addr in &config.executors {
        match connect_patiently(addr, &config).await {
            Ok(link) => links.push(link),
            Err(e) => tracing::error!(error = %e, "executor not connected"),
        }
    }
    let served = front::prepare::ServedModel { name, tokenizer, max_model_len };
    let front = front::GenerationService::new(served, links);
    GrpcHost::new()
        .add_service(ferry_proto::v1::generation_server::GenerationServer::new(front))
        .serve(listener, shutdown)
        .await?;
    Ok(())
}

async fn connect_patiently(
    addr: &str,
    config: &SchedulerConfig,
) -> Result<link::LinkHandle, link::LinkError> {
    let url = if addr.contains("://") { addr.to_string() } else { format!("http://{addr}") };
    let deadline = tokio::time::Instant::now() + CONNECT_PATIENCE;
    loop {
        match link::connect(&url, config, "ferry-scheduler").await {
            Ok(link) => return Ok(link),
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
            Err(e) => {
                tracing::debug!(error = %e, "executor not reachable yet, retrying");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
}
