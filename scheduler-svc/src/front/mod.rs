//! The front: the client API (`ferry.v1.Generation`; the OpenAI HTTP API translates to it).
//! It checks and tokenizes requests, places each on an executor (the least loaded), and turns
//! the executor link's token events into a stream of text deltas with stop strings applied.
//! A client that goes away aborts its request, which frees its blocks.

pub mod prepare;
pub mod text;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ferry_proto::v1::{self, generation_server::Generation};
use ferry_sched_core::{FinishReason, RequestId, StopCause};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::link::{LinkError, LinkEvent, LinkHandle, Submission};
use prepare::{prepare, PrepareError, ServedModel};
use text::TextAssembler;

/// Where a live request runs.
#[derive(Clone, Copy)]
struct Placement {
    link: usize,
    id: RequestId,
}

/// Shared front state.
pub struct Front {
    model: ServedModel,
    links: Vec<LinkHandle>,
    max_live: usize,
    next_id: AtomicU64,
    live: Mutex<HashMap<String, Placement>>,
}

/// The gRPC face of the front.
#[derive(Clone)]
pub struct GenerationService {
    front: Arc<Front>,
}

impl GenerationService {
    /// A front serving `model` on `links`, holding at most `max_live` requests at once.
    pub fn new(model: ServedModel, links: Vec<LinkHandle>, max_live: usize) -> Self {
        let front =
            Front { model, links, max_live, next_id: AtomicU64::new(1), live: Mutex::default() };
        Self { front: Arc::new(front) }
    }

    /// The served model.
    pub fn model(&self) -> &ServedModel {
        &self.front.model
    }

    /// Whether any executor is connected and its session up.
    pub fn has_executors(&self) -> bool {
        self.front.links.iter().any(LinkHandle::is_alive)
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

impl Front {
    /// The executor for a prompt: the longest cached prefix first, then the lightest load,
    /// then the first listed (DESIGN.md §2's router).
    async fn place(&self, prompt: &[u32]) -> Result<usize, Status> {
        let alive: Vec<usize> =
            (0..self.links.len()).filter(|i| self.links[*i].is_alive()).collect();
        if alive.is_empty() {
            return Err(Status::unavailable("no executor is connected"));
        }
        let hits: Vec<usize> = if alive.len() == 1 {
            vec![0]
        } else {
            let prompt: Arc<[u32]> = prompt.into();
            let asks = alive.iter().map(|i| self.links[*i].prefix_hit(prompt.clone()));
            futures_util::future::join_all(asks).await
        };
        let score = |k: usize| {
            let i = alive[k];
            (
                hits[k],
                std::cmp::Reverse(self.links[i].load.load(Ordering::Relaxed)),
                std::cmp::Reverse(i),
            )
        };
        Ok(alive[(0..alive.len()).max_by_key(|k| score(*k)).unwrap_or(0)])
    }

    fn forget(&self, request_id: &str) {
        if let Ok(mut live) = self.live.lock() {
            live.remove(request_id);
        }
    }

    /// Streams one request's events until it ends or the client leaves.
    async fn pump(
        self: Arc<Self>,
        request_id: String,
        placement: Placement,
        prompt_len: usize,
        mut assembler: TextAssembler,
        mut events: mpsc::UnboundedReceiver<LinkEvent>,
        tx: mpsc::Sender<Result<v1::GenerateEvent, Status>>,
    ) {
        let link = &self.links[placement.link];
        let tok = &self.model.tokenizer;
        let mut completion = 0u32;
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
                    link.abort(placement.id).await;
                    break;
                }
            };
            let out = match ev {
                Some(LinkEvent::Token(token, logprobs)) => {
                    completion += 1;
                    let pushed = assembler.push(tok, token);
                    match pushed.stopped {
                        None => Ok(event(pushed.text, vec![token], logprobs)),
                        Some(stop) => {
                            link.abort(placement.id).await;
                            let mut last = event(pushed.text, vec![token], logprobs);
                            last.finish_reason = v1::FinishReason::Stop.into();
                            last.stop_reason = stop;
                            last.usage = Some(v1::Usage {
                                prompt_tokens: prompt_len as u32,
                                completion_tokens: completion,
                                cached_prompt_tokens: 0,
                            });
                            let _ = tx.send(Ok(last)).await;
                            break;
                        }
                    }
                }
                Some(LinkEvent::Finished { reason, stats }) => {
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
                    let mut last = event(assembler.finish(), Vec::new(), None);
                    last.finish_reason = v1::FinishReason::Error.into();
                    last.error = "the executor running this request was lost".into();
                    let _ = tx.send(Ok(last)).await;
                    break;
                }
            };
            if tx.send(out).await.is_err() {
                link.abort(placement.id).await;
                break;
            }
        }
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
        let req = request.into_inner();
        let front = &self.front;
        let prepared = prepare(&front.model, &req).map_err(|e| match e {
            PrepareError::UnknownModel { .. } => Status::not_found(e.to_string()),
            PrepareError::Invalid(_) => Status::invalid_argument(e.to_string()),
        })?;
        let link_index = front.place(&prepared.prompt).await?;
        let id = RequestId(front.next_id.fetch_add(1, Ordering::Relaxed));
        let request_id = if req.request_id.is_empty() {
            format!("req-{}", id.0)
        } else {
            req.request_id.clone()
        };
        let placement = Placement { link: link_index, id };
        {
            let mut live =
                front.live.lock().map_err(|_| Status::internal("front state is poisoned"))?;
            if live.contains_key(&request_id) {
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
            live.insert(request_id.clone(), placement);
        }
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let prompt_len = prepared.prompt.len();
        let assembler = TextAssembler::new(&prepared.stop, prepared.include_stop_str);
        let sub = Submission {
            id,
            prompt: prepared.prompt,
            max_tokens: prepared.max_tokens,
            min_tokens: prepared.min_tokens,
            stop_token_ids: prepared.stop_token_ids,
            ignore_eos: prepared.ignore_eos,
            priority: prepared.priority,
            sampling: prepared.sampling,
            events: events_tx,
        };
        let added = front.links[link_index].add(sub).await;
        let refused = match added {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(Status::invalid_argument(e.to_string())),
            Err(LinkError::Gone) | Err(LinkError::Connect { .. }) => {
                Some(Status::unavailable("the executor for this request is not reachable"))
            }
        };
        if let Some(status) = refused {
            front.forget(&request_id);
            return Err(status);
        }
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(
            front.clone().pump(request_id, placement, prompt_len, assembler, events_rx, tx),
        );
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
            .copied();
        if let Some(p) = placement {
            self.front.links[p.link].abort(p.id).await;
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
