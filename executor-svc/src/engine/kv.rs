//! KV operations: the executor's side of a KV transfer (DESIGN.md §6). An `Export` copies a
//! request's full blocks out of the KV pool and puts them to the node's KV agent, which pushes
//! them on to the destination node's agent; an `Import` reads blocks from the node's agent (as
//! they arrive) and writes them into the pool. Both run beside the steps, on the async runtime,
//! and each is reported done or failed, with the reason, in a later `StepResult`.
//!
//! With the local agent, blocks go through the executor's shared-memory staging region
//! (`ferry_kv_transfer_svc::shm`, `--kv-staging-mib`): an export's transfer starts first and
//! the agent sends each block on as soon as the step has copied it into its slot; an import's
//! blocks are written into the pool at the first step after each lands — copied from the
//! agent's store itself when the agent holds the block in shared memory (mapped read-only
//! here), else from the slot the agent copied it into. Without room in the region (or without a region the agent can map), the blocks
//! cross the agent's socket instead, whole.
//!
//! Invariants:
//! - an export's bytes are copied out of the pool in the step that starts it, so the blocks may
//!   change or be freed afterwards without touching the transfer (the scheduler still keeps
//!   them until the export is reported, for a retry or a recompute);
//! - an import is reported done only at the start of a step after every block of it arrived,
//!   checked, and was written into the pool — so no step reads its blocks before they hold the
//!   imported KV. A staged import writes its blocks as they land; if it then fails, the
//!   scheduler frees those blocks without naming their content, so nothing reads them;
//! - a staging slot is reused only after the agent answered or closed the transfer's
//!   connection, even when the executor stopped waiting (a deadline, a session reset);
//! - a block read from the agent's store stays there unchanged while the import that reads it
//!   is in progress: the import's connection stays open until it is reported or reset;
//! - an import's blocks are held by no live request and no other import while it runs;
//! - a session reset ends every transfer in progress; their late completions are ignored.

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::time::Instant;

use bytes::Bytes;
use ferry_kv_transfer_svc::data::{self, Op};
use ferry_kv_transfer_svc::frames::{self, Header};
use ferry_kv_transfer_svc::layout::BlockLayout;
use ferry_kv_transfer_svc::shm::{self, Place, PoolMemory, Slots, Staging};
use ferry_proto::v1::{self, kv_operation::Op as KvOp};
use ferry_runtime::telemetry;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::backend::ModelBackend;

/// Where an executor's KV operations go: its node's KV agent, and the async runtime that runs
/// them.
#[derive(Clone, Debug)]
pub struct KvPort {
    /// The local agent (`host:port`).
    pub agent: String,
    /// The runtime the transfers run on.
    pub runtime: tokio::runtime::Handle,
    /// This executor's KV layout (the blocks it sends and accepts).
    pub layout: v1::KvLayout,
    /// Shared memory with the agent, if any (see [`staging`]).
    pub staging: Option<Arc<Staging>>,
}

/// The staging region `config` asks for, with slots of `layout`'s blocks, and before them a
/// KV pool of `pool_blocks` blocks (0: none) with its memory; `None` (and a warning) when it
/// cannot be made: transfers then take the agent's socket. A region without room for the
/// pool is made without it (the pool then stays in the executor's own memory).
pub fn staging(
    config: &crate::config::ExecutorConfig,
    layout: &v1::KvLayout,
    pool_blocks: u32,
) -> Option<(Arc<Staging>, Option<PoolMemory>)> {
    config.kv_agent.as_ref()?;
    let block_bytes = BlockLayout::from_proto(Some(layout)).ok()?.block_bytes;
    let slots = (config.kv_staging_mib << 20) / block_bytes as u64;
    if slots == 0 {
        return None;
    }
    let slots = u32::try_from(slots).unwrap_or(u32::MAX);
    let dir = &config.kv_shm_dir;
    if pool_blocks > 0 {
        match Staging::create_with_pool(dir, block_bytes, pool_blocks, slots) {
            Ok((s, pool)) => return Some((s, Some(pool))),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "the KV pool stays in private memory: exports copy their blocks into staging slots first");
            }
        }
    }
    match Staging::create(dir, block_bytes, slots) {
        Ok(s) => Some((s, None)),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "no KV staging region: KV transfers go through the agent's socket");
            None
        }
    }
}

/// A KV operation the engine refuses (the step is refused with it).
#[derive(Debug, thiserror::Error)]
pub enum KvOpError {
    /// The executor has no KV agent.
    #[error("this executor has no KV agent (start it with --kv-agent): {0} KV operations refused")]
    NoAgent(usize),
    /// A bad operation.
    #[error("KV operation {transfer_id}: {reason}")]
    Invalid {
        /// The transfer.
        transfer_id: String,
        /// What is wrong.
        reason: String,
    },
}

/// The request an operation moves blocks of (an export's or an import's; a KV-tier write
/// belongs to none).
pub(super) fn request_of_op(op: &v1::KvOperation) -> Option<u64> {
    match &op.op {
        Some(KvOp::Export(e)) => Some(e.request_id),
        Some(KvOp::Import(i)) => Some(i.request_id),
        Some(KvOp::Store(_)) | None => None,
    }
}

/// The request whose export or import `error` refuses, if it names one of `ops`.
pub(super) fn request_of(error: &KvOpError, ops: &[v1::KvOperation]) -> Option<u64> {
    let KvOpError::Invalid { transfer_id, .. } = error else { return None };
    request_of_op(ops.iter().find(|op| &op.transfer_id == transfer_id)?)
}

/// A finished transfer, from its task.
enum Done {
    Export {
        transfer_id: String,
        result: Result<u64, Failed>,
    },
    /// The blocks, read through the socket; `None` when staged (they are in its slots).
    Import {
        transfer_id: String,
        result: Result<Option<Vec<Bytes>>, Failed>,
    },
}

/// Why a transfer failed: the reason metrics count, and what happened.
#[derive(Debug)]
struct Failed {
    kind: v1::KvFailure,
    message: String,
}

impl Failed {
    fn new(kind: v1::KvFailure, message: String) -> Self {
        Self { kind, message }
    }

    /// An agent's answer, classified by its code (`what` says which step failed).
    fn of_status(what: &str, s: &tonic::Status) -> Self {
        use tonic::Code;
        let kind = match s.code() {
            Code::DeadlineExceeded => v1::KvFailure::Deadline,
            Code::Cancelled => v1::KvFailure::Cancelled,
            Code::DataLoss => v1::KvFailure::Checksum,
            Code::FailedPrecondition => v1::KvFailure::Layout,
            Code::NotFound => v1::KvFailure::NotFound,
            Code::ResourceExhausted => v1::KvFailure::StoreFull,
            Code::Unavailable | Code::Unknown | Code::Internal | Code::Aborted => {
                v1::KvFailure::AgentUnavailable
            }
            _ => v1::KvFailure::Malformed,
        };
        Self::new(kind, format!("{what}: {}", s.message()))
    }
}

/// A transfer in progress.
struct InProgress {
    /// Blocks it writes (an import), empty for an export.
    blocks: Vec<u32>,
    started: Instant,
    task: tokio::task::JoinHandle<()>,
    /// A staged import's slots and progress.
    staged: Option<Landing>,
}

/// A staged import's blocks as they land (in their slots, or in the agent's store).
struct Landing {
    slots: Arc<Slots>,
    landed: tokio::sync::watch::Receiver<Vec<Place>>,
    /// Blocks written into the pool so far.
    written: usize,
    /// Dropped with the import: lets the agent reuse the stored blocks this one read.
    _release: tokio::sync::oneshot::Sender<()>,
}

impl Landing {
    /// Writes the blocks that landed since the last call into `blocks` of `backend`; stops at
    /// a block that cannot be written (the final call meets it again and fails the import).
    fn write_landed(
        &mut self,
        blocks: &[u32],
        backend: &mut dyn ModelBackend,
    ) -> Result<(), Failed> {
        // Out of the watch first: its lock is not held while blocks are copied.
        let new: Vec<Place> = {
            let landed = self.landed.borrow();
            let end = landed.len().min(blocks.len());
            landed.get(self.written..end).map(<[Place]>::to_vec).unwrap_or_default()
        };
        for place in new {
            let i = self.written;
            let data = place
                .bytes(&self.slots, i)
                .map_err(|e| Failed::new(v1::KvFailure::Executor, e.to_string()))?;
            write_block(backend, blocks[i], data)?;
            self.written += 1;
        }
        Ok(())
    }

    /// Writes the rest (every block has landed); the bytes imported.
    fn write_all(&mut self, blocks: &[u32], backend: &mut dyn ModelBackend) -> Result<u64, Failed> {
        self.write_landed(blocks, backend)?;
        if self.written != blocks.len() {
            let why = format!("import: {} of {} blocks landed", self.written, blocks.len());
            return Err(Failed::new(v1::KvFailure::Malformed, why));
        }
        Ok((blocks.len() * self.slots.staging().block_bytes()) as u64)
    }
}

/// Writes block `b` of `backend`.
fn write_block(backend: &mut dyn ModelBackend, b: u32, data: &[u8]) -> Result<(), Failed> {
    backend.write_block(b as usize, data).map_err(|e| Failed::new(v1::KvFailure::Executor, e))
}

/// Writes `data` (block by block) into `blocks` of `backend`; the bytes written.
fn write_all(
    backend: &mut dyn ModelBackend,
    blocks: &[u32],
    data: &[Bytes],
) -> Result<u64, Failed> {
    let mut bytes = 0u64;
    for (&b, d) in blocks.iter().zip(data) {
        write_block(backend, b, d)?;
        bytes += d.len() as u64;
    }
    Ok(bytes)
}

/// The engine's KV operations in progress.
pub struct KvOps {
    port: Option<KvPort>,
    /// The staging region, once the agent said it maps it.
    staging_ok: Arc<AtomicBool>,
    block_layout: Option<BlockLayout>,
    running: HashMap<String, InProgress>,
    /// Transfers started through shared memory and through the agent's socket.
    paths: KvPaths,
    done_tx: std_mpsc::Sender<Done>,
    done_rx: std_mpsc::Receiver<Done>,
}

impl std::fmt::Debug for KvOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvOps")
            .field("port", &self.port)
            .field("running", &self.running.len())
            .finish_non_exhaustive()
    }
}

/// Transfers started, by the path their blocks took between executor and agent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvPaths {
    /// Through the staging region.
    pub shared_memory: u64,
    /// Through the agent's socket.
    pub socket: u64,
    /// Exports sent from the KV pool where the blocks are (a pool in the shared region).
    pub pool: u64,
}

impl KvPaths {
    fn count(&mut self, staged: bool) {
        if staged {
            self.shared_memory += 1;
        } else {
            self.socket += 1;
        }
    }
}

/// What a KV operation needs to know of the requests.
pub trait RequestTables {
    /// The block table of live request `id` (after the step's diff), if it is live.
    fn table(&self, id: u64) -> Option<&[u32]>;
    /// Whether a live request's table holds `block`.
    fn holds(&self, block: u32) -> bool;
}

impl KvOps {
    /// KV operations through `port` (none accepted without one).
    pub fn new(port: Option<KvPort>) -> Self {
        let (done_tx, done_rx) = std_mpsc::channel();
        let block_layout =
            port.as_ref().and_then(|p| BlockLayout::from_proto(Some(&p.layout)).ok());
        let staging_ok = Arc::new(AtomicBool::new(false));
        if let Some(p) = &port {
            if let Some(staging) = &p.staging {
                let (ok, agent, name) =
                    (staging_ok.clone(), p.agent.clone(), staging.name().to_string());
                p.runtime.spawn(probe_until_answered(agent, name, ok));
            }
        }
        let running = HashMap::new();
        let paths = KvPaths::default();
        Self { port, staging_ok, block_layout, running, paths, done_tx, done_rx }
    }

    /// Transfers in progress.
    pub fn in_progress(&self) -> usize {
        self.running.len()
    }

    /// Transfers started so far, by path.
    pub fn paths(&self) -> KvPaths {
        self.paths
    }

    /// Checks a step's KV operations against `tables` (the requests after the step's diff) and
    /// the transfers in progress; changes nothing.
    pub fn validate(
        &self,
        ops: &[v1::KvOperation],
        num_blocks: usize,
        tables: &dyn RequestTables,
    ) -> Result<(), KvOpError> {
        if ops.is_empty() {
            return Ok(());
        }
        if self.port.is_none() {
            return Err(KvOpError::NoAgent(ops.len()));
        }
        let mut ids = std::collections::HashSet::new();
        let mut importing: std::collections::HashSet<u32> =
            self.running.values().flat_map(|t| t.blocks.iter().copied()).collect();
        for op in ops {
            let tid = &op.transfer_id;
            let bad = |reason: String| KvOpError::Invalid { transfer_id: tid.clone(), reason };
            if tid.is_empty() || tid.len() > frames::MAX_TRANSFER_ID {
                return Err(bad(format!(
                    "transfer_id must be 1 to {} bytes",
                    frames::MAX_TRANSFER_ID
                )));
            }
            if op.deadline_unix_ms == 0 {
                return Err(bad(
                    "no deadline: every KV operation needs deadline_unix_ms (Unix ms)".into(),
                ));
            }
            if self.running.contains_key(tid) || !ids.insert(tid.clone()) {
                return Err(bad("the transfer is already in progress".into()));
            }
            let in_range = |blocks: &[u32]| match blocks.iter().find(|b| **b as usize >= num_blocks)
            {
                Some(b) => {
                    Err(bad(format!("block {b} is out of range (pool has {num_blocks} blocks)")))
                }
                None => Ok(()),
            };
            // Imports and stores name each block they move, every one full.
            let full_blocks = |ids: &[u32], hashes: &[u64], what: &str| {
                in_range(ids)?;
                if ids.is_empty() || hashes.len() != ids.len() {
                    return Err(bad(format!(
                        "{} block hashes for {} blocks: {what} full blocks, each named",
                        hashes.len(),
                        ids.len()
                    )));
                }
                Ok(())
            };
            match &op.op {
                Some(KvOp::Export(e)) => {
                    let table = tables
                        .table(e.request_id)
                        .ok_or_else(|| bad(format!("request {} is not live", e.request_id)))?;
                    in_range(&e.block_ids)?;
                    if e.block_hashes.is_empty() || e.block_hashes.len() > e.block_ids.len() {
                        return Err(bad(format!(
                            "{} block hashes for {} blocks: an export names each full block it sends",
                            e.block_hashes.len(),
                            e.block_ids.len()
                        )));
                    }
                    if let Some(b) =
                        e.block_ids[..e.block_hashes.len()].iter().find(|b| !table.contains(b))
                    {
                        return Err(bad(format!("block {b} is not request {}'s", e.request_id)));
                    }
                    if e.destination_agent.is_empty() {
                        return Err(bad("an export needs a destination agent".into()));
                    }
                }
                Some(KvOp::Import(i)) => {
                    full_blocks(&i.block_ids, &i.block_hashes, "an import fills")?;
                    for b in &i.block_ids {
                        if tables.holds(*b) || !importing.insert(*b) {
                            return Err(bad(format!(
                                "block {b} is in use: an import writes only free blocks"
                            )));
                        }
                    }
                }
                Some(KvOp::Store(st)) => {
                    full_blocks(&st.block_ids, &st.block_hashes, "a store writes")?;
                    if let Some(b) = st.block_ids.iter().find(|b| importing.contains(b)) {
                        return Err(bad(format!(
                            "block {b} is being imported: a store copies only settled blocks"
                        )));
                    }
                }
                None => return Err(bad("no operation".into())),
            }
        }
        Ok(())
    }

    /// Starts a validated step's operations: copies exports' and stores' blocks out of
    /// `backend` now (before the step's forward, which may reuse them) and hands the rest to
    /// the runtime.
    pub fn start(&mut self, ops: &[v1::KvOperation], backend: &mut dyn ModelBackend) {
        if ops.is_empty() {
            return; // most steps: no clone of the port and layout
        }
        let (Some(port), Some(layout)) = (self.port.clone(), self.block_layout.clone()) else {
            return;
        };
        for op in ops {
            let started = Instant::now();
            let outgoing = match &op.op {
                Some(KvOp::Export(e)) => {
                    Some((&e.block_ids, &e.block_hashes, Some(e.destination_agent.clone())))
                }
                Some(KvOp::Store(st)) => Some((&st.block_ids, &st.block_hashes, None)),
                Some(KvOp::Import(_)) | None => None,
            };
            let (task, blocks, staged) = if let Some((ids, hashes, destination)) = outgoing {
                let ids = &ids[..hashes.len()];
                let task =
                    self.start_outgoing(op, ids, hashes, destination, &port, &layout, backend);
                (task, Vec::new(), None)
            } else if let Some(KvOp::Import(i)) = &op.op {
                let (task, staged) = self.start_import(op, i, &port, &layout);
                (task, i.block_ids.clone(), staged)
            } else {
                continue;
            };
            let t = InProgress { blocks, started, task, staged };
            self.running.insert(op.transfer_id.clone(), t);
        }
    }

    /// Starts an export (or a KV-tier store) of blocks `ids`: staged, its transfer starts first
    /// and sends each block as soon as it is copied out; else all are copied out, then sent.
    #[allow(clippy::too_many_arguments)]
    fn start_outgoing(
        &mut self,
        op: &v1::KvOperation,
        ids: &[u32],
        hashes: &[u64],
        destination: Option<String>,
        port: &KvPort,
        layout: &BlockLayout,
        backend: &mut dyn ModelBackend,
    ) -> tokio::task::JoinHandle<()> {
        let (tid, deadline, done) =
            (op.transfer_id.clone(), op.deadline_unix_ms, self.done_tx.clone());
        let span = op_span(op, "kv_export", hashes.len(), layout.block_bytes);
        let header = Header {
            transfer_id: tid.clone(),
            layout: layout.clone(),
            hashes: hashes.to_vec(),
            destination,
            deadline_unix_ms: deadline,
            traceparent: telemetry::hop_traceparent(span.as_ref()),
        };
        let agent = port.agent.clone();
        let report = move |result: Result<u64, Failed>| {
            end_span(span, &result);
            let _ = done.send(Done::Export { transfer_id: tid, result });
        };
        // An export's blocks stay the request's until it is reported: sent from the pool
        // itself when it is in the shared region. A store's may be reused at once: copied.
        let in_place = header.destination.is_some()
            && backend.kv_in_shared_pool()
            && self.staging_ok.load(Ordering::Acquire);
        let pooled = in_place.then(|| port.staging.as_ref()?.pool_slots(ids)).flatten();
        let in_place = pooled.is_some();
        let slots = if in_place {
            self.paths.pool += 1;
            pooled
        } else {
            let slots = self.slots(port, ids.len());
            self.paths.count(slots.is_some());
            slots
        };
        if let Some(slots) = slots {
            let (mut filler, slots, filled) = shm::filling(slots);
            let task = port.runtime.spawn(async move {
                let sent = data::put_staged(&agent, header.to_proto(), slots, filled);
                let sent = async {
                    sent.await.map(|r| r.bytes).map_err(|s| Failed::of_status("export", &s))
                };
                report(by(deadline, sent).await);
            });
            for &b in ids {
                if in_place {
                    // Each block's checksums now, while the step holds it: the receiver
                    // refuses a block that changed before the agent sent it.
                    filler.publish_in_place();
                } else if filler.fill(|buf| backend.read_block(b as usize, buf)).is_err() {
                    // A block that cannot be read ends the transfer: the filler goes early.
                    break;
                }
            }
            return task;
        }
        let copied = copy_out(backend, ids, layout.block_bytes);
        port.runtime.spawn(async move {
            let result = match copied {
                Ok(blocks) => by(deadline, export(&agent, header, blocks)).await,
                Err(e) => Err(e),
            };
            report(result);
        })
    }

    /// Starts an import: staged when the blocks come from the local agent (the region is
    /// shared with it only) and slots are free, each block then written into the pool at the
    /// first step after it lands; else read through the socket, written when all are here.
    fn start_import(
        &mut self,
        op: &v1::KvOperation,
        i: &v1::KvImport,
        port: &KvPort,
        layout: &BlockLayout,
    ) -> (tokio::task::JoinHandle<()>, Option<Landing>) {
        let (tid, deadline, done) =
            (op.transfer_id.clone(), op.deadline_unix_ms, self.done_tx.clone());
        // A KV-tier read names the agent whose store holds the blocks, and no transfer (the
        // agent answers from its store now); else the transfer arrives here.
        let tier_read = !i.source_agent.is_empty();
        let span = op_span(op, "kv_import", i.block_ids.len(), layout.block_bytes);
        let request = v1::GetBlocksRequest {
            transfer_id: if tier_read { String::new() } else { tid.clone() },
            layout: Some(layout.layout.clone()),
            block_hashes: i.block_hashes.clone(),
            deadline_unix_ms: deadline,
            traceparent: telemetry::hop_traceparent(span.as_ref()),
        };
        let agent = if tier_read { i.source_agent.clone() } else { port.agent.clone() };
        let (n, block_bytes) = (i.block_ids.len(), layout.block_bytes);
        let slots = if agent == port.agent { self.slots(port, n) } else { None };
        self.paths.count(slots.is_some());
        let (staged, landing) = match slots {
            Some(slots) => {
                let slots = Arc::new(slots);
                let (landed_tx, landed) = tokio::sync::watch::channel(Vec::new());
                let (release, released) = tokio::sync::oneshot::channel();
                let landing =
                    Landing { slots: slots.clone(), landed, written: 0, _release: release };
                (Some((slots, landed_tx, released)), Some(landing))
            }
            None => (None, None),
        };
        let task = port.runtime.spawn(async move {
            let read = async {
                match staged {
                    Some((slots, landed, released)) => {
                        data::get_staged(&agent, request, slots, landed, released)
                            .await
                            .map(|()| None)
                            .map_err(|s| Failed::of_status("import", &s))
                    }
                    None => import(&agent, &request, n, block_bytes).await.map(Some),
                }
            };
            let result = by(deadline, read).await;
            end_span(span, &result);
            let _ = done.send(Done::Import { transfer_id: tid, result });
        });
        (task, landing)
    }

    /// The transfers that ended since the last call, each reported; and the blocks of staged
    /// imports that landed since, written into `backend` now (no step reads an import's
    /// blocks before it is reported done, and a failed import's blocks go back to the
    /// scheduler's free pool without a name, so writing them early is safe).
    pub fn finish(&mut self, backend: &mut dyn ModelBackend) -> Vec<v1::KvOperationResult> {
        for t in self.running.values_mut() {
            if let Some(landing) = &mut t.staged {
                // A block that cannot be written fails the import when it is reported.
                let _ = landing.write_landed(&t.blocks, backend);
            }
        }
        let mut results = Vec::new();
        while let Ok(done) = self.done_rx.try_recv() {
            let (tid, outcome) = match done {
                Done::Export { transfer_id, result } => (transfer_id, result),
                Done::Import { transfer_id, result } => {
                    let Some(t) = self.running.get_mut(&transfer_id) else { continue };
                    let written = result.and_then(|arrived| match arrived {
                        Some(blocks) => write_all(backend, &t.blocks, &blocks),
                        None => t.staged.as_mut().map_or_else(
                            || {
                                Err(Failed::new(
                                    v1::KvFailure::Executor,
                                    "a staged import without slots".into(),
                                ))
                            },
                            |landing| landing.write_all(&t.blocks, backend),
                        ),
                    });
                    (transfer_id, written)
                }
            };
            // A transfer of a session that was reset since is not this session's to report.
            let Some(t) = self.running.remove(&tid) else { continue };
            let duration_us = t.started.elapsed().as_micros() as u64;
            results.push(match outcome {
                Ok(bytes) => v1::KvOperationResult {
                    transfer_id: tid,
                    ok: true,
                    error: String::new(),
                    bytes,
                    duration_us,
                    failure: v1::KvFailure::Unspecified.into(),
                },
                Err(failed) => v1::KvOperationResult {
                    transfer_id: tid,
                    ok: false,
                    error: failed.message,
                    bytes: 0,
                    duration_us,
                    failure: failed.kind.into(),
                },
            });
        }
        results
    }

    /// Ends every transfer in progress (a new session starts empty).
    pub fn reset(&mut self) {
        for (_, t) in self.running.drain() {
            t.task.abort();
        }
        while self.done_rx.try_recv().is_ok() {}
    }
}

/// Asks the agent at `agent` whether it maps staging region `name` until it answers (it may
/// start after the executor, as a sidecar does); sets `ok` when it does.
async fn probe_until_answered(agent: String, name: String, ok: Arc<AtomicBool>) {
    let mut wait = std::time::Duration::from_millis(200);
    for attempt in 0.. {
        match data::probe(&agent, &name).await {
            Ok(()) => {
                ok.store(true, Ordering::Release);
                tracing::info!(agent, region = name, "KV transfers go through shared memory");
                return;
            }
            Err(s) if s.code() == tonic::Code::Unavailable => {}
            Err(s) => {
                let error = s.message();
                tracing::warn!(
                    agent,
                    error,
                    "the KV agent cannot map the staging region: KV transfers take its socket"
                );
                return;
            }
        }
        if attempt == 0 {
            tracing::info!(
                agent,
                "the KV agent is not reachable yet: transfers take its socket until it is"
            );
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(std::time::Duration::from_secs(10));
    }
}

/// The executor's span for KV operation `op` (`name`), under its request's trace; `None` when
/// untraced (a KV-tier store carries no trace).
fn op_span(
    op: &v1::KvOperation,
    name: &'static str,
    blocks: usize,
    block_bytes: usize,
) -> Option<telemetry::HopSpan> {
    use opentelemetry::KeyValue;
    let (peer_key, peer) = match &op.op {
        Some(KvOp::Export(e)) => ("ferry.destination_agent", e.destination_agent.clone()),
        Some(KvOp::Import(i)) => ("ferry.source_agent", i.source_agent.clone()),
        _ => ("ferry.agent", String::new()),
    };
    telemetry::HopSpan::start(
        &op.traceparent,
        name,
        vec![
            KeyValue::new("ferry.transfer_id", op.transfer_id.clone()),
            KeyValue::new("ferry.blocks", blocks as i64),
            KeyValue::new("ferry.bytes", (blocks * block_bytes) as i64),
            KeyValue::new(peer_key, peer),
        ],
    )
}

/// Ends `span` with the transfer's outcome.
fn end_span<T>(span: Option<telemetry::HopSpan>, result: &Result<T, Failed>) {
    telemetry::end_hop(span, result.as_ref().err().map(|f| f.message.as_str()));
}

impl KvOps {
    /// `n` staging slots, if the agent maps the region and `n` are free.
    fn slots(&self, port: &KvPort, n: usize) -> Option<Slots> {
        if !self.staging_ok.load(Ordering::Acquire) {
            return None;
        }
        port.staging.as_ref()?.alloc(n)
    }
}

/// Copies blocks `ids` out of `backend`.
fn copy_out(
    backend: &mut dyn ModelBackend,
    ids: &[u32],
    block_bytes: usize,
) -> Result<Vec<Bytes>, Failed> {
    ids.iter()
        .map(|&b| {
            let mut buf = vec![0u8; block_bytes];
            backend
                .read_block(b as usize, &mut buf)
                .map(|()| Bytes::from(buf))
                .map_err(|e| Failed::new(v1::KvFailure::Executor, e))
        })
        .collect()
}

/// `transfer`, failed if it has not ended by `deadline_unix_ms` (a stalled agent or peer must
/// not hold a transfer's blocks, nor its request, past the deadline the scheduler set).
async fn by<T>(
    deadline_unix_ms: u64,
    transfer: impl std::future::Future<Output = Result<T, Failed>>,
) -> Result<T, Failed> {
    let at = ferry_runtime::clock::instant_of(deadline_unix_ms);
    let left = at.saturating_duration_since(std::time::Instant::now());
    tokio::time::timeout_at(at.into(), transfer).await.unwrap_or_else(|_| {
        Err(Failed::new(
            v1::KvFailure::Deadline,
            format!("deadline passed ({} ms after the operation started)", left.as_millis()),
        ))
    })
}

/// Puts `blocks` to the agent at `agent`, which pushes them on to the header's destination (or
/// keeps them when it names none); the bytes moved.
async fn export(agent: &str, header: Header, blocks: Vec<Bytes>) -> Result<u64, Failed> {
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let feed = async move {
        if tx.send(frames::header_frame(&header)).await.is_err() {
            return;
        }
        for (i, b) in blocks.iter().enumerate() {
            for f in frames::chunks(i, b) {
                if tx.send(f).await.is_err() {
                    return;
                }
            }
        }
    };
    let ((), sent) = tokio::join!(feed, data::send_blocks(agent, Op::Put, rx));
    let receipt = sent.map_err(|s| Failed::of_status("export", &s))?;
    Ok(receipt.bytes)
}

/// Reads the `n` blocks of `request` from the agent at `agent`, each `block_bytes` long, checked.
async fn import(
    agent: &str,
    request: &v1::GetBlocksRequest,
    n: usize,
    block_bytes: usize,
) -> Result<Vec<Bytes>, Failed> {
    let malformed = |m: String| Failed::new(v1::KvFailure::Malformed, m);
    // `data::get` checks each chunk's CRC32C as its bytes arrive: a mismatch comes as
    // DATA_LOSS, reported as a checksum failure.
    let mut chunks =
        data::get(agent, request).await.map_err(|s| Failed::of_status("import", &s))?;
    let mut blocks = Vec::with_capacity(n);
    let mut current = bytes::BytesMut::new();
    while let Some(chunk) = chunks.recv().await {
        let c = chunk.map_err(|s| Failed::of_status("import", &s))?;
        if c.block_index as usize != blocks.len() || c.offset != current.len() as u64 {
            return Err(malformed(format!(
                "import: chunk for block {} at {} out of order",
                c.block_index, c.offset
            )));
        }
        if current.len() + c.data.len() > block_bytes {
            return Err(malformed(format!(
                "import: block {} is longer than {block_bytes} bytes",
                c.block_index
            )));
        }
        if current.is_empty() && c.data.len() == block_bytes {
            blocks.push(c.data);
        } else {
            current.extend_from_slice(&c.data);
            if current.len() == block_bytes {
                blocks.push(std::mem::take(&mut current).freeze());
            }
        }
    }
    if blocks.len() != n {
        return Err(malformed(format!("import: {} of {n} blocks arrived", blocks.len())));
    }
    Ok(blocks)
}
