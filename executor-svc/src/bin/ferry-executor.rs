//! `ferry-executor`: parse flags, bind, serve until SIGTERM or Ctrl-C.

use clap::{Parser, Subcommand};
use ferry_executor_svc::bench::{self, BenchOptions};
use ferry_executor_svc::model::{LoadedModel, ModelFile};
use ferry_executor_svc::ExecutorConfig;

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
    log: ferry_runtime::logging::LogArgs,
    #[command(flatten)]
    trace: ferry_runtime::telemetry::TraceArgs,
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
    tls: ferry_runtime::tls::TlsArgs,
    #[command(flatten)]
    probe: ferry_runtime::grpc::ProbeArgs,
    #[command(flatten)]
    drain: ferry_runtime::DrainArgs,
    #[command(flatten)]
    check: ferry_runtime::check::CheckArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Benchmark the CPU forward: decode tokens/s per batch size, prefill tokens/s, KV bytes.
    Bench {
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
        kv_cache_dtype: ferry_executor_svc::model::KvDtype,
        /// Measure the matrix products instead: each kernel this CPU runs, on the first
        /// layer's matrices and the output head, for these activation row counts.
        #[arg(long, value_delimiter = ',')]
        kernels: Option<Vec<usize>>,
    },
}

fn run_kernel_bench(model: Option<&std::path::Path>, rows: &[usize]) -> anyhow::Result<()> {
    let model = LoadedModel::open(model)?;
    let weights = &model.weights;
    println!(
        "{:<24} {:>5} {:>8} {:>9} {:>11}",
        "weight", "rows", "kernel", "GFLOP/s", "weight GB/s"
    );
    bench::run_kernels(weights, rows, |r| {
        println!(
            "{:<24} {:>5} {:>8} {:>9.1} {:>11.1}",
            r.weight, r.rows, r.kernel, r.gflops, r.weight_gbs
        );
    });
    Ok(())
}

fn run_bench(
    model: Option<&std::path::Path>,
    opts: &BenchOptions,
    json: bool,
) -> anyhow::Result<()> {
    let model = LoadedModel::open(model)?;
    let kv_bytes = ferry_executor_svc::model::PagedKvCache::bytes_per_token(
        &model.weights.shape,
        opts.kv_dtype,
    );
    let cpu = bench::cpu_summary();
    if !json {
        println!("{cpu}");
        println!(
            "model {} ({}); KV cache {} {kv_bytes} bytes per cached token",
            model.file.name,
            model.file.path.display(),
            opts.kv_dtype.name()
        );
        println!(
            "{:<28} {:>6} {:>10} {:>9} | share of step time: {:>6} {:>6} {:>6} {:>6} {:>6}",
            "scenario",
            "batch",
            "tokens/s",
            "step ms",
            "matmul",
            "attn",
            "other",
            "sample",
            "sched"
        );
    }
    let rows = bench::run(&model.weights, opts, |r| {
        if !json {
            let pct = |f: f64| format!("{:.1}%", 100.0 * f);
            let s = &r.shares;
            println!(
                "{:<28} {:>6} {:>10.1} {:>9.2} |                     {:>6} {:>6} {:>6} {:>6} {:>6}",
                r.scenario,
                r.batch,
                r.tokens_per_s,
                r.median_step_ms,
                pct(s.matmul),
                pct(s.attention),
                pct(s.other),
                pct(s.sampling),
                pct(s.scheduling)
            );
        }
    });
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({ "cpu": cpu, "kv_bytes_per_token": kv_bytes, "rows": rows })
            )?
        );
    }
    Ok(())
}

fn run_structured_bench(
    model: Option<&std::path::Path>,
    batches: &[usize],
    steps: usize,
    json: bool,
) -> anyhow::Result<()> {
    let model = LoadedModel::open(model)?;
    if !json {
        println!("model {}; sampled decode, {steps} steps per round", model.file.name);
        println!(
            "{:>6} {:>12} {:>12} {:>18} {:>18}",
            "batch", "grammar", "tokens/s", "mask us/token", "wait us/step"
        );
    }
    let rows = bench::run_structured(model, batches, steps, |r| {
        if !json {
            println!(
                "{:>6} {:>12} {:>12.1} {:>18.1} {:>18.1}",
                r.batch,
                if r.constrained { "json_schema" } else { "none" },
                r.tokens_per_s,
                r.mask_us_per_token,
                r.wait_us_per_step
            );
        }
    })?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut cli = Cli::parse();
    if let Some(Command::Bench {
        model,
        batches,
        steps,
        prefill_reps,
        prefill_len,
        context,
        json,
        structured,
        kernels,
        kv_cache_dtype,
    }) = cli.command
    {
        if let Some(rows) = kernels {
            return tokio::task::spawn_blocking(move || run_kernel_bench(model.as_deref(), &rows))
                .await?;
        }
        if structured {
            return tokio::task::spawn_blocking(move || {
                run_structured_bench(model.as_deref(), &batches, steps, json)
            })
            .await?;
        }
        return tokio::task::spawn_blocking(move || {
            run_bench(
                model.as_deref(),
                &BenchOptions {
                    batches,
                    decode_steps: steps,
                    prefill_reps,
                    prefill_len,
                    context,
                    kv_dtype: kv_cache_dtype,
                },
                json,
            )
        })
        .await?;
    }
    cli.executor.validate_flags()?;
    if let Some(path) = &cli.leadership_token_file {
        let token = ferry_runtime::secret::read_token_file(path).map_err(anyhow::Error::msg)?;
        cli.executor.leadership_token = Some(token.into());
    }
    cli.cluster.validate()?;
    ferry_runtime::check::shared_flags(&[("listen", &cli.listen)], &cli.log, &cli.trace)
        .map_err(anyhow::Error::msg)?;
    cli.tls.validate(&[("listen", &cli.listen)])?;
    cli.probe.validate()?;
    let drain = cli.drain.timeout().map_err(anyhow::Error::msg)?;
    // A dry run checks the configuration, not this build: a CUDA pool's flags are checked by
    // any build (the CUDA image's executor runs them).
    let build = cli.executor.check_build();
    if cli.check.dry_run_done("ferry-executor") {
        if let Err(e) = build {
            eprintln!("ferry-executor: note: {e}");
        }
        return Ok(());
    }
    build?;
    cli.log.init().map_err(anyhow::Error::msg)?;
    let _telemetry = cli.trace.init("ferry-executor").map_err(anyhow::Error::msg)?;
    ferry_runtime::tls::start(&cli.tls)?;
    let (listener, addr) = ferry_runtime::grpc::bind(&cli.listen).await?;
    ferry_runtime::grpc::announce("ferry-executor", "grpc", addr);
    let probe = cli.probe.bind("ferry-executor").await?;
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
        ferry_runtime::shutdown_signal(),
        drain,
    )
    .await
}
