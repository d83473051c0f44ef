//! The data channel's server side: an agent accepts data-channel connections on its own port (a
//! side channel of its gRPC server, told apart by its first bytes) and dispatches each to its
//! [`Agent`]: a push or an executor's put to the same checks and store as the gRPC calls, a
//! read to the same read path, staged operations through the executor's shared-memory region.
//!
//! The format itself, and the client side, are `ferry_kv_wire::data_channel`'s: this module
//! reads and writes only through its [`framing`](ferry_kv_wire::data_channel::framing).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ferry_kv_wire::buffers::BufferPool;
use ferry_kv_wire::data_channel::framing::{
    answer, end, io_status, read_chunk, read_message, read_region, read_staged_block,
    write_block_landed, write_block_shared, write_chunk,
};
use ferry_kv_wire::data_channel::{Op, BUFFER, MAGIC, TAG_CHUNK};
use ferry_kv_wire::shm::Region;
use ferry_proto::v1::{self, block_frame::Frame};
use ferry_runtime::side_channel::{Conn as Accepted, ReadHalf, WriteHalf};
use futures_util::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tonic::Status;

use crate::agent::{Agent, Checksums};

/// The side channel for an agent's gRPC host.
pub fn side_channel(agent: Arc<Agent>) -> ferry_runtime::side_channel::SideChannel {
    ferry_runtime::side_channel::SideChannel {
        magic: MAGIC,
        handler: Arc::new(move |conn| {
            tokio::spawn(serve(agent.clone(), conn));
        }),
    }
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
                for frame in ferry_kv_wire::frames::chunks(index, &data) {
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

/// The region named on `reader` and its offsets, checked against `blocks` blocks of
/// `block_bytes` each.
async fn staged_region(
    agent: &Agent,
    reader: &mut BufReader<ReadHalf>,
    blocks: usize,
    block_bytes: usize,
) -> Result<(Arc<Region>, Vec<u64>), Status> {
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
    let header = ferry_kv_wire::frames::read_header(v1::BlockFrame {
        frame: Some(Frame::Header(proto.clone())),
    })
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
            let frames = ferry_kv_wire::frames::chunks_with(i, &data, crcs).map(Ok).collect();
            Some((frames, (reader, i + 1)))
        }
    })
    .flat_map(futures_util::stream::iter);
    let first = v1::BlockFrame { frame: Some(Frame::Header(proto)) };
    let frames = futures_util::stream::once(async { Ok(first) }).chain(blocks);
    agent.put_staged(Box::pin(frames)).await
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
    let bb = ferry_kv_wire::layout::BlockLayout::from_proto(request.layout.as_ref())
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
            write_block_shared(w, i, offset, store.name()).await.map_err(io)?;
        } else {
            region.write(at, &data).map_err(|e| Status::invalid_argument(e.to_string()))?;
            agent.counters.staged_reads_copied.fetch_add(1, Ordering::Relaxed);
            write_block_landed(w, i).await.map_err(io)?;
        }
        w.flush().await.map_err(io)?;
    }
    if next.next().is_some() {
        return Err(Status::internal("the read ended before every block was here"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;

    use ferry_kv_wire::data_channel::framing::read_receipt;
    use ferry_kv_wire::data_channel::{get_staged, open_staged, probe, send_blocks};
    use ferry_kv_wire::shm::{Place, Staging};
    use tokio::sync::mpsc;

    use super::*;

    /// A small test layout (the wire crate's frame tests use the same one).
    fn layout() -> v1::KvLayout {
        v1::KvLayout {
            num_layers: 2,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 8,
            dtype: v1::KvDtype::F32.into(),
            model_fingerprint: "fp".into(),
        }
    }

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
        let chunks = data.iter().enumerate().flat_map(|(i, d)| ferry_kv_wire::frames::chunks(i, d));
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
        ferry_kv_wire::layout::BlockLayout::from_proto(Some(&layout())).unwrap().block_bytes
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
        let (mut filler, slots, _) = ferry_kv_wire::shm::filling(staging.alloc(2).unwrap());
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
            let crc = ferry_kv_wire::frames::crc32c(slots.block(i)) + u32::from(i == 1);
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
