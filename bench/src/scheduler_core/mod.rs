//! `ferry-bench core`: the scheduling core's cost per step (one `schedule` plus one
//! `apply_result`), median and p99, per scenario (`scenarios`: decode populations, chunked
//! prefill mixed with decode, preemption pressure, a long waiting queue). `--json` prints an
//! array of rows (`scenario`, `running`, `waiting`, `median_us`, `p99_us`) to compare across
//! versions.
//!
//! It lives here, out of the core, because it reads the clock (`std::time::Instant`) around
//! the calls it times, and the core reads none.
//!
//! Comparing two versions: where the linker places the core's hot loops moves a scenario by
//! 2–4 % with no change to the code (the same core measured in this binary and in a two-file
//! driver), more than the runs' own spread (±0.5 % between 60 interleaved runs of one binary).
//! Build both versions with every function and branch target aligned to a cache line,
//! `RUSTFLAGS="-C llvm-args=-align-all-functions=6 -C llvm-args=-align-all-nofallthru-blocks=6"`
//! (a separate target dir each), then interleave their runs and compare medians: what is left
//! is the code's own cost.

use scenarios::{measure, scenarios};

mod scenarios;

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

/// What to run and for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchOptions {
    /// Timed iterations per scenario.
    pub iterations: usize,
    /// Untimed iterations before timing (after the population is set up).
    pub warmup: usize,
    /// Run only scenarios whose name contains this.
    pub filter: Option<String>,
    /// Small populations and few iterations: a smoke test, not a measurement.
    pub quick: bool,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions { iterations: 300, warmup: 50, filter: None, quick: false }
    }
}

/// One scenario's result.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct BenchRow {
    /// Scenario name.
    pub scenario: String,
    /// Running requests at the end.
    pub running: usize,
    /// Waiting requests at the end.
    pub waiting: usize,
    /// Median step time (schedule + apply), microseconds.
    pub median_us: f64,
    /// 99th percentile step time, microseconds.
    pub p99_us: f64,
}

/// Run the scenarios selected by `opts` and return one row each.
pub fn run_scenarios(opts: &BenchOptions) -> Vec<BenchRow> {
    let (iterations, warmup) = if opts.quick {
        (opts.iterations.min(5), opts.warmup.min(2))
    } else {
        (opts.iterations.max(1), opts.warmup)
    };
    let mut rows = Vec::new();
    for sc in scenarios(opts.quick, iterations + warmup) {
        if let Some(f) = &opts.filter {
            if !sc.name.contains(f.as_str()) {
                continue;
            }
        }
        let setup = if opts.quick { sc.setup_steps.min(40) } else { sc.setup_steps };
        let (d, mut times) = measure(&sc, setup + warmup, iterations);
        times.sort_by(f64::total_cmp);
        let stats = d.core.stats();
        rows.push(BenchRow {
            scenario: sc.name.clone(),
            running: stats.num_running,
            waiting: stats.num_waiting,
            median_us: percentile(&times, 0.5),
            p99_us: percentile(&times, 0.99),
        });
    }
    rows
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// Runs the bench and prints its rows.
pub fn run(args: &BenchCoreArgs) -> anyhow::Result<()> {
    let opts = BenchOptions {
        iterations: args.iterations,
        filter: args.filter.clone(),
        quick: args.quick,
        ..BenchOptions::default()
    };
    let rows = run_scenarios(&opts);
    if args.json {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_run_covers_every_scenario() {
        let rows = run_scenarios(&BenchOptions { quick: true, ..BenchOptions::default() });
        let names: Vec<_> = rows.iter().map(|r| r.scenario.as_str()).collect();
        assert_eq!(names, ["decode-64", "decode-256", "mixed-prefill", "preemption", "waiting-2k"]);
        assert!(rows.iter().all(|r| r.median_us >= 0.0 && r.p99_us >= r.median_us));
        assert!(rows.iter().any(|r| r.waiting > 1000), "the waiting scenario keeps a queue");
    }
}
