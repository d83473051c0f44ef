//! The receiving path: a push arriving from another node's agent (its blocks stored pinned as
//! they arrive, so a reader can start before the last one, until the transfer's reader has
//! them) and an executor's `Put` (forwarded when its header names a destination, else stored
//! here unpinned, as the KV tier's cache). Every chunk is checked before its block is stored.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use ferry_kv_wire::frames::{BlockAssembler, Header};
use ferry_proto::v1;
use tokio::time::Instant;
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use super::failure::{stream_failure, Failure};
use super::{deadline_of, end_hop, first_header, hop_span, Agent, Checksums, Incoming, Receipt};
use crate::store::{BlockKey, Inserted};

impl Agent {
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

    /// A `Put` of an executor's staged blocks ([`ferry_kv_wire::shm`]) with the checksums the executor
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
}
