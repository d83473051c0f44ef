//! The `ferry.v1.KvTransfer` gRPC service.
//!
//! Today it describes the agent; the block store and the mover arrive with the KV transfer
//! work, and until then their calls answer UNIMPLEMENTED with a message that says so.

use std::sync::Arc;

use ferry_proto::v1::{self, kv_transfer_server::KvTransfer};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::config::KvAgentConfig;

/// The agent's gRPC face.
#[derive(Clone)]
pub struct KvAgentService {
    config: Arc<KvAgentConfig>,
}

impl KvAgentService {
    /// A service for an agent configured by `config`.
    pub fn new(config: KvAgentConfig) -> Self {
        Self { config: Arc::new(config) }
    }
}

/// `/metrics` of a KV agent: its store (empty until the block store lands).
pub struct KvAgentMetrics {
    /// The agent's configuration.
    pub config: Arc<KvAgentConfig>,
}

impl ferry_runtime::metrics::Render for KvAgentMetrics {
    fn render(&self, t: &mut ferry_runtime::metrics::Text) {
        let labels = [("node", self.config.node_id.as_str())];
        let capacity = (self.config.store_mib * 1024 * 1024) as f64;
        t.gauge(
            "ferry_kv_store_capacity_bytes",
            "Host memory for the block store.",
            &labels,
            capacity,
        );
        t.gauge("ferry_kv_store_used_bytes", "Bytes of KV blocks held in the store.", &labels, 0.0);
    }
}

impl KvAgentService {
    /// Its metrics.
    pub fn metrics(&self) -> KvAgentMetrics {
        KvAgentMetrics { config: self.config.clone() }
    }
}

fn not_yet(what: &str) -> Status {
    Status::unimplemented(format!("{what} is not available yet in this build: the block store lands with the KV transfer work"))
}

#[tonic::async_trait]
impl KvTransfer for KvAgentService {
    async fn put(
        &self,
        _request: Request<Streaming<v1::BlockFrame>>,
    ) -> Result<Response<v1::TransferReceipt>, Status> {
        Err(not_yet("Put"))
    }

    async fn push(
        &self,
        _request: Request<Streaming<v1::BlockFrame>>,
    ) -> Result<Response<v1::TransferReceipt>, Status> {
        Err(not_yet("Push"))
    }

    type GetStream = ReceiverStream<Result<v1::BlockFrame, Status>>;

    async fn get(
        &self,
        _request: Request<v1::GetBlocksRequest>,
    ) -> Result<Response<Self::GetStream>, Status> {
        Err(not_yet("Get"))
    }

    async fn cancel(
        &self,
        _request: Request<v1::CancelTransferRequest>,
    ) -> Result<Response<v1::CancelTransferResponse>, Status> {
        Ok(Response::new(v1::CancelTransferResponse { found: false }))
    }

    async fn lookup(
        &self,
        request: Request<v1::LookupRequest>,
    ) -> Result<Response<v1::LookupResponse>, Status> {
        // The store is empty until blocks can be put into it.
        let asked = request.into_inner().block_hashes.len();
        Ok(Response::new(v1::LookupResponse { present: vec![false; asked], prefix_blocks: 0 }))
    }

    async fn describe(
        &self,
        _request: Request<v1::DescribeKvAgentRequest>,
    ) -> Result<Response<v1::KvAgentDescription>, Status> {
        Ok(Response::new(v1::KvAgentDescription {
            node_id: self.config.node_id.clone(),
            capacity_bytes: self.config.store_mib * 1024 * 1024,
            ..Default::default()
        }))
    }
}
