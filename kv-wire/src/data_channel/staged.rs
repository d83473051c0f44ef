//! The data channel's client through shared memory ([`crate::shm`]): an export whose blocks
//! the agent sends on from the executor's slots ([`put_staged`]), an import whose blocks the
//! agent copies into them or leaves in its store for the executor to copy ([`get_staged`]), and
//! the probe that tells whether the agent maps the executor's region at all ([`probe`]).
//!
//! Invariant: a transfer's slots are dropped only after the agent answered or closed the
//! connection, even when the caller stopped waiting, so the agent never reads or writes a slot
//! that another transfer reuses.

use std::sync::Arc;

use ferry_proto::v1;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Status;

use super::client::connect;
use super::framing::{read_name, read_receipt, read_status, write_message, write_region};
use super::{Conn, Op, TAG_BLOCK, TAG_END, TAG_SHARED};

/// A connection over which the agent holds blocks of its store for this process to read,
/// kept until `release` fires or is dropped.
struct Held {
    conn: Conn,
    release: tokio::sync::oneshot::Receiver<()>,
}

/// Runs `work` on its own task, which keeps `slots` until the agent answered or closed the
/// connection, so a caller that stops waiting (a deadline) never frees slots the agent may
/// still read or write; the caller gets the outcome if it still waits. What `work` leaves
/// [`Held`] is kept, with the slots, until it is released.
async fn with_slots<T: Send + 'static>(
    slots: Arc<crate::shm::Slots>,
    work: impl std::future::Future<Output = (Result<T, Status>, Option<Held>)> + Send + 'static,
) -> Result<T, Status> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (outcome, held) = work.await;
        match held {
            None => {
                drop(slots);
                let _ = tx.send(outcome);
            }
            Some(Held { conn, release }) => {
                let _ = tx.send(outcome);
                let _ = release.await;
                drop((conn, slots));
            }
        }
    });
    rx.await.unwrap_or_else(|_| Err(Status::internal("the staged transfer's task ended")))
}

/// Connects for staged `op` and sends its message and the region with `offsets`.
pub async fn open_staged<M: Message>(
    address: &str,
    op: Op,
    message: &M,
    slots: &crate::shm::Slots,
    offsets: &[u64],
) -> Result<Conn, Status> {
    let (r, mut w) = connect(address, op).await?;
    let unreachable = |e: std::io::Error| Status::unavailable(format!("agent {address}: {e}"));
    write_message(&mut w, message).await.map_err(unreachable)?;
    write_region(&mut w, slots.staging().name(), offsets).await.map_err(unreachable)?;
    w.flush().await.map_err(unreachable)?;
    Ok((r, w))
}

/// Exports the blocks staged in `slots` (the header's blocks, in order) through the agent at
/// `address`, each (with the checksums its filler computed) as soon as `filled` says it is
/// staged: the agent sends them on to the
/// header's destination, or stores them when it names none. The agent's receipt, or its
/// refusal; the transfer fails if the filler goes before filling every slot.
pub async fn put_staged(
    address: &str,
    header: v1::TransferHeader,
    slots: Arc<crate::shm::Slots>,
    mut filled: crate::shm::Filled,
) -> Result<v1::TransferReceipt, Status> {
    let address = address.to_string();
    let keep = slots.clone();
    let put = async move {
        let unreachable = |e: std::io::Error| Status::unavailable(format!("agent {address}: {e}"));
        let (mut r, mut w) = open_staged(&address, Op::PutStaged, &header, &slots, &[]).await?;
        let offsets = slots.offsets();
        let mut sent = 0;
        while sent < offsets.len() {
            let ready: Vec<Vec<u32>> = filled.borrow_and_update()[sent..].to_vec();
            for (o, crcs) in offsets[sent..].iter().zip(&ready) {
                w.write_u64_le(*o).await.map_err(unreachable)?;
                for crc in crcs {
                    w.write_u32_le(*crc).await.map_err(unreachable)?;
                }
            }
            w.flush().await.map_err(unreachable)?;
            sent += ready.len();
            if sent < offsets.len() && filled.changed().await.is_err() {
                break; // the filler went early
            }
        }
        if sent < offsets.len() {
            // Ending the stream early ends the transfer at the agent; its answer says it no
            // longer reads the slots it was given.
            let _ = w.shutdown().await;
            let _ = read_status(&mut r).await;
            return Err(Status::aborted(format!(
                "the executor stopped after staging {sent} of {} blocks",
                offsets.len()
            )));
        }
        let _keep_open = w;
        read_receipt(&mut r, &header.transfer_id).await.map_err(unreachable)?
    };
    with_slots(keep, async move { (put.await, None) }).await
}

/// Reads the blocks `req` asks for from the agent at `address`: each is copied into its slot
/// of `slots` (one per block, in order), or left in the agent's store for the reader to copy
/// from there. `landed` lists where each block is as it lands, so the reader can take them
/// before the last arrives. The slots, and the agent's hold on the stored blocks (the
/// connection), are kept on a task of their own until the agent answered and `release` fires
/// or is dropped: drop it only once done reading every block `landed` listed.
pub async fn get_staged(
    address: &str,
    req: v1::GetBlocksRequest,
    slots: Arc<crate::shm::Slots>,
    landed: tokio::sync::watch::Sender<Vec<crate::shm::Place>>,
    release: tokio::sync::oneshot::Receiver<()>,
) -> Result<(), Status> {
    let address = address.to_string();
    let keep = slots.clone();
    with_slots(keep, async move {
        let mut conn = None;
        let outcome = read_staged(&address, &req, &slots, &landed, &mut conn).await;
        // Whatever the outcome: the reader may be copying the blocks that landed so far.
        let holds = landed.borrow().iter().any(|p| matches!(p, crate::shm::Place::Store { .. }));
        (outcome, conn.filter(|_| holds).map(|conn| Held { conn, release }))
    })
    .await
}

/// The records of a staged read, until its end; the connection is left in `conn`.
async fn read_staged(
    address: &str,
    req: &v1::GetBlocksRequest,
    slots: &crate::shm::Slots,
    landed: &tokio::sync::watch::Sender<Vec<crate::shm::Place>>,
    conn: &mut Option<Conn>,
) -> Result<(), Status> {
    let unreachable = |e: std::io::Error| Status::unavailable(format!("agent {address}: {e}"));
    let (r, _) =
        conn.insert(open_staged(address, Op::GetStaged, req, slots, &slots.offsets()).await?);
    loop {
        let tag = r.read_u8().await.map_err(unreachable)?;
        if tag == TAG_END {
            break;
        }
        if tag != TAG_BLOCK && tag != TAG_SHARED {
            return Err(Status::unavailable(format!("agent {address}: unknown record {tag}")));
        }
        let i = r.read_u32_le().await.map_err(unreachable)? as usize;
        if i != landed.borrow().len() || i >= slots.len() {
            return Err(Status::internal(format!(
                "agent {address}: block {i} landed out of order"
            )));
        }
        let place = if tag == TAG_SHARED {
            let offset = r.read_u64_le().await.map_err(unreachable)?;
            let name = read_name(r).await.map_err(|s| {
                Status::internal(format!("agent {address}: block {i}: {}", s.message()))
            })?;
            let bad = |e: crate::shm::RegionError| {
                Status::internal(format!("agent {address}: its store's block {i}: {e}"))
            };
            let region = slots.staging().peers().get(&name).map_err(bad)?;
            region.check(offset, slots.staging().block_bytes()).map_err(bad)?;
            crate::shm::Place::Store { region, offset }
        } else {
            crate::shm::Place::Slot
        };
        landed.send_modify(|places| places.push(place));
    }
    read_status(r).await.map_err(unreachable)??;
    if landed.borrow().len() != slots.len() {
        return Err(Status::internal(format!("agent {address}: the read ended early")));
    }
    Ok(())
}

/// Whether the agent at `address` can map staging region `name` (it shares the directory).
pub async fn probe(address: &str, name: &str) -> Result<(), Status> {
    let (mut r, mut w) = connect(address, Op::Probe).await?;
    let unreachable = |e: std::io::Error| Status::unavailable(format!("agent {address}: {e}"));
    write_region(&mut w, name, &[]).await.map_err(unreachable)?;
    w.flush().await.map_err(unreachable)?;
    read_status(&mut r).await.map_err(unreachable)?
}
