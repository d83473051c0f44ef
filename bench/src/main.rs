//! `ferry-bench`: parse flags, run one benchmark, print its figures.

use clap::{Parser, Subcommand};

/// Ferry's benchmarks.
#[derive(Debug, Parser)]
#[command(name = "ferry-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The scheduling core: cost of one schedule + apply per step, per scenario.
    Core(ferry_bench::scheduler_core::BenchCoreArgs),
    /// Load-test an OpenAI-compatible endpoint: throughput, TTFT, TPOT, ITL, end-to-end latency.
    Serve(Box<ferry_bench::loadgen::LoadArgs>),
    /// KV block transfer between agents, against plain TCP on loopback.
    Kv(ferry_bench::kv_transfer::KvBenchArgs),
    /// Speculative decoding on against off (in process, greedy), on a workload that repeats
    /// its input and one that does not.
    Spec(ferry_bench::speculation::SpecBenchArgs),
    /// The control plane's own cost: the scheduler process's CPU per streamed token and per
    /// request, over simulated executors (processes of their own).
    ControlPlane(ferry_bench::control_plane::ControlPlaneArgs),
    /// The control-plane bench's baseline server: a task per connection writing a chunk per
    /// token, nothing else (started by `control-plane`).
    #[command(hide = true)]
    WriteFloor(ferry_bench::control_plane::write_floor::WriteFloorArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Core(args) => ferry_bench::scheduler_core::run(&args),
        Command::Kv(args) => ferry_bench::kv_transfer::run(&args).await.map(|_| ()),
        Command::ControlPlane(args) => ferry_bench::control_plane::run(&args).await,
        Command::WriteFloor(args) => ferry_bench::control_plane::write_floor::serve(&args).await,
        Command::Spec(args) => {
            tokio::task::spawn_blocking(move || ferry_bench::speculation::run(&args)).await?
        }
        Command::Serve(args) => {
            let report = ferry_bench::loadgen::run(*args).await?;
            ferry_bench::loadgen::print(&report);
            anyhow::ensure!(report.failed == 0, "{} requests failed", report.failed);
            Ok(())
        }
    }
}
