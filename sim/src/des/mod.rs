//! The discrete-event cluster simulator: Ferry's real scheduling core (one per executor) and
//! its real router over N simulated GPUs, in virtual time — no sleeping, no sockets, no
//! threads in the loop.
//!
//! Events are arrivals (one pending at a time: requests are made as they arrive) and step
//! completions, taken from a heap in time order (ties in the order they were posted, so a run
//! is a function of its inputs). An executor with work builds a step with its core's
//! `schedule`, the roofline (`ferry_roofline`) says how long the step takes on the
//! profile's GPU for that very batch (each item's new tokens and cached context), and at
//! the step's end its result (one deterministic token per sampling request) goes through
//! the core's `apply_result`; the tokens' times are the step's end. One step is in flight per
//! executor, as in a synchronous engine.
//!
//! Disaggregation follows the front's policy ([`ferry_sched_core::routing`]): with prefill
//! executors in the cluster, a new request whose prompt is long enough (uncached where it
//! would decode) and whose decode executor has room is computed on the least-loaded prefill
//! executor as a prefill-only request; when its export goes out the continuation (prompt plus
//! the first token, importing the prompt's whole blocks) is added to the decode executor, as
//! the front does. The transfer takes `bytes / (network bandwidth x GPUs of the group)` plus a
//! fixed latency from the step that carries the export; each side reports its end in the
//! first step result after the bytes have arrived.
//!
//! The parts: [`ClusterSpec`] says what to simulate (`cluster`); this module holds the
//! simulation's state and its event loop ([`run`]); `placement` is the router (where a new
//! request goes, and its arrival there), `executor` a simulated executor's steps and what
//! their results tell, `transfers` the KV transfers between executors and from the KV tier
//! (`agent_store` is a node agent's store of blocks), and `report` what a run measured.

mod agent_store;
mod cluster_spec;
mod data_parallel;
mod executor;
mod placement;
mod report;
#[cfg(test)]
pub(crate) mod tests;
mod transfers;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use ferry_roofline::SimBatchItem;
use ferry_sched_core::{
    BlockHash, KvOp, RequestEvent, RequestId, ScheduledWork, Scheduler, StepOutcome, Timestamp,
    TransferId,
};

use crate::stats::Histogram;
use crate::workload::{SimRequest, Source};

use agent_store::AgentStore;
use transfers::Transfer;

pub use cluster_spec::{ClusterSpec, ControlPlane, KvTier, LoopedSim, ModelPool, Router, Slo};
pub use data_parallel::DataParallel;
pub use report::{Detail, Latency, ModelReport, Report, Timeline};

/// Progress, for a progress bar.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Virtual seconds so far.
    pub now: f64,
    /// Requests arrived so far.
    pub arrived: u64,
    /// Requests finished (or refused) so far.
    pub done: u64,
}

/// A request in flight.
struct Track {
    arrival: f64,
    first: f64,
    last: f64,
    prompt: u32,
    /// Its prefill executor's part, if it is disaggregated and not yet handed on.
    handoff: Option<Handoff>,
    /// The request, if it is a turn of a conversation with turns after it (its end sends the
    /// next turn).
    turn: Option<Box<SimRequest>>,
    /// The conversation it belongs to, if any: its sampled tokens are the conversation's.
    conversation: Option<u32>,
    /// The model it asked for (its place in [`Sim::pools`]).
    model: usize,
}

/// What a run counted of one model's requests.
#[derive(Default)]
struct ModelCounts {
    /// Requests that asked for it.
    requests: u64,
    /// Requests its executors finished.
    finished: u64,
    /// Output tokens its executors generated for finished requests.
    output_tokens: u64,
    ttft: Histogram,
}

/// A disaggregated request's decode half, chosen when it arrived.
struct Handoff {
    decode: usize,
    /// The first token, once the prefill executor sampled it (the continuation's prior output).
    first_token: Option<u32>,
    transfer: TransferId,
    import_tokens: usize,
    prompt: std::sync::Arc<[u32]>,
    output_len: usize,
}

struct Exec {
    core: Scheduler,
    busy: bool,
    /// The result of the step in flight, built with it.
    outcome: StepOutcome,
    step_secs: f64,
    live: usize,
    kv_usage: f64,
    /// Transfers whose export or import this executor carries out, not yet reported.
    transfers: Vec<TransferId>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival,
    /// A conversation's next turn (the key of [`Sim::turns`]).
    NextTurn(u64),
    StepDone(usize),
    /// The shard's scheduler has streamed executor `e`'s step result (with a control-plane
    /// cost): its tokens reach their clients and the executor steps again.
    Streamed(usize),
    /// A transfer's bytes have arrived.
    TransferDone(u64),
}

/// The virtual time of `secs` (nanoseconds; the heap's and the cores' unit).
fn ns(secs: f64) -> u64 {
    Timestamp::from_secs_f64(secs).0
}

struct Sim<'a> {
    spec: &'a ClusterSpec,
    /// Every model's pool, the first model's first; the executors are theirs in that order.
    pools: Vec<ModelPool>,
    /// Each executor's model (its place in `pools`).
    model_of: Vec<usize>,
    /// Each pool's executors.
    pool_executors: Vec<std::ops::Range<usize>>,
    by_model: Vec<ModelCounts>,
    execs: Vec<Exec>,
    heap: BinaryHeap<Reverse<(u64, u64, Event)>>,
    posted: u64,
    now: u64,
    tracks: HashMap<u64, Track>,
    items: Vec<SimBatchItem>,
    work: Vec<ScheduledWork>,
    events: Vec<RequestEvent>,
    hashes: Vec<BlockHash>,
    next_rr: usize,
    ttft: Histogram,
    tpot: Histogram,
    itl: Histogram,
    e2e: Histogram,
    arrived: u64,
    finished: u64,
    rejected: u64,
    met_slo: u64,
    prompt_tokens: u64,
    output_tokens: u64,
    first_arrival: Option<u64>,
    last_finish: u64,
    busy_secs: f64,
    kv_weighted: f64,
    kv_max: f64,
    transfers: HashMap<u64, Transfer>,
    next_transfer: u64,
    next_continuation: u64,
    kv_ops: Vec<KvOp>,
    disaggregated: u64,
    transfer_bytes: u64,
    transfer_secs: f64,
    transfers_done: u64,
    timeline: Timeline,
    /// Conversations' next turns, by key, until they arrive.
    turns: HashMap<u64, SimRequest>,
    next_turn: u64,
    /// Each node's agent store (one per executor), with the KV tier.
    agents: Vec<AgentStore>,
    tier_reads: u64,
    tier_read_tokens: u64,
    tier_read_failures: u64,
    tier_writes: u64,
    /// Each executor's shard.
    shard_of: Vec<usize>,
    /// When each shard's scheduler CPU is next free (ns), and how long it was busy (s).
    cpu_free: Vec<u64>,
    cpu_busy: Vec<f64>,
    /// Data-parallel groups' rounds (none without `spec.data_parallel`), and rounds run.
    groups: Vec<data_parallel::Group>,
    dp_rounds: u64,
}

/// Ids of conversations' later turns start here (above the workload's, below continuations').
const TURN_IDS: u64 = 1 << 40;

/// Ids of continuations (a disaggregated request's decode half) start here, far above the
/// workload's.
const CONTINUATION_IDS: u64 = 1 << 48;

/// Each executor's shard: Ferry's assignment of executors `exec-<i>` over pools `shard-<j>`.
fn shard_of(spec: &ClusterSpec) -> Vec<usize> {
    let names: Vec<String> = (0..spec.executors).map(|i| format!("exec-{i}")).collect();
    let pools: Vec<String> = (0..spec.shards).map(|j| format!("shard-{j}")).collect();
    let executors: Vec<(&str, Option<&str>)> = names.iter().map(|n| (n.as_str(), None)).collect();
    let pools: Vec<&str> = pools.iter().map(String::as_str).collect();
    ferry_sched_core::shards::assign(&executors, &pools)
        .into_iter()
        .map(|s| s.unwrap_or(0))
        .collect()
}

/// Runs `spec` over the requests of `source`; `progress` is called now and then.
pub fn run(
    spec: &ClusterSpec,
    source: &mut Source,
    mut progress: impl FnMut(Progress),
) -> Result<Report, String> {
    if spec.executors == 0 {
        return Err("a cluster needs at least one executor".into());
    }
    if spec.shards == 0 || spec.shards > spec.executors {
        return Err(format!("{} shards of {} executors", spec.shards, spec.executors));
    }
    if spec.shards > 1 && spec.prefill_executors > 0 {
        return Err("shards with prefill executors are not simulated".into());
    }
    spec.check_models()?;
    if spec.prefill_executors >= spec.executors {
        return Err(format!(
            "{} prefill executors of {}: at least one must decode",
            spec.prefill_executors, spec.executors
        ));
    }
    let started = std::time::Instant::now();
    let mut sim = Sim::new(spec)?;
    let mut pending = source.next_request()?;
    if let Some(r) = &pending {
        sim.post(ns(r.arrival), Event::Arrival);
    }
    let mut handled = 0u64;
    while let Some(Reverse((at, _, event))) = sim.heap.pop() {
        if at < sim.now {
            return Err(format!("virtual time went back from {} to {at} ns", sim.now));
        }
        sim.now = at;
        match event {
            Event::Arrival => {
                let request = pending.take().expect("an arrival is posted with its request");
                sim.arrive(&request)?;
                pending = source.next_request()?;
                if let Some(r) = &pending {
                    sim.post(ns(r.arrival).max(sim.now), Event::Arrival);
                }
            }
            Event::StepDone(e) => sim.step_done(e)?,
            Event::Streamed(e) => sim.streamed(e)?,
            Event::TransferDone(tid) => sim.transfer_done(tid)?,
            Event::NextTurn(key) => {
                let request = sim.turns.remove(&key).expect("a turn is posted with its request");
                sim.arrive(&request)?;
            }
        }
        handled += 1;
        if handled.is_multiple_of(65_536) {
            let now = sim.now as f64 / 1e9;
            progress(Progress { now, arrived: sim.arrived, done: sim.finished + sim.rejected });
        }
    }
    if !sim.tracks.is_empty() {
        return Err(sim.stuck());
    }
    Ok(sim.report(started.elapsed().as_secs_f64()))
}

impl<'a> Sim<'a> {
    /// A cluster of `spec` before anything arrives.
    fn new(spec: &'a ClusterSpec) -> Result<Self, String> {
        let pools = spec.pools();
        let model_of: Vec<usize> = pools
            .iter()
            .enumerate()
            .flat_map(|(m, p)| std::iter::repeat_n(m, p.executors))
            .collect();
        let execs = model_of
            .iter()
            .map(|&m| {
                Ok(Exec {
                    core: Scheduler::new(pools[m].scheduler.clone()).map_err(|e| e.to_string())?,
                    busy: false,
                    outcome: StepOutcome::default(),
                    step_secs: 0.0,
                    live: 0,
                    kv_usage: 0.0,
                    transfers: Vec::new(),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        let agents = (0..execs.len()).map(|_| AgentStore::default()).collect();
        let pool_executors = pools
            .iter()
            .scan(0, |start, p| {
                let range = *start..*start + p.executors;
                *start = range.end;
                Some(range)
            })
            .collect();
        Ok(Sim {
            spec,
            by_model: pools.iter().map(|_| ModelCounts::default()).collect(),
            pools,
            model_of,
            pool_executors,
            execs,
            heap: BinaryHeap::new(),
            posted: 0,
            now: 0,
            tracks: HashMap::new(),
            items: Vec::new(),
            work: Vec::new(),
            events: Vec::new(),
            hashes: Vec::new(),
            next_rr: 0,
            ttft: Histogram::default(),
            tpot: Histogram::default(),
            itl: Histogram::default(),
            e2e: Histogram::default(),
            arrived: 0,
            finished: 0,
            rejected: 0,
            met_slo: 0,
            prompt_tokens: 0,
            output_tokens: 0,
            first_arrival: None,
            last_finish: 0,
            busy_secs: 0.0,
            kv_weighted: 0.0,
            kv_max: 0.0,
            transfers: HashMap::new(),
            next_transfer: 0,
            next_continuation: CONTINUATION_IDS,
            kv_ops: Vec::new(),
            disaggregated: 0,
            transfer_bytes: 0,
            transfer_secs: 0.0,
            transfers_done: 0,
            timeline: Timeline::default(),
            turns: HashMap::new(),
            next_turn: TURN_IDS,
            agents,
            tier_reads: 0,
            tier_read_tokens: 0,
            tier_read_failures: 0,
            tier_writes: 0,
            shard_of: shard_of(spec),
            cpu_free: vec![0; spec.shards],
            cpu_busy: vec![0.0; spec.shards],
            groups: spec.data_parallel.map_or_else(Vec::new, |dp| {
                (0..spec.executors.div_ceil(dp.size)).map(|_| dp.group()).collect()
            }),
            dp_rounds: 0,
        })
    }

    /// Why a run that went idle with requests left is wrong: the first of them, where it is.
    fn stuck(&self) -> String {
        let first = self.tracks.keys().min().copied().unwrap_or_default();
        let id = RequestId(first);
        let held = self.execs.iter().enumerate().find_map(|(e, x)| {
            let busy = x.busy;
            let transfers = &x.transfers;
            x.core
                .request_view(id)
                .map(|v| format!("on executor {e} (busy {busy}, transfers {transfers:?}): {v:?}"))
        });
        format!(
            "{} requests never finished: the cluster went idle with work left; request {first} {}",
            self.tracks.len(),
            held.unwrap_or_else(|| "is on no executor".into())
        )
    }

    /// Charges `secs` of CPU to the scheduler of executor `e`'s shard, after what it has to do
    /// already; when it will be done (ns).
    fn charge(&mut self, e: usize, secs: f64) -> u64 {
        let s = self.shard_of[e];
        let done = self.cpu_free[s].max(self.now) + ns(secs);
        self.cpu_free[s] = done;
        self.cpu_busy[s] += secs;
        done
    }

    fn post(&mut self, at: u64, event: Event) {
        self.posted += 1;
        self.heap.push(Reverse((at, self.posted, event)));
    }

    fn secs(&self) -> f64 {
        self.now as f64 / 1e9
    }

    /// Executor `e`'s model's pool.
    fn pool_of(&self, e: usize) -> &ModelPool {
        &self.pools[self.model_of[e]]
    }

    /// The model a request of `key` (its conversation, or its index) asks for: each model by its
    /// share, the same for every turn of a conversation.
    fn model_for(&self, key: u64) -> usize {
        if self.pools.len() == 1 {
            return 0;
        }
        let u = (crate::workload::mix(key ^ 0x6d6f_6465_6c73) >> 11) as f64 / (1u64 << 53) as f64;
        let mut below = 0.0;
        for (m, p) in self.pools.iter().enumerate().skip(1) {
            below += p.share;
            if u < below {
                return m;
            }
        }
        0
    }
}
