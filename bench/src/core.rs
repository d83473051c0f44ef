//! `ferry-bench core`: the scheduling core's cost per step (one `schedule` plus one
//! `apply_result`), median and p99, per scenario. `--json` prints an array of rows
//! (`scenario`, `running`, `waiting`, `median_us`, `p99_us`) to compare across versions.

use ferry_sched_core::bench::{self, BenchOptions};

/// Flags of `ferry-bench core`.
#[derive(Debug, clap::Args)]
pub struct BenchCoreArgs {
    /// Print JSON rows instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Small populations and few iterations: a smoke test, not a measurement.
    #[arg(long)]
    pub quick: bool,
    /// Run only scenarios whose name contains this.
    #[arg(long)]
    pub filter: Option<String>,
    /// Timed iterations per scenario.
    #[arg(long, default_value_t = 300)]
    pub iterations: usize,
}

#[derive(serde::Serialize)]
struct Row<'a> {
    scenario: &'a str,
    running: usize,
    waiting: usize,
    median_us: f64,
    p99_us: f64,
}

/// Runs the bench and prints its rows.
pub fn run(args: &BenchCoreArgs) -> anyhow::Result<()> {
    let opts = BenchOptions {
        iterations: args.iterations,
        filter: args.filter.clone(),
        quick: args.quick,
        ..BenchOptions::default()
    };
    let rows = bench::run(&opts);
    if args.json {
        let rows: Vec<Row> = rows
            .iter()
            .map(|r| Row {
                scenario: &r.scenario,
                running: r.running,
                waiting: r.waiting,
                median_us: r.median_us,
                p99_us: r.p99_us,
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        // The last column shows whether a step's cost grows linearly with the running requests.
        println!(
            "{:<16} {:>8} {:>8} {:>12} {:>12} {:>18}",
            "scenario", "running", "waiting", "median_us", "p99_us", "median_ns/running"
        );
        for r in &rows {
            let per_running = r.median_us * 1e3 / r.running.max(1) as f64;
            println!(
                "{:<16} {:>8} {:>8} {:>12.1} {:>12.1} {:>18.1}",
                r.scenario, r.running, r.waiting, r.median_us, r.p99_us, per_running
            );
        }
    }
    Ok(())
}
