//! A raw TCP protocol on a gRPC service's own port: connections that open with the side
//! channel's magic bytes go to its handler, all others to the gRPC (and `/metrics`) server.
//!
//! Why: bulk data (KV blocks between nodes) moves several times faster as plain length-framed
//! bytes than as HTTP/2 frames of protobuf messages, yet operators should see one address per
//! service. Sniffing the first bytes keeps one port: an HTTP/2 client starts with its preface
//! (`PRI * HTTP/2.0`), an HTTP/1.1 client with a method, and neither starts with the magic.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// What takes over a side-channel connection: over plain TCP, one that opened with the magic
/// bytes (still unread); under TLS, one that negotiated [`crate::tls::DATA_ALPN`] (its client
/// sends the magic all the same).
pub type Handler = Arc<dyn Fn(Conn) + Send + Sync>;

/// A side-channel connection.
pub enum Conn {
    /// Plain TCP.
    Tcp(TcpStream),
    /// Mutual TLS.
    Tls(Box<crate::tls::ServerStream>),
}

/// The reading half of a connection, whatever carries it.
pub type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
/// The writing half of a connection, whatever carries it.
pub type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

impl Conn {
    /// Its two halves, usable from two tasks.
    pub fn into_split(self) -> (ReadHalf, WriteHalf) {
        match self {
            Conn::Tcp(tcp) => tcp_halves(tcp),
            Conn::Tls(tls) => halves(*tls),
        }
    }
}

/// The halves of a TCP stream (no lock between them).
pub fn tcp_halves(tcp: TcpStream) -> (ReadHalf, WriteHalf) {
    let (r, w) = tcp.into_split();
    (Box::new(r), Box::new(w))
}

/// The halves of any stream (TLS streams cannot be split without a lock; this is tokio's).
pub fn halves<S: AsyncRead + AsyncWrite + Send + 'static>(stream: S) -> (ReadHalf, WriteHalf) {
    let (r, w) = tokio::io::split(stream);
    (Box::new(r), Box::new(w))
}

/// A side channel: its magic bytes and its handler.
#[derive(Clone)]
pub struct SideChannel {
    /// The bytes a side-channel connection starts with.
    pub magic: &'static [u8],
    /// Takes each such connection.
    pub handler: Handler,
}

/// How long a new connection may take to send enough bytes to tell which protocol it speaks.
/// Clients send their first bytes (the magic, or HTTP/2's preface) in one write, so only a
/// broken or hostile client takes long; past this its connection goes to the gRPC server,
/// which refuses what it sent.
const SNIFF_TIMEOUT: Duration = Duration::from_secs(2);

/// Accepts on `listener`, giving side-channel connections to `side` and yielding the others.
/// The accept loop stops when the returned stream is dropped.
pub fn split(
    listener: TcpListener,
    side: SideChannel,
) -> ReceiverStream<std::io::Result<TcpStream>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let conn = tokio::select! {
                accepted = listener.accept() => accepted.map(|(c, _)| c),
                () = tx.closed() => return,
            };
            match conn {
                Ok(conn) => {
                    let (tx, side) = (tx.clone(), side.clone());
                    tokio::spawn(async move {
                        if opens_with(&conn, side.magic).await {
                            (side.handler)(Conn::Tcp(conn));
                        } else {
                            let _ = tx.send(Ok(conn)).await;
                        }
                    });
                }
                Err(e) => {
                    if tx.send(Err(e)).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    ReceiverStream::new(rx)
}

/// Whether `conn`'s first bytes are `magic` (without reading them).
async fn opens_with(conn: &TcpStream, magic: &[u8]) -> bool {
    let mut buf = [0u8; 16];
    let want = magic.len().min(buf.len());
    let sniff = async {
        // Peeking cannot tell "no more yet" from "closed after part of the magic" (found by
        // fuzzing: one byte, then a close, held a task waking every millisecond), so the
        // wait between looks grows: 1 ms at first, at most 64 ms.
        let mut pause = Duration::from_millis(1);
        loop {
            let n = conn.peek(&mut buf[..want]).await.unwrap_or(0);
            if n == 0 || buf[..n] != magic[..n] {
                return false; // closed, or another protocol
            }
            if n == want {
                return true;
            }
            // Part of the magic so far: wait for more.
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(64));
        }
    };
    tokio::time::timeout(SNIFF_TIMEOUT, sniff).await.unwrap_or(false)
}
