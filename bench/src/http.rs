//! The one HTTP client of Ferry's tools: the load generator streams completions with it and the
//! integration tests make every HTTP call through it (hyper's client, HTTP/1.1, no TLS: both
//! talk to endpoints on this machine or a private network).
//!
//! A response's body is read frame by frame, so a streamed (SSE) answer can be timed as it
//! arrives, or held open while a test looks elsewhere.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

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

/// A client (connections are pooled and reused).
#[derive(Clone, Debug)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

impl Default for HttpClient {
    fn default() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        // No pooled connections: each request gets its own, as a client fleet's would, and a
        // connection the server closed (after a 413, say) is never reused.
        let inner =
            Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build(connector);
        Self { inner }
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
            .uri(format!("http://{addr}{path}"))
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
