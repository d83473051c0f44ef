//! The front: the client API (`ferry.v1.Generation`; the OpenAI HTTP API translates to it).
//! It checks and tokenizes requests ([`prepare`]), places each where it runs ([`placement`]),
//! and streams its text back ([`stream`]: stop strings applied, a lost request moved). A client
//! that goes away aborts its request, which frees its blocks.
//!
//! The request path by file: `http/openai.rs` (OpenAI JSON) → this module's `generate` →
//! `prepare.rs` (tokenize, check) → `placement.rs` (pick an executor link) →
//! `link/step_loop.rs` (the core schedules it; steps go to the executor) → back as link events
//! → `stream.rs` (detokenize, `text.rs`) → the client.
//!
//! Failover: the front journals each live stream — its spec and the tokens already delivered.
//! When where it runs is lost, the continuation (prompt + delivered tokens, as prior output) is
//! placed again; seeded sampling and greedy decoding continue exactly, so the client sees one
//! stream with no repeated and no missing token.

mod disagg;
pub mod keys;
pub mod placement;
pub mod prepare;
pub mod remote;
pub mod stream;
#[cfg(test)]
mod tests;
pub mod text;
pub mod trace;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferry_proto::v1::{self, generation_server::Generation};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::config::FrontSettings;
use crate::executors::ExecutorSet;
use crate::metrics::SchedulerMetrics;
use crate::request::RequestSpec;
use placement::{Placed, Placement};
pub use prepare::RequestLimits;
use prepare::{prepare, PrepareError, ServedModel};
use stream::RequestStream;
use trace::RequestTrace;

/// Where a front sends its requests.
pub enum Route {
    /// Executors this process drives (the scheduler role, and `serve`).
    Local(Arc<ExecutorSet>),
    /// The pool's leader scheduler, followed through etcd (a front in its own process).
    Remote(Arc<remote::Leader>),
}

/// Shared front state.
pub struct Front {
    model: ServedModel,
    route: Route,
    metrics: Arc<SchedulerMetrics>,
    settings: FrontSettings,
    /// The next id a request gets in an executor's core (each placement takes one).
    next_id: std::sync::atomic::AtomicU64,
    /// The next KV transfer id (prefill/decode handoffs).
    next_transfer: std::sync::atomic::AtomicU64,
    /// Live requests by client request id.
    live: Mutex<HashMap<String, Live>>,
    /// Set when the process begins to drain: `/health` says so from then on.
    draining: std::sync::atomic::AtomicBool,
}

/// A live request: where it runs now, and whose it is.
struct Live {
    placement: Placement,
    /// The id of the API key that created it (`None` when the APIs are open).
    owner: Option<Arc<str>>,
    /// The first sample of a request with several: how many (its others are live under
    /// [`sample_id`]); 0 otherwise.
    samples: usize,
}

/// The gRPC face of the front.
#[derive(Clone)]
pub struct GenerationService {
    front: Arc<Front>,
}

impl GenerationService {
    /// A front serving `model` through `route` under `settings`.
    pub fn new(model: ServedModel, route: Route, settings: FrontSettings) -> Self {
        let metrics = match &route {
            Route::Local(set) => set.metrics.clone(),
            Route::Remote(_) => SchedulerMetrics::new(),
        };
        let front = Front {
            model,
            route,
            metrics,
            settings,
            next_id: std::sync::atomic::AtomicU64::new(1),
            next_transfer: disagg::transfer_ids(),
            live: Mutex::default(),
            draining: std::sync::atomic::AtomicBool::new(false),
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
            model_name: self.front.model.name().to_string(),
            metrics: self.front.metrics.clone(),
            executors: match &self.front.route {
                Route::Local(set) => Some(set.clone()),
                Route::Remote(_) => None,
            },
            leading,
            keys: self.front.settings.keys.clone(),
        }
    }

    /// From now on `/health` answers 503 "draining" (the drain's first step).
    pub fn begin_drain(&self) {
        self.front.draining.store(true, Ordering::SeqCst);
    }

    /// Whether this process is draining.
    pub fn is_draining(&self) -> bool {
        self.front.draining.load(Ordering::SeqCst)
    }

    /// The API keys callers must present (`None`: the client APIs are open).
    pub fn keys(&self) -> Option<&Arc<keys::ApiKeys>> {
        self.front.settings.keys.as_ref()
    }

    /// What one request may ask for.
    pub fn limits(&self) -> &RequestLimits {
        &self.front.settings.limits
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

impl Front {
    fn live(&self) -> Result<std::sync::MutexGuard<'_, HashMap<String, Live>>, Status> {
        self.live.lock().map_err(|_| Status::internal("front state is poisoned"))
    }

    /// The caller's API key (`None` when the APIs are open), or `UNAUTHENTICATED`.
    fn caller(
        &self,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<Option<Arc<keys::ApiKey>>, Status> {
        self.settings.keys.as_ref().map(|k| k.identify_call(metadata)).transpose()
    }

    /// Refuses a new request when its id is live or the front is full.
    fn check_room(&self, request_id: &str) -> Result<(), Status> {
        let live = self.live()?;
        if live.contains_key(request_id) {
            return Err(Status::already_exists(format!(
                "request id {request_id:?} is already live"
            )));
        }
        if live.len() >= self.settings.max_live {
            return Err(Status::resource_exhausted(format!(
                "the queue is full: {} requests are running or waiting (limit {}); retry later",
                live.len(),
                self.settings.max_live
            )));
        }
        Ok(())
    }

    /// Checks and tokenizes a new request from `caller` for `samples` samples; its spec and the
    /// caller's permit (for the prompt and every sample's tokens), or the refusal.
    fn accept(
        &self,
        req: &v1::GenerateRequest,
        caller: Option<&Arc<keys::ApiKey>>,
        trace: &mut RequestTrace,
        samples: usize,
    ) -> Result<(RequestSpec, Option<keys::Permit>), Status> {
        if req.priority != 0 && !self.settings.accepts_priority {
            return Err(Status::invalid_argument(format!(
                "priority {} given, but this scheduler serves first come, first served: start \
                 it with --scheduling-policy priority, or leave priority at 0",
                req.priority
            )));
        }
        let mut spec = trace
            .tokenize(|| prepare(&self.model, &self.settings.limits, req))
            .map_err(|e| match e {
                PrepareError::UnknownModel { .. } => Status::not_found(e.to_string()),
                PrepareError::OtherModel { .. } => Status::failed_precondition(e.to_string()),
                PrepareError::Invalid(_) => Status::invalid_argument(e.to_string()),
            })?;
        let permit = match caller {
            Some(key) => {
                let tokens = (spec.prompt.len() + samples * spec.max_tokens) as u64;
                Some(key.admit(tokens, std::time::Instant::now())?)
            }
            None => None,
        };
        spec.traceparent = trace.open_request(spec.prompt.len());
        Ok((spec, permit))
    }

    /// Checks, tokenizes and places a new request from `caller`; its spec, placement and the
    /// caller's permit (held while it runs), or the refusal.
    async fn admit(
        &self,
        req: &v1::GenerateRequest,
        request_id: &str,
        caller: Option<&Arc<keys::ApiKey>>,
        trace: &mut RequestTrace,
    ) -> Result<Admitted, Status> {
        let (spec, permit) = self.accept(req, caller, trace, 1)?;
        let spec = Arc::new(spec);
        self.check_room(request_id)?;
        // A new request does not wait for an executor here (none is a 503 now); a front in its
        // own process waits out a leader failover (`place_new`).
        let ((placement, events), handoff) = self.place_new(&spec, request_id).await?;
        let admitted = {
            let mut live = self.live()?;
            let room = !live.contains_key(request_id) && live.len() < self.settings.max_live;
            if room {
                let owner = caller.map(|k| k.id.clone());
                let placement = placement.clone();
                live.insert(request_id.to_string(), Live { placement, owner, samples: 0 });
            }
            room
        };
        if !admitted {
            placement.abort().await;
            return Err(Status::resource_exhausted(format!(
                "the queue is full or request id {request_id:?} became live meanwhile (limit {}); retry later",
                self.settings.max_live
            )));
        }
        Ok(Admitted { spec, placed: (placement, events), handoff, permit })
    }

    /// Checks, tokenizes and places the `n` samples of a new request from `caller` (sample i
    /// streams as `sample_id(request_id, i)`, with its own trace under the request's): their
    /// specs (a seed moves on by one per sample, as vLLM's does; only the first scores the
    /// prompt), placements and traces, and the caller's permit; or the refusal.
    async fn admit_samples(
        &self,
        req: &v1::GenerateRequest,
        request_id: &str,
        caller: Option<&Arc<keys::ApiKey>>,
        mut trace: RequestTrace,
        n: usize,
    ) -> Result<(Vec<Sample>, Option<keys::Permit>), (Status, RequestTrace)> {
        let (spec, permit) = match self.accept(req, caller, &mut trace, n) {
            Ok(accepted) => accepted,
            Err(status) => return Err((status, trace)),
        };
        let ids: Vec<String> = (0..n).map(|i| sample_id(request_id, i)).collect();
        let key_id = caller.map_or("", |k| &*k.id).to_string();
        let mut traces = vec![trace];
        let mut specs = Vec::with_capacity(n);
        for (i, id) in ids.iter().enumerate() {
            let mut s = spec.clone();
            if let Some(seed) = s.sampling.seed {
                s.sampling.seed = Some(seed.wrapping_add(i as u64));
            }
            if i > 0 {
                s.sampling.prompt_logprobs = None;
                let mut t = RequestTrace::start(traces[0].context(), id, &key_id);
                s.traceparent = t.open_request(s.prompt.len());
                traces.push(t);
            }
            specs.push(Arc::new(s));
        }
        let placed = match self.check_rooms(&ids) {
            Ok(()) => self.place_samples(&specs, &ids, self.new_request_patience()).await,
            Err(status) => return Err((status, traces.swap_remove(0))),
        };
        let placed = match placed {
            Ok(placed) => placed,
            Err(e) => return Err((e.into(), traces.swap_remove(0))),
        };
        let admitted = match self.live() {
            Ok(mut live) => {
                let room = ids.iter().all(|id| !live.contains_key(id))
                    && live.len() + n <= self.settings.max_live;
                if room {
                    let owner = caller.map(|k| k.id.clone());
                    for (id, (placement, _)) in ids.iter().zip(&placed) {
                        let (placement, owner) = (placement.clone(), owner.clone());
                        live.insert(id.clone(), Live { placement, owner, samples: 0 });
                    }
                    live.get_mut(request_id).expect("inserted").samples = n;
                }
                room
            }
            Err(_) => false,
        };
        if !admitted {
            for (placement, _) in &placed {
                placement.abort().await;
            }
            let status = Status::resource_exhausted(format!(
                "the queue is full or request id {request_id:?} became live meanwhile (limit {}); retry later",
                self.settings.max_live
            ));
            return Err((status, traces.swap_remove(0)));
        }
        let samples = ids
            .into_iter()
            .zip(specs)
            .zip(placed)
            .zip(traces)
            .map(|(((id, spec), placed), trace)| Sample { id, spec, placed, trace })
            .collect();
        Ok((samples, permit))
    }

    /// How long placing a new request waits for an executor: not at all in this process (none
    /// is a 503 now); a front in its own process waits out a leader's failover.
    fn new_request_patience(&self) -> std::time::Duration {
        match self.route {
            Route::Local(_) => std::time::Duration::ZERO,
            Route::Remote(_) => self.settings.failover_wait,
        }
    }

    /// Refuses new samples when one of their ids is live or the front has no room for all.
    fn check_rooms(&self, ids: &[String]) -> Result<(), Status> {
        for id in ids {
            self.check_room(id)?;
        }
        let live = self.live()?.len();
        if live + ids.len() > self.settings.max_live {
            return Err(Status::resource_exhausted(format!(
                "the queue is full: {live} requests are running or waiting and {} samples asked \
                 for (limit {}); retry later",
                ids.len(),
                self.settings.max_live
            )));
        }
        Ok(())
    }

    fn forget(&self, request_id: &str) {
        if let Ok(mut live) = self.live.lock() {
            live.remove(request_id);
        }
    }

    fn set_placement(&self, request_id: &str, placement: &Placement) {
        if let Ok(mut live) = self.live.lock() {
            if let Some(l) = live.get_mut(request_id) {
                l.placement = placement.clone();
            }
        }
    }
}

/// Most samples one request may ask for (`n`, and OpenAI's `best_of`).
pub const MAX_SAMPLES: u32 = 64;

/// The stream id of sample `i` of request `request_id`: the request's own for the first.
pub(crate) fn sample_id(request_id: &str, i: usize) -> String {
    if i == 0 {
        request_id.to_string()
    } else {
        format!("{request_id}#{i}")
    }
}

/// One sample of a request with several, admitted.
struct Sample {
    id: String,
    spec: Arc<RequestSpec>,
    placed: Placed,
    trace: RequestTrace,
}

/// A request the front admitted: its spec, where it runs, its decode half when disaggregated,
/// and its caller's permit (held while it runs; `None` when the APIs are open).
struct Admitted {
    spec: Arc<RequestSpec>,
    placed: Placed,
    handoff: Option<disagg::Handoff>,
    permit: Option<keys::Permit>,
}

impl GenerationService {
    /// `generate` for a request with several samples (`n` > 1): each sample streams on its
    /// own (its own placement, journal and moves) into a channel of its own, and one task
    /// forwards their events to the client with their `index`, `usage` counting the prompt
    /// once and the samples' tokens together. The client gone, or one sample's error, ends
    /// every sample.
    async fn generate_samples(
        &self,
        req: &v1::GenerateRequest,
        request_id: String,
        caller: Option<Arc<keys::ApiKey>>,
        trace: RequestTrace,
        arrived: Instant,
    ) -> Result<Response<ReceiverStream<Result<v1::GenerateEvent, Status>>>, Status> {
        let front = &self.front;
        let n = req.n;
        let refuse = |trace: RequestTrace, status: Status| {
            trace.refused(status.message());
            Err(status)
        };
        if n > MAX_SAMPLES {
            let status = Status::invalid_argument(format!(
                "n = {n} samples asked for; at most {MAX_SAMPLES} are served"
            ));
            return refuse(trace, status);
        }
        if !req.output_token_ids.is_empty() {
            let status = Status::invalid_argument(
                "a continuation (output_token_ids) is one sample: n must be 1",
            );
            return refuse(trace, status);
        }
        let admitted =
            front.admit_samples(req, &request_id, caller.as_ref(), trace, n as usize).await;
        let (samples, permit) = match admitted {
            Ok(a) => a,
            Err((status, trace)) => return refuse(trace, status),
        };
        let (tx, rx) = mpsc::channel(64);
        let mut streams = tokio_stream::StreamMap::new();
        for (i, Sample { id, spec, placed, trace }) in samples.into_iter().enumerate() {
            let (sample_tx, sample_rx) = mpsc::channel(64);
            let index = u32::try_from(i).expect("at most MAX_SAMPLES");
            streams.insert(index, ReceiverStream::new(sample_rx));
            let span =
                tracing::info_span!("request", request_id = %id, trace_id = %trace.trace_id());
            let stream =
                RequestStream::new(front.clone(), id, spec, placed, sample_tx, arrived, trace);
            tokio::spawn(tracing::Instrument::instrument(stream.run(), span));
        }
        tokio::spawn(async move {
            merge_samples(streams, &tx, request_id).await;
            drop(permit); // the key's request ends with its last sample
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Forwards the samples' events to `client` (see [`GenerationService::generate_samples`]).
async fn merge_samples(
    mut streams: tokio_stream::StreamMap<u32, ReceiverStream<Result<v1::GenerateEvent, Status>>>,
    client: &mpsc::Sender<Result<v1::GenerateEvent, Status>>,
    request_id: String,
) {
    use tokio_stream::StreamExt;
    let mut completion = vec![0u32; streams.len()];
    let mut cached = 0;
    loop {
        let next = tokio::select! {
            next = streams.next() => next,
            () = client.closed() => return,
        };
        let Some((index, event)) = next else { return };
        let mut event = match event {
            Ok(event) => event,
            Err(status) => {
                let _ = client.send(Err(status)).await;
                return; // dropping the other samples' channels ends them
            }
        };
        let i = index as usize;
        if let Some(u) = &event.usage {
            completion[i] = u.completion_tokens;
        } else {
            let tokens = u32::try_from(event.token_ids.len()).unwrap_or(u32::MAX);
            completion[i] = completion[i].saturating_add(tokens);
        }
        if let Some(u) = &mut event.usage {
            cached = cached.max(u.cached_prompt_tokens);
            u.completion_tokens = completion.iter().sum();
            u.cached_prompt_tokens = cached;
        }
        event.index = index;
        event.request_id.clone_from(&request_id);
        if client.send(Ok(event)).await.is_err() {
            return;
        }
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
        let front = &self.front;
        let caller = front.caller(request.metadata())?;
        let parent = ferry_runtime::telemetry::extract_metadata(request.metadata());
        let req = request.into_inner();
        let request_id = if req.request_id.is_empty() {
            // Random (128 bits): an id names nobody else's request and cannot be guessed.
            format!("req-{}", ferry_runtime::secret::to_hex(&ferry_runtime::secret::random()[..16]))
        } else {
            req.request_id.clone()
        };
        let key_id = caller.as_ref().map_or("", |k| &*k.id).to_string();
        let mut trace = RequestTrace::start(&parent, &request_id, &key_id);
        if req.n > 1 {
            return self.generate_samples(&req, request_id, caller, trace, arrived).await;
        }
        let admitted = match front.admit(&req, &request_id, caller.as_ref(), &mut trace).await {
            Ok(a) => a,
            Err(status) => {
                trace.refused(status.message());
                tracing::debug!(request_id = %request_id, api_key = %key_id, status = %status.message(), "request refused");
                return Err(status);
            }
        };
        let Admitted { spec, placed, handoff, permit } = admitted;
        let (tx, rx) = mpsc::channel(64);
        // Log lines about this request carry its id, its trace id and its API key's id.
        let span = tracing::info_span!(
            "request",
            request_id = %request_id,
            trace_id = %trace.trace_id(),
            api_key = %key_id
        );
        let stream =
            RequestStream::new(front.clone(), request_id, spec, placed, tx, arrived, trace)
                .with_handoff(handoff);
        let run = async move {
            stream.run().await;
            drop(permit); // the key's request ends here
        };
        tokio::spawn(tracing::Instrument::instrument(run, span));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn abort(
        &self,
        request: Request<v1::AbortRequest>,
    ) -> Result<Response<v1::AbortResponse>, Status> {
        let caller = self.front.caller(request.metadata())?;
        let request_id = request.into_inner().request_id;
        let placements: Vec<Placement> = {
            let live = self.front.live()?;
            match live.get(&request_id) {
                // With API keys, only the key that created a request may abort it.
                Some(l) if l.owner.as_deref() != caller.as_ref().map(|k| &*k.id) => {
                    return Err(Status::permission_denied(format!(
                        "request {request_id:?} was created with another API key; only that key may abort it"
                    )));
                }
                // Every sample of a request with several.
                Some(l) => std::iter::once(l.placement.clone())
                    .chain((1..l.samples).filter_map(|i| {
                        live.get(&sample_id(&request_id, i)).map(|s| s.placement.clone())
                    }))
                    .collect(),
                None => Vec::new(),
            }
        };
        for p in &placements {
            p.abort().await;
        }
        Ok(Response::new(v1::AbortResponse { found: !placements.is_empty() }))
    }

    async fn list_models(
        &self,
        request: Request<v1::ListModelsRequest>,
    ) -> Result<Response<v1::ListModelsResponse>, Status> {
        self.front.caller(request.metadata())?;
        let m = &self.front.model;
        Ok(Response::new(v1::ListModelsResponse {
            models: vec![v1::ModelInfo {
                id: m.name().to_string(),
                max_model_len: u32::try_from(m.max_model_len).unwrap_or(u32::MAX),
                owned_by: "ferry".into(),
            }],
        }))
    }
}
