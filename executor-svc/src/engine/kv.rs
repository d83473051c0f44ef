//! KV operations: the executor's side of a KV transfer (DESIGN.md §6). An `Export` copies a
//! request's full blocks out of the KV pool and puts them to the node's KV agent, which pushes
//! them on to the destination node's agent; an `Import` reads blocks from the node's agent (as
//! they arrive) and writes them into the pool. Both run beside the steps, on the async runtime,
//! and each is reported done or failed, with the reason, in a later `StepResult`.
//!
//! Invariants:
//! - an export's bytes are copied out of the pool in the step that starts it, so the blocks may
//!   change or be freed afterwards without touching the transfer (the scheduler still keeps
//!   them until the export is reported, for a retry or a recompute);
//! - an import's blocks are written only when the whole import has arrived and checked, at the
//!   start of a step, and reported in that step's result — so no step reads them before they
//!   hold the imported KV, and a failed import writes nothing;
//! - an import's blocks are held by no live request and no other import while it runs;
//! - a session reset ends every transfer in progress; their late completions are ignored.

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::time::Instant;

use bytes::Bytes;
use ferry_kv_transfer_svc::data::{self, Op};
use ferry_kv_transfer_svc::frames::{self, Header};
use ferry_kv_transfer_svc::layout::BlockLayout;
use ferry_proto::v1::{self, kv_operation::Op as KvOp};
use ferry_runtime::telemetry;

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

/// A finished transfer, from its task.
enum Done {
    Export { transfer_id: String, result: Result<u64, Failed> },
    Import { transfer_id: String, result: Result<Vec<Bytes>, Failed> },
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
            Code::InvalidArgument | Code::DataLoss if s.message().contains("CRC32C") => {
                v1::KvFailure::Checksum
            }
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
}

/// The engine's KV operations in progress.
pub struct KvOps {
    port: Option<KvPort>,
    block_layout: Option<BlockLayout>,
    running: HashMap<String, InProgress>,
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
        Self { port, block_layout, running: HashMap::new(), done_tx, done_rx }
    }

    /// Transfers in progress.
    pub fn in_progress(&self) -> usize {
        self.running.len()
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
            let tid = op.transfer_id.clone();
            let started = Instant::now();
            let done = self.done_tx.clone();
            let deadline = op.deadline_unix_ms;
            let outgoing = match &op.op {
                Some(KvOp::Export(e)) => {
                    Some((&e.block_ids, &e.block_hashes, Some(e.destination_agent.clone())))
                }
                Some(KvOp::Store(st)) => Some((&st.block_ids, &st.block_hashes, None)),
                Some(KvOp::Import(_)) | None => None,
            };
            let (task, blocks) = if let Some((ids, hashes, destination)) = outgoing {
                let span = op_span(op, "kv_export", hashes.len(), layout.block_bytes);
                let copied = copy_out(backend, &ids[..hashes.len()], layout.block_bytes);
                let header = Header {
                    transfer_id: tid.clone(),
                    layout: layout.clone(),
                    hashes: hashes.clone(),
                    destination,
                    deadline_unix_ms: deadline,
                    traceparent: telemetry::hop_traceparent(span.as_ref()),
                };
                let agent = port.agent.clone();
                let task = port.runtime.spawn(async move {
                    let result = match copied {
                        Ok(blocks) => by(deadline, export(&agent, header, blocks)).await,
                        Err(e) => Err(e),
                    };
                    end_span(span, &result);
                    let _ = done.send(Done::Export { transfer_id: tid, result });
                });
                (task, Vec::new())
            } else if let Some(KvOp::Import(i)) = &op.op {
                // A KV-tier read names the agent whose store holds the blocks, and no transfer
                // (the agent answers from its store now); else the transfer arrives here.
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
                let task = port.runtime.spawn(async move {
                    let result = by(deadline, import(&agent, &request, n, block_bytes)).await;
                    end_span(span, &result);
                    let _ = done.send(Done::Import { transfer_id: tid, result });
                });
                (task, i.block_ids.clone())
            } else {
                continue;
            };
            self.running.insert(op.transfer_id.clone(), InProgress { blocks, started, task });
        }
    }

    /// The transfers that ended since the last call: imports that arrived are written into
    /// `backend` now; each is reported.
    pub fn finish(&mut self, backend: &mut dyn ModelBackend) -> Vec<v1::KvOperationResult> {
        let mut results = Vec::new();
        while let Ok(done) = self.done_rx.try_recv() {
            let (tid, outcome) = match done {
                Done::Export { transfer_id, result } => (transfer_id, result),
                Done::Import { transfer_id, result } => {
                    let Some(t) = self.running.get(&transfer_id) else { continue };
                    let written = result.and_then(|blocks| {
                        let mut bytes = 0u64;
                        for (&b, data) in t.blocks.iter().zip(&blocks) {
                            backend
                                .write_block(b as usize, data)
                                .map_err(|e| Failed::new(v1::KvFailure::Executor, e))?;
                            bytes += data.len() as u64;
                        }
                        Ok(bytes)
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

/// Puts `blocks` to the agent at `agent`, which pushes them to the header's destination; the
/// bytes moved.
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
        if crc32c::crc32c(&c.data) != c.crc32c {
            return Err(Failed::new(
                v1::KvFailure::Checksum,
                format!("import: CRC32C mismatch in block {}", c.block_index),
            ));
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
