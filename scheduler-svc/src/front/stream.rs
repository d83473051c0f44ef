//! One request's stream at the front: it turns the events of wherever the request runs into
//! the client's `GenerateEvent`s, one method per event — a token, the end, a loss — and moves
//! the request when where it ran is lost.
//!
//! Invariants:
//! - the client sees each generated token once, in order, whatever moves happened: the stream
//!   journals the tokens it delivered, and a move places the continuation (prompt plus those
//!   tokens as prior output), whose sampling continues exactly (draws depend on seed and
//!   position only);
//! - the stream ends with exactly one final event (a finish reason, usage, or an error), or
//!   with the client gone; either way the request is aborted where it ran (so its blocks are
//!   freed) and leaves the front's live table;
//! - a disaggregated request (`disagg.rs`) is one stream across two placements: the prefill
//!   half's events count until its export starts, the decode half's after; the prefill half
//!   is then only watched, so that a failed export cancels the transfer (the decode executor
//!   recomputes instead of waiting out the timeout).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_proto::v1;
use ferry_sched_core::{FinishReason, FinishStats, Fork, StopCause};
use tokio::sync::mpsc;
use tonic::Status;

use super::disagg::{self, Handoff};
use super::placement::{Placed, Placement};
use super::text::TextAssembler;
use super::trace::RequestTrace;
use super::Front;
use crate::link::LinkEvent;
use crate::metrics::FinishLabel;
use crate::request::RequestSpec;

/// How long a stream that matched a stop string waits for the scheduler's account of the
/// request (its cached prompt tokens) after aborting it. Locally this is one message between
/// tasks; a remote leader answers within a round trip. Past it, usage says 0 cached tokens.
const STOP_ACCOUNT_WAIT: Duration = Duration::from_secs(2);

/// Where a stream's client events go.
pub(crate) type ClientTx = mpsc::Sender<Result<v1::GenerateEvent, Status>>;

/// How a stream ended, for its spans.
struct Ending {
    label: FinishLabel,
    stats: Option<FinishStats>,
}

impl Ending {
    fn abort() -> Self {
        Self { label: FinishLabel::Abort, stats: None }
    }
}

/// One live request's stream.
pub(crate) struct RequestStream {
    front: Arc<Front>,
    request_id: String,
    spec: Arc<RequestSpec>,
    /// Tokens generated so far (the spec's prior output first): the journal a move resubmits.
    delivered: Vec<u32>,
    placement: Placement,
    events: mpsc::UnboundedReceiver<LinkEvent>,
    /// A disaggregated request's decode half, until its prefill half's export starts.
    handoff: Option<Handoff>,
    /// A disaggregated request's prefill half while its export runs.
    exporting: Option<Exporting>,
    /// Where it runs now is the decode half of a handoff (an import there is the handoff's;
    /// else it is a KV-tier read).
    handed_off: bool,
    assembler: TextAssembler,
    /// The prompt's log-probabilities as they arrive (slot j for prompt token j + 1), when
    /// asked for; taken by the first event.
    prompt_logprobs: Option<Vec<Option<v1::PositionLogprobs>>>,
    client: ClientTx,
    arrived: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    trace: RequestTrace,
}

impl RequestStream {
    /// A stream for `spec`, `placed` where it runs (its events arrive there), answering
    /// `client`.
    pub(crate) fn new(
        front: Arc<Front>,
        request_id: String,
        spec: Arc<RequestSpec>,
        (placement, events): Placed,
        client: ClientTx,
        arrived: Instant,
        trace: RequestTrace,
    ) -> Self {
        let assembler = TextAssembler::new(
            &spec.output.stop,
            spec.output.include_stop_str,
            spec.output.keep_special_tokens,
        );
        let delivered = spec.prior_output.clone();
        let prompt_logprobs =
            spec.sampling.prompt_logprobs.map(|_| vec![None; spec.prompt.len().saturating_sub(1)]);
        Self {
            prompt_logprobs,
            front,
            request_id,
            spec,
            delivered,
            placement,
            events,
            handoff: None,
            exporting: None,
            handed_off: false,
            assembler,
            client,
            arrived,
            first_token: None,
            last_token: None,
            trace,
        }
    }

    /// The stream of a request placed as the prefill half of `handoff` (if any).
    pub(crate) fn with_handoff(mut self, handoff: Option<Handoff>) -> Self {
        self.handoff = handoff;
        self
    }

    /// Streams until the request ends or the client leaves.
    pub(crate) async fn run(mut self) {
        let ending = loop {
            let event = tokio::select! {
                ev = self.events.recv() => ev,
                ev = next_export_event(&mut self.exporting) => {
                    self.on_export_event(ev.as_ref());
                    continue;
                }
                () = self.client.closed() => break self.client_gone().await,
            };
            let ended = match event {
                Some(LinkEvent::ExportStarted) => self.hand_off().await,
                Some(LinkEvent::Imported(ok)) => {
                    self.on_imported(ok);
                    None
                }
                Some(LinkEvent::Token(token, logprobs, loops)) => {
                    self.on_token(token, logprobs, loops).await
                }
                Some(LinkEvent::PromptLogprobs { from, logprobs }) => {
                    self.on_prompt_logprobs(from, logprobs);
                    None
                }
                Some(LinkEvent::Preempted) => {
                    self.trace.event("preempted", Vec::new());
                    None
                }
                Some(LinkEvent::Finished { reason, stats }) => {
                    Some(self.on_finished(reason, stats).await)
                }
                Some(LinkEvent::Refused(why)) => Some(self.end_with_error(why).await),
                Some(LinkEvent::Failed) | None => self.on_lost().await,
            };
            if let Some(ending) = ended {
                break ending;
            }
        };
        let Self { front, request_id, placement, trace, .. } = self;
        trace.finish(ending.label.as_str(), placement.name(), ending.stats.as_ref());
        front.forget(&request_id);
    }

    /// Keeps the prompt log-probabilities not received before (a prompt computed again
    /// reports them again), until the first event carries them.
    fn on_prompt_logprobs(&mut self, from: usize, logprobs: Vec<v1::PositionLogprobs>) {
        let Some(slots) = self.prompt_logprobs.as_mut() else { return };
        for (i, lp) in logprobs.into_iter().enumerate() {
            // Slot j holds prompt token j + 1's.
            if let Some(slot) = (from + i).checked_sub(1).and_then(|j| slots.get_mut(j)) {
                slot.get_or_insert(lp);
            }
        }
    }

    fn event(
        &mut self,
        text: String,
        token_ids: Vec<u32>,
        logprobs: Option<v1::PositionLogprobs>,
    ) -> v1::GenerateEvent {
        let prompt_logprobs = self
            .prompt_logprobs
            .take()
            .map(|slots| slots.into_iter().map(Option::unwrap_or_default).collect())
            .unwrap_or_default();
        v1::GenerateEvent {
            prompt_logprobs,
            request_id: self.request_id.clone(),
            text,
            token_ids,
            logprobs: logprobs.into_iter().collect(),
            usage: self.spec.output.continuous_usage.then(|| self.usage(0)),
            ..Default::default()
        }
    }

    fn usage(&self, cached: usize) -> v1::Usage {
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        v1::Usage {
            prompt_tokens: count(self.spec.prompt.len()),
            completion_tokens: count(self.delivered.len()),
            cached_prompt_tokens: count(cached),
        }
    }

    /// Sends `event`; the client gone means the request is aborted.
    async fn send(&mut self, event: v1::GenerateEvent) -> Option<Ending> {
        if self.client.send(Ok(event)).await.is_err() {
            return Some(self.client_gone().await);
        }
        None
    }

    /// A generated token: time it, journal it, and send its text — or, if it completes a stop
    /// string, end the request there.
    async fn on_token(
        &mut self,
        token: u32,
        logprobs: Option<v1::PositionLogprobs>,
        loops: u8,
    ) -> Option<Ending> {
        let now = Instant::now();
        let metrics = &self.front.metrics;
        match self.last_token {
            None => {
                metrics.ttft.observe((now - self.arrived).as_secs_f64());
                self.first_token = Some(now);
                self.trace.event("first_token", Vec::new());
            }
            Some(t) => metrics.itl.observe((now - t).as_secs_f64()),
        }
        self.last_token = Some(now);
        self.delivered.push(token);
        let pushed =
            self.assembler.push(&self.front.models.get(self.spec.model).file.tokenizer, token);
        let mut event = self.event(pushed.text, vec![token], logprobs);
        if loops > 0 {
            event.loops = vec![u32::from(loops)];
        }
        match pushed.stopped {
            None => self.send(event).await,
            Some(stop) => Some(self.on_stop_string(event, stop).await),
        }
    }

    /// The text matched stop string `stop` with the token in `last`: abort the request where
    /// it runs, take its account (cached prompt tokens) and finish with `stop`.
    async fn on_stop_string(&mut self, mut last: v1::GenerateEvent, stop: String) -> Ending {
        self.stop_export("the request ended at a stop string").await;
        self.placement.abort().await;
        let stats = self.account_after_abort().await;
        self.front.metrics.finished(FinishLabel::Stop);
        self.observe_end(stats.as_ref().and_then(|s| s.queue_time));
        last.finish_reason = v1::FinishReason::Stop.into();
        last.stop_reason = stop;
        last.usage = Some(self.usage(stats.map_or(0, |s| s.prefix_hit_tokens)));
        let _ = self.client.send(Ok(last)).await;
        Ending { label: FinishLabel::Stop, stats }
    }

    /// Records a finished request's latencies and sizes (vLLM's request histograms);
    /// `queue_time` is the scheduler's arrival-to-first-scheduled, seconds, when it said.
    fn observe_end(&self, queue_time: Option<f64>) {
        let m = &self.front.metrics;
        m.e2e.observe(self.arrived.elapsed().as_secs_f64());
        if let Some(q) = queue_time {
            m.queue_time.observe(q);
        }
        m.request_prompt_tokens.observe(self.spec.prompt.len() as f64);
        m.request_generation_tokens.observe(self.delivered.len() as f64);
        m.request_max_tokens.observe(self.spec.max_tokens as f64);
        if let Some(first) = self.first_token {
            let to_first = (first - self.arrived).as_secs_f64();
            m.prefill_time.observe(to_first - queue_time.unwrap_or(0.0));
            m.decode_time.observe(first.elapsed().as_secs_f64());
        }
    }

    /// After an abort, the scheduler's final account of the request: its `Finished` event
    /// (tokens generated after the stop are dropped). `None` if where it ran was lost
    /// meanwhile or did not answer within [`STOP_ACCOUNT_WAIT`].
    async fn account_after_abort(&mut self) -> Option<FinishStats> {
        let account = async {
            loop {
                match self.events.recv().await {
                    Some(LinkEvent::Finished { stats, .. }) => return Some(stats),
                    Some(
                        LinkEvent::Token(..)
                        | LinkEvent::Preempted
                        | LinkEvent::PromptLogprobs { .. }
                        | LinkEvent::ExportStarted
                        | LinkEvent::Imported(_),
                    ) => {}
                    Some(LinkEvent::Refused(_) | LinkEvent::Failed) | None => return None,
                }
            }
        };
        tokio::time::timeout(STOP_ACCOUNT_WAIT, account).await.ok().flatten()
    }

    /// The scheduler finished the request: send what text is held and the final event.
    async fn on_finished(&mut self, reason: FinishReason, stats: FinishStats) -> Ending {
        self.front.metrics.finished(reason.into());
        self.observe_end(stats.queue_time);
        let by_token = matches!(reason, FinishReason::Stop(_));
        let text = self.assembler.finish(by_token);
        let mut last = self.event(text, Vec::new(), None);
        let (finish_reason, stop_reason) = wire_finish(reason);
        last.finish_reason = finish_reason.into();
        last.stop_reason = stop_reason;
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        last.usage = Some(v1::Usage {
            prompt_tokens: count(stats.prompt_tokens),
            completion_tokens: count(stats.output_tokens),
            cached_prompt_tokens: count(stats.prefix_hit_tokens),
        });
        let _ = self.client.send(Ok(last)).await;
        Ending { label: reason.into(), stats: Some(stats) }
    }

    /// Where the request ran was lost: place the continuation elsewhere (waiting up to the
    /// failover timeout for somewhere to appear), or end the stream with the error.
    async fn on_lost(&mut self) -> Option<Ending> {
        // A handoff in progress is off: the continuation is recomputed wherever it lands.
        self.handoff = None;
        self.stop_export("the decode executor was lost").await;
        self.relocate().await
    }

    /// Places the continuation anew (waiting up to the failover timeout for an executor), or
    /// ends the stream with the error.
    async fn relocate(&mut self) -> Option<Ending> {
        let moved = tokio::select! {
            moved = self.front.place(
                &self.spec,
                &self.request_id,
                &self.delivered,
                self.front.settings.failover_wait,
            ) => moved,
            () = self.client.closed() => return Some(self.client_gone().await),
        };
        self.handed_off = false;
        match moved {
            Ok((to, events)) => {
                tracing::warn!(
                    request = %self.request_id,
                    from = %self.placement.name(),
                    to = %to.name(),
                    delivered = self.delivered.len(),
                    "where it ran was lost: request moved"
                );
                self.front.metrics.requests_moved.add(1);
                self.trace.event(
                    "moved",
                    vec![
                        opentelemetry::KeyValue::new("from", self.placement.name().to_string()),
                        opentelemetry::KeyValue::new("to", to.name().to_string()),
                    ],
                );
                self.placement = to;
                self.events = events;
                self.front.set_placement(&self.request_id, &self.placement);
                None
            }
            Err(e) => {
                Some(self.end_with_error(format!("where this request ran was lost and {e}")).await)
            }
        }
    }

    /// Ends the stream with an error that says why (the text generated so far goes first).
    async fn end_with_error(&mut self, why: String) -> Ending {
        self.front.metrics.finished(FinishLabel::Error);
        let text = self.assembler.finish(false);
        let mut last = self.event(text, Vec::new(), None);
        last.finish_reason = v1::FinishReason::Error.into();
        last.error = why;
        let _ = self.client.send(Ok(last)).await;
        Ending { label: FinishLabel::Error, stats: None }
    }

    /// The client went away: abort the request where it runs.
    async fn client_gone(&mut self) -> Ending {
        self.stop_export("the client went away").await;
        self.placement.abort().await;
        self.front.metrics.finished(FinishLabel::Abort);
        Ending::abort()
    }
}

/// A disaggregated request's prefill half while its export runs: its placement, its events,
/// and the transfer to cancel at the decode node's agent if the export fails.
struct Exporting {
    placement: Placement,
    events: mpsc::UnboundedReceiver<LinkEvent>,
    handoff: Handoff,
}

/// The next event of the prefill half being watched; never, if none is.
async fn next_export_event(exporting: &mut Option<Exporting>) -> Option<LinkEvent> {
    match exporting {
        Some(e) => e.events.recv().await,
        None => std::future::pending().await,
    }
}

impl RequestStream {
    /// The prefill half's export started: submit the continuation, importing the prompt's
    /// KV, to the decode executor, and watch the prefill half until the export ends. If the
    /// decode executor is gone or refuses it, cancel the transfer and place the continuation
    /// as a move does (recomputed).
    async fn hand_off(&mut self) -> Option<Ending> {
        let handoff = self.handoff.take()?;
        let to = handoff.decode.clone();
        let submitted = self
            .front
            .submit(&to, &self.spec, &self.delivered, Some(handoff.import_plan()), Fork::None)
            .await;
        let (placement, events) = match submitted {
            Ok(placed) => placed,
            Err(e) => {
                tracing::warn!(
                    request = %self.request_id,
                    decode = %to.name,
                    error = %e,
                    "the decode executor did not take the continuation; it is recomputed elsewhere"
                );
                disagg::cancel_transfer(handoff.agent(), handoff.transfer_id, "no decode side");
                self.front.metrics.handoffs_recomputed.add(1);
                self.trace.event("handoff_failed", Vec::new());
                return self.relocate().await;
            }
        };
        self.front.metrics.disaggregated.add(1);
        self.trace.event(
            "handed_off",
            vec![
                opentelemetry::KeyValue::new("prefill", self.placement.name().to_string()),
                opentelemetry::KeyValue::new("decode", placement.name().to_string()),
                opentelemetry::KeyValue::new("transfer_id", handoff.transfer_id.0.to_string()),
                opentelemetry::KeyValue::new("import_tokens", handoff.import_tokens as i64),
            ],
        );
        let prefill = std::mem::replace(&mut self.placement, placement);
        let prefill_events = std::mem::replace(&mut self.events, events);
        self.exporting = Some(Exporting { placement: prefill, events: prefill_events, handoff });
        self.handed_off = true;
        self.front.set_placement(&self.request_id, &self.placement);
        None
    }

    /// An import ended, the decode half's or a KV-tier read: with the KV, or without (the
    /// prompt is computed).
    fn on_imported(&mut self, ok: bool) {
        let event = match (self.handed_off, ok) {
            (true, true) => "kv_imported",
            (true, false) => {
                self.front.metrics.handoffs_recomputed.add(1);
                "kv_import_failed"
            }
            (false, true) => "kv_tier_read",
            (false, false) => "kv_tier_read_failed",
        };
        self.trace.event(event, Vec::new());
    }

    /// An event of the prefill half while its export runs: the export is done (the prefill
    /// request finished `Transferred`), or it failed or its executor was lost — then the
    /// transfer is cancelled at the decode node, whose import fails and recomputes.
    fn on_export_event(&mut self, event: Option<&LinkEvent>) {
        let failed = match event {
            Some(LinkEvent::Finished { reason: FinishReason::Transferred, .. }) => None,
            Some(LinkEvent::Finished { reason, .. }) => {
                Some(format!("the export ended {}", FinishLabel::from(*reason).as_str()))
            }
            Some(LinkEvent::Refused(why)) => Some(format!("the prefill half ended: {why}")),
            Some(LinkEvent::Failed) | None => Some("the prefill executor was lost".to_string()),
            Some(_) => return,
        };
        let Some(exporting) = self.exporting.take() else { return };
        match failed {
            None => self.trace.event("kv_exported", Vec::new()),
            Some(why) => {
                tracing::warn!(request = %self.request_id, transfer = exporting.handoff.transfer_id.0, %why, "KV export failed; the decode side recomputes");
                disagg::cancel_transfer(
                    exporting.handoff.agent(),
                    exporting.handoff.transfer_id,
                    &why,
                );
                self.trace.event("kv_export_failed", Vec::new());
            }
        }
    }

    /// Stops watching the prefill half (the request ends or moves): aborts it and cancels its
    /// transfer.
    async fn stop_export(&mut self, why: &str) {
        if let Some(exporting) = self.exporting.take() {
            exporting.placement.abort().await;
            disagg::cancel_transfer(exporting.handoff.agent(), exporting.handoff.transfer_id, why);
        }
    }
}

/// The wire's finish reason and `stop_reason` (the stop token's id) for the core's reason.
fn wire_finish(reason: FinishReason) -> (v1::FinishReason, String) {
    match reason {
        FinishReason::Stop(StopCause::Eos(t) | StopCause::StopToken(t)) => {
            (v1::FinishReason::Stop, t.to_string())
        }
        FinishReason::Length => (v1::FinishReason::Length, String::new()),
        FinishReason::Abort => (v1::FinishReason::Abort, String::new()),
        FinishReason::Error | FinishReason::Transferred => (v1::FinishReason::Error, String::new()),
    }
}
