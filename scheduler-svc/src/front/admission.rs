//! Admission: the front's journal of live requests (one entry per stream, by request id, with
//! where it runs and whose key it is charged to) and how a new request gets in — the caller's
//! key, the priority rule, tokenizing and the request's checks ([`super::prepare`]), room in
//! the journal, and its placement ([`super::placement`], [`super::disagg`]). A request with
//! several samples is admitted whole or not at all.

use std::collections::HashMap;
use std::sync::Arc;

use ferry_proto::v1;
use tonic::Status;

use super::disagg::Handoff;
use super::keys::{ApiKey, Permit};
use super::models::ModelRefusal;
use super::placement::{Placed, Placement};
use super::prepare::{prepare, PrepareError};
use super::trace::RequestTrace;
use super::{Front, Live, Route};
use crate::request::RequestSpec;

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
pub(super) struct Sample {
    pub(super) id: String,
    pub(super) spec: Arc<RequestSpec>,
    pub(super) placed: Placed,
    pub(super) trace: RequestTrace,
}

/// A request the front admitted: its spec, where it runs, its decode half when disaggregated,
/// and its caller's permit (held while it runs; `None` when the APIs are open).
pub(super) struct Admitted {
    pub(super) spec: Arc<RequestSpec>,
    pub(super) placed: Placed,
    pub(super) handoff: Option<Handoff>,
    pub(super) permit: Option<Permit>,
}

impl Front {
    pub(super) fn live(&self) -> Result<std::sync::MutexGuard<'_, HashMap<String, Live>>, Status> {
        self.live.lock().map_err(|_| Status::internal("front state is poisoned"))
    }

    /// The caller's API key (`None` when the APIs are open), or `UNAUTHENTICATED`.
    pub(super) fn caller(
        &self,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<Option<Arc<ApiKey>>, Status> {
        self.settings.keys.as_ref().map(|k| k.identify_call(metadata)).transpose()
    }

    /// What a caller is told while this process stands by for its pool's leader.
    pub(super) fn standby_notice(&self) -> Option<String> {
        self.standing.get().and_then(|s| s.standby_notice())
    }

    /// Refuses a new request when its id is live or the front is full.
    pub(super) fn check_room(&self, request_id: &str) -> Result<(), Status> {
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
    pub(super) fn accept(
        &self,
        req: &v1::GenerateRequest,
        caller: Option<&Arc<ApiKey>>,
        trace: &mut RequestTrace,
        samples: usize,
    ) -> Result<(RequestSpec, Option<Permit>), Status> {
        if let Some(notice) = self.standby_notice() {
            return Err(Status::unavailable(notice));
        }
        if req.priority != 0 && !self.settings.accepts_priority {
            return Err(Status::invalid_argument(format!(
                "priority {} given, but this scheduler serves first come, first served: start \
                 it with --scheduling-policy priority, or leave priority at 0",
                req.priority
            )));
        }
        let mut spec = trace
            .tokenize(|| prepare(&self.models, &self.settings.limits, req))
            .map_err(|e| match e {
                PrepareError::Model(ModelRefusal::Unknown { .. }) => {
                    Status::not_found(e.to_string())
                }
                PrepareError::Model(ModelRefusal::Other { .. }) => {
                    Status::failed_precondition(e.to_string())
                }
                PrepareError::Invalid(_) => Status::invalid_argument(e.to_string()),
            })?;
        let permit = match caller {
            Some(key) => {
                let tokens = (spec.prompt.len() + samples * spec.max_tokens) as u64;
                Some(key.admit(tokens, std::time::Instant::now())?)
            }
            None => None,
        };
        if let Some(lora) = &spec.lora {
            self.models.get(spec.model).adapters.count_request(&lora.name);
        }
        spec.traceparent = trace.open_request(&spec);
        Ok((spec, permit))
    }

    /// Checks, tokenizes and places a new request from `caller`; its spec, placement and the
    /// caller's permit (held while it runs), or the refusal.
    pub(super) async fn admit(
        &self,
        req: &v1::GenerateRequest,
        request_id: &str,
        caller: Option<&Arc<ApiKey>>,
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
    pub(super) async fn admit_samples(
        &self,
        req: &v1::GenerateRequest,
        request_id: &str,
        caller: Option<&Arc<ApiKey>>,
        mut trace: RequestTrace,
        n: usize,
    ) -> Result<(Vec<Sample>, Option<Permit>), (Status, RequestTrace)> {
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
                s.traceparent = t.open_request(&s);
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
    pub(super) fn new_request_patience(&self) -> std::time::Duration {
        match self.route {
            Route::Local(_) => std::time::Duration::ZERO,
            Route::Remote(_) => self.settings.failover_wait,
        }
    }

    /// Refuses new samples when one of their ids is live or the front has no room for all.
    pub(super) fn check_rooms(&self, ids: &[String]) -> Result<(), Status> {
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

    pub(super) fn forget(&self, request_id: &str) {
        if let Ok(mut live) = self.live.lock() {
            live.remove(request_id);
        }
    }

    pub(super) fn set_placement(&self, request_id: &str, placement: &Placement) {
        if let Ok(mut live) = self.live.lock() {
            if let Some(l) = live.get_mut(request_id) {
                l.placement = placement.clone();
            }
        }
    }
}
