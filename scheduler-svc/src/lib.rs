//! Ferry's scheduler service (DESIGN.md sections 1–4): the front that speaks to clients, one
//! pure scheduling core (`ferry-sched-core`) per connected executor, and the glue that streams
//! each step to its executor.
//!
//! The library is everything; `ferry-scheduler` parses flags, resolves them ([`config`]) and
//! calls [`run`] (the scheduling role, with its own front) or [`run_front`] (a front alone);
//! `ferry serve` calls [`run`] beside an executor in the same process.
//!
//! Following a request by file: `http/` (OpenAI JSON) → `front/` (prepare, place, stream) →
//! `link/` (the step loop that owns an executor's core, and the wire forms) → the executor →
//! back through `link/step_loop.rs` to `front/stream.rs`.

pub mod admin;
pub mod config;
pub mod discovery;
pub mod executors;
pub mod fence;
pub mod front;
pub mod http;
pub mod leader;
pub mod link;
pub mod metrics;
pub mod request;
pub mod standby;
pub mod tier;

use std::sync::Arc;
use std::time::Duration;

use ferry_model::ModelFile;
use ferry_runtime::cluster::ClusterArgs;
use ferry_runtime::GrpcHost;
use tokio::net::TcpListener;

use executors::ExecutorSet;
use front::models::Models;
use front::FrontSettings;
use link::{SchedulerSettings, SessionOpener};

/// What the scheduling role runs with, checked at start-up.
#[derive(Clone, Debug)]
pub struct SchedulerRole {
    /// How it schedules and who it is.
    pub scheduler: SchedulerSettings,
    /// Its front's limits.
    pub front: FrontSettings,
    /// Executors listed by hand, as `(name, url)`.
    pub listed: Vec<(String, String)>,
    /// etcd, for discovery and leadership (validated); `None` for a static set-up.
    pub cluster: Option<ClusterArgs>,
    /// How long the drain may take (`--drain-timeout`).
    pub drain: Duration,
}

/// Where a service listens.
pub struct Listeners {
    /// The gRPC API (and `/metrics`).
    pub grpc: TcpListener,
    /// The OpenAI HTTP API, when served.
    pub http: Option<TcpListener>,
    /// The plaintext probe port (health and `/metrics`), when asked for.
    pub probe: Option<TcpListener>,
}

/// Serves the scheduling role for `models` (the first is the default) — its front's gRPC API
/// on `listeners.grpc` and the OpenAI HTTP API on `listeners.http` — until `shutdown`
/// resolves, driving the executors it lists, and with etcd those it discovers while it leads
/// its pool, each for the model it runs.
pub async fn run(
    role: SchedulerRole,
    models: Vec<Arc<ModelFile>>,
    listeners: Listeners,
    shutdown: ferry_runtime::Shutdown,
) -> anyhow::Result<()> {
    let executors = ExecutorSet::new();
    let opener = SessionOpener {
        settings: Arc::new(role.scheduler.clone()),
        models: models.iter().map(|m| link::OpenerModel::of(m)).collect(),
        epoch: 0,
        token: role.scheduler.static_token.clone(),
        metrics: executors.metrics.clone(),
        tier: executors.tier.clone(),
        fence: executors.fence.clone(),
        dp_groups: Arc::new(link::dp_group::DpGroups::new(role.scheduler.prefill_throttle)),
    };
    for (name, url) in &role.listed {
        match opener.open_patiently(name, url).await {
            Ok(link) => executors.insert(link),
            Err(e) => tracing::error!(error = %e, "executor not connected"),
        }
    }
    // As vLLM does, a model's usable length is what the smallest KV cache of its executors can
    // hold for one request, so a request the front accepts always fits. (Executors discovered
    // later refuse, with a clear error, what their own cache cannot hold.)
    let usable = |model: &ModelFile| {
        let cache_limit = executors
            .serving(&model.fingerprint)
            .iter()
            .map(|l| {
                (l.info.num_blocks as usize * l.info.block_size as usize)
                    .min(l.info.max_model_len as usize)
            })
            .min();
        let model_len = model.shape.max_model_len;
        let usable = cache_limit.map_or(model_len, |c| c.min(model_len));
        role.front.max_model_len.map_or(usable, |cap| cap.min(usable))
    };
    let served = models.iter().map(|m| (m.clone(), usable(m))).collect();
    let served = Models::new(served, &role.front.lora)?;
    // Statically listed executors never come back once lost; discovered ones may.
    let mut front_settings = match &role.cluster {
        Some(_) => role.front,
        None => FrontSettings { failover_wait: Duration::ZERO, ..role.front },
    };
    // This process schedules what its front admits: a priority means something only if it
    // orders by priority.
    front_settings.accepts_priority = role.scheduler.orders_by_priority();
    // Executors listed by hand are reconnected when they come back after a failure.
    let reconnect = (!role.listed.is_empty()).then(|| {
        let (listed, set) = (role.listed.clone(), executors.clone());
        tokio::spawn(discovery::run_static(listed, opener.clone(), set))
    });
    // With etcd, executors are driven only while this scheduler leads its pool.
    let (leading_tx, leading) = tokio::sync::watch::channel(None);
    let standing = role.cluster.as_ref().map(|c| {
        let pool = role.scheduler.pool.clone();
        Arc::new(standby::Standing::follow(c.clone(), pool, leading.clone()))
    });
    let leading = role.cluster.is_some().then_some(leading);
    let (resign_tx, resign_rx) = tokio::sync::watch::channel(false);
    let mut leader_task = match role.cluster {
        Some(c) => {
            let candidate = leader::Candidate {
                pool: role.scheduler.pool.clone(),
                scheduler_id: role.scheduler.scheduler_id.clone(),
                address: c.advertised(listeners.grpc.local_addr()?),
            };
            let set = executors.clone();
            Some(tokio::spawn(leader::run(c, candidate, opener, set, leading_tx, resign_rx)))
        }
        None => None,
    };
    let front = front::GenerationService::new(
        served,
        front::Route::Local(executors.clone()),
        front_settings,
    );
    if let Some(standing) = &standing {
        front.stand_by(standing.clone());
    }
    // The drain's hand-over: a leader resigns, handing its requests over (the fronts move
    // their streams to the next leader).
    let hand_over = async {
        let _ = resign_tx.send(true);
        if let Some(task) = leader_task.as_mut() {
            let _ = task.await;
        }
    };
    let metrics = Arc::new(front.metrics_view(leading));
    let admin = admin::AdminService::new(executors, standing);
    let stop = Stop { signal: shutdown, hand_over, drain: role.drain };
    serve_api(front, metrics, admin, listeners, stop).await?;
    if let Some(task) = leader_task {
        task.abort();
    }
    if let Some(task) = reconnect {
        task.abort();
    }
    Ok(())
}

/// A front in its own process for `models` (the first is the default): the OpenAI HTTP and
/// `Generation` gRPC APIs, sending every request to the leader scheduler of one of `pools`
/// (every pool up when empty; found through etcd; [`front::shards`] chooses among those that
/// serve its model) and moving streams to the next leader when one fails.
pub async fn run_front(
    (settings, pools, cluster): (FrontSettings, Vec<String>, ClusterArgs),
    models: Vec<Arc<ModelFile>>,
    listeners: Listeners,
    shutdown: ferry_runtime::Shutdown,
    drain: Duration,
) -> anyhow::Result<()> {
    let served = models.into_iter().map(|m| {
        let len =
            settings.max_model_len.map_or(m.shape.max_model_len, |c| c.min(m.shape.max_model_len));
        (m, len)
    });
    let served = Models::new(served.collect(), &settings.lora)?;
    let shards = front::shards::Shards::follow(cluster, pools);
    let admin = admin::FrontAdmin::new(shards.clone());
    let front = front::GenerationService::new(served, front::Route::Remote(shards), settings);
    let metrics = Arc::new(front.metrics_view(None));
    let stop = Stop { signal: shutdown, hand_over: async {}, drain };
    serve_api(front, metrics, admin, listeners, stop).await
}

/// With API keys, every call on the client gRPC port needs one — the Admin API and reflection
/// too — but `Generation` (which identifies its caller itself, and charges the key) and health
/// (for probes); `/metrics` needs one only with `--api-key-guards-health-and-metrics`, as on the
/// HTTP port.
fn key_gate(front: &front::GenerationService) -> ferry_runtime::call_gate::CallGate {
    use ferry_runtime::call_gate::{CallGate, Check};
    let Some(keys) = front.keys().cloned() else { return CallGate::default() };
    let mut open = vec!["/ferry.v1.Generation/", "/grpc.health.v1.Health/"];
    if !keys.guard_health_and_metrics {
        open.push("/metrics");
    }
    let check: Check = Arc::new(move |headers| keys.identify_headers(headers).map(drop));
    CallGate::new(check, open)
}

/// How the APIs stop: on `signal` they drain (runtime's `shutdown` module): health says
/// `NOT_SERVING` (gRPC) and `/health` 503 "draining", then `hand_over` runs, then the APIs stop
/// accepting and finish what they serve — all within `drain`.
struct Stop<S, H> {
    signal: S,
    hand_over: H,
    drain: Duration,
}

/// Serves `front` over gRPC on `listener` and HTTP on `http` until `stop.signal`, then drains.
async fn serve_api(
    front: front::GenerationService,
    metrics: Arc<dyn ferry_runtime::prometheus::Render>,
    admin: impl ferry_proto::v1::admin_server::Admin,
    listeners: Listeners,
    stop: Stop<impl std::future::Future<Output = ()> + Send, impl std::future::Future<Output = ()>>,
) -> anyhow::Result<()> {
    let Listeners { grpc, http, probe } = listeners;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move || ferry_runtime::when_set(stop_rx.clone());
    let mut http_task =
        http.map(|l| tokio::spawn(http::serve(front.clone(), metrics.clone(), l, stopped())));
    let host = GrpcHost::new()
        .callers(ferry_runtime::tls::API_CALLERS)
        .add_service(
            ferry_proto::v1::generation_server::GenerationServer::new(front.clone())
                .max_decoding_message_size(front.limits().max_request_bytes),
        )
        .with_metrics(metrics)
        .add_service(ferry_proto::v1::admin_server::AdminServer::new(admin))
        .gate(key_gate(&front));
    let health = host.health_switch();
    let grpc = host.serve(ferry_runtime::grpc::Ports { grpc, probe }, stopped());
    tokio::pin!(grpc);
    let Stop { signal, hand_over, drain } = stop;
    tokio::select! {
        result = &mut grpc => return Ok(result?),
        () = signal => {}
    }
    let mut served = Ok(());
    ferry_runtime::bounded_drain(drain, async {
        front.begin_drain();
        health.not_serving().await;
        hand_over.await;
        let _ = stop_tx.send(true);
        served = grpc.await;
        if let Some(task) = http_task.as_mut() {
            if let Ok(Err(e)) = task.await {
                tracing::warn!(error = %e, "HTTP API");
            }
        }
    })
    .await;
    if let Some(task) = http_task {
        task.abort();
    }
    Ok(served?)
}
