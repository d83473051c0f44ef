//! The task that drives one executor: it owns that executor's scheduling core and loops —
//! build a step, send it, apply results in order, pass token events to the requests' streams
//! (DESIGN.md §2–§4).
//!
//! Event-driven: it builds steps while the core has work and fewer than its
//! `max_steps_in_flight` are outstanding ([`ferry_sched_flags::STEPS_IN_FLIGHT`], so the
//! executor never waits for the scheduler; one with speculative decoding), and
//! otherwise sleeps until a command or a result arrives — no polling.
//!
//! Invariants:
//! - results are applied in the order the steps went out (the executor answers in order, and a
//!   result for a step not in flight is an error that ends the loop);
//! - every request the core holds has an entry here, with its spec and its stream, until the
//!   core reports it finished or the loop ends; when the loop ends, for whatever reason, every
//!   request still here hears [`LinkEvent::Failed`], so its front moves it — none is lost;
//! - `load` is the number of entries (the router reads it).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use ferry_proto::v1;
use ferry_sched_core::dp_rounds::Round;
use ferry_sched_core::{RequestEvent, RequestId, Scheduler, SchedulerStats, Timestamp};
use tokio::sync::{mpsc, watch};
use tokio_stream::{Stream, StreamExt};

use super::transfers::Transfers;
use super::wire;
use super::{Command, LinkEvent, TransferPlan};
use crate::metrics::SchedulerMetrics;
use crate::request::RequestSpec;
use crate::tier::TierIndex;

/// A request on this executor: what the link needs beside the core's own record.
struct Entry {
    spec: Arc<RequestSpec>,
    transfer: Option<TransferPlan>,
    events: mpsc::UnboundedSender<LinkEvent>,
}

/// How often an otherwise idle loop asks the executor for news while KV transfers or KV-tier
/// writes are in progress (their ends are reported only in step results).
const TRANSFER_POLL: std::time::Duration = std::time::Duration::from_millis(2);

/// A step sent and not yet answered.
struct InFlight {
    sent_at: Instant,
    /// It carried nothing (an empty step only keeps the pipeline's order).
    empty: bool,
    /// Its data-parallel group's round (0: not in a group).
    round: u64,
}

/// Which session the steps belong to.
pub(super) struct Session {
    /// The executor's name, for logs.
    pub name: Arc<str>,
    /// The leadership epoch the session was opened under.
    pub epoch: u64,
    /// The executor's id for the session.
    pub id: u64,
    /// Its data-parallel group, stepped in rounds (`dp_group`).
    pub group: Option<super::dp_group::Member>,
}

/// Where the loop publishes what others read: the router's load, the admin view's stats and
/// the Prometheus counters.
pub(super) struct Published {
    pub load: Arc<AtomicUsize>,
    pub stats: Arc<std::sync::Mutex<SchedulerStats>>,
    pub metrics: Arc<SchedulerMetrics>,
    /// What each agent holds: this loop records its executor's stores and imports.
    pub tier: Arc<TierIndex>,
    /// Where a newer leadership epoch is reported.
    pub fence: Arc<crate::fence::Fence>,
    /// The stats the metrics were last brought up to.
    last: SchedulerStats,
    /// Where the core's held and waiting LoRA adapters go (an executor that runs adapters).
    pub lora: Option<Arc<std::sync::Mutex<super::LoraView>>>,
}

impl Published {
    pub(super) fn new(
        load: Arc<AtomicUsize>,
        stats: Arc<std::sync::Mutex<SchedulerStats>>,
        shared: super::Shared,
        initial: &SchedulerStats,
    ) -> Self {
        let super::Shared { metrics, tier, fence } = shared;
        Self { load, stats, metrics, tier, fence, last: *initial, lora: None }
    }

    /// Brings the metrics' counters, the handle's stats and its adapters up to `core`'s.
    fn update(&mut self, core: &Scheduler) {
        let now = core.stats();
        self.metrics.add_core_deltas(&self.last, &now);
        self.last = now;
        *self.stats.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = now;
        if let Some(lora) = &self.lora {
            let adapters = core.lora_adapters();
            lora.lock().unwrap_or_else(std::sync::PoisonError::into_inner).publish(adapters);
        }
    }
}

/// One executor's loop.
pub(super) struct StepLoop {
    core: Scheduler,
    session: Session,
    /// The executor's end-of-sequence ids, for the core's stop checks.
    eos: Vec<u32>,
    /// Most requests the executor holds (its `--max-live-requests`): the core holds no more.
    max_live: usize,
    entries: HashMap<RequestId, Entry>,
    in_flight: VecDeque<InFlight>,
    /// The last step built carried nothing: wait for news before building another.
    idle: bool,
    /// The core's clock starts with the loop.
    start: Instant,
    published: Published,
    /// Reused for each result's events.
    events: Vec<RequestEvent>,
    /// This executor's side of each KV transfer, for the admin view.
    transfers: Transfers,
    /// The executor's KV block size and agent.
    kv: KvFacts,
    /// Issued operations that put blocks in an agent's store (or were meant to read them from
    /// one), by transfer id, until reported.
    tier_ops: HashMap<String, TierOp>,
}

/// What a link knows of its executor's KV.
pub(super) struct KvFacts {
    /// Bytes of one KV block.
    pub block_bytes: u64,
    /// Its node's agent (empty: none).
    pub agent: String,
    /// Its KV layout, as the tier's index keys it.
    pub layout: u64,
}

/// An issued operation the KV tier's index learns from when it is reported, by its blocks'
/// hashes.
enum TierOp {
    /// A KV-tier write to the local agent (not a transfer: no request waits on it).
    Store(Vec<u64>),
    /// An import: from the agent named (a KV-tier read), or arriving at the local agent
    /// (`None`: a transfer).
    Import(Vec<u64>, Option<String>),
}

impl StepLoop {
    pub(super) fn new(
        core: Scheduler,
        session: Session,
        (eos, max_live): (Vec<u32>, usize),
        kv: KvFacts,
        published: Published,
    ) -> Self {
        Self {
            core,
            session,
            eos,
            max_live,
            entries: HashMap::new(),
            in_flight: VecDeque::new(),
            idle: false,
            start: Instant::now(),
            published,
            events: Vec::new(),
            transfers: Transfers::default(),
            kv,
            tier_ops: HashMap::new(),
        }
    }

    fn now(&self) -> Timestamp {
        Timestamp(u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// Runs until the session ends, `close` gives a reason, or every handle is dropped.
    pub(super) async fn run<R>(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        steps: mpsc::Sender<v1::Step>,
        mut results: R,
        mut close: watch::Receiver<Option<String>>,
    ) where
        R: Stream<Item = Result<v1::StepResult, tonic::Status>> + Unpin,
    {
        let mut group = self.session.group.as_ref().map(super::dp_group::Member::subscribe);
        loop {
            if let Some(reason) = close.borrow_and_update().clone() {
                return self.fail_all(&reason);
            }
            // A drained core may still have KV-tier writes to send, or results of them to hear.
            let work = !self.core.is_drained() || self.awaiting_kv();
            if let Some(changed) = &mut group {
                // A rank of a data-parallel group: one step a round, when the group says.
                changed.borrow_and_update();
                if let Err(why) = self.step_in_round(&steps, work).await {
                    return self.fail_all(&why);
                }
            }
            while group.is_none()
                && !self.idle
                && work
                && self.in_flight.len() < self.core.config().max_steps_in_flight
            {
                if let Err(why) = self.send_step(&steps, Round::default()).await {
                    return self.fail_all(&why);
                }
            }
            let transfers = self.awaiting_kv();
            let round_changed = async {
                match &mut group {
                    Some(changed) => changed.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                Ok(()) = close.changed() => {} // handled at the top of the loop
                true = round_changed => {} // the group's round moved: asked at the top
                () = tokio::time::sleep(TRANSFER_POLL), if self.idle && transfers => {
                    self.idle = false;
                }
                cmd = commands.recv() => match cmd {
                    Some(cmd) => {
                        self.command(cmd);
                        self.published.update(&self.core);
                    }
                    None => return, // every handle dropped: shutting down
                },
                // Polled even with nothing in flight, so an idle link notices at once that its
                // executor died (the stream ends or fails) instead of at its next step.
                msg = results.next() => match msg {
                    Some(Ok(result)) => {
                        if let Err(e) = self.apply(&result) {
                            return self.fail_all(&e);
                        }
                        self.published.update(&self.core);
                    }
                    None => return self.fail_all("the executor ended the session"),
                    Some(Err(status)) => {
                        // A refusal naming a newer epoch: another scheduler leads (reported
                        // before the requests fail, so none waits here for a new executor).
                        if let Some(newest) = ferry_proto::fencing::newest_epoch(&status) {
                            self.published.fence.saw(newest);
                        }
                        return self.fail_all(&format!("the executor failed: {}", status.message()))
                    }
                },
            }
        }
    }

    /// Builds and sends the next step (of `round`, throttled or not, in a data-parallel group;
    /// round 0 outside one).
    async fn send_step(
        &mut self,
        steps: &mpsc::Sender<v1::Step>,
        round: Round,
    ) -> Result<(), String> {
        let mut step = self.build_step(round.throttle)?;
        step.dp_round = round.id;
        let empty = wire::is_empty(&step);
        if steps.send(step).await.is_err() {
            return Err("the executor closed the session".into());
        }
        self.in_flight.push_back(InFlight { sent_at: Instant::now(), empty, round: round.id });
        self.idle = empty;
        Ok(())
    }

    /// In a data-parallel group: sends this rank's step of the round when the group lets it
    /// (one at a time: the next round waits for every rank's result of this one).
    async fn step_in_round(
        &mut self,
        steps: &mpsc::Sender<v1::Step>,
        work: bool,
    ) -> Result<(), String> {
        if !self.in_flight.is_empty() {
            return Ok(());
        }
        let has_work = work && !self.idle;
        match self.session.group.as_ref().and_then(|g| g.may_step(has_work)) {
            Some(round) => self.send_step(steps, round).await,
            None => Ok(()),
        }
    }

    /// Schedules the next step (holding prefills back if `throttle` and the core's rule
    /// agrees) and tells preempted requests' streams.
    fn build_step(&mut self, throttle: bool) -> Result<v1::Step, String> {
        let now = self.now();
        let plan = self
            .core
            .schedule_throttled(now, throttle)
            .map_err(|e| format!("scheduling failed: {e}"))?;
        let entries = &self.entries;
        for id in &plan.preempted {
            if let Some(e) = entries.get(id) {
                let _ = e.events.send(LinkEvent::Preempted);
            }
        }
        let s = &self.session;
        let info = |id| entries.get(&id).map(|e: &Entry| (&*e.spec, e.transfer.as_ref()));
        let now_unix_ms = ferry_runtime::clock::now_unix_ms();
        let step = wire::to_proto(plan, s.id, s.epoch, now_unix_ms, info);
        self.transfers.issued(&step.kv_ops, self.kv.block_bytes);
        self.tier_issued(&step.kv_ops);
        Ok(step)
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            // Reads: no reason to build a step.
            Command::PrefixHit(prompt, salt, reply) => {
                let _ = reply.send(self.core.prefix_hit_tokens(&prompt, salt));
            }
            Command::Views(reply) => {
                let _ = reply.send(self.core.request_views().collect());
            }
            Command::Transfers(reply) => {
                let _ = reply.send(self.transfers.views());
            }
            Command::Add(sub, reply) => {
                // Every request the core holds may reach the executor (preempted ones stay
                // there), so the core holds no more than the executor takes.
                if self.entries.len() >= self.max_live {
                    let _ = reply.send(Err(super::AddRefused::Full { limit: self.max_live }));
                    return;
                }
                self.idle = false;
                let now = self.now();
                let mut req = super::core_request(
                    &sub.spec,
                    sub.id,
                    sub.output,
                    &self.eos,
                    sub.transfer.as_ref(),
                    now,
                );
                req.fork = sub.fork;
                let added = self.core.add_request(req);
                if added.is_ok() {
                    if let Some(plan) = &sub.transfer {
                        self.transfers.planned(plan);
                    }
                    let entry =
                        Entry { spec: sub.spec, transfer: sub.transfer, events: sub.events };
                    self.entries.insert(sub.id, entry);
                    self.published.load.fetch_add(1, Ordering::Relaxed);
                }
                let _ = reply.send(added.map_err(Into::into));
            }
            Command::Abort(id) => {
                self.idle = false;
                let now = self.now();
                if let Ok(done) = self.core.abort(id, now) {
                    self.finish(id, LinkEvent::Finished { reason: done.reason, stats: done.stats });
                }
            }
        }
    }

    fn apply(&mut self, result: &v1::StepResult) -> Result<(), String> {
        let Some(sent) = self.in_flight.pop_front() else {
            return Err(format!("the executor answered step {} that was not sent", result.step_id));
        };
        if !sent.empty {
            self.published.metrics.step_duration.observe(sent.sent_at.elapsed().as_secs_f64());
        }
        let outcome = wire::outcome_of(result);
        for k in &result.kv_results {
            if !self.tier_reported(k) {
                self.published.metrics.kv_transfer(k);
                self.transfers.reported(k);
            }
            if !k.ok {
                tracing::warn!(executor = %self.session.name, transfer = %k.transfer_id, error = %k.error, "KV transfer failed");
            }
        }
        // Log-probabilities travel beside the core (which only needs the tokens), in order.
        let mut logprobs: HashMap<u64, std::slice::Iter<'_, v1::PositionLogprobs>> = result
            .outputs
            .iter()
            .filter(|o| !o.logprobs.is_empty())
            .map(|o| (o.id, o.logprobs.iter()))
            .collect();
        // So do the prompt's, before the tokens they precede.
        for o in result.outputs.iter().filter(|o| !o.prompt_logprobs.is_empty()) {
            if let Some(e) = self.entries.get(&RequestId(o.id)) {
                let _ = e.events.send(LinkEvent::PromptLogprobs {
                    from: o.prompt_logprobs_from as usize,
                    logprobs: o.prompt_logprobs.clone(),
                });
            }
        }
        let now = self.now();
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        self.core
            .apply_result(&outcome, now, &mut events)
            .map_err(|e| format!("applying step {}: {e}", result.step_id))?;
        for ev in &events {
            match ev {
                &RequestEvent::Token { id, token, loops, .. } => {
                    if let Some(e) = self.entries.get(&id) {
                        let lp = logprobs.get_mut(&id.0).and_then(Iterator::next).cloned();
                        let _ = e.events.send(LinkEvent::Token(token, lp, loops));
                    }
                }
                RequestEvent::Finished(done) => {
                    let refused = result.refused.iter().find(|r| r.id == done.id.0);
                    let event = match refused {
                        Some(r) => {
                            tracing::warn!(executor = %self.session.name, request = r.id, reason = %r.reason, "the executor refused a request");
                            self.published.metrics.requests_refused.add(1);
                            LinkEvent::Refused(format!("{}{}", super::REFUSED, r.reason))
                        }
                        None => LinkEvent::Finished { reason: done.reason, stats: done.stats },
                    };
                    self.finish(done.id, event);
                }
                &RequestEvent::ExportStarted { id, .. } => {
                    if let Some(e) = self.entries.get(&id) {
                        let _ = e.events.send(LinkEvent::ExportStarted);
                    }
                }
                &RequestEvent::Imported { id, ok, .. } => {
                    if let Some(e) = self.entries.get(&id) {
                        let _ = e.events.send(LinkEvent::Imported(ok));
                    }
                }
            }
        }
        self.events = events;
        // A transfer that ended changes what the next step says (a finished export is
        // forgotten, an import's request computes), even when it answers an empty step.
        if !sent.empty || !result.kv_results.is_empty() {
            self.idle = false;
        }
        if let Some(group) = &self.session.group {
            group.answered(sent.round, !self.core.is_drained() || self.awaiting_kv());
        }
        Ok(())
    }

    /// Remembers the issued operations that change what an agent holds.
    fn tier_issued(&mut self, ops: &[v1::KvOperation]) {
        use v1::kv_operation::Op;
        for op in ops {
            let tier_op = match &op.op {
                Some(Op::Store(s)) => TierOp::Store(s.block_hashes.clone()),
                Some(Op::Import(i)) => TierOp::Import(
                    i.block_hashes.clone(),
                    (!i.source_agent.is_empty()).then(|| i.source_agent.clone()),
                ),
                Some(Op::Export(_)) | None => continue,
            };
            self.tier_ops.insert(op.transfer_id.clone(), tier_op);
        }
    }

    /// KV work outstanding that only later step results report: transfers, KV-tier writes
    /// to send or to hear of.
    fn awaiting_kv(&self) -> bool {
        let stats = self.core.stats();
        stats.num_receiving + stats.num_transferring > 0
            || !self.tier_ops.is_empty()
            || self.core.tier_stores_pending()
    }

    /// Updates the tier's index with a reported operation: blocks stored in (or arrived at)
    /// the local agent are there now; a tier read that failed names blocks its agent may no
    /// longer hold. True for a KV-tier write (not a transfer: counted here alone).
    fn tier_reported(&mut self, k: &v1::KvOperationResult) -> bool {
        let Some(op) = self.tier_ops.remove(&k.transfer_id) else { return false };
        let (m, tier) = (&self.published.metrics, &self.published.tier);
        let store = matches!(op, TierOp::Store(_));
        match (op, k.ok) {
            (TierOp::Store(hashes), true) => {
                m.tier_stored_blocks.add(hashes.len() as u64);
                tier.stored(&self.kv.agent, self.kv.layout, &hashes);
            }
            (TierOp::Store(_), false) => m.tier_store_failures.add(1),
            (TierOp::Import(hashes, None), true) => {
                tier.stored(&self.kv.agent, self.kv.layout, &hashes);
            }
            (TierOp::Import(_, None), false) => {}
            (TierOp::Import(hashes, Some(_)), true) => {
                m.tier_imported_blocks.add(hashes.len() as u64);
            }
            (TierOp::Import(hashes, Some(agent)), false) => {
                m.tier_import_failures.add(1);
                tier.forget(&agent, self.kv.layout, &hashes);
            }
        }
        store
    }

    fn finish(&mut self, id: RequestId, event: LinkEvent) {
        if let Some(e) = self.entries.remove(&id) {
            if let Some(plan) = &e.transfer {
                self.transfers.left(plan);
            }
            let _ = e.events.send(event);
            self.published.load.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn fail_all(&mut self, why: &str) {
        tracing::error!(executor = %self.session.name, reason = why, "executor link stopped");
        for (_, e) in self.entries.drain() {
            let _ = e.events.send(LinkEvent::Failed);
        }
        self.published.load.store(0, Ordering::Relaxed);
    }
}
