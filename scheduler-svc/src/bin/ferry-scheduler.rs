//! `ferry-scheduler`: the scheduler and front (default), `serve` (the whole system in one
//! process), `bench-core` (the scheduling core's benchmark). Parse flags, build, run until
//! SIGTERM or Ctrl-C.

use clap::{Parser, Subcommand};
use ferry_executor_svc::ExecutorConfig;
use ferry_kv_transfer_svc::KvAgentConfig;
use ferry_scheduler_svc::SchedulerConfig;

/// Ferry's scheduler and OpenAI-compatible front.
#[derive(Debug, Parser)]
#[command(name = "ferry-scheduler", version, about, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
    #[command(flatten)]
    front: FrontArgs,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Address for the gRPC API (port 0 picks a free port).
    #[arg(long, env = "FERRY_LISTEN", default_value = "127.0.0.1:50051")]
    listen: String,
    /// Address for the OpenAI-compatible HTTP API (port 0 picks a free port).
    #[arg(long, env = "FERRY_HTTP_LISTEN", default_value = "127.0.0.1:8000")]
    http_listen: String,
    #[command(flatten)]
    log: ferry_runtime::logging::LogArgs,
    #[command(flatten)]
    trace: ferry_runtime::telemetry::TraceArgs,
    #[command(flatten)]
    scheduler: SchedulerConfig,
}

/// Flags of the scheduler role that `serve` takes from its executor instead.
#[derive(Debug, clap::Args)]
struct FrontArgs {
    /// GGUF model whose tokenizer the front uses; the default model if absent.
    #[arg(long, env = "FERRY_MODEL")]
    model: Option<std::path::PathBuf>,
    #[command(flatten)]
    cluster: ferry_runtime::cluster::ClusterArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The whole system in one process: front, scheduler, one executor and a KV agent.
    Serve {
        #[command(flatten)]
        run: RunArgs,
        #[command(flatten)]
        executor: ExecutorConfig,
        #[command(flatten)]
        kv_agent: KvAgentConfig,
    },
    /// A front alone: the OpenAI and gRPC APIs, sending requests to the pool's leader
    /// scheduler found through etcd, and moving streams to the next leader when one fails.
    Front {
        #[command(flatten)]
        run: RunArgs,
        #[command(flatten)]
        front: FrontArgs,
    },
    /// Benchmark the scheduling core: cost of one schedule + apply per step, per scenario.
    BenchCore(ferry_scheduler_svc::bench_core::BenchCoreArgs),
    /// Load-test an OpenAI-compatible endpoint: throughput, TTFT, TPOT, ITL, end-to-end latency.
    BenchServe(ferry_scheduler_svc::loadgen::LoadArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        None => {
            let run = cli.run;
            run.log.init().map_err(anyhow::Error::msg)?;
            let _telemetry = run.trace.init("ferry-scheduler").map_err(anyhow::Error::msg)?;
            run.scheduler.validate()?;
            let (listener, addr) = ferry_runtime::grpc::bind(&run.listen).await?;
            let (http, http_addr) = ferry_runtime::grpc::bind(&run.http_listen).await?;
            ferry_runtime::grpc::announce("ferry-scheduler", "grpc", addr);
            ferry_runtime::grpc::announce("ferry-scheduler", "http", http_addr);
            let model = cli.front.model;
            let stop = ferry_runtime::shutdown_signal();
            let cluster = cli.front.cluster.enabled().then_some(cli.front.cluster);
            ferry_scheduler_svc::run(run.scheduler, model, cluster, listener, Some(http), stop)
                .await
        }
        Some(Command::Front { run, front }) => {
            run.log.init().map_err(anyhow::Error::msg)?;
            let _telemetry = run.trace.init("ferry-front").map_err(anyhow::Error::msg)?;
            run.scheduler.validate()?;
            front.cluster.validate()?;
            let (listener, addr) = ferry_runtime::grpc::bind(&run.listen).await?;
            let (http, http_addr) = ferry_runtime::grpc::bind(&run.http_listen).await?;
            ferry_runtime::grpc::announce("ferry-scheduler", "grpc", addr);
            ferry_runtime::grpc::announce("ferry-scheduler", "http", http_addr);
            let stop = ferry_runtime::shutdown_signal();
            ferry_scheduler_svc::run_front(
                run.scheduler,
                front.model,
                front.cluster,
                listener,
                Some(http),
                stop,
            )
            .await
        }
        Some(Command::BenchCore(args)) => ferry_scheduler_svc::bench_core::run(&args),
        Some(Command::BenchServe(args)) => {
            let report = ferry_scheduler_svc::loadgen::run(args).await?;
            ferry_scheduler_svc::loadgen::print(&report);
            anyhow::ensure!(report.failed == 0, "{} requests failed", report.failed);
            Ok(())
        }
        Some(Command::Serve { run, executor, kv_agent }) => {
            run.log.init().map_err(anyhow::Error::msg)?;
            let _telemetry = run.trace.init("ferry-scheduler").map_err(anyhow::Error::msg)?;
            ferry_scheduler_svc::serve::run(
                &run.listen,
                &run.http_listen,
                run.scheduler,
                executor,
                kv_agent,
                |addrs| {
                    ferry_runtime::grpc::announce("ferry-scheduler", "grpc", addrs.grpc);
                    ferry_runtime::grpc::announce("ferry-scheduler", "http", addrs.http);
                    ferry_runtime::grpc::announce("ferry-scheduler", "executor", addrs.executor);
                    ferry_runtime::grpc::announce("ferry-scheduler", "kv", addrs.kv_agent);
                },
                ferry_runtime::shutdown_signal(),
            )
            .await
        }
    }
}
