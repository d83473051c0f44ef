//! The `ferry.v1.Executor` gRPC service: sessions fenced by the scheduler's leadership epoch,
//! and the step stream that feeds the engine.
//!
//! Invariants: at most one session is current; a handshake or reset from an epoch older than
//! the newest seen in its scheduler pool is refused; a newer handshake supersedes the current
//! session (its stream ends with `FAILED_PRECONDITION` at its next step) and starts from an
//! empty request table — one of another pool (a shard the executor was reassigned to) only
//! once the current session's stream has ended, and none of a pool other than `--pool`.
//! With etcd, a handshake opens a session only with the leadership token its epoch's elected
//! scheduler published. A session's stream and resets present its secret, which only the
//! handshake's answer carries; a session has one stream at a time.
//! Steps are executed one at a time, in the order they arrive.

use std::sync::{Arc, Mutex, MutexGuard};

use ferry_proto::v1::{self, executor_server::Executor};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use ferry_runtime::cluster::ClusterArgs;

use crate::actor::EngineHandle;
use crate::data_parallel::{StepTrace, TracedStep};
use crate::engine::simulated_gpu::SimIdentity;

/// Session state shared by the RPC handlers. A std mutex is right here: it is held for a few
/// field updates and never across an `.await`.
#[derive(Debug, Default)]
struct SessionState {
    /// Newest epoch any scheduler of each pool presented (epochs are per pool: each pool's
    /// leader is elected on its own).
    epochs: std::collections::HashMap<String, u64>,
    /// The pool whose scheduler holds the current session.
    pool: String,
    /// Current session id; 0 when none.
    session_id: u64,
    /// Who holds the current session.
    scheduler_id: String,
    /// Last session id handed out.
    last_session_id: u64,
    /// The current session's secret (given only to its handshake).
    secret: Vec<u8>,
    /// Whether the current session's stream is open (one at a time).
    streaming: bool,
    /// The newest epoch whose leadership token etcd confirmed, and the token.
    verified: Option<(u64, Vec<u8>)>,
}

impl SessionState {
    /// The newest epoch a scheduler of `pool` presented (0: none).
    fn newest(&self, pool: &str) -> u64 {
        self.epochs.get(pool).copied().unwrap_or(0)
    }
}

/// A session stream's claim on its session; released when the stream ends.
struct StreamClaim {
    state: Arc<Mutex<SessionState>>,
    session_id: u64,
}

impl Drop for StreamClaim {
    fn drop(&mut self) {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if state.session_id == self.session_id {
            state.streaming = false;
        }
    }
}

/// The executor's gRPC face.
#[derive(Clone)]
pub struct ExecutorService {
    info: Arc<Mutex<Arc<v1::ExecutorInfo>>>,
    state: Arc<Mutex<SessionState>>,
    engine: EngineHandle,
    /// Set for an executor that simulates a model profile: it serves each scheduler's model.
    identity: Option<Arc<SimIdentity>>,
    /// Whom a handshake must prove to be.
    leadership: Leadership,
    /// The only pool whose schedulers may open a session (`--pool`); `None`: any.
    pool: Option<Arc<str>>,
    /// Where each step executed is recorded (`--step-trace`).
    trace: Option<Arc<StepTrace>>,
}

/// What a handshake's leadership token is checked against.
#[derive(Clone)]
enum Leadership {
    /// Nothing: a static executor given no token opens a session for anyone.
    Open,
    /// The token a static set-up shares (`--leadership-token-file`).
    Token(Arc<[u8]>),
    /// The token etcd holds for the handshake's epoch.
    Etcd(ClusterArgs),
}

impl ExecutorService {
    /// A service answering with `info` and running steps on `engine`; with `identity`, it
    /// serves the model each handshake names (a simulated model profile) instead of refusing
    /// another fingerprint.
    pub fn new(
        info: v1::ExecutorInfo,
        engine: EngineHandle,
        identity: Option<Arc<SimIdentity>>,
    ) -> Self {
        let info = Arc::new(Mutex::new(Arc::new(info)));
        let leadership = Leadership::Open;
        Self { info, state: Arc::default(), engine, identity, leadership, pool: None, trace: None }
    }

    /// Records each step executed in `trace` (`--step-trace`), when given.
    #[must_use]
    pub fn with_step_trace(mut self, trace: Option<Arc<StepTrace>>) -> Self {
        self.trace = trace;
        self
    }

    /// Sessions open only for schedulers of `pool` (`--pool`), when given.
    #[must_use]
    pub fn in_pool(mut self, pool: Option<String>) -> Self {
        self.pool = pool.map(Arc::from);
        self
    }

    /// Handshakes checked against `cluster`'s etcd when it has one (a session opens only for
    /// the scheduler that published the handshake's leadership token for its epoch), else
    /// against `token` when there is one.
    #[must_use]
    pub fn with_leadership(
        mut self,
        cluster: Option<ClusterArgs>,
        token: Option<Arc<[u8]>>,
    ) -> Self {
        self.leadership = match (cluster.filter(ClusterArgs::enabled), token) {
            (Some(cluster), _) => Leadership::Etcd(cluster),
            (None, Some(token)) => Leadership::Token(token),
            (None, None) => Leadership::Open,
        };
        self
    }

    /// Checks `req`'s leadership token against etcd (once per epoch and token), or against
    /// the static token.
    async fn check_leadership(&self, req: &v1::HandshakeRequest) -> Result<(), Status> {
        let token = &req.leadership_token;
        let cluster = match &self.leadership {
            Leadership::Open => return Ok(()),
            Leadership::Token(t) if ferry_runtime::secret::same(t, token) => return Ok(()),
            Leadership::Token(_) => {
                return Err(Status::permission_denied(
                    "this executor opens sessions only for a scheduler presenting its \
                     --leadership-token-file token",
                ))
            }
            Leadership::Etcd(cluster) => cluster,
        };
        let known = self.state()?.verified.as_ref().is_some_and(|(epoch, verified)| {
            *epoch == req.epoch && ferry_runtime::secret::same(verified, token)
        });
        if known {
            return Ok(());
        }
        let key = cluster.leadership_key(req.epoch);
        let read = async {
            let mut client = cluster.client().await?;
            client.get(key.as_str(), None).await
        };
        let answer = tokio::time::timeout(std::time::Duration::from_secs(5), read)
            .await
            .map_err(|_| Status::unavailable("etcd did not answer: cannot check the leadership"))?
            .map_err(|e| Status::unavailable(format!("etcd: cannot check the leadership: {e}")))?;
        let published = answer
            .kvs()
            .first()
            .and_then(|kv| kv.value_str().ok())
            .and_then(ferry_runtime::secret::from_hex);
        match published {
            Some(p) if ferry_runtime::secret::same(&p, token) => {
                self.state()?.verified = Some((req.epoch, p));
                Ok(())
            }
            Some(_) => Err(Status::permission_denied(format!(
                "the leadership token does not match the one etcd holds for epoch {}",
                req.epoch
            ))),
            None => Err(Status::permission_denied(format!(
                "no scheduler leads under epoch {} (etcd holds no leadership token at {key}): \
                 only the elected scheduler may open a session",
                req.epoch
            ))),
        }
    }

    /// What this executor is now.
    fn info(&self) -> Result<Arc<v1::ExecutorInfo>, Status> {
        let info = self.info.lock().map_err(|_| Status::internal("executor info is poisoned"))?;
        Ok(info.clone())
    }

    /// A simulating executor takes on the model `req` names: its fingerprint, vocabulary and
    /// end tokens. Others are what they are.
    fn adopt(&self, req: &v1::HandshakeRequest) -> Result<(), Status> {
        let Some(identity) = &self.identity else { return Ok(()) };
        let mut info = (*self.info()?).clone();
        if !req.expected_fingerprint.is_empty() {
            info.model_fingerprint.clone_from(&req.expected_fingerprint);
        }
        if req.vocab_size > 0 {
            info.vocab_size = req.vocab_size;
        }
        info.eos_token_ids.clone_from(&req.eos_token_ids);
        identity.adopt(req.vocab_size, req.eos_token_ids.first().copied());
        *self.info.lock().map_err(|_| Status::internal("executor info is poisoned"))? =
            Arc::new(info);
        Ok(())
    }

    fn state(&self) -> Result<MutexGuard<'_, SessionState>, Status> {
        self.state.lock().map_err(|_| Status::internal("executor session state is poisoned"))
    }

    /// Checks that `(session_id, epoch)` is the current session and `secret` its secret; a
    /// stream, whose secret cannot change, is checked once ([`Self::claim`]).
    fn check_current(&self, session_id: u64, epoch: u64, secret: &[u8]) -> Result<(), Status> {
        let state = self.state()?;
        Self::check_session(&state, session_id, epoch)?;
        Self::check_secret(&state, session_id, secret)
    }

    /// Checks that `secret` is `state`'s session's.
    fn check_secret(state: &SessionState, session_id: u64, secret: &[u8]) -> Result<(), Status> {
        if ferry_runtime::secret::same(secret, &state.secret) {
            return Ok(());
        }
        Err(Status::permission_denied(format!(
            "session {session_id}: the {} metadata does not hold the session's secret",
            ferry_runtime::secret::SESSION_SECRET_HEADER
        )))
    }

    /// Checks that `(session_id, epoch)` is `state`'s current session.
    fn check_session(state: &SessionState, session_id: u64, epoch: u64) -> Result<(), Status> {
        let newest = state.newest(&state.pool);
        if epoch < newest {
            return Err(ferry_proto::fencing::stale_epoch(epoch, newest));
        }
        if session_id == 0 || session_id != state.session_id {
            return Err(Status::failed_precondition(format!(
                "session {session_id} is not the current session ({})",
                state.session_id
            )));
        }
        Ok(())
    }

    /// The first step of a stream: checks it with the stream's secret and claims the
    /// session's one stream.
    fn claim(&self, step: &v1::Step, secret: &[u8]) -> Result<StreamClaim, Status> {
        let mut state = self.state()?;
        Self::check_session(&state, step.session_id, step.epoch)?;
        Self::check_secret(&state, step.session_id, secret)?;
        if state.streaming {
            return Err(Status::already_exists(format!(
                "session {} already has its stream: one stream per session",
                step.session_id
            )));
        }
        state.streaming = true;
        Ok(StreamClaim { state: self.state.clone(), session_id: step.session_id })
    }
}

/// The session secret a call presents (empty if none, or not hex).
fn presented_secret(metadata: &tonic::metadata::MetadataMap) -> Vec<u8> {
    metadata
        .get(ferry_runtime::secret::SESSION_SECRET_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(ferry_runtime::secret::from_hex)
        .unwrap_or_default()
}

#[tonic::async_trait]
impl Executor for ExecutorService {
    async fn handshake(
        &self,
        request: Request<v1::HandshakeRequest>,
    ) -> Result<Response<v1::HandshakeResponse>, Status> {
        let mut req = request.into_inner();
        if req.pool.is_empty() {
            req.pool = ferry_runtime::cluster::DEFAULT_POOL.to_string();
        }
        let info = self.info()?;
        if !req.expected_model.is_empty() && req.expected_model != info.model {
            return Err(Status::failed_precondition(format!(
                "this executor serves model {:?}, not {:?}",
                info.model, req.expected_model
            )));
        }
        if self.identity.is_none()
            && !req.expected_fingerprint.is_empty()
            && req.expected_fingerprint != info.model_fingerprint
        {
            return Err(Status::failed_precondition(format!(
                "this executor runs model {:?} with fingerprint {}, but the scheduler tokenizes \
                 for a model with fingerprint {}: give both the same model file",
                info.model, info.model_fingerprint, req.expected_fingerprint
            )));
        }
        if let Some(only) = self.pool.as_deref().filter(|p| *p != req.pool) {
            return Err(Status::failed_precondition(format!(
                "this executor serves scheduler pool {only:?} only (--pool), not {:?}",
                req.pool
            )));
        }
        // Stale epochs are refused before etcd is asked (and again below, under the lock).
        let newest = self.state()?.newest(&req.pool);
        if req.epoch < newest {
            return Err(ferry_proto::fencing::stale_epoch(req.epoch, newest));
        }
        if let Err(refused) = self.check_leadership(&req).await {
            tracing::warn!(epoch = req.epoch, scheduler = %req.scheduler_id, reason = %refused.message(), "handshake refused");
            return Err(refused);
        }
        let secret = ferry_runtime::secret::random();
        let session_id = {
            let mut state = self.state()?;
            let newest = state.newest(&req.pool);
            if req.epoch < newest {
                return Err(ferry_proto::fencing::stale_epoch(req.epoch, newest));
            }
            if state.session_id != 0 && state.pool != req.pool && state.streaming {
                return Err(Status::unavailable(format!(
                    "a scheduler of pool {:?} ({}) drives this executor: it lets go when its \
                     shard no longer owns it; try again",
                    state.pool, state.scheduler_id
                )));
            }
            state.epochs.insert(req.pool.clone(), req.epoch);
            state.pool.clone_from(&req.pool);
            self.adopt(&req)?;
            state.last_session_id += 1;
            state.session_id = state.last_session_id;
            state.scheduler_id = req.scheduler_id;
            state.secret.clone_from(&secret);
            state.streaming = false;
            tracing::info!(session = state.session_id, epoch = req.epoch, pool = %state.pool, scheduler = %state.scheduler_id, "session opened");
            state.session_id
        };
        // A new session starts with no request (the scheduler sends its requests as new ones)
        // and with the blocks cached so far, for the scheduler to adopt.
        let (_, cached_blocks) = self.engine.reset().await?;
        tracing::info!(
            session = session_id,
            cached_blocks = cached_blocks.len(),
            "cached blocks offered"
        );
        let info = Some((*self.info()?).clone());
        Ok(Response::new(v1::HandshakeResponse {
            session_id,
            info,
            session_secret: secret,
            cached_blocks,
        }))
    }

    type SessionStream = ReceiverStream<Result<v1::StepResult, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<v1::Step>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let secret = presented_secret(request.metadata());
        let mut steps = request.into_inner();
        let (tx, rx) = mpsc::channel(8);
        let this = self.clone();
        tokio::spawn(async move {
            let mut last_step: Option<u64> = None;
            // The session this stream holds, from its first step on.
            let mut claim: Option<StreamClaim> = None;
            loop {
                let step = match steps.message().await {
                    Ok(Some(step)) => step,
                    Ok(None) => return,
                    Err(status) => {
                        // The scheduler went away, or sent what cannot be decoded (a step past
                        // --max-step-bytes): it hears why, if it still listens.
                        tracing::debug!(%status, "session stream ended");
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                };
                let checked = match &claim {
                    Some(c) if c.session_id != step.session_id => {
                        Err(Status::invalid_argument(format!(
                            "this stream is session {}'s, not {}'s",
                            c.session_id, step.session_id
                        )))
                    }
                    // The stream's secret was checked when it claimed the session, and a
                    // session keeps its secret: only the session and epoch can change.
                    Some(_) => this
                        .state()
                        .and_then(|state| Self::check_session(&state, step.session_id, step.epoch)),
                    None => this.claim(&step, &secret).map(|c| claim = Some(c)),
                };
                if let Err(status) = checked {
                    let _ = tx.send(Err(status)).await;
                    return;
                }
                if last_step.is_some_and(|last| step.step_id <= last) {
                    let msg = format!(
                        "step ids must increase: {} after {}",
                        step.step_id,
                        last_step.unwrap_or(0)
                    );
                    let _ = tx.send(Err(Status::invalid_argument(msg))).await;
                    return;
                }
                last_step = Some(step.step_id);
                let traced = this.trace.as_ref().map(|_| TracedStep::of(&step));
                let reply = match this.engine.execute(step).await {
                    Ok(Ok(result)) => Ok(result),
                    Ok(Err(refused)) => Err(Status::invalid_argument(refused.to_string())),
                    Err(unavailable) => Err(unavailable),
                };
                if let (Some(trace), Some(traced)) = (&this.trace, traced) {
                    trace.record(traced);
                }
                let failed = reply.is_err();
                if tx.send(reply).await.is_err() || failed {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn reset(
        &self,
        request: Request<v1::ResetRequest>,
    ) -> Result<Response<v1::ResetResponse>, Status> {
        let secret = presented_secret(request.metadata());
        let req = request.into_inner();
        self.check_current(req.session_id, req.epoch, &secret)?;
        let (dropped, _) = self.engine.reset().await?;
        Ok(Response::new(v1::ResetResponse { dropped_requests: dropped as u32 }))
    }

    async fn describe(
        &self,
        _request: Request<v1::DescribeRequest>,
    ) -> Result<Response<v1::ExecutorDescription>, Status> {
        let stats = self.engine.stats().await?;
        let state = self.state()?;
        Ok(Response::new(v1::ExecutorDescription {
            info: Some((*self.info()?).clone()),
            session_id: state.session_id,
            epoch: state.newest(&state.pool),
            scheduler_id: state.scheduler_id.clone(),
            num_requests: stats.num_requests,
            steps_executed: stats.steps_executed,
            blocks_in_use: stats.blocks_in_use,
            busy_us: stats.busy_us,
            idle_us: stats.idle_us,
            simulated_us: stats.simulated_us,
        }))
    }
}
