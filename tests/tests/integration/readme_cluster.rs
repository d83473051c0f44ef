//! The README's cluster and disaggregation sections as a newcomer pastes them (issue 49): their
//! command blocks are read from `README.md`, every host name made 127.0.0.1 and every port a
//! free one (listen addresses stay `0.0.0.0`, so `--plaintext` is needed as written), each
//! process started in order, and the README's requests sent through them.

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use ferry_tests::streams::wait_for;
use ferry_tests::{binary, Etcd, Service, TempDir};

/// The README's `sh` blocks in the section under `heading`.
fn blocks(readme: &str, heading: &str) -> Vec<String> {
    let start = readme.find(heading).unwrap_or_else(|| panic!("no {heading:?} in the README"));
    let section = &readme[start + heading.len()..];
    let section = &section[..section.find("\n### ").unwrap_or(section.len())];
    section
        .split("```sh\n")
        .skip(1)
        .map(|b| b[..b.find("\n```").expect("a closed block")].to_string())
        .collect()
}

/// A command line's words: single quotes keep spaces; a two-space `#` starts a comment.
fn words(line: &str) -> Vec<String> {
    let line = line.split_once("  #").map_or(line, |(l, _)| l);
    let (mut out, mut word, mut quoted, mut any) = (Vec::new(), String::new(), false, false);
    for c in line.chars() {
        match c {
            '\'' => (quoted, any) = (!quoted, true),
            ' ' if !quoted => {
                if any {
                    out.push(std::mem::take(&mut word));
                }
                any = false;
            }
            c => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(word);
    }
    out
}

/// The README's hosts and ports made this machine's: every host name 127.0.0.1, etcd's port
/// the test's etcd, every other port a free one (the same README port, the same free port).
struct Places {
    ports: HashMap<String, String>,
    vars: HashMap<String, String>,
    /// Where relative paths (`certs/…`) are made.
    dir: TempDir,
}

/// The README's host names.
const HOSTS: [&str; 6] = ["node-a", "node-b", "node-c", "node-p", "node-d", "10.0.0.5"];

impl Places {
    fn new(etcd: &Etcd) -> Self {
        let endpoints = etcd.endpoints();
        let etcd_port = endpoints.split(',').next().unwrap().rsplit(':').next().unwrap();
        let ports = HashMap::from([("2379".to_string(), etcd_port.to_string())]);
        let dir = TempDir::new("readme-cluster").unwrap();
        Self { ports, vars: HashMap::new(), dir }
    }

    /// `line` with its variables, hosts and ports replaced; `None` for an assignment.
    fn command(&mut self, line: &str) -> Option<Vec<String>> {
        let words = words(line);
        if let [only] = words.as_slice() {
            if let Some((name, value)) = only.split_once('=') {
                self.vars.insert(format!("${name}"), value.to_string());
                return None;
            }
        }
        let words: Vec<String> = words
            .iter()
            .flat_map(|w| {
                let mut w = w.clone();
                let expands = self.vars.keys().any(|name| w.contains(name.as_str()));
                for (name, value) in &self.vars {
                    w = w.replace(name, value);
                }
                if expands {
                    w.split(' ').map(String::from).collect::<Vec<_>>() // unquoted: split
                } else {
                    vec![w]
                }
            })
            .collect();
        let certs = format!("{}/certs/", self.dir.0.display());
        let mut out = Vec::new();
        for (i, w) in words.iter().enumerate() {
            let mut w = w.replace("certs/", &certs);
            if w == "certs" && i > 0 && words[i - 1] == "--out" {
                w = certs.trim_end_matches('/').to_string();
            }
            for host in HOSTS {
                w = w.replace(&format!("{host}:"), "127.0.0.1:");
                // The names a certificate carries (`ferry certs --hosts`).
                if i > 0 && words[i - 1] == "--hosts" {
                    w = w.replace(host, "127.0.0.1");
                }
            }
            out.push(self.ports_of(&w));
        }
        Some(out)
    }

    /// `word` with each `:PORT` (four or five digits) made this run's.
    fn ports_of(&mut self, word: &str) -> String {
        let mut out = String::new();
        let mut rest = word;
        while let Some(i) = rest.find(':') {
            out.push_str(&rest[..=i]);
            rest = &rest[i + 1..];
            let digits = rest.chars().take_while(char::is_ascii_digit).count();
            if (4..=5).contains(&digits) {
                let free = self.ports.entry(rest[..digits].to_string()).or_insert_with(|| {
                    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                    l.local_addr().unwrap().port().to_string()
                });
                out.push_str(free);
                rest = &rest[digits..];
            }
        }
        out.push_str(rest);
        out
    }
}

/// Runs a README request line (curl or grpcurl) and returns its output, stdout then stderr.
fn request(words: &[String]) -> (bool, String) {
    let program = match words[0].as_str() {
        "grpcurl" => std::env::var("FERRY_GRPCURL").unwrap_or_else(|_| "grpcurl".into()),
        other => other.to_string(),
    };
    let out = Command::new(program).args(&words[1..]).output().unwrap();
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// Starts a README process line: its program from this build, waiting for its addresses.
fn start(words: &[String]) -> Service {
    let name = words[0].as_str();
    // A scheduler (or front) announces gRPC and HTTP; an agent or executor its gRPC port.
    let announced = if name == "ferry-scheduler" { 2 } else { 1 };
    binary(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    let args: Vec<&str> = words[1..].iter().map(String::as_str).collect();
    Service::start(name, &args, announced).unwrap_or_else(|e| panic!("{words:?}: {e}"))
}

/// Starts the processes of `block` in order (a one-shot command, `ferry certs`, runs to its
/// end), waiting for `sched-1` to lead before the next; then sends `requests`' lines and checks
/// the answers: a completion from the front, the leader's executors (`gpu-a`, `gpu-b`) with
/// their roles, and the standby naming the leader.
async fn run_cluster(places: &mut Places, block: &str, requests: &str) -> Vec<Service> {
    let mut running = Vec::new();
    for line in block.lines() {
        let Some(words) = places.command(line) else { continue };
        if words[0] == "ferry" {
            let out = Command::new(binary("ferry").unwrap()).args(&words[1..]).output().unwrap();
            assert!(out.status.success(), "{words:?}: {}", String::from_utf8_lossy(&out.stderr));
            continue;
        }
        let service = start(&words);
        // The first scheduler leads (the README says so): wait until it drives the executors.
        if words.iter().any(|w| w == "sched-1") {
            // (It listens on 0.0.0.0; its certificate names 127.0.0.1.)
            let http = format!("127.0.0.1:{}", service.addr("http").port());
            let ca = places.dir.0.join("certs/ca.pem");
            let mut curl: Vec<String> = vec!["curl".into(), "-s".into()];
            if ca.exists() {
                curl.extend(["--cacert".into(), ca.display().to_string()]);
                curl.push(format!("https://{http}/health"));
            } else {
                curl.push(format!("http://{http}/health"));
            }
            let healthy = || request(&curl) == (true, "ok".to_string());
            assert!(wait_for(Duration::from_mins(2), healthy).await.is_some(), "sched-1 idle");
        }
        running.push(service);
    }
    let mut answers = Vec::new();
    for line in requests.lines() {
        let words = places.command(line).expect("a request");
        // The leader is healthy with one executor; the other may still be connecting.
        if line.contains("ListExecutors") {
            let both = || {
                let (ok, text) = request(&words);
                ok && text.contains("gpu-a") && text.contains("gpu-b")
            };
            wait_for(Duration::from_mins(2), both).await;
        }
        answers.push(request(&words));
    }
    let [(ok, completion), (ok2, executors), (ok3, standby)] = &answers[..] else {
        panic!("the README's requests changed: {answers:?}");
    };
    assert!(*ok && completion.contains("\"choices\""), "{completion}");
    assert!(*ok2 && executors.contains("gpu-a") && executors.contains("gpu-b"), "{executors}");
    assert!(executors.contains("EXECUTOR_ROLE_BOTH"), "{executors}");
    let leader = format!("127.0.0.1:{}", places.ports["50051"]);
    assert!(*ok3 && standby.contains("standby") && standby.contains(&leader), "{standby}");
    running
}

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).expect("README")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_cluster_and_disaggregation_commands_run_as_pasted() {
    let readme = readme();
    let cluster = blocks(&readme, "### A cluster on several machines");
    let disagg = blocks(&readme, "### Prefill and decode on different executors");
    assert!(cluster.len() >= 2 && disagg.len() == 1, "the README's blocks moved");
    let etcd = Etcd::start().unwrap();
    let mut places = Places::new(&etcd);
    let mut running = run_cluster(&mut places, &cluster[0], &cluster[1]).await;

    // The disaggregation block joins the same cluster; the leader drives its executors too.
    for line in disagg[0].lines() {
        let words = places.command(line).expect("a process");
        running.push(start(&words));
    }
    let list = places.command(cluster[1].lines().nth(1).unwrap()).unwrap();
    let both_roles = || {
        let (ok, text) = request(&list);
        ok && text.contains("EXECUTOR_ROLE_PREFILL") && text.contains("EXECUTOR_ROLE_DECODE")
    };
    assert!(
        wait_for(Duration::from_mins(2), both_roles).await.is_some(),
        "the prefill and decode executors never joined: {}",
        request(&list).1
    );
}

/// The same cluster under mutual TLS, as the README's Mutual TLS section writes it (the
/// certificates made by `ferry certs` as written, the requests over HTTPS and with the
/// `client` certificate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_mutual_tls_cluster_commands_run_as_pasted() {
    let readme = readme();
    let tls = blocks(&readme, "### Mutual TLS");
    assert!(tls.len() >= 2, "the README's blocks moved");
    let etcd = Etcd::start().unwrap();
    let mut places = Places::new(&etcd);
    let _running = run_cluster(&mut places, &tls[0], &tls[1]).await;
}
