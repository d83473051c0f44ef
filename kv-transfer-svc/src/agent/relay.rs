//! The relay: an executor's export (a `Put` naming a destination) pushed on to the
//! destination agent over the data channel as it arrives, each chunk checked on the way (or
//! passed on unchecked when the executor's own checksums travel with it, for the destination
//! to check); answered once the destination has every block.

use std::sync::atomic::Ordering;

use ferry_kv_wire::data_channel;
use ferry_kv_wire::frames::{self, BlockAssembler, Header};
use ferry_proto::v1;
use tokio::sync::{mpsc, watch};
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use super::failure::{stream_failure, Failure};
use super::{deadline_of, end_hop, hop_span, Agent, Checksums, Receipt};

impl Agent {
    /// Forwards an executor's export (a `Put` naming a destination) to the destination agent
    /// as it arrives, checking every chunk on the way; answers once the destination has all.
    pub(super) async fn forward(
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
        let push = data_channel::push(&destination, rx);
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
}

fn frame_len(frame: &v1::BlockFrame) -> u64 {
    match &frame.frame {
        Some(v1::block_frame::Frame::Chunk(c)) => c.data.len() as u64,
        _ => 0,
    }
}
