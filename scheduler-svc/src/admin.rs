//! `ferry.v1.Admin`: the operators' view of a scheduler — every request its cores hold, with
//! status, pending `WorkKey`, blocks, preemptions and the last scheduling decision (and why), and
//! each executor's scheduling gauges, and the KV transfers between executors (both sides of
//! each, joined). Read-only; each listing asks every step loop once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use ferry_proto::v1::{self, admin_server::Admin};
use ferry_sched_core::{Decision, RequestStatus, RequestView, WorkKey};
use tonic::{Request, Response, Status};

use crate::executors::ExecutorSet;
use crate::link::transfers::{Phase, TransferSide};
use crate::standby::Standing;

/// The admin service over the executors this process drives.
#[derive(Clone)]
pub struct AdminService {
    executors: Arc<ExecutorSet>,
    /// With etcd: a standby says so (and where the leader is) rather than list nothing.
    standing: Option<Arc<Standing>>,
}

impl AdminService {
    /// An admin view of `executors`, driven while `standing` (if any) says this leads.
    pub fn new(executors: Arc<ExecutorSet>, standing: Option<Arc<Standing>>) -> Self {
        Self { executors, standing }
    }

    /// Refuses a call on a standby, naming the leader.
    fn leading(&self) -> Result<(), Status> {
        match self.standing.as_ref().and_then(|s| s.standby_notice()) {
            Some(notice) => Err(Status::unavailable(notice)),
            None => Ok(()),
        }
    }
}

/// `ferry.v1.Admin` on a front in its own process, which drives no executor: every call is
/// refused naming where the Admin API is served (each pool's leader).
#[derive(Clone)]
pub struct FrontAdmin {
    shards: Arc<crate::front::shards::Shards>,
}

impl FrontAdmin {
    /// The refusals of a front following `shards`.
    pub fn new(shards: Arc<crate::front::shards::Shards>) -> Self {
        Self { shards }
    }

    fn refusal(&self) -> Status {
        let leaders: Vec<String> = self
            .shards
            .leaders()
            .into_iter()
            .map(|(pool, leader)| match leader {
                Some(at) => format!("pool {pool:?} at {at}"),
                None => format!("pool {pool:?} (no leader elected now)"),
            })
            .collect();
        let where_ = if leaders.is_empty() {
            "no scheduler pool is up now".to_string()
        } else {
            leaders.join(", ")
        };
        Status::unimplemented(format!(
            "this is a front, which drives no executor: ferry.v1.Admin is served by each \
             scheduler pool's leader ({where_})"
        ))
    }
}

#[tonic::async_trait]
impl Admin for FrontAdmin {
    async fn list_requests(
        &self,
        _request: Request<v1::ListRequestsRequest>,
    ) -> Result<Response<v1::ListRequestsResponse>, Status> {
        Err(self.refusal())
    }

    async fn list_executors(
        &self,
        _request: Request<v1::ListExecutorsRequest>,
    ) -> Result<Response<v1::ListExecutorsResponse>, Status> {
        Err(self.refusal())
    }

    async fn list_transfers(
        &self,
        _request: Request<v1::ListTransfersRequest>,
    ) -> Result<Response<v1::ListTransfersResponse>, Status> {
        Err(self.refusal())
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
        Some(WorkKey::PromptPrelude) => "PROMPT_PRELUDE",
        Some(WorkKey::PromptRecurrent) => "PROMPT_RECURRENT",
        Some(WorkKey::PromptCoda) => "PROMPT_CODA",
        Some(WorkKey::DecodePrelude) => "DECODE_PRELUDE",
        Some(WorkKey::DecodeRecurrent) => "DECODE_RECURRENT",
        Some(WorkKey::DecodeCoda) => "DECODE_CODA",
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
        Decision::ForkWait => {
            "waiting: a sample of several, for its first sample's prompt KV to fork from"
        }
        Decision::LoraWait => {
            "waiting: its LoRA adapter is not loaded and the executor holds --max-loras others"
        }
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

fn phase(p: &Phase) -> String {
    match p {
        Phase::Planned => "PLANNED".into(),
        Phase::InProgress => "IN_PROGRESS".into(),
        Phase::Done => "DONE".into(),
        Phase::Failed(reason) => format!("FAILED({reason})"),
        Phase::Abandoned => "ABANDONED".into(),
    }
}

/// Transfers from their sides (each executor's), joined by transfer id; newest first.
fn transfers(sides: Vec<(Arc<str>, TransferSide)>) -> Vec<v1::AdminTransfer> {
    let mut by_id: HashMap<u64, Vec<(Arc<str>, TransferSide)>> = HashMap::new();
    for (executor, side) in sides {
        by_id.entry(side.transfer_id).or_default().push((executor, side));
    }
    let mut out: Vec<(Instant, v1::AdminTransfer)> = by_id
        .into_iter()
        .map(|(tid, sides)| {
            let since = sides.iter().map(|(_, s)| s.since).min().expect("one side at least");
            let ended: Option<Vec<Instant>> = sides.iter().map(|(_, s)| s.ended).collect();
            let issued = sides.iter().filter_map(|(_, s)| s.issued).min();
            let phases: Vec<&Phase> = sides.iter().map(|(_, s)| &s.phase).collect();
            let state = if ended.is_none() {
                "IN_PROGRESS"
            } else if phases.iter().any(|p| matches!(p, Phase::Failed(_))) {
                "FAILED"
            } else if phases.iter().any(|p| **p == Phase::Abandoned) {
                "ABANDONED"
            } else {
                "DONE"
            };
            let mut t = v1::AdminTransfer {
                transfer_id: tid.to_string(),
                state: state.into(),
                age_seconds: since.elapsed().as_secs_f64(),
                seconds: ended.and_then(|e| e.into_iter().max()).map_or(0.0, |end| {
                    end.saturating_duration_since(issued.unwrap_or(since)).as_secs_f64()
                }),
                ..Default::default()
            };
            let mut errors = Vec::new();
            for (executor, s) in &sides {
                t.request_id = s.request.to_string();
                t.blocks = t.blocks.max(s.blocks);
                t.bytes = t.bytes.max(s.bytes);
                if s.export {
                    t.source = executor.to_string();
                    t.source_state = phase(&s.phase);
                    t.destination_agent.clone_from(&s.destination_agent);
                } else {
                    t.destination = executor.to_string();
                    t.destination_state = phase(&s.phase);
                }
                if !s.error.is_empty() {
                    let side = if s.export { "export" } else { "import" };
                    errors.push(format!("{side}: {}", s.error));
                }
            }
            t.error = errors.join("; ");
            (since, t)
        })
        .collect();
    out.sort_by_key(|(since, _)| std::cmp::Reverse(*since));
    out.into_iter().map(|(_, t)| t).collect()
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn list_requests(
        &self,
        request: Request<v1::ListRequestsRequest>,
    ) -> Result<Response<v1::ListRequestsResponse>, Status> {
        self.leading()?;
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

    async fn list_transfers(
        &self,
        _request: Request<v1::ListTransfersRequest>,
    ) -> Result<Response<v1::ListTransfersResponse>, Status> {
        self.leading()?;
        let mut sides = Vec::new();
        for link in self.executors.alive() {
            sides.extend(link.transfers().await.into_iter().map(|t| (link.name.clone(), t)));
        }
        Ok(Response::new(v1::ListTransfersResponse { transfers: transfers(sides) }))
    }

    async fn list_executors(
        &self,
        _request: Request<v1::ListExecutorsRequest>,
    ) -> Result<Response<v1::ListExecutorsResponse>, Status> {
        self.leading()?;
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
                    role: match l.info.role() {
                        v1::ExecutorRole::Unspecified => v1::ExecutorRole::Both,
                        role => role,
                    }
                    .into(),
                    data_parallel: l.info.data_parallel.clone(),
                    prefills_deferred: s.prefills_deferred,
                }
            })
            .collect();
        Ok(Response::new(v1::ListExecutorsResponse { executors }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(tid: u64, export: bool, phase: Phase, ended: bool) -> TransferSide {
        let now = Instant::now();
        TransferSide {
            transfer_id: tid,
            request: "req-1".into(),
            export,
            destination_agent: if export { "10.0.0.2:7000".into() } else { String::new() },
            blocks: 4,
            bytes: 4096,
            error: match &phase {
                Phase::Failed(r) => format!("{r} happened"),
                _ => String::new(),
            },
            phase,
            since: now,
            issued: Some(now),
            ended: ended.then_some(now),
        }
    }

    #[test]
    fn a_transfer_joins_its_two_sides_and_is_over_only_when_both_are() {
        let (p, d): (Arc<str>, Arc<str>) = ("p".into(), "d".into());
        let got = transfers(vec![
            // 1: exported, import still running.
            (p.clone(), side(1, true, Phase::Done, true)),
            (d.clone(), side(1, false, Phase::InProgress, false)),
            // 2: the export failed, the import was then cancelled.
            (p.clone(), side(2, true, Phase::Failed("deadline".into()), true)),
            (d.clone(), side(2, false, Phase::Failed("cancelled".into()), true)),
            // 3: both done.
            (p, side(3, true, Phase::Done, true)),
            (d, side(3, false, Phase::Done, true)),
        ]);
        let by_id = |id: &str| got.iter().find(|t| t.transfer_id == id).unwrap();
        let t1 = by_id("1");
        assert_eq!(
            (t1.state.as_str(), t1.destination_state.as_str()),
            ("IN_PROGRESS", "IN_PROGRESS")
        );
        assert_eq!((t1.source.as_str(), t1.destination.as_str()), ("p", "d"));
        assert_eq!(t1.destination_agent, "10.0.0.2:7000");
        let t2 = by_id("2");
        assert_eq!(t2.state, "FAILED");
        assert_eq!(t2.source_state, "FAILED(deadline)");
        assert_eq!(t2.error, "export: deadline happened; import: cancelled happened");
        assert_eq!(by_id("3").state, "DONE");
        assert_eq!(got.len(), 3);
    }
}
