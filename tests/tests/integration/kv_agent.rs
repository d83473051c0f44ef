//! The KV agent (`ferry-kv`) as real processes: an export put to one node's agent is pushed to
//! another's, where a reader gets exactly the bytes (even when it asks before they arrive), and
//! nothing stays pinned once it has them. Every bad stream or request is refused with a status
//! that says what was wrong, and leaves the store as it was; a cancelled, corrupted or late
//! transfer ends for its reader at once, with the reason.

use std::time::Duration;

use bytes::Bytes;
use ferry_kv_transfer_svc::peers;
use ferry_kv_wire::frames::{chunks, header_frame, read_header, Header};
use ferry_proto::v1::{self, block_frame::Frame, kv_transfer_client::KvTransferClient};
use ferry_runtime::clock::unix_deadline;
use ferry_tests::Service;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

fn layout(fingerprint: &str) -> v1::KvLayout {
    v1::KvLayout {
        num_layers: 4,
        block_size: 16,
        num_kv_heads: 2,
        head_dim: 64,
        dtype: v1::KvDtype::F32.into(),
        model_fingerprint: fingerprint.into(),
    }
}

fn header(tid: &str, blocks: usize, destination: Option<&str>, deadline: Duration) -> Header {
    read_header(v1::BlockFrame {
        frame: Some(Frame::Header(v1::TransferHeader {
            transfer_id: tid.into(),
            layout: Some(layout("model-a")),
            block_hashes: (1..=blocks as u64).map(|h| h * 0x9e37_79b9).collect(),
            destination_agent: destination.unwrap_or_default().into(),
            deadline_unix_ms: unix_deadline(deadline),
            traceparent: String::new(),
        })),
    })
    .expect("a valid header")
}

fn block(i: usize, bytes: usize) -> Bytes {
    (0..bytes).map(|b| (b as u8).wrapping_mul(7).wrapping_add(i as u8)).collect::<Vec<_>>().into()
}

fn blocks(h: &Header) -> Vec<Bytes> {
    (0..h.hashes.len()).map(|i| block(i, h.layout.block_bytes)).collect()
}

fn agent(node: &str) -> (Service, KvTransferClient<Channel>) {
    let svc = Service::start(
        "ferry-kv",
        &["--listen", "127.0.0.1:0", "--node-id", node, "--store-mib", "64"],
        1,
    )
    .unwrap();
    let client = peers::client(&svc.addr("grpc").to_string()).unwrap();
    (svc, client)
}

/// Frames of `h` and `data`; the caller feeds them, so it controls pace and content.
fn frames(h: &Header, data: &[Bytes]) -> Vec<v1::BlockFrame> {
    let mut all = vec![header_frame(h)];
    for (i, b) in data.iter().enumerate() {
        all.extend(chunks(i, b));
    }
    all
}

/// Starts a `Put` whose frames the test sends on the returned channel.
fn put(
    client: &KvTransferClient<Channel>,
) -> (
    mpsc::Sender<v1::BlockFrame>,
    tokio::task::JoinHandle<Result<v1::TransferReceipt, tonic::Status>>,
) {
    let (tx, rx) = mpsc::channel(64);
    let mut c = client.clone();
    let call = tokio::spawn(async move { Ok(c.put(ReceiverStream::new(rx)).await?.into_inner()) });
    (tx, call)
}

/// Reads transfer `tid` (blocks of `h`) from `client`: the blocks' bytes, or the status.
async fn get(
    client: &KvTransferClient<Channel>,
    h: &Header,
    tid: &str,
    deadline: Duration,
) -> Result<Vec<u8>, tonic::Status> {
    let req = v1::GetBlocksRequest {
        transfer_id: tid.into(),
        layout: Some(h.layout.layout.clone()),
        block_hashes: h.hashes.clone(),
        deadline_unix_ms: unix_deadline(deadline),
        traceparent: String::new(),
    };
    let mut stream = client.clone().get(req).await?.into_inner();
    let mut bytes = Vec::new();
    while let Some(frame) = stream.next().await {
        if let Some(Frame::Chunk(c)) = frame?.frame {
            bytes.extend_from_slice(&c.data);
        }
    }
    Ok(bytes)
}

async fn describe(client: &KvTransferClient<Channel>) -> v1::KvAgentDescription {
    client.clone().describe(v1::DescribeKvAgentRequest {}).await.unwrap().into_inner()
}

/// Nothing pinned, no transfer in progress (the agent's metrics say so).
async fn settled(svc: &Service) -> String {
    let mut text = String::new();
    let zero =
        |text: &str, name: &str| text.lines().any(|l| l.starts_with(name) && l.ends_with(" 0"));
    for _ in 0..100 {
        text = ferry_tests::http(svc.addr("grpc"), "GET", "/metrics", b"").unwrap().1;
        if zero(&text, "ferry_kv_store_pinned_bytes{")
            && zero(&text, "ferry_kv_transfers_in_progress{")
        {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the agent did not settle:\n{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_reaches_the_other_node_and_its_reader_gets_exactly_the_bytes() {
    let (a, a_client) = agent("node-a");
    let (b, b_client) = agent("node-b");
    let dest = b.addr("grpc").to_string();
    let h = header("t-export", 5, Some(&dest), Duration::from_secs(30));
    let data = blocks(&h);
    // The reader asks first: it waits for the push and gets each block as it arrives.
    let reader = {
        let (b_client, h) = (b_client.clone(), h.clone());
        tokio::spawn(async move { get(&b_client, &h, "t-export", Duration::from_secs(30)).await })
    };
    let (tx, call) = put(&a_client);
    for f in frames(&h, &data) {
        tx.send(f).await.unwrap();
    }
    drop(tx);
    let receipt = call.await.unwrap().unwrap();
    assert_eq!((receipt.blocks, receipt.bytes), (5, h.total_bytes()));
    let got = reader.await.unwrap().unwrap();
    assert_eq!(got, data.concat(), "the reader got the exact bytes");
    // B keeps the blocks as cache, unpinned; A kept nothing (it only forwarded).
    let d = describe(&b_client).await;
    assert_eq!((d.blocks, d.bytes, d.bytes_received), (5, h.total_bytes(), h.total_bytes()));
    assert_eq!(describe(&a_client).await.blocks, 0);
    let m = settled(&b).await;
    assert!(m.contains("ferry_kv_transfers_received{node=\"node-b\"} 1"), "{m}");
    // B can say which blocks it holds.
    let mut asked = h.hashes.clone();
    asked.push(12345);
    let found = b_client
        .clone()
        .lookup(v1::LookupRequest {
            block_hashes: asked,
            layout: Some(layout("model-a")),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(found.prefix_blocks, 5);
    assert_eq!(found.present, [true, true, true, true, true, false]);
    drop(a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_chunk_fails_the_transfer_for_its_reader_and_leaves_no_block() {
    let (a, a_client) = agent("node-a");
    let (b, b_client) = agent("node-b");
    let dest = b.addr("grpc").to_string();
    let h = header("t-corrupt", 4, Some(&dest), Duration::from_secs(30));
    let mut all = frames(&h, &blocks(&h));
    // The third block's bytes change on the way (its CRC no longer matches).
    if let Some(Frame::Chunk(c)) = &mut all[3].frame {
        let mut bad = c.data.to_vec();
        bad[100] ^= 0xff;
        c.data = bad.into();
    }
    let reader = {
        let (b_client, h) = (b_client.clone(), h.clone());
        tokio::spawn(async move { get(&b_client, &h, "t-corrupt", Duration::from_secs(30)).await })
    };
    let (tx, call) = put(&a_client);
    for f in all {
        if tx.send(f).await.is_err() {
            break;
        }
    }
    drop(tx);
    let refused = call.await.unwrap().unwrap_err();
    assert_eq!(refused.code(), tonic::Code::DataLoss, "{refused:?}");
    assert!(refused.message().contains("CRC32C mismatch in block 2"), "{}", refused.message());
    let failed = reader.await.unwrap().unwrap_err();
    assert!(failed.message().contains("t-corrupt"), "the reader hears why: {failed:?}");
    // The blocks that did arrive left with the transfer: both stores are as they were.
    settled(&b).await;
    assert_eq!(describe(&b_client).await.blocks, 0);
    assert_eq!(describe(&a_client).await.blocks, 0);
    let m = settled(&a).await;
    assert!(m.contains("ferry_kv_transfer_failures{node=\"node-a\",reason=\"checksum\"} 1"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_transfer_ends_for_everyone_and_a_later_push_under_its_id_is_refused() {
    let (_a, a_client) = agent("node-a");
    let (b, b_client) = agent("node-b");
    let dest = b.addr("grpc").to_string();
    let h = header("t-cancel", 4, Some(&dest), Duration::from_secs(30));
    let all = frames(&h, &blocks(&h));
    let (tx, call) = put(&a_client);
    // Header and two blocks go; then the sender stalls and the transfer is cancelled.
    for f in all.iter().take(3) {
        tx.send(f.clone()).await.unwrap();
    }
    let reader = {
        let (b_client, h) = (b_client.clone(), h.clone());
        tokio::spawn(async move { get(&b_client, &h, "t-cancel", Duration::from_secs(30)).await })
    };
    // Wait until B holds the two blocks, so the cancel has something to undo.
    for _ in 0..100 {
        if describe(&b_client).await.blocks == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(describe(&b_client).await.blocks, 2);
    let cancel =
        v1::CancelTransferRequest { transfer_id: "t-cancel".into(), reason: "the test".into() };
    assert!(b_client.clone().cancel(cancel.clone()).await.unwrap().into_inner().found);
    let ended = reader.await.unwrap().unwrap_err();
    assert_eq!(ended.code(), tonic::Code::Cancelled, "{ended:?}");
    assert!(ended.message().contains("the test"), "{ended:?}");
    settled(&b).await;
    assert_eq!(describe(&b_client).await.blocks, 0, "the blocks it brought left with it");
    // The source's forward ends too, and a new push under the same id is refused.
    a_client.clone().cancel(cancel).await.unwrap();
    drop(tx);
    let forward = call.await.unwrap().unwrap_err();
    assert!(
        matches!(
            forward.code(),
            tonic::Code::Cancelled | tonic::Code::Unavailable | tonic::Code::FailedPrecondition
        ),
        "{forward:?}"
    );
    let again = header("t-cancel", 1, None, Duration::from_secs(30));
    let mut direct = b_client.clone();
    let late = direct.push(tokio_stream::iter(frames(&again, &blocks(&again)))).await.unwrap_err();
    assert_eq!(late.code(), tonic::Code::FailedPrecondition, "{late:?}");
    assert!(late.message().contains("already ended"), "{late:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_past_its_deadline_gives_its_blocks_back() {
    let (b, b_client) = agent("node-b");
    let h = header("t-late", 3, None, Duration::from_millis(600));
    let all = frames(&h, &blocks(&h));
    let (tx, rx) = mpsc::channel(8);
    let mut direct = b_client.clone();
    let call = tokio::spawn(async move { direct.push(ReceiverStream::new(rx)).await });
    tx.send(all[0].clone()).await.unwrap();
    tx.send(all[1].clone()).await.unwrap();
    // The sender is slower than the deadline.
    let late = call.await.unwrap().unwrap_err();
    assert_eq!(late.code(), tonic::Code::DeadlineExceeded, "{late:?}");
    drop(tx);
    settled(&b).await;
    assert_eq!(describe(&b_client).await.blocks, 0);
    // A whole transfer nobody reads before its deadline is given back too.
    let unread = header("t-unread", 2, None, Duration::from_millis(800));
    b_client.clone().push(tokio_stream::iter(frames(&unread, &blocks(&unread)))).await.unwrap();
    let m = settled(&b).await;
    assert!(m.contains("reason=\"deadline\"} 2"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_saying_what_was_wrong_and_change_nothing() {
    let (b, b_client) = agent("node-b");
    let h = header("t-ok", 2, None, Duration::from_secs(30));
    let data = blocks(&h);
    let mut c = b_client.clone();
    // A truncated push: the last block never comes.
    let mut short = frames(&h, &data);
    short.pop();
    let err = c.push(tokio_stream::iter(short)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("ended after"), "{err:?}");
    // An oversized chunk, and a chunk before any header.
    let h2 = header("t-big", 1, None, Duration::from_secs(30));
    let huge = Bytes::from(vec![1u8; h2.layout.block_bytes + 1]);
    let oversized = vec![
        header_frame(&h2),
        v1::BlockFrame {
            frame: Some(Frame::Chunk(v1::BlockChunk {
                block_index: 0,
                offset: 0,
                crc32c: crc32c::crc32c(&huge),
                data: huge,
            })),
        },
    ];
    let err = c.push(tokio_stream::iter(oversized)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("chunks are at most"), "{err:?}");
    let headless: Vec<_> = frames(&h, &data).into_iter().skip(1).collect();
    let err = c.push(tokio_stream::iter(headless)).await.unwrap_err();
    assert!(err.message().contains("must start with a header"), "{err:?}");
    // A push naming a destination (pushes are stored where they arrive).
    let onward = header("t-onward", 1, Some("127.0.0.1:1"), Duration::from_secs(30));
    let err = c.push(tokio_stream::iter(frames(&onward, &blocks(&onward)))).await.unwrap_err();
    assert!(err.message().contains("names no destination"), "{err:?}");
    // A layout without a dtype.
    let mut no_dtype = h.to_proto();
    no_dtype.transfer_id = "t-dtype".into();
    no_dtype.layout.as_mut().unwrap().dtype = 0;
    let err = c
        .push(tokio_stream::iter(vec![v1::BlockFrame { frame: Some(Frame::Header(no_dtype)) }]))
        .await
        .unwrap_err();
    assert!(err.message().contains("dtype 0 is not f32"), "{err:?}");
    // A KV-tier read of blocks the store does not hold, and a read with another layout than
    // the transfer's.
    let missing = v1::GetBlocksRequest {
        layout: Some(layout("model-a")),
        block_hashes: vec![42],
        ..Default::default()
    };
    let err = match c.get(missing).await {
        Err(e) => e,
        Ok(r) => r.into_inner().next().await.unwrap().unwrap_err(),
    };
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    let pending = header("t-layout", 1, None, Duration::from_secs(30));
    let (tx, rx) = mpsc::channel(4);
    let mut pusher = b_client.clone();
    let push = tokio::spawn(async move { pusher.push(ReceiverStream::new(rx)).await });
    tx.send(header_frame(&pending)).await.unwrap();
    let other = Header {
        layout: ferry_kv_wire::layout::BlockLayout::from_proto(Some(&layout("model-b"))).unwrap(),
        ..pending.clone()
    };
    let mut err = None;
    for _ in 0..50 {
        match get(&b_client, &other, "t-layout", Duration::from_secs(2)).await {
            Err(e) if e.code() == tonic::Code::FailedPrecondition => {
                err = Some(e);
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    let err = err.expect("a reader with another layout is refused");
    assert!(err.message().contains("another KV layout"), "{err:?}");
    drop(tx);
    let _ = push.await;
    // A cancel without an id.
    let err = c.cancel(v1::CancelTransferRequest::default()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    // After all that, the store is as it was: empty, nothing pinned.
    settled(&b).await;
    let d = describe(&b_client).await;
    assert_eq!((d.blocks, d.bytes), (0, 0), "{d:?}");
}

/// An agent process whose staging directory is `dir`.
fn agent_in(node: &str, dir: &std::path::Path) -> Service {
    let dir = dir.to_str().unwrap();
    let args =
        ["--listen", "127.0.0.1:0", "--node-id", node, "--store-mib", "64", "--shm-dir", dir];
    Service::start("ferry-kv", &args, 1).unwrap()
}

fn shm_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-kv-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_export_and_a_staged_read_move_exactly_the_bytes_through_shared_memory() {
    use ferry_kv_wire::{data_channel, shm};
    let dir = shm_dir("staged");
    let (a, b) = (agent_in("node-a", &dir), agent_in("node-b", &dir));
    let (a_addr, b_addr) = (a.addr("grpc").to_string(), b.addr("grpc").to_string());
    let h = header("t-staged", 5, Some(&b_addr), Duration::from_secs(30));
    let bb = h.layout.block_bytes;
    let (exporter, importer) =
        (shm::Staging::create(&dir, bb, 8).unwrap(), shm::Staging::create(&dir, bb, 8).unwrap());
    data_channel::probe(&a_addr, exporter.name()).await.unwrap();
    data_channel::probe(&b_addr, importer.name()).await.unwrap();
    // The reader asks first; the exporter fills its slots one by one as the transfer runs.
    let req = v1::GetBlocksRequest {
        transfer_id: h.transfer_id.clone(),
        layout: Some(h.layout.layout.clone()),
        block_hashes: h.hashes.clone(),
        deadline_unix_ms: unix_deadline(Duration::from_secs(30)),
        traceparent: String::new(),
    };
    let into = std::sync::Arc::new(importer.alloc(5).unwrap());
    let (landed_tx, landed) = tokio::sync::watch::channel(Vec::new());
    let (release, released) = tokio::sync::oneshot::channel();
    let read = {
        let (b_addr, into) = (b_addr.clone(), into.clone());
        tokio::spawn(async move {
            data_channel::get_staged(&b_addr, req, into, landed_tx, released).await
        })
    };
    let (mut filler, out, filled) = shm::filling(exporter.alloc(5).unwrap());
    let sent = {
        let (a_addr, proto) = (a_addr.clone(), h.to_proto());
        tokio::spawn(async move { data_channel::put_staged(&a_addr, proto, out, filled).await })
    };
    let data = blocks(&h);
    for d in &data {
        filler
            .fill(|buf| {
                buf.copy_from_slice(d);
                Ok::<(), ()>(())
            })
            .unwrap();
    }
    let receipt = sent.await.unwrap().unwrap();
    assert_eq!((receipt.blocks, receipt.bytes), (5, h.total_bytes()));
    read.await.unwrap().unwrap();
    let places = landed.borrow().clone();
    assert_eq!(places.len(), 5, "every block was reported as it landed");
    for (i, (d, place)) in data.iter().zip(&places).enumerate() {
        // The destination agent keeps what it receives in shared memory of its own: the
        // reader copies from there, not from a copy in its slot.
        assert!(matches!(place, shm::Place::Store { .. }), "block {i} is read from the store");
        assert_eq!(place.bytes(&into, i).unwrap(), &d[..], "block {i} landed exactly");
    }
    drop((filler, into, places, release));
    // The read's task gives the slots back once it let go of the agent's connection.
    let free = || (exporter.free_slots(), importer.free_slots()) == (8, 8);
    assert!(
        ferry_tests::streams::wait_for(Duration::from_secs(10), free).await.is_some(),
        "every slot is free again: {} and {} of 8",
        exporter.free_slots(),
        importer.free_slots()
    );
    settled(&a).await;
    settled(&b).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_export_that_stops_early_or_names_a_foreign_region_is_refused_and_changes_nothing()
{
    use ferry_kv_wire::{data_channel, shm};
    let (dir, elsewhere) = (shm_dir("early"), shm_dir("elsewhere"));
    let (a, b) = (agent_in("node-a", &dir), agent_in("node-b", &dir));
    let (a_addr, b_addr) = (a.addr("grpc").to_string(), b.addr("grpc").to_string());
    let h = header("t-early", 3, Some(&b_addr), Duration::from_secs(30));
    let exporter = shm::Staging::create(&dir, h.layout.block_bytes, 4).unwrap();
    // Regions the agent does not share, or names that are not regions', are refused.
    let foreign = shm::Staging::create(&elsewhere, 64, 1).unwrap();
    let err = data_channel::probe(&a_addr, foreign.name()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains(dir.to_str().unwrap()), "{err:?}");
    let err = data_channel::probe(&a_addr, "../../etc/passwd").await.unwrap_err();
    assert!(err.message().contains("not a name of the form ferry-kv-"), "{err:?}");
    // The exporter stops after one of three blocks: the transfer fails at both agents.
    let (mut filler, out, filled) = shm::filling(exporter.alloc(3).unwrap());
    let sent =
        tokio::spawn(
            async move { data_channel::put_staged(&a_addr, h.to_proto(), out, filled).await },
        );
    filler
        .fill(|buf| {
            buf.fill(1);
            Ok::<(), ()>(())
        })
        .unwrap();
    drop(filler);
    let err = sent.await.unwrap().unwrap_err();
    assert_eq!(err.code(), tonic::Code::Aborted, "{err:?}");
    assert!(err.message().contains("after staging 1 of 3 blocks"), "{err:?}");
    let (ma, mb) = (settled(&a).await, settled(&b).await);
    assert!(mb.contains("ferry_kv_store_used_bytes{node=\"node-b\"} 0"), "{mb}");
    assert!(
        ma.contains("ferry_kv_transfer_failures{node=\"node-a\",reason=\"truncated\"} 1"),
        "{ma}"
    );
    assert_eq!(exporter.free_slots(), 4, "the slots are free again");
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(elsewhere);
}
