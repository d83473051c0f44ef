//! The data channel's client over the socket: connecting to an agent (TLS under mutual TLS),
//! sending a block stream to it (an executor's `Put`, an agent's `Push` to another), and
//! reading blocks from it (`Get`), each chunk checked as it lands.

use std::sync::Arc;

use ferry_proto::v1::{self, block_frame::Frame};
use ferry_runtime::tls;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tonic::Status;

use super::framing::{read_chunk, read_receipt, read_status, write_chunk, write_message};
use super::{Conn, Op, BUFFER, MAGIC, TAG_CHUNK, TAG_END};
use crate::buffers::BufferPool;

/// Receive buffers of this process's reads from agents (an executor's imports).
static CLIENT_BUFFERS: std::sync::LazyLock<Arc<BufferPool>> =
    std::sync::LazyLock::new(|| BufferPool::new(256 << 20));

/// Connects to the agent at `address` (`host:port` or a URL) for `op`: the magic and the
/// operation byte are written (not yet flushed).
pub(super) async fn connect(address: &str, op: Op) -> Result<Conn, Status> {
    let hostport =
        address.split_once("://").map_or(address, |(_, rest)| rest).trim_end_matches('/');
    let unreachable = |e: std::io::Error| Status::unavailable(format!("agent {address}: {e}"));
    // Under mutual TLS the data channel is TLS too, told apart from gRPC by its ALPN; the
    // server checks this process's role, this side that it reached an agent.
    let (read, write) = if let Some(tls) = tls::current() {
        // Boxed: a TLS handshake's state would swell every transfer's future.
        let handshake = Box::pin(tls.connect(hostport, tls::Role::KvAgent, tls::Protocol::Data));
        let conn = handshake.await.map_err(unreachable)?;
        ferry_runtime::side_channel::halves(conn)
    } else {
        let conn = TcpStream::connect(hostport).await.map_err(unreachable)?;
        conn.set_nodelay(true).map_err(unreachable)?;
        ferry_runtime::side_channel::tcp_halves(conn)
    };
    let mut w = BufWriter::with_capacity(BUFFER, write);
    w.write_all(MAGIC).await.map_err(unreachable)?;
    w.write_u8(op as u8).await.map_err(unreachable)?;
    Ok((BufReader::with_capacity(BUFFER, read), w))
}

/// Sends the frames arriving on `frames` (a header, then chunks) to the agent at `address` as
/// `op` ([`Op::Push`] agent to agent, [`Op::Put`] from an executor); the agent's receipt, or
/// its refusal.
pub async fn send_blocks(
    address: &str,
    op: Op,
    mut frames: mpsc::Receiver<v1::BlockFrame>,
) -> Result<v1::TransferReceipt, Status> {
    let (mut r, mut w) = connect(address, op).await?;
    let unreachable = |e: std::io::Error| Status::unavailable(format!("agent {address}: {e}"));
    let Some(v1::BlockFrame { frame: Some(Frame::Header(header)) }) = frames.recv().await else {
        return Err(Status::invalid_argument("a block stream starts with its header"));
    };
    write_message(&mut w, &header).await.map_err(unreachable)?;
    let mut write_failed = None;
    while let Some(frame) = frames.recv().await {
        let Some(Frame::Chunk(c)) = frame.frame else {
            return Err(Status::invalid_argument("a block stream has one header, first"));
        };
        if let Err(e) = write_chunk(&mut w, None, &c).await {
            // The agent stopped reading (it refused the stream): its answer says why.
            write_failed = Some(e);
            break;
        }
    }
    if write_failed.is_none() {
        w.flush().await.map_err(unreachable)?;
        w.shutdown().await.map_err(unreachable)?;
    }
    read_receipt(&mut r, &header.transfer_id).await.map_err(|e| match write_failed {
        Some(first) => Status::unavailable(format!("agent {address}: {first} ({e})")),
        None => Status::unavailable(format!("agent {address}: no answer: {e}")),
    })?
}

/// Pushes the frames arriving on `frames` to the agent at `address` (agent to agent).
pub async fn push(
    address: &str,
    frames: mpsc::Receiver<v1::BlockFrame>,
) -> Result<v1::TransferReceipt, Status> {
    send_blocks(address, Op::Push, frames).await
}

/// Reads the blocks `req` asks for from the agent at `address`: their chunks, in order, as
/// they come, each one's CRC32C checked (a mismatch is a `DATA_LOSS` error); the last item is
/// an error if the read failed.
pub async fn get(
    address: &str,
    req: &v1::GetBlocksRequest,
) -> Result<mpsc::Receiver<Result<v1::BlockChunk, Status>>, Status> {
    let (mut r, mut w) = connect(address, Op::Get).await?;
    let unreachable = |e: std::io::Error| Status::unavailable(format!("agent {address}: {e}"));
    write_message(&mut w, req).await.map_err(unreachable)?;
    w.flush().await.map_err(unreachable)?;
    let (tx, rx) = mpsc::channel(4);
    let address = address.to_string();
    tokio::spawn(async move {
        let _keep_open = w;
        loop {
            let item = match r.read_u8().await {
                Ok(TAG_CHUNK) => match read_chunk(&mut r, &CLIENT_BUFFERS).await {
                    Ok(Some(c)) => Ok(c),
                    Ok(None) => Err(Status::unavailable(format!(
                        "agent {address}: the read ended without its end record"
                    ))),
                    Err(s) => Err(s),
                },
                Ok(TAG_END) => match read_status(&mut r).await {
                    Ok(Ok(())) => return,
                    Ok(Err(s)) => Err(s),
                    Err(e) => Err(Status::unavailable(format!("agent {address}: {e}"))),
                },
                Ok(tag) => {
                    Err(Status::unavailable(format!("agent {address}: unknown record {tag}")))
                }
                Err(e) => Err(Status::unavailable(format!("agent {address}: {e}"))),
            };
            let last = item.is_err();
            if tx.send(item).await.is_err() || last {
                return;
            }
        }
    });
    Ok(rx)
}
