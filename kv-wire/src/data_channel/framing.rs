//! The data channel's pieces, read and written: length-framed messages, chunks (their bytes
//! checked against their CRC32C as they land), statuses and receipts, region references, and
//! the records of a `Get` and a staged `Get` answer. Both sides build on these, so a piece's
//! layout is written once (the format is in the [parent module's](super) head).

use std::io::IoSlice;
use std::sync::Arc;

use ferry_proto::v1;
use ferry_runtime::side_channel::{ReadHalf, WriteHalf};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tonic::Status;

use super::{CHUNK_HEAD, MAX_MESSAGE_BYTES, MAX_STATUS_MESSAGE, TAG_BLOCK, TAG_END, TAG_SHARED};
use crate::buffers::BufferPool;
use crate::frames::MAX_CHUNK_BYTES;

/// A data-channel I/O error as the status a transfer fails with.
pub fn io_status(e: &std::io::Error) -> Status {
    Status::unavailable(format!("data channel: {e}"))
}

/// Ends a `Get` answer: the end record with `outcome`, then the connection's writing half.
pub async fn end<W: AsyncWrite + Unpin>(
    w: &mut W,
    outcome: &Result<(), Status>,
) -> std::io::Result<()> {
    w.write_u8(TAG_END).await?;
    write_status(w, outcome.as_ref().err()).await?;
    w.flush().await?;
    w.shutdown().await
}

/// Reads a length-framed protobuf message (at most [`MAX_MESSAGE_BYTES`]).
pub async fn read_message<M: Message + Default, R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<M, Status> {
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

/// Writes `m` length-framed, as [`read_message`] reads it.
pub(crate) async fn write_message<M: Message, W: AsyncWrite + Unpin>(
    w: &mut W,
    m: &M,
) -> std::io::Result<()> {
    let bytes = m.encode_to_vec();
    w.write_u32_le(bytes.len() as u32).await?;
    w.write_all(&bytes).await
}

/// The next chunk, or `None` at a clean end of stream (between chunks).
pub async fn read_chunk<R: AsyncRead + Unpin>(
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
pub async fn write_chunk<W: AsyncWrite + Unpin>(
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

/// Writes a status: `u32` code (0: OK), `u32` length and the message, cut to
/// [`MAX_STATUS_MESSAGE`] bytes.
pub(crate) async fn write_status<W: AsyncWrite + Unpin>(
    w: &mut W,
    status: Option<&Status>,
) -> std::io::Result<()> {
    let (code, message) = status.map_or((0, ""), |s| (s.code() as u32, s.message()));
    let message = &message.as_bytes()[..message.len().min(MAX_STATUS_MESSAGE)];
    w.write_u32_le(code).await?;
    w.write_u32_le(message.len() as u32).await?;
    w.write_all(message).await
}

/// Reads a status as [`write_status`] wrote it; an I/O error if the connection broke.
pub(crate) async fn read_status<R: AsyncRead + Unpin>(
    r: &mut R,
) -> std::io::Result<Result<(), Status>> {
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
pub async fn read_receipt<R: AsyncRead + Unpin>(
    r: &mut R,
    transfer_id: &str,
) -> std::io::Result<Result<v1::TransferReceipt, Status>> {
    let status = read_status(r).await?;
    let bytes = r.read_u64_le().await?;
    let blocks = r.read_u32_le().await?;
    Ok(status.map(|()| v1::TransferReceipt { transfer_id: transfer_id.to_string(), blocks, bytes }))
}

/// Answers a `Put`, `Push` or `Probe` with `outcome`, as [`read_receipt`] reads it, and closes
/// the connection's writing half.
pub async fn answer(
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

/// Writes a staging region's name and the offsets of a transfer's slots in it.
pub(crate) async fn write_region<W: AsyncWrite + Unpin>(
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
pub(crate) async fn write_name<W: AsyncWrite + Unpin>(
    w: &mut W,
    name: &str,
) -> std::io::Result<()> {
    w.write_u32_le(name.len() as u32).await?;
    w.write_all(name.as_bytes()).await
}

/// Reads a shared region's name as [`write_name`] wrote it: at most
/// [`crate::shm::MAX_NAME`] bytes of UTF-8.
pub(crate) async fn read_name<R: AsyncRead + Unpin>(r: &mut R) -> Result<String, Status> {
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

/// Reads a region reference as [`write_region`] wrote it: its name and at most
/// [`crate::frames::MAX_BLOCKS`] slot offsets.
pub async fn read_region<R: AsyncRead + Unpin>(r: &mut R) -> Result<(String, Vec<u64>), Status> {
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

/// A staged block's slot offset and chunk checksums, as `PutStaged` sends them.
pub async fn read_staged_block(
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

/// Announces a staged `Get`'s block `i` as copied into the reader's slot.
pub async fn write_block_landed<W: AsyncWrite + Unpin>(w: &mut W, i: usize) -> std::io::Result<()> {
    w.write_u8(TAG_BLOCK).await?;
    w.write_u32_le(i as u32).await
}

/// Announces a staged `Get`'s block `i` as left in the agent's store, at `offset` of its
/// shared region `name`, for the reader to copy from there.
pub async fn write_block_shared<W: AsyncWrite + Unpin>(
    w: &mut W,
    i: usize,
    offset: u64,
    name: &str,
) -> std::io::Result<()> {
    w.write_u8(TAG_SHARED).await?;
    w.write_u32_le(i as u32).await?;
    w.write_u64_le(offset).await?;
    write_name(w, name).await
}
