//! `ferry-bench control-plane`: what Ferry's control plane itself costs per streamed token and
//! per request. N simulated executors (`ferry-executor --backend sim`, processes of their own,
//! not counted) under one `ferry-scheduler` (front and scheduler in one process, as `serve`
//! runs them), loaded by `ferry-bench serve`'s generator at two output lengths; the scheduler
//! process's CPU time (user + system, from `/proc/<pid>/stat`) over each run. With `cpu =
//! a · output tokens + b · requests` for the two runs, `a` is the cost per streamed token and
//! `b` per request (tokenizing its prompt included).
//!
//! With `--fronts N`, N fronts run as processes of their own (finding the scheduler through an
//! etcd the bench starts), each loaded with its share of the requests at once; each process's
//! cost is solved the same way, and the sum of them. User and system time are given apart.
//!
//! Last, the same run measures its baseline ([`write_floor`]): what the least an async server
//! can do per streamed token (wake a connection's task, write the chunk) costs at the second
//! run's pace over as many loopback connections; the per-token figure is also given as a
//! multiple of it.
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

pub mod write_floor;

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
    /// Fronts in processes of their own (`ferry-scheduler front`), each loaded with its share
    /// of the requests; 0: the front runs in the scheduler's process, as `serve` runs it. With
    /// any, an etcd (from the `PATH`) is started for them to find the scheduler.
    #[arg(long, default_value_t = 0)]
    pub fronts: usize,
    /// The load's clients keep their connections open between requests (HTTP/1.1
    /// keep-alive); without it each request opens and closes its own.
    #[arg(long)]
    pub keep_alive: bool,
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

    /// User and system CPU time so far, seconds.
    fn cpu(&self) -> anyhow::Result<Cpu> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))?;
        // Fields after the command name (which may hold spaces) start after its ')'.
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let (utime, stime): (u64, u64) = (fields[11].parse()?, fields[12].parse()?);
        Ok(Cpu { user: utime as f64 / clock_ticks(), system: stime as f64 / clock_ticks() })
    }
}

/// CPU time, seconds.
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    user: f64,
    system: f64,
}

impl std::ops::Sub for Cpu {
    type Output = Cpu;
    fn sub(self, o: Cpu) -> Cpu {
        Cpu { user: self.user - o.user, system: self.system - o.system }
    }
}

impl std::ops::Add for Cpu {
    type Output = Cpu;
    fn add(self, o: Cpu) -> Cpu {
        Cpu { user: self.user + o.user, system: self.system + o.system }
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
async fn load(
    args: &ControlPlaneArgs,
    http: SocketAddr,
    (requests, output): (usize, u64),
) -> anyhow::Result<Report> {
    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        load: LoadArgs,
    }
    let flags = [
        "serve".to_string(),
        format!("--target={http}"),
        format!("--requests={requests}"),
        format!("--concurrency={}", (args.concurrency / args.fronts.max(1)).max(1)),
        format!("--prompt-len={}:{}", args.prompt_len.0, args.prompt_len.1),
        format!("--output-len={output}"),
    ];
    let flags = flags.into_iter().chain(args.keep_alive.then(|| "--keep-alive".to_string()));
    let report = crate::loadgen::run(Wrap::try_parse_from(flags)?.load).await?;
    anyhow::ensure!(report.failed == 0, "{} requests failed: {:?}", report.failed, report.errors);
    Ok(report)
}

/// The processes under test: the scheduler, and the fronts when they run on their own.
struct Ferry {
    scheduler: Proc,
    fronts: Vec<Proc>,
    /// With separate fronts: the etcd they find the scheduler through, and its data.
    _etcd: Option<(Proc, tempdir::Dir)>,
}

impl Ferry {
    /// Where clients send requests: each front's HTTP API, or the scheduler's.
    fn targets(&self) -> Vec<SocketAddr> {
        if self.fronts.is_empty() {
            vec![self.scheduler.addr("http")]
        } else {
            self.fronts.iter().map(|f| f.addr("http")).collect()
        }
    }

    /// Each process's CPU time so far: the scheduler's, then each front's.
    fn cpu(&self) -> anyhow::Result<Vec<Cpu>> {
        std::iter::once(&self.scheduler).chain(&self.fronts).map(Proc::cpu).collect()
    }
}

/// Starts the executors, the scheduler and (with `--fronts`) etcd and the fronts.
fn start(args: &ControlPlaneArgs, bin_dir: &Path) -> anyhow::Result<(Vec<Proc>, Ferry)> {
    let etcd = if args.fronts > 0 { Some(start_etcd()?) } else { None };
    let endpoints = etcd.as_ref().map(|(e, _)| format!("--etcd-endpoints={}", e.addr("etcd")));
    let mut executors = Vec::new();
    for i in 0..args.executors {
        let mut flags = vec![
            "--listen=127.0.0.1:0".to_string(),
            "--backend=sim".into(),
            format!("--executor-id=sim-{i}"),
            format!("--model-profile={}", args.model_profile),
            format!("--hardware={}", args.hardware),
            format!("--time-scale={}", args.time_scale),
        ];
        flags.extend(endpoints.clone());
        executors.push(Proc::start(&bin_dir.join("ferry-executor"), &flags, 1)?);
    }
    let mut flags = vec!["--listen=127.0.0.1:0".to_string(), "--http-listen=127.0.0.1:0".into()];
    if let Some(e) = &endpoints {
        flags.push(e.clone());
    } else {
        let listed = executors.iter().map(|e| format!("--executor=http://{}", e.addr("grpc")));
        flags.extend(listed);
    }
    flags.extend(args.scheduler_flags.split_whitespace().map(String::from));
    let scheduler = Proc::start(&bin_dir.join("ferry-scheduler"), &flags, 2)?;
    let mut fronts = Vec::new();
    for _ in 0..args.fronts {
        let mut flags = vec![
            "front".to_string(),
            "--listen=127.0.0.1:0".into(),
            "--http-listen=127.0.0.1:0".into(),
        ];
        flags.extend(endpoints.clone());
        fronts.push(Proc::start(&bin_dir.join("ferry-scheduler"), &flags, 2)?);
    }
    Ok((executors, Ferry { scheduler, fronts, _etcd: etcd }))
}

/// An etcd on free loopback ports with a temporary data directory (`etcd` on the `PATH`).
fn start_etcd() -> anyhow::Result<(Proc, tempdir::Dir)> {
    let free = || -> anyhow::Result<u16> {
        Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
    };
    let (client, peer) = (free()?, free()?);
    let dir = tempdir::Dir::new("ferry-bench-etcd")?;
    let args = [
        "--name=bench".to_string(),
        format!("--data-dir={}", dir.0.display()),
        format!("--listen-client-urls=http://127.0.0.1:{client}"),
        format!("--advertise-client-urls=http://127.0.0.1:{client}"),
        format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
        format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
        format!("--initial-cluster=bench=http://127.0.0.1:{peer}"),
    ];
    let child = Command::new("etcd")
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| {
            anyhow::anyhow!("starting etcd (from the PATH; scripts/setup installs it): {e}")
        })?;
    let addr: SocketAddr = format!("127.0.0.1:{client}").parse()?;
    let proc = Proc { child, addrs: vec![("etcd".into(), addr)] };
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(addr).is_err() {
        anyhow::ensure!(Instant::now() < deadline, "etcd did not listen at {addr} in 30 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((proc, dir))
}

/// A temporary directory, removed when dropped.
mod tempdir {
    /// The directory.
    pub struct Dir(pub std::path::PathBuf);

    impl Dir {
        pub fn new(name: &str) -> std::io::Result<Self> {
            let path = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
            std::fs::create_dir_all(&path)?;
            Ok(Self(path))
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// One run at `output` tokens a request: every target loaded at once with its share of the
/// requests; the output tokens, requests and each process's CPU over the run.
async fn measure(
    args: &ControlPlaneArgs,
    ferry: &Ferry,
    output: u64,
) -> anyhow::Result<(f64, f64, Vec<Cpu>, f64)> {
    let targets = ferry.targets();
    let share = args.requests / targets.len();
    let before = ferry.cpu()?;
    let runs = targets.iter().map(|t| load(args, *t, (share, output)));
    let reports = futures_util::future::try_join_all(runs).await?;
    let after = ferry.cpu()?;
    let cpu: Vec<Cpu> = after.iter().zip(&before).map(|(a, b)| *a - *b).collect();
    let tokens: u64 = reports.iter().map(|r| r.output_tokens).sum();
    let completed: usize = reports.iter().map(|r| r.completed).sum();
    let per_s: f64 = reports.iter().map(|r| r.output_tokens_per_s).sum();
    let total = cpu.iter().fold(Cpu::default(), |a, b| a + *b);
    println!(
        "output {output:>4}: {completed} requests, {tokens} output tokens, {per_s:.0} tokens/s; \
         Ferry CPU {:.2} s user + {:.2} s system ({:.2} µs per token overall)",
        total.user,
        total.system,
        1e6 * (total.user + total.system) / tokens as f64
    );
    Ok((tokens as f64, completed as f64, cpu, per_s))
}

/// Runs the benchmark and prints its figures.
pub async fn run(args: &ControlPlaneArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.output_lens.len() == 2, "--output-lens takes two lengths");
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?.parent().map(Path::to_path_buf).unwrap_or_default(),
    };
    let (_executors, ferry) = start(args, &bin_dir)?;
    for t in ferry.targets() {
        wait_healthy(t).await?;
    }
    let mut runs = Vec::new();
    for &output in &args.output_lens {
        runs.push(measure(args, &ferry, output).await?);
    }
    // cpu = a·tokens + b·requests, from the two runs, for each process and for all of them.
    let [(t1, r1, c1, _), (t2, r2, c2, per_s)] = [&runs[0], &runs[1]];
    let det = t1 * r2 - t2 * r1;
    anyhow::ensure!(det.abs() > f64::EPSILON, "the two runs do not separate tokens from requests");
    let solve = |c1: f64, c2: f64| ((c1 * r2 - c2 * r1) / det, (t1 * c2 - t2 * c1) / det);
    let sum = |c: &[Cpu]| c.iter().fold(Cpu::default(), |a, b| a + *b);
    let mut rows: Vec<(String, Cpu, Cpu)> = Vec::new();
    let names = std::iter::once(if args.fronts == 0 {
        "scheduler (front and scheduler in one process)".to_string()
    } else {
        "scheduler".to_string()
    })
    .chain((0..args.fronts).map(|i| format!("front {i}")));
    for (k, name) in names.enumerate() {
        rows.push((name, c1[k], c2[k]));
    }
    if args.fronts > 0 {
        rows.push(("all Ferry processes".into(), sum(c1), sum(c2)));
    }
    println!("over {} simulated executors:", args.executors);
    let mut first = None;
    for (name, a, b) in rows {
        let (tu, ru) = solve(a.user, b.user);
        let (ts, rs) = solve(a.system, b.system);
        println!(
            "  {name}: {:.2} µs of CPU per streamed token ({:.2} user, {:.2} system), {:.0} µs \
             per request ({:.0} user, {:.0} system)",
            (tu + ts) * 1e6,
            tu * 1e6,
            ts * 1e6,
            (ru + rs) * 1e6,
            ru * 1e6,
            rs * 1e6
        );
        first.get_or_insert(tu + ts);
    }
    // The baseline: a bare write per token at the second run's pace, measured now.
    let this = std::env::current_exe()?;
    let floor = write_floor::measure(&this, args.concurrency, *per_s, 2.0).await?;
    let per_write = floor.user + floor.system;
    println!(
        "  the floor: a tokio task per connection writing each token as it comes ({} \
         connections, {per_s:.0} writes/s, `ferry-bench write-floor`): {:.2} µs of CPU per token \
         ({:.2} user, {:.2} system); the first row is {:.1}× that",
        args.concurrency,
        per_write * 1e6,
        floor.user * 1e6,
        floor.system * 1e6,
        first.unwrap_or_default() / per_write
    );
    Ok(())
}
