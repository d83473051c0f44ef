//! Streaming (`"stream": true`): the answer as Server-Sent Events, each chunk sent as the
//! front's event arrives. The body runs through its phases in order (events, the usage chunk
//! if asked, `[DONE]`, end); an error from the front becomes an error event in OpenAI's shape
//! (the status mapped by [`http_status`]) and ends it. Each event is one `data:` line written
//! straight into its frame: JSON text never holds a raw line break, so none needs splitting.

use std::convert::Infallible;
use std::fmt::Write as _;

use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use ferry_proto::v1;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::json;

use super::response_body::Shaper;
use crate::http::http_status;

/// Where the SSE body is.
enum Phase {
    Events,
    Usage,
    Done,
    End,
}

/// The streamed answer: `text/event-stream`, not cached, with [`sse_events`] as its body.
pub(super) fn sse_response(
    shaper: Shaper,
    events: impl Stream<Item = Result<v1::GenerateEvent, tonic::Status>> + Send + Unpin + 'static,
    include_usage: bool,
) -> Response {
    let body = axum::body::Body::from_stream(sse_events(shaper, events, include_usage));
    let headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")];
    (headers, body).into_response()
}

/// An event's frame holding `data` as it displays.
fn frame_of(data: &impl std::fmt::Display) -> Bytes {
    frame(|out| {
        let _ = write!(out, "{data}");
    })
}

/// One event's frame: `data: <data>` and the blank line that ends it.
fn frame(write: impl FnOnce(&mut String)) -> Bytes {
    let mut out = String::with_capacity(256);
    out.push_str("data: ");
    write(&mut out);
    out.push_str("\n\n");
    Bytes::from(out)
}

/// Whether choice `index` has its first chunk now, marking it in `started`.
fn first_of_choice(started: &mut Vec<bool>, index: u32) -> bool {
    let i = index as usize;
    if started.len() <= i {
        started.resize(i + 1, false);
    }
    !std::mem::replace(&mut started[i], true)
}

/// The SSE body: one chunk per event, then (if asked) a usage chunk, then `[DONE]`. Chunks are
/// sent as events arrive; dropping the body (client gone) drops the front's stream, which
/// aborts the request.
fn sse_events(
    shaper: Shaper,
    events: impl Stream<Item = Result<v1::GenerateEvent, tonic::Status>> + Send + Unpin + 'static,
    include_usage: bool,
) -> impl Stream<Item = Result<Bytes, Infallible>> + Send + 'static {
    struct State<S> {
        shaper: Shaper,
        events: S,
        /// Choices that have had their first chunk, by index (at most `n`, a few).
        started: Vec<bool>,
        usage: Option<v1::Usage>,
        phase: Phase,
    }
    let started = Vec::new();
    let init = State { shaper, events, started, usage: None, phase: Phase::Events };
    stream::unfold(init, move |mut st| async move {
        loop {
            match st.phase {
                Phase::Events => match st.events.next().await {
                    Some(Ok(ev)) => {
                        if ev.usage.is_some() {
                            st.usage = ev.usage;
                        }
                        let first = first_of_choice(&mut st.started, ev.index);
                        let data = frame(|out| st.shaper.chunk_into(&ev, first, out));
                        return Some((Ok(data), st));
                    }
                    Some(Err(status)) => {
                        st.phase = Phase::Done;
                        let data = json!({ "error": { "message": status.message(), "code": http_status(status.code()).as_u16() } });
                        return Some((Ok(frame_of(&data)), st));
                    }
                    None => st.phase = if include_usage { Phase::Usage } else { Phase::Done },
                },
                Phase::Usage => {
                    st.phase = Phase::Done;
                    let data = st.shaper.usage_chunk(st.usage);
                    return Some((Ok(frame_of(&data)), st));
                }
                Phase::Done => {
                    st.phase = Phase::End;
                    return Some((Ok(frame_of(&"[DONE]")), st));
                }
                Phase::End => return None,
            }
        }
    })
}
