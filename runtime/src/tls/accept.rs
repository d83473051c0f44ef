//! The serving side: the accept loop that runs each connection's TLS handshake in its own task
//! and hands on the connections whose caller may use the port, the count of refused
//! handshakes (`ferry_tls_handshakes_refused`), and the listener axum serves the HTTP API on.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::rustls::ServerConfig;

use super::certificates::{Configs, Tls};
use super::role_verifier::role_refusal;
use super::{Role, DATA_ALPN, HANDSHAKE_TIMEOUT};

/// At most one log line per this long about refused handshakes (a scanner or a client with a
/// stale certificate would otherwise write one per attempt); the metric counts every one.
const REFUSED_LOG_EVERY: Duration = Duration::from_secs(10);

/// A connection accepted over TLS.
pub type ServerStream = tokio_rustls::server::TlsStream<TcpStream>;

/// Which callers a listener takes.
#[derive(Clone, Copy, Debug)]
pub enum Callers {
    /// Clients with a certificate from the CA holding one of these roles (mutual TLS).
    Roles(&'static [Role]),
    /// Any client (the HTTP API): server authentication only.
    Anyone,
}

/// Accepts on `listener` and runs each connection's handshake in its own task; yields the
/// connections whose peer is among `callers`, each with its remote address. A refused peer
/// (no certificate, another CA, a role not allowed here) is logged and closed. The loop stops
/// when the receiver is dropped.
pub fn accept(
    tls: Tls,
    listener: TcpListener,
    callers: Callers,
) -> mpsc::Receiver<(ServerStream, std::net::SocketAddr)> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        // The port's configuration, built again when the files are reloaded.
        let mut built: Option<(Arc<Configs>, Arc<ServerConfig>)> = None;
        loop {
            let (tcp, remote) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors and the like: pause instead of spinning.
                        tracing::warn!(error = %e, "accept");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = tx.closed() => return,
            };
            let configs = tls.configs();
            let config = match callers {
                Callers::Anyone => configs.public.clone(),
                Callers::Roles(_) => match &built {
                    Some((from, config)) if Arc::ptr_eq(from, &configs) => config.clone(),
                    _ => match configs.mutual() {
                        Ok(config) => {
                            built = Some((configs, config.clone()));
                            config
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "TLS configuration for a port");
                            continue;
                        }
                    },
                },
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let _ = tcp.set_nodelay(true);
                let acceptor = tokio_rustls::TlsAcceptor::from(config);
                let conn = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await
                {
                    Ok(Ok(conn)) => conn,
                    Ok(Err(e)) => return refused(remote, &e, false),
                    Err(_) => return refused(remote, &"no handshake within 10 s", true),
                };
                if let Callers::Roles(allowed) = callers {
                    let cert = conn.get_ref().1.peer_certificates().and_then(<[_]>::first);
                    if let Some(why) = role_refusal(cert, allowed) {
                        refused(remote, &why, false);
                        return explain_refusal(conn, why).await;
                    }
                }
                let _ = tx.send((conn, remote)).await;
            });
        }
    });
    rx
}

/// Answers a gRPC caller whose certificate holds no role the port takes: every call it makes
/// on the connection (for as long as a handshake may take) fails `UNAUTHENTICATED` with `why`,
/// and nothing else is served to it; any other protocol is closed at once.
async fn explain_refusal(conn: ServerStream, why: String) {
    use tokio::io::AsyncWriteExt;
    if conn.get_ref().1.alpn_protocol() != Some(b"h2".as_slice()) {
        let mut conn = conn;
        let _ = conn.shutdown().await;
        return;
    }
    let status = tonic::Status::unauthenticated(why);
    let answer =
        tower::service_fn(move |_: tonic::codegen::http::Request<hyper::body::Incoming>| {
            let response = status.clone().into_http::<tonic::body::Body>();
            async move { Ok::<_, std::convert::Infallible>(response) }
        });
    let server = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    let serving = server.serve_connection(
        hyper_util::rt::TokioIo::new(conn),
        hyper_util::service::TowerToHyperService::new(answer),
    );
    let _ = tokio::time::timeout(HANDSHAKE_TIMEOUT, serving).await;
}

/// Handshakes this process's ports refused, by why: the peer failed the handshake (no
/// certificate, another CA, a role not allowed, not TLS at all), or did not finish it in time.
static REFUSED: [crate::prometheus::Counter; 2] =
    [crate::prometheus::Counter::new(), crate::prometheus::Counter::new()];

/// When refused handshakes were last logged, and how many since were not.
static REFUSED_LOG: std::sync::Mutex<(Option<std::time::Instant>, u64)> =
    std::sync::Mutex::new((None, 0));

/// Counts a refused handshake and logs it, at most once per [`REFUSED_LOG_EVERY`].
fn refused(remote: std::net::SocketAddr, why: &dyn std::fmt::Display, timed_out: bool) {
    REFUSED[usize::from(timed_out)].add(1);
    let mut log = REFUSED_LOG.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let now = std::time::Instant::now();
    if log.0.is_some_and(|last| now.duration_since(last) < REFUSED_LOG_EVERY) {
        log.1 += 1;
        return;
    }
    let unlogged = std::mem::take(&mut log.1);
    log.0 = Some(now);
    drop(log);
    tracing::warn!(
        %remote,
        error = %why,
        unlogged_since_last = unlogged,
        "TLS handshake refused (see ferry_tls_handshakes_refused)"
    );
}

/// `ferry_tls_handshakes_refused{reason}`: what [`accept`] refused, for every port of the
/// process.
pub struct HandshakeMetrics;

impl crate::prometheus::Render for HandshakeMetrics {
    fn render(&self, out: &mut crate::prometheus::Text) {
        let name = "ferry_tls_handshakes_refused";
        out.family(
            name,
            "counter",
            "TLS handshakes refused on this process's ports (no or untrusted certificate, a role \
             not allowed on the port, not TLS, or too slow)",
        );
        out.sample(name, &[("reason", "refused")], REFUSED[0].get() as f64);
        out.sample(name, &[("reason", "timeout")], REFUSED[1].get() as f64);
    }
}

/// A listener for axum (the HTTP API) whose connections are TLS ([`accept`]).
pub struct Listener {
    conns: mpsc::Receiver<(ServerStream, std::net::SocketAddr)>,
    local: std::net::SocketAddr,
}

impl Listener {
    /// Accepts TLS connections from `callers` on `listener`.
    pub fn new(tls: Tls, listener: TcpListener, callers: Callers) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        Ok(Self { conns: accept(tls, listener, callers), local })
    }
}

impl axum::serve::Listener for Listener {
    type Io = ServerStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.conns.recv().await {
            Some(conn) => conn,
            // The accept loop ends only with this receiver; never reached.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

/// Whether an accepted connection negotiated the KV data channel.
pub fn is_data_channel(conn: &ServerStream) -> bool {
    conn.get_ref().1.alpn_protocol() == Some(DATA_ALPN)
}
