//! `ferry-executor`: parse flags, bind, serve until SIGTERM or Ctrl-C.

use clap::Parser;
use ferry_executor_svc::ExecutorConfig;

/// Ferry's model executor.
#[derive(Debug, Parser)]
#[command(name = "ferry-executor", version, about)]
struct Cli {
    /// Address for the gRPC API (port 0 picks a free port).
    #[arg(long, env = "FERRY_LISTEN", default_value = "127.0.0.1:50061")]
    listen: String,
    /// Log filter (RUST_LOG syntax).
    #[arg(long, env = "FERRY_LOG", default_value = "info")]
    log: String,
    #[command(flatten)]
    executor: ExecutorConfig,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    ferry_runtime::logging::init(&cli.log).map_err(anyhow::Error::msg)?;
    cli.executor.validate()?;
    let (listener, addr) = ferry_runtime::grpc::bind(&cli.listen).await?;
    ferry_runtime::grpc::announce("ferry-executor", "grpc", addr);
    ferry_executor_svc::run(cli.executor, listener, ferry_runtime::shutdown_signal()).await
}
