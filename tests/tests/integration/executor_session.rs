//! A real `ferry-executor` process driven over its gRPC session the way a scheduler drives it:
//! handshake, a step stream that prefills and decodes the real model, a bad step refused with
//! `INVALID_ARGUMENT`, a newer epoch taking over and a stale one refused, a scheduler that
//! tokenizes for another model refused; a stream or reset without the session's secret, and a
//! second stream of a session, refused while the session runs on.

// Each test is one end-to-end scenario, read top to bottom; splitting one would scatter it.
#![allow(clippy::too_many_lines)]

use std::time::Duration;

use ferry_model::ModelFile;
use ferry_proto::v1::{self, executor_client::ExecutorClient};
use ferry_tests::Service;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// A step stream for session `hs` fed by `rx`, presenting `secret` (the handshake's, unless a
/// test forges one).
fn with_secret<T>(message: T, secret: &[u8]) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    let hex = ferry_runtime::secret::to_hex(secret).parse().unwrap();
    request.metadata_mut().insert(ferry_runtime::secret::SESSION_SECRET_HEADER, hex);
    request
}

fn prefill_then_decode(session_id: u64, epoch: u64, prompt: &[u32], step_id: u64) -> v1::Step {
    v1::Step {
        session_id,
        epoch,
        step_id,
        new_requests: vec![v1::NewRequest {
            id: 1,
            prompt_token_ids: prompt.to_vec(),
            block_ids: (0..8).collect(),
            ..Default::default()
        }],
        work: vec![v1::ScheduledWork {
            id: 1,
            key: v1::WorkKey::Prompt.into(),
            num_tokens: prompt.len() as u32,
            draft_token_ids: vec![],
            loop_index: 0,
        }],
        total_num_tokens: prompt.len() as u32,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_runs_the_model_and_refuses_bad_steps() {
    let model = ModelFile::open(None).unwrap();
    let tok = &model.tokenizer;
    let svc =
        Service::start("ferry-executor", &["--listen", "127.0.0.1:0", "--kv-cache-mib", "64"], 1)
            .unwrap();
    let mut client = ExecutorClient::connect(format!("http://{}", svc.addr("grpc"))).await.unwrap();
    let hs = client
        .handshake(v1::HandshakeRequest {
            scheduler_id: "test".into(),
            epoch: 3,
            expected_model: String::new(),
            expected_fingerprint: model.fingerprint.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let info = hs.info.unwrap();
    assert_eq!(info.model, "SmolLM2-135M-Instruct");
    assert_eq!(info.model_fingerprint, model.fingerprint);
    assert!(info.num_blocks > 8, "{info:?}");
    assert_eq!(info.eos_token_ids, tok.eog_token_ids);

    assert_eq!(hs.session_secret.len(), ferry_runtime::secret::LEN, "a session secret");
    let (tx, rx) = mpsc::channel(4);
    let stream = with_secret(ReceiverStream::new(rx), &hs.session_secret);
    let mut results = client.session(stream).await.unwrap().into_inner();
    let prompt = tok.encode("The capital of France is").unwrap();
    tx.send(prefill_then_decode(hs.session_id, 3, &prompt, 1)).await.unwrap();
    let mut generated = Vec::new();
    let first = results.message().await.unwrap().unwrap();
    generated.extend(&first.outputs[0].token_ids);

    // Someone who knows the session id and epoch (Describe shows them) but not the secret:
    // a stream without it, or with another, and a reset without it, are refused; a second
    // stream even with the secret is refused while the first runs. The session goes on.
    let described = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
    assert_eq!((described.session_id, described.epoch), (hs.session_id, 3));
    let forged = ferry_runtime::secret::random();
    for (what, secret) in [("no secret", &[][..]), ("another secret", &forged[..])] {
        let (ftx, frx) = mpsc::channel(1);
        let mut refused = client
            .session(with_secret(ReceiverStream::new(frx), secret))
            .await
            .unwrap()
            .into_inner();
        ftx.send(v1::Step {
            session_id: hs.session_id,
            epoch: 3,
            step_id: 100,
            ..Default::default()
        })
        .await
        .unwrap();
        let status = refused.message().await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::PermissionDenied, "{what}: {status}");
    }
    let (ftx, frx) = mpsc::channel(1);
    let second = with_secret(ReceiverStream::new(frx), &hs.session_secret);
    let mut second = client.session(second).await.unwrap().into_inner();
    ftx.send(v1::Step { session_id: hs.session_id, epoch: 3, step_id: 100, ..Default::default() })
        .await
        .unwrap();
    let status = second.message().await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::AlreadyExists, "{status}");
    let reset = v1::ResetRequest { session_id: hs.session_id, epoch: 3 };
    let status = client.reset(reset).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status}");
    let described = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
    assert_eq!(described.num_requests, 1, "the refused calls changed nothing");
    for step_id in 2..5u64 {
        let mut step =
            v1::Step { session_id: hs.session_id, epoch: 3, step_id, ..Default::default() };
        step.work.push(v1::ScheduledWork {
            id: 1,
            key: v1::WorkKey::Decode.into(),
            num_tokens: 1,
            draft_token_ids: vec![],
            loop_index: 0,
        });
        step.total_num_tokens = 1;
        tx.send(step).await.unwrap();
        let r = results.message().await.unwrap().unwrap();
        assert_eq!(r.step_id, step_id);
        generated.extend(&r.outputs[0].token_ids);
    }
    assert!(tok.decode(&generated).starts_with(" Paris"), "{:?}", tok.decode(&generated));

    // A bad step ends the stream with INVALID_ARGUMENT and a message naming the problem.
    let bad = v1::Step {
        session_id: hs.session_id,
        epoch: 3,
        step_id: 9,
        total_num_tokens: 5,
        ..Default::default()
    };
    tx.send(bad).await.unwrap();
    let status = results.message().await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains("total_num_tokens is 5"), "{status}");
    let described = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
    assert_eq!(described.num_requests, 1, "the refused step changed nothing");

    // A newer epoch takes over and starts empty; the old epoch is refused.
    let hs2 = client
        .handshake(v1::HandshakeRequest {
            scheduler_id: "new".into(),
            epoch: 4,
            expected_model: String::new(),
            expected_fingerprint: String::new(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let stale = client
        .handshake(v1::HandshakeRequest {
            scheduler_id: "old".into(),
            epoch: 3,
            expected_model: String::new(),
            expected_fingerprint: String::new(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(stale.code(), tonic::Code::FailedPrecondition);
    // A scheduler tokenizing for another model is refused, whatever its epoch, and the
    // session stays the current one.
    let other_model = client
        .handshake(v1::HandshakeRequest {
            scheduler_id: "other-model".into(),
            epoch: 5,
            expected_model: String::new(),
            expected_fingerprint: "0123456789abcdef".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(other_model.code(), tonic::Code::FailedPrecondition);
    let why = other_model.message();
    assert!(why.contains(&model.fingerprint) && why.contains("0123456789abcdef"), "{why}");
    let described = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
    assert_eq!(
        (described.num_requests, described.session_id, described.scheduler_id.as_str()),
        (0, hs2.session_id, "new")
    );
    let (tx2, rx2) = mpsc::channel(1);
    let old = with_secret(ReceiverStream::new(rx2), &hs.session_secret);
    let mut old = client.session(old).await.unwrap().into_inner();
    tx2.send(prefill_then_decode(hs.session_id, 3, &prompt, 1)).await.unwrap();
    let refused =
        tokio::time::timeout(Duration::from_secs(30), old.message()).await.unwrap().unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    drop(svc);
}

/// Without etcd, an executor given `--leadership-token-file` opens a session only for a
/// handshake presenting that token (a bad file is refused at start-up: `grpc_surface`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_executor_with_a_token_file_opens_sessions_only_for_its_token() {
    let dir = std::env::temp_dir().join(format!("ferry-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    let token = ferry_runtime::secret::random();
    std::fs::write(&file, ferry_runtime::secret::to_hex(&token) + "\n").unwrap();
    let args = ["--listen", "127.0.0.1:0", "--kv-cache-mib", "64", "--leadership-token-file"];
    let path = file.to_str().unwrap();
    let svc = Service::start("ferry-executor", &[&args[..], &[path]].concat(), 1).unwrap();
    let mut client = ExecutorClient::connect(format!("http://{}", svc.addr("grpc"))).await.unwrap();
    let hello = |epoch, leadership_token| v1::HandshakeRequest {
        scheduler_id: "s".into(),
        epoch,
        leadership_token,
        ..Default::default()
    };
    for (what, req) in [("no token", hello(u64::MAX, vec![])), ("another", hello(1, vec![1; 32]))] {
        let status = client.handshake(req).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::PermissionDenied, "{what}: {status}");
    }
    let described = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
    assert_eq!((described.session_id, described.epoch), (0, 0), "the refusals changed nothing");
    let hs = client.handshake(hello(1, token)).await.unwrap().into_inner();
    assert!(hs.session_id > 0);
    drop(svc);
    let _ = std::fs::remove_dir_all(dir);
}

/// Request `id`'s decode of one token.
fn decode(id: u64) -> v1::ScheduledWork {
    v1::ScheduledWork {
        id,
        key: v1::WorkKey::Decode.into(),
        num_tokens: 1,
        draft_token_ids: vec![],
        loop_index: 0,
    }
}
/// A new request of `prompt` in `block`.
fn new(id: u64, prompt: Vec<u32>, block: u32) -> v1::NewRequest {
    v1::NewRequest { id, prompt_token_ids: prompt, block_ids: vec![block], ..Default::default() }
}

/// A request whose data breaks a rule or a limit is refused alone — the step runs without it,
/// the result names it, and the other request on the executor goes on exactly as it would
/// have; a step past `--max-step-bytes` is refused whole with the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_fails_alone_and_the_session_runs_on_exactly() {
    let model = ModelFile::open(None).unwrap();
    let prompt = model.tokenizer.encode("The capital of France is").unwrap();
    let args = [
        "--listen",
        "127.0.0.1:0",
        "--kv-cache-mib",
        "64",
        "--max-live-requests",
        "3",
        "--max-step-bytes",
        "65536",
    ];
    let svc = Service::start("ferry-executor", &args, 1).unwrap();
    let mut client = ExecutorClient::connect(format!("http://{}", svc.addr("grpc"))).await.unwrap();
    let info = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner().info.unwrap();
    assert_eq!((info.max_live_requests, info.max_step_bytes), (3, 65536), "the handshake says");
    // Request 1's tokens over `steps` steps, with `tamper` adding to each decode step the parts
    // of other requests, and what each step's result refused.
    let session_client = client.clone();
    let run = |epoch: u64, steps: u64, tamper: fn(u64, &mut v1::Step)| {
        let mut client = session_client.clone();
        let prompt = prompt.clone();
        async move {
            let hs = client
                .handshake(v1::HandshakeRequest {
                    scheduler_id: "test".into(),
                    epoch,
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            let (tx, rx) = mpsc::channel(4);
            let stream = with_secret(ReceiverStream::new(rx), &hs.session_secret);
            let mut results = client.session(stream).await.unwrap().into_inner();
            tx.send(prefill_then_decode(hs.session_id, epoch, &prompt, 1)).await.unwrap();
            let first = results.message().await.unwrap().unwrap();
            let mut tokens = first.outputs[0].token_ids.clone();
            let mut refused = Vec::new();
            for step_id in 2..=steps {
                let mut step =
                    v1::Step { session_id: hs.session_id, epoch, step_id, ..Default::default() };
                step.work.push(decode(1));
                step.total_num_tokens = 1;
                tamper(step_id, &mut step);
                tx.send(step).await.unwrap();
                let r = results.message().await.unwrap().unwrap();
                assert_eq!(r.outputs.len(), 1, "only request 1 samples: {r:?}");
                tokens.extend(&r.outputs[0].token_ids);
                refused.push(r.refused.into_iter().map(|r| (r.id, r.reason)).collect::<Vec<_>>());
            }
            (tokens, refused, tx, results, hs.session_id)
        }
    };
    let (tokens, refused, tx, mut results, session) = run(3, 6, |step_id, step| match step_id {
        2 => {
            step.new_requests.push(new(2, vec![1, 2, 999_999], 20));
            step.work.push(v1::ScheduledWork {
                id: 2,
                key: v1::WorkKey::Prompt.into(),
                num_tokens: 3,
                draft_token_ids: vec![],
                loop_index: 0,
            });
            step.total_num_tokens += 3;
        }
        3 => {
            for (id, block) in [(3, 21), (4, 22), (5, 23)] {
                step.new_requests.push(new(id, vec![1, 2, 3], block));
            }
        }
        4 => {
            step.work.push(decode(2));
            step.total_num_tokens += 1;
        }
        5 => step.finished_ids.extend([2, 3, 4, 5]),
        _ => {}
    })
    .await;
    let ids: Vec<Vec<u64>> =
        refused.iter().map(|r| r.iter().map(|(id, _)| *id).collect()).collect();
    assert_eq!(ids, [vec![2], vec![5], vec![2], vec![], vec![]], "{refused:?}");
    assert!(refused[0][0].1.contains("outside the vocabulary"), "{refused:?}");
    assert!(refused[1][0].1.contains("--max-live-requests"), "{refused:?}");
    assert_eq!(refused[2][0].1, refused[0][0].1, "named again with its reason");
    let described = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
    assert_eq!(described.num_requests, 1, "only request 1 is held");
    // A step past --max-step-bytes is refused whole (gRPC's limit), naming the limit.
    let huge = v1::Step {
        session_id: session,
        epoch: 3,
        step_id: 7,
        new_requests: vec![new(9, vec![40_000; 30_000], 30)],
        ..Default::default()
    };
    tx.send(huge).await.unwrap();
    let status = results.message().await.unwrap_err();
    assert!(status.message().contains("65536"), "{status}");
    // Request 1's tokens are those of an undisturbed run.
    let (clean, refused, ..) = run(4, 6, |_, _| {}).await;
    assert!(refused.iter().all(Vec::is_empty));
    assert_eq!(tokens, clean);
    assert!(model.tokenizer.decode(&tokens).starts_with(" Paris"));
    drop(svc);
}

/// Scheduler shards: epochs are fenced per pool (each pool elects its leader on its own), an
/// executor whose session of one pool still streams tells another pool's scheduler to come
/// back (`UNAVAILABLE`) and takes it once that stream ends, and an executor labelled with a
/// pool (`--pool`) opens sessions for that pool only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_fenced_per_pool_and_a_labelled_executor_serves_its_pool_only() {
    let args = ["--listen", "127.0.0.1:0", "--kv-cache-mib", "64"];
    let svc = Service::start("ferry-executor", &args, 1).unwrap();
    let mut client = ExecutorClient::connect(format!("http://{}", svc.addr("grpc"))).await.unwrap();
    let hello = |pool: &str, epoch| v1::HandshakeRequest {
        scheduler_id: format!("sched-{pool}"),
        epoch,
        pool: pool.into(),
        ..Default::default()
    };
    let a = client.handshake(hello("a", 10)).await.unwrap().into_inner();
    let (tx, rx) = mpsc::channel(4);
    let stream = with_secret(ReceiverStream::new(rx), &a.session_secret);
    let mut results = client.session(stream).await.unwrap().into_inner();
    let step = v1::Step { session_id: a.session_id, epoch: 10, step_id: 1, ..Default::default() };
    tx.send(step).await.unwrap();
    results.message().await.unwrap().expect("pool a's first step ran");

    // Pool b (an older epoch: another pool's count) waits while a's stream lives.
    let busy = client.handshake(hello("b", 5)).await.unwrap_err();
    assert_eq!(busy.code(), tonic::Code::Unavailable, "{busy}");
    assert!(busy.message().contains("\"a\""), "names the pool holding it: {busy}");
    let described = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
    assert_eq!((described.session_id, described.epoch), (a.session_id, 10), "a's session runs on");

    // Pool a lets go (its shard no longer owns the executor): b's handshake opens.
    drop((tx, results));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let b = loop {
        match client.handshake(hello("b", 5)).await {
            Ok(hs) => break hs.into_inner(),
            Err(s) if s.code() == tonic::Code::Unavailable => {
                assert!(tokio::time::Instant::now() < deadline, "b never got the executor: {s}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(s) => panic!("pool b refused: {s}"),
        }
    };
    let described = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
    assert_eq!((described.session_id, described.epoch), (b.session_id, 5));

    // Pool a's fence still stands: its older epoch is refused, naming the newest.
    let stale = client.handshake(hello("a", 9)).await.unwrap_err();
    assert_eq!(stale.code(), tonic::Code::FailedPrecondition, "{stale}");
    assert_eq!(ferry_proto::fencing::newest_epoch(&stale), Some(10));
    let again = client.handshake(hello("a", 10)).await.unwrap().into_inner();
    assert!(again.session_id > b.session_id);
    drop(svc);

    // Labelled: pool a only.
    let labelled =
        Service::start("ferry-executor", &[&args[..], &["--pool", "a"]].concat(), 1).unwrap();
    let mut client =
        ExecutorClient::connect(format!("http://{}", labelled.addr("grpc"))).await.unwrap();
    let other = client.handshake(hello("b", 1)).await.unwrap_err();
    assert_eq!(other.code(), tonic::Code::FailedPrecondition, "{other}");
    assert!(other.message().contains("--pool"), "{other}");
    let described = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
    assert_eq!(described.session_id, 0, "the refusal opened nothing");
    client.handshake(hello("a", 1)).await.expect("its own pool's scheduler opens");
}
