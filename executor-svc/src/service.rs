//! The `ferry.v1.Executor` gRPC service: sessions fenced by the scheduler's leadership epoch.
//!
//! Invariants: at most one session is current; a handshake or reset from an epoch older than
//! the newest seen is refused; a newer handshake supersedes the current session.

use std::sync::{Arc, Mutex, MutexGuard};

use ferry_proto::v1::{self, executor_server::Executor};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::config::ExecutorConfig;

/// Session state shared by the RPC handlers. A std mutex is right here: it is held for a few
/// field updates and never across an `.await`.
#[derive(Debug, Default)]
struct SessionState {
    /// Newest epoch any scheduler presented.
    epoch: u64,
    /// Current session id; 0 when none.
    session_id: u64,
    /// Who holds the current session.
    scheduler_id: String,
    /// Last session id handed out.
    last_session_id: u64,
}

/// The executor's gRPC face.
#[derive(Clone)]
pub struct ExecutorService {
    config: Arc<ExecutorConfig>,
    state: Arc<Mutex<SessionState>>,
}

impl ExecutorService {
    /// A service for an executor configured by `config`.
    pub fn new(config: ExecutorConfig) -> Self {
        Self { config: Arc::new(config), state: Arc::default() }
    }

    fn state(&self) -> Result<MutexGuard<'_, SessionState>, Status> {
        self.state.lock().map_err(|_| Status::internal("executor session state is poisoned"))
    }

    fn info(&self) -> v1::ExecutorInfo {
        let c = &self.config;
        v1::ExecutorInfo {
            executor_id: c.executor_id.clone(),
            block_size: c.block_size,
            role: v1::ExecutorRole::from(c.role).into(),
            backend: v1::Backend::from(c.backend).into(),
            ..Default::default()
        }
    }
}

fn stale_epoch(given: u64, newest: u64) -> Status {
    Status::failed_precondition(format!(
        "stale scheduler epoch {given}: this executor has seen epoch {newest}"
    ))
}

#[tonic::async_trait]
impl Executor for ExecutorService {
    async fn handshake(
        &self,
        request: Request<v1::HandshakeRequest>,
    ) -> Result<Response<v1::HandshakeResponse>, Status> {
        let req = request.into_inner();
        let info = self.info();
        if !req.expected_model.is_empty() && req.expected_model != info.model {
            return Err(Status::failed_precondition(format!(
                "this executor serves model {:?}, not {:?}",
                info.model, req.expected_model
            )));
        }
        let mut state = self.state()?;
        if req.epoch < state.epoch {
            return Err(stale_epoch(req.epoch, state.epoch));
        }
        state.epoch = req.epoch;
        state.last_session_id += 1;
        state.session_id = state.last_session_id;
        state.scheduler_id = req.scheduler_id;
        tracing::info!(session = state.session_id, epoch = state.epoch, scheduler = %state.scheduler_id, "session opened");
        Ok(Response::new(v1::HandshakeResponse { session_id: state.session_id, info: Some(info) }))
    }

    type SessionStream = ReceiverStream<Result<v1::StepResult, Status>>;

    async fn session(
        &self,
        _request: Request<Streaming<v1::Step>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        Err(Status::unimplemented(
            "step execution is not available yet in this build: the model engine lands with the executor-engine issue",
        ))
    }

    async fn reset(
        &self,
        request: Request<v1::ResetRequest>,
    ) -> Result<Response<v1::ResetResponse>, Status> {
        let req = request.into_inner();
        let state = self.state()?;
        if req.epoch < state.epoch {
            return Err(stale_epoch(req.epoch, state.epoch));
        }
        if req.session_id != state.session_id || state.session_id == 0 {
            return Err(Status::failed_precondition(format!(
                "session {} is not the current session ({})",
                req.session_id, state.session_id
            )));
        }
        Ok(Response::new(v1::ResetResponse { dropped_requests: 0 }))
    }

    async fn describe(
        &self,
        _request: Request<v1::DescribeRequest>,
    ) -> Result<Response<v1::ExecutorDescription>, Status> {
        let state = self.state()?;
        Ok(Response::new(v1::ExecutorDescription {
            info: Some(self.info()),
            session_id: state.session_id,
            epoch: state.epoch,
            scheduler_id: state.scheduler_id.clone(),
            ..Default::default()
        }))
    }
}
