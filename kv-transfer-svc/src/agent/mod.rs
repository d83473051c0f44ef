//! The agent's state and what it does with block streams: store the blocks of a push (pinned
//! until the transfer's reader has them), hand them to a reader as they arrive, forward an
//! executor's export to another node's agent, and end a transfer that fails or is cancelled
//! without a trace in the store.
//!
//! Invariants:
//! - a block of a transfer in progress is pinned in the store once by that transfer, and
//!   unpinned when the transfer is read, fails, is cancelled or passes its deadline;
//! - a transfer that ends without being read leaves the store as it found it: the blocks it
//!   added are removed (blocks that were there before stay);
//! - every ended transfer leaves a tombstone for [`TOMBSTONE_TTL`] saying why, so a reader
//!   waiting for it, or a late push under its id, gets that reason at once instead of waiting
//!   for a deadline;
//! - one lock guards the store and the transfer table together, so the two never disagree.
//!
//! The agent's work, by path: [`receive`] (a push arriving, an executor's put stored here),
//! [`relay`] (an executor's export pushed on to another node's agent), [`read`] (blocks
//! handed to a reader as they arrive, or from the store) and [`failure`] (why a transfer
//! failed, and how it ends). This module holds the state they share and what reads all of it.

mod failure;
mod read;
mod receive;
mod relay;

pub use failure::Failure;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use ferry_kv_wire::buffers::BufferPool;
use ferry_kv_wire::frames::{self, BlockAssembler, Header};
use ferry_kv_wire::layout::BlockLayout;
use ferry_proto::v1;
use ferry_runtime::clock;
use ferry_runtime::telemetry::HopSpan;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use crate::store::{BlockKey, BlockStore};

/// Most block hashes one `ListBlocks` answers (2.4 MB of message at most).
pub const MAX_LISTED_BLOCKS: usize = 1 << 18;

/// A span for this agent's part in the transfer of `header`, under the sender's trace.
fn hop_span(header: &Header, name: &'static str) -> Option<HopSpan> {
    use opentelemetry::KeyValue;
    HopSpan::start(
        &header.traceparent,
        name,
        vec![
            KeyValue::new("ferry.transfer_id", header.transfer_id.clone()),
            KeyValue::new("ferry.blocks", header.hashes.len() as i64),
            KeyValue::new("ferry.bytes", header.total_bytes() as i64),
        ],
    )
}

/// Ends `span` with `result`.
fn end_hop<T, E: std::fmt::Display>(span: Option<HopSpan>, result: &Result<T, E>) {
    let error = result.as_ref().err().map(ToString::to_string);
    ferry_runtime::telemetry::end_hop(span, error.as_deref());
}

/// How long an ended transfer's reason is kept.
pub const TOMBSTONE_TTL: Duration = Duration::from_mins(10);
/// The deadline of a transfer whose header gives none.
pub const DEFAULT_DEADLINE: Duration = Duration::from_mins(5);

/// A push being received, or received and not yet read.
#[derive(Debug)]
struct Incoming {
    layout: u64,
    /// Blocks it pinned.
    pinned: Vec<BlockKey>,
    /// Blocks it added to the store (removed again if it fails).
    added: Vec<BlockKey>,
    deadline: Instant,
}

/// Why a transfer ended (a tombstone).
#[derive(Debug, Clone)]
struct Ended {
    failure: Failure,
    why: String,
    at: Instant,
}

/// Everything behind the agent's one lock.
#[derive(Debug)]
struct State {
    store: BlockStore,
    incoming: HashMap<String, Incoming>,
    /// Exports being forwarded to another agent, with their cancel switch.
    outgoing: HashMap<String, watch::Sender<bool>>,
    ended: HashMap<String, Ended>,
    /// Layouts seen per model fingerprint (for lookups by fingerprint).
    layouts: HashMap<String, HashSet<u64>>,
}

/// Monotonic counters.
#[derive(Debug, Default)]
pub struct Counters {
    /// Block bytes received (pushes and puts).
    pub bytes_received: AtomicU64,
    /// Block bytes sent (forwarded pushes and reads).
    pub bytes_sent: AtomicU64,
    /// Transfers received whole.
    pub transfers_received: AtomicU64,
    /// Failures, by [`Failure`] (its discriminant is its place in [`Failure::ALL`]).
    pub failures: [AtomicU64; Failure::ALL.len()],
    /// Sum of received transfers' durations, microseconds (with `transfers_received`, the mean).
    pub transfer_micros: AtomicU64,
    /// Blocks of staged reads that the executor copied straight out of the store's shared
    /// memory ([`ferry_kv_wire::buffers`]), and those the agent copied into its slots.
    pub staged_reads_in_place: AtomicU64,
    /// See `staged_reads_in_place`.
    pub staged_reads_copied: AtomicU64,
}

/// A node's KV agent.
#[derive(Debug)]
pub struct Agent {
    /// The node it serves.
    pub node_id: String,
    state: Mutex<State>,
    /// Bumped whenever a block arrives or a transfer ends, so waiting readers look again.
    changed: watch::Sender<u64>,
    /// What it counted.
    pub counters: Counters,
    /// Buffers that arriving chunks are read into, recycled as blocks leave the store.
    pub buffers: Arc<BufferPool>,
    /// Local executors' staging regions, mapped.
    pub regions: ferry_kv_wire::shm::Regions,
}

/// What a store received or forwarded.
pub type Receipt = v1::TransferReceipt;

/// A stream of block frames.
pub type FrameStream = mpsc::Receiver<Result<v1::BlockFrame, Status>>;

/// A stream of whole blocks.
pub type BlockStream = mpsc::Receiver<Result<Bytes, Status>>;

/// The local instant of a wall-clock deadline (`0`: [`DEFAULT_DEADLINE`] from now).
pub fn deadline_of(unix_ms: u64) -> Instant {
    if unix_ms == 0 {
        return Instant::now() + DEFAULT_DEADLINE;
    }
    Instant::from_std(clock::instant_of(unix_ms))
}

impl Agent {
    /// An agent for `node_id` with a store of `capacity` bytes, mapping local executors'
    /// staging regions from `shm_dir` and keeping the blocks it receives in regions of its own
    /// there.
    pub fn new(node_id: String, capacity: usize, shm_dir: std::path::PathBuf) -> Arc<Self> {
        let state = State {
            store: BlockStore::new(capacity),
            incoming: HashMap::new(),
            outgoing: HashMap::new(),
            ended: HashMap::new(),
            layouts: HashMap::new(),
        };
        Arc::new(Self {
            node_id,
            state: Mutex::new(state),
            changed: watch::channel(0).0,
            counters: Counters::default(),
            // Idle buffers up to the store's size: the agent's memory stays at the store's
            // high-water mark instead of faulting pages in again for every transfer. Received
            // blocks land in shared memory, for local executors to copy from directly.
            buffers: BufferPool::shared(capacity, shm_dir.clone()),
            regions: ferry_kv_wire::shm::Regions::new(shm_dir),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the store half-updated: every update
        // under it is a few map operations. Keep serving.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    /// Which of `hashes` the store holds, for `layout` (or any layout of `fingerprint`).
    pub fn lookup(&self, req: &v1::LookupRequest) -> Result<v1::LookupResponse, Status> {
        let mut st = self.state();
        let layouts: Vec<u64> = match &req.layout {
            Some(l) => vec![
                BlockLayout::from_proto(Some(l))
                    .map_err(|e| Status::invalid_argument(e.to_string()))?
                    .id,
            ],
            None => st
                .layouts
                .get(&req.model_fingerprint)
                .map(|s| s.iter().copied().collect())
                .unwrap_or_default(),
        };
        let present: Vec<bool> = req
            .block_hashes
            .iter()
            .map(|&hash| {
                let found =
                    layouts.iter().any(|&layout| st.store.contains(BlockKey { layout, hash }));
                st.store.count(found);
                found
            })
            .collect();
        let prefix_blocks = present.iter().take_while(|p| **p).count() as u32;
        Ok(v1::LookupResponse { present, prefix_blocks })
    }

    /// The blocks held in a layout, least recently used first (`ListBlocks`).
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for a missing or malformed layout.
    pub fn list_blocks(
        &self,
        req: &v1::ListBlocksRequest,
    ) -> Result<v1::ListBlocksResponse, Status> {
        let layout = BlockLayout::from_proto(req.layout.as_ref())
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let limit = match req.limit as usize {
            0 => MAX_LISTED_BLOCKS,
            n => n.min(MAX_LISTED_BLOCKS),
        };
        Ok(v1::ListBlocksResponse { block_hashes: self.state().store.list(layout.id, limit) })
    }

    /// The store and the counters, for `Describe` and `/metrics`.
    pub fn describe(&self) -> v1::KvAgentDescription {
        let st = self.state();
        let (hits, misses) = st.store.hits_and_misses();
        v1::KvAgentDescription {
            node_id: self.node_id.clone(),
            blocks: st.store.len() as u64,
            bytes: st.store.used() as u64,
            capacity_bytes: st.store.capacity() as u64,
            transfers_in_progress: (st.incoming.len() + st.outgoing.len()) as u32,
            bytes_received: self.counters.bytes_received.load(Ordering::Relaxed),
            bytes_sent: self.counters.bytes_sent.load(Ordering::Relaxed),
            hits,
            misses,
        }
    }

    /// Bytes held by pinned blocks (a transfer in progress holds them).
    pub fn pinned_bytes(&self) -> usize {
        self.state().store.pinned_bytes()
    }

    /// Ends the transfers whose deadline passed and forgets old tombstones; run periodically.
    pub fn reap(&self) {
        let now = Instant::now();
        let expired: Vec<String> = {
            let mut st = self.state();
            st.ended.retain(|_, e| now.duration_since(e.at) < TOMBSTONE_TTL);
            st.incoming
                .iter()
                .filter(|(_, inc)| inc.deadline <= now)
                .map(|(t, _)| t.clone())
                .collect()
        };
        for tid in expired {
            let _ = self.fail(
                &tid,
                Failure::Deadline,
                format!("transfer {tid} was not read before its deadline"),
            );
        }
    }
}

/// Whether a stream's chunk checksums are still to be checked where it is received.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checksums {
    /// Check every chunk's (a gRPC stream: prost decoded the bytes, nothing checked them).
    Check,
    /// Its reader verified each chunk's as the bytes arrived (the data channel, see
    /// [`ferry_kv_wire::frames::Crc32c`]): only the other rules are checked.
    Verified,
}

impl Checksums {
    fn assembler(self, asm: BlockAssembler) -> BlockAssembler {
        match self {
            Self::Check => asm,
            Self::Verified => asm.verified(),
        }
    }
}

/// Reads and checks a stream's first frame.
pub async fn first_header(
    frames: &mut (impl Stream<Item = Result<v1::BlockFrame, Status>> + Unpin),
) -> Result<Header, Status> {
    let first = frames
        .next()
        .await
        .ok_or_else(|| {
            Status::invalid_argument("an empty block stream: it must start with a header")
        })?
        .map_err(|s| {
            Status::cancelled(format!("the sender failed before the header: {}", s.message()))
        })?;
    frames::read_header(first).map_err(|e| Status::invalid_argument(e.to_string()))
}
