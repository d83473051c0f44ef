//! The `ferry.v1.Generation` service: a request is admitted ([`super::admission`]) and
//! streamed ([`super::stream`]); a request with several samples (`n` > 1) streams each sample
//! on its own and merges their events for the client, with `usage` counting the prompt once.

use std::sync::Arc;
use std::time::Instant;

use ferry_proto::v1::{self, generation_server::Generation};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::admission::{sample_id, Admitted, Sample, MAX_SAMPLES};
use super::client_stream::ClientStream;
use super::keys::ApiKey;
use super::placement::Placement;
use super::stream::RequestStream;
use super::trace::RequestTrace;
use super::GenerationService;

impl GenerationService {
    /// `generate` for a request with several samples (`n` > 1): each sample streams on its
    /// own (its own placement, journal and moves) into a channel of its own, and their merge
    /// (run as the client reads) forwards their events to the client with their `index`,
    /// `usage` counting the prompt once and the samples' tokens together. The client gone, or one sample's error, ends
    /// every sample.
    async fn generate_samples(
        &self,
        req: &v1::GenerateRequest,
        request_id: String,
        caller: Option<Arc<ApiKey>>,
        trace: RequestTrace,
        arrived: Instant,
    ) -> Result<Response<ClientStream>, Status> {
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
        let merge = async move {
            merge_samples(streams, &tx, request_id).await;
            drop(permit); // the key's request ends with its last sample
        };
        Ok(Response::new(ClientStream::new(rx, merge)))
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
    type GenerateStream = ClientStream;

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
        // Run as the client reads (`ClientStream`): one task per token to wake, not two.
        Ok(Response::new(ClientStream::new(rx, tracing::Instrument::instrument(run, span))))
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

    async fn locate(
        &self,
        request: Request<v1::LocateRequest>,
    ) -> Result<Response<v1::LocateResponse>, Status> {
        self.front.caller(request.metadata())?;
        self.front.locate(&request.into_inner()).await.map(Response::new)
    }

    async fn list_models(
        &self,
        request: Request<v1::ListModelsRequest>,
    ) -> Result<Response<v1::ListModelsResponse>, Status> {
        self.front.caller(request.metadata())?;
        let models = self.front.models.iter().map(|m| v1::ModelInfo {
            id: m.name().to_string(),
            max_model_len: u32::try_from(m.max_model_len).unwrap_or(u32::MAX),
            owned_by: "ferry".into(),
            architecture: m.file.shape.family.name.into(),
            weight_types: m.file.weight_types.clone(),
        });
        Ok(Response::new(v1::ListModelsResponse { models: models.collect() }))
    }
}
