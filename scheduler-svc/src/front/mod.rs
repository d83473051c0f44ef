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

    /// Checks, tokenizes and places a new request from `caller`; its spec, placement and the
    /// caller's permit (held while it runs), or the refusal.
    async fn admit(
        &self,
        req: &v1::GenerateRequest,
        request_id: &str,
        caller: Option<&Arc<keys::ApiKey>>,
        trace: &mut RequestTrace,
    ) -> Result<Admitted, Status> {
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
                let tokens = (spec.prompt.len() + spec.max_tokens) as u64;
                Some(key.admit(tokens, std::time::Instant::now())?)
            }
            None => None,
        };
        spec.traceparent = trace.open_request(spec.prompt.len());
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
                live.insert(request_id.to_string(), Live { placement: placement.clone(), owner });
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

/// A request the front admitted: its spec, where it runs, its decode half when disaggregated,
/// and its caller's permit (held while it runs; `None` when the APIs are open).
struct Admitted {
    spec: Arc<RequestSpec>,
    placed: Placed,
    handoff: Option<disagg::Handoff>,
    permit: Option<keys::Permit>,
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
        let placement = match self.front.live()?.get(&request_id) {
            // With API keys, only the key that created a request may abort it.
            Some(l) if l.owner.as_deref() != caller.as_ref().map(|k| &*k.id) => {
                return Err(Status::permission_denied(format!(
                    "request {request_id:?} was created with another API key; only that key may abort it"
                )));
            }
            Some(l) => Some(l.placement.clone()),
            None => None,
        };
        if let Some(p) = &placement {
            p.abort().await;
        }
        Ok(Response::new(v1::AbortResponse { found: placement.is_some() }))
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
