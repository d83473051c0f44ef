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
    agent: KvAgentConfig,
    #[command(flatten)]
    cluster: ferry_runtime::cluster::ClusterArgs,
    #[command(flatten)]
    service: ferry_runtime::ServiceFlags,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    cli.agent.validate()?;
    cli.cluster.validate()?;
    let drain = cli.service.validate(&[("listen", &cli.listen)])?;
    if cli.service.check.dry_run_done("ferry-kv") {
        return Ok(());
    }
    let _telemetry = cli.service.start("ferry-kv")?;
    let (listener, addr) = ferry_runtime::grpc::bind(&cli.listen).await?;
    ferry_runtime::grpc::announce("ferry-kv", "grpc", addr);
    let probe = cli.service.probe.bind("ferry-kv").await?;
    let cluster = cli.cluster.enabled().then_some(cli.cluster);
    let stop = Box::pin(ferry_runtime::shutdown_signal());
    let ports = ferry_runtime::grpc::Ports { grpc: listener, probe };
    ferry_kv_transfer_svc::run(cli.agent, cluster, ports, stop, drain).await
}
