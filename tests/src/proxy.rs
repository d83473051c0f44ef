//! A TCP proxy in front of a KV agent that corrupts what agents push through it: in each
//! data-channel `Push` connection (the agent-to-agent path), one byte of the first chunk's data
//! is flipped, after its CRC32C was computed. Everything else (gRPC, an executor's `Get`) goes
//! through unchanged. It follows the data channel's wire format
//! (`ferry_kv_transfer_svc::data`): magic, operation byte, `u32` header length and header,
//! then chunks, each a 20-byte head (`u32` block, `u64` offset, `u32` length, `u32` CRC32C)
//! and its bytes.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Result;

/// The data channel's first bytes and the `Push` operation.
const MAGIC: &[u8; 8] = b"FERRYKV1";
const OP_PUSH: u8 = 1;

/// A running proxy (its threads end with the process).
pub struct CorruptingProxy {
    addr: SocketAddr,
    corrupted: Arc<AtomicUsize>,
}

impl CorruptingProxy {
    /// A proxy on a free loopback port, forwarding to `upstream`.
    pub fn start(upstream: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let corrupted = Arc::new(AtomicUsize::new(0));
        let count = corrupted.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let count = count.clone();
                std::thread::spawn(move || {
                    if let Ok(up) = TcpStream::connect(upstream) {
                        let _ = relay(conn, up, &count);
                    }
                });
            }
        });
        Ok(Self { addr, corrupted })
    }

    /// Where to connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Pushes corrupted so far.
    pub fn corrupted(&self) -> usize {
        self.corrupted.load(Ordering::Relaxed)
    }
}

fn relay(client: TcpStream, upstream: TcpStream, corrupted: &AtomicUsize) -> io::Result<()> {
    let (mut from_up, mut to_client) = (upstream.try_clone()?, client.try_clone()?);
    let back = std::thread::spawn(move || {
        let _ = io::copy(&mut from_up, &mut to_client);
        let _ = to_client.shutdown(Shutdown::Write);
    });
    let (mut from, mut to) = (client, upstream);
    let result = forward(&mut from, &mut to, corrupted);
    let _ = to.shutdown(Shutdown::Write);
    let _ = back.join();
    result
}

/// Copies `from` to `to`, flipping one byte of a push's first chunk.
fn forward(from: &mut TcpStream, to: &mut TcpStream, corrupted: &AtomicUsize) -> io::Result<()> {
    let mut start = [0u8; 9];
    from.read_exact(&mut start)?;
    to.write_all(&start)?;
    if &start[..8] == MAGIC && start[8] == OP_PUSH {
        let mut len = [0u8; 4];
        from.read_exact(&mut len)?;
        to.write_all(&len)?;
        let header_len = u64::from(u32::from_le_bytes(len));
        io::copy(&mut from.take(header_len), to)?;
        let mut head = [0u8; 20];
        from.read_exact(&mut head)?;
        to.write_all(&head)?;
        let data_len = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes"));
        if data_len > 0 {
            let mut first = [0u8; 1];
            from.read_exact(&mut first)?;
            first[0] ^= 0x5a;
            to.write_all(&first)?;
            corrupted.fetch_add(1, Ordering::Relaxed);
        }
    }
    io::copy(from, to)?;
    Ok(())
}
