//! Coordination through a real etcd (issues 6 and 17): registration, discovery and removal when
//! a lease lapses; executors killed under load lose no request; etcd down for three lease TTLs,
//! or raft's leader of a three-member etcd killed, in mid-load, stalls no stream and moves none;
//! a standby takes over from a killed, revoked, drained or paused leader.

use std::time::{Duration, Instant};

use ferry_proto::v1::{self, executor_client::ExecutorClient};
use ferry_tests::streams::{
    assert_complete, assert_same_streams, metric, run_streams, wait_for, Outcome,
};
use ferry_tests::{grpcurl, http, signal, Etcd, Service};

const PREFIX: &str = "/ferry/default/executors/";

/// An executor with id `id` registered in `etcd` with a 2 s lease.
fn start_executor(etcd: &Etcd, id: &str) -> Service {
    start_executor_with_ttl(etcd, id, "2")
}

/// [`start_executor`] with a lease of `ttl` seconds.
fn start_executor_with_ttl(etcd: &Etcd, id: &str, ttl: &str) -> Service {
    start_executor_with(etcd, id, ttl, "64")
}

/// [`start_executor`] with a lease of `ttl` seconds and a KV cache of `kv_mib` MiB.
pub(crate) fn start_executor_with(etcd: &Etcd, id: &str, ttl: &str, kv_mib: &str) -> Service {
    start_executor_env(etcd, id, (ttl, kv_mib), &[])
}

/// [`start_executor_with`] with extra environment variables.
fn start_executor_env(
    etcd: &Etcd,
    id: &str,
    (ttl, kv_mib): (&str, &str),
    env: &[(&str, &std::ffi::OsStr)],
) -> Service {
    let endpoints = etcd.endpoints();
    let args = [
        "--listen",
        "127.0.0.1:0",
        "--kv-cache-mib",
        kv_mib,
        "--executor-id",
        id,
        "--etcd-endpoints",
        &endpoints,
        "--lease-ttl",
        ttl,
    ];
    Service::start_with_env("ferry-executor", &args, env, 1).unwrap()
}

/// A scheduler that discovers its executors through `etcd`.
fn start_scheduler(etcd: &Etcd) -> Service {
    start_scheduler_as(etcd, "scheduler-test")
}

/// A scheduler with id `id` that campaigns for the default pool and, leading, discovers its
/// executors through `etcd`; its leadership lease lasts 2 s.
pub(crate) fn start_scheduler_as(etcd: &Etcd, id: &str) -> Service {
    start_scheduler_with_ttl(etcd, id, "2")
}

/// [`start_scheduler_as`] with a leadership lease of `ttl` seconds.
fn start_scheduler_with_ttl(etcd: &Etcd, id: &str, ttl: &str) -> Service {
    start_scheduler_with(etcd, id, ttl, &[])
}

/// [`start_scheduler_with_ttl`] with `extra` flags.
pub(crate) fn start_scheduler_with(etcd: &Etcd, id: &str, ttl: &str, extra: &[&str]) -> Service {
    let endpoints = etcd.endpoints();
    let mut args = vec![
        "--scheduler-id",
        id,
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--etcd-endpoints",
        &endpoints,
        "--lease-ttl",
        ttl,
    ];
    args.extend_from_slice(extra);
    Service::start("ferry-scheduler", &args, 2).unwrap()
}

/// Waits until `sched` drives every executor in `execs` (each has its session, and the
/// scheduler has put them in rotation).
pub(crate) async fn wait_ready(sched: &Service, execs: &[&Service]) {
    for exec in execs {
        wait_for_session(exec).await;
    }
    // Each link joins the scheduler's rotation right after its session opens: wait until the
    // scheduler counts them all.
    let connected =
        || metric(sched.addr("http"), "ferry_executors_connected") >= execs.len() as f64;
    assert!(wait_for(Duration::from_secs(10), connected).await.is_some(), "links not up");
    assert!(wait_for(Duration::from_secs(10), || health(sched) == 200).await.is_some());
}

/// Waits until executor `exec` has a session from a scheduler.
async fn wait_for_session(exec: &Service) {
    let mut client =
        ExecutorClient::connect(format!("http://{}", exec.addr("grpc"))).await.unwrap();
    for _ in 0..400 {
        let d = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
        if d.session_id != 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("no scheduler opened a session to {}", exec.addr("grpc"));
}

pub(crate) fn health(sched: &Service) -> u16 {
    http(sched.addr("http"), "GET", "/health", b"").map_or(0, |r| r.0)
}

/// The request of stream `i`: greedy for even `i`, seeded sampling for odd `i`.
fn request(i: usize, max_tokens: u32) -> v1::GenerateRequest {
    let sampling = if i.is_multiple_of(2) {
        v1::SamplingParams { temperature: 0.0, ..Default::default() }
    } else {
        v1::SamplingParams { temperature: 0.8, seed: Some(1000 + i as u64), ..Default::default() }
    };
    v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Prompt(format!(
            "Story {i}: once upon a time, in a town called {}, there lived",
            ["Amber", "Birch", "Cedar", "Dune"][i % 4]
        ))),
        sampling: Some(sampling),
        stopping: Some(v1::StoppingCriteria { max_tokens, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

/// Streams `0..n`'s requests.
fn requests(n: usize, max_tokens: u32) -> Vec<v1::GenerateRequest> {
    (0..n).map(|i| request(i, max_tokens)).collect()
}

/// The fault tests' streams: this many at once, each this many tokens long.
const STREAMS: usize = 32;
const STREAM_TOKENS: u32 = 40;

/// The fault tests' streams run undisturbed against `target`: the reference that every
/// disturbed run must equal.
async fn undisturbed_streams(target: &Service) -> Vec<Outcome> {
    let outcomes =
        run_streams(target.addr("grpc"), requests(STREAMS, STREAM_TOKENS), 0, || {}).await;
    assert_complete(&outcomes, STREAM_TOKENS as usize);
    outcomes
}

/// The same streams again with `fault` injected once every stream has tokens: all complete,
/// each with exactly the undisturbed tokens and text. Returns how many requests `target`'s
/// front moved meanwhile (`ferry_requests_moved`), for the caller to check against the fault.
async fn streams_survive(
    target: &Service,
    undisturbed: &[Outcome],
    what: &str,
    fault: impl FnOnce(),
) -> u64 {
    let moved_before = metric(target.addr("http"), "ferry_requests_moved");
    let t = Instant::now();
    let outcomes =
        run_streams(target.addr("grpc"), requests(STREAMS, STREAM_TOKENS), 4, fault).await;
    let moved = (metric(target.addr("http"), "ferry_requests_moved") - moved_before) as u64;
    eprintln!("{STREAMS} streams {what}: {:?}, {moved} moved", t.elapsed());
    assert_complete(&outcomes, STREAM_TOKENS as usize);
    assert_same_streams(&outcomes, undisturbed);
    moved
}

/// A fault that signals the executor of `execs` holding the most requests when it runs (every
/// stream has tokens then, so each is on an executor), recording how many it held and which
/// one it was. The router sends a request where its prefix is cached, so which executor holds
/// the streams of a repeated run is not known in advance: the one holding most is always one
/// that holds some.
fn signal_busiest<'a>(
    execs: &'a [Service],
    sig: &'a str,
    (held, which): (&'a std::cell::Cell<u64>, &'a std::cell::Cell<usize>),
) -> impl FnOnce() + 'a {
    move || {
        let holds = |e: &Service| metric(e.addr("grpc"), "ferry_executor_requests") as u64;
        let (k, n) = execs.iter().map(holds).enumerate().max_by_key(|&(_, n)| n).unwrap();
        eprintln!("signal {sig} to {} executor of {}: it holds {n}", k + 1, execs.len());
        held.set(n);
        which.set(k);
        signal(execs[k].pid(), sig).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executors_register_are_discovered_and_dropped_when_their_lease_lapses() {
    let etcd = Etcd::start().unwrap();
    let sched = start_scheduler(&etcd);
    assert_eq!(health(&sched), 503, "no executor yet");
    let mut exec = start_executor(&etcd, "exec-a");
    let key = format!("{PREFIX}exec-a");
    let registered =
        wait_for(Duration::from_secs(30), || etcd.keys(PREFIX).unwrap() == [key.clone()]).await;
    assert!(registered.is_some(), "exec-a never registered");
    wait_for_session(&exec).await;
    let (_, metrics) = http(exec.addr("grpc"), "GET", "/metrics", b"").unwrap();
    assert!(metrics.contains("\nferry_etcd_registered 1\n"), "{metrics}");
    assert!(wait_for(Duration::from_secs(5), || health(&sched) == 200).await.is_some());
    let (status, body) = http(
        sched.addr("http"),
        "POST",
        "/v1/completions",
        br#"{"model":"SmolLM2-135M-Instruct","prompt":"Hello","max_tokens":4}"#,
    )
    .unwrap();
    assert_eq!(status, 200, "{body}");

    // Frozen (SIGSTOP): its session stays open but its keep-alives stop, so its lease lapses
    // within the TTL and the scheduler drops it.
    signal(exec.pid(), "STOP").unwrap();
    let lapsed = wait_for(Duration::from_secs(10), || etcd.keys(PREFIX).unwrap().is_empty()).await;
    let lapsed = lapsed.expect("the frozen executor's key outlived its lease");
    eprintln!("lease lapsed {lapsed:?} after SIGSTOP (TTL 2 s)");
    let dropped = wait_for(Duration::from_secs(5), || health(&sched) == 503).await;
    assert!(dropped.is_some(), "the scheduler kept an executor whose lease lapsed");

    // Thawed: it notices, registers again, and the scheduler takes it back.
    signal(exec.pid(), "CONT").unwrap();
    assert!(
        wait_for(Duration::from_secs(15), || etcd.keys(PREFIX).unwrap() == [key.clone()])
            .await
            .is_some(),
        "exec-a did not register again"
    );
    assert!(wait_for(Duration::from_secs(10), || health(&sched) == 200).await.is_some());

    // SIGTERM withdraws the key at once instead of waiting for the lease.
    let t = Instant::now();
    assert!(exec.terminate(Duration::from_secs(30)).unwrap().success());
    assert!(etcd.keys(PREFIX).unwrap().is_empty(), "drain left the key behind");
    eprintln!("SIGTERM to exit with withdrawn key: {:?}", t.elapsed());
    assert!(wait_for(Duration::from_secs(5), || health(&sched) == 503).await.is_some());

    // A KV agent registers under kv/<node> the same way, and withdraws on SIGTERM.
    let endpoints = etcd.endpoints();
    let args = ["--listen", "127.0.0.1:0", "--node-id", "node-a", "--etcd-endpoints", &endpoints];
    let mut kv = Service::start("ferry-kv", &args, 1).unwrap();
    let kv_prefix = "/ferry/default/kv/";
    let kv_key = format!("{kv_prefix}node-a");
    assert!(wait_for(Duration::from_secs(10), || etcd.keys(kv_prefix).unwrap()
        == [kv_key.clone()])
    .await
    .is_some());
    assert!(kv.terminate(Duration::from_secs(10)).unwrap().success());
    assert!(etcd.keys(kv_prefix).unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_executor_loses_no_request_and_changes_no_token() {
    let etcd = Etcd::start().unwrap();
    let sched = start_scheduler(&etcd);
    let a = start_executor(&etcd, "exec-a");
    let b = start_executor(&etcd, "exec-b");
    wait_ready(&sched, &[&a, &b]).await;

    let undisturbed = undisturbed_streams(&sched).await;

    // Same requests; once every stream has tokens, one executor dies (kill -9): exactly the
    // requests it held move.
    let (held, which) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    let mut execs = vec![a, b];
    let kill = signal_busiest(&execs, "KILL", (&held, &which));
    let moved = streams_survive(&sched, &undisturbed, "with a kill -9 mid-way", kill).await;
    assert!(held.get() > 0, "the killed executor held no stream: nothing was tested");
    assert_eq!(moved, held.get(), "requests moved vs requests the dead executor held");
    drop(execs.swap_remove(which.get()));
    assert_eq!(health(&sched), 200, "the survivor still serves");

    // Drain: SIGTERM on an executor under load hands its requests to another one.
    execs.push(start_executor(&etcd, "exec-c"));
    wait_ready(&sched, &[&execs[0], &execs[1]]).await;
    let term = signal_busiest(&execs, "TERM", (&held, &which));
    let moved =
        streams_survive(&sched, &undisturbed, "with an executor drained mid-way", term).await;
    assert!(held.get() > 0, "the drained executor held no stream: nothing was tested");
    assert_eq!(moved, held.get(), "requests moved vs requests the drained executor held");
    let drained = &mut execs[which.get()];
    assert!(drained.terminate(Duration::from_secs(30)).unwrap().success(), "drained executor exit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_past_its_drain_timeout_exits_and_its_requests_move() {
    // Long enough that no held stream ends within the 1 s drain window (the shortest
    // `--drain-timeout`): a stream alone on an executor decodes about 200 tokens/s here (CI
    // profile), so 400 leave twice the window; at 160 tokens and a 2 s window one held alone
    // finished inside it once the products got faster, and had nothing to move.
    const TOKENS: u32 = 400;
    // Listed by hand, without etcd: nothing tells the scheduler that the executor drains, so
    // it keeps the session open, and only the drain timeout ends it. Room for all eight streams
    // whole on either executor (about 46 KB of KV per token), so none is preempted and
    // recomputed (with 64 MiB most were, and the test took 90 s).
    let exec = |id: &str| {
        let args = ["--listen", "127.0.0.1:0", "--kv-cache-mib", "320", "--executor-id", id];
        let args = [&args[..], &["--drain-timeout", "1"]].concat();
        Service::start("ferry-executor", &args, 1).unwrap()
    };
    let mut execs = [exec("exec-a"), exec("exec-b")];
    let sched = ferry_tests::start_scheduler(&[&execs[0], &execs[1]], &[]);
    wait_ready(&sched, &[&execs[0], &execs[1]]).await;
    // Streams long enough that none can end within the 1 s drain window (see `TOKENS`), so
    // every request the executor held is still there to move.
    let reqs = || requests(8, TOKENS);
    let undisturbed = run_streams(sched.addr("grpc"), reqs(), 0, || {}).await;
    assert_complete(&undisturbed, TOKENS as usize);
    // Each executor's health, watched from before the drain.
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    let mut watches = Vec::new();
    for exec in &execs {
        let url = format!("http://{}", exec.addr("grpc"));
        let channel =
            tonic::transport::Endpoint::from_shared(url).unwrap().connect().await.unwrap();
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
        let all = tonic_health::pb::HealthCheckRequest { service: String::new() };
        let mut watch = health.watch(all).await.unwrap().into_inner();
        assert_eq!(watch.message().await.unwrap().unwrap().status, serving);
        watches.push(watch);
    }

    let (held, which) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    let moved_before = metric(sched.addr("http"), "ferry_requests_moved");
    let term = signal_busiest(&execs, "TERM", (&held, &which));
    let outcomes = run_streams(sched.addr("grpc"), reqs(), 4, term).await;
    let moved = (metric(sched.addr("http"), "ferry_requests_moved") - moved_before) as u64;
    assert_complete(&outcomes, TOKENS as usize);
    assert_same_streams(&outcomes, &undisturbed);
    assert!(held.get() > 0, "the drained executor held no stream: nothing was tested");
    assert_eq!(moved, held.get(), "requests moved vs requests the drained executor held");
    // Its first word on SIGTERM was NOT_SERVING; it then exited by itself, cleanly.
    let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
    let watch = &mut watches[which.get()];
    let next = watch.message().await.unwrap().expect("a health update after SIGTERM");
    assert_eq!(next.status, not_serving);
    let drained = &mut execs[which.get()];
    assert!(drained.wait_exit().is_some_and(|s| s.success()), "the drained executor did not exit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_down_for_three_ttls_mid_load_stalls_no_stream_and_moves_none() {
    const TTL: Duration = Duration::from_secs(2);
    const PROBE: usize = 64;
    // What a stream must outlast from its 48th token: the outage and etcd's restart.
    let outage_span = TTL * 3 + Duration::from_secs(1);
    let etcd = Etcd::start().unwrap();
    let sched = start_scheduler(&etcd);
    // Room for all eight streams whole (about 46 KB of KV per token): none is preempted, so
    // every gap is a step's time, not a wait for room.
    // Its forward on both threads, as before the tests' default of one: this test has the
    // machine to itself (see .config/nextest.toml).
    let threads = [("RAYON_NUM_THREADS", std::ffi::OsStr::new("2"))];
    let exec = start_executor_env(&etcd, "exec-a", ("2", "320"), &threads);
    wait_ready(&sched, &[&exec]).await;
    let metric = |name: &str| metric(sched.addr("http"), name);
    let epoch = metric("ferry_scheduler_epoch{");
    // Streams long enough that every one outlives the outage (three TTLs and etcd's restart):
    // measured on this machine rather than fixed (a fixed 256 did not always span it on a
    // machine several times faster than this one; a fixed 640 spent ~110 s of CPU here). Eight
    // streams of 64 tokens give the fastest stream's time per token; the streams last a quarter
    // more than the outage and a second from their 48th token at that pace (contexts grow,
    // and steps slow, along a stream: the real pace only makes them longer), at most 640
    // tokens (the KV room above holds eight of those whole).
    let probe = run_streams(sched.addr("grpc"), requests(8, PROBE as u32), 0, || {}).await;
    assert_complete(&probe, PROBE);
    // Timed from the 16th token on: the first steps include prefill.
    let steps = PROBE as u32 - 17;
    let pace = probe.iter().map(|o| (o.arrived[PROBE - 1] - o.arrived[16]) / steps);
    let pace = pace.min().expect("eight streams");
    let needed = outage_span.mul_f64(1.25).div_duration_f64(pace);
    let tokens = (48 + needed.ceil() as u32).clamp(160, 640);
    eprintln!("{pace:?} per token: streams of {tokens} tokens");
    let undisturbed = run_streams(sched.addr("grpc"), requests(8, tokens), 0, || {}).await;
    assert_complete(&undisturbed, tokens as usize);
    // The streams must span the outage, or the test shows nothing: say so plainly.
    let span = undisturbed.iter().map(|o| o.arrived[tokens as usize - 1] - o.arrived[48]).min();
    assert!(
        span.is_some_and(|s| s > outage_span),
        "streams last {span:?} after their 48th token, too short to span an outage of {:?}: \
         the probe misjudged the pace",
        TTL * 3
    );
    let moved_before = metric("ferry_requests_moved");

    // Once every stream has 48 tokens (a baseline of gaps), etcd dies (kill -9) for three lease
    // TTLs, then restarts on its data (another thread keeps the time, so nothing here blocks
    // the streams).
    let (outage_tx, outage_rx) = std::sync::mpsc::channel();
    let outcomes = run_streams(sched.addr("grpc"), requests(8, tokens), 48, move || {
        std::thread::spawn(move || {
            let mut etcd = etcd;
            etcd.kill(0).unwrap();
            let down = Instant::now();
            std::thread::sleep(TTL * 3);
            let up = Instant::now();
            etcd.restart(0).unwrap();
            outage_tx.send((etcd, down, up)).unwrap();
        });
    })
    .await;
    let (etcd, down, up) = outage_rx.recv().unwrap();
    assert_complete(&outcomes, tokens as usize);
    assert_same_streams(&outcomes, &undisturbed);
    for (i, o) in outcomes.iter().enumerate() {
        assert!(o.arrived.last().is_some_and(|t| *t > up), "stream {i} ended within the outage");
    }
    // No stream paused: a stream that waited for etcd would have a gap of most of the outage
    // (three TTLs); no gap during it is longer than twice the longest before it (or than twice
    // the longest of the same stretch of the streams undisturbed: contexts grow, and step times
    // with them, from the first tokens to the outage's), nor than one TTL. (This test has the
    // machine's two cores to itself, `.config/nextest.toml`: next to other tests' processes,
    // step times vary more than that.)
    // A gap counts in a window when it overlaps it (one that began during the outage and
    // ended after it is a stall of the outage too).
    let gaps = |from: Instant, to: Instant| {
        outcomes
            .iter()
            .flat_map(|o| o.gaps().skip(1))
            .filter(|&(end, gap)| end > from && end.checked_sub(gap).is_some_and(|s| s < to))
            .map(|(_, gap)| gap)
            .max()
            .expect("tokens arrived in that window")
    };
    let started = outcomes.iter().filter_map(|o| o.arrived.first()).min().copied().unwrap();
    let (before, during) = (gaps(started, down), gaps(down, up));
    let same_stretch = outcomes
        .iter()
        .zip(&undisturbed)
        .flat_map(|(o, u)| {
            (2..o.arrived.len())
                .filter(move |&j| o.arrived[j] > down && o.arrived[j - 1] < up)
                .map(move |j| u.arrived[j].saturating_duration_since(u.arrived[j - 1]))
        })
        .max()
        .unwrap_or_default();
    eprintln!(
        "etcd down {:?}: longest gap before {before:?}, during {during:?}, \
         same stretch undisturbed {same_stretch:?}",
        up - down
    );
    assert!(
        during <= before.max(same_stretch) * 2,
        "a stream stalled: {during:?} during, {before:?} before, {same_stretch:?} undisturbed"
    );
    assert!(during < TTL, "a stream stalled: {during:?} during the outage");
    assert_eq!(metric("vllm:num_preemptions_total"), 0.0, "a stream waited for room");
    // The leader never stepped down: same leadership, same epoch, and no request moved.
    assert_eq!(metric("ferry_requests_moved") - moved_before, 0.0, "requests moved");
    assert_eq!(metric("ferry_scheduler_leader{"), 1.0);
    assert_eq!(metric("ferry_scheduler_epoch{"), epoch, "the leadership changed");
    assert_eq!(session_owner(&exec).await, ("scheduler-test".to_string(), epoch as u64));
    // Registration resumes by itself (the key survives in etcd's data or is put back).
    let key = format!("{PREFIX}exec-a");
    assert!(wait_for(Duration::from_secs(15), || etcd.keys(PREFIX).unwrap() == [key.clone()])
        .await
        .is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_leader_killed_mid_load_keeps_the_ferry_leader_its_epoch_and_every_stream() {
    let mut etcd = Etcd::cluster(3).unwrap();
    let sched = start_scheduler(&etcd);
    let a = start_executor(&etcd, "exec-a");
    wait_ready(&sched, &[&a]).await;
    let metric = |name: &str| metric(sched.addr("http"), name);
    let epoch = metric("ferry_scheduler_epoch{");
    let undisturbed = undisturbed_streams(&sched).await;
    let raft = etcd.raft_leader().unwrap();
    let kill = || etcd.kill(raft).unwrap();
    let moved = streams_survive(&sched, &undisturbed, "raft's leader killed mid-way", kill).await;
    assert_eq!(moved, 0, "no request had to move");
    assert_eq!(metric("ferry_scheduler_leader{"), 1.0);
    assert_eq!(metric("ferry_scheduler_epoch{"), epoch, "the leadership changed");
    assert_eq!(session_owner(&a).await, ("scheduler-test".to_string(), epoch as u64));
    let elected = etcd.raft_leader().unwrap();
    assert_ne!(elected, raft, "the two live members elected a new raft leader");
    // Registration, discovery and serving go on through the two live members.
    let b = start_executor(&etcd, "exec-b");
    wait_ready(&sched, &[&a, &b]).await;
    let outcomes = run_streams(sched.addr("grpc"), requests(8, 24), 0, || {}).await;
    assert_complete(&outcomes, 24);
    // Both registrations, read through the new raft leader alone (exec-a's may be between a
    // lapsed lease and its new one for a moment, so waited for).
    let want = [format!("{PREFIX}exec-a"), format!("{PREFIX}exec-b")];
    let keys = || {
        let mut keys = etcd_keys_via_member(&etcd, elected);
        keys.sort();
        keys
    };
    let seen = wait_for(Duration::from_secs(15), || keys() == want).await;
    assert!(seen.is_some(), "keys through the new raft leader: {:?}", keys());
}

/// Keys under the executors' prefix, read through member `i` alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_lease_lost_mid_load_while_it_serves_moves_no_stream() {
    // etcd trouble (a raft election, a slow member) can lapse the lease of an executor that is
    // fine; revoking it is the same event on demand. The scheduler asks the executor, which
    // still serves, keeps its session, and the executor registers again by itself.
    let etcd = Etcd::start().unwrap();
    let sched = start_scheduler(&etcd);
    let a = start_executor(&etcd, "exec-a");
    wait_ready(&sched, &[&a]).await;
    let undisturbed = undisturbed_streams(&sched).await;
    let key = format!("{PREFIX}exec-a");
    let lease = member_lease(&etcd, &key);
    let revoke = || {
        etcd.ctl(&["lease", "revoke", &lease]).unwrap();
        // The registration is gone: its lease no longer exists, and the key is either absent or,
        // when the executor has already registered again (it may, within milliseconds), under
        // another lease.
        let ttl: serde_json::Value = serde_json::from_str(
            &etcd.ctl(&["lease", "timetolive", &lease, "-w", "json"]).unwrap(),
        )
        .unwrap();
        assert_eq!(ttl["ttl"].as_i64(), Some(-1), "the lease outlived its revocation: {ttl}");
        let keys = etcd.keys(PREFIX).unwrap();
        assert!(
            keys.is_empty() || member_lease(&etcd, &key) != lease,
            "revoking the lease left the key under it"
        );
    };
    let moved = streams_survive(&sched, &undisturbed, "the executor's lease revoked", revoke).await;
    assert_eq!(moved, 0, "a request moved off an executor that served on");
    assert!(
        wait_for(Duration::from_secs(15), || etcd.keys(PREFIX).unwrap() == [key.clone()])
            .await
            .is_some(),
        "exec-a did not register again"
    );
    assert_ne!(member_lease(&etcd, &key), lease, "registered again under a new lease");
    let opened = metric(sched.addr("http"), "ferry_executor_sessions_opened");
    assert_eq!(opened, 1.0, "the executor's session was closed and opened again");
}

/// The lease (in hex, as etcdctl takes it) that holds `key`.
fn member_lease(etcd: &Etcd, key: &str) -> String {
    let v: serde_json::Value =
        serde_json::from_str(&etcd.ctl(&["get", key, "-w", "json"]).unwrap()).unwrap();
    format!("{:x}", v["kvs"][0]["lease"].as_i64().expect("a key under a lease"))
}

fn etcd_keys_via_member(etcd: &Etcd, i: usize) -> Vec<String> {
    let ep = etcd.member_endpoint(i);
    let out = std::process::Command::new("etcdctl")
        .args(["--endpoints", &ep, "get", "--prefix", "--keys-only", PREFIX])
        .env("ETCDCTL_API", "3")
        .output()
        .unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

/// The executor's session owner and epoch.
pub(crate) async fn session_owner(exec: &Service) -> (String, u64) {
    let mut client =
        ExecutorClient::connect(format!("http://{}", exec.addr("grpc"))).await.unwrap();
    let d = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
    (d.scheduler_id, d.epoch)
}

/// The lease of the pool's current leader key (the candidate key created first), in hex.
fn leader_lease(etcd: &Etcd) -> String {
    let out = etcd.ctl(&["get", "--prefix", "/ferry/default/scheduler/", "-w", "json"]).unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let kvs = v["kvs"].as_array().expect("candidate keys");
    let leader = kvs.iter().min_by_key(|kv| kv["create_revision"].as_i64().unwrap()).unwrap();
    format!("{:x}", leader["lease"].as_i64().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_handshake_is_refused_and_the_leaders_session_runs_on() {
    let etcd = Etcd::start().unwrap();
    let exec = start_executor(&etcd, "exec-a");
    let sched = start_scheduler(&etcd);
    wait_ready(&sched, &[&exec]).await;
    let mut client =
        ExecutorClient::connect(format!("http://{}", exec.addr("grpc"))).await.unwrap();
    let before = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
    assert!(before.session_id > 0 && before.epoch > 0, "{before:?}");
    // The leader published its token in etcd, under its lease.
    let token_key = format!("/ferry/default/leadership/{}", before.epoch);
    assert_eq!(etcd.keys(&token_key).unwrap().len(), 1, "no leadership token at {token_key}");
    let forge = |epoch, leadership_token| v1::HandshakeRequest {
        scheduler_id: "intruder".into(),
        epoch,
        leadership_token,
        ..Default::default()
    };
    // A higher epoch would fence the leader out until a restart; the current one would take
    // its session over. Neither has the token etcd holds for the epoch.
    let attempts = [
        ("epoch u64::MAX", forge(u64::MAX, Vec::new())),
        ("the current epoch without a token", forge(before.epoch, Vec::new())),
        ("the current epoch with a made-up token", forge(before.epoch, vec![7; 32])),
    ];
    for (what, forged) in attempts {
        let status = client.handshake(forged).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::PermissionDenied, "{what}: {status}");
    }
    let after = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
    assert_eq!(
        (after.session_id, after.epoch, after.scheduler_id.as_str()),
        (before.session_id, before.epoch, before.scheduler_id.as_str()),
        "the leader's session stands"
    );
    // And it serves: new streams complete through the same session.
    let outcomes = run_streams(sched.addr("grpc"), requests(4, 8), 0, || {}).await;
    assert_complete(&outcomes, 8);
    let last = client.describe(v1::DescribeRequest {}).await.unwrap().into_inner();
    assert_eq!(last.session_id, before.session_id);
    assert!(last.steps_executed > before.steps_executed, "the session ran the streams");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_scheduler_takes_over_and_a_deposed_leader_is_fenced() {
    const TTL: Duration = Duration::from_secs(2);
    let etcd = Etcd::start().unwrap();
    let exec = start_executor(&etcd, "exec-a");
    let mut scheds = [Some(start_scheduler_as(&etcd, "s0")), None];
    assert!(wait_for(Duration::from_secs(30), || health(scheds[0].as_ref().unwrap()) == 200)
        .await
        .is_some());
    scheds[1] = Some(start_scheduler_as(&etcd, "s1"));
    // s1 stands by once its candidate key is in the election, beside the leader's.
    let candidates = || etcd.keys("/ferry/default/scheduler/").unwrap().len() == 2;
    assert!(wait_for(Duration::from_secs(10), candidates).await.is_some(), "s1 never campaigned");
    assert_eq!(health(scheds[1].as_ref().unwrap()), 503, "a standby drives no executor");
    // It says it stands by and where the leader is: on HTTP, Generation and Admin alike.
    let leader_at = scheds[0].as_ref().unwrap().addr("grpc").to_string();
    let standby = scheds[1].as_ref().unwrap();
    let says = |body: &str| body.contains("standby of pool") && body.contains(&leader_at);
    let body =
        || http(standby.addr("http"), "GET", "/health", b"").map(|r| r.1).unwrap_or_default();
    assert!(
        wait_for(Duration::from_secs(10), || says(&body())).await.is_some(),
        "the standby's /health never named the leader: {}",
        body()
    );
    let (status, completion) =
        http(standby.addr("http"), "POST", "/v1/completions", br#"{"prompt":"Hi","max_tokens":2}"#)
            .unwrap();
    assert!(status == 503 && says(&completion), "{status} {completion}");
    let target = standby.addr("grpc").to_string();
    let out = grpcurl(&["-plaintext", &target, "ferry.v1.Admin/ListExecutors"]).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("Unavailable") && says(&err), "{err}");
    let (owner, first_epoch) = session_owner(&exec).await;
    assert_eq!(owner, "s0");

    // The leader's lease revoked by hand: it stops at once, the standby leads with a newer
    // epoch, and the executor serves only the new leader.
    etcd.ctl(&["lease", "revoke", &leader_lease(&etcd)]).unwrap();
    let s1 = scheds[1].as_ref().unwrap();
    assert!(wait_for(TTL + Duration::from_secs(1), || health(s1) == 200).await.is_some());
    let s0 = scheds[0].as_ref().unwrap();
    assert!(wait_for(Duration::from_secs(1), || health(s0) == 503).await.is_some());
    let (owner, epoch) = session_owner(&exec).await;
    assert_eq!(owner, "s1");
    assert!(epoch > first_epoch, "the new leader's epoch {epoch} is not above {first_epoch}");
    let metric = |s: &Service, name: &str| metric(s.addr("http"), name);
    assert_eq!(metric(s1, "ferry_scheduler_leader{"), 1.0);
    assert_eq!(metric(s1, "ferry_scheduler_epoch{"), epoch as f64);
    assert_eq!(metric(s0, "ferry_scheduler_leader{"), 0.0);
    // A stale leader that tried anyway, with the deposed epoch, is refused by the executor
    // (the real grpcurl, speaking for s0), and the new leader's session is untouched.
    let stale = ferry_tests::grpcurl(&[
        "-plaintext",
        "-d",
        &format!(r#"{{"scheduler_id":"s0","epoch":{first_epoch}}}"#),
        &exec.addr("grpc").to_string(),
        "ferry.v1.Executor/Handshake",
    ])
    .unwrap();
    let err = String::from_utf8_lossy(&stale.stderr);
    assert!(!stale.status.success() && err.contains("stale scheduler epoch"), "{err}");
    assert_eq!(session_owner(&exec).await, ("s1".to_string(), epoch));
    let (status, _) = http(
        s0.addr("http"),
        "POST",
        "/v1/completions",
        br#"{"model":"SmolLM2-135M-Instruct","prompt":"Hi","max_tokens":2}"#,
    )
    .unwrap();
    assert_eq!(status, 503, "the deposed leader must not schedule");

    // kill -9 of the leader, three times: the standby leads (after the dead leader's lease
    // lapses, a TTL).
    let mut leader = 1;
    let mut times = Vec::new();
    for _ in 0..3 {
        let old = scheds[leader].take().unwrap();
        let killed = Instant::now();
        signal(old.pid(), "KILL").unwrap();
        drop(old);
        let standby = 1 - leader;
        let id = format!("s{standby}");
        let mut took = None;
        while killed.elapsed() < Duration::from_secs(10) {
            if session_owner(&exec).await.0 == id {
                took = Some(killed.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // How long it took is reported below, not asserted (a measurement, on a shared
        // machine); that it happened within the deadline is.
        times.push(took.expect("the standby never took over within 10 s"));
        assert!(wait_for(Duration::from_secs(5), || health(scheds[standby].as_ref().unwrap())
            == 200)
        .await
        .is_some());
        scheds[leader] = Some(start_scheduler_as(&etcd, &format!("s{leader}")));
        leader = standby;
    }
    times.sort();
    eprintln!(
        "leader failover (kill -9 to new session), TTL {TTL:?}: median {:?}, worst {:?}",
        times[1], times[2]
    );
}

/// A front in its own process that follows the pool's leader through `etcd`.
pub(crate) fn start_front(etcd: &Etcd) -> Service {
    start_front_with(etcd, &[])
}

/// [`start_front`] with `extra` flags.
pub(crate) fn start_front_with(etcd: &Etcd, extra: &[&str]) -> Service {
    let endpoints = etcd.endpoints();
    let mut args = vec![
        "front",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--etcd-endpoints",
        &endpoints,
        "--lease-ttl",
        "2",
    ];
    args.extend_from_slice(extra);
    Service::start("ferry-scheduler", &args, 2).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_scheduler_breaks_no_stream() {
    let etcd = Etcd::start().unwrap();
    let exec = start_executor(&etcd, "exec-a");
    let s0 = start_scheduler_as(&etcd, "s0");
    wait_ready(&s0, &[&exec]).await;
    let s1 = start_scheduler_as(&etcd, "s1");
    let front = start_front(&etcd);
    assert!(wait_for(Duration::from_secs(10), || health(&front) == 200).await.is_some());
    // A front serves no Admin API of its own: the call says where it is served.
    let out =
        grpcurl(&["-plaintext", &front.addr("grpc").to_string(), "ferry.v1.Admin/ListRequests"])
            .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let leader_at = s0.addr("grpc").to_string();
    assert!(
        !out.status.success() && err.contains("Unimplemented") && err.contains(&leader_at),
        "{err}"
    );

    let undisturbed = undisturbed_streams(&front).await;

    // Same requests through the front; once every stream has tokens, the leader dies.
    let pid = s0.pid();
    let kill = || signal(pid, "KILL").unwrap();
    let moved =
        streams_survive(&front, &undisturbed, "through a front, leader killed mid-way", kill).await;
    assert_eq!(moved, STREAMS as u64, "every stream was on the dead leader and moved");
    assert_eq!(session_owner(&exec).await.0, "s1", "the standby leads now");

    // Drain: SIGTERM on the leader resigns at once; the fronts move its streams.
    let s0 = start_scheduler_as(&etcd, "s0");
    let mut s1 = s1;
    let pid = s1.pid();
    let term = || signal(pid, "TERM").unwrap();
    let moved =
        streams_survive(&front, &undisturbed, "through a front, leader drained mid-way", term)
            .await;
    assert_eq!(moved, STREAMS as u64, "every stream was on the drained leader and moved");
    assert!(s1.terminate(Duration::from_secs(30)).unwrap().success(), "drained leader exit");
    assert_eq!(session_owner(&exec).await.0, "s0");

    // Deposed alive: s0's lease revoked mid-load. Its streams move at once, not after its
    // failover timeout (an hour here: a stream that waited for it would hang the test).
    drop(s0);
    let s0 = start_scheduler_with(&etcd, "s0", "2", &["--failover-timeout", "3600"]);
    wait_ready(&s0, &[&exec]).await;
    let s1 = start_scheduler_as(&etcd, "s1");
    let candidates = || etcd.keys("/ferry/default/scheduler/").unwrap().len() == 2;
    assert!(wait_for(Duration::from_secs(10), candidates).await.is_some(), "s1 never campaigned");
    let lease = leader_lease(&etcd);
    let revoke = || {
        etcd.ctl(&["lease", "revoke", &lease]).unwrap();
    };
    let moved =
        streams_survive(&front, &undisturbed, "through a front, leader deposed mid-way", revoke)
            .await;
    assert_eq!(moved, STREAMS as u64, "every stream was on the deposed leader and moved");
    assert_eq!(session_owner(&exec).await.0, "s1");
    assert_eq!(metric(s0.addr("http"), "ferry_scheduler_leader{"), 0.0, "s0 was deposed");

    // Paused (SIGSTOP): s1 cannot notice anything, its lease lapses and s0 (which campaigned
    // again) is elected while s1 still holds the front's streams open. The front moves them when
    // the election names s0, not when s1 resumes: s1 stays stopped until every stream is done.
    assert!(wait_for(Duration::from_secs(10), candidates).await.is_some(), "s0 never campaigned");
    let paused = s1.pid();
    let pause = || signal(paused, "STOP").unwrap();
    let survived = streams_survive(&front, &undisturbed, "through a front, leader paused", pause);
    let moved = tokio::time::timeout(Duration::from_mins(2), survived).await;
    signal(paused, "CONT").unwrap();
    let moved = moved.expect("the streams waited for the paused leader to resume");
    assert_eq!(moved, STREAMS as u64, "every stream was on the paused leader and moved");
    assert_eq!(session_owner(&exec).await.0, "s0", "s0 leads after s1's lease lapsed");
}
