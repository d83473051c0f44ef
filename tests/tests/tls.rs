//! Mutual TLS between Ferry's services (issue 18, item 2), as real processes with certificates
//! made by `ferry certs`: a prefill/decode cluster whose every link is mutual TLS (scheduler to
//! executors, executors to their agents, agent to agent over the data channel, the test to
//! the scheduler's API) streams exactly what `ferry serve` over TLS streams; every internal
//! port refuses a client certificate from another CA, no certificate, plaintext, and a
//! certificate whose role may not call it (an executor may not drive an executor); each
//! service's plaintext probe port answers health checks and `/metrics` and nothing else; a rotated
//! certificate set is used without a restart; and a service refuses to listen beyond
//! loopback in plaintext unless told to.
//!
//! The test process itself presents the `client` certificate (`ferry_runtime::tls::install`),
//! so its gRPC calls and `/metrics` reads go over mutual TLS too.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use ferry_runtime::tls::{self, Protocol, Role, TlsArgs};
use ferry_tests::streams::{
    assert_complete, assert_same_streams, run_streams, sum_samples, wait_for,
};
use ferry_tests::{binary, grpcurl, Service, TempDir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MAX_TOKENS: u32 = 16;

/// `ferry certs --out dir`.
fn make_certs(dir: &Path) {
    let out = std::process::Command::new(binary("ferry").unwrap())
        .args(["certs", "--out"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "ferry certs: {}", String::from_utf8_lossy(&out.stderr));
}

/// The `--tls-*` flags for the certificate `stem` in `dir`.
fn tls_flags(dir: &Path, stem: &str) -> Vec<String> {
    let file = |name: String| dir.join(name).display().to_string();
    vec![
        "--tls-cert".into(),
        file(format!("{stem}.pem")),
        "--tls-key".into(),
        file(format!("{stem}.key")),
        "--tls-ca".into(),
        file("ca.pem".into()),
    ]
}

fn start(name: &str, args: &[String], expect: usize) -> Service {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Service::start(name, &args, expect).unwrap()
}

/// Makes the test process present `dir`'s `client` certificate on every call.
fn install_client(dir: &Path) {
    let args = TlsArgs {
        cert: Some(dir.join("client.pem")),
        key: Some(dir.join("client.key")),
        ca: Some(dir.join("ca.pem")),
        plaintext: false,
    };
    tls::install(args.load().unwrap().unwrap());
}

/// `/metrics` of the gRPC port at `addr` (HTTP/1.1 over mutual TLS).
async fn metrics(addr: SocketAddr) -> String {
    let tls = tls::current().expect("installed");
    let mut conn = tls.connect(&addr.to_string(), Role::Scheduler, Protocol::Http1).await.unwrap();
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut body = String::new();
    // The server closes after its answer; a TLS close without close_notify is fine here.
    let _ = conn.read_to_string(&mut body).await;
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    body
}

async fn metric(addr: SocketAddr, name: &str) -> f64 {
    sum_samples(&metrics(addr).await, name).unwrap_or_else(|| panic!("no {name}"))
}

/// `grpcurl` `list` against `addr` with `flags`; true if it answered.
fn grpcurl_lists(addr: SocketAddr, flags: &[String]) -> bool {
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let addr = addr.to_string();
    args.extend(["-connect-timeout", "5", &addr, "list"]);
    grpcurl(&args).unwrap().status.success()
}

/// A `client` certificate against an executor: the call fails `UNAUTHENTICATED` naming the roles
/// the port takes (issue 49), not with a broken pipe.
fn a_client_is_told_why_an_executor_refuses_it(certs: &Path, executor: SocketAddr) {
    let flags = grpcurl_tls(certs, certs, Some("client"));
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let executor = executor.to_string();
    args.extend([executor.as_str(), "ferry.v1.Executor/Describe"]);
    let out = grpcurl(&args).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("Unauthenticated")
            && err.contains("names none of the roles this port takes (ferry-scheduler)"),
        "{err}"
    );
}

/// grpcurl's flags to present `stem` from `cert_dir`, trusting `ca_dir`'s CA.
fn grpcurl_tls(ca_dir: &Path, cert_dir: &Path, stem: Option<&str>) -> Vec<String> {
    let mut flags = vec!["-cacert".to_string(), ca_dir.join("ca.pem").display().to_string()];
    if let Some(stem) = stem {
        flags.extend([
            "-cert".to_string(),
            cert_dir.join(format!("{stem}.pem")).display().to_string(),
            "-key".to_string(),
            cert_dir.join(format!("{stem}.key")).display().to_string(),
        ]);
    }
    flags
}

/// Prompts of ~150 tokens each, so the scheduler disaggregates them.
fn requests(n: usize) -> Vec<ferry_proto::v1::GenerateRequest> {
    (0..n)
        .map(|i| {
            let prompt = format!(
                "Ledger {i}. {}What was built next?",
                format!("In year {i} the town built a wall, a well and a gate. ").repeat(8)
            );
            let seed = (i % 2 == 1).then_some(9000 + i as u64);
            ferry_tests::streams::request(prompt, MAX_TOKENS, seed)
        })
        .collect()
}

/// A node: a KV agent and an executor of `role`, each with its own role's certificate.
fn node(certs: &Path, role: &str) -> (Service, Service) {
    let mut args: Vec<String> =
        ["--listen", "127.0.0.1:0", "--node-id", role].map(String::from).to_vec();
    args.extend(tls_flags(certs, "kv"));
    args.extend(["--probe-listen".into(), "127.0.0.1:0".into()]);
    let agent = start("ferry-kv", &args, 2);
    let kv = agent.addr("grpc").to_string();
    let mut args: Vec<String> = [
        "--listen",
        "127.0.0.1:0",
        "--executor-id",
        role,
        "--role",
        role,
        "--kv-agent",
        &kv,
        "--kv-cache-mib",
        "256",
    ]
    .map(String::from)
    .to_vec();
    args.extend(tls_flags(certs, "executor"));
    args.extend(["--probe-listen".into(), "127.0.0.1:0".into()]);
    let executor = start("ferry-executor", &args, 2);
    (agent, executor)
}

#[allow(clippy::too_many_lines)] // one cluster, every port's refusals
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutual_tls_cluster_streams_exactly_and_every_internal_port_refuses_strangers() {
    let dir = TempDir::new("tls").unwrap();
    let (ours, other) = (dir.0.join("ours"), dir.0.join("other"));
    make_certs(&ours);
    make_certs(&other);
    install_client(&ours);

    // The reference: `ferry serve` over TLS (one certificate naming every role).
    let mut args: Vec<String> = ferry_tests::serve_args("256").map(String::from).to_vec();
    args.extend(tls_flags(&ours, "serve"));
    let serve = start("ferry", &args, 4);
    let reference = run_streams(serve.addr("grpc"), requests(4), 0, || {}).await;
    assert_complete(&reference, MAX_TOKENS as usize);
    drop(serve);

    // Prefill and decode nodes and a scheduler, each process with its own role.
    let (prefill_agent, prefill) = node(&ours, "prefill");
    let (decode_agent, decode) = node(&ours, "decode");
    let mut args: Vec<String> = [
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--disaggregation-min-tokens",
        "64",
    ]
    .map(String::from)
    .to_vec();
    for e in [&prefill, &decode] {
        args.extend(["--executor".to_string(), e.addr("grpc").to_string()]);
    }
    args.extend(tls_flags(&ours, "scheduler"));
    args.extend(["--probe-listen".into(), "127.0.0.1:0".into()]);
    let scheduler = start("ferry-scheduler", &args, 3);
    let grpc = scheduler.addr("grpc");
    let mut driven = false;
    for _ in 0..120 {
        let body = metrics(grpc).await;
        if body.lines().filter(|l| l.starts_with("vllm:num_requests_running{")).count() == 2 {
            driven = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(driven, "the scheduler never drove both executors over mutual TLS");

    let got = run_streams(grpc, requests(4), 0, || {}).await;
    assert_same_streams(&got, &reference);
    // Every request was prefilled on one node and its KV pushed, agent to agent over the
    // TLS data channel, to the other.
    assert_eq!(metric(grpc, "ferry_requests_disaggregated{").await, 4.0);
    assert_eq!(metric(grpc, "ferry_handoffs_recomputed{").await, 0.0);
    assert_eq!(metric(grpc, "ferry_kv_transfer_failures{").await, 0.0);
    assert!(metric(grpc, "ferry_kv_transfers{").await >= 4.0);

    // Every internal port: a certificate from another CA, none, plaintext → refused; the
    // right role from our CA → answered (the control that shows the refusals mean something).
    let ports: [(&str, SocketAddr, &str); 5] = [
        ("prefill executor", prefill.addr("grpc"), "scheduler"),
        ("decode executor", decode.addr("grpc"), "scheduler"),
        ("prefill agent", prefill_agent.addr("grpc"), "executor"),
        ("decode agent", decode_agent.addr("grpc"), "kv"),
        ("scheduler", grpc, "client"),
    ];
    // (what a failure means, the port, grpcurl's flags, whether it must answer)
    let mut calls: Vec<(String, SocketAddr, Vec<String>, bool)> = Vec::new();
    for (what, addr, allowed) in ports {
        let flags = grpcurl_tls(&ours, &ours, Some(allowed));
        calls.push((format!("{what} refused a {allowed}"), addr, flags, true));
        let foreign = grpcurl_tls(&ours, &other, Some(allowed));
        calls.push((format!("{what} took a certificate from another CA"), addr, foreign, false));
        let none = grpcurl_tls(&ours, &ours, None);
        calls.push((format!("{what} took no certificate"), addr, none, false));
        let plaintext = vec!["-plaintext".to_string()];
        calls.push((format!("{what} answered plaintext"), addr, plaintext, false));
    }
    // Roles: an executor, an agent or a client may not drive an executor.
    for stem in ["executor", "kv", "client", "front"] {
        let flags = grpcurl_tls(&ours, &ours, Some(stem));
        calls.push((format!("an executor took a {stem}"), prefill.addr("grpc"), flags, false));
    }
    // Nor may a front or a client use an agent; an executor may not call the scheduler's API.
    for stem in ["front", "client"] {
        let flags = grpcurl_tls(&ours, &ours, Some(stem));
        calls.push((format!("an agent took a {stem}"), prefill_agent.addr("grpc"), flags, false));
    }
    let flags = grpcurl_tls(&ours, &ours, Some("executor"));
    calls.push(("the scheduler took an executor".to_string(), grpc, flags, false));
    // At once: a refused call takes grpcurl seconds to give up.
    let answered: Vec<bool> = std::thread::scope(|s| {
        let calls = calls.iter().map(|(_, addr, flags, _)| s.spawn(|| grpcurl_lists(*addr, flags)));
        calls.collect::<Vec<_>>().into_iter().map(|t| t.join().unwrap()).collect()
    });
    for ((failure, _, _, must), did) in calls.iter().zip(answered) {
        assert_eq!(did, *must, "{failure}");
    }
    a_client_is_told_why_an_executor_refuses_it(&ours, prefill.addr("grpc"));
    // Probe ports: plaintext health and /metrics (for kubelets and Prometheus), nothing else.
    let probes = [
        ("prefill executor", prefill.addr("probe"), "ferry.v1.Executor/Describe"),
        ("decode agent", decode_agent.addr("probe"), "ferry.v1.KvTransfer/Describe"),
        ("scheduler", scheduler.addr("probe"), "ferry.v1.Generation/Generate"),
    ];
    let mut refused = Vec::new();
    for (what, addr, api) in probes {
        let body = assert_probe_port(addr, api, what).await;
        refused.push(sum_samples(&body, "ferry_tls_handshakes_refused{").unwrap_or(0.0));
    }
    // The prefill executor refused another CA, no certificate, plaintext and four roles.
    assert!(refused[0] >= 7.0, "the prefill executor counted {} refused handshakes", refused[0]);
    // The data channel's plaintext opening (its magic) is not TLS: closed without an answer.
    let mut raw = tokio::net::TcpStream::connect(prefill_agent.addr("grpc")).await.unwrap();
    raw.write_all(b"FERRYKV1\x01").await.unwrap();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(15), raw.read(&mut buf)).await;
    let answered = matches!(read, Ok(Ok(n)) if n > 0 && !buf[..n].starts_with(&[0x15]));
    assert!(!answered, "the agent answered a plaintext data channel: {:?}", &buf[..8]);

    // The cluster still serves after all that.
    let again = run_streams(grpc, requests(4), 0, || {}).await;
    assert_same_streams(&again, &reference);
}

/// A probe port answers health checks (SERVING) and `GET /metrics` in plaintext, and refuses
/// the service's API (`api`, a method); returns the metrics.
async fn assert_probe_port(addr: SocketAddr, api: &str, what: &str) -> String {
    let addr_s = addr.to_string();
    let health = grpcurl(&["-plaintext", &addr_s, "grpc.health.v1.Health/Check"]).unwrap();
    let health_out = String::from_utf8_lossy(&health.stdout);
    assert!(health.status.success() && health_out.contains("\"SERVING\""), "{what}: {health_out}");
    let protos = concat!(env!("CARGO_MANIFEST_DIR"), "/../proto");
    let (service, _) = api.rsplit_once('/').unwrap();
    let file = match service {
        "ferry.v1.Executor" => "ferry/v1/executor.proto",
        "ferry.v1.KvTransfer" => "ferry/v1/kv_transfer.proto",
        _ => "ferry/v1/generation.proto",
    };
    let call = ["-plaintext", "-import-path", protos, "-proto", file, "-d", "{}", &addr_s, api];
    let out = grpcurl(&call).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("Unimplemented"), "{what} probe port: {err}");
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut body = String::new();
    conn.read_to_string(&mut body).await.unwrap();
    assert!(body.starts_with("HTTP/1.1 200") && body.contains("# TYPE ferry_"), "{what}: {body}");
    body
}

/// Copies `stem`'s certificate, key and CA from `from` into `to` as `tls.crt`, `tls.key`,
/// `ca.crt`, each replaced at once (written beside, then renamed), as a secret mount updates.
fn place(from: &Path, stem: &str, to: &Path) {
    for (src, dst) in [
        (format!("{stem}.pem"), "tls.crt"),
        (format!("{stem}.key"), "tls.key"),
        ("ca.pem".into(), "ca.crt"),
    ] {
        let tmp = to.join(format!(".{dst}.tmp"));
        std::fs::copy(from.join(src), &tmp).unwrap();
        std::fs::rename(&tmp, to.join(dst)).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_set_is_used_without_a_restart() {
    let dir = TempDir::new("tls-rotate").unwrap();
    let (old, new, live) = (dir.0.join("old"), dir.0.join("new"), dir.0.join("live"));
    make_certs(&old);
    make_certs(&new);
    std::fs::create_dir_all(&live).unwrap();
    place(&old, "kv", &live);
    let file = |name: &str| live.join(name).display().to_string();
    let args: Vec<String> = [
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--tls-cert".into(),
        file("tls.crt"),
        "--tls-key".into(),
        file("tls.key"),
        "--tls-ca".into(),
        file("ca.crt"),
    ]
    .to_vec();
    let agent = start("ferry-kv", &args, 1);
    let addr = agent.addr("grpc");
    let old_executor = grpcurl_tls(&old, &old, Some("executor"));
    let new_executor = grpcurl_tls(&new, &new, Some("executor"));
    assert!(grpcurl_lists(addr, &old_executor));
    assert!(!grpcurl_lists(addr, &new_executor), "a certificate of the next CA, before rotation");

    place(&new, "kv", &live);
    let rotated = wait_for(Duration::from_secs(30), || grpcurl_lists(addr, &new_executor)).await;
    assert!(rotated.is_some(), "the agent never used the rotated certificates");
    assert!(!grpcurl_lists(addr, &old_executor), "the old CA still trusted after rotation");
}

#[test]
fn plaintext_beyond_loopback_only_when_asked() {
    let check = |name: &str, args: &[&str]| {
        let out = std::process::Command::new(binary(name).unwrap())
            .args(args)
            .arg("--check-config")
            .env_remove("FERRY_PLAINTEXT")
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    for name in ["ferry-executor", "ferry-kv"] {
        let (ok, err) = check(name, &["--listen", "0.0.0.0:0"]);
        assert!(
            !ok && err.contains("--listen 0.0.0.0:0") && err.contains("--plaintext"),
            "{name}: {err}"
        );
        // (An executor also needs a way to check its scheduler there: etcd, here.)
        let etcd = ["--etcd-endpoints", "127.0.0.1:2379"];
        let (ok, err) =
            check(name, &[&["--listen", "0.0.0.0:0", "--plaintext"][..], &etcd].concat());
        assert!(ok, "{name} --plaintext: {err}");
        let (ok, err) = check(name, &["--listen", "127.0.0.1:0"]);
        assert!(ok, "{name} on loopback: {err}");
    }
    let (ok, err) =
        check("ferry-scheduler", &["--http-listen", "0.0.0.0:0", "--executor", "127.0.0.1:1"]);
    assert!(!ok && err.contains("--http-listen 0.0.0.0:0"), "{err}");
    let (ok, err) = check("ferry-scheduler", &["--tls-cert", "c.pem", "--executor", "127.0.0.1:1"]);
    assert!(!ok && err.contains("go together"), "{err}");
}
