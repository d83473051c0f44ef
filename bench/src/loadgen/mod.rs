//! `ferry-bench serve`: a load generator for any OpenAI-compatible endpoint (Ferry,
//! vLLM, llama.cpp's server). N streaming completion requests at a fixed concurrency, or
//! arriving as a Poisson process, with prompt and output lengths drawn from ranges or read from
//! a JSONL dataset. Reports throughput, time to first token, time per output token,
//! inter-token latency and end-to-end latency (median, p90, p99), with a progress bar, and
//! writes the figures as JSON.

mod client;
pub mod inprocess;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

pub use client::{stream_completion, Observed};

/// An inclusive range `MIN:MAX` (or a single value).
#[derive(Clone, Copy, Debug)]
pub struct Span(pub u64, pub u64);

impl std::str::FromStr for Span {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let parse = |x: &str| x.trim().parse::<u64>().map_err(|e| format!("{x:?}: {e}"));
        let span = match s.split_once(':') {
            Some((a, b)) => Span(parse(a)?, parse(b)?),
            None => Span(parse(s)?, parse(s)?),
        };
        if span.0 > span.1 || span.1 == 0 {
            return Err(format!("{s:?} is not MIN:MAX with 0 < MAX and MIN <= MAX"));
        }
        Ok(span)
    }
}

/// Flags of `ferry-bench serve`.
#[derive(Debug, clap::Args)]
pub struct LoadArgs {
    /// Server address, HOST:PORT.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub target: String,
    /// HTTPS: the CA (PEM) the server's certificate chains to (`ferry certs`' `ca.pem`).
    #[arg(long)]
    pub tls_ca: Option<std::path::PathBuf>,
    /// Keep connections open between requests (HTTP/1.1 keep-alive, as one application's
    /// pooled client does); without it, each request opens its own connection.
    #[arg(long)]
    pub keep_alive: bool,
    /// Model name to send (empty: the server's default).
    #[arg(long, default_value = "")]
    pub model: String,
    /// Requests to send.
    #[arg(long, default_value_t = 32)]
    pub requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Poisson arrival rate (requests/s); without it requests start as slots free up.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Prompt length in common English words (about one token each), MIN:MAX.
    #[arg(long, default_value = "130:300")]
    pub prompt_len: Span,
    /// Output tokens per request (sent as `max_tokens` with `ignore_eos`), MIN:MAX.
    #[arg(long, default_value = "128")]
    pub output_len: Span,
    /// JSONL dataset of {"prompt": ..., "`max_tokens"`: ...} lines instead of generated prompts.
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Seed of the generated workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Instead of a server, drive the scheduling core and the CPU engine directly in this
    /// process (the baseline for the service path's cost); greedy, default model.
    #[arg(long)]
    pub in_process: bool,
    /// With --in-process: the KV cache, as `ferry-executor` sizes it.
    #[command(flatten)]
    pub kv_cache: ferry_executor_svc::executor_config::KvCacheArgs,
    /// With --in-process: the scheduling flags, as `ferry-scheduler` takes them.
    #[command(flatten)]
    pub scheduler: ferry_scheduler_svc::config::SchedulerArgs,
}

/// One request of the workload.
#[derive(Clone, Debug)]
pub struct Job {
    pub(crate) prompt: String,
    pub(crate) max_tokens: u64,
}

/// splitmix64: a small seeded generator, so a workload (or a chaos soak) is reproducible.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn bits(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn in_span(&mut self, s: Span) -> u64 {
        s.0 + self.bits() % (s.1 - s.0 + 1)
    }
    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.bits() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.bits() % n as u64) as usize
    }
    /// Exponentially distributed with mean `mean` seconds (Poisson arrivals' gaps).
    pub fn exp(&mut self, mean: f64) -> std::time::Duration {
        std::time::Duration::from_secs_f64(-mean * (1.0 - self.unit()).ln())
    }
}

pub(crate) const WORDS: &[&str] = &[
    "the",
    "time",
    "people",
    "year",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "name",
    "team",
];

pub(crate) fn workload(args: &LoadArgs) -> anyhow::Result<Vec<Job>> {
    if let Some(path) = &args.dataset {
        let text = std::fs::read_to_string(path)?;
        let mut jobs = Vec::new();
        for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
            let v: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), i + 1))?;
            let prompt = v["prompt"]
                .as_str()
                .ok_or_else(|| anyhow::anyhow!("{}:{}: no \"prompt\"", path.display(), i + 1))?;
            jobs.push(Job {
                prompt: prompt.to_string(),
                max_tokens: v["max_tokens"].as_u64().unwrap_or(128),
            });
        }
        anyhow::ensure!(!jobs.is_empty(), "{} has no requests", path.display());
        return Ok((0..args.requests).map(|i| jobs[i % jobs.len()].clone()).collect());
    }
    let mut rng = Rng(args.seed);
    Ok((0..args.requests)
        .map(|_| {
            let n = rng.in_span(args.prompt_len);
            let words: Vec<&str> =
                (0..n).map(|_| WORDS[(rng.bits() % WORDS.len() as u64) as usize]).collect();
            Job { prompt: words.join(" "), max_tokens: rng.in_span(args.output_len) }
        })
        .collect())
}

/// Median, p90 and p99 of a set of durations, in milliseconds.
#[derive(Debug, Default, serde::Serialize)]
pub struct Percentiles {
    /// Median.
    pub median_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
}

fn percentiles(mut xs: Vec<f64>) -> Percentiles {
    if xs.is_empty() {
        return Percentiles::default();
    }
    xs.sort_by(f64::total_cmp);
    let at = |q: f64| xs[((xs.len() - 1) as f64 * q).round() as usize] * 1e3;
    Percentiles { median_ms: at(0.5), p90_ms: at(0.9), p99_ms: at(0.99) }
}

/// The figures of one run.
#[derive(Debug, serde::Serialize)]
pub struct Report {
    /// Requests that completed.
    pub completed: usize,
    /// Requests that failed.
    pub failed: usize,
    /// Wall time, seconds.
    pub duration_s: f64,
    /// Output tokens per second over the run.
    pub output_tokens_per_s: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Prompt tokens sent (as the server counted them).
    pub prompt_tokens: u64,
    /// Output tokens received.
    pub output_tokens: u64,
    /// Time to first token.
    pub ttft: Percentiles,
    /// Time per output token after the first, per request.
    pub tpot: Percentiles,
    /// Gaps between consecutive streamed tokens.
    pub itl: Percentiles,
    /// Request start to end.
    pub e2e: Percentiles,
    /// The first few error messages.
    pub errors: Vec<String>,
}

/// Runs the load and prints the report.
pub async fn run(args: LoadArgs) -> anyhow::Result<Report> {
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    anyhow::ensure!(args.rate.is_none_or(|r| r > 0.0), "--rate must be positive");
    let jobs = workload(&args)?;
    if args.in_process {
        let settings = args.scheduler.resolve()?;
        let (concurrency, kv) = (args.concurrency, args.kv_cache.clone());
        let report = tokio::task::spawn_blocking(move || {
            // Greedy, as the served runs ask for (temperature 0).
            let greedy = ferry_proto::v1::SamplingParams::default();
            inprocess::run(&jobs, concurrency, &settings, &kv, &greedy)
        })
        .await??
        .0;
        if let Some(path) = &args.json {
            std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
        }
        return Ok(report);
    }
    let total = jobs.len();
    let slots = Arc::new(Semaphore::new(args.concurrency));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let start = Instant::now();
    let mut rng = Rng(args.seed ^ 0xA5A5);
    let target = Arc::new(args.target.clone());
    let tls = args.tls_ca.as_deref().map(ferry_runtime::tls::public_client).transpose()?;
    let client = crate::http_client::HttpClient::new(tls, args.keep_alive);
    let model = args.model.clone();
    let rate = args.rate;
    tokio::spawn(async move {
        for job in jobs {
            if let Some(rate) = rate {
                // Exponential inter-arrival times make a Poisson process.
                let wait = -(1.0 - rng.unit()).ln() / rate;
                tokio::time::sleep(Duration::from_secs_f64(wait)).await;
            }
            let Ok(permit) = slots.clone().acquire_owned().await else { return };
            let body = serde_json::json!({
                "model": model, "prompt": job.prompt, "max_tokens": job.max_tokens,
                "temperature": 0, "ignore_eos": true, "stream": true,
                "stream_options": { "include_usage": true },
            })
            .to_string();
            let (tx, target, client) = (tx.clone(), target.clone(), client.clone());
            tokio::spawn(async move {
                let result = stream_completion(&client, &target, "/v1/completions", body).await;
                drop(permit);
                let _ = tx.send(result);
            });
        }
    });
    let (mut done, mut failed, mut errors) = (Vec::new(), 0usize, Vec::new());
    while done.len() + failed < total {
        let Some(result) = rx.recv().await else { break };
        match result {
            Ok(obs) => done.push(obs),
            Err(e) => {
                failed += 1;
                if errors.len() < 5 {
                    errors.push(e.to_string());
                }
            }
        }
        progress(done.len() + failed, total, start.elapsed());
    }
    eprintln!();
    let secs = |d: &Duration| d.as_secs_f64();
    let output_tokens: u64 = done.iter().map(|o| o.output_tokens).sum();
    let duration = start.elapsed().as_secs_f64();
    let report = Report {
        completed: done.len(),
        failed,
        duration_s: duration,
        output_tokens_per_s: output_tokens as f64 / duration,
        requests_per_s: done.len() as f64 / duration,
        prompt_tokens: done.iter().map(|o| o.prompt_tokens).sum(),
        output_tokens,
        ttft: percentiles(done.iter().filter_map(|o| o.ttft.as_ref().map(secs)).collect()),
        tpot: percentiles(
            done.iter()
                .filter(|o| o.output_tokens > 1)
                .filter_map(|o| {
                    o.ttft.map(|t| {
                        o.e2e.checked_sub(t).unwrap().as_secs_f64() / (o.output_tokens - 1) as f64
                    })
                })
                .collect(),
        ),
        itl: percentiles(done.iter().flat_map(|o| o.gaps.iter().map(secs)).collect()),
        e2e: percentiles(done.iter().map(|o| o.e2e.as_secs_f64()).collect()),
        errors,
    };
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(report)
}

fn progress(n: usize, total: usize, elapsed: Duration) {
    let width = 30;
    let filled = n * width / total.max(1);
    eprint!(
        "\r[{}{}] {n}/{total} requests, {:.1} s",
        "=".repeat(filled),
        " ".repeat(width - filled),
        elapsed.as_secs_f64()
    );
}

/// Prints a report as a table.
pub fn print(r: &Report) {
    println!("requests: {} completed, {} failed in {:.1} s", r.completed, r.failed, r.duration_s);
    println!(
        "throughput: {:.1} output tokens/s, {:.2} requests/s",
        r.output_tokens_per_s, r.requests_per_s
    );
    println!("tokens: {} prompt, {} output", r.prompt_tokens, r.output_tokens);
    println!("{:<6} {:>10} {:>10} {:>10}", "ms", "median", "p90", "p99");
    for (name, p) in [("TTFT", &r.ttft), ("TPOT", &r.tpot), ("ITL", &r.itl), ("E2E", &r.e2e)] {
        println!("{name:<6} {:>10.1} {:>10.1} {:>10.1}", p.median_ms, p.p90_ms, p.p99_ms);
    }
    for e in &r.errors {
        println!("error: {e}");
    }
}
