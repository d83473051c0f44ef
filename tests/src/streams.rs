//! Many generation streams at once, with a fault injected mid-way, and the checks the fault
//! tests share: every stream complete, and token for token what an undisturbed run delivered.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ferry_proto::v1::{self, generation_client::GenerationClient};

/// What one stream delivered: its token ids, its text, how it ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Token ids, in order.
    pub tokens: Vec<u32>,
    /// Text, in order.
    pub text: String,
    /// The final event's finish reason.
    pub finish: i32,
    /// The final event's error.
    pub error: String,
    /// When each token arrived.
    pub arrived: Vec<Instant>,
}

impl Outcome {
    /// The gaps between consecutive tokens that arrived in separate events, each with the
    /// time it ended.
    pub fn gaps(&self) -> impl Iterator<Item = (Instant, Duration)> + '_ {
        self.arrived.windows(2).filter(|w| w[1] > w[0]).map(|w| (w[1], w[1] - w[0]))
    }
}

/// Runs `requests` as streams at once against the gRPC front at `grpc`; `fault` runs once
/// every stream has delivered at least `k` tokens (or ended).
pub async fn run_streams(
    grpc: SocketAddr,
    requests: Vec<v1::GenerateRequest>,
    k: usize,
    fault: impl FnOnce(),
) -> Vec<Outcome> {
    let n = requests.len();
    run_streams_until(grpc, requests, (n, k), fault).await
}

/// [`run_streams`], with `fault` run once `m` streams have delivered at least `k` tokens (or
/// ended).
pub async fn run_streams_until(
    grpc: SocketAddr,
    requests: Vec<v1::GenerateRequest>,
    (m, k): (usize, usize),
    fault: impl FnOnce(),
) -> Vec<Outcome> {
    // Over mutual TLS when the test process installed its TLS (`ferry_runtime::tls`).
    let endpoint = ferry_runtime::tls::endpoint(&grpc.to_string()).unwrap();
    let (progress_tx, mut progress_rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
    let mut tasks = Vec::new();
    for (i, req) in requests.into_iter().enumerate() {
        let endpoint = endpoint.clone();
        let progress = progress_tx.clone();
        tasks.push(tokio::spawn(async move {
            let role = ferry_runtime::tls::Role::Scheduler;
            let channel = ferry_runtime::tls::connect(&endpoint, role).await.unwrap();
            let mut client = GenerationClient::new(channel);
            let mut stream = client.generate(req).await.unwrap().into_inner();
            let mut out = Outcome {
                tokens: vec![],
                text: String::new(),
                finish: 0,
                error: String::new(),
                arrived: vec![],
            };
            let mut reported = false;
            while let Some(ev) = stream.message().await.unwrap() {
                out.tokens.extend(&ev.token_ids);
                out.arrived.extend(ev.token_ids.iter().map(|_| Instant::now()));
                out.text.push_str(&ev.text);
                if ev.finish_reason != 0 {
                    out.finish = ev.finish_reason;
                    out.error = ev.error;
                }
                if !reported && out.tokens.len() >= k {
                    reported = true;
                    let _ = progress.send(i);
                }
            }
            if !reported {
                let _ = progress.send(i);
            }
            out
        }));
    }
    drop(progress_tx);
    for _ in 0..m {
        progress_rx.recv().await;
    }
    fault();
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap());
    }
    outcomes
}

/// Every stream delivered exactly the tokens (and text) of the undisturbed run.
pub fn assert_same_streams(got: &[Outcome], undisturbed: &[Outcome]) {
    assert_eq!(got.len(), undisturbed.len());
    for (i, (g, u)) in got.iter().zip(undisturbed).enumerate() {
        assert_eq!(g.tokens, u.tokens, "stream {i} differs from the undisturbed run");
        assert_eq!(g.text, u.text, "stream {i}'s text differs from the undisturbed run");
    }
}

/// Every stream ended without error at its `max_tokens` (`ignore_eos` requests).
pub fn assert_complete(outcomes: &[Outcome], max_tokens: usize) {
    for (i, o) in outcomes.iter().enumerate() {
        assert_eq!(o.error, "", "stream {i} failed");
        assert_eq!(o.finish, v1::FinishReason::Length as i32, "stream {i}: {o:?}");
        assert_eq!(o.tokens.len(), max_tokens, "stream {i} has missing or repeated tokens");
    }
}

/// Polls `cond` every 50 ms for up to `limit`; returns how long it took, or `None`.
pub async fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if cond() {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// The sum of the samples of family `name` in `/metrics` at `http`. `name{` matches the
/// labelled family exactly; `name{a="b",c="d"` only the samples with those labels.
pub fn metric(http: SocketAddr, name: &str) -> f64 {
    try_metric(http, name).unwrap_or_else(|| panic!("no {name} in /metrics at {http}"))
}

/// [`metric`], or `None` when the service cannot be asked or exports no such sample.
pub fn try_metric(http: SocketAddr, name: &str) -> Option<f64> {
    let (_, body) = crate::http(http, "GET", "/metrics", b"").ok()?;
    sum_samples(&body, name)
}

/// The sum of the samples of `name` (as in [`metric`]) in a Prometheus text `body`.
pub fn sum_samples(body: &str, name: &str) -> Option<f64> {
    let (family, labels) = name.split_once('{').map_or((name, ""), |(f, l)| (f, l));
    let wanted: Vec<&str> = labels.split(',').filter(|l| !l.is_empty()).collect();
    let values: Vec<f64> = body
        .lines()
        .filter(|l| {
            l.strip_prefix(family).is_some_and(|rest| {
                (rest.starts_with('{') || (!name.contains('{') && rest.starts_with(' ')))
                    && wanted.iter().all(|w| rest.contains(w))
            })
        })
        .map(|l| l.rsplit_once(' ')?.1.parse().ok())
        .collect::<Option<_>>()?;
    (!values.is_empty()).then(|| values.iter().sum())
}

/// Waits until the executor at `exec` holds no request and no block.
pub async fn assert_executor_idle(exec: &crate::Service) {
    assert_executor_idle_at(exec.addr("grpc")).await;
}

/// Waits until the executor whose gRPC port is `addr` holds no request and no block.
pub async fn assert_executor_idle_at(addr: SocketAddr) {
    let exec = addr;
    let mut client =
        v1::executor_client::ExecutorClient::connect(format!("http://{exec}")).await.unwrap();
    let mut last = None;
    for _ in 0..400 {
        let d = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
        if d.num_requests == 0 && d.blocks_in_use == 0 {
            return;
        }
        last = Some(d);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("executor {exec} still holds work: {last:?}");
}

/// A request for `prompt`, `max_tokens` long (EOS ignored): greedy, or seeded sampling at
/// temperature 0.8.
pub fn request(prompt: String, max_tokens: u32, seed: Option<u64>) -> v1::GenerateRequest {
    let sampling = match seed {
        Some(seed) => {
            v1::SamplingParams { temperature: 0.8, seed: Some(seed), ..Default::default() }
        }
        None => v1::SamplingParams { temperature: 0.0, ..Default::default() },
    };
    v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Prompt(prompt)),
        sampling: Some(sampling),
        stopping: Some(v1::StoppingCriteria { max_tokens, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

/// Runs `requests` through the scheduler `sched`, killing with `kill -9`, once `after` tokens
/// have arrived, whichever of `executors` holds the most streams; checks the streams it held
/// (and no others) moved, and every stream completed `tokens` tokens exactly as `undisturbed`.
///
/// # Panics
///
/// If the killed executor held no stream, or a stream moved, stopped or differed where it
/// should not have.
pub async fn assert_streams_survive_a_kill_9(
    sched: &crate::Service,
    executors: &[crate::Service],
    (requests, after): (Vec<v1::GenerateRequest>, usize),
    undisturbed: &[Outcome],
    tokens: usize,
) {
    let held = std::cell::Cell::new(0);
    let moved_before = metric(sched.addr("http"), "ferry_requests_moved");
    let kill = || {
        let holds = |e: &crate::Service| metric(e.addr("grpc"), "ferry_executor_requests") as u64;
        let (k, n) = executors.iter().map(holds).enumerate().max_by_key(|&(_, n)| n).unwrap();
        held.set(n);
        crate::signal(executors[k].pid(), "KILL").unwrap();
    };
    let outcomes = run_streams(sched.addr("grpc"), requests, after, kill).await;
    let moved = (metric(sched.addr("http"), "ferry_requests_moved") - moved_before) as u64;
    assert!(held.get() > 0, "the killed executor held no stream: nothing was tested");
    assert_eq!(moved, held.get(), "requests moved vs requests the dead executor held");
    assert_complete(&outcomes, tokens);
    assert_same_streams(&outcomes, undisturbed);
}
