//! One executor, driven: the task that owns this executor's scheduling core, opens its step
//! session, and loops — schedule, send the step, apply results, pass token events to the
//! requests' streams (DESIGN.md §2–§4).
//!
//! The loop is event-driven: it builds steps while the core has work and fewer than
//! `MAX_STEPS_IN_FLIGHT` are outstanding (so the executor never waits for the scheduler), and
//! otherwise sleeps until a command or a result arrives — no polling. The core is owned by
//! this task alone; others talk to it through [`LinkHandle`].

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use ferry_proto::v1::{self, executor_client::ExecutorClient};
use ferry_sched_core::{
    self as core, AddError, FinishReason, FinishStats, RequestEvent, RequestId, SampledToken,
    Scheduler, StepOutcome, StepPlan, Timestamp, WorkKey,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::config::SchedulerConfig;
use crate::metrics::SchedulerMetrics;

/// Steps outstanding at once: one running, one queued behind it.
const MAX_STEPS_IN_FLIGHT: usize = 2;

/// What a request's stream hears.
#[derive(Debug, Clone)]
pub enum LinkEvent {
    /// A sampled token, with its log-probabilities when the request asked for them.
    Token(u32, Option<v1::PositionLogprobs>),
    /// The end.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Final counters.
        stats: FinishStats,
    },
    /// The executor was lost; the request did not finish.
    Failed,
    /// The core preempted it (it will run again).
    Preempted,
}

/// A request for this executor.
#[derive(Debug)]
pub struct Submission {
    /// Core id (unique per link).
    pub id: RequestId,
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// Tokens already generated and delivered before the request moved here (a failover);
    /// they count against `max_tokens`.
    pub output: Vec<u32>,
    /// Most tokens to generate (including `output`).
    pub max_tokens: usize,
    /// Fewest tokens before EOS may stop it.
    pub min_tokens: usize,
    /// Extra stop tokens.
    pub stop_token_ids: Vec<u32>,
    /// Keep going past EOS.
    pub ignore_eos: bool,
    /// Lower runs first.
    pub priority: i32,
    /// How the executor samples.
    pub sampling: v1::SamplingParams,
    /// The W3C trace context of its span, for the executor's spans (empty when untraced).
    pub traceparent: String,
    /// Where its events go.
    pub events: mpsc::UnboundedSender<LinkEvent>,
}

enum Command {
    Add(Box<Submission>, oneshot::Sender<Result<(), AddError>>),
    Abort(RequestId),
    PrefixHit(Arc<[u32]>, oneshot::Sender<usize>),
    Views(oneshot::Sender<Vec<ferry_sched_core::RequestView>>),
}

/// A handle to one executor's loop.
#[derive(Clone)]
pub struct LinkHandle {
    /// The executor's name (its id in etcd, or its address when listed by hand).
    pub name: Arc<str>,
    tx: mpsc::Sender<Command>,
    /// Set to a reason to stop the loop: its requests fail (and the front moves them).
    close: Arc<watch::Sender<Option<String>>>,
    /// What the executor said in the handshake.
    pub info: Arc<v1::ExecutorInfo>,
    /// Requests on this executor now (for the router).
    pub load: Arc<AtomicUsize>,
    /// The core's stats as of its last step or command (for metrics).
    stats: Arc<std::sync::Mutex<ferry_sched_core::SchedulerStats>>,
}

/// Why a link could not be set up or a command not delivered.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The executor did not answer.
    #[error("executor {addr}: {reason}")]
    Connect {
        /// Its address.
        addr: String,
        /// What failed.
        reason: String,
    },
    /// The link's task has stopped (its executor is gone).
    #[error("the executor's scheduling loop has stopped")]
    Gone,
}

impl LinkHandle {
    /// Submits a request; the core's refusal comes back as an error.
    pub async fn add(&self, sub: Submission) -> Result<Result<(), AddError>, LinkError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::Add(Box::new(sub), reply)).await.map_err(|_| LinkError::Gone)?;
        rx.await.map_err(|_| LinkError::Gone)
    }

    /// The core's gauges and counters as of its last step or command.
    pub fn stats(&self) -> ferry_sched_core::SchedulerStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the link's loop still runs (its executor session is up).
    pub fn is_alive(&self) -> bool {
        !self.tx.is_closed() && self.close.borrow().is_none()
    }

    /// Stops the loop: the session ends and every request on it gets [`LinkEvent::Failed`].
    pub fn close(&self, reason: &str) {
        self.close.send_if_modified(|r| {
            let first = r.is_none();
            if first {
                *r = Some(reason.to_string());
            }
            first
        });
    }

    /// How many leading tokens of `prompt` this executor's cache would serve now (0 if the
    /// link is gone).
    pub async fn prefix_hit(&self, prompt: Arc<[u32]>) -> usize {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Command::PrefixHit(prompt, reply)).await.is_err() {
            return 0;
        }
        rx.await.unwrap_or(0)
    }

    /// The admin view of every request the core holds (empty if the link is gone).
    pub async fn request_views(&self) -> Vec<ferry_sched_core::RequestView> {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Command::Views(reply)).await.is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Aborts a request (a no-op if it already finished).
    pub async fn abort(&self, id: RequestId) {
        let _ = self.tx.send(Command::Abort(id)).await;
    }
}

/// Connects to the executor at `addr`, opens a session under fencing `epoch` and starts its
/// loop; `name` names the executor in logs and in the executor set.
pub async fn connect(
    name: &str,
    addr: &str,
    config: &SchedulerConfig,
    scheduler_id: &str,
    epoch: u64,
    metrics: Arc<SchedulerMetrics>,
) -> Result<LinkHandle, LinkError> {
    let fail = |reason: String| LinkError::Connect { addr: addr.to_string(), reason };
    let mut client =
        ExecutorClient::connect(addr.to_string()).await.map_err(|e| fail(e.to_string()))?;
    let hs = client
        .handshake(v1::HandshakeRequest {
            scheduler_id: scheduler_id.to_string(),
            epoch,
            expected_model: String::new(),
        })
        .await
        .map_err(|s| fail(format!("handshake: {}", s.message())))?
        .into_inner();
    let info = hs.info.ok_or_else(|| fail("handshake without executor info".into()))?;
    let core_config = core::SchedulerConfig {
        block_size: info.block_size as usize,
        num_blocks: info.num_blocks as usize,
        max_model_len: info.max_model_len as usize,
        max_num_seqs: config.max_num_seqs as usize,
        max_num_batched_tokens: config.max_num_batched_tokens as usize,
        enable_chunked_prefill: config.enable_chunked_prefill,
        max_steps_in_flight: MAX_STEPS_IN_FLIGHT,
        ..core::SchedulerConfig::default()
    };
    let core =
        Scheduler::new(core_config).map_err(|e| fail(format!("scheduler configuration: {e}")))?;
    let (step_tx, step_rx) = mpsc::channel(MAX_STEPS_IN_FLIGHT + 1);
    let results = client
        .session(ReceiverStream::new(step_rx))
        .await
        .map_err(|s| fail(format!("session: {}", s.message())))?
        .into_inner();
    let (tx, rx) = mpsc::channel(1024);
    let load = Arc::new(AtomicUsize::new(0));
    let eos = info.eos_token_ids.clone();
    let (close_tx, close_rx) = watch::channel(None);
    let stats = Arc::new(std::sync::Mutex::new(core.stats()));
    metrics.sessions_opened.add(1);
    let step_loop = StepLoop {
        last_stats: core.stats(),
        core,
        metrics,
        shared_stats: stats.clone(),
        sent_at: VecDeque::new(),
        name: name.into(),
        epoch,
        session_id: hs.session_id,
        entries: HashMap::new(),
        in_flight_empty: VecDeque::new(),
        idle: false,
        start: Instant::now(),
        eos,
        load: load.clone(),
        events: Vec::new(),
    };
    tokio::spawn(step_loop.run(rx, step_tx, results, close_rx));
    Ok(LinkHandle {
        name: name.into(),
        tx,
        close: Arc::new(close_tx),
        info: Arc::new(info),
        load,
        stats,
    })
}

struct Entry {
    sampling: v1::SamplingParams,
    traceparent: String,
    events: mpsc::UnboundedSender<LinkEvent>,
}

struct StepLoop {
    core: Scheduler,
    metrics: Arc<SchedulerMetrics>,
    /// The stats the metrics were last brought up to.
    last_stats: ferry_sched_core::SchedulerStats,
    shared_stats: Arc<std::sync::Mutex<ferry_sched_core::SchedulerStats>>,
    /// When each in-flight step was sent.
    sent_at: VecDeque<Instant>,
    name: Arc<str>,
    epoch: u64,
    session_id: u64,
    entries: HashMap<RequestId, Entry>,
    /// For each step in flight, whether it carried nothing.
    in_flight_empty: VecDeque<bool>,
    /// The last step built carried nothing: wait for news before building another.
    idle: bool,
    start: Instant,
    eos: Vec<u32>,
    load: Arc<AtomicUsize>,
    events: Vec<RequestEvent>,
}

impl StepLoop {
    fn now(&self) -> Timestamp {
        Timestamp(self.start.elapsed().as_nanos() as u64)
    }

    async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        steps: mpsc::Sender<v1::Step>,
        mut results: tonic::Streaming<v1::StepResult>,
        mut close: watch::Receiver<Option<String>>,
    ) {
        loop {
            if let Some(reason) = close.borrow_and_update().clone() {
                return self.fail_all(&reason);
            }
            while !self.idle
                && !self.core.is_drained()
                && self.in_flight_empty.len() < MAX_STEPS_IN_FLIGHT
            {
                let now = self.now();
                let step = match self.core.schedule(now) {
                    Ok(plan) => {
                        let entries = &self.entries;
                        for id in &plan.preempted {
                            if let Some(e) = entries.get(id) {
                                let _ = e.events.send(LinkEvent::Preempted);
                            }
                        }
                        to_proto(plan, self.session_id, self.epoch, |id| {
                            entries.get(&id).map(|e| (e.sampling, e.traceparent.clone()))
                        })
                    }
                    Err(e) => return self.fail_all(&format!("scheduling failed: {e}")),
                };
                let empty = step.work.is_empty()
                    && step.new_requests.is_empty()
                    && step.cached_requests.is_empty()
                    && step.finished_ids.is_empty()
                    && step.preempted_ids.is_empty();
                if steps.send(step).await.is_err() {
                    return self.fail_all("the executor closed the session");
                }
                self.in_flight_empty.push_back(empty);
                self.sent_at.push_back(Instant::now());
                self.idle = empty;
            }
            tokio::select! {
                Ok(()) = close.changed() => {} // handled at the top of the loop
                cmd = commands.recv() => match cmd {
                    Some(cmd) => {
                        self.command(cmd);
                        self.publish_stats();
                    }
                    None => return, // every handle dropped: shutting down
                },
                msg = results.message(), if !self.in_flight_empty.is_empty() => match msg {
                    Ok(Some(result)) => {
                        if let Err(e) = self.apply(&result) {
                            return self.fail_all(&e);
                        }
                        self.publish_stats();
                    }
                    Ok(None) => return self.fail_all("the executor ended the session"),
                    Err(status) => return self.fail_all(&format!("the executor failed: {}", status.message())),
                },
            }
        }
    }

    fn command(&mut self, cmd: Command) {
        // Reads: no reason to build a step.
        let cmd = match cmd {
            Command::PrefixHit(prompt, reply) => {
                let _ = reply.send(self.core.prefix_hit_tokens(&prompt, 0));
                return;
            }
            Command::Views(reply) => {
                let _ = reply.send(self.core.request_views().collect());
                return;
            }
            cmd => cmd,
        };
        self.idle = false;
        match cmd {
            Command::Add(sub, reply) => {
                let mut req = core::NewRequest::new(sub.id, sub.prompt, sub.max_tokens, self.now());
                req.min_tokens = sub.min_tokens;
                req.eos_token_ids = self.eos.clone();
                req.stop_token_ids = sub.stop_token_ids;
                req.ignore_eos = sub.ignore_eos;
                req.priority = sub.priority;
                req.output = sub.output;
                let added = self.core.add_request(req);
                if added.is_ok() {
                    let entry = Entry {
                        sampling: sub.sampling,
                        traceparent: sub.traceparent,
                        events: sub.events,
                    };
                    self.entries.insert(sub.id, entry);
                    self.load.fetch_add(1, Ordering::Relaxed);
                }
                let _ = reply.send(added);
            }
            Command::Abort(id) => {
                let now = self.now();
                if let Ok(done) = self.core.abort(id, now) {
                    self.finish(id, LinkEvent::Finished { reason: done.reason, stats: done.stats });
                }
            }
            Command::PrefixHit(..) | Command::Views(_) => {} // answered above
        }
    }

    /// Brings the metrics' counters and the handle's stats up to the core's.
    fn publish_stats(&mut self) {
        let now = self.core.stats();
        self.metrics.add_core_deltas(&self.last_stats, &now);
        self.last_stats = now;
        *self.shared_stats.lock().unwrap_or_else(|e| e.into_inner()) = now;
    }

    fn apply(&mut self, result: &v1::StepResult) -> Result<(), String> {
        let was_empty = self.in_flight_empty.pop_front().unwrap_or(true);
        if let Some(sent) = self.sent_at.pop_front() {
            if !was_empty {
                self.metrics.step_duration.observe(sent.elapsed().as_secs_f64());
            }
        }
        let outcome = outcome_of(result);
        // Log-probabilities travel beside the core (which only needs the tokens), in order.
        let mut logprobs: HashMap<u64, std::vec::IntoIter<v1::PositionLogprobs>> = result
            .outputs
            .iter()
            .filter(|o| !o.logprobs.is_empty())
            .map(|o| (o.id, o.logprobs.clone().into_iter()))
            .collect();
        let now = self.now();
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        self.core
            .apply_result(&outcome, now, &mut events)
            .map_err(|e| format!("applying step {}: {e}", result.step_id))?;
        for ev in &events {
            match ev {
                &RequestEvent::Token { id, token, .. } => {
                    if let Some(e) = self.entries.get(&id) {
                        let lp = logprobs.get_mut(&id.0).and_then(Iterator::next);
                        let _ = e.events.send(LinkEvent::Token(token, lp));
                    }
                }
                RequestEvent::Finished(done) => self.finish(
                    done.id,
                    LinkEvent::Finished { reason: done.reason, stats: done.stats },
                ),
                RequestEvent::Imported { .. } | RequestEvent::ExportStarted { .. } => {}
            }
        }
        self.events = events;
        if !was_empty {
            self.idle = false;
        }
        Ok(())
    }

    fn finish(&mut self, id: RequestId, event: LinkEvent) {
        if let Some(e) = self.entries.remove(&id) {
            let _ = e.events.send(event);
            self.load.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn fail_all(&mut self, why: &str) {
        tracing::error!(executor = %self.name, reason = why, "executor link stopped");
        for (_, e) in self.entries.drain() {
            let _ = e.events.send(LinkEvent::Failed);
        }
        self.load.store(0, Ordering::Relaxed);
    }
}

/// The core's view of an executor's result: the sampled tokens, in order.
pub(crate) fn outcome_of(result: &v1::StepResult) -> StepOutcome {
    let sampled = result
        .outputs
        .iter()
        .flat_map(|o| {
            o.token_ids.iter().map(move |t| SampledToken { id: RequestId(o.id), token: *t })
        })
        .collect();
    StepOutcome { step_id: core::StepId(result.step_id), sampled, kv_results: Vec::new() }
}

fn work_key(k: WorkKey) -> v1::WorkKey {
    match k {
        WorkKey::Prompt => v1::WorkKey::Prompt,
        WorkKey::PromptChunk => v1::WorkKey::PromptChunk,
        WorkKey::Decode => v1::WorkKey::Decode,
        WorkKey::Verify => v1::WorkKey::Verify,
    }
}

/// The wire form of a plan; `info_of` gives each new request's sampling parameters and trace
/// context.
pub(crate) fn to_proto(
    plan: &StepPlan,
    session_id: u64,
    epoch: u64,
    info_of: impl Fn(RequestId) -> Option<(v1::SamplingParams, String)>,
) -> v1::Step {
    v1::Step {
        session_id,
        epoch,
        step_id: plan.step_id.0,
        new_requests: plan
            .new_requests
            .iter()
            .map(|n| {
                let (sampling, traceparent) = info_of(n.id).unzip();
                v1::NewRequest {
                    id: n.id.0,
                    prompt_token_ids: n.prompt.to_vec(),
                    output_token_ids: n.output.to_vec(),
                    sampling,
                    block_ids: plan.blocks(n.block_ids).iter().map(|b| b.0).collect(),
                    num_computed_tokens: n.num_computed_tokens as u32,
                    traceparent: traceparent.unwrap_or_default(),
                }
            })
            .collect(),
        cached_requests: plan
            .cached_requests
            .iter()
            .map(|c| v1::CachedRequestUpdate {
                id: c.id.0,
                new_block_ids: plan.blocks(c.block_ids).iter().map(|b| b.0).collect(),
                resumed: c.resumed,
                num_computed_tokens: c.num_computed_tokens as u32,
            })
            .collect(),
        work: plan
            .scheduled
            .iter()
            .map(|w| v1::ScheduledWork {
                id: w.id.0,
                key: work_key(w.work).into(),
                num_tokens: w.num_tokens as u32,
                draft_token_ids: Vec::new(),
            })
            .collect(),
        finished_ids: plan.finished.iter().map(|id| id.0).collect(),
        preempted_ids: plan.preempted.iter().map(|id| id.0).collect(),
        kv_ops: Vec::new(),
        total_num_tokens: plan.total_tokens as u32,
    }
}
