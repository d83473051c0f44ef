//! Exports (and KV-tier stores): a request's full blocks copied out of the pool in the step
//! that starts the operation and put to the node's agent — staged, the transfer starts first
//! and the agent sends each block on as soon as it is copied into its slot (or names the pool's
//! own blocks when the pool is in the shared region); else all are copied out, then sent over
//! the agent's socket.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use ferry_kv_wire::data_channel::{self, Op};
use ferry_kv_wire::frames::{self, Header};
use ferry_kv_wire::layout::BlockLayout;
use ferry_kv_wire::shm;
use ferry_proto::v1;
use ferry_runtime::telemetry;

use super::transfer::{by, end_span, op_span, Done, Failed};
use super::{KvOps, KvPort, ModelBackend};

impl KvOps {
    /// Starts an export (or a KV-tier store) of blocks `ids`: staged, its transfer starts first
    /// and sends each block as soon as it is copied out; else all are copied out, then sent.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_outgoing(
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
                let sent = data_channel::put_staged(&agent, header.to_proto(), slots, filled);
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
    let ((), sent) = tokio::join!(feed, data_channel::send_blocks(agent, Op::Put, rx));
    let receipt = sent.map_err(|s| Failed::of_status("export", &s))?;
    Ok(receipt.bytes)
}
