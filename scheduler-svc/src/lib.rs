//! Ferry's scheduler service (DESIGN.md sections 1–4): the front that speaks to clients, one
//! pure scheduling core (`ferry-sched-core`) per connected executor, and the glue that streams
//! each step to its executor.
//!
//! The library is everything; `ferry-scheduler` parses flags and calls [`run`] (the scheduler
//! role) or [`serve::run`] (the whole system in one process).

pub mod bench_core;
pub mod config;
pub mod front;
pub mod http;
pub mod link;
pub mod loadgen;
pub mod serve;

use std::path::PathBuf;
use std::time::Duration;

use ferry_runtime::GrpcHost;
use tokio::net::TcpListener;

pub use config::SchedulerConfig;

/// Serves the scheduler's gRPC API (the front's `Generation` service) on `listener`, and the
/// OpenAI HTTP API on `http` when given, until `shutdown` resolves. `model` is the GGUF whose
/// tokenizer the front uses (the default model when `None`).
pub async fn run(
    config: SchedulerConfig,
    model: Option<PathBuf>,
    listener: TcpListener,
    http: Option<TcpListener>,
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
    // As vLLM does, the usable length is what the smallest executor's KV cache can hold for one
    // request, so a request the front accepts always fits.
    let cache_limit = links
        .iter()
        .map(|l| {
            (l.info.num_blocks as usize * l.info.block_size as usize)
                .min(l.info.max_model_len as usize)
        })
        .min();
    let max_model_len = cache_limit.map_or(max_model_len, |c| c.min(max_model_len));
    let served = front::prepare::ServedModel { name, tokenizer, max_model_len };
    let front = front::GenerationService::new(served, links, config.max_queued_requests as usize);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    let http_task = http.map(|l| tokio::spawn(http::serve(front.clone(), l, stopped())));
    let grpc = GrpcHost::new()
        .add_service(ferry_proto::v1::generation_server::GenerationServer::new(front))
        .serve(listener, stopped());
    tokio::pin!(grpc);
    tokio::select! {
        result = &mut grpc => result?,
        () = shutdown => {
            let _ = stop_tx.send(true);
            grpc.await?;
        }
    }
    let _ = stop_tx.send(true);
    if let Some(task) = http_task {
        task.await??;
    }
    Ok(())
}

async fn connect_patiently(
    addr: &str,
    config: &SchedulerConfig,
) -> Result<link::LinkHandle, link::LinkError> {
    let url = if addr.contains("://") { addr.to_string() } else { format!("http://{addr}") };
    // Executors may still be loading their model: keep trying for a while.
    let deadline =
        tokio::time::Instant::now() + Duration::from_secs(config.executor_connect_timeout);
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
