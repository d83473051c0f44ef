//! `ferry-executor`: parse flags, bind, serve until SIGTERM or Ctrl-C. Its `bench` command
//! measures the CPU forward instead (`forward_bench`; `--structured`: `structured_bench`;
//! `--kernels`: `kernel_bench`).

use clap::{Parser, Subcommand};
use ferry_executor_svc::forward::ModelFile;
use ferry_executor_svc::ExecutorConfig;
use forward_bench::BenchOptions;

mod forward_bench;
mod gpu_bench;
mod kernel_bench;
mod structured_bench;

/// Ferry's model executor.
#[derive(Debug, Parser)]
#[command(name = "ferry-executor", version, about, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Address for the gRPC API (port 0 picks a free port).
    #[arg(long, env = "FERRY_LISTEN", default_value = "127.0.0.1:50061")]
    listen: String,
    #[command(flatten)]
    executor: ExecutorConfig,
    /// Without etcd: open sessions only for a scheduler presenting the token in this file
    /// (hex, at least 16 bytes: the scheduler's `--leadership-token-file`). With etcd, each
    /// handshake's token is checked against the one its leadership published there.
    #[arg(long = "leadership-token-file", env = "FERRY_LEADERSHIP_TOKEN_FILE")]
    leadership_token_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    cluster: ferry_runtime::cluster::ClusterArgs,
    #[command(flatten)]
    service: ferry_runtime::ServiceFlags,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Benchmark the CUDA backend (a build with `--features cuda`) on a model of a real shape
    /// with random weights made on the spot: decode tokens/s per batch size and prefill
    /// tokens/s, beside the GPU's memory-bandwidth roofline (`scripts/gpu-check`).
    GpuBench(gpu_bench::GpuBenchOptions),
    /// Benchmark the CPU forward: decode tokens/s per batch size, prefill tokens/s, KV bytes.
    Bench(BenchArgs),
}

/// `ferry-executor bench`'s flags.
#[derive(Debug, clap::Args)]
struct BenchArgs {
    /// GGUF model; the default model when absent.
    #[arg(long, env = "FERRY_MODEL")]
    model: Option<std::path::PathBuf>,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,8,16,32,64")]
    batches: Vec<usize>,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Prefill repetitions (0 skips the prefill figure).
    #[arg(long, default_value_t = 3)]
    prefill_reps: usize,
    /// Prompt length of the prefill figure (attention's share grows with it).
    #[arg(long, default_value_t = 512)]
    prefill_len: usize,
    /// Context of each sequence before the timed decode steps (attention's share grows
    /// with it).
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Measure structured outputs instead: sampled decode through the engine with and
    /// without a JSON schema (rounds A B B A per batch size), the masks' time per token
    /// and how long steps waited for them.
    #[arg(long)]
    structured: bool,
    /// The KV cache's element type (f16 or f32).
    #[arg(long, default_value = "f16")]
    kv_cache_dtype: ferry_executor_svc::forward::KvDtype,
    /// Measure every scenario once per count of distinct LoRA adapters in the batch (e.g.
    /// `0,1,4,8`; random adapters of rank 16 on every projection; sequence `i` runs
    /// adapter `i % n`).
    #[arg(long, value_delimiter = ',')]
    lora_adapters: Vec<usize>,
    /// Measure the matrix products instead: each kernel this CPU runs, on the first
    /// layer's matrices and the output head, for these activation row counts.
    #[arg(long, value_delimiter = ',')]
    kernels: Option<Vec<usize>>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut cli = Cli::parse();
    if let Some(command) = cli.command.take() {
        return run_command(command).await;
    }
    cli.executor.validate_flags()?;
    if let Some(path) = &cli.leadership_token_file {
        let token = ferry_runtime::secret::read_token_file(path).map_err(anyhow::Error::msg)?;
        cli.executor.leadership_token = Some(token.into());
    }
    cli.cluster.validate()?;
    let drain = cli.service.validate(&[("listen", &cli.listen)])?;
    // Who may drive this executor: with etcd, its pool's elected leader; with a token file,
    // a scheduler that has the token; under mutual TLS, a `scheduler` certificate. With none
    // of them any scheduler that reaches it opens a session.
    let trusts_anyone = !cli.cluster.enabled()
        && cli.executor.leadership_token.is_none()
        && !cli.service.tls.mutual();
    if trusts_anyone && !ferry_runtime::tls::is_loopback(&cli.listen) {
        anyhow::bail!(
            "--listen {} is reachable from other machines, and nothing would check the \
             scheduler that drives this executor: give --etcd-endpoints (only its pool's elected \
             leader), --leadership-token-file (only a scheduler with the token) or --tls-cert, \
             --tls-key and --tls-ca (only a `scheduler` certificate)",
            cli.listen
        );
    }
    // A dry run checks the configuration, not this build: a CUDA pool's flags are checked by
    // any build (the CUDA image's executor runs them).
    let build = cli.executor.check_build();
    if cli.service.check.dry_run_done("ferry-executor") {
        if let Err(e) = build {
            eprintln!("ferry-executor: note: {e}");
        }
        return Ok(());
    }
    build?;
    let _telemetry = cli.service.start("ferry-executor")?;
    if trusts_anyone {
        tracing::warn!(
            listen = %cli.listen,
            "no etcd, no --leadership-token-file and no mutual TLS: any scheduler on this \
             machine may drive this executor"
        );
    }
    let (listener, addr) = ferry_runtime::grpc::bind(&cli.listen).await?;
    ferry_runtime::grpc::announce("ferry-executor", "grpc", addr);
    let probe = cli.service.probe.bind("ferry-executor").await?;
    // A simulated model profile reads no model file.
    let model = if cli.executor.model_profile.is_some() {
        None
    } else {
        let path = cli.executor.model.clone();
        let model = tokio::task::spawn_blocking(move || ModelFile::open(path.as_deref())).await??;
        Some(std::sync::Arc::new(model))
    };
    let cluster = cli.cluster.enabled().then_some(cli.cluster);
    ferry_executor_svc::run(
        cli.executor,
        model,
        cluster,
        ferry_runtime::grpc::Ports { grpc: listener, probe },
        Box::pin(ferry_runtime::shutdown_signal()),
        drain,
    )
    .await
}

/// Runs a subcommand (a bench) instead of the executor.
async fn run_command(command: Command) -> anyhow::Result<()> {
    match command {
        Command::GpuBench(options) => {
            tokio::task::spawn_blocking(move || gpu_bench::report(&options)).await?
        }
        Command::Bench(args) => tokio::task::spawn_blocking(move || bench(args)).await?,
    }
}

/// Runs the CPU bench `args` ask for.
fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let model = args.model.as_deref();
    if let Some(rows) = &args.kernels {
        return kernel_bench::report(model, rows);
    }
    if args.structured {
        return structured_bench::report(model, &args.batches, args.steps, args.json);
    }
    let options = BenchOptions {
        batches: args.batches,
        decode_steps: args.steps,
        prefill_reps: args.prefill_reps,
        prefill_len: args.prefill_len,
        context: args.context,
        kv_dtype: args.kv_cache_dtype,
        lora_adapters: args.lora_adapters,
    };
    forward_bench::report(model, &options, args.json)
}
