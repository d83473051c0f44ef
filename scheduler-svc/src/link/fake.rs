//! A fake executor for the async shell's unit tests: it answers each step the way the real
//! engine does — a token for every request whose scheduled work completes its sequence — with
//! tokens chosen by a function of (request id, position), so a request continued elsewhere gets
//! the tokens an undisturbed run would have had. No model, no sockets: a link over channels.

use std::collections::HashMap;
use std::sync::Arc;

use ferry_proto::v1;
use ferry_sched_core::{Scheduler, SchedulerConfig};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use super::step_loop::Session;
use super::LinkHandle;
use crate::metrics::SchedulerMetrics;

/// The token at `position` (0-based over prompt and output) of the request with wire id `id`.
pub(crate) type TokenFn = Arc<dyn Fn(u64, usize) -> u32 + Send + Sync>;

/// The end-of-sequence id the fake executor states.
pub(crate) const FAKE_EOS: u32 = 2;
/// The fingerprint of the model the fake executors run (a front's tests serve it under it).
pub(crate) const FAKE_FINGERPRINT: &str = "fake-model";

/// A prompt holding this token is refused by the fake executor, as the real one refuses a
/// request whose data breaks a rule: alone, named in every later step until it is finished.
pub(crate) const FAKE_REFUSED_TOKEN: u32 = 4093;

/// A running fake executor; dropping it (or [`FakeExecutor::kill`]) ends its session as a
/// `kill -9` would: the link's result stream ends.
pub(crate) struct FakeExecutor {
    task: tokio::task::JoinHandle<()>,
    seeds: Seeds,
}

/// The sampling seed of each request a fake executor was given, in order.
type Seeds = Arc<std::sync::Mutex<Vec<Option<u64>>>>;

impl FakeExecutor {
    /// Ends the session at once.
    pub(crate) fn kill(&self) {
        self.task.abort();
    }

    /// The sampling seed each new request arrived with, in order.
    pub(crate) fn seeds(&self) -> Vec<Option<u64>> {
        self.seeds.lock().expect("not poisoned").clone()
    }
}

impl Drop for FakeExecutor {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A core configuration small enough for tests.
pub(crate) fn test_config() -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks: 256,
        max_model_len: 512,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_steps_in_flight: ferry_sched_flags::STEPS_IN_FLIGHT,
        ..SchedulerConfig::default()
    }
}

/// A link named `name` driving a fake executor that answers with `token`, counting into
/// `metrics`.
pub(crate) fn fake_link(
    name: &str,
    token: TokenFn,
    metrics: Arc<SchedulerMetrics>,
) -> (LinkHandle, FakeExecutor) {
    let (link, steps, results) = raw_link(name, metrics);
    let (_, gate) = watch::channel(u64::MAX);
    let seeds = Seeds::default();
    let task = tokio::spawn(answer(steps, results, token, gate, seeds.clone()));
    (link, FakeExecutor { task, seeds })
}

/// [`fake_link`] whose executor answers only as many steps as `gate` allows (it waits for the
/// gate to open further before each answer).
pub(crate) fn gated_link(
    name: &str,
    token: TokenFn,
    metrics: Arc<SchedulerMetrics>,
    gate: watch::Receiver<u64>,
) -> (LinkHandle, FakeExecutor) {
    let (link, steps, results) = raw_link(name, metrics);
    let seeds = Seeds::default();
    let task = tokio::spawn(answer(steps, results, token, gate, seeds.clone()));
    (link, FakeExecutor { task, seeds })
}

/// Where a link's results come from.
pub(crate) type ResultTx = mpsc::Sender<Result<v1::StepResult, tonic::Status>>;

/// A link whose executor side the test plays by hand: it receives the steps and sends the
/// results.
pub(crate) fn raw_link(
    name: &str,
    metrics: Arc<SchedulerMetrics>,
) -> (LinkHandle, mpsc::Receiver<v1::Step>, ResultTx) {
    let shared = super::Shared { metrics, tier: Arc::default(), fence: Arc::default() };
    raw_session(name, 0, shared)
}

/// [`fake_link`] as a leader would open it under `epoch`, sharing `shared` with the other
/// links of its set (its metrics, its fence).
pub(crate) fn leader_link(
    name: &str,
    epoch: u64,
    token: TokenFn,
    shared: super::Shared,
) -> (LinkHandle, FakeExecutor) {
    let (link, steps, results) = raw_session(name, epoch, shared);
    let (_, gate) = watch::channel(u64::MAX);
    let seeds = Seeds::default();
    let task = tokio::spawn(answer(steps, results, token, gate, seeds.clone()));
    (link, FakeExecutor { task, seeds })
}

/// [`raw_link`] under `epoch`, sharing `shared`.
pub(crate) fn raw_session(
    name: &str,
    epoch: u64,
    shared: super::Shared,
) -> (LinkHandle, mpsc::Receiver<v1::Step>, ResultTx) {
    let config = test_config();
    let info = v1::ExecutorInfo {
        executor_id: name.to_string(),
        block_size: config.block_size as u32,
        num_blocks: config.num_blocks as u32,
        max_model_len: config.max_model_len as u32,
        eos_token_ids: vec![FAKE_EOS],
        model_fingerprint: FAKE_FINGERPRINT.into(),
        max_loras: 2,
        ..Default::default()
    };
    let core = Scheduler::new(config).expect("a valid test configuration");
    let (step_tx, step_rx) = mpsc::channel(ferry_sched_flags::STEPS_IN_FLIGHT + 1);
    let (result_tx, result_rx) = mpsc::channel(8);
    let session = Session { name: name.into(), epoch, id: 1, group: None };
    let results = ReceiverStream::new(result_rx);
    let link = LinkHandle::start(core, session, info, shared, step_tx, results);
    (link, step_rx, result_tx)
}

/// A request as the fake executor tracks it.
struct Seq {
    /// Tokens of prompt and output so far.
    len: usize,
    /// Tokens whose KV is computed.
    computed: usize,
}

async fn answer(
    mut steps: mpsc::Receiver<v1::Step>,
    results: ResultTx,
    token: TokenFn,
    mut gate: watch::Receiver<u64>,
    seeds: Seeds,
) {
    let mut seqs: HashMap<u64, Seq> = HashMap::new();
    let mut refused: std::collections::HashSet<u64> = std::collections::HashSet::new();
    let mut answered = 0u64;
    while let Some(step) = steps.recv().await {
        let next = answered + 1;
        if gate.wait_for(|open| *open >= next).await.is_err() {
            std::future::pending::<()>().await; // the gate's owner is gone: stall for good
        }
        for id in &step.finished_ids {
            seqs.remove(id);
            refused.remove(id);
        }
        for nr in &step.new_requests {
            let seed = nr.sampling.as_ref().and_then(|s| s.seed);
            seeds.lock().expect("not poisoned").push(seed);
            if nr.prompt_token_ids.contains(&FAKE_REFUSED_TOKEN) {
                refused.insert(nr.id);
                continue;
            }
            let len = nr.prompt_token_ids.len() + nr.output_token_ids.len();
            seqs.insert(nr.id, Seq { len, computed: nr.num_computed_tokens as usize });
        }
        for cu in &step.cached_requests {
            if let Some(s) = seqs.get_mut(&cu.id) {
                if cu.resumed {
                    s.computed = cu.num_computed_tokens as usize;
                }
            }
        }
        let mut outputs = Vec::new();
        let mut refusals = Vec::new();
        for w in &step.work {
            if refused.contains(&w.id) {
                let reason = format!("token id {FAKE_REFUSED_TOKEN} is refused here");
                refusals.push(v1::RefusedRequest { id: w.id, reason });
                continue;
            }
            let s = seqs.get_mut(&w.id).expect("work for a request the step introduced");
            s.computed += w.num_tokens as usize;
            if s.computed >= s.len {
                let t = token(w.id, s.len);
                s.len += 1;
                outputs.push(v1::RequestOutput {
                    id: w.id,
                    token_ids: vec![t],
                    ..Default::default()
                });
            }
        }
        let result = v1::StepResult {
            step_id: step.step_id,
            outputs,
            refused: refusals,
            ..Default::default()
        };
        if results.send(Ok(result)).await.is_err() {
            return;
        }
        answered += 1;
    }
}
