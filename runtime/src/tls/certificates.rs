//! The certificate, key and CA files, and the rustls configurations built from them: read at
//! start-up, looked at again every [`RELOAD_EVERY`], and replaced only by a set that parses
//! whole (a half-written or invalid set is logged and the previous one kept). Connections
//! already open keep their session; every new one uses the set in use when it starts.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};

use super::role_verifier::RoleVerifier;
use super::{file_error, provider, Protocol, TlsArgs, TlsError, RELOAD_EVERY};

impl TlsArgs {
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
pub(super) struct Configs {
    /// This service's certificate chain and key.
    identity: (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>),
    /// Checks a client's chain against the CA.
    chain: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    /// The HTTP API: no client certificate.
    pub(super) public: Arc<ServerConfig>,
    /// Calls presenting this service's certificate, one per [`Protocol`] (their ALPN).
    pub(super) clients: [Arc<ClientConfig>; 3],
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
    /// A port's configuration: client certificates from the CA (the role each holds is
    /// checked after the handshake, [`super::role_verifier::role_refusal`]); ALPN h2, the data
    /// channel, and HTTP/1.1 for `/metrics`.
    pub(super) fn mutual(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let verifier = Arc::new(RoleVerifier { chain: self.chain.clone() });
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.identity.0.clone(), self.identity.1.clone_key())?;
        config.alpn_protocols = Protocol::ALL.map(|p| p.alpn().to_vec()).to_vec();
        Ok(Arc::new(config))
    }
}

/// The CA certificates in `pem` (the contents of `path`).
pub(super) fn parse_roots(path: &Path, pem: &[u8]) -> Result<Arc<RootCertStore>, TlsError> {
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

impl Tls {
    pub(super) fn configs(&self) -> Arc<Configs> {
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
    pub(super) fn watch(&self) {
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
}
