//! The one HTTP client of Ferry's tools: the load generator streams completions with it and the
//! integration tests make every HTTP call through it (hyper's client, HTTP/1.1; HTTPS when
//! given a CA to trust, for a server started with `--tls-*`).
//!
//! A response's body is read frame by frame, so a streamed (SSE) answer can be timed as it
//! arrives, or held open while a test looks elsewhere.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::rustls::{pki_types::ServerName, ClientConfig};

/// Why an HTTP call failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The request could not be built (a bad address or path).
    #[error("bad request: {0}")]
    Build(#[from] hyper::http::Error),
    /// Connecting, sending or receiving failed.
    #[error("{0}")]
    Transport(#[from] hyper_util::client::legacy::Error),
    /// Reading the body failed.
    #[error("reading the body: {0}")]
    Body(#[from] hyper::Error),
}

/// A client: plain HTTP, or HTTPS to servers whose certificate chains to a given CA.
#[derive(Clone, Debug)]
pub struct HttpClient {
    inner: Client<Connector, Full<Bytes>>,
    scheme: &'static str,
}

impl Default for HttpClient {
    fn default() -> Self {
        Self::new(None, false)
    }
}

impl HttpClient {
    /// A client speaking HTTPS with `tls` (see `ferry_runtime::tls::public_client`).
    pub fn with_tls(tls: Arc<ClientConfig>) -> Self {
        Self::new(Some(tls), false)
    }

    /// A client, with HTTPS when given `tls`. Without `keep_alive` no connection is pooled:
    /// each request gets its own, as a client fleet's would, and a connection the server closed
    /// (after a 413, say) is never reused; with it, connections stay open between requests
    /// (HTTP/1.1 keep-alive), as one application's pooled client (the OpenAI SDKs') does.
    pub fn new(tls: Option<Arc<ClientConfig>>, keep_alive: bool) -> Self {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut builder = Client::builder(TokioExecutor::new());
        if !keep_alive {
            builder.pool_max_idle_per_host(0);
        }
        Self { inner: builder.build(Connector { tls }), scheme }
    }
}

/// Dials TCP (no delay), then TLS when configured.
#[derive(Clone)]
pub struct Connector {
    tls: Option<Arc<ClientConfig>>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector").field("tls", &self.tls.is_some()).finish()
    }
}

impl tower_service::Service<hyper::Uri> for Connector {
    type Response = TokioIo<Stream>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<TokioIo<Stream>>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: hyper::Uri) -> Self::Future {
        let tls = self.tls.clone();
        Box::pin(async move {
            let bad = |what| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
            // An IPv6 host comes bracketed in a URI.
            let host = uri.host().ok_or_else(|| bad("no host"))?.trim_matches(['[', ']']);
            let port = uri.port_u16().ok_or_else(|| bad("no port"))?;
            let tcp = TcpStream::connect((host, port)).await?;
            tcp.set_nodelay(true)?;
            let Some(tls) = tls else { return Ok(TokioIo::new(Box::new(tcp) as Stream)) };
            let name =
                ServerName::try_from(host.to_string()).map_err(|_| bad("not a host name"))?;
            let conn = tokio_rustls::TlsConnector::from(tls).connect(name, tcp).await?;
            Ok(TokioIo::new(Box::new(conn) as Stream))
        })
    }
}

/// A client connection, plain or TLS.
pub type Stream = Box<dyn Io>;

/// What a connection is: bytes both ways.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

impl Connection for Box<dyn Io> {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

/// A response whose body has not been read yet.
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The response's headers.
    pub headers: hyper::HeaderMap,
    body: Incoming,
}

impl Response {
    /// The next piece of the body as it arrives; `None` at its end.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, HttpError> {
        loop {
            match self.body.frame().await {
                None => return Ok(None),
                Some(frame) => {
                    if let Ok(data) = frame?.into_data() {
                        return Ok(Some(data));
                    }
                }
            }
        }
    }

    /// The whole (rest of the) body as text (invalid UTF-8 replaced).
    pub async fn text(self) -> Result<String, HttpError> {
        let bytes = self.body.collect().await?.to_bytes();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

impl HttpClient {
    /// Sends `method path` with a JSON `body` to `addr` (`host:port`) and returns the response
    /// once its head has arrived.
    pub async fn send(
        &self,
        addr: &str,
        method: &str,
        path: &str,
        body: impl Into<Bytes>,
    ) -> Result<Response, HttpError> {
        self.send_with(addr, method, path, &[], body).await
    }

    /// [`Self::send`] with extra `headers` (a `traceparent`, say).
    pub async fn send_with(
        &self,
        addr: &str,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<Response, HttpError> {
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(format!("{}://{addr}{path}", self.scheme))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(body.into()))?;
        let response = self.inner.request(request).await?;
        let status = response.status().as_u16();
        let (parts, body) = response.into_parts();
        Ok(Response { status, headers: parts.headers, body })
    }
}
