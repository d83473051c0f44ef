//! TLS and mutual TLS between Ferry's services (rustls, ring).
//!
//! **Identity is a role, not an address.** A service's certificate names its role among its
//! DNS names (`ferry-front`, `ferry-scheduler`, `ferry-executor`, `ferry-kv`; `ferry-client`
//! for an operator's tools). A caller checks that the service it reached holds the role it
//! meant to reach (a scheduler dialling an executor accepts only a certificate valid for
//! `ferry-executor`), and a service checks, once per connection, that its caller's certificate
//! holds a role allowed on that port: only a scheduler may drive an executor; executors,
//! agents and schedulers may use an agent; fronts, schedulers and clients may use a
//! scheduler's API. Pods come and go with new addresses, so certificates need not name them
//! (they may, for other tools).
//!
//! **Every connection, both ways, is mutual** on gRPC ports (and on the KV agents' data
//! channel, which shares the agent's port and is told apart by ALPN inside TLS). The OpenAI
//! HTTP API takes TLS without client certificates: API keys authenticate its callers.
//!
//! **Reloaded when they change**: the certificate, key and CA files are looked at every
//! [`RELOAD_EVERY`]; a change is read and, if the new files are valid, used for every new
//! connection from then on (a rotation needs no restart; connections already open keep their
//! session). A half-written or invalid set is logged and the previous one kept.
//!
//! One TLS set per process ([`install`]): `ferry serve`, which runs every role in one process,
//! takes a certificate naming every role.
//!
//! The parts: `certificates` reads the files, builds the rustls configurations and reloads
//! them; `role_verifier` checks a caller's role during the handshake; `dial` is the calling
//! side (gRPC channels, raw connections); `accept` is the serving side (the accept loop and its
//! refused-handshake counts).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;

mod accept;
mod certificates;
mod dial;
mod role_verifier;
#[cfg(test)]
mod tests;

pub use accept::{accept, is_data_channel, Callers, HandshakeMetrics, Listener, ServerStream};
pub use certificates::Tls;
pub use dial::{connect, connect_lazy, dialled_url, endpoint, public_client};

/// How often the certificate files are checked for a change.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// How long a new connection may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// ALPN of the KV agents' raw data channel inside TLS (gRPC negotiates `h2`).
pub const DATA_ALPN: &[u8] = b"ferry-kv-data/1";

/// What a certificate says its holder is: one of these DNS names among its subject names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// A stateless front (`ferry-scheduler front`).
    Front,
    /// A scheduler (with or without its own front).
    Scheduler,
    /// A model executor.
    Executor,
    /// A node's KV transfer agent.
    KvAgent,
    /// An operator's tool or a gRPC API client (grpcurl, scripts).
    Client,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 5] =
        [Role::Front, Role::Scheduler, Role::Executor, Role::KvAgent, Role::Client];

    /// The DNS name a certificate carries to hold this role.
    pub fn dns_name(self) -> &'static str {
        match self {
            Role::Front => "ferry-front",
            Role::Scheduler => "ferry-scheduler",
            Role::Executor => "ferry-executor",
            Role::KvAgent => "ferry-kv",
            Role::Client => "ferry-client",
        }
    }

    fn server_name(self) -> ServerName<'static> {
        ServerName::try_from(self.dns_name()).expect("role names are DNS names")
    }
}

/// Who may connect to an executor's port.
pub const EXECUTOR_CALLERS: &[Role] = &[Role::Scheduler];
/// Who may connect to a KV agent's port (gRPC and data channel).
pub const AGENT_CALLERS: &[Role] = &[Role::Executor, Role::KvAgent, Role::Scheduler];
/// Who may connect to a scheduler's or a front's gRPC port.
pub const API_CALLERS: &[Role] = &[Role::Front, Role::Scheduler, Role::Client];

/// The TLS flags every service takes.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct TlsArgs {
    /// Mutual TLS: this service's certificate chain (PEM). Its DNS names include its role
    /// (`ferry-front`, `ferry-scheduler`, `ferry-executor`, `ferry-kv`; all of them for
    /// `ferry serve`). Reloaded when the file changes. With --tls-key and --tls-ca.
    #[arg(long = "tls-cert", env = "FERRY_TLS_CERT")]
    pub cert: Option<PathBuf>,
    /// Mutual TLS: the certificate's private key (PEM).
    #[arg(long = "tls-key", env = "FERRY_TLS_KEY")]
    pub key: Option<PathBuf>,
    /// Mutual TLS: the CA certificates (PEM) every peer's certificate must chain to.
    #[arg(long = "tls-ca", env = "FERRY_TLS_CA")]
    pub ca: Option<PathBuf>,
    /// Serve and call plaintext although a listen address is not loopback (without TLS
    /// flags, only loopback addresses are served plaintext).
    #[arg(long, env = "FERRY_PLAINTEXT")]
    pub plaintext: bool,
}

/// A TLS flag, file or certificate that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Some of the three files but not all.
    #[error("--tls-cert, --tls-key and --tls-ca go together (mutual TLS needs all three)")]
    Partial,
    /// Plaintext asked for beside TLS files.
    #[error("--plaintext contradicts --tls-cert/--tls-key/--tls-ca: give one or the other")]
    Contradiction,
    /// A non-loopback listen address without TLS or an explicit `--plaintext`.
    #[error(
        "--{flag} {addr} is reachable from other machines: give --tls-cert, --tls-key and \
         --tls-ca for mutual TLS, or --plaintext to serve plaintext on purpose"
    )]
    Unprotected {
        /// The listen flag.
        flag: &'static str,
        /// Its value.
        addr: String,
    },
    /// A file that could not be read or parsed.
    #[error("{what} {path}: {reason}")]
    File {
        /// Which file (`--tls-cert` …).
        what: &'static str,
        /// Where.
        path: String,
        /// Why.
        reason: String,
    },
    /// rustls refused the set (a key that does not match its certificate, …).
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    /// The CA file holds a certificate rustls cannot use as a root.
    #[error("--tls-ca {0}: no usable CA certificate")]
    NoRoots(String),
}

impl TlsArgs {
    /// Whether mutual TLS is asked for (every peer then shows a certificate naming its role).
    pub fn mutual(&self) -> bool {
        self.cert.is_some() && self.key.is_some() && self.ca.is_some()
    }

    /// Checks the flags against the listen addresses (`(flag, address)`), reading nothing.
    pub fn validate(&self, listens: &[(&'static str, &str)]) -> Result<(), TlsError> {
        let given = [&self.cert, &self.key, &self.ca].iter().filter(|p| p.is_some()).count();
        if given != 0 && given != 3 {
            return Err(TlsError::Partial);
        }
        if given == 3 && self.plaintext {
            return Err(TlsError::Contradiction);
        }
        if given == 0 && !self.plaintext {
            if let Some((flag, addr)) = listens.iter().find(|(_, a)| !is_loopback(a)) {
                return Err(TlsError::Unprotected { flag, addr: (*addr).to_string() });
            }
        }
        Ok(())
    }
}

/// Whether a listen address (`host:port`) is reachable only from this machine.
pub fn is_loopback(addr: &str) -> bool {
    if let Ok(sa) = addr.parse::<std::net::SocketAddr>() {
        return sa.ip().is_loopback();
    }
    addr.rsplit_once(':').is_some_and(|(host, _)| host == "localhost")
}

/// What a client connection speaks (its ALPN).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// gRPC (`h2`).
    Grpc,
    /// The KV agents' data channel ([`DATA_ALPN`]).
    Data,
    /// HTTP/1.1.
    Http1,
}

impl Protocol {
    const ALL: [Protocol; 3] = [Protocol::Grpc, Protocol::Data, Protocol::Http1];

    fn alpn(self) -> &'static [u8] {
        match self {
            Protocol::Grpc => b"h2",
            Protocol::Data => DATA_ALPN,
            Protocol::Http1 => b"http/1.1",
        }
    }
}

/// The crypto every configuration here uses (ring: what tonic and etcd-client build).
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn file_error(what: &'static str, path: &Path, reason: impl std::fmt::Display) -> TlsError {
    TlsError::File { what, path: path.display().to_string(), reason: reason.to_string() }
}

static PROCESS: OnceLock<Tls> = OnceLock::new();

/// Makes `tls` this process's identity for every server and client from now on, and starts
/// watching its files. The first call wins; call it once, at start-up, inside the runtime.
pub fn install(tls: Tls) {
    let watched = tls.clone();
    if PROCESS.set(tls).is_ok() {
        watched.watch();
    }
}

/// The process's TLS, if [`install`]ed.
pub fn current() -> Option<Tls> {
    PROCESS.get().cloned()
}

/// Reads the files of flags already checked ([`TlsArgs::validate`]) and installs them; logs
/// which mode the process runs in.
pub fn start(args: &TlsArgs) -> Result<(), TlsError> {
    match args.load()? {
        Some(tls) => {
            tracing::info!("mutual TLS on every internal link");
            install(tls);
        }
        None if args.plaintext => tracing::warn!("plaintext on every link (--plaintext)"),
        None => tracing::info!("plaintext: every listen address is loopback"),
    }
    Ok(())
}
