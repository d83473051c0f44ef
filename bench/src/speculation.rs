//! `ferry-bench spec`: speculative decoding on against off, in one process (the scheduling
//! core and the CPU engine driven directly, as `ferry-bench serve --in-process`), on three
//! workloads: one that repeats its input (each prompt is a passage written twice, so the
//! greedy answer goes on quoting it, as summaries and code edits quote theirs); the load
//! generator's random words, greedy (a small model's greedy answer to them often loops, which
//! drafts predict); and the same prompts sampled at temperature 1 (seeded), whose answers
//! rarely repeat, so drafts mostly fail: the cost of speculation that does not pay. Runs
//! alternate off, on, on, off per round, so drift on a shared machine falls on both; the
//! figures are medians over rounds.

use std::time::Instant;

use clap::Parser;
use ferry_proto::v1;
use ferry_sched_core::SchedulerStats;
use ferry_scheduler_svc::config::SchedulerArgs;

use crate::loadgen::{inprocess, workload, Job, LoadArgs, Rng, Span};

/// Flags of `ferry-bench spec`.
#[derive(Debug, clap::Args)]
pub struct SpecBenchArgs {
    /// Rounds of (off, on, on, off) per workload and concurrency.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Concurrencies to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub concurrency: Vec<usize>,
    /// Requests per run: this many per unit of concurrency, at least 2.
    #[arg(long, default_value_t = 2)]
    pub requests_per_slot: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 128)]
    pub output_len: u64,
    /// `--speculative-config` of the runs with speculation.
    #[arg(
        long,
        default_value = r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}"#
    )]
    pub speculative_config: String,
    /// The KV cache, as `ferry-executor` sizes it.
    #[command(flatten)]
    pub kv_cache: ferry_executor_svc::executor_config::KvCacheArgs,
    /// Workloads to run, comma-separated: repeating, plain, sampled.
    #[arg(long, value_delimiter = ',', default_value = "repeating,plain,sampled")]
    pub workloads: Vec<String>,
}

/// One run's figures.
struct Run {
    tokens_per_s: f64,
    stats: SchedulerStats,
}

/// Passages written twice: the answer continues the quotation.
fn repeating(n: usize, output_len: u64, seed: u64) -> Vec<Job> {
    let mut rng = Rng(seed);
    (0..n)
        .map(|_| {
            let sentences: Vec<String> = (0..6)
                .map(|_| {
                    let words: Vec<&str> = (0..10)
                        .map(|_| crate::loadgen::WORDS[rng.below(crate::loadgen::WORDS.len())])
                        .collect();
                    format!("{}.", words.join(" "))
                })
                .collect();
            let passage = sentences.join(" ");
            Job { prompt: format!("{passage}\n\n{passage}\n\n"), max_tokens: output_len }
        })
        .collect()
}

fn one_run(
    jobs: &[Job],
    concurrency: usize,
    args: &SpecBenchArgs,
    sampling: &v1::SamplingParams,
    speculate: bool,
) -> anyhow::Result<Run> {
    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        scheduler: SchedulerArgs,
    }
    let mut flags = vec!["x".to_string()];
    if speculate {
        flags.extend(["--speculative-config".into(), args.speculative_config.clone()]);
    }
    let settings = Flags::try_parse_from(flags)?.scheduler.resolve()?;
    let (report, stats) = inprocess::run(jobs, concurrency, &settings, &args.kv_cache, sampling)?;
    anyhow::ensure!(
        report.completed == jobs.len(),
        "{} of {} completed",
        report.completed,
        jobs.len()
    );
    Ok(Run { tokens_per_s: report.output_tokens_per_s, stats })
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        f64::midpoint(xs[n / 2 - 1], xs[n / 2])
    }
}

/// Runs the comparison and prints one line per workload and concurrency.
pub fn run(args: &SpecBenchArgs) -> anyhow::Result<()> {
    println!(
        "{:<10} {:>4} {:>12} {:>12} {:>7} {:>8} {:>12} {:>10} {:>10}",
        "workload",
        "conc",
        "off tok/s",
        "on tok/s",
        "on/off",
        "verifies",
        "accept rate",
        "acc/verify",
        "steps on/off"
    );
    for &concurrency in &args.concurrency {
        let n = (concurrency * args.requests_per_slot).max(2);
        let load = LoadArgs::parse_for_bench(n, args.output_len);
        let greedy = v1::SamplingParams::default();
        let sampled = v1::SamplingParams { temperature: 1.0, seed: Some(1), ..greedy.clone() };
        let plain = workload(&load)?;
        let workloads = [
            ("repeating", repeating(n, args.output_len, 7), &greedy),
            ("plain", plain.clone(), &greedy),
            ("sampled", plain, &sampled),
        ];
        for (name, jobs, sampling) in &workloads {
            if !args.workloads.iter().any(|w| w == name) {
                continue;
            }
            let started = Instant::now();
            let (mut off, mut on) = (Vec::new(), Vec::new());
            let mut last_on = None;
            let mut last_off = None;
            for _ in 0..args.rounds {
                for speculate in [false, true, true, false] {
                    let r = one_run(jobs, concurrency, args, sampling, speculate)?;
                    if speculate {
                        on.push(r.tokens_per_s);
                        last_on = Some(r.stats);
                    } else {
                        off.push(r.tokens_per_s);
                        last_off = Some(r.stats);
                    }
                }
            }
            let (s, o) = (last_on.expect("rounds > 0"), last_off.expect("rounds > 0"));
            let rate = s.spec_accepted_tokens as f64 / s.spec_draft_tokens.max(1) as f64;
            let per_verify = s.spec_accepted_tokens as f64 / s.spec_drafts.max(1) as f64;
            let (m_off, m_on) = (median(off), median(on));
            println!(
                "{:<10} {:>4} {:>12.1} {:>12.1} {:>7.3} {:>8} {:>12.3} {:>10.2} {:>6}/{:<6} ({:.0} s)",
                name,
                concurrency,
                m_off,
                m_on,
                m_on / m_off,
                s.spec_drafts,
                rate,
                per_verify,
                s.steps,
                o.steps,
                started.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

impl LoadArgs {
    /// The load generator's random-words workload: `requests` prompts of 130–300 words,
    /// `output_len` tokens each.
    fn parse_for_bench(requests: usize, output_len: u64) -> LoadArgs {
        #[derive(Parser)]
        struct Flags {
            #[command(flatten)]
            load: LoadArgs,
        }
        let mut flags = Flags::parse_from(["x"]);
        flags.load.requests = requests;
        flags.load.output_len = Span(output_len, output_len);
        flags.load
    }
}
