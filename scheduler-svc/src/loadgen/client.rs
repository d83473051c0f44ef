//! A small streaming HTTP/1.1 client for the load generator: one POST per connection, the
//! response body read incrementally (chunked or not) so each SSE `data:` line is timed when it
//! arrives. No TLS: the load generator targets endpoints on this machine or a private network.

use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

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
    Io(#[from] std::io::Error),
    /// The server answered with an error status.
    #[error("HTTP {status}: {body}")]
    Status {
        /// The status.
        status: u16,
        /// The body, as far as read.
        body: String,
    },
    /// The response was not HTTP as expected.
    #[error("malformed response: {0}")]
    Malformed(String),
}

/// POSTs `body` to `host:port` `path` and reads the SSE stream, timing text chunks.
pub async fn stream_completion(
    addr: &str,
    path: &str,
    body: &str,
) -> Result<Observed, ClientError> {
    let start = Instant::now();
    let mut stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).await?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ClientError::Malformed(format!("status line {line:?}")))?;
    let mut chunked = false;
    loop {
        line.clear();
        if reader.read_line(&mut line).await? == 0 || line == "\r\n" {
            break;
        }
        let lower = line.to_ascii_lowercase();
        chunked |= lower.starts_with("transfer-encoding:") && lower.contains("chunked");
    }
    let mut body = Vec::new();
    let mut obs = Observed::default();
    let mut last_chunk: Option<Instant> = None;
    let mut pending = String::new();
    let mut chunks = 0u64;
    loop {
        // Read the next piece of the body (one HTTP chunk, or whatever arrives).
        let piece = if chunked {
            line.clear();
            reader.read_line(&mut line).await?;
            let size = usize::from_str_radix(line.trim(), 16)
                .map_err(|_| ClientError::Malformed(format!("chunk size {line:?}")))?;
            if size == 0 {
                break;
            }
            let mut buf = vec![0; size + 2];
            reader.read_exact(&mut buf).await?;
            buf.truncate(size);
            buf
        } else {
            let mut buf = vec![0; 8192];
            let n = reader.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            buf.truncate(n);
            buf
        };
        if status != 200 {
            body.extend_from_slice(&piece);
            continue;
        }
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
    if status != 200 {
        return Err(ClientError::Status {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    if obs.output_tokens == 0 {
        obs.output_tokens = chunks;
    }
    obs.e2e = start.elapsed();
    Ok(obs)
}
