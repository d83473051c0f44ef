//! The calling side: gRPC channels and raw connections to another service, over mutual TLS
//! (checking that the server holds the role the caller meant to reach) when the process has
//! TLS, plaintext otherwise; and the client configuration of the HTTP API's callers.

use std::path::Path;
use std::sync::Arc;

use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_rustls::rustls::ClientConfig;
use tonic::transport::{Channel, Endpoint, Uri};

use super::certificates::{parse_roots, Tls};
use super::{current, file_error, provider, Protocol, Role, TlsError, HANDSHAKE_TIMEOUT};

impl Tls {
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
    Endpoint::from_shared(format!("http://{}", host_port(address)))
}

/// `address`'s `host:port`, without a scheme or a trailing `/`.
fn host_port(address: &str) -> &str {
    address.split_once("://").map_or(address, |(_, rest)| rest).trim_end_matches('/')
}

/// `address` (`host:port` or a URL) as this process dials it, for logs: `https://` under TLS
/// (whatever scheme an advertised address carries), `http://` otherwise.
pub fn dialled_url(address: &str) -> String {
    url_as_dialled(address, super::current().is_some())
}

/// `address` with the scheme it is dialled with, `https` when `tls`.
fn url_as_dialled(address: &str, tls: bool) -> String {
    format!("{}://{}", if tls { "https" } else { "http" }, host_port(address))
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

#[cfg(test)]
mod tests {
    #[test]
    fn a_logged_url_has_the_scheme_it_is_dialled_with() {
        assert_eq!(super::url_as_dialled("http://node-a:50061", true), "https://node-a:50061");
        assert_eq!(super::url_as_dialled("node-a:50061/", true), "https://node-a:50061");
        assert_eq!(super::url_as_dialled("http://node-a:50061", false), "http://node-a:50061");
    }
}
