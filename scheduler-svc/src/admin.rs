//! `ferry.v1.Admin`: the operators' view of a scheduler — every request its cores hold, with
//! status, pending `WorkKey`, blocks, preemptions and the last scheduling decision (and why), and
//! each executor's scheduling gauges. Read-only; each listing asks every step loop once.

use std::sync::Arc;

use ferry_proto::v1::{self, admin_server::Admin};
use ferry_sched_core::{Decision, RequestStatus, RequestView, WorkKey};
use tonic::{Request, Response, Status};

use crate::executors::ExecutorSet;

/// The admin service over the executors this process drives.
#[derive(Clone)]
pub struct AdminService {
    executors: Arc<ExecutorSet>,
}

impl AdminService {
    /// An admin view of `executors`.
    pub fn new(executors: Arc<ExecutorSet>) -> Self {
        Self { executors }
    }
}

fn status(s: RequestStatus) -> String {
    match s {
        RequestStatus::Waiting => "WAITING".into(),
        RequestStatus::Receiving => "RECEIVING".into(),
        RequestStatus::Active => "ACTIVE".into(),
        RequestStatus::Transferring => "TRANSFERRING".into(),
        RequestStatus::Finished(reason) => format!("FINISHED({reason:?})"),
    }
}

fn work_key(k: Option<WorkKey>) -> &'static str {
    match k {
        None => "",
        Some(WorkKey::Prompt) => "PROMPT",
        Some(WorkKey::PromptChunk) => "PROMPT_CHUNK",
        Some(WorkKey::Decode) => "DECODE",
        Some(WorkKey::Verify) => "VERIFY",
    }
}

/// The decision and what it means, for someone asking "why is this request not running?".
fn decision(d: Decision) -> String {
    let why = match d {
        Decision::Queued => "in the waiting queue",
        Decision::ImportQueued => "waiting for a KV fetch slot or blocks to import into",
        Decision::Importing => "its KV is being imported",
        Decision::Admitted => "admitted into a slot",
        Decision::Scheduled => "got work in the last step",
        Decision::NoBudget => "not scheduled: the step's token budget ran out",
        Decision::NoBlocks => "waiting: not enough free KV blocks",
        Decision::NoSlot => "waiting: every admission slot is taken",
        Decision::InFlight => "waiting: a step in flight still references it",
        Decision::FenceWait => "waiting one step: its blocks are fenced by a step in flight",
        Decision::Preempted => "preempted (its KV will be recomputed)",
        Decision::Yielded => "yielded its slot, kept its KV",
        Decision::Reclaimed => "some of its KV was reclaimed while it waited",
        Decision::Exporting => "its KV export is in progress",
        Decision::Finished => "finished",
    };
    format!("{d:?}: {why}")
}

fn to_proto(executor: &str, v: &RequestView) -> v1::AdminRequest {
    v1::AdminRequest {
        executor: executor.to_string(),
        id: v.id.0,
        status: status(v.status),
        work_key: work_key(v.pending_work).into(),
        has_slot: v.has_slot,
        blocks: v.blocks_held as u32,
        computed_tokens: v.num_computed_tokens as u32,
        prompt_tokens: v.num_prompt_tokens as u32,
        output_tokens: v.num_output_tokens as u32,
        preemptions: v.num_preemptions,
        priority: v.priority,
        last_decision: decision(v.last_decision),
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn list_requests(
        &self,
        request: Request<v1::ListRequestsRequest>,
    ) -> Result<Response<v1::ListRequestsResponse>, Status> {
        let only = request.into_inner().executor;
        let mut requests = Vec::new();
        for link in self.executors.alive() {
            if !only.is_empty() && *link.name != *only {
                continue;
            }
            let views = link.request_views().await;
            requests.extend(views.iter().map(|v| to_proto(&link.name, v)));
        }
        Ok(Response::new(v1::ListRequestsResponse { requests }))
    }

    async fn list_executors(
        &self,
        _request: Request<v1::ListExecutorsRequest>,
    ) -> Result<Response<v1::ListExecutorsResponse>, Status> {
        let executors = self
            .executors
            .alive()
            .iter()
            .map(|l| {
                let s = l.stats();
                v1::AdminExecutor {
                    name: l.name.to_string(),
                    running: s.num_running as u32,
                    waiting: s.num_waiting as u32,
                    kv_usage: s.kv_usage,
                    steps: s.steps,
                    steps_in_flight: s.steps_in_flight as u32,
                    prefix_cache_queries: s.prefix_cache_queries,
                    prefix_cache_hits: s.prefix_cache_hits,
                    preemptions: s.num_preemptions,
                }
            })
            .collect();
        Ok(Response::new(v1::ListExecutorsResponse { executors }))
    }
}
