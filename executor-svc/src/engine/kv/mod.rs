//! KV operations: the executor's side of a KV transfer (DESIGN.md §6). An `Export` copies a
//! request's full blocks out of the KV pool and puts them to the node's KV agent, which pushes
//! them on to the destination node's agent; an `Import` reads blocks from the node's agent (as
//! they arrive) and writes them into the pool. Both run beside the steps, on the async runtime,
//! and each is reported done or failed, with the reason, in a later `StepResult`.
//!
//! With the local agent, blocks go through the executor's shared-memory staging region
//! (`ferry_kv_wire::shm`, `--kv-staging-mib`): an export's transfer starts first and
//! the agent sends each block on as soon as the step has copied it into its slot; an import's
//! blocks are written into the pool at the first step after each lands — copied from the
//! agent's store itself when the agent holds the block in shared memory (mapped read-only
//! here), else from the slot the agent copied it into. Without room in the region (or without
//! a region the agent can map), the blocks cross the agent's socket instead, whole.
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
//!
//! The pieces: [`validate`] (a step's operations checked whole), [`export`] (blocks copied out
//! and put to the agent), [`import`] (blocks read and written into the pool), [`transfer`]
//! (a transfer's deadline, span and failure, and its report back to the engine), and
//! [`probe`] (whether the agent maps the staging region). This module holds the operations in
//! progress and reports them.

mod export;
mod import;
mod probe;
mod transfer;
mod validate;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Instant;

use ferry_kv_wire::layout::BlockLayout;
use ferry_kv_wire::shm::{PoolMemory, Slots, Staging};
use ferry_proto::v1::{self, kv_operation::Op as KvOp};

use super::backend::ModelBackend;
use import::{write_all, Landing};
use transfer::{Done, Failed};

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
    config: &crate::executor_config::ExecutorConfig,
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

/// A transfer in progress.
struct InProgress {
    /// Blocks it writes (an import), empty for an export.
    blocks: Vec<u32>,
    started: Instant,
    task: tokio::task::JoinHandle<()>,
    /// A staged import's slots and progress.
    staged: Option<Landing>,
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
                p.runtime.spawn(probe::probe_until_answered(agent, name, ok));
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

impl KvOps {
    /// `n` staging slots, if the agent maps the region and `n` are free.
    fn slots(&self, port: &KvPort, n: usize) -> Option<Slots> {
        if !self.staging_ok.load(Ordering::Acquire) {
            return None;
        }
        port.staging.as_ref()?.alloc(n)
    }
}
