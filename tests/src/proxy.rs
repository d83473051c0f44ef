//! A TCP proxy in front of a KV agent that does a fault to what agents push through it, in
//! each data-channel `Push` connection (the agent-to-agent path): it flips one byte of the
//! first chunk's data, after its CRC32C was computed ([`Fault::Corrupt`]), or it holds the
//! push after the first chunk's head until released ([`Fault::Stall`]: the push is then
//! certainly in the middle when the test kills its sender). Everything else (gRPC, an
//! executor's `Get`) goes through unchanged. It follows the data channel's wire format
//! (`ferry_kv_wire::data_channel`): magic, operation byte, `u32` header length and header,
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

/// What the proxy does to each push.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Flip a byte of the first chunk's data.
    Corrupt,
    /// Hold the push after the first chunk's head until [`PushProxy::release`].
    Stall,
}

/// What the proxy threads share.
struct Shared {
    fault: Fault,
    /// Pushes it did its fault to.
    faulted: AtomicUsize,
    released: std::sync::atomic::AtomicBool,
}

/// A running proxy (its threads end with the process).
pub struct PushProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl PushProxy {
    /// A proxy on a free loopback port, forwarding to `upstream`, doing `fault` to pushes.
    pub fn start(upstream: SocketAddr, fault: Fault) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            fault,
            faulted: AtomicUsize::new(0),
            released: std::sync::atomic::AtomicBool::new(false),
        });
        let threads = shared.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let shared = threads.clone();
                std::thread::spawn(move || {
                    if let Ok(up) = TcpStream::connect(upstream) {
                        let _ = relay(conn, up, &shared);
                    }
                });
            }
        });
        Ok(Self { addr, shared })
    }

    /// Where to connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Pushes corrupted or stalled so far.
    pub fn faulted(&self) -> usize {
        self.shared.faulted.load(Ordering::Relaxed)
    }

    /// Lets stalled pushes (and later ones) go on.
    pub fn release(&self) {
        self.shared.released.store(true, Ordering::Relaxed);
    }
}

fn relay(client: TcpStream, upstream: TcpStream, shared: &Shared) -> io::Result<()> {
    let (mut from_up, mut to_client) = (upstream.try_clone()?, client.try_clone()?);
    let back = std::thread::spawn(move || {
        let _ = io::copy(&mut from_up, &mut to_client);
        let _ = to_client.shutdown(Shutdown::Write);
    });
    let (mut from, mut to) = (client, upstream);
    let result = forward(&mut from, &mut to, shared);
    let _ = to.shutdown(Shutdown::Write);
    let _ = back.join();
    result
}

/// Copies `from` to `to`, doing the fault to a push's first chunk.
fn forward(from: &mut TcpStream, to: &mut TcpStream, shared: &Shared) -> io::Result<()> {
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
        match shared.fault {
            Fault::Corrupt if data_len > 0 => {
                let mut first = [0u8; 1];
                from.read_exact(&mut first)?;
                first[0] ^= 0x5a;
                to.write_all(&first)?;
                shared.faulted.fetch_add(1, Ordering::Relaxed);
            }
            Fault::Corrupt => {}
            Fault::Stall => {
                shared.faulted.fetch_add(1, Ordering::Relaxed);
                while !shared.released.load(Ordering::Relaxed) {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
        }
    }
    io::copy(from, to)?;
    Ok(())
}
