//! Streaming (`"stream": true`): the answer as Server-Sent Events, each chunk sent as the
//! front's event arrives. The body runs through its phases in order (events, the usage chunk
//! if asked, `[DONE]`, end); an error from the front becomes an error event in OpenAI's shape
//! (the status mapped by [`http_status`]) and ends it.

use std::convert::Infallible;

use axum::response::sse::Event;
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

/// The SSE body: one chunk per event, then (if asked) a usage chunk, then `[DONE]`. Chunks are
/// sent as events arrive; dropping the body (client gone) drops the front's stream, which
/// aborts the request.
pub(super) fn sse_events(
    shaper: Shaper,
    events: impl Stream<Item = Result<v1::GenerateEvent, tonic::Status>> + Send + Unpin + 'static,
    include_usage: bool,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    struct State<S> {
        shaper: Shaper,
        events: S,
        /// Choices that have had their first chunk.
        started: std::collections::HashSet<u32>,
        usage: Option<v1::Usage>,
        phase: Phase,
    }
    let started = std::collections::HashSet::new();
    let init = State { shaper, events, started, usage: None, phase: Phase::Events };
    stream::unfold(init, move |mut st| async move {
        loop {
            match st.phase {
                Phase::Events => match st.events.next().await {
                    Some(Ok(ev)) => {
                        if ev.usage.is_some() {
                            st.usage = ev.usage;
                        }
                        let first = st.started.insert(ev.index);
                        let data = st.shaper.chunk_text(&ev, first);
                        return Some((Ok(Event::default().data(data)), st));
                    }
                    Some(Err(status)) => {
                        st.phase = Phase::Done;
                        let data = json!({ "error": { "message": status.message(), "code": http_status(status.code()).as_u16() } });
                        return Some((Ok(Event::default().data(data.to_string())), st));
                    }
                    None => st.phase = if include_usage { Phase::Usage } else { Phase::Done },
                },
                Phase::Usage => {
                    st.phase = Phase::Done;
                    let data = st.shaper.usage_chunk(st.usage);
                    return Some((Ok(Event::default().data(data.to_string())), st));
                }
                Phase::Done => {
                    st.phase = Phase::End;
                    return Some((Ok(Event::default().data("[DONE]")), st));
                }
                Phase::End => return None,
            }
        }
    })
}
