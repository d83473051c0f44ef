//! The front: the client API (`ferry.v1.Generation`; the OpenAI HTTP API translates to it).
//! It checks and tokenizes requests, places each on an executor (longest cached prefix, then
//! least load), and turns the executor link's token events into a stream of text deltas with
//! stop strings applied. A client that goes away aborts its request, which frees its blocks.
//!
//! Failover: the front journals each live stream — its prompt and the tokens already delivered.
//! When the executor running it is lost, the continuation (prompt + delivered tokens, as prior
//! output) is placed on a surviving executor; seeded sampling and greedy decoding continue
//! exactly, so the client sees one stream with no repeated and no missing token.

pub mod prepare;
pub mod remote;
pub mod text;
pub mod trace;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_proto::v1::{self, generation_server::Generation};
use ferry_sched_core::{FinishReason, RequestId, StopCause};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::executors::ExecutorSet;
use crate::link::{LinkError, LinkEvent, LinkHandle, Submission};
use crate::metrics::SchedulerMetrics;
use prepare::{prepare, PrepareError, ServedModel};
use text::TextAssembler;
use trace::RequestTrace;

/// Where a front sends its requests.
pub enum Route {
    /// Executors this process drives (the scheduler role, and `serve`).
    Local(Arc<ExecutorSet>),
    /// The pool's leader scheduler, followed through etcd (a front in its own process).
    Remote(Arc<remote::Leader>),
}

/// Where a live request runs.
#[derive(Clone)]
enum Placement {
    /// On an executor link of this process, under a core id.
    Link { link: LinkHandle, id: RequestId },
    /// On the leader scheduler.
    Remote(remote::Call),
}

impl Placement {
    /// Aborts the request where it runs (a no-op if it already ended).
    async fn abort(&self) {
        match self {
            Placement::Link { link, id } => link.abort(*id).await,
            Placement::Remote(call) => call.cancel(),
        }
    }

    fn name(&self) -> &str {
        match self {
            Placement::Link { link, .. } => &link.name,
            Placement::Remote(call) => &call.leader,
        }
    }
}

/// What a request asks for, kept for as long as it streams so it can be moved.
#[derive(Clone)]
struct Journal {
    /// The trace context of its `request` span (empty when untraced).
    traceparent: String,
    prompt: Vec<u32>,
    /// Tokens delivered to the client so far.
    delivered: Vec<u32>,
    max_tokens: usize,
    min_tokens: usize,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    priority: i32,
    sampling: v1::SamplingParams,
}

impl Journal {
    /// The continuation as a request to a scheduler: prompt tokens plus the delivered tokens
    /// as prior output. Stop strings stay with this front, which applies them.
    fn continuation(&self) -> v1::GenerateRequest {
        v1::GenerateRequest {
            input: Some(v1::generate_request::Input::PromptTokenIds(v1::TokenIds {
                ids: self.prompt.clone(),
            })),
            output_token_ids: self.delivered.clone(),
            sampling: Some(self.sampling),
            stopping: Some(v1::StoppingCriteria {
                max_tokens: self.max_tokens as u32,
                min_tokens: self.min_tokens as u32,
                stop_token_ids: self.stop_token_ids.clone(),
                ignore_eos: self.ignore_eos,
                ..Default::default()
            }),
            priority: self.priority,
            ..Default::default()
        }
    }

    fn submission(&self, id: RequestId, events: mpsc::UnboundedSender<LinkEvent>) -> Submission {
        Submission {
            id,
            prompt: self.prompt.clone(),
            output: self.delivered.clone(),
            max_tokens: self.max_tokens,
            min_tokens: self.min_tokens,
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            priority: self.priority,
            sampling: self.sampling,
            traceparent: self.traceparent.clone(),
            events,
        }
    }
}

/// What a new request's stream starts from.
type Admitted = (Placement, Journal, TextAssembler, mpsc::UnboundedReceiver<LinkEvent>);

/// Shared front state.
pub struct Front {
    model: ServedModel,
    route: Route,
    metrics: Arc<SchedulerMetrics>,
    max_live: usize,
    /// How long a request whose executor was lost waits for another one to appear.
    failover_wait: Duration,
    next_id: AtomicU64,
    live: Mutex<HashMap<String, Placement>>,
}

/// The gRPC face of the front.
#[derive(Clone)]
pub struct GenerationService {
    front: Arc<Front>,
}

impl GenerationService {
    /// A front serving `model` through `route`, holding at most `max_live` requests at once;
    /// a request whose executor (or scheduler) is lost waits up to `failover_wait` for another.
    pub fn new(model: ServedModel, route: Route, max_live: usize, failover_wait: Duration) -> Self {
        let metrics = match &route {
            Route::Local(set) => set.metrics.clone(),
            Route::Remote(_) => SchedulerMetrics::new(),
        };
        let front = Front {
            model,
            route,
            metrics,
            max_live,
            failover_wait,
            next_id: AtomicU64::new(1),
            live: Mutex::default(),
        };
        Self { front: Arc::new(front) }
    }

    /// The served model.
    pub fn model(&self) -> &ServedModel {
        &self.front.model
    }

    /// What `/metrics` shows for this front (and the executors it drives), with `leading`
    /// when the process campaigns for leadership.
    pub fn metrics_view(
        &self,
        leading: Option<tokio::sync::watch::Receiver<Option<u64>>>,
    ) -> crate::metrics::MetricsView {
        crate::metrics::MetricsView {
            model_name: self.front.model.name.clone(),
            metrics: self.front.metrics.clone(),
            executors: match &self.front.route {
                Route::Local(set) => Some(set.clone()),
                Route::Remote(_) => None,
            },
            leading,
        }
    }

    /// Whether requests can run now: an executor session is up (a remote front: a leader is
    /// known).
    pub fn has_executors(&self) -> bool {
        match &self.front.route {
            Route::Local(set) => !set.alive().is_empty(),
            Route::Remote(leader) => leader.current().is_some(),
        }
    }
}

/// vLLM's name for a finish reason.
fn vllm_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop(_) => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
        FinishReason::Error | FinishReason::Transferred => "error",
    }
}

fn finish_reason(reason: FinishReason) -> (v1::FinishReason, String) {
    match reason {
        FinishReason::Stop(StopCause::Eos(t)) | FinishReason::Stop(StopCause::StopToken(t)) => {
            (v1::FinishReason::Stop, t.to_string())
        }
        FinishReason::Length => (v1::FinishReason::Length, String::new()),
        FinishReason::Abort => (v1::FinishReason::Abort, String::new()),
        FinishReason::Error | FinishReason::Transferred => (v1::FinishReason::Error, String::new()),
    }
}

/// Why a request could not be placed.
enum PlaceError {
    /// No executor is up.
    NoExecutor,
    /// The executor refused it (bad for that executor: too long for its cache, …).
    Refused(String),
    /// The leader scheduler refused it, or none answered in time.
    Remote(Status),
}

impl From<PlaceError> for Status {
    fn from(e: PlaceError) -> Status {
        match e {
            PlaceError::NoExecutor => Status::unavailable("no executor is connected"),
            PlaceError::Refused(why) => Status::invalid_argument(why),
            PlaceError::Remote(status) => status,
        }
    }
}

impl std::fmt::Display for PlaceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlaceError::NoExecutor => write!(f, "no other executor is up"),
            PlaceError::Refused(why) => write!(f, "no other executor took it: {why}"),
            PlaceError::Remote(s) => write!(f, "no scheduler took it: {}", s.message()),
        }
    }
}

impl Front {
    /// The executor for a sequence: the longest cached prefix first, then the lightest load,
    /// then the first listed (DESIGN.md §2's router).
    async fn pick(alive: &[LinkHandle], tokens: &[u32]) -> Option<LinkHandle> {
        if alive.len() <= 1 {
            return alive.first().cloned();
        }
        let tokens: Arc<[u32]> = tokens.into();
        let asks = alive.iter().map(|l| l.prefix_hit(tokens.clone()));
        let hits = futures_util::future::join_all(asks).await;
        let score = |k: usize| {
            (
                hits[k],
                std::cmp::Reverse(alive[k].load.load(Ordering::Relaxed)),
                std::cmp::Reverse(k),
            )
        };
        (0..alive.len()).max_by_key(|k| score(*k)).map(|k| alive[k].clone())
    }

    /// Places `journal` (its prompt and delivered tokens) on an executor up now, or one that
    /// comes up within `patience`; an executor that turns out to be gone is skipped.
    async fn place(
        &self,
        journal: &Journal,
        patience: Duration,
    ) -> Result<(Placement, mpsc::UnboundedReceiver<LinkEvent>), PlaceError> {
        let executors = match &self.route {
            Route::Local(set) => set,
            Route::Remote(leader) => return Self::place_remote(leader, journal, patience).await,
        };
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let alive = executors.wait_alive(left).await;
            let mut sequence = journal.prompt.clone();
            sequence.extend_from_slice(&journal.delivered);
            let Some(link) = Self::pick(&alive, &sequence).await else {
                return Err(PlaceError::NoExecutor);
            };
            let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
            let (events_tx, events_rx) = mpsc::unbounded_channel();
            match link.add(journal.submission(id, events_tx)).await {
                Ok(Ok(())) => return Ok((Placement::Link { link, id }, events_rx)),
                Ok(Err(e)) => return Err(PlaceError::Refused(e.to_string())),
                Err(LinkError::Gone) | Err(LinkError::Connect { .. }) => {
                    // It died between the pick and the add: try the others.
                    link.close("its loop stopped");
                    if tokio::time::Instant::now() >= deadline && executors.alive().is_empty() {
                        return Err(PlaceError::NoExecutor);
                    }
                }
            }
        }
    }

    /// Sends `journal` to the leader scheduler, retrying (no leader, leader unreachable or
    /// without executors) until `patience` runs out.
    async fn place_remote(
        leader: &remote::Leader,
        journal: &Journal,
        patience: Duration,
    ) -> Result<(Placement, mpsc::UnboundedReceiver<LinkEvent>), PlaceError> {
        let deadline = tokio::time::Instant::now() + patience;
        let mut delay = Duration::from_millis(50);
        loop {
            match remote::submit(leader, journal.continuation(), &journal.traceparent).await {
                Ok((call, rx)) => return Ok((Placement::Remote(call), rx)),
                Err(remote::SubmitError::Refused(status)) => {
                    return Err(PlaceError::Remote(status))
                }
                Err(remote::SubmitError::Retry(status)) => {
                    if tokio::time::Instant::now() >= deadline {
                        return Err(PlaceError::Remote(status));
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_millis(500));
                }
            }
        }
    }

    /// Checks, tokenizes and places a new request; what its stream needs, or the refusal.
    async fn admit(
        &self,
        req: &v1::GenerateRequest,
        request_id: &str,
        trace: &mut RequestTrace,
    ) -> Result<Admitted, Status> {
        let front = self;
        let prepared = trace.tokenize(|| prepare(&front.model, req)).map_err(|e| match e {
            PrepareError::UnknownModel { .. } => Status::not_found(e.to_string()),
            PrepareError::Invalid(_) => Status::invalid_argument(e.to_string()),
        })?;
        let traceparent = trace.open_request(prepared.prompt.len());
        let journal = Journal {
            traceparent,
            prompt: prepared.prompt,
            delivered: prepared.output,
            max_tokens: prepared.max_tokens,
            min_tokens: prepared.min_tokens,
            stop_token_ids: prepared.stop_token_ids,
            ignore_eos: prepared.ignore_eos,
            priority: prepared.priority,
            sampling: prepared.sampling,
        };
        {
            let live =
                front.live.lock().map_err(|_| Status::internal("front state is poisoned"))?;
            if live.contains_key(request_id) {
                return Err(Status::already_exists(format!(
                    "request id {request_id:?} is already live"
                )));
            }
            if live.len() >= front.max_live {
                return Err(Status::resource_exhausted(format!(
                    "the queue is full: {} requests are running or waiting (limit {}); retry later",
                    live.len(),
                    front.max_live
                )));
            }
        }
        // A new request does not wait for an executor: no executor is a 503 now.
        let (placement, events_rx) = front.place(&journal, Duration::ZERO).await?;
        let admitted = {
            let mut live =
                front.live.lock().map_err(|_| Status::internal("front state is poisoned"))?;
            let room = !live.contains_key(request_id) && live.len() < front.max_live;
            if room {
                live.insert(request_id.to_string(), placement.clone());
            }
            room
        };
        if !admitted {
            placement.abort().await;
            return Err(Status::resource_exhausted(format!(
                "the queue is full or request id {request_id:?} became live meanwhile (limit {}); retry later",
                front.max_live
            )));
        }
        let assembler = TextAssembler::new(&prepared.stop, prepared.include_stop_str);
        Ok((placement, journal, assembler, events_rx))
    }

    fn forget(&self, request_id: &str) {
        if let Ok(mut live) = self.live.lock() {
            live.remove(request_id);
        }
    }

    fn set_placement(&self, request_id: &str, placement: &Placement) {
        if let Ok(mut live) = self.live.lock() {
            if let Some(p) = live.get_mut(request_id) {
                *p = placement.clone();
            }
        }
    }

    /// Streams one request's events until it ends or the client leaves, moving it to another
    /// executor when its own is lost.
    #[allow(clippy::too_many_arguments)]
    async fn pump(
        self: Arc<Self>,
        request_id: String,
        mut placement: Placement,
        mut journal: Journal,
        mut assembler: TextAssembler,
        mut events: mpsc::UnboundedReceiver<LinkEvent>,
        tx: mpsc::Sender<Result<v1::GenerateEvent, Status>>,
        arrived: Instant,
        trace: RequestTrace,
    ) {
        let metrics = &self.metrics;
        let mut last_token: Option<Instant> = None;
        // How it ended, for its spans: vLLM's finish reason and the core's figures.
        let mut ended: Option<(&'static str, Option<ferry_sched_core::FinishStats>)> = None;
        let tok = &self.model.tokenizer;
        let prompt_len = journal.prompt.len();
        let event = |text: String, token_ids: Vec<u32>, logprobs: Option<v1::PositionLogprobs>| {
            v1::GenerateEvent {
                request_id: request_id.clone(),
                text,
                token_ids,
                logprobs: logprobs.into_iter().collect(),
                ..Default::default()
            }
        };
        loop {
            let ev = tokio::select! {
                ev = events.recv() => ev,
                () = tx.closed() => {
                    placement.abort().await;
                    ended = Some(("abort", None));
                    break;
                }
            };
            let out = match ev {
                Some(LinkEvent::Token(token, logprobs)) => {
                    let now = Instant::now();
                    match last_token {
                        None => {
                            metrics.ttft.observe((now - arrived).as_secs_f64());
                            trace.event("first_token", Vec::new());
                        }
                        Some(t) => metrics.itl.observe((now - t).as_secs_f64()),
                    }
                    last_token = Some(now);
                    journal.delivered.push(token);
                    let pushed = assembler.push(tok, token);
                    match pushed.stopped {
                        None => Ok(event(pushed.text, vec![token], logprobs)),
                        Some(stop) => {
                            placement.abort().await;
                            metrics.finished(FinishReason::Stop(StopCause::StopToken(token)));
                            metrics.e2e.observe(arrived.elapsed().as_secs_f64());
                            ended = Some(("stop", None));
                            let mut last = event(pushed.text, vec![token], logprobs);
                            last.finish_reason = v1::FinishReason::Stop.into();
                            last.stop_reason = stop;
                            last.usage = Some(v1::Usage {
                                prompt_tokens: prompt_len as u32,
                                completion_tokens: journal.delivered.len() as u32,
                                cached_prompt_tokens: 0,
                            });
                            let _ = tx.send(Ok(last)).await;
                            break;
                        }
                    }
                }
                Some(LinkEvent::Preempted) => {
                    trace.event("preempted", Vec::new());
                    continue;
                }
                Some(LinkEvent::Finished { reason, stats }) => {
                    metrics.finished(reason);
                    ended = Some((vllm_reason(reason), Some(stats)));
                    metrics.e2e.observe(arrived.elapsed().as_secs_f64());
                    if let Some(q) = stats.queue_time {
                        metrics.queue_time.observe(q);
                    }
                    let (reason, stop_reason) = finish_reason(reason);
                    let mut last = event(assembler.finish(), Vec::new(), None);
                    last.finish_reason = reason.into();
                    last.stop_reason = stop_reason;
                    last.usage = Some(v1::Usage {
                        prompt_tokens: stats.prompt_tokens as u32,
                        completion_tokens: stats.output_tokens as u32,
                        cached_prompt_tokens: stats.prefix_hit_tokens as u32,
                    });
                    let _ = tx.send(Ok(last)).await;
                    break;
                }
                Some(LinkEvent::Failed) | None => {
                    let moved = tokio::select! {
                        moved = self.place(&journal, self.failover_wait) => moved,
                        () = tx.closed() => break,
                    };
                    match moved {
                        Ok((to, rx)) => {
                            tracing::warn!(
                                request = %request_id,
                                from = %placement.name(),
                                to = %to.name(),
                                delivered = journal.delivered.len(),
                                "where it ran was lost: request moved"
                            );
                            metrics.requests_moved.add(1);
                            trace.event(
                                "moved",
                                vec![
                                    opentelemetry::KeyValue::new(
                                        "from",
                                        placement.name().to_string(),
                                    ),
                                    opentelemetry::KeyValue::new("to", to.name().to_string()),
                                ],
                            );
                            placement = to;
                            events = rx;
                            self.set_placement(&request_id, &placement);
                            continue;
                        }
                        Err(e) => {
                            metrics.failed();
                            ended = Some(("error", None));
                            let why = format!("where this request ran was lost and {e}");
                            let mut last = event(assembler.finish(), Vec::new(), None);
                            last.finish_reason = v1::FinishReason::Error.into();
                            last.error = why;
                            let _ = tx.send(Ok(last)).await;
                            break;
                        }
                    }
                }
            };
            if tx.send(out).await.is_err() {
                placement.abort().await;
                ended = Some(("abort", None));
                break;
            }
        }
        let (reason, stats) = ended.unwrap_or(("abort", None));
        trace.finish(reason, placement.name(), stats.as_ref());
        self.forget(&request_id);
    }
}

#[tonic::async_trait]
impl Generation for GenerationService {
    type GenerateStream = ReceiverStream<Result<v1::GenerateEvent, Status>>;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let arrived = Instant::now();
        let parent = ferry_runtime::telemetry::extract_metadata(request.metadata());
        let req = request.into_inner();
        let front = &self.front;
        let request_id = if req.request_id.is_empty() {
            format!("req-{}", front.next_id.fetch_add(1, Ordering::Relaxed))
        } else {
            req.request_id.clone()
        };
        let mut trace = RequestTrace::start(&parent, &request_id);
        let admitted = front.admit(&req, &request_id, &mut trace).await;
        let (placement, journal, assembler, events_rx) = match admitted {
            Ok(a) => a,
            Err(status) => {
                trace.refused(status.message());
                return Err(status);
            }
        };
        let (tx, rx) = mpsc::channel(64);
        // Log lines about this request carry its id and trace id.
        let span =
            tracing::info_span!("request", request_id = %request_id, trace_id = %trace.trace_id());
        let pump = front
            .clone()
            .pump(request_id, placement, journal, assembler, events_rx, tx, arrived, trace);
        tokio::spawn(tracing::Instrument::instrument(pump, span));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn abort(
        &self,
        request: Request<v1::AbortRequest>,
    ) -> Result<Response<v1::AbortResponse>, Status> {
        let request_id = request.into_inner().request_id;
        let placement = self
            .front
            .live
            .lock()
            .map_err(|_| Status::internal("front state is poisoned"))?
            .get(&request_id)
            .cloned();
        if let Some(p) = &placement {
            p.abort().await;
        }
        Ok(Response::new(v1::AbortResponse { found: placement.is_some() }))
    }

    async fn list_models(
        &self,
        _request: Request<v1::ListModelsRequest>,
    ) -> Result<Response<v1::ListModelsResponse>, Status> {
        let m = &self.front.model;
        Ok(Response::new(v1::ListModelsResponse {
            models: vec![v1::ModelInfo {
                id: m.name.clone(),
                max_model_len: m.max_model_len as u32,
                owned_by: "ferry".into(),
            }],
        }))
    }
}
