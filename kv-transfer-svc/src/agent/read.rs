//! The reading path: blocks handed to a reader whole, in order — a transfer's as each arrives
//! (waiting for a push still arriving, until the deadline; the transfer's pins go once all are
//! sent), or a KV-tier read's from the store, all present now.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use ferry_kv_wire::frames::{self, Header};
use ferry_kv_wire::layout::BlockLayout;
use ferry_proto::v1;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use super::{deadline_of, end_hop, hop_span, Agent, BlockStream, FrameStream};
use crate::store::BlockKey;

impl Agent {
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
}
