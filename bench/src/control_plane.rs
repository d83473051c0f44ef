//! `ferry-bench control-plane`: what Ferry's control plane itself costs per streamed token and
//! per request. N simulated executors (`ferry-executor --backend sim`, processes of their own,
//! not counted) under one `ferry-scheduler` (front and scheduler in one process, as `serve`
//! runs them), loaded by `ferry-bench serve`'s generator at two output lengths; the scheduler
//! process's CPU time (user + system, from `/proc/<pid>/stat`) over each run. With `cpu =
//! a · output tokens + b · requests` for the two runs, `a` is the cost per streamed token and
//! `b` per request (tokenizing its prompt included).
//!
//! Run nothing else meanwhile: on two cores the load generator and the simulated executors
//! share the machine with the process measured, and its CPU time is what counts (not the
//! throughput).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;

use crate::loadgen::{LoadArgs, Report, Span};

/// Flags of `ferry-bench control-plane`.
#[derive(Debug, clap::Args)]
pub struct ControlPlaneArgs {
    /// Simulated executors.
    #[arg(long, default_value_t = 4)]
    pub executors: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 256)]
    pub concurrency: usize,
    /// Requests per run.
    #[arg(long, default_value_t = 1024)]
    pub requests: usize,
    /// Prompt length in words (about a token each), MIN:MAX.
    #[arg(long, default_value = "100:200")]
    pub prompt_len: Span,
    /// The two runs' output tokens per request.
    #[arg(long, value_delimiter = ',', default_value = "64,512")]
    pub output_lens: Vec<u64>,
    /// The simulated executors' model profile (`ferry-sim --list-profiles`).
    #[arg(long, default_value = "llama-3-8b")]
    pub model_profile: String,
    /// Their simulated GPU.
    #[arg(long, default_value = "h100")]
    pub hardware: String,
    /// Wall-clock seconds per simulated second.
    #[arg(long, default_value_t = 0.02)]
    pub time_scale: f64,
    /// Where `ferry-executor` and `ferry-scheduler` are (default: beside this program).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Extra flags for the scheduler (e.g. `--max-num-seqs=512`), space-separated.
    #[arg(long, default_value = "")]
    pub scheduler_flags: String,
}

/// A child process, killed when dropped.
struct Proc {
    child: Child,
    addrs: Vec<(String, SocketAddr)>,
}

impl Proc {
    /// Starts `bin` with `args` and waits for its `listening <kind>=<addr>` lines, `kinds` of
    /// them.
    fn start(bin: &Path, args: &[String], kinds: usize) -> anyhow::Result<Self> {
        let mut child = Command::new(bin)
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting {}: {e}", bin.display()))?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some((_, rest)) = line.split_once(" listening ") {
                    if let Some((kind, addr)) = rest.split_once('=') {
                        if let Ok(addr) = addr.trim().parse::<SocketAddr>() {
                            let _ = tx.send((kind.to_string(), addr));
                        }
                    }
                }
            }
        });
        let mut proc = Self { child, addrs: Vec::new() };
        while proc.addrs.len() < kinds {
            let got = rx.recv_timeout(Duration::from_secs(180)).map_err(|_| {
                anyhow::anyhow!("{} printed no listening address in 3 minutes", bin.display())
            })?;
            proc.addrs.push(got);
        }
        Ok(proc)
    }

    fn addr(&self, kind: &str) -> SocketAddr {
        self.addrs.iter().find(|(k, _)| k == kind).map(|(_, a)| *a).expect("address printed")
    }

    /// User + system CPU time so far, seconds.
    fn cpu_seconds(&self) -> anyhow::Result<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))?;
        // Fields after the command name (which may hold spaces) start after its ')'.
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let (utime, stime): (u64, u64) = (fields[11].parse()?, fields[12].parse()?);
        Ok((utime + stime) as f64 / clock_ticks())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Clock ticks per second of `/proc`'s CPU times (`getconf CLK_TCK`; 100 on Linux).
fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// Waits until `GET /health` at `http` answers 200.
async fn wait_healthy(http: SocketAddr) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let client = crate::http_client::HttpClient::default();
    let mut last = String::new();
    while Instant::now() < deadline {
        match client.send(&http.to_string(), "GET", "/health", Vec::new()).await {
            Ok(r) if r.status == 200 => return Ok(()),
            Ok(r) => last = format!("HTTP {}", r.status),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!("the scheduler at {http} never became healthy (last: {last})")
}

/// One run's load against `http`.
async fn load(args: &ControlPlaneArgs, http: SocketAddr, output: u64) -> anyhow::Result<Report> {
    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        load: LoadArgs,
    }
    let flags = [
        "serve".to_string(),
        format!("--target={http}"),
        format!("--requests={}", args.requests),
        format!("--concurrency={}", args.concurrency),
        format!("--prompt-len={}:{}", args.prompt_len.0, args.prompt_len.1),
        format!("--output-len={output}"),
    ];
    let report = crate::loadgen::run(Wrap::try_parse_from(flags)?.load).await?;
    anyhow::ensure!(report.failed == 0, "{} requests failed: {:?}", report.failed, report.errors);
    Ok(report)
}

/// Runs the benchmark and prints its figures.
pub async fn run(args: &ControlPlaneArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.output_lens.len() == 2, "--output-lens takes two lengths");
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?.parent().map(Path::to_path_buf).unwrap_or_default(),
    };
    let mut executors = Vec::new();
    for i in 0..args.executors {
        let flags = [
            "--listen=127.0.0.1:0".to_string(),
            "--backend=sim".into(),
            format!("--executor-id=sim-{i}"),
            format!("--model-profile={}", args.model_profile),
            format!("--hardware={}", args.hardware),
            format!("--time-scale={}", args.time_scale),
        ];
        executors.push(Proc::start(&bin_dir.join("ferry-executor"), &flags, 1)?);
    }
    let mut flags = vec!["--listen=127.0.0.1:0".to_string(), "--http-listen=127.0.0.1:0".into()];
    flags.extend(executors.iter().map(|e| format!("--executor=http://{}", e.addr("grpc"))));
    flags.extend(args.scheduler_flags.split_whitespace().map(String::from));
    let scheduler = Proc::start(&bin_dir.join("ferry-scheduler"), &flags, 2)?;
    let http = scheduler.addr("http");
    wait_healthy(http).await?;
    let mut runs = Vec::new();
    for &output in &args.output_lens {
        let before = scheduler.cpu_seconds()?;
        let report = load(args, http, output).await?;
        let cpu = scheduler.cpu_seconds()? - before;
        println!(
            "output {output:>4}: {} requests, {} output tokens, {:.0} tokens/s, scheduler CPU \
             {cpu:.2} s ({:.2} µs per token overall)",
            report.completed,
            report.output_tokens,
            report.output_tokens_per_s,
            1e6 * cpu / report.output_tokens as f64
        );
        runs.push((report.output_tokens as f64, report.completed as f64, cpu));
    }
    // cpu = a·tokens + b·requests, from the two runs.
    let [(t1, r1, c1), (t2, r2, c2)] = [runs[0], runs[1]];
    let det = t1 * r2 - t2 * r1;
    anyhow::ensure!(det.abs() > f64::EPSILON, "the two runs do not separate tokens from requests");
    let per_token = (c1 * r2 - c2 * r1) / det;
    let per_request = (t1 * c2 - t2 * c1) / det;
    println!(
        "scheduler (front and scheduler in one process) over {} simulated executors: {:.2} µs \
         of CPU per streamed token, {:.0} µs per request",
        args.executors,
        per_token * 1e6,
        per_request * 1e6
    );
    Ok(())
}
