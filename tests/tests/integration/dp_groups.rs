//! Data-parallel groups as real processes (issue 46): three simulated executors started as the
//! ranks of one group (`--dp-group moe --dp-rank R --dp-size 3`) under one `ferry-scheduler`. Each executor writes the steps it ran (`--step-trace`: round id, when
//! received and answered); the test reads the lockstep from the executors' side: every rank
//! ran every round once, no rank received round r + 1 before every rank had answered round r,
//! and an idle rank got empty steps (executors outside groups are every other test's).
//! With `--throttle-prefills` the same holds and the scheduler reports steps whose prefills it
//! held back; without, none.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ferry_tests::streams::{metric, run_streams, wait_for};
use ferry_tests::{start_scheduler, Service, TempDir};

/// One line of a `--step-trace` file.
#[derive(Debug, Clone, Copy)]
struct Traced {
    round: u64,
    received_us: u64,
    answered_us: u64,
    tokens: u64,
}

/// Every whole line of the trace at `path`. The executor writes a line in one write, but a
/// rank killed by the test may still leave an unterminated last line: it is skipped, and any
/// other line that does not parse fails the test.
fn read_trace(path: &Path) -> Vec<Traced> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let whole = text.rfind('\n').map_or("", |end| &text[..end]);
    whole
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let n = |k: &str| v[k].as_u64().unwrap();
            Traced {
                round: n("round"),
                received_us: n("received_us"),
                answered_us: n("answered_us"),
                tokens: n("tokens"),
            }
        })
        .collect()
}

/// A simulated H100 running Llama-3-8B at a tenth of real time, tracing its steps to `trace`.
fn start_sim(id: &str, trace: &Path, extra: &[&str], models: &TempDir) -> Service {
    let trace = trace.to_str().unwrap();
    let mut args = vec!["--listen", "127.0.0.1:0", "--backend", "sim", "--executor-id", id];
    args.extend(["--model-profile", "llama-3-8b", "--hardware", "h100", "--time-scale", "0.1"]);
    args.extend(["--step-trace", trace]);
    args.extend(extra);
    let env = [("FERRY_MODEL_DIR", models.0.as_os_str())];
    Service::start_with_env("ferry-executor", &args, &env, 1).unwrap()
}

/// Output length of request `i`: 8 to 48 tokens, so ranks run out of work at different times.
fn max_tokens(i: usize) -> usize {
    8 + (i * 7) % 41
}

/// Requests of mixed sizes: long prompts (prefill-heavy) among short ones.
fn requests() -> Vec<ferry_proto::v1::GenerateRequest> {
    (0..24)
        .map(|i| {
            let body = if i % 3 == 0 {
                "A long account of the harbour. ".repeat(40)
            } else {
                String::new()
            };
            let prompt = format!("Request {i}: {body}What happened next?");
            ferry_tests::streams::request(prompt, max_tokens(i) as u32, Some(i as u64))
        })
        .collect()
}

/// Asserts the group's lockstep from the ranks' traces (`killed`: a rank killed mid-run, whose
/// rounds stop); returns (rounds, rounds in which a rank ran an empty step while another
/// computed).
fn assert_lockstep(ranks: &[Vec<Traced>], killed: Option<usize>) -> (usize, usize) {
    let mut by_round: BTreeMap<u64, Vec<Traced>> = BTreeMap::new();
    for (rank, steps) in ranks.iter().enumerate() {
        assert!(!steps.is_empty(), "rank {rank} ran no step");
        let rounds: Vec<u64> = steps.iter().map(|s| s.round).collect();
        let from_one: Vec<u64> = (1..=steps.len() as u64).collect();
        assert_eq!(rounds, from_one, "rank {rank}: one step in each round from the first");
        for s in steps {
            by_round.entry(s.round).or_default().push(*s);
        }
    }
    let last_of_killed = killed.map_or(u64::MAX, |k| ranks[k].len() as u64);
    let mut dummies = 0;
    for (round, steps) in &by_round {
        let expected = ranks.len() - usize::from(*round > last_of_killed);
        assert_eq!(steps.len(), expected, "round {round}: every live rank steps once");
        let some_work = steps.iter().any(|s| s.tokens > 0);
        dummies += usize::from(some_work && steps.iter().any(|s| s.tokens == 0));
        if let Some(next) = by_round.get(&(round + 1)) {
            let last_answer = steps.iter().map(|s| s.answered_us).max().unwrap();
            let first_next = next.iter().map(|s| s.received_us).min().unwrap();
            assert!(
                first_next >= last_answer,
                "round {} reached a rank {} µs before round {round}'s last answer",
                round + 1,
                last_answer - first_next
            );
        }
    }
    (by_round.len(), dummies)
}

/// Runs the group (throttled or not, a rank killed mid-run or not); returns the steps whose
/// prefills the scheduler deferred and the requests it moved.
async fn run_group(throttle: bool, kill: bool) -> (f64, f64) {
    let models = TempDir::new("dp-models").unwrap();
    let traces = TempDir::new("dp-traces").unwrap();
    let trace = |id: &str| -> PathBuf { traces.0.join(format!("{id}.jsonl")) };
    let ranks: Vec<Service> = (0..3)
        .map(|r| {
            let rank = r.to_string();
            let group = ["--dp-group", "moe", "--dp-rank", &rank, "--dp-size", "3"];
            start_sim(&format!("rank-{r}"), &trace(&format!("rank-{r}")), &group, &models)
        })
        .collect();
    let execs: Vec<&Service> = ranks.iter().collect();
    let flags: &[&str] =
        if throttle { &["--throttle-prefills", "--prefill-schedule-interval", "4"] } else { &[] };
    let sched = start_scheduler(&execs, flags);
    let http = sched.addr("http");
    let up = wait_for(Duration::from_secs(30), || metric(http, "ferry_executors_connected") == 3.0);
    assert!(up.await.is_some(), "the scheduler drives the three ranks");
    // Once every stream has 4 tokens, the rank holding the most requests is killed.
    let grpc = sched.addr("grpc");
    let outcomes = run_streams(grpc, requests(), 0, || {}).await;
    for (i, o) in outcomes.iter().enumerate() {
        assert_eq!(o.error, "", "stream {i} failed");
        assert_eq!(o.tokens.len(), max_tokens(i), "stream {i}: missing or repeated tokens");
    }
    // Then long outputs, one a rank, and prompts arriving one after another while they decode:
    // what the throttle holds back between aligned rounds (the burst above ran mostly with
    // requests waiting, which lifts it). Once the long ones have 4 tokens, with `kill`, the
    // rank holding the most requests is killed.
    let request = ferry_tests::streams::request;
    let long: Vec<_> = (0..3).map(|i| request(format!("Decode {i}."), 48, Some(200 + i))).collect();
    let body = "More about the harbour. ".repeat(30);
    let (decoding, arrive) = tokio::sync::oneshot::channel();
    let (mut killed, mut held) = (None, 0.0);
    let fault = || {
        if kill {
            let holds = |r: usize| metric(ranks[r].addr("grpc"), "ferry_executor_requests");
            let victim = (0..3).max_by(|&a, &b| holds(a).total_cmp(&holds(b))).unwrap();
            held = holds(victim);
            ferry_tests::signal(ranks[victim].pid(), "KILL").unwrap();
            killed = Some(victim);
        }
        let _ = decoding.send(());
    };
    let prompted = async {
        let _ = arrive.await;
        let mut outcomes = Vec::new();
        for i in 0..6 {
            let prompt = request(format!("Prompt {i}: {body}"), 4, Some(300 + i));
            outcomes.extend(run_streams(grpc, vec![prompt], 0, || {}).await);
        }
        outcomes
    };
    let (decoded, prompted) = tokio::join!(run_streams(grpc, long, 4, fault), prompted);
    for (o, n) in decoded.iter().map(|o| (o, 48)).chain(prompted.iter().map(|o| (o, 4))) {
        assert_eq!((o.error.as_str(), o.tokens.len()), ("", n));
    }
    // Then a request alone: one rank computes it while the others step empty, every round.
    let lone = ferry_tests::streams::request("A lone request.".into(), 8, Some(99));
    let alone = run_streams(grpc, vec![lone], 0, || {}).await;
    assert_eq!((alone[0].error.as_str(), alone[0].tokens.len()), ("", 8));
    let deferred = metric(http, "ferry_prefills_deferred_steps");
    let moved = metric(http, "ferry_requests_moved");
    drop(sched);
    let traced: Vec<Vec<Traced>> =
        (0..3).map(|r| read_trace(&trace(&format!("rank-{r}")))).collect();
    let (rounds, dummies) = assert_lockstep(&traced, killed);
    eprintln!(
        "throttle {throttle}, killed {killed:?}: {rounds} rounds, {dummies} with an idle rank's \
         empty step beside a busy one, {deferred} steps deferred prefills, {moved} requests \
         moved ({held} held by the killed rank)"
    );
    assert!(dummies >= 8, "{dummies} rounds had an idle rank beside a busy one");
    assert_eq!(killed.is_some(), kill);
    if kill {
        assert!(held > 0.0, "the killed rank held no request");
        assert!(moved >= 1.0, "the killed rank held {held} requests and none moved");
    }
    (deferred, moved)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_parallel_group_steps_in_lockstep_rounds() {
    let (deferred, moved) = run_group(false, false).await;
    assert_eq!(deferred, 0.0, "no throttle, nothing deferred");
    assert_eq!(moved, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_data_parallel_group_defers_prefills_between_aligned_rounds() {
    let (deferred, _) = run_group(true, false).await;
    assert!(deferred > 0.0, "the throttle held no prefill back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_killed_mid_run_leaves_the_rounds_and_its_streams_move() {
    // Asserted inside: the killed rank held requests, they moved and every stream completed,
    // and the two live ranks kept stepping in rounds without it.
    run_group(false, true).await;
}
