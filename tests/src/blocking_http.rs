//! HTTP for the tests, blocking: thin wrappers over Ferry's one HTTP client
//! (`ferry_bench::http_client`), run on a runtime of their own so that sync and async tests alike can
//! call them.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result};
use ferry_bench::http_client::{HttpClient, Response};

/// How long one call may take before the test fails instead of hanging.
const CALL_TIMEOUT: Duration = Duration::from_mins(2);

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime for the tests' HTTP calls")
    })
}

fn client() -> &'static HttpClient {
    static CLIENT: OnceLock<HttpClient> = OnceLock::new();
    CLIENT.get_or_init(HttpClient::default)
}

/// Runs `fut` on the tests' HTTP runtime and waits for it (from any thread, in a runtime or
/// not), failing after [`CALL_TIMEOUT`].
fn wait<T: Send + 'static>(
    fut: impl std::future::Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    runtime().spawn(async move {
        let _ = tx.send(tokio::time::timeout(CALL_TIMEOUT, fut).await);
    });
    rx.recv().context("the HTTP runtime dropped the call")?.context("the HTTP call timed out")?
}

/// Sends `method path` with `body` to `addr` and returns the status and the whole body.
pub fn http(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Result<(u16, String)> {
    http_with(addr, method, path, &[], body)
}

/// [`http`] with extra request `headers`.
pub fn http_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(u16, String)> {
    let (status, body, _) = send(addr, method, path, headers, body, None)?;
    Ok((status, body))
}

/// A POST of `body` to `path` with `headers`, also returning the response's `header` (if
/// sent).
pub fn http_header(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    header: &'static str,
) -> Result<(u16, String, Option<String>)> {
    send(addr, "POST", path, headers, body, Some(header))
}

/// One request: its status, its whole body and the value of `header` (when asked for and sent).
fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    header: Option<&'static str>,
) -> Result<(u16, String, Option<String>)> {
    let (method, path, body) = (method.to_string(), path.to_string(), body.to_vec());
    let headers: Vec<(String, String)> =
        headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
    wait(async move {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (&**n, &**v)).collect();
        let response =
            client().send_with(&addr.to_string(), &method, &path, &headers, body).await?;
        let value = header
            .and_then(|h| response.headers.get(h))
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let status = response.status;
        Ok((status, response.text().await?, value))
    })
}

/// A response whose body is still streaming; dropping it closes the connection (a streamed
/// request is then aborted by the server).
pub struct OpenStream(Option<Response>);

impl OpenStream {
    /// Reads the rest of the body until the server ends it.
    pub fn read_rest(mut self) -> Result<String> {
        let response = self.0.take().context("already read")?;
        wait(async move { Ok(response.text().await?) })
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        // The body is dropped on the runtime that polls its connection.
        if let Some(response) = self.0.take() {
            runtime().spawn(async move { drop(response) });
        }
    }
}

/// POSTs `body` to `path` and returns once the response's head arrived, leaving its body open:
/// the caller holds the request live until it drops the stream.
pub fn http_open(addr: SocketAddr, path: &str, body: &[u8]) -> Result<(u16, OpenStream)> {
    let (path, body) = (path.to_string(), body.to_vec());
    wait(async move {
        let response = client().send(&addr.to_string(), "POST", &path, body).await?;
        Ok((response.status, OpenStream(Some(response))))
    })
}

/// A greedy completion of `prompt` by `model` at `addr` (`max_tokens` tokens past EOS, each
/// with its log-probability): the answer's text, log-probabilities and body.
///
/// # Panics
///
/// If the server does not answer 200, or its answer names another model.
pub fn greedy_completion(
    addr: SocketAddr,
    model: &str,
    prompt: &str,
    max_tokens: u32,
) -> (String, Vec<f64>, serde_json::Value) {
    let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": true, "logprobs": 1});
    let (status, text) =
        http(addr, "POST", "/v1/completions", body.to_string().as_bytes()).expect("an answer");
    assert_eq!(status, 200, "{model}: {text}");
    let v: serde_json::Value = serde_json::from_str(&text).expect("a JSON answer");
    assert_eq!(v["model"], model, "the answer names the model asked for");
    let choice = &v["choices"][0];
    let text = choice["text"].as_str().expect("a text").to_string();
    let lps = choice["logprobs"]["token_logprobs"].as_array().expect("logprobs");
    (text, lps.iter().map(|l| l.as_f64().expect("a number")).collect(), v)
}
