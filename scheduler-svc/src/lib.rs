//! Ferry's scheduler service (DESIGN.md sections 1–4): the front that speaks to clients, one
//! pure scheduling core (`ferry-sched-core`) per connected executor, and the glue that streams
//! each step to its executor.
//!
//! The library is everything; `ferry-scheduler` parses flags and calls [`run`] (the scheduler
//! role) or [`serve::run`] (the whole system in one process).

pub mod admin;
pub mod bench_core;
pub mod config;
pub mod discovery;
pub mod executors;
pub mod front;
pub mod http;
pub mod leader;
pub mod link;
pub mod loadgen;
pub mod metrics;
pub mod serve;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferry_runtime::cluster::ClusterArgs;
use ferry_runtime::GrpcHost;
use tokio::net::TcpListener;

pub use config::SchedulerConfig;
use executors::ExecutorSet;

/// Serves the scheduler's gRPC API (the front's `Generation` service) on `listener`, and the
/// OpenAI HTTP API on `http` when given, until `shutdown` resolves. `model` is the GGUF whose
/// tokenizer the front uses (the default model when `None`). With `cluster`, executors are
/// discovered through etcd as well as taken from `config.executors`.
pub async fn run(
    config: SchedulerConfig,
    model: Option<PathBuf>,
    cluster: Option<ClusterArgs>,
    listener: TcpListener,
    http: Option<TcpListener>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    config.validate()?;
    if let Some(c) = &cluster {
        c.validate()?;
    }
    let (name, tokenizer, max_model_len) = tokio::task::spawn_blocking(move || {
        ferry_executor_svc::model::load_tokenizer(model.as_deref()).map_err(anyhow::Error::from)
    })
    .await??;
    let executors = ExecutorSet::new();
    let patience = Duration::from_secs(config.executor_connect_timeout);
    for addr in &config.executors {
        let url = if addr.contains("://") { addr.to_string() } else { format!("http://{addr}") };
        let scheduler_id = config.scheduler_id();
        let fence = Fence { scheduler_id: &scheduler_id, epoch: 0, metrics: &executors.metrics };
        match connect_patiently(addr, &url, &config, fence, Some(patience)).await {
            Ok(link) => executors.insert(link),
            Err(e) => tracing::error!(error = %e, "executor not connected"),
        }
    }
    // As vLLM does, the usable length is what the smallest executor's KV cache can hold for one
    // request, so a request the front accepts always fits. (Executors discovered later refuse,
    // with a clear error, what their own cache cannot hold.)
    let cache_limit = executors
        .alive()
        .iter()
        .map(|l| {
            (l.info.num_blocks as usize * l.info.block_size as usize)
                .min(l.info.max_model_len as usize)
        })
        .min();
    let max_model_len = cache_limit.map_or(max_model_len, |c| c.min(max_model_len));
    let served = front::prepare::ServedModel { name, tokenizer, max_model_len };
    // Statically listed executors never come back once lost; discovered ones may.
    let failover_wait = match &cluster {
        Some(_) => Duration::from_secs(config.failover_timeout),
        None => Duration::ZERO,
    };
    // Executors listed by hand are reconnected when they come back after a failure.
    let reconnect = (!config.executors.is_empty()).then(|| {
        let (addrs, set) = (config.executors.clone(), executors.clone());
        tokio::spawn(discovery::run_static(addrs, config.clone(), set, config.scheduler_id()))
    });
    // With etcd, executors are driven only while this scheduler leads its pool.
    let (leading_tx, leading) = tokio::sync::watch::channel(None);
    let leading = cluster.is_some().then_some(leading);
    let (resign_tx, resign_rx) = tokio::sync::watch::channel(false);
    let discovery = match cluster {
        Some(c) => {
            let candidate = leader::Candidate {
                pool: config.pool.clone(),
                scheduler_id: config.scheduler_id(),
                address: c.advertised(listener.local_addr()?),
            };
            let set = executors.clone();
            let config = config.clone();
            Some(tokio::spawn(leader::run(c, candidate, config, set, leading_tx, resign_rx)))
        }
        None => None,
    };
    let front = front::GenerationService::new(
        served,
        front::Route::Local(executors.clone()),
        config.max_queued_requests as usize,
        failover_wait,
    );
    // Drain: a leader first resigns, handing its requests over (the fronts move their streams
    // to the next leader); then the APIs stop and finish what they still serve.
    let mut leader_task = discovery;
    let shutdown = async {
        shutdown.await;
        let _ = resign_tx.send(true);
        if let Some(task) = leader_task.as_mut() {
            let _ = tokio::time::timeout(Duration::from_secs(3), task).await;
        }
    };
    let metrics = Arc::new(front.metrics_view(leading));
    let admin = admin::AdminService::new(executors);
    serve_api(front, metrics, Some(admin), listener, http, shutdown).await?;
    if let Some(task) = leader_task {
        task.abort();
    }
    if let Some(task) = reconnect {
        task.abort();
    }
    Ok(())
}

/// A front in its own process: the OpenAI HTTP and `Generation` gRPC APIs, sending every
/// request to the leader scheduler of `config.pool` (found through etcd) and moving streams to
/// the next leader when one fails.
pub async fn run_front(
    config: SchedulerConfig,
    model: Option<PathBuf>,
    cluster: ClusterArgs,
    listener: TcpListener,
    http: Option<TcpListener>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    config.validate()?;
    cluster.validate()?;
    anyhow::ensure!(cluster.enabled(), "a front needs --etcd-endpoints to find its scheduler");
    let (name, tokenizer, max_model_len) = tokio::task::spawn_blocking(move || {
        ferry_executor_svc::model::load_tokenizer(model.as_deref()).map_err(anyhow::Error::from)
    })
    .await??;
    let served = front::prepare::ServedModel { name, tokenizer, max_model_len };
    let leader = front::remote::Leader::follow(cluster, config.pool.clone());
    let front = front::GenerationService::new(
        served,
        front::Route::Remote(leader),
        config.max_queued_requests as usize,
        Duration::from_secs(config.failover_timeout),
    );
    let metrics = Arc::new(front.metrics_view(None));
    serve_api(front, metrics, None, listener, http, shutdown).await
}

/// Serves `front` over gRPC on `listener` and HTTP on `http` until `shutdown`, then drains.
async fn serve_api(
    front: front::GenerationService,
    metrics: Arc<dyn ferry_runtime::metrics::Render>,
    admin: Option<admin::AdminService>,
    listener: TcpListener,
    http: Option<TcpListener>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    let http_task =
        http.map(|l| tokio::spawn(http::serve(front.clone(), metrics.clone(), l, stopped())));
    let mut host = GrpcHost::new()
        .add_service(ferry_proto::v1::generation_server::GenerationServer::new(front))
        .with_metrics(metrics);
    if let Some(admin) = admin {
        host = host.add_service(ferry_proto::v1::admin_server::AdminServer::new(admin));
    }
    let grpc = host.serve(listener, stopped());
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

/// Who opens an executor session, under which leadership epoch, counting into `metrics`.
#[derive(Clone, Copy)]
pub(crate) struct Fence<'a> {
    pub scheduler_id: &'a str,
    pub epoch: u64,
    pub metrics: &'a std::sync::Arc<metrics::SchedulerMetrics>,
}

/// Connects to executor `name` at `url`, retrying (it may still be loading its model) until
/// `patience` runs out, or forever when `None`.
pub(crate) async fn connect_patiently(
    name: &str,
    url: &str,
    config: &SchedulerConfig,
    fence: Fence<'_>,
    patience: Option<Duration>,
) -> Result<link::LinkHandle, link::LinkError> {
    let deadline = patience.map(|p| tokio::time::Instant::now() + p);
    let mut delay = Duration::from_millis(100);
    loop {
        let metrics = fence.metrics.clone();
        match link::connect(name, url, config, fence.scheduler_id, fence.epoch, metrics).await {
            Ok(link) => return Ok(link),
            Err(e) if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) => return Err(e),
            Err(e) => {
                tracing::debug!(error = %e, "executor not reachable yet, retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
        }
    }
}
