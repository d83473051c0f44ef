//! `ferry-bench kv`: how fast KV blocks move between agents, against a plain TCP sender and
//! receiver moving the same bytes in the same run.
//!
//! Every path moves the same bytes: one transfer's blocks (256 MiB by default), from memory
//! of their own (as an executor's pool or an agent's store holds them) into memory of their
//! own. The paths, each timed from the first byte sent to the last byte stored:
//! - `tcp-pools`: plain TCP on loopback from one pool (allocated and touched first) into
//!   another, a `write_all` and a `read_exact` per block: the baseline, the same bytes from
//!   memory to memory with nothing but the transport;
//! - `tcp`: the same connection with the sender writing one block again and again and the
//!   receiver reading into one reused buffer: both stay in the CPU's cache, so this is the
//!   transport alone, a ceiling no path that moves a transfer's bytes between memory reaches
//!   (`tcp-pools` itself gets about two thirds of it here);
//! - `push`: agent to agent as agents do it, over the destination's data channel (chunked,
//!   CRC32C checked, stored; the sender's checksums computed before the clock starts);
//! - `grpc-push`: the same through the gRPC `Push` (for tools; shown for comparison);
//! - `put+push`: an executor's export through its node's agent (a data-channel `Put` with a
//!   destination; the relay checks every chunk as it reads it) on to the destination agent;
//! - `whole-socket`: the same, with the importing executor reading each block from its agent
//!   as it arrives into a pool of its own: one executor's KV pool to another's, every byte
//!   through the agents' sockets;
//! - `whole-staged`: one executor's KV pool to another's as an executor whose pool is in its
//!   own memory does it: the exporter copies its blocks into its shared-memory staging slots
//!   (computing their checksums as it goes), its agent sends them from there, the destination
//!   agent keeps each block in a shared region of its store, and the importer copies each
//!   from there into its pool as it lands. Timed from the first copy out of the source pool
//!   to the last copy into the destination pool; both pools are allocated and touched first,
//!   as an executor's are;
//! - `whole`: the same as a CPU executor with an agent does it: its pool is in the region it
//!   shares with its agent, so the exporter only computes each block's checksums and its
//!   agent sends the blocks from the pool itself.
//!
//! The agents run in this process on loopback, like the TCP pair, so all share the same
//! cores. Each round runs every path once, back to back; a path's ratio is the median over
//! rounds of its run against the same round's baseline, since the machine's own rate drifts.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use ferry_kv_transfer_svc::{peers, KvAgentConfig};
use ferry_kv_wire::data_channel;
use ferry_kv_wire::frames::{chunks, header_frame, read_header, Header};
use ferry_kv_wire::shm;
use ferry_proto::v1::{self, block_frame::Frame};
use ferry_runtime::clock::unix_deadline;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

/// Every path, in the order each round runs them (the two baselines first).
pub const PATHS: [&str; 8] =
    ["tcp", "tcp-pools", "push", "grpc-push", "put+push", "whole-socket", "whole-staged", "whole"];

/// Flags of `ferry-bench kv`.
#[derive(Debug, clap::Args)]
pub struct KvBenchArgs {
    /// Megabytes moved per run.
    #[arg(long, default_value_t = 512)]
    pub mib: usize,
    /// Tokens per block of the layout moved (SmolLM2-135M's shape: 30 layers, 3 KV heads of
    /// 64, f32: 46 080 bytes per token).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Runs of each path, alternating.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Paths to run besides the baselines `tcp` and `tcp-pools` (comma-separated; all by
    /// default).
    #[arg(long, value_delimiter = ',', default_values_t = PATHS.map(String::from))]
    pub paths: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One path's runs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KvBenchRow {
    /// One of [`PATHS`].
    pub path: &'static str,
    /// MB/s of each run.
    pub mb_per_s: Vec<f64>,
    /// The median over rounds of each run against the same round's `tcp` run (the machine's
    /// own rate drifts between rounds; a round's paths run back to back).
    pub ratio_to_tcp: f64,
    /// The same against each round's `tcp-pools` run.
    pub ratio_to_tcp_pools: f64,
}

fn layout(block_size: u32) -> v1::KvLayout {
    v1::KvLayout {
        num_layers: 30,
        block_size,
        num_kv_heads: 3,
        head_dim: 64,
        dtype: v1::KvDtype::F32.into(),
        model_fingerprint: "bench".into(),
    }
}

/// The header of transfer `tid`: `blocks` blocks with hashes of their own (a transfer whose
/// blocks were already stored would skip the store's work and flatter the figure).
fn header(tid: &str, blocks: usize, block_size: u32, destination: Option<String>) -> Header {
    let base = tid.bytes().fold(0u64, |h, b| h.wrapping_mul(131).wrapping_add(u64::from(b))) << 20;
    read_header(v1::BlockFrame {
        frame: Some(Frame::Header(v1::TransferHeader {
            transfer_id: tid.into(),
            layout: Some(layout(block_size)),
            block_hashes: (1..=blocks as u64).map(|i| base + i).collect(),
            destination_agent: destination.unwrap_or_default(),
            deadline_unix_ms: unix_deadline(std::time::Duration::from_secs(600)),
            traceparent: String::new(),
        })),
    })
    .expect("a valid bench header")
}

/// The importer's read of transfer `h`.
fn read_request(h: &Header) -> v1::GetBlocksRequest {
    v1::GetBlocksRequest {
        transfer_id: h.transfer_id.clone(),
        layout: Some(h.layout.layout.clone()),
        block_hashes: h.hashes.clone(),
        deadline_unix_ms: unix_deadline(std::time::Duration::from_secs(600)),
        traceparent: String::new(),
    }
}

/// The frames of transfer `h`, its blocks cut from `source` in order (checksums computed
/// before the clock starts).
fn frames(h: &Header, source: &Bytes) -> Vec<v1::BlockFrame> {
    let bb = h.layout.block_bytes;
    std::iter::once(header_frame(h))
        .chain(
            (0..h.hashes.len())
                .flat_map(|i| chunks(i, &source.slice(i * bb..(i + 1) * bb)).collect::<Vec<_>>()),
        )
        .collect()
}

async fn start_agent(
    node: &str,
    store_mib: u64,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<String> {
    let (listener, addr) = ferry_runtime::grpc::bind("127.0.0.1:0").await?;
    let config =
        KvAgentConfig { node_id: node.into(), store_mib, shm_dir: shm::DEFAULT_DIR.into() };
    let drain = std::time::Duration::from_secs(5);
    let stopped = ferry_runtime::when_set(stop.clone());
    tokio::spawn(ferry_kv_transfer_svc::run(config, None, listener.into(), stopped, drain));
    Ok(addr.to_string())
}

/// Moves the bytes of `source` over plain TCP on loopback into `dest` (two pools of the
/// transfer's size, allocated and touched before): the same bytes from memory to memory that
/// the pool-to-pool path moves; MB/s. The receiver is a task of its own, as a separate
/// process's would be, so sender and receiver run at once.
async fn tcp_pools(source: &[u8], dest: &mut Vec<u8>, len: usize) -> anyhow::Result<f64> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let mut pool = std::mem::take(dest);
    let start = Instant::now();
    let receiver = tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await?;
        for block in pool.chunks_mut(len) {
            conn.read_exact(block).await?;
        }
        anyhow::Ok(pool)
    });
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.set_nodelay(true)?;
    for block in source.chunks(len) {
        conn.write_all(block).await?;
    }
    conn.flush().await?;
    *dest = receiver.await??;
    let secs = start.elapsed().as_secs_f64();
    anyhow::ensure!(dest.as_slice() == source, "tcp-pools: the bytes arrived unchanged");
    dest.fill(1);
    Ok(source.len() as f64 / secs / 1e6)
}

/// Moves `blocks` blocks of `block` over plain TCP on loopback, the receiver reading into one
/// reused buffer; MB/s.
async fn tcp(blocks: usize, block: &Bytes) -> anyhow::Result<f64> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let len = block.len();
    let receiver = tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await?;
        let mut buf = vec![0u8; len];
        let mut got = 0;
        for _ in 0..blocks {
            conn.read_exact(&mut buf).await?;
            got += 1;
        }
        anyhow::Ok(got)
    });
    let start = Instant::now();
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.set_nodelay(true)?;
    for _ in 0..blocks {
        conn.write_all(block).await?;
    }
    conn.flush().await?;
    let got = receiver.await??;
    anyhow::ensure!(got == blocks, "tcp: {got} of {blocks} blocks");
    Ok((blocks * len) as f64 / start.elapsed().as_secs_f64() / 1e6)
}

/// Pushes `blocks` blocks of `source` straight to the agent at `to`, over its data channel or
/// (`grpc`) its gRPC `Push`; MB/s.
async fn push(
    tid: &str,
    to: &str,
    blocks: usize,
    source: &Bytes,
    block_size: u32,
    grpc: bool,
) -> anyhow::Result<f64> {
    let h = header(tid, blocks, block_size, None);
    let all = frames(&h, source);
    let start = Instant::now();
    let receipt = if grpc {
        peers::client(to)?.push(tokio_stream::iter(all)).await?.into_inner()
    } else {
        let (rx, fed) = feed(all);
        let ((), pushed) = tokio::join!(fed, data_channel::push(to, rx));
        pushed?
    };
    anyhow::ensure!(receipt.bytes == h.total_bytes(), "push: {receipt:?}");
    Ok(h.total_bytes() as f64 / start.elapsed().as_secs_f64() / 1e6)
}

/// Feeds `all` into a channel for a data-channel sender.
fn feed(
    all: Vec<v1::BlockFrame>,
) -> (tokio::sync::mpsc::Receiver<v1::BlockFrame>, impl std::future::Future<Output = ()>) {
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let fed = async move {
        for f in all {
            if tx.send(f).await.is_err() {
                break;
            }
        }
    };
    (rx, fed)
}

/// An export as an executor makes it: `blocks` blocks of `source` put to its agent at `via`, which pushes
/// them on to `to`; MB/s. With `read`, a reader at `to` (the importing executor) takes each
/// block as it arrives and copies it into its own pool, and the time runs until it has all:
/// the whole path from one executor's pool to the other's.
async fn export(
    tid: &str,
    via: &str,
    to: &str,
    blocks: usize,
    source: &Bytes,
    block_size: u32,
    read: bool,
) -> anyhow::Result<f64> {
    let h = header(tid, blocks, block_size, Some(to.to_string()));
    let (rx, fed) = feed(frames(&h, source));
    let request = read_request(&h);
    let mut pool = vec![1u8; if read { source.len() } else { 0 }];
    let to = to.to_string();
    let start = Instant::now();
    // The importing executor, a task of its own (another process in a deployment).
    let reader = tokio::spawn(async move {
        if !read {
            return anyhow::Ok(0usize);
        }
        let mut chunks = data_channel::get(&to, &request).await?;
        let mut at = 0;
        while let Some(chunk) = chunks.recv().await {
            let c = chunk?;
            pool[at..at + c.data.len()].copy_from_slice(&c.data);
            at += c.data.len();
        }
        Ok(at)
    });
    let sender = data_channel::send_blocks(via, data_channel::Op::Put, rx);
    let ((), receipt) = tokio::join!(fed, sender);
    let read_bytes = reader.await??;
    let secs = start.elapsed().as_secs_f64();
    let receipt = receipt?;
    anyhow::ensure!(receipt.bytes == h.total_bytes(), "put: {receipt:?}");
    if read {
        anyhow::ensure!(read_bytes as u64 == h.total_bytes(), "the reader got every byte");
    }
    Ok(h.total_bytes() as f64 / secs / 1e6)
}

/// One executor's pool to another's through the agents at `via` (the exporter's) and `to`
/// (the importer's); MB/s. The exporter's pool is in its shared region (`in_place`: its blocks
/// leave from there) or its own memory (`pools.0`, copied into staging slots first).
async fn staged(
    tid: &str,
    (via, to): (&str, &str),
    pools: &mut (Vec<u8>, Vec<u8>),
    (stagings, shared_pool): (&(Arc<shm::Staging>, Arc<shm::Staging>), &shm::PoolMemory),
    block_size: u32,
    in_place: bool,
) -> anyhow::Result<f64> {
    let bb = stagings.0.block_bytes();
    let blocks = pools.0.len() / bb;
    let h = header(tid, blocks, block_size, Some(to.to_string()));
    let request = read_request(&h);
    let no_room = || anyhow::anyhow!("staging: no room for {blocks} blocks");
    let start = Instant::now();
    // As executors do it: the exporter's transfer starts first and sends each block as soon
    // as it is copied out (or its checksums computed, in place); the importer copies each
    // block into its pool as it lands.
    let out = if in_place {
        let ids: Vec<u32> = (0..u32::try_from(blocks)?).collect();
        stagings.0.pool_slots(&ids).ok_or_else(no_room)?
    } else {
        stagings.0.alloc(blocks).ok_or_else(no_room)?
    };
    let (mut filler, out, filled) = shm::filling(out);
    let into = std::sync::Arc::new(stagings.1.alloc(blocks).ok_or_else(no_room)?);
    let (landed_tx, mut landed) = tokio::sync::watch::channel(Vec::new());
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let (via, to, proto, into2) = (via.to_string(), to.to_string(), h.to_proto(), into.clone());
    let sent =
        tokio::spawn(async move { data_channel::put_staged(&via, proto, out, filled).await });
    let read = tokio::spawn(async move {
        data_channel::get_staged(&to, request, into2, landed_tx, released).await
    });
    // The exporter's and the importer's engine threads.
    let source = std::mem::take(&mut pools.0);
    let exporter = tokio::task::spawn_blocking(move || {
        for i in 0..blocks {
            if in_place {
                filler.publish_in_place();
            } else {
                filler.fill(|buf| {
                    buf.copy_from_slice(&source[i * bb..(i + 1) * bb]);
                    anyhow::Ok(())
                })?;
            }
        }
        anyhow::Ok(source)
    });
    let mut pool = std::mem::take(&mut pools.1);
    let runtime = tokio::runtime::Handle::current();
    let importer = tokio::task::spawn_blocking(move || {
        let mut written = 0;
        while written < blocks {
            let new: Vec<shm::Place> = landed.borrow_and_update()[written..].to_vec();
            for place in new {
                let i = written;
                pool[i * bb..(i + 1) * bb].copy_from_slice(place.bytes(&into, i)?);
                written += 1;
            }
            if written < blocks {
                runtime
                    .block_on(landed.changed())
                    .map_err(|_| anyhow::anyhow!("the read ended early"))?;
            }
        }
        // Done reading: the agent may reuse the stored blocks this read took.
        drop(release);
        anyhow::Ok(pool)
    });
    pools.0 = exporter.await??;
    pools.1 = importer.await??;
    read.await??;
    let secs = start.elapsed().as_secs_f64();
    anyhow::ensure!(sent.await??.bytes == h.total_bytes(), "staged put: short");
    let exported = if in_place { shared_pool.bytes() } else { &pools.0[..] };
    anyhow::ensure!(exported == pools.1, "the importer's pool holds the exporter's blocks");
    pools.1.fill(0);
    Ok(h.total_bytes() as f64 / secs / 1e6)
}

/// Rounds that warm up and are not counted: connections, the allocator, the page cache, and
/// the receiving agent's store, which keeps each transfer's blocks as cache: once full, an
/// arriving block takes the buffer of one it evicts (a running agent's steady state) instead
/// of new memory, which costs a page fault per 4 KiB.
const WARM_UP: usize = 2;

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// Runs the bench and prints its rows.
pub async fn run(args: &KvBenchArgs) -> anyhow::Result<Vec<KvBenchRow>> {
    anyhow::ensure!(args.mib > 0 && args.rounds > 0, "--mib and --rounds must be at least 1");
    let block_bytes = 30 * 2 * args.block_size as usize * 3 * 64 * 4;
    let block: Bytes = (0..block_bytes).map(|i| (i * 7) as u8).collect::<Vec<u8>>().into();
    let blocks = (args.mib << 20).div_ceil(block_bytes);
    // Room for one transfer's blocks at a time: each unread one is cancelled right after its
    // run, which takes its blocks out again.
    let store_mib = (args.mib + 64) as u64;
    let (stop_tx, stop) = watch::channel(false);
    let a = start_agent("bench-a", store_mib, &stop).await?;
    let b = start_agent("bench-b", store_mib, &stop).await?;
    let done = |tid: String| {
        let b = b.clone();
        async move {
            let reason = "bench run done".to_string();
            let cancel = v1::CancelTransferRequest { transfer_id: tid, reason };
            peers::client(&b)?.cancel(cancel).await?;
            anyhow::Ok(())
        }
    };
    let bs = args.block_size;
    for p in &args.paths {
        anyhow::ensure!(PATHS.contains(&p.as_str()), "unknown path {p:?}; paths: {PATHS:?}");
    }
    // The baselines always run; the rest as asked, in this order.
    let chosen: Vec<&'static str> = PATHS
        .into_iter()
        .filter(|p| matches!(*p, "tcp" | "tcp-pools") || args.paths.iter().any(|a| a == p))
        .collect();
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); chosen.len()];
    // Two executors' pools (touched, as a warm KV pool is) and staging regions.
    let dir = std::path::Path::new(shm::DEFAULT_DIR);
    let slots = u32::try_from(blocks)?;
    // The exporter's pool in its shared region, as a CPU executor's with an agent is.
    let (exporter, mut shared_pool) =
        shm::Staging::create_with_pool(dir, block_bytes, slots, slots)?;
    let stagings = (exporter, shm::Staging::create(dir, block_bytes, slots)?);
    let mut pools = (block.repeat(blocks), vec![1u8; blocks * block_bytes]);
    shared_pool.bytes_mut().copy_from_slice(&pools.0);
    // The blocks the socket paths send, in memory of their own (as an executor's pool or an
    // agent's store holds them), not one block sent again from the cache.
    let source = Bytes::from(block.repeat(blocks));
    for round in 0..WARM_UP + args.rounds {
        for (i, &path) in chosen.iter().enumerate() {
            let tid = format!("{path}-{round}");
            let r = match path {
                "tcp" => tcp(blocks, &block).await?,
                "tcp-pools" => tcp_pools(&pools.0, &mut pools.1, block_bytes).await?,
                "push" | "grpc-push" => {
                    let r = push(&tid, &b, blocks, &source, bs, path == "grpc-push").await?;
                    done(tid).await?;
                    r
                }
                "put+push" => {
                    let r = export(&tid, &a, &b, blocks, &source, bs, false).await?;
                    done(tid).await?;
                    r
                }
                "whole-socket" => export(&tid, &a, &b, blocks, &source, bs, true).await?,
                _ => {
                    let shm = (&stagings, &shared_pool);
                    staged(&tid, (&a, &b), &mut pools, shm, bs, path == "whole").await?
                }
            };
            if round >= WARM_UP {
                runs[i].push(r);
            }
        }
    }
    let _ = stop_tx.send(true);
    let paired = |runs: &[f64], base: &[f64]| {
        median(&runs.iter().zip(base).map(|(r, b)| r / b).collect::<Vec<_>>())
    };
    let (base, pools_base) = (runs[0].clone(), runs[1].clone());
    let rows: Vec<KvBenchRow> = chosen
        .into_iter()
        .zip(runs)
        .map(|(path, mb_per_s)| KvBenchRow {
            path,
            ratio_to_tcp: paired(&mb_per_s, &base),
            ratio_to_tcp_pools: paired(&mb_per_s, &pools_base),
            mb_per_s,
        })
        .collect();
    print_rows(args, block_bytes, &rows)?;
    Ok(rows)
}

/// Prints `rows` as a table (or JSON with `--json`).
fn print_rows(args: &KvBenchArgs, block_bytes: usize, rows: &[KvBenchRow]) -> anyhow::Result<()> {
    if args.json {
        println!("{}", serde_json::to_string_pretty(rows)?);
    } else {
        println!(
            "{} MiB per run in blocks of {block_bytes} bytes ({} tokens)",
            args.mib, args.block_size
        );
        println!(
            "{:<12} {:>12} {:>8} {:>10}  runs (MB/s)",
            "path", "median MB/s", "vs tcp", "vs pools"
        );
        for r in rows {
            let runs: Vec<String> = r.mb_per_s.iter().map(|x| format!("{x:.0}")).collect();
            println!(
                "{:<12} {:>12.0} {:>8.2} {:>10.2}  {}",
                r.path,
                median(&r.mb_per_s),
                r.ratio_to_tcp,
                r.ratio_to_tcp_pools,
                runs.join(" ")
            );
        }
    }
    Ok(())
}
