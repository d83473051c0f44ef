//! `ferry`: `ferry serve` runs the whole system in one process. Parse and check the flags (a bad
//! one exits non-zero, naming it), bind, read the model once, run until SIGTERM or Ctrl-C.

use std::sync::Arc;

use clap::{Parser, Subcommand};
use ferry_model::ModelFile;

/// Ferry, all in one process.
#[derive(Debug, Parser)]
#[command(name = "ferry", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The whole system in one process: front, scheduler, one executor and a KV agent (two of
    /// each with --disaggregate), with the default model (obtained when missing) unless
    /// --model names one.
    Serve(Box<ferry::ServeArgs>),
    /// Write a private CA and a certificate per role (front, scheduler, executor, kv, client;
    /// one naming every role for serve; one for etcd) for mutual TLS: `--tls-*` flags.
    Certs(ferry::certs::CertsArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let args = match cli.command {
        Command::Serve(args) => *args,
        Command::Certs(args) => {
            for path in ferry::certs::run(&args)? {
                println!("{}", path.display());
            }
            return Ok(());
        }
    };
    let config = args.resolve()?;
    if args.service.check.dry_run_done("ferry serve") {
        return Ok(());
    }
    let _telemetry = args.service.start("ferry")?;
    let (mut bound, addrs) = ferry::bind(
        &args.listen,
        &args.http_address(),
        (args.disaggregate, args.extra_model.len()),
    )
    .await?;
    for (kind, addr) in addrs.parts() {
        ferry_runtime::grpc::announce("ferry", kind, addr);
    }
    bound.set_probe(args.service.probe.bind("ferry").await?);
    let mut paths = vec![args.executor.model.clone()];
    paths.extend(args.extra_model.iter().cloned().map(Some));
    let mut models = Vec::new();
    for path in paths {
        let model = tokio::task::spawn_blocking(move || ModelFile::open(path.as_deref())).await??;
        models.push(Arc::new(model));
    }
    // Boxed: every part's state together is large for `main`'s stack frame.
    Box::pin(ferry::run(config, models, bound, Box::pin(ferry_runtime::shutdown_signal()))).await
}
