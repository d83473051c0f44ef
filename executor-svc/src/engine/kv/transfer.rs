//! A transfer's life beside the steps: its deadline ([`by`]), its span under the request's
//! trace, why it failed ([`Failed`], classified once from the agent's answer), and its end as
//! its task reports it back to the engine ([`Done`]).

use bytes::Bytes;
use ferry_proto::v1::{self, kv_operation::Op as KvOp};
use ferry_runtime::telemetry;

/// A finished transfer, from its task.
pub(super) enum Done {
    Export {
        transfer_id: String,
        result: Result<u64, Failed>,
    },
    /// The blocks, read through the socket; `None` when staged (they are in its slots).
    Import {
        transfer_id: String,
        result: Result<Option<Vec<Bytes>>, Failed>,
    },
}

/// Why a transfer failed: the reason metrics count, and what happened.
#[derive(Debug)]
pub(super) struct Failed {
    pub(super) kind: v1::KvFailure,
    pub(super) message: String,
}

impl Failed {
    pub(super) fn new(kind: v1::KvFailure, message: String) -> Self {
        Self { kind, message }
    }

    /// An agent's answer, classified by its code (`what` says which step failed).
    pub(super) fn of_status(what: &str, s: &tonic::Status) -> Self {
        use tonic::Code;
        let kind = match s.code() {
            Code::DeadlineExceeded => v1::KvFailure::Deadline,
            Code::Cancelled => v1::KvFailure::Cancelled,
            Code::DataLoss => v1::KvFailure::Checksum,
            Code::FailedPrecondition => v1::KvFailure::Layout,
            Code::NotFound => v1::KvFailure::NotFound,
            Code::ResourceExhausted => v1::KvFailure::StoreFull,
            Code::Unavailable | Code::Unknown | Code::Internal | Code::Aborted => {
                v1::KvFailure::AgentUnavailable
            }
            _ => v1::KvFailure::Malformed,
        };
        Self::new(kind, format!("{what}: {}", s.message()))
    }
}

/// The executor's span for KV operation `op` (`name`), under its request's trace; `None` when
/// untraced (a KV-tier store carries no trace).
pub(super) fn op_span(
    op: &v1::KvOperation,
    name: &'static str,
    blocks: usize,
    block_bytes: usize,
) -> Option<telemetry::HopSpan> {
    use opentelemetry::KeyValue;
    let (peer_key, peer) = match &op.op {
        Some(KvOp::Export(e)) => ("ferry.destination_agent", e.destination_agent.clone()),
        Some(KvOp::Import(i)) => ("ferry.source_agent", i.source_agent.clone()),
        _ => ("ferry.agent", String::new()),
    };
    telemetry::HopSpan::start(
        &op.traceparent,
        name,
        vec![
            KeyValue::new("ferry.transfer_id", op.transfer_id.clone()),
            KeyValue::new("ferry.blocks", blocks as i64),
            KeyValue::new("ferry.bytes", (blocks * block_bytes) as i64),
            KeyValue::new(peer_key, peer),
        ],
    )
}

/// Ends `span` with the transfer's outcome.
pub(super) fn end_span<T>(span: Option<telemetry::HopSpan>, result: &Result<T, Failed>) {
    telemetry::end_hop(span, result.as_ref().err().map(|f| f.message.as_str()));
}

/// `transfer`, failed if it has not ended by `deadline_unix_ms` (a stalled agent or peer must
/// not hold a transfer's blocks, nor its request, past the deadline the scheduler set).
pub(super) async fn by<T>(
    deadline_unix_ms: u64,
    transfer: impl std::future::Future<Output = Result<T, Failed>>,
) -> Result<T, Failed> {
    let at = ferry_runtime::clock::instant_of(deadline_unix_ms);
    let left = at.saturating_duration_since(std::time::Instant::now());
    tokio::time::timeout_at(at.into(), transfer).await.unwrap_or_else(|_| {
        Err(Failed::new(
            v1::KvFailure::Deadline,
            format!("deadline passed ({} ms after the operation started)", left.as_millis()),
        ))
    })
}
