//! One executor, driven: a handle to the task that owns that executor's scheduling core
//! ([`step_loop`]), how a session to an executor is opened ([`open`]), and the step protocol's
//! wire forms ([`wire`]) (DESIGN.md §2–§4).
//!
//! The core is owned by the loop's task alone; the front and the admin view talk to it through
//! [`LinkHandle`], whose commands travel over a channel. A link whose loop stopped is dead for
//! good: its requests heard [`LinkEvent::Failed`], and a new session is a new link.

pub mod dp_group;
#[cfg(test)]
pub(crate) mod fake;
mod lora_view;
mod open;
mod step_loop;
#[cfg(test)]
pub(crate) mod tests;
pub mod transfers;
pub mod wire;

pub use lora_view::LoraView;
pub use open::{geometry_of, GeometryRefused, OpenerModel, SchedulerSettings, SessionOpener};

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use ferry_proto::v1;
use ferry_sched_core::{AddError, FinishReason, FinishStats, RequestId};
use tokio::sync::{mpsc, oneshot, watch};

use crate::request::RequestSpec;

/// What a request's stream hears.
#[derive(Debug, Clone)]
pub enum LinkEvent {
    /// A sampled token, with its log-probabilities when the request asked for them, and (a
    /// looped model's request) the recurrent loops it ran (0 for a plain model's).
    Token(u32, Option<v1::PositionLogprobs>, u8),
    /// The end.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Final counters.
        stats: FinishStats,
    },
    /// It ended with an error, alone, for a reason (the client's message): its executor
    /// refused it. Not moved: another executor would refuse it too.
    Refused(String),
    /// The executor was lost; the request did not finish.
    Failed,
    /// The core preempted it (it will run again).
    Preempted,
    /// Log-probabilities of prompt tokens (`prompt_logprobs`): entry i scores prompt token
    /// `from + i`. A prompt computed again (after a preemption or a move) reports again.
    PromptLogprobs {
        /// The prompt position of the first entry.
        from: usize,
        /// The entries.
        logprobs: Vec<v1::PositionLogprobs>,
    },
    /// Its prompt is done here and its KV export starts (a prefill-only request); it finishes
    /// `Transferred` once the export is done, or with an error if it failed.
    ExportStarted,
    /// Its KV import ended: with the KV (`true`) it decodes from it, without it recomputes.
    Imported(bool),
}

/// A request's part in a KV transfer (prefill/decode disaggregation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferPlan {
    /// Prefill here, then export the prompt's KV through `transfer_id` to the `destination`
    /// agent.
    Export {
        /// The transfer.
        transfer_id: ferry_sched_core::TransferId,
        /// The client's id of its request (for the admin view).
        request: Arc<str>,
        /// The decode node's agent.
        destination: String,
        /// How long the export may take once it starts.
        timeout: std::time::Duration,
    },
    /// Import the KV of the first `tokens` prompt tokens through `transfer_id` from this node's
    /// agent, then compute the rest.
    Import {
        /// The transfer.
        transfer_id: ferry_sched_core::TransferId,
        /// The client's id of its request (for the admin view).
        request: Arc<str>,
        /// Prompt tokens the import covers (whole blocks).
        tokens: usize,
        /// How long the import may wait for the KV once it starts; past it the prompt is
        /// recomputed.
        timeout: std::time::Duration,
        /// `None`: the KV arrives through the transfer at this node's agent (disaggregation).
        /// Else a KV-tier read from this agent's store (any node's).
        source: Option<String>,
    },
}

/// A request for this executor.
#[derive(Debug)]
pub struct Submission {
    /// Core id (unique per link).
    pub id: RequestId,
    /// What the client asked for.
    pub spec: Arc<RequestSpec>,
    /// Tokens already generated and delivered (a continuation, or a request moved here after a
    /// failure); they count against `max_tokens`.
    pub output: Vec<u32>,
    /// Its part in a KV transfer, if any.
    pub transfer: Option<TransferPlan>,
    /// Its part in parallel sampling (`n` > 1): the first sample of several, or another that
    /// forks from the first's prompt KV in this core.
    pub fork: ferry_sched_core::Fork,
    /// Where its events go.
    pub events: mpsc::UnboundedSender<LinkEvent>,
}

/// The request `spec` for the scheduling core under `id`, with `output` the tokens already
/// delivered (they are recomputed as part of the sequence, unless `transfer` imports
/// their prompt's KV), `eos` the executor's EOS ids and its part in a KV transfer.
pub fn core_request(
    spec: &RequestSpec,
    id: ferry_sched_core::RequestId,
    output: Vec<u32>,
    eos: &[u32],
    transfer: Option<&TransferPlan>,
    now: ferry_sched_core::Timestamp,
) -> ferry_sched_core::NewRequest {
    let mut req = ferry_sched_core::NewRequest::new(id, spec.prompt.clone(), spec.max_tokens, now);
    match transfer {
        Some(TransferPlan::Export { transfer_id, .. }) => req.kv_export = Some(*transfer_id),
        Some(TransferPlan::Import { transfer_id, tokens, .. }) => {
            req.kv_import =
                Some(ferry_sched_core::KvImport { transfer_id: *transfer_id, num_tokens: *tokens });
        }
        None => {}
    }
    req.min_tokens = spec.min_tokens;
    req.eos_token_ids = eos.to_vec();
    req.stop_token_ids.clone_from(&spec.stop_token_ids);
    req.ignore_eos = spec.ignore_eos;
    req.priority = spec.priority;
    req.output = output;
    // A grammar checks one token at a time, so a structured output decodes plainly.
    req.speculate = spec.sampling.structured_output.is_none();
    // Past 255 it is out of range anyway: the core refuses it naming the model's limit.
    req.max_loops = spec.sampling.max_loops.map(|l| u8::try_from(l).unwrap_or(u8::MAX));
    req.exit_threshold = spec.sampling.exit_threshold;
    // A request scoring its prompt has a prefix cache (salt) of its own: every prompt token is
    // computed, and so scored.
    req.cache_salt = shared_salt(spec).unwrap_or((1 << 63) | id.0);
    // The core holds an adapter's requests back while the executor holds `--max-loras` others.
    req.adapter = spec.lora.as_ref().map_or(0, adapter_salt);
    req
}

/// The prefix-cache salt a request of `spec` shares blocks under: its LoRA adapter's (a block
/// computed under one adapter holds KV no other adapter, nor the base model, computes), or
/// the base model's 0; `None` for one that scores its prompt, which shares none. The core's
/// cache, routing and the KV tier all look its blocks up under it.
pub(crate) fn shared_salt(spec: &RequestSpec) -> Option<u64> {
    if spec.sampling.prompt_logprobs.is_some() {
        return None;
    }
    Some(spec.lora.as_ref().map_or(0, adapter_salt))
}

/// The prefix-cache salt of requests run with `lora`: its name and path, hashed (FNV-1a, so
/// every process computes the same), never 0 (the base model's) nor with the top bit (a
/// request's own, for prompt log-probabilities).
fn adapter_salt(lora: &v1::LoraAdapterRef) -> u64 {
    let bytes = lora.name.bytes().chain([0]).chain(lora.path.bytes());
    let h = bytes
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    (h >> 1).max(1)
}

/// What the handle asks of the loop.
enum Command {
    Add(Box<Submission>, oneshot::Sender<Result<(), AddRefused>>),
    Abort(RequestId),
    PrefixHit(Arc<[u32]>, u64, oneshot::Sender<usize>),
    Views(oneshot::Sender<Vec<ferry_sched_core::RequestView>>),
    Transfers(oneshot::Sender<Vec<transfers::TransferSide>>),
}

/// How the error of a request an executor refused begins (a front behind a remote scheduler
/// tells it from a lost request by it, and does not move it).
pub const REFUSED: &str = "the executor refused this request: ";

/// Why a link did not take a request.
#[derive(Debug, thiserror::Error)]
pub enum AddRefused {
    /// The core refused it (what the client got wrong).
    #[error(transparent)]
    Core(#[from] AddError),
    /// The executor holds as many requests as it takes (its `--max-live-requests`).
    #[error("the executor holds its limit of {limit} requests (--max-live-requests)")]
    Full {
        /// The executor's limit.
        limit: usize,
    },
}

/// A handle to one executor's loop.
#[derive(Clone)]
pub struct LinkHandle {
    /// The executor's name (its id in etcd, or its address when listed by hand).
    pub name: Arc<str>,
    /// The leadership epoch its session was opened under (0 without etcd).
    pub epoch: u64,
    tx: mpsc::Sender<Command>,
    /// Set to a reason to stop the loop: its requests fail (and the front moves them).
    close: Arc<watch::Sender<Option<String>>>,
    /// What the executor said in the handshake.
    pub info: Arc<v1::ExecutorInfo>,
    /// Requests on this executor now (for the router).
    pub load: Arc<AtomicUsize>,
    /// Requests the router chose it for and not yet added (see [`Reservation`]).
    reserved: Arc<AtomicUsize>,
    /// The core's stats as of its last step or command (for metrics).
    stats: Arc<std::sync::Mutex<ferry_sched_core::SchedulerStats>>,
    /// What it knows of the executor's LoRA adapters (the router's hint of where an adapter
    /// already is, and the metrics' held and waiting adapters).
    lora: Arc<std::sync::Mutex<LoraView>>,
}

/// A request counted in its chosen executor's routing load until dropped
/// ([`LinkHandle::reserve`]).
#[derive(Debug)]
pub struct Reservation(Arc<AtomicUsize>);

impl Drop for Reservation {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
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
    /// The executor refused the session for a reason another try cannot fix (another model, a
    /// stale epoch, a geometry the core cannot use).
    #[error("executor {addr} refused the session: {reason}")]
    Refused {
        /// Its address.
        addr: String,
        /// Why.
        reason: String,
    },
    /// The link's task has stopped (its executor is gone).
    #[error("the executor's scheduling loop has stopped")]
    Gone,
}

/// What a link shares with the others of its executor set.
pub(crate) struct Shared {
    /// Where it counts.
    pub metrics: Arc<crate::metrics::SchedulerMetrics>,
    /// Where it records what it wrote to its node's agent.
    pub tier: Arc<crate::tier::TierIndex>,
    /// Where it reports an executor's newer leadership epoch.
    pub fence: Arc<crate::fence::Fence>,
}

/// When the executor's agent (`kv`) is one the KV tier's index knows nothing of (this
/// scheduler just started leading, or the agent is new), asks the agent what it holds of the
/// executor's `layout`, in the background (within 10 s: an agent that does not answer is left
/// to the stores that come).
fn recover_tier_index(
    tier: &Arc<crate::tier::TierIndex>,
    kv: &step_loop::KvFacts,
    layout: Option<&v1::KvLayout>,
) {
    let Some(layout) = layout.cloned() else { return };
    if kv.agent.is_empty() || tier.len(&kv.agent, kv.layout) > 0 {
        return;
    }
    let (tier, agent, key) = (tier.clone(), kv.agent.clone(), kv.layout);
    tokio::spawn(async move {
        let recovered = crate::tier::recover(&tier, &agent, (&layout, key));
        match tokio::time::timeout(std::time::Duration::from_secs(10), recovered).await {
            Ok(Ok(n)) => {
                tracing::info!(%agent, blocks = n, "KV tier index recovered from the agent");
            }
            Ok(Err(e)) => tracing::warn!(%agent, error = %e, "KV tier index not recovered"),
            Err(_) => {
                tracing::warn!(%agent, "KV tier index not recovered: the agent did not answer");
            }
        }
    });
}

impl LinkHandle {
    /// Starts the step loop of a session with an executor described by `info`: `core` schedules
    /// for it, steps go out on `steps` and results come back on `results`.
    fn start<R>(
        core: ferry_sched_core::Scheduler,
        session: step_loop::Session,
        info: v1::ExecutorInfo,
        shared: Shared,
        steps: mpsc::Sender<v1::Step>,
        results: R,
    ) -> Self
    where
        R: tokio_stream::Stream<Item = Result<v1::StepResult, tonic::Status>>
            + Send
            + Unpin
            + 'static,
    {
        let (tx, rx) = mpsc::channel(1024);
        let (close_tx, close_rx) = watch::channel(None);
        let load = Arc::new(AtomicUsize::new(0));
        let stats = Arc::new(std::sync::Mutex::new(core.stats()));
        let kv = step_loop::KvFacts {
            block_bytes: info.kv_layout.as_ref().and_then(v1::KvLayout::block_bytes).unwrap_or(0),
            agent: info.kv_agent_address.clone(),
            layout: crate::tier::layout_key(info.kv_layout.as_ref()),
        };
        recover_tier_index(&shared.tier, &kv, info.kv_layout.as_ref());
        let lora = Arc::new(std::sync::Mutex::new(LoraView::default()));
        let mut published =
            step_loop::Published::new(load.clone(), stats.clone(), shared, &core.stats());
        published.lora = (info.max_loras > 0).then(|| lora.clone());
        let (name, epoch) = (session.name.clone(), session.epoch);
        let eos = info.eos_token_ids.clone();
        let max_live = match info.max_live_requests {
            0 => usize::MAX,
            n => n as usize,
        };
        let step_loop = step_loop::StepLoop::new(core, session, (eos, max_live), kv, published);
        tokio::spawn(step_loop.run(rx, steps, results, close_rx));
        let close = Arc::new(close_tx);
        let reserved = Arc::default();
        let info = Arc::new(info);
        LinkHandle { name, epoch, tx, close, info, load, reserved, stats, lora }
    }

    /// Counts a request the router just chose this executor for until the returned guard is
    /// dropped (once the request is added, or not): concurrent placements weigh it at once,
    /// where [`Self::load`] counts it only when the link's loop has taken it in — a burst of
    /// requests would otherwise all see the same loads and go to the same executor.
    pub fn reserve(&self) -> Reservation {
        self.reserved.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Reservation(self.reserved.clone())
    }

    /// The load the router weighs: requests held and requests on their way.
    pub fn routing_load(&self) -> usize {
        use std::sync::atomic::Ordering::Relaxed;
        self.load.load(Relaxed) + self.reserved.load(Relaxed)
    }

    /// Whether the executor takes another request now (below its `--max-live-requests`; an
    /// executor that states no limit has none).
    pub fn has_room(&self) -> bool {
        let limit = self.info.max_live_requests as usize;
        limit == 0 || self.load.load(std::sync::atomic::Ordering::Relaxed) < limit
    }

    /// Submits a request; a refusal (the core's, or a full executor) comes back as an error.
    pub async fn add(&self, sub: Submission) -> Result<Result<(), AddRefused>, LinkError> {
        let (reply, rx) = oneshot::channel();
        let adapter = sub.spec.lora.as_ref().map(|l| (adapter_salt(l), l.name.clone()));
        self.tx.send(Command::Add(Box::new(sub), reply)).await.map_err(|_| LinkError::Gone)?;
        let added = rx.await.map_err(|_| LinkError::Gone)?;
        if let (Some((id, name)), Ok(())) = (adapter, &added) {
            self.note_adapter(id, name);
        }
        Ok(added)
    }

    /// Whether the executor holds LoRA adapter `name` (as far as the requests added here tell).
    pub fn holds_adapter(&self, name: &str) -> bool {
        self.lora_view().holds(name)
    }

    /// What the link knows of the executor's LoRA adapters.
    pub fn lora_view(&self) -> std::sync::MutexGuard<'_, LoraView> {
        self.lora.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the executor runs LoRA adapters at all.
    pub fn runs_adapters(&self) -> bool {
        self.info.max_loras > 0
    }

    /// Notes that a request with adapter `name` (the core's id `id`) was added: the executor
    /// reads it (or uses it again), and drops its least recently used one past its
    /// `--max-loras`.
    pub(crate) fn note_adapter(&self, id: u64, name: String) {
        self.lora_view().note(id, name, self.info.max_loras as usize);
    }

    /// The core's gauges and counters as of its last step or command.
    pub fn stats(&self) -> ferry_sched_core::SchedulerStats {
        *self.stats.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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

    /// How many leading tokens of `prompt` this executor's cache would serve now to a request
    /// of prefix-cache salt `salt` (0 if the link is gone).
    pub async fn prefix_hit(&self, prompt: Arc<[u32]>, salt: u64) -> usize {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Command::PrefixHit(prompt, salt, reply)).await.is_err() {
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

    /// This executor's side of each KV transfer in progress or recently ended (empty if the
    /// link is gone).
    pub async fn transfers(&self) -> Vec<transfers::TransferSide> {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Command::Transfers(reply)).await.is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Aborts a request (a no-op if it already finished).
    pub async fn abort(&self, id: RequestId) {
        let _ = self.tx.send(Command::Abort(id)).await;
    }
}
