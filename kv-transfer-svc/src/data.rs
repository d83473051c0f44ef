//! The data channel: KV blocks as length-framed bytes on an agent's own port (a side channel of
//! its gRPC server, told apart by its first bytes), for agent-to-agent pushes and for an
//! executor's exports and imports through its local agent.
//!
//! Why not gRPC: on loopback a gRPC `Push` moved blocks at about a third of what a plain TCP
//! connection moves (HTTP/2 framing, protobuf messages, the copies between them); the data
//! channel reaches about 80 % (`ferry-bench kv`). It carries the same content — the same
//! header, the same chunks with their CRC32C — and the agent checks and stores it with the
//! same code as the gRPC calls, so the two differ only in framing. The gRPC `Put`, `Push` and
//! `Get` stay, for tools and tests.
//!
//! Wire format, all integers little-endian:
//! - [`MAGIC`], then one operation byte: [`Op::Push`], [`Op::Put`] or [`Op::Get`];
//! - `Push`/`Put`: the header (`u32` length, then a protobuf `TransferHeader`, at most
//!   [`MAX_MESSAGE_BYTES`]), then chunks in order: `u32` block index, `u64` offset, `u32` length,
//!   `u32` CRC32C, the bytes; the sender then closes its writing half and the agent answers:
//!   `u32` status code (0 for OK, else the gRPC code), `u32` length and the message, `u64`
//!   bytes received, `u32` blocks;
//! - `Get`: the request (`u32` length, then a protobuf `GetBlocksRequest`); the agent answers
//!   with records, each a tag byte then: `0` a chunk (as above), `1` the end (a status as
//!   above, without the receipt's fields);
//! - staged operations, between an executor and its own agent through the executor's
//!   shared-memory region ([`crate::shm`]); a region reference is a `u32` name length, the
//!   name, a `u32` count and that many `u64` slot offsets:
//!   - `PutStaged`: the header, a region reference without offsets, then per block, in
//!     order, as the executor fills it: its `u64` slot offset and the `u32` CRC32C of each of
//!     its chunks as [`crate::frames::chunks`] cuts it (the executor computes them right after
//!     copying the block in, while it is in cache); answered as `Put` is. A stream that ends
//!     early fails the transfer (reason `truncated`);
//!   - `GetStaged`: the request, then a region reference with one slot per block; the agent
//!     answers with a record per block as it is ready, in order, then the end record: `2`
//!     (`u32` block index) when it copied the block into its slot, or `3` (`u32` block index,
//!     `u64` offset, `u32` name length, the name) when the block is in a shared region of the
//!     agent's store ([`crate::buffers`]), for the executor to copy from there itself. The
//!     agent keeps every block it named so until the executor closes the connection;
//!   - `Probe`: a region reference; answered as `Put` is (OK if the agent can map it).

use std::io::IoSlice;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ferry_proto::v1::{self, block_frame::Frame};
use ferry_runtime::side_channel::{Conn as Accepted, ReadHalf, WriteHalf};
use ferry_runtime::tls;
use futures_util::StreamExt;
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tonic::Status;

use crate::agent::{Agent, Checksums};
use crate::buffers::BufferPool;
use crate::frames::MAX_CHUNK_BYTES;

/// A client's connection to an agent's data channel, buffered both ways.
type Conn = (BufReader<ReadHalf>, BufWriter<WriteHalf>);

/// The first bytes of a data-channel connection.
pub const MAGIC: &[u8; 8] = b"FERRYKV1";
/// Largest header or request accepted.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
/// Bytes of a chunk's head on the wire.
const CHUNK_HEAD: usize = 4 + 8 + 4 + 4;
/// Buffer for the small reads and writes (heads); chunk data bypasses it.
const BUFFER: usize = 64 << 10;
/// Longest status message on the wire.
const MAX_STATUS_MESSAGE: usize = 16 << 10;

/// Receive buffers of this process's reads from agents (an executor's imports).
static CLIENT_BUFFERS: std::sync::LazyLock<Arc<BufferPool>> =
    std::sync::LazyLock::new(|| BufferPool::new(256 << 20));

/// What a data-channel connection does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Agent to agent: store these blocks here for a transfer's reader.
    Push = 1,
    /// Executor to its agent: push these blocks on to the header's destination, or keep them
    /// in the store (KV tier) when it names none.
    Put = 2,
    /// Executor from its agent: read blocks (of a transfer, as they arrive, or from the store).
    Get = 3,
    /// Executor to its agent: a `Put` of blocks staged in shared memory ([`crate::shm`]).
    PutStaged = 4,
    /// Executor from its agent: a `Get` whose blocks the agent copies into shared memory.
    GetStaged = 5,
    /// Executor to its agent: can you map this staging region?
    Probe = 6,
}

/// Record tags of a `Get` answer.
const TAG_CHUNK: u8 = 0;
const TAG_END: u8 = 1;
/// A staged `Get`'s block landed in its slot (`u32` index follows).
const TAG_BLOCK: u8 = 2;
/// A staged `Get`'s block is in the agent's store, to be copied from there: `u32` index, `u64`
/// offset, then the region's name (`u32` length, the bytes).
const TAG_SHARED: u8 = 3;

/// The side channel for an agent's gRPC host.
pub fn side_channel(agent: Arc<Agent>) -> ferry_runtime::side_channel::SideChannel {
    ferry_runtime::side_channel::SideChannel {
        magic: MAGIC,
        handler: Arc::new(move |conn| {
            tokio::spawn(serve(agent.clone(), conn));
        }),
    }
}

fn io_status(e: &std::io::Error) -> Status {
    Status::unavailable(format!("data channel: {e}"))
}

/// Serves one data-channel connection.
pub async fn serve(agent: Arc<Agent>, conn: Accepted) {
    if let Accepted::Tcp(tcp) = &conn {
        let _ = tcp.set_nodelay(true);
    }
    let (read, write) = conn.into_split();
    let mut reader = BufReader::with_capacity(BUFFER, read);
    let mut magic = [0u8; 9];
    if reader.read_exact(&mut magic).await.is_err() || &magic[..8] != MAGIC {
        return;
    }
    match magic[8] {
        b if b == Op::Push as u8 || b == Op::Put as u8 => {
            let outcome = receive(&agent, b == Op::Put as u8, reader).await;
            let _ = answer(write, outcome).await;
        }
        b if b == Op::Get as u8 => {
            let _ = send(&agent, reader, write).await;
        }
        b if b == Op::PutStaged as u8 => {
            let outcome = receive_staged(&agent, reader).await;
            let _ = answer(write, outcome).await;
        }
        b if b == Op::GetStaged as u8 => {
            let mut w = BufWriter::new(write);
            let mut held = Vec::new();
            let outcome = send_staged(&agent, &mut reader, &mut w, &mut held).await;
            let _ = end(&mut w, &outcome).await;
            if !held.is_empty() {
                // The executor copies these blocks out of the store's regions until it closes
                // the connection (or its process ends): none is reused before.
                let _ = reader.read(&mut [0u8; 1]).await;
                drop(held);
            }
        }
        b if b == Op::Probe as u8 => {
            let outcome = read_region(&mut reader).await.and_then(|(name, _)| {
                agent.regions.get(&name).map_err(|e| Status::failed_precondition(e.to_string()))
            });
            let _ = answer(write, outcome.map(|_| v1::TransferReceipt::default())).await;
        }
        _ => {
            let bad =
                Status::invalid_argument(format!("data channel: unknown operation {}", magic[8]));
            let _ = answer(write, Err(bad)).await;
        }
    }
}

/// The frames of a block stream arriving on `reader` (its header first).
fn incoming(
    reader: BufReader<ReadHalf>,
    header: v1::TransferHeader,
    buffers: Arc<BufferPool>,
) -> impl futures_util::Stream<Item = Result<v1::BlockFrame, Status>> + Unpin {
    let header = v1::BlockFrame { frame: Some(Frame::Header(header)) };
    let chunks = futures_util::stream::unfold(Some(reader), move |reader| {
        let buffers = buffers.clone();
        async move {
            let mut reader = reader?;
            match read_chunk(&mut reader, &buffers).await {
                Ok(Some(chunk)) => {
                    Some((Ok(v1::BlockFrame { frame: Some(Frame::Chunk(chunk)) }), Some(reader)))
                }
                Ok(None) => None,
                Err(status) => Some((Err(status), None)),
            }
        }
    });
    Box::pin(futures_util::stream::once(async { Ok(header) }).chain(chunks))
}

async fn receive(
    agent: &Agent,
    put: bool,
    mut reader: BufReader<ReadHalf>,
) -> Result<v1::TransferReceipt, Status> {
    let header: v1::TransferHeader = read_message(&mut reader).await?;
    let frames = incoming(reader, header, agent.buffers.clone());
    if put {
        agent.put(frames, Checksums::Verified).await
    } else {
        agent.receive_push(frames, Checksums::Verified).await
    }
}

async fn send(
    agent: &Arc<Agent>,
    mut reader: BufReader<ReadHalf>,
    write: WriteHalf,
) -> std::io::Result<()> {
    let mut w = BufWriter::with_capacity(BUFFER, write);
    let request: Result<v1::GetBlocksRequest, Status> = read_message(&mut reader).await;
    let mut blocks = match request.and_then(|r| agent.read_blocks(r)) {
        Ok((_, blocks)) => blocks,
        Err(status) => return end(&mut w, &Err(status)).await,
    };
    let mut index = 0;
    while let Some(block) = blocks.recv().await {
        match block {
            Ok(data) => {
                for frame in crate::frames::chunks(index, &data) {
                    if let Some(Frame::Chunk(c)) = frame.frame {
                        write_chunk(&mut w, Some(TAG_CHUNK), &c).await?;
                    }
                }
            }
            Err(status) => return end(&mut w, &Err(status)).await,
        }
        index += 1;
    }
    end(&mut w, &Ok(())).await
}

async fn end<W: AsyncWrite + Unpin>(
    w: &mut W,
    outcome: &Result<(), Status>,
) -> std::io::Result<()> {
    w.write_u8(TAG_END).await?;
    write_status(w, outcome.as_ref().err()).await?;
    w.flush().await?;
    w.shutdown().await
}

async fn read_message<M: Message + Default, R: AsyncRead + Unpin>(r: &mut R) -> Result<M, Status> {
    let len =
        r.read_u32_le().await.map_err(|e| Status::invalid_argument(format!("data channel: {e}")))?
            as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(Status::invalid_argument(format!(
            "data channel message of {len} bytes; at most {MAX_MESSAGE_BYTES}"
        )));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)
        .await
        .map_err(|e| Status::invalid_argument(format!("data channel: {e}")))?;
    M::decode(buf.as_slice())
        .map_err(|e| Status::invalid_argument(format!("data channel message: {e}")))
}

async fn write_message<M: Message, W: AsyncWrite + Unpin>(w: &mut W, m: &M) -> std::io::Result<()> {
    let bytes = m.encode_to_vec();
    w.write_u32_le(bytes.len() as u32).await?;
    w.write_all(&bytes).await
}

/// The next chunk, or `None` at a clean end of stream (between chunks).
async fn read_chunk<R: AsyncRead + Unpin>(
    r: &mut R,
    buffers: &Arc<BufferPool>,
) -> Result<Option<v1::BlockChunk>, Status> {
    let mut head = [0u8; CHUNK_HEAD];
    let mut got = 0;
    while got < CHUNK_HEAD {
        let n = r.read(&mut head[got..]).await.map_err(|e| io_status(&e))?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(Status::unavailable(
                "data channel: the sender stopped inside a chunk head",
            ));
        }
        got += n;
    }
    let word = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().expect("4 bytes"));
    let block_index = word(0);
    let offset = u64::from_le_bytes(head[4..12].try_into().expect("8 bytes"));
    let len = word(12) as usize;
    let crc32c = word(16);
    if len > MAX_CHUNK_BYTES {
        return Err(Status::invalid_argument(format!(
            "chunk of {len} bytes for block {block_index}; chunks are at most {MAX_CHUNK_BYTES} bytes"
        )));
    }
    let mut data = buffers.take(len);
    let mut filled = 0;
    // Each piece is checked as it lands, while it is in cache (see `Crc32c`).
    let mut crc = crate::frames::Crc32c::default();
    while filled < len {
        match r.read(&mut data[filled..]).await.map_err(|e| io_status(&e))? {
            0 => {
                return Err(Status::unavailable(format!(
                    "data channel: the sender stopped after {filled} of {len} bytes of a chunk"
                )))
            }
            n => {
                crc.update(&data[filled..filled + n]);
                filled += n;
            }
        }
    }
    if crc.value() != crc32c {
        let e = crate::frames::FrameError::Checksum { block: block_index, offset };
        return Err(Status::data_loss(e.to_string()));
    }
    Ok(Some(v1::BlockChunk { block_index, offset, data: buffers.freeze(data), crc32c }))
}

/// Writes chunk `c` (after a record tag, if any) with one vectored write for its head and its
/// bytes: a head written alone would leave as a packet of its own (the socket sends at once)
/// and wake the receiver for 20 bytes.
async fn write_chunk<W: AsyncWrite + Unpin>(
    w: &mut W,
    tag: Option<u8>,
    c: &v1::BlockChunk,
) -> std::io::Result<()> {
    let mut buf = [0u8; 1 + CHUNK_HEAD];
    let at = usize::from(tag.is_some());
    buf[0] = tag.unwrap_or_default();
    let head = &mut buf[at..at + CHUNK_HEAD];
    head[0..4].copy_from_slice(&c.block_index.to_le_bytes());
    head[4..12].copy_from_slice(&c.offset.to_le_bytes());
    head[12..16].copy_from_slice(&(c.data.len() as u32).to_le_bytes());
    head[16..20].copy_from_slice(&c.crc32c.to_le_bytes());
    let (mut head, mut data) = (&buf[..at + CHUNK_HEAD], &c.data[..]);
    while !head.is_empty() {
        let n = w.write_vectored(&[IoSlice::new(head), IoSlice::new(data)]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        let of_head = n.min(head.len());
        head = &head[of_head..];
        data = &data[n - of_head..];
    }
    w.write_all(data).await
}

async fn write_status<W: AsyncWrite + Unpin>(
    w: &mut W,
    status: Option<&Status>,
) -> std::io::Result<()> {
    let (code, message) = status.map_or((0, ""), |s| (s.code() as u32, s.message()));
    let message = &message.as_bytes()[..message.len().min(MAX_STATUS_MESSAGE)];
    w.write_u32_le(code).await?;
    w.write_u32_le(message.len() as u32).await?;
    w.write_all(message).await
}

async fn read_status<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Result<(), Status>> {
    let code = r.read_u32_le().await?;
    let len = r.read_u32_le().await? as usize;
    if len > MAX_STATUS_MESSAGE {
        return Err(std::io::Error::other(format!("a status message of {len} bytes")));
    }
    let mut message = vec![0u8; len];
    r.read_exact(&mut message).await?;
    if code == 0 {
        return Ok(Ok(()));
    }
    let message = String::from_utf8_lossy(&message).into_owned();
    Ok(Err(Status::new(tonic::Code::from_i32(code as i32), message)))
}

/// The agent's answer to a `Put` or `Push` (see [`answer`]): its receipt, or its refusal.
async fn read_receipt<R: AsyncRead + Unpin>(
    r: &mut R,
    transfer_id: &str,
) -> std::io::Result<Result<v1::TransferReceipt, Status>> {
    let status = read_status(r).await?;
    let bytes = r.read_u64_le().await?;
    let blocks = r.read_u32_le().await?;
    Ok(status.map(|()| v1::TransferReceipt { transfer_id: transfer_id.to_string(), blocks, bytes }))
}

async fn answer(
    write: WriteHalf,
    outcome: Result<v1::TransferReceipt, Status>,
) -> std::io::Result<()> {
    let mut w = BufWriter::new(write);
    write_status(&mut w, outcome.as_ref().err()).await?;
    let receipt = outcome.unwrap_or_default();
    w.write_u64_le(receipt.bytes).await?;
    w.write_u32_le(receipt.blocks).await?;
    w.flush().await?;
    w.shutdown().await
}

async fn connect(address: &str, op: Op) -> Result<Conn, Status> {
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

/// Writes a staging region's name and the offsets of a transfer's slots in it.
async fn write_region<W: AsyncWrite + Unpin>(
    w: &mut W,
    name: &str,
    offsets: &[u64],
) -> std::io::Result<()> {
    write_name(w, name).await?;
    w.write_u32_le(offsets.len() as u32).await?;
    for o in offsets {
        w.write_u64_le(*o).await?;
    }
    Ok(())
}

/// Writes a shared region's name: `u32` length, then the bytes.
async fn write_name<W: AsyncWrite + Unpin>(w: &mut W, name: &str) -> std::io::Result<()> {
    w.write_u32_le(name.len() as u32).await?;
    w.write_all(name.as_bytes()).await
}

/// Reads a shared region's name as [`write_name`] wrote it: at most
/// [`crate::shm::MAX_NAME`] bytes of UTF-8.
async fn read_name<R: AsyncRead + Unpin>(r: &mut R) -> Result<String, Status> {
    let bad = |e: std::io::Error| Status::invalid_argument(format!("data channel: {e}"));
    let len = r.read_u32_le().await.map_err(bad)? as usize;
    if len > crate::shm::MAX_NAME {
        return Err(Status::invalid_argument(format!(
            "a shared region's name of {len} bytes; at most {}",
            crate::shm::MAX_NAME
        )));
    }
    let mut name = vec![0u8; len];
    r.read_exact(&mut name).await.map_err(bad)?;
    String::from_utf8(name)
        .map_err(|_| Status::invalid_argument("a shared region's name is not UTF-8"))
}

async fn read_region<R: AsyncRead + Unpin>(r: &mut R) -> Result<(String, Vec<u64>), Status> {
    let bad = |e: std::io::Error| Status::invalid_argument(format!("data channel: {e}"));
    let name = read_name(r).await?;
    let count = r.read_u32_le().await.map_err(bad)? as usize;
    if count > crate::frames::MAX_BLOCKS {
        return Err(Status::invalid_argument(format!(
            "{count} staged blocks; a transfer carries at most {}",
            crate::frames::MAX_BLOCKS
        )));
    }
    let mut offsets = Vec::with_capacity(count);
    for _ in 0..count {
        offsets.push(r.read_u64_le().await.map_err(bad)?);
    }
    Ok((name, offsets))
}

/// The region named on `reader` and its offsets, checked against `blocks` blocks of
/// `block_bytes` each.
async fn staged_region(
    agent: &Agent,
    reader: &mut BufReader<ReadHalf>,
    blocks: usize,
    block_bytes: usize,
) -> Result<(Arc<crate::shm::Region>, Vec<u64>), Status> {
    let (name, offsets) = read_region(reader).await?;
    if offsets.len() != blocks {
        return Err(Status::invalid_argument(format!(
            "{} staged slots for {blocks} blocks",
            offsets.len()
        )));
    }
    let region =
        agent.regions.get(&name).map_err(|e| Status::failed_precondition(e.to_string()))?;
    for &o in &offsets {
        region.check(o, block_bytes).map_err(|e| Status::invalid_argument(e.to_string()))?;
    }
    Ok((region, offsets))
}

/// A staged `Put`: the header, the region, then the offset of each block's slot and its
/// chunks' checksums as the executor fills it. An export is sent on from the slots themselves
/// (no copy) with the executor's checksums, which the destination checks; a KV-tier write is
/// copied into the store (the executor reuses its slots once answered), which checks them.
async fn receive_staged(
    agent: &Agent,
    mut reader: BufReader<ReadHalf>,
) -> Result<v1::TransferReceipt, Status> {
    let proto: v1::TransferHeader = read_message(&mut reader).await?;
    let header =
        crate::frames::read_header(v1::BlockFrame { frame: Some(Frame::Header(proto.clone())) })
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
    let (bb, n) = (header.layout.block_bytes, header.hashes.len());
    let (name, _) = read_region(&mut reader).await?;
    let region =
        agent.regions.get(&name).map_err(|e| Status::failed_precondition(e.to_string()))?;
    let forward = header.destination.is_some();
    let buffers = agent.buffers.clone();
    // Each block as its offset arrives; an executor that stops early ends the stream with an
    // error, so nothing incomplete is forwarded or stored.
    let blocks = futures_util::stream::unfold((reader, 0usize), move |(mut reader, i)| {
        let (region, buffers) = (region.clone(), buffers.clone());
        async move {
            if i == n {
                return None;
            }
            let (offset, crcs) = match read_staged_block(&mut reader, bb).await {
                Ok(read) => read,
                Err(e) => {
                    let why = format!("the executor stopped after staging {i} of {n} blocks: {e}");
                    return Some((vec![Err(Status::aborted(why))], (reader, n)));
                }
            };
            let data = match region.bytes(offset, bb) {
                Ok(data) if forward => data,
                Ok(data) => {
                    let mut copy = buffers.take(bb);
                    copy.copy_from_slice(&data);
                    buffers.freeze(copy)
                }
                Err(e) => {
                    return Some((vec![Err(Status::invalid_argument(e.to_string()))], (reader, n)))
                }
            };
            // With the executor's checksums: a forward passes them on for the destination to
            // check, a store checks them on the copy it just made (`Agent::put_staged`).
            let frames = crate::frames::chunks_with(i, &data, crcs).map(Ok).collect();
            Some((frames, (reader, i + 1)))
        }
    })
    .flat_map(futures_util::stream::iter);
    let first = v1::BlockFrame { frame: Some(Frame::Header(proto)) };
    let frames = futures_util::stream::once(async { Ok(first) }).chain(blocks);
    agent.put_staged(Box::pin(frames)).await
}

/// A staged block's slot offset and chunk checksums, as `PutStaged` sends them.
async fn read_staged_block(
    reader: &mut BufReader<ReadHalf>,
    block_bytes: usize,
) -> std::io::Result<(u64, Vec<u32>)> {
    let offset = reader.read_u64_le().await?;
    let count = block_bytes.div_ceil(crate::frames::CHUNK_BYTES);
    let mut crcs = Vec::with_capacity(count);
    for _ in 0..count {
        crcs.push(reader.read_u32_le().await?);
    }
    Ok((offset, crcs))
}

/// A staged `Get`: the request, then the region and the slots to fill. A block held in a
/// shared region of the agent's store is named for the executor to copy from there (and kept,
/// in `held`, until the connection closes); any other is copied into its slot. Each is
/// announced as it is ready; then the end record, after which the agent touches no slot.
async fn send_staged(
    agent: &Arc<Agent>,
    reader: &mut BufReader<ReadHalf>,
    w: &mut BufWriter<WriteHalf>,
    held: &mut Vec<bytes::Bytes>,
) -> Result<(), Status> {
    let request: v1::GetBlocksRequest = read_message(reader).await?;
    let bb = crate::layout::BlockLayout::from_proto(request.layout.as_ref())
        .map_err(|e| Status::invalid_argument(e.to_string()))?
        .block_bytes;
    let (region, offsets) = staged_region(agent, reader, request.block_hashes.len(), bb).await?;
    let (_, mut blocks) = agent.read_blocks(request)?;
    let mut next = offsets.iter().enumerate();
    let io = |e: std::io::Error| io_status(&e);
    while let Some(block) = blocks.recv().await {
        let data = block?;
        let Some((i, &at)) = next.next() else {
            return Err(Status::internal("the agent read more blocks than were asked for"));
        };
        // The reader may take each block as soon as it is announced.
        if let Some((store, offset)) = agent.buffers.locate(&data) {
            agent.counters.staged_reads_in_place.fetch_add(1, Ordering::Relaxed);
            held.push(data);
            w.write_u8(TAG_SHARED).await.map_err(io)?;
            w.write_u32_le(i as u32).await.map_err(io)?;
            w.write_u64_le(offset).await.map_err(io)?;
            write_name(w, store.name()).await.map_err(io)?;
        } else {
            region.write(at, &data).map_err(|e| Status::invalid_argument(e.to_string()))?;
            agent.counters.staged_reads_copied.fetch_add(1, Ordering::Relaxed);
            w.write_u8(TAG_BLOCK).await.map_err(io)?;
            w.write_u32_le(i as u32).await.map_err(io)?;
        }
        w.flush().await.map_err(io)?;
    }
    if next.next().is_some() {
        return Err(Status::internal("the read ended before every block was here"));
    }
    Ok(())
}

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
async fn open_staged<M: Message>(
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;

    use super::*;
    use crate::frames::tests::layout;
    use crate::shm::{Place, Staging};

    /// An agent in this process serving its data channel on a port of its own, with a shared
    /// memory directory of its own (removed on drop) and a store of four test blocks.
    struct Node {
        dir: std::path::PathBuf,
        agent: Arc<Agent>,
        addr: String,
    }

    impl Node {
        async fn start(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let agent = Agent::new("node".into(), 4 * block_bytes(), dir.clone());
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let serving = agent.clone();
            tokio::spawn(async move {
                while let Ok((conn, _)) = listener.accept().await {
                    tokio::spawn(serve(serving.clone(), Accepted::Tcp(conn)));
                }
            });
            Self { dir, agent, addr }
        }
    }

    impl Drop for Node {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// The header of a KV-tier write of `hashes`.
    fn tier_write(tid: &str, hashes: Vec<u64>) -> v1::TransferHeader {
        v1::TransferHeader {
            transfer_id: tid.into(),
            layout: Some(layout()),
            block_hashes: hashes,
            destination_agent: String::new(),
            deadline_unix_ms: ferry_runtime::clock::unix_deadline(Duration::from_secs(30)),
            traceparent: String::new(),
        }
    }

    /// The frames of a KV-tier write of `data` under `hashes`.
    fn tier_frames(tid: &str, hashes: &[u64], data: &[Bytes]) -> Vec<v1::BlockFrame> {
        let header =
            v1::BlockFrame { frame: Some(Frame::Header(tier_write(tid, hashes.to_vec()))) };
        let chunks = data.iter().enumerate().flat_map(|(i, d)| crate::frames::chunks(i, d));
        std::iter::once(header).chain(chunks).collect()
    }

    /// Puts `frames` to the agent at `addr` over the data channel.
    async fn put(addr: &str, frames: Vec<v1::BlockFrame>) -> Result<v1::TransferReceipt, Status> {
        let (tx, rx) = mpsc::channel(frames.len());
        for frame in frames {
            tx.send(frame).await.unwrap();
        }
        drop(tx);
        send_blocks(addr, Op::Put, rx).await
    }

    /// Keeps `data` in the store of the agent at `addr` under `hashes` (a KV-tier put).
    async fn store(addr: &str, hashes: &[u64], data: &[Bytes]) {
        put(addr, tier_frames(&format!("put-{}", hashes[0]), hashes, data)).await.unwrap();
    }

    fn block_bytes() -> usize {
        crate::layout::BlockLayout::from_proto(Some(&layout())).unwrap().block_bytes
    }

    /// A read of `hashes` from the store.
    fn tier_read(hashes: Vec<u64>) -> v1::GetBlocksRequest {
        v1::GetBlocksRequest {
            transfer_id: String::new(),
            layout: Some(layout()),
            block_hashes: hashes,
            deadline_unix_ms: ferry_runtime::clock::unix_deadline(Duration::from_secs(30)),
            traceparent: String::new(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_chunk_whose_bytes_do_not_match_its_checksum_is_refused_as_data_loss() {
        let (node, bb) = (Node::start("ferry-data-crc").await, block_bytes());
        let block = Bytes::from(vec![3u8; bb]);
        let mut frames = tier_frames("bad", &[1, 2], &[block.clone(), block]);
        // One bit of the second block flipped after its checksum was taken.
        let Some(Frame::Chunk(c)) = &mut frames.last_mut().unwrap().frame else { panic!() };
        let mut data = c.data.to_vec();
        data[bb / 2] ^= 1;
        c.data = data.into();
        let refused = put(&node.addr, frames).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::DataLoss, "{refused:?}");
        assert!(refused.message().contains("CRC32C mismatch in block 1"), "{refused:?}");
        let (_, mut blocks) = node.agent.read_blocks(tier_read(vec![1])).unwrap();
        let first = blocks.recv().await.unwrap().unwrap();
        assert_eq!(&first[..], &vec![3u8; bb][..], "the block before it was stored");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_staged_block_whose_checksum_the_executor_got_wrong_is_not_stored() {
        let (node, bb) = (Node::start("ferry-data-staged-crc").await, block_bytes());
        let staging = Staging::create(&node.dir, bb, 2).unwrap();
        let (mut filler, slots, _) = crate::shm::filling(staging.alloc(2).unwrap());
        for b in [5u8, 6] {
            filler
                .fill(|buf| {
                    buf.fill(b);
                    Ok::<(), ()>(())
                })
                .unwrap();
        }
        // As `put_staged` sends them, but with the second block's checksum off by one.
        let header = tier_write("staged-bad", vec![1, 2]);
        let (mut r, mut w) =
            open_staged(&node.addr, Op::PutStaged, &header, &slots, &[]).await.unwrap();
        for (i, offset) in slots.offsets().into_iter().enumerate() {
            let crc = crate::frames::crc32c(slots.block(i)) + u32::from(i == 1);
            w.write_u64_le(offset).await.unwrap();
            w.write_u32_le(crc).await.unwrap();
        }
        w.flush().await.unwrap();
        let refused = read_receipt(&mut r, "staged-bad").await.unwrap().unwrap_err();
        assert_eq!(refused.code(), tonic::Code::DataLoss, "{refused:?}");
        assert!(refused.message().contains("CRC32C mismatch in block 1"), "{refused:?}");
        let (_, mut blocks) = node.agent.read_blocks(tier_read(vec![1])).unwrap();
        assert_eq!(&blocks.recv().await.unwrap().unwrap()[..], &vec![5u8; bb][..]);
        let absent = node.agent.read_blocks(tier_read(vec![2])).unwrap_err();
        assert_eq!(absent.code(), tonic::Code::NotFound, "block 2 was not stored: {absent:?}");
        drop((filler, slots, staging));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stored_block_read_in_place_is_not_reused_until_the_reader_lets_go() {
        // A store of four blocks: its shared region has four slots.
        let (node, bb) = (Node::start("ferry-data-test").await, block_bytes());
        let (agent, addr, dir) = (&node.agent, &node.addr, &node.dir);
        let data: Vec<Bytes> = (1..=3u8).map(|b| Bytes::from(vec![b; bb])).collect();
        store(addr, &[1, 2, 3], &data).await;
        assert_eq!(agent.buffers.shared_free(bb), Some(1), "received blocks are in shared memory");

        let staging = Staging::create(dir, bb, 3).unwrap();
        probe(addr, staging.name()).await.unwrap();
        let slots = Arc::new(staging.alloc(3).unwrap());
        let (landed_tx, landed) = tokio::sync::watch::channel(Vec::new());
        let (release, released) = tokio::sync::oneshot::channel();
        let req = tier_read(vec![1, 2, 3]);
        get_staged(addr, req.clone(), slots.clone(), landed_tx, released).await.unwrap();
        let places = landed.borrow().clone();
        assert_eq!(places.len(), 3);
        for (i, place) in places.iter().enumerate() {
            assert!(matches!(place, Place::Store { .. }), "block {i} is read from the store");
            assert_eq!(place.bytes(&slots, i).unwrap(), &data[i][..], "block {i}");
        }

        // Four new blocks evict the three from the store, but not from their slots: the new
        // ones take the one free slot, then the heap.
        let other: Vec<Bytes> = (7..=10u8).map(|b| Bytes::from(vec![b; bb])).collect();
        store(addr, &[4, 5, 6, 7], &other).await;
        assert_eq!(agent.buffers.shared_free(bb), Some(0));
        for (i, place) in places.iter().enumerate() {
            assert_eq!(place.bytes(&slots, i).unwrap(), &data[i][..], "block {i} unchanged");
        }

        // A block the store holds on the heap is copied into the reader's slot instead.
        let second = Staging::create(dir, bb, 4).unwrap();
        let more = Arc::new(second.alloc(4).unwrap());
        let (landed_tx, landed2) = tokio::sync::watch::channel(Vec::new());
        let (release2, released) = tokio::sync::oneshot::channel();
        let req = v1::GetBlocksRequest { block_hashes: vec![4, 5, 6, 7], ..req.clone() };
        probe(addr, more.staging().name()).await.unwrap();
        get_staged(addr, req, more.clone(), landed_tx, released).await.unwrap();
        let kinds: Vec<bool> =
            landed2.borrow().iter().map(|p| matches!(p, Place::Store { .. })).collect();
        assert_eq!(kinds, [true, false, false, false], "the one shared slot, then the heap");
        for (i, place) in landed2.borrow().iter().enumerate() {
            assert_eq!(place.bytes(&more, i).unwrap(), &other[i][..], "block {}", i + 4);
        }
        drop((release2, more, second));

        // Let go: the agent gets its three slots back once the connection closes.
        drop(release);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while agent.buffers.shared_free(bb) != Some(3) {
            assert!(std::time::Instant::now() < deadline, "the held slots came back");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(staging.free_slots(), 0, "the reader's slots are its own until it drops them");
        drop(slots);
    }
}
