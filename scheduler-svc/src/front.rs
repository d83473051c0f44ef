//! The front's gRPC client API, `ferry.v1.Generation`.
//!
//! Generation needs executors wired to the scheduling core; until that lands, `Generate`
//! answers UNIMPLEMENTED with a message that says so, and `ListModels` lists no model.

use std::sync::Arc;

use ferry_proto::v1::{self, generation_server::Generation};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::config::SchedulerConfig;

/// The front's gRPC face.
#[derive(Clone)]
pub struct GenerationService {
    #[allow(dead_code)] // read once requests are routed to executors
    config: Arc<SchedulerConfig>,
}

impl GenerationService {
    /// A front configured by `config`.
    pub fn new(config: SchedulerConfig) -> Self {
        Self { config: Arc::new(config) }
    }
}

#[tonic::async_trait]
impl Generation for GenerationService {
    type GenerateStream = ReceiverStream<Result<v1::GenerateEvent, Status>>;

    async fn generate(
        &self,
        _request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        Err(Status::unimplemented(
            "generation is not available yet in this build: executors are not wired to the scheduler",
        ))
    }

    async fn abort(
        &self,
        _request: Request<v1::AbortRequest>,
    ) -> Result<Response<v1::AbortResponse>, Status> {
        Ok(Response::new(v1::AbortResponse { found: false }))
    }

    async fn list_models(
        &self,
        _request: Request<v1::ListModelsRequest>,
    ) -> Result<Response<v1::ListModelsResponse>, Status> {
        Ok(Response::new(v1::ListModelsResponse::default()))
    }
}
