//! Every binary, started for real on port 0, answers the standard health service and serves
//! reflection that the real grpcurl (v1alpha) can list and describe; it stops cleanly on
//! SIGTERM and refuses bad flags with a clear message.

use std::process::Command;
use std::time::Duration;

use ferry_tests::{binary, grpcurl_ok, Service};

const GRACE: Duration = Duration::from_secs(10);

/// Lists, describes and health-checks one announced endpoint.
fn check_surface(addr: std::net::SocketAddr, service: &str, message: &str) {
    let target = addr.to_string();
    let list = grpcurl_ok(&["-plaintext", &target, "list"]).unwrap();
    assert!(list.lines().any(|l| l == service), "{service} missing from `list`:\n{list}");
    assert!(list.lines().any(|l| l == "grpc.health.v1.Health"), "health missing:\n{list}");

    let described = grpcurl_ok(&["-plaintext", &target, "describe", service]).unwrap();
    assert!(described.contains("is a service"), "{described}");
    assert!(described.contains("rpc "), "{described}");

    let msg = grpcurl_ok(&["-plaintext", &target, "describe", message]).unwrap();
    assert!(msg.contains("is a message"), "{msg}");

    let health = grpcurl_ok(&[
        "-plaintext",
        "-d",
        &format!(r#"{{"service":"{service}"}}"#),
        &target,
        "grpc.health.v1.Health/Check",
    ])
    .unwrap();
    assert!(health.contains("SERVING") && !health.contains("NOT_SERVING"), "{health}");
}

#[test]
fn executor_serves_health_and_reflection() {
    let mut svc = Service::start("ferry-executor", &["--listen", "127.0.0.1:0"], 1).unwrap();
    let addr = svc.addr("grpc");
    check_surface(addr, "ferry.v1.Executor", "ferry.v1.Step");
    let described =
        grpcurl_ok(&["-plaintext", &addr.to_string(), "ferry.v1.Executor/Describe"]).unwrap();
    assert!(described.contains("executor-0"), "{described}");
    assert!(svc.terminate(GRACE).unwrap().success());
}

#[test]
fn kv_agent_serves_health_and_reflection() {
    let mut svc =
        Service::start("ferry-kv", &["--listen", "127.0.0.1:0", "--node-id", "n7"], 1).unwrap();
    let addr = svc.addr("grpc");
    check_surface(addr, "ferry.v1.KvTransfer", "ferry.v1.BlockChunk");
    let described =
        grpcurl_ok(&["-plaintext", &addr.to_string(), "ferry.v1.KvTransfer/Describe"]).unwrap();
    assert!(described.contains("n7"), "{described}");
    assert!(svc.terminate(GRACE).unwrap().success());
}

#[test]
fn scheduler_serves_health_and_reflection() {
    let mut svc = Service::start(
        "ferry-scheduler",
        &["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"],
        2,
    )
    .unwrap();
    check_surface(svc.addr("grpc"), "ferry.v1.Generation", "ferry.v1.GenerateEvent");
    check_surface(svc.addr("grpc"), "ferry.v1.Admin", "ferry.v1.AdminRequest");
    assert!(svc.terminate(GRACE).unwrap().success());
}

#[test]
fn serve_hosts_every_part_in_one_process() {
    let mut svc = Service::start(
        "ferry",
        &["serve", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"],
        4,
    )
    .unwrap();
    check_surface(svc.addr("grpc"), "ferry.v1.Generation", "ferry.v1.GenerateRequest");
    check_surface(svc.addr("executor"), "ferry.v1.Executor", "ferry.v1.StepResult");
    check_surface(svc.addr("kv"), "ferry.v1.KvTransfer", "ferry.v1.TransferHeader");
    // Another process that reaches the executor's port cannot fence its scheduler out: a
    // handshake with the highest epoch but without the in-process token is refused, and the
    // system answers after it as before.
    let forged = ferry_tests::grpcurl(&[
        "-plaintext",
        "-d",
        r#"{"scheduler_id":"x","epoch":"18446744073709551615"}"#,
        &svc.addr("executor").to_string(),
        "ferry.v1.Executor/Handshake",
    ])
    .unwrap();
    let err = String::from_utf8_lossy(&forged.stderr);
    assert!(!forged.status.success() && err.contains("PermissionDenied"), "{err}");
    let body = br#"{"model":"SmolLM2-135M-Instruct","prompt":"Hello","max_tokens":4}"#;
    let (status, answer) =
        ferry_tests::http(svc.addr("http"), "POST", "/v1/completions", body).unwrap();
    assert_eq!(status, 200, "{answer}");
    assert!(svc.terminate(GRACE).unwrap().success());
}

#[test]
fn stale_epoch_is_refused() {
    let svc = Service::start("ferry-executor", &["--listen", "127.0.0.1:0"], 1).unwrap();
    let target = svc.addr("grpc").to_string();
    let ok = grpcurl_ok(&[
        "-plaintext",
        "-d",
        r#"{"scheduler_id":"a","epoch":5}"#,
        &target,
        "ferry.v1.Executor/Handshake",
    ])
    .unwrap();
    assert!(ok.contains("sessionId"), "{ok}");
    let stale = ferry_tests::grpcurl(&[
        "-plaintext",
        "-d",
        r#"{"scheduler_id":"b","epoch":4}"#,
        &target,
        "ferry.v1.Executor/Handshake",
    ])
    .unwrap();
    assert!(!stale.status.success());
    let err = String::from_utf8_lossy(&stale.stderr);
    assert!(err.contains("FailedPrecondition") && err.contains("stale scheduler epoch 4"), "{err}");
}

/// Every invalid flag, and every invalid combination, is refused at start-up: a non-zero exit,
/// the flags named, and nothing bound (no address announced).
#[test]
// One table of cases, one row per flag: splitting it would only scatter the table.
#[allow(clippy::too_many_lines)]
fn bad_flags_exit_non_zero_naming_the_flags() {
    const DRAIN: &str = "--drain-timeout must be between 1 and 86400 seconds, got 0";
    let listen = ["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"];
    let sched = |extra: &[&'static str]| [&listen[..], extra].concat();
    let serve = |extra: &[&'static str]| [&["serve"][..], &listen[..], extra].concat();
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        ("ferry-executor", vec!["--block-size", "12"], "--block-size 12 is invalid"),
        ("ferry-executor", vec!["--kv-cache-mib", "0"], "--kv-cache-mib must be at least 1"),
        ("ferry-executor", vec!["--executor-id", " "], "--executor-id must not be empty"),
        ("ferry-executor", vec!["--lease-ttl", "1"], "--lease-ttl must be between 2 and 3600"),
        ("ferry-executor", vec!["--no-such-flag"], "unexpected argument"),
        (
            "ferry-executor",
            vec!["--leadership-token-file", "/nonexistent/token"],
            "--leadership-token-file /nonexistent/token",
        ),
        (
            "ferry-scheduler",
            sched(&["--leadership-token-file", "/nonexistent/token"]),
            "--leadership-token-file /nonexistent/token",
        ),
        ("ferry-kv", vec!["--store-mib", "lots"], "invalid value"),
        ("ferry-kv", vec!["--store-mib", "0"], "--store-mib must be at least 1"),
        ("ferry-kv", vec!["--node-id", ""], "--node-id must not be empty"),
        ("ferry-kv", vec!["--cluster", "a/b"], "--cluster \"a/b\" must be non-empty"),
        ("ferry-scheduler", sched(&["--max-num-seqs", "0"]), "--max-num-seqs must be at least 1"),
        (
            "ferry-scheduler",
            sched(&["--max-num-seqs", "300", "--max-num-batched-tokens", "256"]),
            "--max-num-batched-tokens (256) must be at least --max-num-seqs (300)",
        ),
        (
            "ferry-scheduler",
            sched(&["--max-queued-requests", "0"]),
            "--max-queued-requests must be at least 1",
        ),
        (
            "ferry-scheduler",
            sched(&["--failover-timeout", "0"]),
            "--failover-timeout must be between 1",
        ),
        (
            "ferry-scheduler",
            sched(&["--executor-connect-timeout", "0"]),
            "--executor-connect-timeout must be between 1",
        ),
        ("ferry-scheduler", sched(&["--pool", "a b"]), "--pool \"a b\" must be non-empty"),
        ("ferry-scheduler", sched(&["--executor", ","]), "--executor \"\" is not an address"),
        ("ferry-scheduler", sched(&["--lease-ttl", "0"]), "--lease-ttl must be between 2 and 3600"),
        (
            "ferry-scheduler",
            vec!["--listen", "not-an-address", "--http-listen", "127.0.0.1:0"],
            "not-an-address",
        ),
        (
            "ferry-scheduler",
            [&["front"][..], &listen[..]].concat(),
            "a front needs --etcd-endpoints",
        ),
        (
            "ferry-scheduler",
            [&["front"][..], &listen[..], &["--etcd-endpoints", "127.0.0.1:1", "--pool", ""]]
                .concat(),
            "--pool \"\" must be non-empty",
        ),
        (
            "ferry",
            serve(&["--max-num-seqs", "64", "--max-num-batched-tokens", "32"]),
            "--max-num-batched-tokens (32) must be at least --max-num-seqs (64)",
        ),
        ("ferry", serve(&["--block-size", "0"]), "--block-size 0 is invalid"),
        ("ferry", serve(&["--kv-cache-mib", "0"]), "--kv-cache-mib must be at least 1"),
        ("ferry", serve(&["--store-mib", "0"]), "--store-mib must be at least 1"),
        (
            "ferry",
            serve(&["--max-queued-requests", "0"]),
            "--max-queued-requests must be at least 1",
        ),
        ("ferry", serve(&["--backend", "gpu"]), "invalid value 'gpu' for '--backend"),
        ("ferry", serve(&["--drain-timeout", "0"]), DRAIN),
        ("ferry-executor", vec!["--drain-timeout", "0"], DRAIN),
        ("ferry-kv", vec!["--drain-timeout", "86401"], "between 1 and 86400 seconds, got 86401"),
        ("ferry-scheduler", sched(&["--drain-timeout", "0"]), DRAIN),
        (
            "ferry-scheduler",
            [
                &["front"][..],
                &listen[..],
                &["--etcd-endpoints", "127.0.0.1:1", "--drain-timeout", "0"],
            ]
            .concat(),
            DRAIN,
        ),
    ];
    for (bin, args, needle) in cases {
        let out = Command::new(binary(bin).unwrap()).args(&args).output().unwrap();
        assert!(!out.status.success(), "{bin} {args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{bin} {args:?}: expected {needle:?} in:\n{err}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        if needle != "not-an-address" {
            assert!(
                !stdout.contains(" listening "),
                "{bin} {args:?} bound before refusing:\n{stdout}"
            );
        }
    }
}

#[test]
fn bench_core_prints_json_rows() {
    let out = Command::new(binary("ferry-bench").unwrap())
        .args(["core", "--quick", "--json", "--filter", "decode"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    for field in ["\"scenario\"", "\"running\"", "\"waiting\"", "\"median_us\"", "\"p99_us\""] {
        assert!(text.contains(field), "{field} missing from:\n{text}");
    }
    assert!(text.trim_start().starts_with('['), "{text}");
}

/// An executor that nothing authenticates its scheduler to (no etcd, no token file, no mutual
/// TLS) refuses an address other machines reach, naming the three ways; on loopback it starts
/// and says once, in its log, that any scheduler on the machine may drive it (issue 49).
#[test]
fn an_executor_trusting_anyone_refuses_other_machines_and_says_so_on_loopback() {
    let sim = ["--backend", "sim", "--model-profile", "llama-3-8b"];
    let out = Command::new(binary("ferry-executor").unwrap())
        .args(["--listen", "0.0.0.0:0", "--plaintext"])
        .args(sim)
        .output()
        .unwrap();
    assert!(!out.status.success(), "started reachable by anyone");
    let err = String::from_utf8_lossy(&out.stderr);
    for way in ["--etcd-endpoints", "--leadership-token-file", "--tls-cert"] {
        assert!(err.contains(way), "{way} not named in:\n{err}");
    }

    let mut child = Command::new(binary("ferry-executor").unwrap())
        .args(["--listen", "127.0.0.1:0"])
        .args(sim)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let said = std::iter::from_fn(|| rx.recv_timeout(Duration::from_mins(1)).ok())
        .any(|l| l.contains("any scheduler on this machine may drive this executor"));
    let _ = child.kill();
    let _ = child.wait();
    assert!(said, "no warning that any local scheduler may drive it");
}
