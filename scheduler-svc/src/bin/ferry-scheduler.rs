//! `ferry-scheduler`: the scheduling role with its front (default), or `front` (a front alone).
//! Parse and resolve the flags (a bad one exits non-zero, naming it), bind, load the model's
//! header, run until SIGTERM or Ctrl-C.

use std::sync::Arc;

use clap::{Parser, Subcommand};
use ferry_model::ModelFile;
use ferry_runtime::cluster::ClusterArgs;
use ferry_scheduler_svc::config::{ExecutorListArgs, FrontArgs, SchedulerArgs};
use ferry_scheduler_svc::{Listeners, SchedulerRole};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Ferry's scheduler and OpenAI-compatible front.
#[derive(Debug, Parser)]
#[command(name = "ferry-scheduler", version, about, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    scheduler: SchedulerArgs,
    #[command(flatten)]
    listed: ExecutorListArgs,
    #[command(flatten)]
    front: FrontArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
}

/// Flags every role takes.
#[derive(Debug, clap::Args)]
struct Common {
    /// Address for the gRPC API (port 0 picks a free port).
    #[arg(long, env = "FERRY_LISTEN", default_value = "127.0.0.1:50051")]
    listen: String,
    /// Address for the OpenAI-compatible HTTP API (port 0 picks a free port).
    #[arg(long, env = "FERRY_HTTP_LISTEN", default_value = "127.0.0.1:8000")]
    http_listen: String,
    #[command(flatten)]
    host_port: ferry_runtime::grpc::HostPortArgs,
    /// GGUF model whose tokenizer the front uses (it must be the executors' model); the
    /// default model if absent. Repeat it to serve several base models: each executor is
    /// driven for the one it runs, a request's `model` picks one, the first is the default.
    #[arg(long, env = "FERRY_MODEL")]
    model: Vec<std::path::PathBuf>,
    /// The name clients give as `model` and `/v1/models` lists (vLLM's flag); default: the
    /// model file's name without `.gguf` (the default model's: `SmolLM2-135M-Instruct`). With
    /// several `--model`s, one name per model, in their order.
    #[arg(long, env = "FERRY_SERVED_MODEL_NAME")]
    served_model_name: Vec<String>,
    #[command(flatten)]
    service: ferry_runtime::ServiceFlags,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A front alone: the OpenAI and gRPC APIs, sending requests to the leader scheduler of a
    /// pool found through etcd (with several pools, the shard whose executor the router would
    /// pick among them all: cached prefix less a load term, then load), and moving streams to
    /// the next leader when one fails.
    Front {
        #[command(flatten)]
        common: Box<Common>,
        #[command(flatten)]
        front: FrontArgs,
        /// The scheduler pools (shards) whose leaders serve this front's requests, comma
        /// separated; default: every pool up in the cluster, as they come and go.
        #[arg(long, env = "FERRY_FRONT_POOLS", value_delimiter = ',')]
        pool: Vec<String>,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
    /// Decides how a bundled etcd member starts (the chart's etcd pods run it first): forms the
    /// cluster, restarts with its data, or joins a running cluster (adding itself through the
    /// membership API, replacing the member it was if its volume was lost), and writes etcd's
    /// configuration file. The member's etcd flags follow `--`.
    EtcdMember {
        #[command(flatten)]
        member: ferry_runtime::cluster::etcd_member::EtcdMemberArgs,
        #[command(flatten)]
        cluster: ClusterArgs,
        #[command(flatten)]
        log: ferry_runtime::logging::LogArgs,
        #[command(flatten)]
        check: ferry_runtime::check::CheckArgs,
    },
}

impl Common {
    /// Checks the flags `start` and `model` would use, without binding or reading anything,
    /// and returns the drain's timeout.
    fn validate(&self) -> anyhow::Result<std::time::Duration> {
        let http = self.host_port.http_listen(&self.http_listen);
        let listen = [("listen", self.listen.as_str()), ("http-listen", &http)];
        let drain = self.service.validate(&listen)?;
        for name in &self.served_model_name {
            anyhow::ensure!(
                !name.is_empty() && name.len() <= 256 && !name.contains(char::is_whitespace),
                "--served-model-name {name:?} must be 1 to 256 characters without spaces"
            );
        }
        let (names, models) = (self.served_model_name.len(), self.model.len().max(1));
        anyhow::ensure!(
            names == 0 || names == models,
            "{names} --served-model-name for {models} model(s): give one name per --model, in order"
        );
        Ok(drain)
    }

    /// Starts logging and tracing as `service`, binds both APIs and announces them.
    async fn start(
        &self,
        service: &'static str,
    ) -> anyhow::Result<(Listeners, ferry_runtime::telemetry::Telemetry)> {
        let telemetry = self.service.start(service)?;
        let (grpc, addr) = ferry_runtime::grpc::bind(&self.listen).await?;
        let (http, http_addr) =
            ferry_runtime::grpc::bind(&self.host_port.http_listen(&self.http_listen)).await?;
        ferry_runtime::grpc::announce("ferry-scheduler", "grpc", addr);
        ferry_runtime::grpc::announce("ferry-scheduler", "http", http_addr);
        let probe = self.service.probe.bind("ferry-scheduler").await?;
        Ok((Listeners { grpc, http: Some(http), probe }, telemetry))
    }

    /// Reads each model's header (fetching the default model when none is given).
    async fn models(&self) -> anyhow::Result<Vec<Arc<ModelFile>>> {
        let paths: Vec<Option<std::path::PathBuf>> = match self.model.as_slice() {
            [] => vec![None],
            given => given.iter().cloned().map(Some).collect(),
        };
        let mut models = Vec::new();
        for (i, path) in paths.into_iter().enumerate() {
            let mut model =
                tokio::task::spawn_blocking(move || ModelFile::open(path.as_deref())).await??;
            if let Some(name) = self.served_model_name.get(i) {
                model.name.clone_from(name);
            }
            models.push(Arc::new(model));
        }
        Ok(models)
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let stop = Box::pin(ferry_runtime::shutdown_signal());
    match cli.command {
        None => {
            let role = SchedulerRole {
                scheduler: cli.scheduler.resolve()?,
                front: cli.front.resolve()?,
                listed: cli.listed.resolve()?,
                cluster: {
                    cli.cluster.validate()?;
                    cli.cluster.enabled().then_some(cli.cluster)
                },
                drain: cli.common.validate()?,
            };
            if cli.common.service.check.dry_run_done("ferry-scheduler") {
                return Ok(());
            }
            let (listeners, _telemetry) = cli.common.start("ferry-scheduler").await?;
            let models = cli.common.models().await?;
            ferry_scheduler_svc::run(role, models, listeners, stop).await
        }
        Some(Command::EtcdMember { member, cluster, log, check }) => {
            cluster.validate()?;
            log.validate().map_err(anyhow::Error::msg)?;
            anyhow::ensure!(cluster.enabled(), "etcd-member needs --etcd-endpoints: the members");
            member.validate()?;
            if check.dry_run_done("ferry-scheduler etcd-member") {
                return Ok(());
            }
            log.init().map_err(anyhow::Error::msg)?;
            ferry_runtime::cluster::etcd_member::run(&member, &cluster).await?;
            Ok(())
        }
        Some(Command::Front { common, front, pool, cluster }) => {
            let settings = front.resolve()?;
            for p in &pool {
                ferry_scheduler_svc::config::check_pool(p)?;
            }
            cluster.validate()?;
            anyhow::ensure!(
                cluster.enabled(),
                "a front needs --etcd-endpoints to find its scheduler"
            );
            let drain = common.validate()?;
            if common.service.check.dry_run_done("ferry-scheduler front") {
                return Ok(());
            }
            let (listeners, _telemetry) = common.start("ferry-front").await?;
            let models = common.models().await?;
            let front = (settings, pool, cluster);
            ferry_scheduler_svc::run_front(front, models, listeners, stop, drain).await
        }
    }
}
