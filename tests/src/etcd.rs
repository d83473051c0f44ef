//! A real etcd for the coordination tests: Debian's `etcd` binary on free loopback ports with a
//! temporary data dir, one member or a cluster of several, and `etcdctl` to look and poke.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// One etcd member: its ports, data dir and process (killed on drop).
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// A running etcd cluster of one or more members.
pub struct Etcd {
    members: Vec<Member>,
    initial_cluster: String,
    token: String,
}

/// A port free on loopback now (for a process that must keep its port across restarts).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Etcd {
    /// Starts a single-member etcd and waits until it answers.
    pub fn start() -> Result<Self> {
        Self::cluster(1)
    }

    /// Starts a cluster of `n` members and waits until every member answers. A free port can be
    /// taken by another process between choosing it and etcd binding it (tests run in
    /// parallel), so a start whose member exits is tried again on new ports.
    pub fn cluster(n: usize) -> Result<Self> {
        let mut last = None;
        for _ in 0..3 {
            match Self::try_cluster(n) {
                Ok(etcd) => return Ok(etcd),
                Err(e) if e.to_string().contains("exited") => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.expect("three attempts"))
    }

    fn try_cluster(n: usize) -> Result<Self> {
        let token = format!("ferry-test-{}-{}", std::process::id(), free_port()?);
        let mut members = Vec::new();
        for i in 0..n {
            let dir = std::env::temp_dir().join(format!("{token}-m{i}"));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir)?;
            members.push(Member {
                name: format!("m{i}"),
                client_port: free_port()?,
                peer_port: free_port()?,
                dir,
                child: None,
            });
        }
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut etcd = Etcd { members, initial_cluster, token };
        for i in 0..n {
            etcd.spawn(i)?;
        }
        for i in 0..n {
            etcd.wait_healthy(i)?;
        }
        Ok(etcd)
    }

    fn spawn(&mut self, i: usize) -> Result<()> {
        let m = &self.members[i];
        let client = format!("http://127.0.0.1:{}", m.client_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let child = Command::new("etcd")
            .args(["--name", &m.name, "--data-dir"])
            .arg(&m.dir)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial_cluster])
            .args(["--initial-cluster-token", &self.token, "--initial-cluster-state", "new"])
            .args(["--log-level", "error", "--logger", "zap"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(m.dir.with_extension("log"))?)
            .spawn()
            .context("starting etcd (scripts/setup installs Debian's etcd-server)")?;
        self.members[i].child = Some(child);
        Ok(())
    }

    fn wait_healthy(&mut self, i: usize) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let ep = self.member_endpoint(i);
        loop {
            let m = &mut self.members[i];
            if let Some(status) = m.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                m.child = None;
                let log = std::fs::read_to_string(m.dir.with_extension("log")).unwrap_or_default();
                let tail: String = log.lines().rev().take(3).collect::<Vec<_>>().join(" / ");
                bail!("etcd member {i} at {ep} exited ({status}): {tail}");
            }
            let ok = Command::new("etcdctl")
                .args(["--endpoints", &ep, "--command-timeout=1s", "endpoint", "health"])
                .env("ETCDCTL_API", "3")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("etcd member {i} at {ep} not healthy within 20 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The client endpoint of member `i` (`127.0.0.1:port`).
    pub fn member_endpoint(&self, i: usize) -> String {
        format!("127.0.0.1:{}", self.members[i].client_port)
    }

    /// All client endpoints, comma-separated (the value of `--etcd-endpoints`).
    pub fn endpoints(&self) -> String {
        (0..self.members.len()).map(|i| self.member_endpoint(i)).collect::<Vec<_>>().join(",")
    }

    /// `kill -9` member `i`.
    pub fn kill(&mut self, i: usize) -> Result<()> {
        if let Some(mut child) = self.members[i].child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Restarts member `i` (killed before) on the same ports and data, and waits for it.
    pub fn restart(&mut self, i: usize) -> Result<()> {
        self.kill(i)?;
        self.spawn(i)?;
        self.wait_healthy(i)
    }

    /// Restarts every member (killed before, all at once: none could reach a quorum alone) and
    /// waits for them.
    pub fn restart_all(&mut self) -> Result<()> {
        for i in 0..self.members.len() {
            self.kill(i)?;
            self.spawn(i)?;
        }
        for i in 0..self.members.len() {
            self.wait_healthy(i)?;
        }
        Ok(())
    }

    /// The process id of member `i`, while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].child.as_ref().map(Child::id)
    }

    /// Runs `etcdctl` against the cluster and returns its stdout.
    pub fn ctl(&self, args: &[&str]) -> Result<String> {
        let out = Command::new("etcdctl")
            .args(["--endpoints", &self.endpoints(), "--command-timeout=3s"])
            .args(args)
            .env("ETCDCTL_API", "3")
            .output()
            .context("running etcdctl (scripts/setup installs Debian's etcd-client)")?;
        if !out.status.success() {
            bail!("etcdctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// The member that is raft's leader now (by `etcdctl endpoint status`, asked of the live
    /// members).
    pub fn raft_leader(&self) -> Result<usize> {
        let live: Vec<usize> =
            (0..self.members.len()).filter(|&i| self.members[i].child.is_some()).collect();
        let endpoints: Vec<String> = live.iter().map(|&i| self.member_endpoint(i)).collect();
        let out = Command::new("etcdctl")
            .args(["--endpoints", &endpoints.join(","), "--command-timeout=3s"])
            .args(["endpoint", "status", "-w", "json"])
            .env("ETCDCTL_API", "3")
            .output()?;
        let status: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let list = status.as_array().context("etcdctl endpoint status: not a list")?;
        for (k, s) in list.iter().enumerate() {
            let me = &s["Status"]["header"]["member_id"];
            if !me.is_null() && *me == s["Status"]["leader"] {
                return Ok(live[k]);
            }
        }
        bail!("no member says it leads: {status}")
    }

    /// The keys under `prefix`.
    pub fn keys(&self, prefix: &str) -> Result<Vec<String>> {
        let out = self.ctl(&["get", "--prefix", "--keys-only", prefix])?;
        Ok(out.lines().filter(|l| !l.is_empty()).map(str::to_string).collect())
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(mut child) = m.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
            let _ = std::fs::remove_dir_all(&m.dir);
            let _ = std::fs::remove_file(m.dir.with_extension("log"));
        }
    }
}
