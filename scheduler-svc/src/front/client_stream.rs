//! The stream a `Generate` call answers with: the request's client events, and the future that
//! makes them ([`super::stream::RequestStream::run`], or the merge of several samples) polled
//! by whoever polls the stream — the HTTP body or gRPC response being written — rather than run
//! as a task of its own. A token the step loop hands over then wakes one task, the connection's,
//! which turns it into the client's event and writes it in the same poll: no second task to
//! schedule and wake per token.
//!
//! Invariant: the request is served to its end whether or not the stream is read to its end.
//! Dropped before the future finished (the client left), the stream closes its channel and
//! hands the future to a task of its own, where it finds the client gone and aborts the request
//! where it runs, as a spawned stream always did.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use ferry_proto::v1;
use futures_util::task::AtomicWaker;
use tokio::sync::mpsc;
use tonic::Status;

/// What the client reads.
type Item = Result<v1::GenerateEvent, Status>;

/// A request's client events, made as they are read (see the module's doc).
pub struct ClientStream {
    events: mpsc::Receiver<Item>,
    /// The future sending into `events`; none once it finished.
    source: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// Whether the source was woken since it was last polled, and the reader's task to wake
    /// then; `waker` (made of it) is what the source is polled with, so that a reader's poll
    /// that is not for the source (the connection asking whether more is ready) does not
    /// poll it.
    wakeup: Arc<Wakeup>,
    waker: Waker,
}

/// The source's waker: marks it woken and wakes the reader's task.
struct Wakeup {
    woken: AtomicBool,
    reader: AtomicWaker,
}

impl Wake for Wakeup {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.reader.wake();
    }
}

impl ClientStream {
    /// The events `source` sends into the channel that `events` reads.
    pub(crate) fn new(
        events: mpsc::Receiver<Item>,
        source: impl Future<Output = ()> + Send + 'static,
    ) -> Self {
        let wakeup = Arc::new(Wakeup { woken: AtomicBool::new(true), reader: AtomicWaker::new() });
        let waker = Waker::from(wakeup.clone());
        Self { events, source: Some(Box::pin(source)), wakeup, waker }
    }
}

impl std::fmt::Debug for ClientStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientStream")
            .field("events", &self.events)
            .field("running", &self.source.is_some())
            .finish_non_exhaustive()
    }
}

impl tokio_stream::Stream for ClientStream {
    type Item = Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        let this = &mut *self;
        // The source first (when it was woken), so that what it makes in this poll is read
        // in this poll; it waits on its own inputs (and on room in the channel) with a waker
        // that wakes this task.
        if let Some(source) = &mut this.source {
            this.wakeup.reader.register(cx.waker());
            if this.wakeup.woken.swap(false, Ordering::AcqRel) {
                let mut source_cx = Context::from_waker(&this.waker);
                if source.as_mut().poll(&mut source_cx).is_ready() {
                    this.source = None; // its sender is dropped: the channel ends once read
                }
            }
        }
        this.events.poll_recv(cx)
    }
}

impl Drop for ClientStream {
    fn drop(&mut self) {
        let Some(source) = self.source.take() else { return };
        // The client left mid-request: the source sees its channel closed and aborts the
        // request; without a runtime (shutting down) there is nothing left to abort on.
        self.events.close();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(source);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    fn event(text: &str) -> v1::GenerateEvent {
        v1::GenerateEvent { text: text.into(), ..Default::default() }
    }

    /// The source runs only as the stream is read, and its events arrive in order, then the
    /// end.
    #[tokio::test]
    async fn the_source_runs_in_the_readers_poll() {
        let (tx, rx) = mpsc::channel(1);
        let (go_tx, mut go_rx) = mpsc::unbounded_channel::<&'static str>();
        let source = async move {
            while let Some(text) = go_rx.recv().await {
                if tx.send(Ok(event(text))).await.is_err() {
                    return;
                }
            }
        };
        let mut stream = ClientStream::new(rx, source);
        for text in ["a", "b", "c"] {
            go_tx.send(text).expect("source alive");
        }
        drop(go_tx);
        let mut got = Vec::new();
        while let Some(ev) = stream.next().await {
            got.push(ev.expect("event").text);
        }
        assert_eq!(got, ["a", "b", "c"]);
        assert!(stream.source.is_none(), "the source finished");
    }

    /// Dropped mid-request, the stream hands its source to a task that sees the client gone.
    #[tokio::test]
    async fn a_dropped_stream_leaves_its_source_running_to_see_the_client_gone() {
        let (tx, rx) = mpsc::channel(4);
        let (saw_tx, saw_rx) = tokio::sync::oneshot::channel();
        let source = async move {
            tx.send(Ok(event("first"))).await.expect("client there");
            tx.closed().await;
            let _ = saw_tx.send("client gone");
        };
        let mut stream = ClientStream::new(rx, source);
        assert_eq!(stream.next().await.expect("event").expect("ok").text, "first");
        assert!(stream.source.is_some(), "the source still runs");
        drop(stream);
        assert_eq!(saw_rx.await.expect("the source ran to its end"), "client gone");
    }
}
