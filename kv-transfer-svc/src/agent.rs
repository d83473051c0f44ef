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

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use ferry_proto::v1;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use crate::buffers::BufferPool;
use crate::frames::{self, BlockAssembler, FrameError, Header};
use crate::layout::BlockLayout;
use crate::store::{BlockKey, BlockStore, Inserted};
use ferry_runtime::clock;
use ferry_runtime::telemetry::HopSpan;

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

/// Why a transfer failed, as metrics count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Failure {
    /// Its deadline passed.
    Deadline,
    /// Someone cancelled it.
    Cancelled,
    /// A chunk's checksum did not match.
    Checksum,
    /// The stream ended before every block arrived.
    Truncated,
    /// A malformed stream or request.
    Malformed,
    /// The store was full of pinned blocks.
    StoreFull,
    /// The other side's layout differs.
    Layout,
    /// The peer agent (or the sender) failed.
    Peer,
}

impl Failure {
    /// Every reason, in label order.
    pub const ALL: [Failure; 8] = [
        Failure::Deadline,
        Failure::Cancelled,
        Failure::Checksum,
        Failure::Truncated,
        Failure::Malformed,
        Failure::StoreFull,
        Failure::Layout,
        Failure::Peer,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Failure::Deadline => "deadline",
            Failure::Cancelled => "cancelled",
            Failure::Checksum => "checksum",
            Failure::Truncated => "truncated",
            Failure::Malformed => "malformed",
            Failure::StoreFull => "store_full",
            Failure::Layout => "layout",
            Failure::Peer => "peer",
        }
    }

    fn of(e: &FrameError) -> Self {
        match e {
            FrameError::Checksum { .. } => Failure::Checksum,
            FrameError::Truncated { .. } => Failure::Truncated,
            FrameError::Layout(_) => Failure::Layout,
            _ => Failure::Malformed,
        }
    }

    /// The gRPC status for a transfer that failed for this reason (a checksum mismatch is
    /// `DATA_LOSS`, so that whoever hears of it tells it apart by its code).
    fn status(self, why: String) -> Status {
        match self {
            Failure::Deadline => Status::deadline_exceeded(why),
            Failure::Cancelled => Status::cancelled(why),
            Failure::Checksum => Status::data_loss(why),
            Failure::Truncated | Failure::Malformed => Status::invalid_argument(why),
            Failure::StoreFull => Status::resource_exhausted(why),
            Failure::Layout => Status::failed_precondition(why),
            Failure::Peer => Status::unavailable(why),
        }
    }
}

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
    /// memory ([`crate::buffers`]), and those the agent copied into its slots.
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
    pub regions: crate::shm::Regions,
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
            regions: crate::shm::Regions::new(shm_dir),
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

    fn count_failure(&self, failure: Failure) {
        self.counters.failures[failure as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Receives a push (the destination side): stores its blocks pinned as they arrive, so a
    /// reader can start before the last one, until the transfer's reader has them.
    pub async fn receive_push(
        &self,
        mut frames: impl Stream<Item = Result<v1::BlockFrame, Status>> + Unpin,
        checksums: Checksums,
    ) -> Result<Receipt, Status> {
        let header = first_header(&mut frames).await?;
        if header.destination.is_some() {
            return Err(Status::invalid_argument("a push is stored here: it names no destination"));
        }
        let span = hop_span(&header, "kv_receive");
        let result = self.receive_pushed(header, frames, checksums).await;
        end_hop(span, &result);
        result
    }

    async fn receive_pushed(
        &self,
        header: Header,
        mut frames: impl Stream<Item = Result<v1::BlockFrame, Status>> + Unpin,
        checksums: Checksums,
    ) -> Result<Receipt, Status> {
        let tid = header.transfer_id.clone();
        let deadline = deadline_of(header.deadline_unix_ms);
        self.begin_incoming(&header, deadline)?;
        let started = Instant::now();
        let receive = self.receive_blocks(&header, &mut frames, true, checksums);
        let received = tokio::time::timeout_at(deadline, receive).await;
        match received {
            Ok(Ok(bytes)) => {
                self.counters.transfers_received.fetch_add(1, Ordering::Relaxed);
                let micros = started.elapsed().as_micros() as u64;
                self.counters.transfer_micros.fetch_add(micros, Ordering::Relaxed);
                Ok(Receipt { transfer_id: tid, blocks: header.hashes.len() as u32, bytes })
            }
            Ok(Err((failure, why))) => Err(self.fail(&tid, failure, why)),
            Err(_) => Err(self.fail(
                &tid,
                Failure::Deadline,
                format!("transfer {tid} passed its deadline while arriving"),
            )),
        }
    }

    /// An executor's `Put`: forwarded to the destination its header names (an export), or
    /// stored here (a KV-tier write).
    pub async fn put(
        &self,
        frames: impl Stream<Item = Result<v1::BlockFrame, Status>> + Unpin,
        checksums: Checksums,
    ) -> Result<Receipt, Status> {
        self.put_checked(frames, Some(checksums), checksums).await
    }

    /// A `Put` of an executor's staged blocks ([`crate::shm`]) with the checksums the executor
    /// computed as it staged them: a forward passes them on unchecked (the destination checks
    /// every chunk), a store checks them on its copy.
    pub async fn put_staged(
        &self,
        frames: impl Stream<Item = Result<v1::BlockFrame, Status>> + Unpin,
    ) -> Result<Receipt, Status> {
        self.put_checked(frames, None, Checksums::Check).await
    }

    /// A `Put`: a forward checks its chunks as `forward` says (`None`: not at all), a store as
    /// `store` says.
    async fn put_checked(
        &self,
        mut frames: impl Stream<Item = Result<v1::BlockFrame, Status>> + Unpin,
        forward: Option<Checksums>,
        store: Checksums,
    ) -> Result<Receipt, Status> {
        let header = first_header(&mut frames).await?;
        if header.destination.is_some() {
            return self.forward(header, frames, forward).await;
        }
        self.receive_put(header, frames, store).await
    }

    /// Stores blocks an executor writes back (a `Put` without destination): unpinned, as the
    /// KV tier's cache.
    async fn receive_put(
        &self,
        header: Header,
        mut frames: impl Stream<Item = Result<v1::BlockFrame, Status>> + Unpin,
        checksums: Checksums,
    ) -> Result<Receipt, Status> {
        let span = hop_span(&header, "kv_store");
        let deadline = deadline_of(header.deadline_unix_ms);
        let receive = self.receive_blocks(&header, &mut frames, false, checksums);
        let received = tokio::time::timeout_at(deadline, receive).await;
        let result = match received {
            Ok(Ok(bytes)) => Ok(Receipt {
                transfer_id: header.transfer_id,
                blocks: header.hashes.len() as u32,
                bytes,
            }),
            Ok(Err((failure, why))) => {
                self.count_failure(failure);
                Err(failure.status(why))
            }
            Err(_) => {
                self.count_failure(Failure::Deadline);
                Err(Status::deadline_exceeded(format!(
                    "put {} passed its deadline",
                    header.transfer_id
                )))
            }
        };
        end_hop(span, &result);
        result
    }

    /// Registers a push about to arrive; refuses a transfer that already ended or is arriving.
    fn begin_incoming(&self, header: &Header, deadline: Instant) -> Result<(), Status> {
        let mut st = self.state();
        let tid = &header.transfer_id;
        if let Some(ended) = st.ended.get(tid) {
            return Err(Status::failed_precondition(format!(
                "transfer {tid} already ended: {}",
                ended.why
            )));
        }
        if st.incoming.contains_key(tid) {
            return Err(Status::already_exists(format!("transfer {tid} is already arriving here")));
        }
        let layout = &header.layout;
        st.layouts.entry(layout.layout.model_fingerprint.clone()).or_default().insert(layout.id);
        st.incoming.insert(
            tid.clone(),
            Incoming { layout: layout.id, pinned: Vec::new(), added: Vec::new(), deadline },
        );
        Ok(())
    }

    /// Reads chunks until the stream ends, storing each completed block (pinned for the
    /// transfer if `pin`). Returns the bytes received.
    async fn receive_blocks(
        &self,
        header: &Header,
        frames: &mut (impl Stream<Item = Result<v1::BlockFrame, Status>> + Unpin),
        pin: bool,
        checksums: Checksums,
    ) -> Result<u64, (Failure, String)> {
        let tid = &header.transfer_id;
        let mut asm = checksums.assembler(BlockAssembler::new(header));
        while let Some(frame) = frames.next().await {
            let frame = frame.map_err(|s| stream_failure(tid, &s))?;
            let done =
                asm.push(frame).map_err(|e| (Failure::of(&e), format!("transfer {tid}: {e}")))?;
            if let Some((i, data)) = done {
                self.counters.bytes_received.fetch_add(data.len() as u64, Ordering::Relaxed);
                let key = BlockKey { layout: header.layout.id, hash: header.hashes[i] };
                self.store_block(tid, key, data, pin)?;
            }
        }
        asm.finish().map_err(|e| (Failure::of(&e), format!("transfer {tid}: {e}")))?;
        Ok(asm.received())
    }

    fn store_block(
        &self,
        tid: &str,
        key: BlockKey,
        data: Bytes,
        pin: bool,
    ) -> Result<(), (Failure, String)> {
        {
            let mut st = self.state();
            if pin && !st.incoming.contains_key(tid) {
                let why = st
                    .ended
                    .get(tid)
                    .map_or_else(|| "it was cancelled".to_string(), |e| e.why.clone());
                return Err((
                    Failure::Cancelled,
                    format!("transfer {tid} ended while arriving: {why}"),
                ));
            }
            let inserted = st
                .store
                .insert(key, data, pin)
                .map_err(|e| (Failure::StoreFull, format!("transfer {tid}: {e}")))?;
            if pin {
                let inc = st.incoming.get_mut(tid).expect("checked above");
                inc.pinned.push(key);
                if inserted == Inserted::New {
                    inc.added.push(key);
                }
            }
        }
        self.bump();
        Ok(())
    }

    /// Ends transfer `tid` as failed: unpins its blocks, removes the ones it added, leaves a
    /// tombstone; returns the status to answer with.
    fn fail(&self, tid: &str, failure: Failure, why: String) -> Status {
        self.count_failure(failure);
        {
            let mut st = self.state();
            if let Some(inc) = st.incoming.remove(tid) {
                for key in &inc.pinned {
                    st.store.unpin(*key);
                }
                for key in &inc.added {
                    st.store.remove(*key);
                }
            }
            if let Some(cancel) = st.outgoing.remove(tid) {
                cancel.send_replace(true);
            }
            st.ended
                .insert(tid.to_string(), Ended { failure, why: why.clone(), at: Instant::now() });
        }
        self.bump();
        failure.status(why)
    }

    /// Cancels transfer `tid`: arriving or forwarding, it ends now and its blocks leave the
    /// store; a reader waiting for it fails with CANCELLED. True if it was in progress.
    pub fn cancel(&self, tid: &str, reason: &str) -> bool {
        let found = {
            let st = self.state();
            st.incoming.contains_key(tid) || st.outgoing.contains_key(tid)
        };
        let why = if reason.is_empty() {
            format!("transfer {tid} was cancelled")
        } else {
            format!("transfer {tid} was cancelled: {reason}")
        };
        if found {
            let _ = self.fail(tid, Failure::Cancelled, why);
        } else {
            self.state().ended.entry(tid.to_string()).or_insert(Ended {
                failure: Failure::Cancelled,
                why,
                at: Instant::now(),
            });
            self.bump();
        }
        found
    }

    /// Streams the blocks `req` asks for as frames: its header, then each block's chunks
    /// (for the gRPC `Get`); see [`Agent::read_blocks`].
    pub fn read(self: &Arc<Self>, req: v1::GetBlocksRequest) -> Result<FrameStream, Status> {
        let (header, mut blocks) = self.read_blocks(req)?;
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            if tx.send(Ok(frames::header_frame(&header))).await.is_err() {
                return;
            }
            let mut index = 0;
            while let Some(block) = blocks.recv().await {
                match block {
                    Ok(data) => {
                        for frame in frames::chunks(index, &data) {
                            if tx.send(Ok(frame)).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                }
                index += 1;
            }
        });
        Ok(rx)
    }

    /// Streams the blocks `req` asks for, whole, in order (the last item is an error if the
    /// read failed); with the read's header. With a transfer id, each block is sent as soon as
    /// it is here (waiting for a push still arriving, until the deadline); the transfer's pins
    /// go once all are sent. Without, every block must be in the store now (a KV-tier read).
    pub fn read_blocks(
        self: &Arc<Self>,
        req: v1::GetBlocksRequest,
    ) -> Result<(Header, BlockStream), Status> {
        let layout = BlockLayout::from_proto(req.layout.as_ref())
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        if req.block_hashes.is_empty() || req.block_hashes.len() > frames::MAX_BLOCKS {
            return Err(Status::invalid_argument(format!(
                "a read asks for 1 to {} blocks, got {}",
                frames::MAX_BLOCKS,
                req.block_hashes.len()
            )));
        }
        if req.transfer_id.len() > frames::MAX_TRANSFER_ID {
            return Err(Status::invalid_argument(format!(
                "transfer_id is longer than {} bytes",
                frames::MAX_TRANSFER_ID
            )));
        }
        let header = Header {
            transfer_id: req.transfer_id.clone(),
            layout,
            hashes: req.block_hashes,
            destination: None,
            deadline_unix_ms: req.deadline_unix_ms,
            traceparent: req.traceparent,
        };
        let span = hop_span(&header, "kv_read");
        let keys: Vec<BlockKey> =
            header.hashes.iter().map(|&hash| BlockKey { layout: header.layout.id, hash }).collect();
        if header.transfer_id.is_empty() {
            // A KV-tier read: all present now, or NOT_FOUND naming the first that is not.
            let found: Result<Vec<Bytes>, Status> = {
                let mut st = self.state();
                keys.iter()
                    .enumerate()
                    .map(|(i, key)| {
                        st.store.get(*key).ok_or_else(|| {
                            Status::not_found(format!(
                                "block {i} ({:016x}) is not in this agent's store",
                                key.hash
                            ))
                        })
                    })
                    .collect()
            };
            let blocks = match found {
                Ok(blocks) => blocks,
                Err(missing) => {
                    end_hop(span, &Err::<(), _>(&missing));
                    return Err(missing);
                }
            };
            let (tx, rx) = mpsc::channel(4);
            let agent = self.clone();
            tokio::spawn(async move {
                let blocks = futures_util::stream::iter(blocks.into_iter().map(Ok));
                let sent = agent.send_blocks(blocks, &tx).await;
                end_hop(span, &sent.map_err(|()| "the read ended before every block was sent"));
            });
            return Ok((header, rx));
        }
        let (tx, rx) = mpsc::channel(4);
        let agent = self.clone();
        let reply = header.clone();
        tokio::spawn(async move {
            let deadline = deadline_of(header.deadline_unix_ms);
            let (tid, layout) = (header.transfer_id.clone(), header.layout.id);
            // Each block is awaited in order and sent as soon as it is here.
            let blocks = futures_util::stream::iter(keys)
                .then(|key| agent.wait_block(&tid, key, layout, deadline));
            let sent = agent.send_blocks(blocks, &tx).await;
            if sent.is_ok() {
                agent.release(&tid);
            }
            end_hop(span, &sent.map_err(|()| "the read ended before every block was sent"));
        });
        Ok((reply, rx))
    }

    /// Waits until block `key` of transfer `tid` is in the store (or the transfer ended, or the
    /// deadline passed).
    async fn wait_block(
        &self,
        tid: &str,
        key: BlockKey,
        layout: u64,
        deadline: Instant,
    ) -> Result<Bytes, Status> {
        let mut changed = self.changed.subscribe();
        loop {
            {
                let mut st = self.state();
                if let Some(inc) = st.incoming.get(tid) {
                    if inc.layout != layout {
                        return Err(Status::failed_precondition(format!(
                            "transfer {tid} carries blocks of another KV layout than the reader's: refused"
                        )));
                    }
                }
                // A wake-up before the block arrived is not a miss: look before reading.
                if st.store.contains(key) {
                    return Ok(st.store.get(key).expect("just seen"));
                }
                if let Some(ended) = st.ended.get(tid) {
                    return Err(ended.failure.status(ended.why.clone()));
                }
            }
            tokio::select! {
                r = changed.changed() => if r.is_err() { return Err(Status::unavailable("the agent is shutting down")) },
                () = tokio::time::sleep_until(deadline) => {
                    return Err(Status::deadline_exceeded(format!(
                        "transfer {tid}: block {:016x} did not arrive before the deadline", key.hash
                    )));
                }
            }
        }
    }

    /// Sends each block as it comes; an error is sent on and ends the stream.
    async fn send_blocks(
        &self,
        blocks: impl Stream<Item = Result<Bytes, Status>>,
        tx: &mpsc::Sender<Result<Bytes, Status>>,
    ) -> Result<(), ()> {
        tokio::pin!(blocks);
        while let Some(block) = blocks.next().await {
            match block {
                Ok(data) => {
                    let len = data.len() as u64;
                    if tx.send(Ok(data)).await.is_err() {
                        return Err(());
                    }
                    self.counters.bytes_sent.fetch_add(len, Ordering::Relaxed);
                }
                Err(status) => {
                    let _ = tx.send(Err(status)).await;
                    return Err(());
                }
            }
        }
        Ok(())
    }

    /// The transfer's reader has every block: its pins go, the blocks stay as cache.
    fn release(&self, tid: &str) {
        let mut st = self.state();
        if let Some(inc) = st.incoming.remove(tid) {
            for key in &inc.pinned {
                st.store.unpin(*key);
            }
        }
    }

    /// Forwards an executor's export (a `Put` naming a destination) to the destination agent
    /// as it arrives, checking every chunk on the way; answers once the destination has all.
    async fn forward(
        &self,
        mut header: Header,
        frames: impl Stream<Item = Result<v1::BlockFrame, Status>> + Unpin,
        check: Option<Checksums>,
    ) -> Result<Receipt, Status> {
        let span = hop_span(&header, "kv_forward");
        // The destination's span goes under this one.
        header.traceparent = ferry_runtime::telemetry::hop_traceparent(span.as_ref());
        let result = self.forwarded(header, frames, check).await;
        end_hop(span, &result);
        result
    }

    async fn forwarded(
        &self,
        header: Header,
        mut frames: impl Stream<Item = Result<v1::BlockFrame, Status>> + Unpin,
        check: Option<Checksums>,
    ) -> Result<Receipt, Status> {
        let tid = header.transfer_id.clone();
        let destination =
            header.destination.clone().expect("forward is for puts with a destination");
        let (cancel_tx, mut cancelled) = watch::channel(false);
        {
            let mut st = self.state();
            if let Some(ended) = st.ended.get(&tid) {
                return Err(Status::failed_precondition(format!(
                    "transfer {tid} already ended: {}",
                    ended.why
                )));
            }
            st.outgoing.insert(tid.clone(), cancel_tx);
        }
        let deadline = deadline_of(header.deadline_unix_ms);
        let onward = Header { destination: None, ..header.clone() };
        let (tx, rx) = mpsc::channel(8);
        let push = crate::data::push(&destination, rx);
        let relay = async {
            tx.send(frames::header_frame(&onward)).await.map_err(|_| {
                (Failure::Peer, format!("transfer {tid}: the destination agent went away"))
            })?;
            let mut asm = check.map(|c| c.assembler(BlockAssembler::checking(&header)));
            while let Some(frame) = frames.next().await {
                let frame = frame.map_err(|s| stream_failure(&tid, &s))?;
                let len = frame_len(&frame);
                if let Some(asm) = &mut asm {
                    asm.push(frame.clone())
                        .map_err(|e| (Failure::of(&e), format!("transfer {tid}: {e}")))?;
                }
                tx.send(frame).await.map_err(|_| {
                    (Failure::Peer, format!("transfer {tid}: the destination agent went away"))
                })?;
                self.counters.bytes_sent.fetch_add(len, Ordering::Relaxed);
            }
            if let Some(asm) = &asm {
                asm.finish().map_err(|e| (Failure::of(&e), format!("transfer {tid}: {e}")))?;
            }
            drop(tx);
            Ok::<(), (Failure, String)>(())
        };
        let work = async {
            let (relayed, pushed) = tokio::join!(relay, push);
            // The destination's own account first: when it refused, the relay only saw it go.
            let pushed = pushed.map_err(|s| {
                let failure = match s.code() {
                    tonic::Code::DataLoss => Failure::Checksum,
                    tonic::Code::InvalidArgument => Failure::Malformed,
                    _ => Failure::Peer,
                };
                let why = format!(
                    "transfer {tid}: the destination agent {destination} refused it: {}",
                    s.message()
                );
                (failure, why)
            });
            match (relayed, pushed) {
                (Ok(()), Ok(receipt)) => Ok(receipt),
                // The relay found the stream bad: that is the cause, whatever followed.
                (Err(e), _) if e.0 != Failure::Peer => Err(e),
                (Err(e), Ok(_)) | (_, Err(e)) => Err(e),
            }
        };
        let outcome = tokio::select! {
            r = tokio::time::timeout_at(deadline, work) => match r {
                Ok(r) => r,
                Err(_) => Err((Failure::Deadline, format!("transfer {tid} passed its deadline while being pushed"))),
            },
            _ = cancelled.wait_for(|c| *c) => Err((Failure::Cancelled, format!("transfer {tid} was cancelled while being pushed"))),
        };
        match outcome {
            Ok(receipt) => {
                self.state().outgoing.remove(&tid);
                Ok(receipt)
            }
            Err((failure, why)) => Err(self.fail(&tid, failure, why)),
        }
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

/// Why a stream of frames failed, from the error its reader gave: a chunk whose checksum the
/// data channel's reader found wrong (`DATA_LOSS`), or the sender's failure.
fn stream_failure(tid: &str, s: &Status) -> (Failure, String) {
    match s.code() {
        tonic::Code::DataLoss => (Failure::Checksum, format!("transfer {tid}: {}", s.message())),
        code => {
            let failure =
                if code == tonic::Code::Aborted { Failure::Truncated } else { Failure::Peer };
            (failure, format!("transfer {tid}: the sender failed: {}", s.message()))
        }
    }
}

/// Whether a stream's chunk checksums are still to be checked where it is received.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checksums {
    /// Check every chunk's (a gRPC stream: prost decoded the bytes, nothing checked them).
    Check,
    /// Its reader verified each chunk's as the bytes arrived (the data channel, see
    /// [`crate::frames::Crc32c`]): only the other rules are checked.
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

fn frame_len(frame: &v1::BlockFrame) -> u64 {
    match &frame.frame {
        Some(v1::block_frame::Frame::Chunk(c)) => c.data.len() as u64,
        _ => 0,
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

#[cfg(test)]
mod tests {
    use super::Failure;

    #[test]
    fn a_failure_counts_at_its_place_in_the_list_of_reasons() {
        for (i, f) in Failure::ALL.iter().enumerate() {
            assert_eq!(*f as usize, i, "{f:?}");
        }
    }
}
