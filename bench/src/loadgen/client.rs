//! One streamed completion, timed: the response body is read as it arrives, so each SSE
//! `data:` line is timed when it comes.

use std::time::{Duration, Instant};

use crate::http_client::{HttpClient, HttpError};

/// What one streamed request observed.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    /// Time to the first non-empty text chunk.
    pub ttft: Option<Duration>,
    /// Times between consecutive text chunks.
    pub gaps: Vec<Duration>,
    /// Request start to the end of the stream.
    pub e2e: Duration,
    /// Output tokens, from the usage chunk (or the number of text chunks).
    pub output_tokens: u64,
    /// Prompt tokens, from the usage chunk.
    pub prompt_tokens: u64,
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting, writing or reading failed.
    #[error("{0}")]
    Http(#[from] HttpError),
    /// The server answered with an error status.
    #[error("HTTP {status}: {body}")]
    Status {
        /// The status.
        status: u16,
        /// The body.
        body: String,
    },
    /// The response was not what an OpenAI streaming endpoint sends.
    #[error("malformed response: {0}")]
    Malformed(String),
}

/// POSTs `body` to `addr` (`host:port`) `path` and reads the SSE stream, timing text chunks.
pub async fn stream_completion(
    client: &HttpClient,
    addr: &str,
    path: &str,
    body: String,
) -> Result<Observed, ClientError> {
    let start = Instant::now();
    let mut response = client.send(addr, "POST", path, body).await?;
    if response.status != 200 {
        let status = response.status;
        return Err(ClientError::Status { status, body: response.text().await? });
    }
    let mut obs = Observed::default();
    let mut last_chunk: Option<Instant> = None;
    let mut pending = String::new();
    let mut chunks = 0u64;
    while let Some(piece) = response.chunk().await? {
        pending.push_str(&String::from_utf8_lossy(&piece));
        while let Some(end) = pending.find('\n') {
            let l: String = pending.drain(..=end).collect();
            let Some(data) = l.trim_end().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                continue;
            }
            let v: serde_json::Value =
                serde_json::from_str(data).map_err(|e| ClientError::Malformed(e.to_string()))?;
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                obs.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
                obs.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
            }
            let choice = &v["choices"][0];
            let text = choice["text"]
                .as_str()
                .or_else(|| choice["delta"]["content"].as_str())
                .unwrap_or("");
            if !text.is_empty() {
                let now = Instant::now();
                chunks += 1;
                match last_chunk {
                    None => obs.ttft = Some(now - start),
                    Some(prev) => obs.gaps.push(now - prev),
                }
                last_chunk = Some(now);
            }
        }
    }
    if obs.output_tokens == 0 {
        obs.output_tokens = chunks;
    }
    obs.e2e = start.elapsed();
    Ok(obs)
}
