//! The floor under a streaming server's cost per token: the least an async Rust server can do
//! for one streamed token. `ferry-bench write-floor` is that server: on tokio's multi-threaded
//! runtime (as Ferry's), one task per connection, woken through a channel once per token,
//! writes one SSE-sized chunk to its TCP connection (`TCP_NODELAY`, as Ferry's: no token waits
//! for an acknowledgement); a producer sends each connection a token per round, paced at the
//! rate the measured run streamed. No HTTP parsing, JSON, tokenizer or scheduler. The
//! control-plane bench starts it as a process of its own, reads its N connections from its own
//! runtime as the load generator reads Ferry's, and measures its CPU from `/proc` as it
//! measures Ferry's.
//!
//! Measured in the same run as Ferry, it is the baseline Ferry's per-token figure is read
//! against on a machine whose speed varies from minute to minute.

use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{Cpu, Proc};

/// A completion chunk as a server streams it under HTTP/1.1 chunked encoding (size line, the
/// SSE event, CRLF): 188 bytes, about what Ferry writes for a one-token chunk.
const CHUNK: &[u8] =
    b"b6\r\ndata: {\"id\":\"cmpl-7f3a9c2e41d0b8a6\",\"object\":\"text_completion\",\
\"created\":1765000000,\"model\":\"llama-3-8b\",\"choices\":[{\"index\":0,\"text\":\" the\",\
\"logprobs\":null,\"finish_reason\":null}]}\n\n\r\n";

/// Flags of `ferry-bench write-floor` (started by `ferry-bench control-plane`).
#[derive(Debug, clap::Args)]
pub struct WriteFloorArgs {
    /// Connections to accept before writing.
    #[arg(long)]
    pub connections: usize,
    /// Writes a second, all connections together.
    #[arg(long)]
    pub writes_per_s: f64,
    /// How long to write.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
}

/// The floor server: accepts `connections`, streams to each, closes them all.
pub async fn serve(args: &WriteFloorArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.connections > 0 && args.writes_per_s > 0.0, "nothing to write");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("ferry-bench listening floor={}", listener.local_addr()?);
    let mut senders = Vec::with_capacity(args.connections);
    let mut writers = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        let (mut stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<&'static [u8]>();
        senders.push(tx);
        writers.push(tokio::spawn(async move {
            while let Some(chunk) = rx.recv().await {
                stream.write_all(chunk).await?;
            }
            std::io::Result::Ok(())
        }));
    }
    let round = Duration::from_secs_f64(args.connections as f64 / args.writes_per_s);
    let rounds = (args.seconds / round.as_secs_f64()).ceil().max(1.0) as usize;
    let mut tick = tokio::time::interval(round);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for _ in 0..rounds {
        tick.tick().await;
        for tx in &senders {
            tx.send(CHUNK)?;
        }
    }
    drop(senders);
    for w in writers {
        w.await??;
    }
    Ok(())
}

/// The floor server's CPU per write at `writes_per_s` over `connections` connections, measured
/// for `seconds`: `bin` is this program.
pub(super) async fn measure(
    bin: &Path,
    connections: usize,
    writes_per_s: f64,
    seconds: f64,
) -> anyhow::Result<Cpu> {
    let args = [
        "write-floor".to_string(),
        format!("--connections={connections}"),
        format!("--writes-per-s={writes_per_s}"),
        format!("--seconds={seconds}"),
    ];
    let server = Proc::start(bin, &args, 1)?;
    let addr = server.addr("floor");
    let before = server.cpu()?;
    let mut readers = Vec::with_capacity(connections);
    let mut written = 0usize;
    for _ in 0..connections {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        readers.push(tokio::spawn(async move {
            let (mut buf, mut got) = (vec![0u8; 16 << 10], 0);
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return got,
                    Ok(n) => got += n,
                }
            }
        }));
    }
    for r in readers {
        written += r.await?;
    }
    let used = server.cpu()? - before;
    let writes = (written / CHUNK.len()).max(1) as f64;
    Ok(Cpu { user: used.user / writes, system: used.system / writes })
}
