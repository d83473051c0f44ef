//! Ferry's executor service: it holds the model and the KV cache memory, applies each `Step`
//! the scheduler sends as a diff against its per-request state, runs the batch and streams the
//! sampled tokens back (DESIGN.md sections 4 and 5).
//!
//! The library is everything; `ferry-executor` only parses flags and calls [`run`], so a test
//! (or the all-in-one `serve`) can host an executor on a listener of its choosing.

pub mod bench;
pub mod config;
pub mod engine;
pub mod kernels;
pub mod model;
pub mod service;

use ferry_runtime::GrpcHost;
use tokio::net::TcpListener;

pub use config::{BackendKind, ExecutorConfig, Role};

/// Serves the executor's gRPC API on `listener` until `shutdown` resolves.
pub async fn run(
    config: ExecutorConfig,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    config.validate()?;
    let service = service::ExecutorService::new(config);
    GrpcHost::new()
        .add_service(ferry_proto::v1::executor_server::ExecutorServer::new(service))
        .serve(listener, shutdown)
        .await?;
    Ok(())
}
