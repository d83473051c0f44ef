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

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};
use tonic::transport::{Channel, Endpoint, Uri};

/// How often the certificate files are checked for a change.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// How long a new connection may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// At most one log line per this long about refused handshakes (a scanner or a client with a
/// stale certificate would otherwise write one per attempt); the metric counts every one.
const REFUSED_LOG_EVERY: Duration = Duration::from_secs(10);

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

    /// Reads the files: `None` when TLS is off.
    pub fn load(&self) -> Result<Option<Tls>, TlsError> {
        let (Some(cert), Some(key), Some(ca)) = (&self.cert, &self.key, &self.ca) else {
            return Ok(None);
        };
        let files = Files { cert: cert.clone(), key: key.clone(), ca: ca.clone() };
        let contents = files.read()?;
        let configs = Configs::parse(&files, &contents)?;
        Ok(Some(Tls {
            shared: Arc::new(Shared {
                files,
                current: RwLock::new(Arc::new(configs)),
                last: std::sync::Mutex::new(contents),
            }),
        }))
    }
}

/// Whether a listen address (`host:port`) is reachable only from this machine.
fn is_loopback(addr: &str) -> bool {
    if let Ok(sa) = addr.parse::<std::net::SocketAddr>() {
        return sa.ip().is_loopback();
    }
    addr.rsplit_once(':').is_some_and(|(host, _)| host == "localhost")
}

/// A process's TLS identity and trust, reloaded when its files change.
#[derive(Clone)]
pub struct Tls {
    shared: Arc<Shared>,
}

struct Shared {
    files: Files,
    current: RwLock<Arc<Configs>>,
    /// The files' contents the current set was built from.
    last: std::sync::Mutex<[Vec<u8>; 3]>,
}

#[derive(Clone)]
struct Files {
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
}

impl Files {
    /// The certificate, key and CA files' contents, read once and both compared (a change is
    /// seen by content, not modification time: a rewrite within the file system's time
    /// granularity, or a secret volume's symlink swap, counts) and parsed.
    fn read(&self) -> Result<[Vec<u8>; 3], TlsError> {
        let read =
            |what, path: &PathBuf| std::fs::read(path).map_err(|e| file_error(what, path, e));
        Ok([
            read("--tls-cert", &self.cert)?,
            read("--tls-key", &self.key)?,
            read("--tls-ca", &self.ca)?,
        ])
    }
}

/// The rustls configurations built from one set of files.
struct Configs {
    /// This service's certificate chain and key.
    identity: (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>),
    /// Checks a client's chain against the CA.
    chain: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    /// The HTTP API: no client certificate.
    public: Arc<ServerConfig>,
    /// Calls presenting this service's certificate, one per [`Protocol`] (their ALPN).
    clients: [Arc<ClientConfig>; 3],
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

impl Configs {
    /// Builds the set from the files' `contents` (cert, key, CA; `files` names them in errors).
    fn parse(files: &Files, [cert, key, ca]: &[Vec<u8>; 3]) -> Result<Self, TlsError> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<_, _>>()
            .map_err(|e| file_error("--tls-cert", &files.cert, e))?;
        if certs.is_empty() {
            return Err(file_error("--tls-cert", &files.cert, "no certificate in the file"));
        }
        let key = PrivateKeyDer::from_pem_slice(key)
            .map_err(|e| file_error("--tls-key", &files.key, e))?;
        let roots = parse_roots(&files.ca, ca)?;
        let provider = provider();
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| file_error("--tls-ca", &files.ca, e))?;
        let mut public = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(certs.clone(), key.clone_key())?;
        public.alpn_protocols = vec![b"http/1.1".to_vec()];
        let base = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs.clone(), key.clone_key())?;
        let clients = Protocol::ALL.map(|p| {
            let mut c = base.clone();
            c.alpn_protocols = vec![p.alpn().to_vec()];
            Arc::new(c)
        });
        Ok(Self { identity: (certs, key), chain: verifier, public: Arc::new(public), clients })
    }
}

impl Configs {
    /// A port's configuration: client certificates from the CA holding one of `allowed`
    /// (checked during the handshake, so a refused client is told why at once); ALPN h2, the
    /// data channel, and HTTP/1.1 for `/metrics`.
    fn mutual(&self, allowed: &'static [Role]) -> Result<Arc<ServerConfig>, TlsError> {
        let verifier = Arc::new(RoleVerifier { chain: self.chain.clone(), allowed });
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.identity.0.clone(), self.identity.1.clone_key())?;
        config.alpn_protocols = Protocol::ALL.map(|p| p.alpn().to_vec()).to_vec();
        Ok(Arc::new(config))
    }
}

/// Checks a client's chain, then that it holds a role allowed on the port.
#[derive(Debug)]
struct RoleVerifier {
    chain: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    allowed: &'static [Role],
}

/// A client certificate that chains to the CA but names no role allowed on the port.
#[derive(thiserror::Error)]
#[error("the client certificate names none of the roles allowed on this port ({0})")]
struct RoleRefused(String);

impl std::fmt::Debug for RoleRefused {
    // rustls shows its `Other` errors with `Debug`: say it in words.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")
    }
}

impl rustls::server::danger::ClientCertVerifier for RoleVerifier {
    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.chain.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        let verified = self.chain.verify_client_cert(end_entity, intermediates, now)?;
        if holds_role(end_entity, self.allowed).is_some() {
            return Ok(verified);
        }
        let names: Vec<_> = self.allowed.iter().map(|r| r.dns_name()).collect();
        let refused = RoleRefused(names.join(", "));
        Err(rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
            Arc::new(refused),
        ))))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.chain.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.chain.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.chain.supported_verify_schemes()
    }
}

/// The CA certificates in `pem` (the contents of `path`).
fn parse_roots(path: &Path, pem: &[u8]) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| file_error("--tls-ca", path, e))?;
        roots.add(cert).map_err(|e| file_error("--tls-ca", path, e))?;
    }
    if roots.is_empty() {
        return Err(TlsError::NoRoots(path.display().to_string()));
    }
    Ok(Arc::new(roots))
}

/// A client configuration that trusts the CA in `ca` and presents no certificate (for a
/// client of the HTTP API, such as the load generator).
pub fn public_client(ca: &Path) -> Result<Arc<ClientConfig>, TlsError> {
    let pem = std::fs::read(ca).map_err(|e| file_error("--tls-ca", ca, e))?;
    let roots = parse_roots(ca, &pem)?;
    let mut c = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    c.alpn_protocols = vec![Protocol::Http1.alpn().to_vec()];
    Ok(Arc::new(c))
}

impl Tls {
    fn configs(&self) -> Arc<Configs> {
        self.shared.current.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Reads the files again if they changed since the last look; true if a new set is in use.
    pub fn reload_if_changed(&self) -> bool {
        // Unreadable for now (mid-rotation): look again next time.
        let Ok(contents) = self.shared.files.read() else { return false };
        {
            let mut last =
                self.shared.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if *last == contents {
                return false;
            }
            last.clone_from(&contents);
        }
        match Configs::parse(&self.shared.files, &contents) {
            Ok(configs) => {
                *self.shared.current.write().unwrap_or_else(std::sync::PoisonError::into_inner) =
                    Arc::new(configs);
                tracing::info!(cert = %self.shared.files.cert.display(), "TLS certificates reloaded");
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "TLS files changed but cannot be used; keeping the previous set");
                false
            }
        }
    }

    /// Looks at the files every [`RELOAD_EVERY`] for as long as the runtime runs.
    fn watch(&self) {
        let tls = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(RELOAD_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                tls.reload_if_changed();
            }
        });
    }

    /// Opens a TLS connection to `hostport` speaking `protocol`, checking that the server
    /// holds `peer`'s role and presenting this service's certificate.
    pub async fn connect(
        &self,
        hostport: &str,
        peer: Role,
        protocol: Protocol,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let config = self.configs().clients[protocol as usize].clone();
        let tcp = TcpStream::connect(hostport).await?;
        tcp.set_nodelay(true)?;
        let connector = tokio_rustls::TlsConnector::from(config);
        tokio::time::timeout(HANDSHAKE_TIMEOUT, connector.connect(peer.server_name(), tcp))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake"))?
    }
}

/// A gRPC endpoint for `address` (`host:port`, or a URL whose scheme is ignored: the process's
/// TLS decides), to add settings to before [`connect`] or [`connect_lazy`].
pub fn endpoint(address: &str) -> Result<Endpoint, tonic::transport::Error> {
    let hostport =
        address.split_once("://").map_or(address, |(_, rest)| rest).trim_end_matches('/');
    Endpoint::from_shared(format!("http://{hostport}"))
}

/// Connects to `endpoint`, a service holding `peer`'s role: over mutual TLS when the process
/// has TLS, plaintext otherwise.
pub async fn connect(endpoint: &Endpoint, peer: Role) -> Result<Channel, tonic::transport::Error> {
    match current() {
        Some(tls) => endpoint.connect_with_connector(connector(tls, peer)).await,
        None => endpoint.connect().await,
    }
}

/// [`connect`], connecting on first use (and again after a failure).
pub fn connect_lazy(endpoint: &Endpoint, peer: Role) -> Channel {
    match current() {
        Some(tls) => endpoint.connect_with_connector_lazy(connector(tls, peer)),
        None => endpoint.connect_lazy(),
    }
}

/// The connector tonic dials through: TCP, then TLS checking the server holds `peer`'s role.
fn connector(
    tls: Tls,
    peer: Role,
) -> impl tower::Service<
    Uri,
    Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>,
    Error = std::io::Error,
    Future = impl Send,
> + Clone
       + Send {
    tower::service_fn(move |uri: Uri| {
        let tls = tls.clone();
        async move {
            let host = uri.host().unwrap_or_default();
            let port = uri.port_u16().unwrap_or(80);
            Ok(TokioIo::new(tls.connect(&format!("{host}:{port}"), peer, Protocol::Grpc).await?))
        }
    })
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

/// The role a certificate holds among `allowed`, if any.
fn holds_role(cert: &CertificateDer<'_>, allowed: &[Role]) -> Option<Role> {
    let cert = webpki::EndEntityCert::try_from(cert).ok()?;
    allowed
        .iter()
        .copied()
        .find(|role| cert.verify_is_valid_for_subject_name(&role.server_name()).is_ok())
}

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
                Callers::Roles(allowed) => match &built {
                    Some((from, config)) if Arc::ptr_eq(from, &configs) => config.clone(),
                    _ => match configs.mutual(allowed) {
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
                let _ = tx.send((conn, remote)).await;
            });
        }
    });
    rx
}

/// Handshakes this process's ports refused, by why: the peer failed the handshake (no
/// certificate, another CA, a role not allowed, not TLS at all), or did not finish it in time.
static REFUSED: [crate::metrics::Counter; 2] =
    [crate::metrics::Counter::new(), crate::metrics::Counter::new()];

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

impl crate::metrics::Render for HandshakeMetrics {
    fn render(&self, out: &mut crate::metrics::Text) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cert: bool, plaintext: bool) -> TlsArgs {
        let p = |s: &str| cert.then(|| PathBuf::from(s));
        TlsArgs { cert: p("c.pem"), key: p("k.pem"), ca: p("ca.pem"), plaintext }
    }

    #[test]
    fn plaintext_only_on_loopback_unless_asked() {
        let lo = [("listen", "127.0.0.1:0"), ("http-listen", "localhost:8000")];
        let wide = [("listen", "127.0.0.1:0"), ("http-listen", "0.0.0.0:8000")];
        assert!(args(false, false).validate(&lo).is_ok());
        assert!(args(false, false).validate(&[("listen", "[::1]:1")]).is_ok());
        let err = args(false, false).validate(&wide).unwrap_err().to_string();
        assert!(err.contains("--http-listen 0.0.0.0:8000") && err.contains("--plaintext"), "{err}");
        assert!(args(false, true).validate(&wide).is_ok());
        assert!(args(true, false).validate(&wide).is_ok());
        assert!(matches!(args(true, true).validate(&lo), Err(TlsError::Contradiction)));
        let partial = TlsArgs { cert: Some("c.pem".into()), ..TlsArgs::default() };
        assert!(matches!(partial.validate(&lo), Err(TlsError::Partial)));
    }

    /// Writes a CA and a certificate for `names` signed by it into `dir` (`cert.pem`,
    /// `key.pem`, `ca.pem`); returns the key's PEM.
    fn write_set(dir: &Path, names: &[&str]) -> String {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(ca, ca_key);
        let key = rcgen::KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|n| (*n).to_string()).collect();
        let cert = rcgen::CertificateParams::new(names).unwrap().signed_by(&key, &issuer).unwrap();
        std::fs::write(dir.join("ca.pem"), ca_cert.pem()).unwrap();
        std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
        std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
        key.serialize_pem()
    }

    #[test]
    fn a_changed_set_is_used_and_a_broken_one_is_not() {
        let dir = std::env::temp_dir().join(format!("ferry-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_set(&dir, &["ferry-kv"]);
        let args = TlsArgs {
            cert: Some(dir.join("cert.pem")),
            key: Some(dir.join("key.pem")),
            ca: Some(dir.join("ca.pem")),
            plaintext: false,
        };
        let tls = args.load().unwrap().expect("TLS on");
        let first = tls.configs();
        assert!(!tls.reload_if_changed(), "nothing changed");
        assert!(Arc::ptr_eq(&first, &tls.configs()));

        // A key that is not the certificate's: refused, the first set stays in use.
        let other = tempfile_key(&dir);
        std::fs::write(dir.join("key.pem"), other).unwrap();
        assert!(!tls.reload_if_changed(), "a mismatched key was taken");
        assert!(Arc::ptr_eq(&first, &tls.configs()));

        // A whole new valid set: used from now on.
        write_set(&dir, &["ferry-kv"]);
        assert!(tls.reload_if_changed(), "a valid new set was not taken");
        assert!(!Arc::ptr_eq(&first, &tls.configs()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The key of a fresh, unrelated set (written to a side directory).
    fn tempfile_key(dir: &Path) -> String {
        let side = dir.join("side");
        std::fs::create_dir_all(&side).unwrap();
        write_set(&side, &["ferry-kv"])
    }

    #[test]
    fn a_role_is_a_dns_name_of_the_certificate() {
        let dir = std::env::temp_dir().join(format!("ferry-tls-role-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_set(&dir, &["ferry-executor", "node-a"]);
        let pem = std::fs::read(dir.join("cert.pem")).unwrap();
        let cert = CertificateDer::from_pem_slice(&pem).unwrap();
        assert_eq!(holds_role(&cert, &Role::ALL), Some(Role::Executor));
        assert_eq!(holds_role(&cert, EXECUTOR_CALLERS), None, "an executor may not drive one");
        assert_eq!(holds_role(&cert, AGENT_CALLERS), Some(Role::Executor));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn missing_files_are_named() {
        let err = args(true, false).load().err().expect("no such files").to_string();
        assert!(err.starts_with("--tls-cert c.pem"), "{err}");
    }
}
