//! Opening a session to an executor: the handshake (under this scheduler's id and leadership
//! epoch, for the model it tokenizes for), the core configured from the flags and the
//! executor's answer, and the step loop started on the session's streams.
//!
//! A refusal that another try cannot fix — the executor runs another model, or states a
//! geometry the core cannot use — is [`LinkError::Refused`] and is not retried; anything else
//! (not up yet, still loading) is retried with the runtime's backoff until the patience given
//! runs out.

use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1::{self, executor_client::ExecutorClient};
use ferry_runtime::{tls, Backoff};
use ferry_sched_core::{BlockHash, BlockId, Scheduler};
use ferry_sched_flags::{Geometry, SchedulerPolicy, STEPS_IN_FLIGHT};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::step_loop::Session;
use super::{wire, LinkError, LinkHandle};
use crate::fence::Fence;
use crate::metrics::SchedulerMetrics;

/// The scheduling role's settings, checked (`config` builds them from the flags).
#[derive(Clone, Debug)]
pub struct SchedulerSettings {
    /// Who this scheduler is (executors show it as their session's owner).
    pub scheduler_id: String,
    /// The pool it schedules.
    pub pool: String,
    /// How long a connection to a listed or discovered executor is retried.
    pub connect_timeout: Duration,
    /// The token presented to listed executors without etcd (empty: none).
    pub static_token: Arc<[u8]>,
    /// The core's policy, with placeholder executor geometry (see [`Self::core_config`]).
    pub policy: SchedulerPolicy,
    /// Data-parallel groups' aligned prefill rounds, one in this many, when prefills are
    /// throttled (`--throttle-prefills`).
    pub prefill_throttle: Option<u64>,
}

/// An executor stated a geometry the core cannot run with.
#[derive(Debug, thiserror::Error)]
#[error("executor {executor}: {source}")]
pub struct GeometryRefused {
    /// The executor's id.
    pub executor: String,
    /// What the core refused.
    #[source]
    pub source: ferry_sched_core::ConfigError,
}

impl SchedulerSettings {
    /// Whether the core orders requests by their priority (`--scheduling-policy priority`).
    pub fn orders_by_priority(&self) -> bool {
        self.policy.orders_by_priority()
    }

    /// The core's configuration for the executor `executor_id` with `geometry` (from its
    /// handshake): the flags' policy plus what the executor stated. Refused when the executor
    /// stated something the core cannot run with (no blocks, say).
    pub fn core_config(
        &self,
        executor_id: &str,
        geometry: Geometry,
    ) -> Result<ferry_sched_core::SchedulerConfig, GeometryRefused> {
        self.policy
            .for_executor(geometry)
            .map_err(|source| GeometryRefused { executor: executor_id.to_string(), source })
    }

    /// Most requests holding an admission slot at once, per executor.
    pub fn max_num_seqs(&self) -> usize {
        self.policy.max_num_seqs()
    }
}

/// What an executor's handshake contributes to its core's configuration.
pub fn geometry_of(info: &v1::ExecutorInfo) -> Geometry {
    Geometry {
        block_size: info.block_size as usize,
        num_blocks: info.num_blocks as usize,
        max_model_len: info.max_model_len as usize,
        kv_agent: !info.kv_agent_address.is_empty(),
        looped: info.looped.as_ref().map(|m| {
            let mut model =
                ferry_sched_core::LoopedModel::new(u8::try_from(m.max_loops).unwrap_or(u8::MAX));
            model.prelude_kv = m.prelude_end > 0;
            model.coda_kv = m.coda_start < m.num_layers;
            model
        }),
        max_loras: info.max_loras as usize,
    }
}

/// A model a scheduler drives executors for, as a handshake names it.
#[derive(Clone, Debug)]
pub struct OpenerModel {
    /// The name clients use (a simulating executor of several models' scheduler is matched
    /// by it: its `--served-model-name`).
    pub name: String,
    /// The fingerprint of its weights; an executor running other weights refuses the
    /// handshake.
    pub fingerprint: String,
    /// Its vocabulary size and end-of-sequence ids (a simulating executor serves them).
    pub vocab: (u32, Arc<[u32]>),
}

impl OpenerModel {
    /// The model of `file`.
    pub fn of(file: &ferry_model::ModelFile) -> Self {
        Self {
            name: file.name.clone(),
            fingerprint: file.fingerprint.clone(),
            vocab: (
                u32::try_from(file.shape.vocab_size).unwrap_or(u32::MAX),
                file.tokenizer.eog_token_ids.as_slice().into(),
            ),
        }
    }
}

/// What opening a session takes: who this scheduler is, under which epoch, for which models.
#[derive(Clone)]
pub struct SessionOpener {
    /// The scheduler's settings (its id, the core's policy, the connect patience).
    pub settings: Arc<SchedulerSettings>,
    /// The models this scheduler's front tokenizes for (the default first): an executor is
    /// driven for the one it runs, and refused if it runs none of them.
    pub models: Arc<[OpenerModel]>,
    /// The leadership epoch (0 without etcd).
    pub epoch: u64,
    /// The leadership token published in etcd for `epoch` (empty without etcd): executors
    /// registered in etcd open sessions only for it.
    pub token: Arc<[u8]>,
    /// Where the links count.
    pub metrics: Arc<SchedulerMetrics>,
    /// Where the links record what they wrote to their agents.
    pub tier: Arc<crate::tier::TierIndex>,
    /// Where the links report an executor's newer leadership epoch.
    pub fence: Arc<Fence>,
    /// The data-parallel groups whose ranks the links step in rounds.
    pub dp_groups: Arc<super::dp_group::DpGroups>,
}

impl SessionOpener {
    fn shared(&self) -> super::Shared {
        super::Shared {
            metrics: self.metrics.clone(),
            tier: self.tier.clone(),
            fence: self.fence.clone(),
        }
    }

    /// The same, under leadership `epoch`, whose token is `token`.
    #[must_use]
    pub fn at_epoch(&self, epoch: u64, token: Arc<[u8]>) -> Self {
        Self { epoch, token, ..self.clone() }
    }

    /// Opens a session to executor `name` at `url`, retrying what may succeed later until the
    /// settings' connect timeout runs out.
    pub async fn open_patiently(&self, name: &str, url: &str) -> Result<LinkHandle, LinkError> {
        let patience = Some(self.settings.connect_timeout);
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1))
            .with_patience(patience);
        loop {
            match self.open(name, url).await {
                Ok(link) => return Ok(link),
                Err(e @ LinkError::Refused { .. }) => return Err(e),
                Err(e) => {
                    tracing::debug!(error = %e, "executor not reachable yet, retrying");
                    if !backoff.wait().await {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Which of the models the executor behind `client` runs: the only one (its handshake
    /// checks it), or the one whose fingerprint it states (`Describe`), or for a simulating
    /// executor the one of its name. Errors: `Ok` a refusal, `Err` unreachable.
    async fn model_of(
        &self,
        client: &mut ExecutorClient<tonic::transport::Channel>,
    ) -> Result<&OpenerModel, Result<String, String>> {
        if let [only] = &*self.models {
            return Ok(only);
        }
        let described = client.describe(v1::DescribeRequest {}).await;
        let info = described
            .map_err(|s| Err(format!("describe: {}", s.message())))?
            .into_inner()
            .info
            .ok_or_else(|| Err("a description without executor info".to_string()))?;
        let simulated = info.backend == v1::Backend::Sim as i32;
        let found = self.models.iter().find(|m| m.fingerprint == info.model_fingerprint);
        let found = found.or_else(|| {
            simulated.then(|| self.models.iter().find(|m| m.name == info.model)).flatten()
        });
        found.ok_or_else(|| {
            let served: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
            Ok(format!(
                "this executor runs model {:?} (fingerprint {}), which this scheduler does not \
                 serve: it serves {}",
                info.model,
                info.model_fingerprint,
                served.join(", ")
            ))
        })
    }

    /// One attempt at opening a session to executor `name` at `url`.
    pub async fn open(&self, name: &str, url: &str) -> Result<LinkHandle, LinkError> {
        let unreachable = |reason: String| LinkError::Connect { addr: url.to_string(), reason };
        let refused = |reason: String| LinkError::Refused { addr: url.to_string(), reason };
        let endpoint = tls::endpoint(url).map_err(|e| unreachable(e.to_string()))?;
        let channel = tls::connect(&endpoint, tls::Role::Executor)
            .await
            .map_err(|e| unreachable(ferry_runtime::error_chain(&e)))?;
        let mut client = ExecutorClient::new(channel);
        let model = self.model_of(&mut client).await.map_err(|e| match e {
            Ok(why) => refused(why),
            Err(why) => unreachable(why),
        })?;
        let hs = client
            .handshake(v1::HandshakeRequest {
                scheduler_id: self.settings.scheduler_id.clone(),
                epoch: self.epoch,
                expected_model: String::new(),
                expected_fingerprint: model.fingerprint.clone(),
                vocab_size: model.vocab.0,
                eos_token_ids: model.vocab.1.to_vec(),
                leadership_token: self.token.to_vec(),
                pool: self.settings.pool.clone(),
            })
            .await
            .map_err(|s| {
                if let Some(newest) = ferry_proto::fencing::newest_epoch(&s) {
                    self.fence.saw(newest);
                }
                let why = format!("handshake: {}", s.message());
                match s.code() {
                    tonic::Code::FailedPrecondition
                    | tonic::Code::InvalidArgument
                    | tonic::Code::PermissionDenied => refused(why),
                    _ => unreachable(why),
                }
            })?
            .into_inner();
        let info = hs.info.ok_or_else(|| unreachable("handshake without executor info".into()))?;
        let config = self
            .settings
            .core_config(&info.executor_id, geometry_of(&info))
            .map_err(|e| refused(e.to_string()))?;
        // The largest step this core can build must fit what the executor decodes.
        let largest =
            wire::largest_step_bytes(config.max_num_seqs, config.max_model_len, config.block_size);
        if info.max_step_bytes != 0 && largest > info.max_step_bytes {
            return Err(refused(format!(
                "a step of this scheduler can take up to {largest} bytes (--max-num-seqs {} × \
                 max_model_len {}), past the executor's --max-step-bytes {}: raise it or lower \
                 those",
                config.max_num_seqs, config.max_model_len, info.max_step_bytes
            )));
        }
        let mut core = Scheduler::new(config).map_err(|e| refused(format!("scheduler: {e}")))?;
        let group = match &info.data_parallel {
            Some(rank) => Some(self.dp_groups.join(rank).map_err(refused)?),
            None => None,
        };
        // The executor's cached blocks from earlier sessions: the prefix cache stays warm
        // across a leader change (the handshake checked the model's fingerprint).
        let cached = hs.cached_blocks.iter().map(|c| (BlockId(c.block_id), BlockHash(c.hash)));
        let adopted = core.adopt_cached_blocks(cached);
        tracing::info!(
            executor = name,
            offered = hs.cached_blocks.len(),
            adopted,
            "cached blocks adopted"
        );
        self.metrics.cached_blocks_adopted.add(adopted as u64);
        let (step_tx, step_rx) = mpsc::channel(STEPS_IN_FLIGHT + 1);
        let mut stream = tonic::Request::new(ReceiverStream::new(step_rx));
        let secret = ferry_runtime::secret::to_hex(&hs.session_secret);
        let secret =
            secret.parse().map_err(|_| refused("a session secret that is not hex".into()))?;
        stream.metadata_mut().insert(ferry_runtime::secret::SESSION_SECRET_HEADER, secret);
        let results = client
            .session(stream)
            .await
            .map_err(|s| unreachable(format!("session: {}", s.message())))?
            .into_inner();
        self.metrics.sessions_opened.add(1);
        let session = Session { name: name.into(), epoch: self.epoch, id: hs.session_id, group };
        Ok(LinkHandle::start(core, session, info, self.shared(), step_tx, results))
    }
}
