//! `ferry serve`: the whole system in one process on loopback with no etcd — the front (gRPC
//! and OpenAI HTTP) and the scheduler on the addresses the user gives, an executor and a KV
//! agent on free loopback ports. This is the embedded default the README's first command
//! starts. With `--disaggregate`, a second executor that only prefills runs beside the first,
//! each with its own KV agent: long prompts are prefilled there and their KV moved, agent to
//! agent over loopback TCP, to the first (prefill/decode disaggregation on one machine).
//!
//! The model is read once and shared: the front tokenizes with the same `ModelFile` whose
//! weights the executor loads, so the two cannot disagree (and the default model is fetched
//! once). With `--extra-model`, each further base model gets an executor and a KV agent of its
//! own, and the one front serves them all (a request's `model` picks one).

pub mod certs;

use std::net::SocketAddr;
use std::sync::Arc;

use ferry_executor_svc::{ExecutorConfig, Role};
use ferry_kv_transfer_svc::KvAgentConfig;
use ferry_model::ModelFile;
use ferry_scheduler_svc::config::{FrontArgs, FrontSettings, SchedulerArgs, SchedulerSettings};
use ferry_scheduler_svc::{Listeners, SchedulerRole};
use tokio::sync::watch;

/// The flags of `ferry serve`.
#[derive(Clone, Debug, clap::Args)]
pub struct ServeArgs {
    /// Address for the gRPC API (port 0 picks a free port).
    #[arg(long, env = "FERRY_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: String,
    /// Address for the OpenAI-compatible HTTP API (port 0 picks a free port).
    #[arg(long, env = "FERRY_HTTP_LISTEN", default_value = "127.0.0.1:8000")]
    pub http_listen: String,
    /// vLLM's `--host` and `--port` for the HTTP API.
    #[command(flatten)]
    pub host_port: ferry_runtime::grpc::HostPortArgs,
    /// How the scheduler schedules.
    #[command(flatten)]
    pub scheduler: SchedulerArgs,
    /// The front's limits.
    #[command(flatten)]
    pub front: FrontArgs,
    /// The embedded executor (its `--model` is the front's too).
    #[command(flatten)]
    pub executor: ExecutorConfig,
    /// The embedded KV agent.
    #[command(flatten)]
    pub kv_agent: KvAgentConfig,
    /// Also run a prefill-only executor with its own KV agent; the first executor decodes
    /// (prefill/decode disaggregation, for prompts of at least --disaggregation-min-tokens).
    #[arg(long, env = "FERRY_DISAGGREGATE")]
    pub disaggregate: bool,
    /// Another base model to serve beside `--model`, by an executor (and KV agent) of its own
    /// with the same flags; repeat it for more. A request's `model` picks one (its file name
    /// without `.gguf`); `--model` stays the default.
    #[arg(long, env = "FERRY_EXTRA_MODELS", value_delimiter = ',')]
    pub extra_model: Vec<std::path::PathBuf>,
    /// What every service takes: logs, traces, mutual TLS between the parts (one certificate
    /// naming every role) and TLS on the APIs (plaintext by default on loopback), the front's
    /// plaintext probe port, the drain's limit (every part's), `--check-config`.
    #[command(flatten)]
    pub service: ferry_runtime::ServiceFlags,
}

/// `ferry serve`'s flags, checked.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    scheduler: SchedulerSettings,
    front: FrontSettings,
    executor: ExecutorConfig,
    kv_agent: KvAgentConfig,
    drain: std::time::Duration,
}

impl ServeArgs {
    /// The HTTP API's address: `--http-listen` with `--host` and `--port` put in.
    pub fn http_address(&self) -> String {
        self.host_port.http_listen(&self.http_listen)
    }

    /// Checks every flag of every part; the error names the flag.
    pub fn resolve(&self) -> anyhow::Result<ServeConfig> {
        self.executor.validate()?;
        self.kv_agent.validate()?;
        let listen = [("listen", self.listen.as_str()), ("http-listen", &self.http_address())];
        let drain = self.service.validate(&listen)?;
        let mut front = self.front.resolve()?;
        // The front checks an adapter's rank against its executor's limit.
        front.lora.max_rank = self.executor.lora.max_lora_rank as usize;
        Ok(ServeConfig {
            scheduler: self.scheduler.resolve()?,
            front,
            executor: self.executor.clone(),
            kv_agent: self.kv_agent.clone(),
            drain,
        })
    }
}

/// Where each embedded part listens, once bound.
#[derive(Clone, Debug)]
pub struct ServeAddrs {
    /// The front's gRPC API.
    pub grpc: SocketAddr,
    /// The OpenAI HTTP API.
    pub http: SocketAddr,
    /// The embedded executor.
    pub executor: SocketAddr,
    /// The embedded KV agent.
    pub kv_agent: SocketAddr,
    /// With `--disaggregate`: the prefill executor and its KV agent.
    pub prefill: Option<(SocketAddr, SocketAddr)>,
    /// With `--extra-model`: each extra model's executor and KV agent.
    pub extra: Vec<(SocketAddr, SocketAddr)>,
}

impl ServeAddrs {
    /// Each part's kind and address, for the startup announcements.
    pub fn parts(&self) -> Vec<(&'static str, SocketAddr)> {
        let mut parts = vec![
            ("grpc", self.grpc),
            ("http", self.http),
            ("executor", self.executor),
            ("kv", self.kv_agent),
        ];
        if let Some((executor, kv)) = self.prefill {
            parts.extend([("prefill-executor", executor), ("prefill-kv", kv)]);
        }
        for &(executor, kv) in &self.extra {
            parts.extend([("model-executor", executor), ("model-kv", kv)]);
        }
        parts
    }
}

/// Binds every part: the front's APIs at `listen` and `http_listen`, the executors and the
/// KV agents on free loopback ports (a second pair with `disaggregate`, one more per extra
/// model).
pub async fn bind(
    listen: &str,
    http_listen: &str,
    (disaggregate, extra_models): (bool, usize),
) -> anyhow::Result<(Bound, ServeAddrs)> {
    let (grpc, grpc_addr) = ferry_runtime::grpc::bind(listen).await?;
    let (http, http_addr) = ferry_runtime::grpc::bind(http_listen).await?;
    let node = || async {
        let (executor, executor_addr) = ferry_runtime::grpc::bind("127.0.0.1:0").await?;
        let (kv_agent, kv_addr) = ferry_runtime::grpc::bind("127.0.0.1:0").await?;
        anyhow::Ok((Node { executor, kv_agent }, (executor_addr, kv_addr)))
    };
    let (main, (executor_addr, kv_addr)) = node().await?;
    let (prefill, prefill_addrs) = if disaggregate {
        let (n, a) = node().await?;
        (Some(n), Some(a))
    } else {
        (None, None)
    };
    let (mut extra, mut extra_addrs) = (Vec::new(), Vec::new());
    for _ in 0..extra_models {
        let (n, a) = node().await?;
        extra.push(n);
        extra_addrs.push(a);
    }
    let addrs = ServeAddrs {
        grpc: grpc_addr,
        http: http_addr,
        executor: executor_addr,
        kv_agent: kv_addr,
        prefill: prefill_addrs,
        extra: extra_addrs,
    };
    let front = Listeners { grpc, http: Some(http), probe: None };
    Ok((Bound { front, main, prefill, extra }, addrs))
}

/// The bound listeners of every part.
pub struct Bound {
    front: Listeners,
    main: Node,
    prefill: Option<Node>,
    extra: Vec<Node>,
}

impl Bound {
    /// The front's plaintext probe port (health and `/metrics`), when `--probe-listen` asks
    /// for one.
    pub fn set_probe(&mut self, probe: Option<tokio::net::TcpListener>) {
        self.front.probe = probe;
    }
}

/// One executor and its node's KV agent, bound.
struct Node {
    executor: tokio::net::TcpListener,
    kv_agent: tokio::net::TcpListener,
}

impl Node {
    /// Runs the executor `config` (its transfers through this node's agent) and the agent
    /// until `stop`.
    async fn run(
        self,
        mut config: ExecutorConfig,
        agent: KvAgentConfig,
        model: Arc<ModelFile>,
        (stop, drain): (watch::Receiver<bool>, std::time::Duration),
    ) -> anyhow::Result<()> {
        config.kv_agent = Some(self.kv_agent.local_addr()?.to_string());
        tokio::try_join!(
            ferry_executor_svc::run(
                config,
                Some(model),
                None,
                self.executor.into(),
                ferry_runtime::when_set(stop.clone()),
                drain,
            ),
            ferry_kv_transfer_svc::run(
                agent,
                None,
                self.kv_agent.into(),
                ferry_runtime::when_set(stop),
                drain
            ),
        )?;
        Ok(())
    }

    fn url(&self) -> anyhow::Result<String> {
        Ok(format!("http://{}", self.executor.local_addr()?))
    }
}

/// Runs every part for `models` (`--model`'s first, then each `--extra-model`'s) until
/// `shutdown` resolves; they drain together.
pub async fn run(
    config: ServeConfig,
    models: Vec<Arc<ModelFile>>,
    bound: Bound,
    shutdown: ferry_runtime::Shutdown,
) -> anyhow::Result<()> {
    let model = models.first().ok_or_else(|| anyhow::anyhow!("no model to serve"))?.clone();
    anyhow::ensure!(models.len() == bound.extra.len() + 1, "one extra node per extra model");
    let mut listed = vec![(bound.main.url()?, bound.main.url()?)];
    // The in-process scheduler and executors share a token no one else knows (or the one
    // `--leadership-token-file` gives): another process that reaches an executor's port
    // cannot open a session on it.
    let mut scheduler = config.scheduler;
    if scheduler.static_token.is_empty() {
        scheduler.static_token = ferry_runtime::secret::random().into();
    }
    let mut executor = config.executor;
    executor.leadership_token = Some(scheduler.static_token.clone());
    let prefill = match &bound.prefill {
        Some(node) => {
            listed.push((node.url()?, node.url()?));
            let mut prefill = executor.clone();
            prefill.executor_id = format!("{}-prefill", executor.executor_id);
            prefill.role = Role::Prefill;
            if executor.role == Role::Both {
                executor.role = Role::Decode;
            }
            Some(prefill)
        }
        None => None,
    };
    let drain = config.drain;
    // One stop signal fans out to every part, so they drain together.
    let (stop_tx, stop_rx) = watch::channel(false);
    let agent = config.kv_agent;
    // Each extra model: an executor with the same flags (its own id) and a KV agent of its own.
    let mut extras = tokio::task::JoinSet::new();
    for (node, model) in bound.extra.into_iter().zip(&models[1..]) {
        listed.push((node.url()?, node.url()?));
        let mut config = executor.clone();
        config.executor_id = format!("{}-{}", executor.executor_id, model.name);
        config.role = Role::Both;
        let node_id = format!("{}-{}", agent.node_id, model.name);
        let agent = KvAgentConfig { node_id, ..agent.clone() };
        extras.spawn(node.run(config, agent, model.clone(), (stop_rx.clone(), drain)));
    }
    let extras = async move {
        while let Some(done) = extras.join_next().await {
            done??;
        }
        anyhow::Ok(())
    };
    let role = SchedulerRole { scheduler, front: config.front, listed, cluster: None, drain };
    let parts = async {
        let prefill_node = async {
            match (bound.prefill, prefill) {
                (Some(node), Some(config)) => {
                    // A node of its own: its agent's metrics and spans say so.
                    let node_id = format!("{}-prefill", agent.node_id);
                    let agent = KvAgentConfig { node_id, ..agent.clone() };
                    Box::pin(node.run(config, agent, model.clone(), (stop_rx.clone(), drain))).await
                }
                _ => Ok(()),
            }
        };
        tokio::try_join!(
            bound.main.run(executor, agent.clone(), model.clone(), (stop_rx.clone(), drain)),
            prefill_node,
            extras,
            ferry_scheduler_svc::run(
                role,
                models.clone(),
                bound.front,
                ferry_runtime::when_set(stop_rx.clone())
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
