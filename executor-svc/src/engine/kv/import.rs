//! Imports: blocks read from an agent and written into the pool — staged when they come from
//! the local agent and slots are free (each block written at the first step after it lands,
//! from its slot or straight from the agent's store), else read through the socket and
//! written once all are here. An import is reported done only after every block was written.

use std::sync::Arc;

use bytes::Bytes;
use ferry_kv_wire::data_channel;
use ferry_kv_wire::layout::BlockLayout;
use ferry_kv_wire::shm::{Place, Slots};
use ferry_proto::v1;
use ferry_runtime::telemetry;

use super::transfer::{by, end_span, op_span, Done, Failed};
use super::{KvOps, KvPort, ModelBackend};

/// A staged import's blocks as they land (in their slots, or in the agent's store).
pub(super) struct Landing {
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
    pub(super) fn write_landed(
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
    pub(super) fn write_all(
        &mut self,
        blocks: &[u32],
        backend: &mut dyn ModelBackend,
    ) -> Result<u64, Failed> {
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
pub(super) fn write_all(
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

impl KvOps {
    /// Starts an import: staged when the blocks come from the local agent (the region is
    /// shared with it only) and slots are free, each block then written into the pool at the
    /// first step after it lands; else read through the socket, written when all are here.
    pub(super) fn start_import(
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
                        data_channel::get_staged(&agent, request, slots, landed, released)
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
}

/// Reads the `n` blocks of `request` from the agent at `agent`, each `block_bytes` long, checked.
async fn import(
    agent: &str,
    request: &v1::GetBlocksRequest,
    n: usize,
    block_bytes: usize,
) -> Result<Vec<Bytes>, Failed> {
    let malformed = |m: String| Failed::new(v1::KvFailure::Malformed, m);
    // `data_channel::get` checks each chunk's CRC32C as its bytes arrive: a mismatch comes as
    // DATA_LOSS, reported as a checksum failure.
    let mut chunks =
        data_channel::get(agent, request).await.map_err(|s| Failed::of_status("import", &s))?;
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
