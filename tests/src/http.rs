//! A minimal HTTP/1.1 client, so the tests need no HTTP client crate.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};

/// A minimal HTTP/1.1 client for tests (no dependency): sends one request with
/// `Connection: close` and returns the status and the body (chunked bodies are de-chunked).
pub fn http(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(120)))?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    // A server may answer (413) and close before reading a large body: the write then fails,
    // but the answer is there to read.
    let written = stream.write_all(body);
    let mut raw = Vec::new();
    if let Err(e) = stream.read_to_end(&mut raw) {
        written?;
        return Err(e.into());
    }
    if raw.is_empty() {
        written?;
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").context("no end of headers")?;
    let status: u16 = head.split_whitespace().nth(1).context("no status")?.parse()?;
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    let body = if chunked { dechunk(rest)? } else { rest.to_string() };
    Ok((status, body))
}

fn dechunk(mut rest: &str) -> Result<String> {
    let mut out = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n").context("bad chunk header")?;
        let size = usize::from_str_radix(size.trim(), 16)?;
        if size == 0 {
            return Ok(out);
        }
        out.push_str(after.get(..size).context("short chunk")?);
        rest = &after[size + 2..];
    }
}

/// Sends a request and reads only the status line, leaving the connection (and so a streamed
/// response) open: the caller holds the request live until it drops the stream.
pub fn http_open(addr: SocketAddr, path: &str, body: &[u8]) -> Result<(u16, std::net::TcpStream)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(120)))?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    // Byte by byte, so nothing after the status line is consumed here.
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while !line.ends_with(b"\r\n") {
        if stream.read(&mut byte)? == 0 {
            break;
        }
        line.push(byte[0]);
    }
    let line = String::from_utf8_lossy(&line);
    let status: u16 = line.split_whitespace().nth(1).context("no status")?.parse()?;
    Ok((status, stream))
}
