//! `ferry-kv`: parse flags, bind, serve until SIGTERM or Ctrl-C.

use clap::Parser;
use ferry_kv_transfer_svc::KvAgentConfig;

/// Ferry's per-node KV transfer agent.
#[derive(Debug, Parser)]
#[command(name = "ferry-kv", version, about)]
struct Cli {
    /// Address for the gRPC API (port 0 picks a free port).
    #[arg(long, env = "FERRY_LISTEN", default_value = "127.0.0.1:50071")]
    listen: String,
    #[command(flatten)]
    log: ferry_runtime::logging::LogArgs,
    #[command(flatten)]
    trace: ferry_runtime::telemetry::TraceArgs,
    #[command(flatten)]
    agent: KvAgentConfig,
    #[command(flatten)]
    cluster: ferry_runtime::cluster::ClusterArgs,
    #[command(flatten)]
    tls: ferry_runtime::tls::TlsArgs,
    #[command(flatten)]
    probe: ferry_runtime::grpc::ProbeArgs,
    #[command(flatten)]
    drain: ferry_runtime::DrainArgs,
    #[command(flatten)]
    check: ferry_runtime::check::CheckArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    cli.agent.validate()?;
    cli.cluster.validate()?;
    ferry_runtime::check::shared_flags(&[("listen", &cli.listen)], &cli.log, &cli.trace)
        .map_err(anyhow::Error::msg)?;
    cli.tls.validate(&[("listen", &cli.listen)])?;
    cli.probe.validate()?;
    let drain = cli.drain.timeout().map_err(anyhow::Error::msg)?;
    if cli.check.dry_run_done("ferry-kv") {
        return Ok(());
    }
    cli.log.init().map_err(anyhow::Error::msg)?;
    let _telemetry = cli.trace.init("ferry-kv").map_err(anyhow::Error::msg)?;
    ferry_runtime::tls::start(&cli.tls)?;
    let (listener, addr) = ferry_runtime::grpc::bind(&cli.listen).await?;
    ferry_runtime::grpc::announce("ferry-kv", "grpc", addr);
    let probe = cli.probe.bind("ferry-kv").await?;
    let cluster = cli.cluster.enabled().then_some(cli.cluster);
    let stop = ferry_runtime::shutdown_signal();
    let ports = ferry_runtime::grpc::Ports { grpc: listener, probe };
    ferry_kv_transfer_svc::run(cli.agent, cluster, ports, stop, drain).await
}
