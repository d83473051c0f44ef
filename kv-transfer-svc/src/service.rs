//! The `ferry.v1.KvTransfer` gRPC service over an [`Agent`]: the executor-facing `Put` and
//! `Get`, the agent-to-agent `Push`, and `Cancel`, `Lookup`, `Describe`. Every bad request is
//! refused with a status that says what was wrong, and leaves the store as it was.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ferry_kv_wire::frames::MAX_TRANSFER_ID;
use ferry_proto::v1::{self, kv_transfer_server::KvTransfer};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::agent::{Agent, Checksums, Failure};

/// The agent's gRPC face.
#[derive(Clone)]
pub struct KvAgentService {
    agent: Arc<Agent>,
}

impl KvAgentService {
    /// The service over `agent`.
    pub fn new(agent: Arc<Agent>) -> Self {
        Self { agent }
    }

    /// Its metrics.
    pub fn metrics(&self) -> KvAgentMetrics {
        KvAgentMetrics { agent: self.agent.clone() }
    }
}

/// `/metrics` of a KV agent: its store and its transfers.
pub struct KvAgentMetrics {
    agent: Arc<Agent>,
}

impl ferry_runtime::prometheus::Render for KvAgentMetrics {
    fn render(&self, t: &mut ferry_runtime::prometheus::Text) {
        let a = &self.agent;
        let labels = [("node", a.node_id.as_str())];
        let d = a.describe();
        t.gauge(
            "ferry_kv_store_capacity_bytes",
            "Host memory for the block store.",
            &labels,
            d.capacity_bytes as f64,
        );
        t.gauge(
            "ferry_kv_store_used_bytes",
            "Bytes of KV blocks held in the store.",
            &labels,
            d.bytes as f64,
        );
        t.gauge(
            "ferry_kv_store_pinned_bytes",
            "Bytes held by transfers in progress.",
            &labels,
            a.pinned_bytes() as f64,
        );
        t.gauge("ferry_kv_store_blocks", "KV blocks held in the store.", &labels, d.blocks as f64);
        t.gauge(
            "ferry_kv_transfers_in_progress",
            "Transfers arriving or being forwarded.",
            &labels,
            f64::from(d.transfers_in_progress),
        );
        t.counter(
            "ferry_kv_store_hits",
            "Blocks asked for (reads, lookups) and found.",
            &labels,
            d.hits as f64,
        );
        t.counter(
            "ferry_kv_store_misses",
            "Blocks asked for and not found.",
            &labels,
            d.misses as f64,
        );
        t.counter(
            "ferry_kv_received_bytes",
            "Block bytes received.",
            &labels,
            d.bytes_received as f64,
        );
        t.counter("ferry_kv_sent_bytes", "Block bytes sent.", &labels, d.bytes_sent as f64);
        let c = &a.counters;
        t.counter(
            "ferry_kv_transfers_received",
            "Transfers received whole.",
            &labels,
            c.transfers_received.load(Ordering::Relaxed) as f64,
        );
        t.counter(
            "ferry_kv_transfer_receive_seconds",
            "Time spent receiving whole transfers (with ferry_kv_transfers_received, the mean).",
            &labels,
            c.transfer_micros.load(Ordering::Relaxed) as f64 / 1e6,
        );
        t.family(
            "ferry_kv_staged_read_blocks",
            "counter",
            "Blocks read by local executors through shared memory: copied by the executor straight out of the store (in_place), or by the agent into the executor's slot (copied).",
        );
        for (path, n) in
            [("in_place", &c.staged_reads_in_place), ("copied", &c.staged_reads_copied)]
        {
            let l = [("path", path), ("node", a.node_id.as_str())];
            t.sample("ferry_kv_staged_read_blocks", &l, n.load(Ordering::Relaxed) as f64);
        }
        t.family("ferry_kv_transfer_failures", "counter", "Transfers that failed, by reason.");
        for (i, f) in Failure::ALL.iter().enumerate() {
            let l = [("node", a.node_id.as_str()), ("reason", f.label())];
            t.sample(
                "ferry_kv_transfer_failures",
                &l,
                c.failures[i].load(Ordering::Relaxed) as f64,
            );
        }
    }
}

#[tonic::async_trait]
impl KvTransfer for KvAgentService {
    async fn put(
        &self,
        request: Request<Streaming<v1::BlockFrame>>,
    ) -> Result<Response<v1::TransferReceipt>, Status> {
        Ok(Response::new(self.agent.put(request.into_inner(), Checksums::Check).await?))
    }

    async fn push(
        &self,
        request: Request<Streaming<v1::BlockFrame>>,
    ) -> Result<Response<v1::TransferReceipt>, Status> {
        Ok(Response::new(self.agent.receive_push(request.into_inner(), Checksums::Check).await?))
    }

    type GetStream = ReceiverStream<Result<v1::BlockFrame, Status>>;

    async fn get(
        &self,
        request: Request<v1::GetBlocksRequest>,
    ) -> Result<Response<Self::GetStream>, Status> {
        let frames = self.agent.read(request.into_inner())?;
        Ok(Response::new(ReceiverStream::new(frames)))
    }

    async fn cancel(
        &self,
        request: Request<v1::CancelTransferRequest>,
    ) -> Result<Response<v1::CancelTransferResponse>, Status> {
        let req = request.into_inner();
        if req.transfer_id.is_empty() || req.transfer_id.len() > MAX_TRANSFER_ID {
            return Err(Status::invalid_argument(format!(
                "transfer_id must be 1 to {MAX_TRANSFER_ID} bytes, got {}",
                req.transfer_id.len()
            )));
        }
        let found = self.agent.cancel(&req.transfer_id, &req.reason);
        Ok(Response::new(v1::CancelTransferResponse { found }))
    }

    async fn lookup(
        &self,
        request: Request<v1::LookupRequest>,
    ) -> Result<Response<v1::LookupResponse>, Status> {
        Ok(Response::new(self.agent.lookup(&request.into_inner())?))
    }

    async fn describe(
        &self,
        _request: Request<v1::DescribeKvAgentRequest>,
    ) -> Result<Response<v1::KvAgentDescription>, Status> {
        Ok(Response::new(self.agent.describe()))
    }

    async fn list_blocks(
        &self,
        request: Request<v1::ListBlocksRequest>,
    ) -> Result<Response<v1::ListBlocksResponse>, Status> {
        Ok(Response::new(self.agent.list_blocks(&request.into_inner())?))
    }
}
