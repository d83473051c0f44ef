//! The scheduler's and the front's configuration: flags (vLLM's names where one exists, each
//! also a `FERRY_…` environment variable), resolved once at start-up into checked settings.
//!
//! The pipeline, in one place: clap parses [`SchedulerArgs`] and [`FrontArgs`]; `resolve`
//! checks every rule — cross-field ones included, by asking the scheduling core itself whether
//! it would run with these values — and returns [`SchedulerSettings`] / [`FrontSettings`],
//! which exist only when valid. A bad flag is an error that names the flag, before anything
//! binds or loads. When an executor handshakes, [`SchedulerSettings::core_config`] — the one
//! function that builds the core's configuration — adds what that executor stated (block size,
//! block count, model length).

use std::time::Duration;

use clap::Args;
use ferry_proto::v1;
use ferry_sched_core as core;

use crate::front::RequestLimits;

/// Steps outstanding at once per executor: one running, one queued behind it (asynchronous
/// scheduling), so the executor never waits for the scheduler.
pub const MAX_STEPS_IN_FLIGHT: usize = 2;

/// Flags of the scheduling role: how each executor's core schedules, and how this scheduler
/// finds and keeps its executors.
#[derive(Clone, Debug, Args)]
pub struct SchedulerArgs {
    /// Most requests that hold an admission slot at once, per executor.
    #[arg(long, env = "FERRY_MAX_NUM_SEQS", default_value_t = 256)]
    pub max_num_seqs: u32,
    /// Most tokens one step may compute, per executor (at least --max-num-seqs, so every
    /// running request can get a token each step).
    #[arg(long, env = "FERRY_MAX_NUM_BATCHED_TOKENS", default_value_t = 2048)]
    pub max_num_batched_tokens: u32,
    /// Split long prompts into chunks that share steps with decodes.
    #[arg(long, env = "FERRY_ENABLE_CHUNKED_PREFILL", default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_chunked_prefill: bool,
    /// How long start-up keeps trying to reach each listed executor, in seconds.
    #[arg(long, env = "FERRY_EXECUTOR_CONNECT_TIMEOUT", default_value_t = 60)]
    pub executor_connect_timeout: u64,
    /// The pool this scheduler leads (with etcd: one leader per pool, the others stand by).
    #[arg(long, env = "FERRY_POOL", default_value = "default")]
    pub pool: String,
    /// Without etcd: a file holding the token (hex, at least 16 bytes) this scheduler presents
    /// to the executors it lists; executors given the same file open sessions only for it.
    /// With etcd each leadership publishes a fresh token there instead.
    #[arg(long = "leadership-token-file", env = "FERRY_LEADERSHIP_TOKEN_FILE")]
    pub leadership_token_file: Option<std::path::PathBuf>,
    /// This scheduler's id, shown by executors as their session's owner
    /// (default `scheduler-<pid>`).
    #[arg(long = "scheduler-id", env = "FERRY_SCHEDULER_ID")]
    pub scheduler_id: Option<String>,
    /// KV tier: full blocks a finished request computed are written to its executor's KV
    /// agent, at most this many per step (each a copy at the step's start); 0 turns writes
    /// off. Executors without an agent write nothing.
    #[arg(long, env = "FERRY_KV_TIER_STORE_BLOCKS_PER_STEP", default_value_t = 16)]
    pub kv_tier_store_blocks_per_step: u32,
    /// Which waiting request is admitted first and which running one gives way when blocks
    /// run out (vLLM's flag): `fcfs`, by arrival; `priority`, by each request's `priority`
    /// (lower first, then arrival). Under `fcfs` a request that sets a priority is refused.
    #[arg(long, env = "FERRY_SCHEDULING_POLICY", value_enum, default_value_t = SchedulingPolicy::Fcfs)]
    pub scheduling_policy: SchedulingPolicy,
    /// Reuse the KV of a prompt's leading full blocks that another request computed (vLLM's
    /// flag; on by default).
    #[arg(long, env = "FERRY_ENABLE_PREFIX_CACHING", default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_prefix_caching: bool,
    /// What preemption does with a running request's KV when blocks run out: `recompute`
    /// frees its blocks and computes its tokens again later (vLLM v1's only mode); `yield`
    /// keeps its blocks while it waits, and resumes it without recompute.
    #[arg(long, env = "FERRY_PREEMPTION_MODE", value_enum, default_value_t = PreemptionModeArg::Recompute)]
    pub preemption_mode: PreemptionModeArg,
    /// Largest prompt chunk one request computes in one step, so a long prompt shares steps
    /// with others (vLLM's flag); 0: only --max-num-batched-tokens limits it.
    #[arg(long, env = "FERRY_LONG_PREFILL_TOKEN_THRESHOLD", default_value_t = 0)]
    pub long_prefill_token_threshold: u32,
    /// Speculative decoding (vLLM's flag), as JSON: `{"method": "ngram",
    /// "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`. Off by
    /// default. A request whose last tokens occurred earlier in its prompt or output proposes
    /// the tokens that followed them, and one step verifies them all; outputs are the same as
    /// without it. Only the `ngram` method exists (no draft model yet); vLLM's
    /// `disable_by_batch_size` turns proposals off while more requests than that run. With
    /// it, steps are not pipelined (a proposal needs the last token).
    #[arg(long, env = "FERRY_SPECULATIVE_CONFIG")]
    pub speculative_config: Option<String>,
}

/// `--speculative-config`'s JSON, as vLLM's `SpeculativeConfig` spells it.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SpeculativeJson {
    method: Option<String>,
    num_speculative_tokens: Option<usize>,
    prompt_lookup_max: Option<usize>,
    prompt_lookup_min: Option<usize>,
    disable_by_batch_size: Option<usize>,
}

/// Parses `--speculative-config` into the core's settings, checked.
pub fn parse_speculative_config(json: &str) -> Result<core::SpeculativeConfig, ConfigError> {
    let bad = |why: String| ConfigError::Speculative { why };
    let spec: SpeculativeJson = serde_json::from_str(json).map_err(|e| bad(e.to_string()))?;
    match spec.method.as_deref() {
        Some("ngram") => {}
        None => return Err(bad("\"method\" is required; the method served is \"ngram\"".into())),
        Some(other) => {
            return Err(bad(format!(
                "method {other:?} is not served: only \"ngram\" (prompt lookup); a draft \
                 model's proposals are not implemented yet"
            )))
        }
    }
    let k = spec
        .num_speculative_tokens
        .ok_or_else(|| bad("\"num_speculative_tokens\" is required".into()))?;
    // vLLM's defaults: both 5 when neither is given, else the one given for both.
    let (min, max) = match (spec.prompt_lookup_min, spec.prompt_lookup_max) {
        (None, None) => (5, 5),
        (Some(n), None) | (None, Some(n)) => (n, n),
        (Some(min), Some(max)) => (min, max),
    };
    let config = core::SpeculativeConfig {
        num_speculative_tokens: k,
        prompt_lookup_max: max,
        prompt_lookup_min: min,
        disable_by_batch_size: spec.disable_by_batch_size,
    };
    config.validate().map_err(|e| match e {
        core::ConfigError::Speculative(why) => bad(why),
        other => bad(other.to_string()),
    })?;
    Ok(config)
}

/// `--preemption-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PreemptionModeArg {
    /// Free the victim's blocks; its tokens are computed again when it resumes.
    Recompute,
    /// The victim keeps its blocks while it waits.
    Yield,
}

/// `--scheduling-policy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SchedulingPolicy {
    /// First come, first served.
    Fcfs,
    /// By request priority (lower first), then arrival.
    Priority,
}

/// Executors listed by hand (without etcd, or beside it).
#[derive(Clone, Debug, Args)]
pub struct ExecutorListArgs {
    /// Executor addresses to schedule for (repeatable, or comma-separated): `host:port` or a
    /// URL.
    #[arg(long = "executor", env = "FERRY_EXECUTORS", value_delimiter = ',')]
    pub executors: Vec<String>,
}

impl ExecutorListArgs {
    /// The listed executors as `(name, url)`: the name is the address as given.
    pub fn resolve(&self) -> Result<Vec<(String, String)>, ConfigError> {
        self.executors
            .iter()
            .map(|a| {
                let a = a.trim();
                if a.is_empty() || a.contains(char::is_whitespace) {
                    return Err(ConfigError::Address { flag: "executor", value: a.to_string() });
                }
                let url = if a.contains("://") { a.to_string() } else { format!("http://{a}") };
                Ok((a.to_string(), url))
            })
            .collect()
    }
}

/// Flags of the front: the client-facing limits.
#[derive(Clone, Debug, Args)]
pub struct FrontArgs {
    /// Most requests the front holds at once (running and queued, all executors); past it new
    /// requests are refused with 429 / `RESOURCE_EXHAUSTED`.
    #[arg(long, env = "FERRY_MAX_QUEUED_REQUESTS", default_value_t = 4096)]
    pub max_queued_requests: u32,
    /// How long a request whose executor (or scheduler) was lost waits for another to take
    /// it, in seconds (without etcd it moves only to an executor already up).
    #[arg(long, env = "FERRY_FAILOVER_TIMEOUT", default_value_t = 30)]
    pub failover_timeout: u64,
    /// Prefill/decode disaggregation: a prompt with at least this many tokens not cached on
    /// the decode executor is prefilled on a prefill-role executor and its KV moved to the
    /// decode executor (needs both roles up, each with a KV agent). 0 turns it off.
    #[arg(long, env = "FERRY_DISAGGREGATION_MIN_TOKENS", default_value_t = 256)]
    pub disaggregation_min_tokens: u32,
    /// How long a KV transfer between executors may take, in seconds; past it the decode
    /// executor recomputes the prompt instead.
    #[arg(long, env = "FERRY_KV_TRANSFER_TIMEOUT", default_value_t = 30)]
    pub kv_transfer_timeout: u64,
    /// KV tier: a request whose prompt prefix is held by a KV agent's store (any node's) for at
    /// least this many tokens more than its executor's cache holds imports it from there
    /// instead of computing it. 0 turns KV-tier reads off.
    #[arg(long, env = "FERRY_KV_TIER_MIN_TOKENS", default_value_t = 64)]
    pub kv_tier_min_tokens: u32,
    /// An API key clients must present (`Authorization: Bearer <key>`, HTTP header or gRPC
    /// metadata) on the client APIs (vLLM's flag); its id is `default`, without limits.
    #[arg(long, env = "FERRY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// A JSON file of API keys with per-key limits:
    /// `{"keys": [{"id": "team-a", "key": "…", "requests_per_minute": 60,
    /// "tokens_per_minute": 100000, "max_concurrent": 8}]}` (limits optional). Logs, metrics
    /// and traces name a key by its id.
    #[arg(long, env = "FERRY_API_KEYS_FILE")]
    pub api_keys_file: Option<std::path::PathBuf>,
    /// With API keys, `/health` and `/metrics` on the HTTP API need a key too.
    #[arg(long, env = "FERRY_API_KEY_GUARDS_HEALTH_AND_METRICS")]
    pub api_key_guards_health_and_metrics: bool,
    /// Most tokens of prompt and output together (vLLM's flag); default: the model's length,
    /// capped to what the smallest executor's KV cache holds for one request.
    #[arg(long, env = "FERRY_MAX_MODEL_LEN")]
    pub max_model_len: Option<u32>,
    /// Most prompt tokens per request; default: up to the model length.
    #[arg(long, env = "FERRY_MAX_PROMPT_TOKENS")]
    pub max_prompt_tokens: Option<u32>,
    /// Most tokens generated per request (`max_tokens`); default: up to the model length.
    #[arg(long, env = "FERRY_MAX_OUTPUT_TOKENS")]
    pub max_output_tokens: Option<u32>,
    /// Most stop strings per request.
    #[arg(long, env = "FERRY_MAX_STOP_STRINGS", default_value_t = RequestLimits::STOP_STRINGS)]
    pub max_stop_strings: u32,
    /// Longest stop string, in bytes.
    #[arg(long, env = "FERRY_MAX_STOP_STRING_BYTES", default_value_t = RequestLimits::STOP_STRING_BYTES)]
    pub max_stop_string_bytes: u32,
    /// Most stop token ids per request.
    #[arg(long, env = "FERRY_MAX_STOP_TOKEN_IDS", default_value_t = RequestLimits::STOP_TOKEN_IDS)]
    pub max_stop_token_ids: u32,
    /// Most log-probabilities per position a request may ask for (vLLM's flag; at most 20,
    /// what executors compute).
    #[arg(long, env = "FERRY_MAX_LOGPROBS", default_value_t = RequestLimits::LOGPROBS)]
    pub max_logprobs: u32,
    /// Largest request, in bytes: an HTTP body (413 past it) or a gRPC message
    /// (`RESOURCE_EXHAUSTED`).
    #[arg(long, env = "FERRY_MAX_REQUEST_BYTES", default_value_t = RequestLimits::REQUEST_BYTES)]
    pub max_request_bytes: u32,
}

/// Largest `--executor-connect-timeout` and `--failover-timeout`: a day.
pub const MAX_TIMEOUT_SECS: u64 = 86_400;

/// The scheduling role's settings, checked.
#[derive(Clone, Debug)]
pub struct SchedulerSettings {
    /// Who this scheduler is (executors show it as their session's owner).
    pub scheduler_id: String,
    /// The pool it schedules.
    pub pool: String,
    /// How long a connection to a listed or discovered executor is retried.
    pub connect_timeout: Duration,
    /// The token presented to listed executors without etcd (empty: none).
    pub static_token: std::sync::Arc<[u8]>,
    /// The core's policy, with placeholder executor geometry (see [`Self::core_config`]).
    policy: core::SchedulerConfig,
}

/// The front's settings, checked.
#[derive(Clone, Debug)]
pub struct FrontSettings {
    /// Most requests held at once.
    pub max_live: usize,
    /// How long a request whose executor or scheduler was lost waits for another.
    pub failover_wait: Duration,
    /// Least uncached prompt tokens for prefill/decode disaggregation; `None`: off.
    pub disaggregation_min_tokens: Option<usize>,
    /// How long a KV transfer may take.
    pub kv_transfer_timeout: Duration,
    /// Least prompt tokens a KV-tier read must save; `None`: no KV-tier reads.
    pub kv_tier_min_tokens: Option<usize>,
    /// The API keys callers must present; `None`: the client APIs are open.
    pub keys: Option<std::sync::Arc<crate::front::keys::ApiKeys>>,
    /// What one request may ask for.
    pub limits: RequestLimits,
    /// `--max-model-len`, if given.
    pub max_model_len: Option<usize>,
    /// Whether requests may set a priority: the scheduler that serves them orders by it. A
    /// front in its own process forwards it and its leader decides.
    pub accepts_priority: bool,
}

/// A flag value, or a combination, that Ferry will not run with. Each message names the
/// flags involved and the limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `--speculative-config` is not valid.
    #[error("--speculative-config: {why}")]
    Speculative {
        /// What is wrong, with the limit.
        why: String,
    },
    /// `--leadership-token-file` cannot be read or holds no token.
    #[error("{why}")]
    TokenFile {
        /// What is wrong, naming the file.
        why: String,
    },
    /// `--api-key` or `--api-keys-file` is not usable.
    #[error("{why}")]
    ApiKeys {
        /// What is wrong, naming the flag.
        why: String,
    },
    /// A request limit out of range.
    #[error("--{flag} {why}")]
    Limit {
        /// The flag.
        flag: &'static str,
        /// What is wrong, with the bound.
        why: String,
    },
    /// A count that must be positive is zero.
    #[error("--{flag} must be at least 1")]
    Zero {
        /// The flag, without its dashes.
        flag: &'static str,
    },
    /// The step budget cannot give every admitted request a token.
    #[error(
        "--max-num-batched-tokens ({budget}) must be at least --max-num-seqs ({seqs}), so \
         every running request can get a token in each step"
    )]
    BudgetBelowSeqs {
        /// `--max-num-batched-tokens`.
        budget: usize,
        /// `--max-num-seqs`.
        seqs: usize,
    },
    /// A timeout out of range.
    #[error("--{flag} must be between 1 and {MAX_TIMEOUT_SECS} seconds, got {got}")]
    Timeout {
        /// The flag, without its dashes.
        flag: &'static str,
        /// The value given.
        got: u64,
    },
    /// A name that is empty or has characters that cannot go in an etcd key.
    #[error(
        "--{flag} {value:?} must be non-empty and contain only letters, digits, '-', '_' and '.'"
    )]
    Name {
        /// The flag, without its dashes.
        flag: &'static str,
        /// The value given.
        value: String,
    },
    /// An address that cannot be one.
    #[error("--{flag} {value:?} is not an address (host:port or a URL)")]
    Address {
        /// The flag, without its dashes.
        flag: &'static str,
        /// The value given.
        value: String,
    },
    /// An executor's handshake stated a geometry the core cannot run with.
    #[error("executor {executor}: {source}")]
    Executor {
        /// The executor's id.
        executor: String,
        /// What the core refused.
        #[source]
        source: core::ConfigError,
    },
}

/// What an executor's handshake contributes to its core's configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExecutorGeometry {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in its KV pool.
    pub num_blocks: usize,
    /// Largest prompt + output.
    pub max_model_len: usize,
    /// It has a KV agent (it can write to the KV tier).
    pub kv_agent: bool,
}

impl From<&v1::ExecutorInfo> for ExecutorGeometry {
    fn from(info: &v1::ExecutorInfo) -> Self {
        Self {
            block_size: info.block_size as usize,
            num_blocks: info.num_blocks as usize,
            max_model_len: info.max_model_len as usize,
            kv_agent: !info.kv_agent_address.is_empty(),
        }
    }
}

/// Checks a `--pool` value (it becomes an etcd key segment).
pub fn check_pool(pool: &str) -> Result<(), ConfigError> {
    check_name("pool", pool)
}

fn check_name(flag: &'static str, value: &str) -> Result<(), ConfigError> {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if value.is_empty() || !value.chars().all(ok) {
        return Err(ConfigError::Name { flag, value: value.to_string() });
    }
    Ok(())
}

fn check_timeout(flag: &'static str, secs: u64) -> Result<Duration, ConfigError> {
    if !(1..=MAX_TIMEOUT_SECS).contains(&secs) {
        return Err(ConfigError::Timeout { flag, got: secs });
    }
    Ok(Duration::from_secs(secs))
}

/// The flag behind one of the core's policy fields.
fn flag_of(field: &str) -> &'static str {
    match field {
        "max_num_seqs" => "max-num-seqs",
        "max_num_batched_tokens" => "max-num-batched-tokens",
        _ => "an internal setting",
    }
}

impl SchedulerArgs {
    /// Checks every rule, the core's own included, and returns the settings.
    pub fn resolve(&self) -> Result<SchedulerSettings, ConfigError> {
        check_name("pool", &self.pool)?;
        let scheduler_id = self
            .scheduler_id
            .clone()
            .unwrap_or_else(|| format!("scheduler-{}", std::process::id()));
        check_name("scheduler-id", &scheduler_id)?;
        let connect_timeout =
            check_timeout("executor-connect-timeout", self.executor_connect_timeout)?;
        let speculative =
            self.speculative_config.as_deref().map(parse_speculative_config).transpose()?;
        let policy = core::SchedulerConfig {
            speculative,
            max_num_seqs: self.max_num_seqs as usize,
            max_num_batched_tokens: self.max_num_batched_tokens as usize,
            enable_chunked_prefill: self.enable_chunked_prefill,
            // A draft continues the last token: with speculation every step waits for the
            // result of the one before (pipelined, a request would propose only every other
            // step).
            max_steps_in_flight: if speculative.is_some() { 1 } else { MAX_STEPS_IN_FLIGHT },
            kv_tier_store_blocks_per_step: self.kv_tier_store_blocks_per_step as usize,
            preemption_policy: match self.scheduling_policy {
                SchedulingPolicy::Fcfs => core::PreemptionPolicy::Fcfs,
                SchedulingPolicy::Priority => core::PreemptionPolicy::Priority,
            },
            preemption_mode: match self.preemption_mode {
                PreemptionModeArg::Recompute => core::PreemptionMode::Recompute,
                PreemptionModeArg::Yield => core::PreemptionMode::Yield,
            },
            enable_prefix_caching: self.enable_prefix_caching,
            long_prefill_token_threshold: (self.long_prefill_token_threshold > 0)
                .then_some(self.long_prefill_token_threshold as usize),
            ..core::SchedulerConfig::default()
        };
        // The core's default geometry is valid, so whatever the core refuses here is a flag's.
        policy.validate().map_err(|e| match e {
            core::ConfigError::Zero { field } => ConfigError::Zero { flag: flag_of(field) },
            core::ConfigError::BudgetBelowSeqs { max_num_batched_tokens, max_num_seqs } => {
                ConfigError::BudgetBelowSeqs { budget: max_num_batched_tokens, seqs: max_num_seqs }
            }
            other => ConfigError::Executor { executor: "(defaults)".into(), source: other },
        })?;
        let static_token = match &self.leadership_token_file {
            Some(path) => ferry_runtime::secret::read_token_file(path)
                .map_err(|why| ConfigError::TokenFile { why })?
                .into(),
            None => std::sync::Arc::from([]),
        };
        Ok(SchedulerSettings {
            scheduler_id,
            pool: self.pool.clone(),
            connect_timeout,
            static_token,
            policy,
        })
    }
}

impl FrontArgs {
    /// Checks the front's flags and returns its settings.
    pub fn resolve(&self) -> Result<FrontSettings, ConfigError> {
        if self.max_queued_requests == 0 {
            return Err(ConfigError::Zero { flag: "max-queued-requests" });
        }
        Ok(FrontSettings {
            max_live: self.max_queued_requests as usize,
            failover_wait: check_timeout("failover-timeout", self.failover_timeout)?,
            disaggregation_min_tokens: (self.disaggregation_min_tokens > 0)
                .then_some(self.disaggregation_min_tokens as usize),
            kv_transfer_timeout: check_timeout("kv-transfer-timeout", self.kv_transfer_timeout)?,
            kv_tier_min_tokens: (self.kv_tier_min_tokens > 0)
                .then_some(self.kv_tier_min_tokens as usize),
            keys: crate::front::keys::ApiKeys::load(
                self.api_key.as_deref(),
                self.api_keys_file.as_deref(),
                self.api_key_guards_health_and_metrics,
            )
            .map_err(|why| ConfigError::ApiKeys { why })?
            .map(std::sync::Arc::new),
            limits: self.limits()?,
            max_model_len: self.max_model_len.map(|n| n as usize),
            accepts_priority: true,
        })
    }

    /// The per-request limits, checked: none may be 0, logprobs at most what executors compute,
    /// and a request must have room for a prompt.
    fn limits(&self) -> Result<RequestLimits, ConfigError> {
        let positive = |flag: &'static str, v: u32| {
            if v == 0 {
                return Err(ConfigError::Limit { flag, why: "must be at least 1".into() });
            }
            Ok(v as usize)
        };
        for (flag, v) in [
            ("max-model-len", self.max_model_len),
            ("max-prompt-tokens", self.max_prompt_tokens),
            ("max-output-tokens", self.max_output_tokens),
        ] {
            if let Some(v) = v {
                positive(flag, v)?;
            }
        }
        let most = ferry_model::sampling::MAX_TOP_LOGPROBS;
        if self.max_logprobs > most {
            return Err(ConfigError::Limit {
                flag: "max-logprobs",
                why: format!("is {}; executors compute at most {most}", self.max_logprobs),
            });
        }
        if self.max_request_bytes < 1024 {
            return Err(ConfigError::Limit {
                flag: "max-request-bytes",
                why: format!("is {}; at least 1024 bytes", self.max_request_bytes),
            });
        }
        Ok(RequestLimits {
            max_prompt_tokens: self.max_prompt_tokens.map_or(usize::MAX, |n| n as usize),
            max_output_tokens: self.max_output_tokens.map_or(usize::MAX, |n| n as usize),
            max_stop_strings: positive("max-stop-strings", self.max_stop_strings)?,
            max_stop_string_bytes: positive("max-stop-string-bytes", self.max_stop_string_bytes)?,
            max_stop_token_ids: positive("max-stop-token-ids", self.max_stop_token_ids)?,
            max_logprobs: self.max_logprobs,
            max_request_bytes: self.max_request_bytes as usize,
        })
    }
}

impl SchedulerSettings {
    /// Whether the core orders requests by their priority (`--scheduling-policy priority`).
    pub fn orders_by_priority(&self) -> bool {
        self.policy.preemption_policy == core::PreemptionPolicy::Priority
    }

    /// The core's configuration for the executor `executor_id` with `geometry` (from its
    /// handshake): the flags' policy plus what the executor stated. Refused when the executor
    /// stated something the core cannot run with (no blocks, say).
    pub fn core_config(
        &self,
        executor_id: &str,
        geometry: ExecutorGeometry,
    ) -> Result<core::SchedulerConfig, ConfigError> {
        let config = core::SchedulerConfig {
            block_size: geometry.block_size,
            num_blocks: geometry.num_blocks,
            max_model_len: geometry.max_model_len,
            kv_tier_store_blocks_per_step: if geometry.kv_agent {
                self.policy.kv_tier_store_blocks_per_step
            } else {
                0
            },
            ..self.policy.clone()
        };
        config.validate().map_err(|source| ConfigError::Executor {
            executor: executor_id.to_string(),
            source,
        })?;
        Ok(config)
    }

    /// Most requests holding an admission slot at once, per executor.
    pub fn max_num_seqs(&self) -> usize {
        self.policy.max_num_seqs
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        scheduler: SchedulerArgs,
        #[command(flatten)]
        front: FrontArgs,
    }

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("x").chain(args.iter().copied())).expect("parses")
    }

    #[test]
    fn speculative_config_reads_vllms_json_and_stops_pipelining() {
        let cli = parse(&[
            "--speculative-config",
            r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}"#,
        ]);
        let policy = cli.scheduler.resolve().unwrap().policy;
        assert_eq!(policy.speculative, Some(core::SpeculativeConfig::ngram(4)));
        assert_eq!(policy.max_steps_in_flight, 1);
        let lookup = parse_speculative_config(r#"{"method":"ngram","num_speculative_tokens":3}"#);
        let lookup = lookup.unwrap();
        assert_eq!((lookup.prompt_lookup_min, lookup.prompt_lookup_max), (5, 5), "vLLM's default");
        let one = parse_speculative_config(
            r#"{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":3}"#,
        )
        .unwrap();
        assert_eq!((one.prompt_lookup_min, one.prompt_lookup_max), (3, 3));
        let off = parse(&[]).scheduler.resolve().unwrap().policy;
        assert_eq!(off.speculative, None);
        assert_eq!(off.max_steps_in_flight, MAX_STEPS_IN_FLIGHT);
    }

    #[test]
    fn every_bad_flag_is_refused_with_its_name() {
        let cases: &[(&[&str], &str)] = &[
            (&["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
            (&["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be at least 1"),
            (
                &["--max-num-seqs", "64", "--max-num-batched-tokens", "32"],
                "--max-num-batched-tokens (32) must be at least --max-num-seqs (64)",
            ),
            (&["--executor-connect-timeout", "0"], "--executor-connect-timeout must be between"),
            (&["--pool", "a/b"], "--pool \"a/b\" must be non-empty"),
            (&["--scheduler-id", ""], "--scheduler-id \"\" must be non-empty"),
            (&["--speculative-config", "{"], "--speculative-config: EOF while parsing"),
            (
                &["--speculative-config", r#"{"method": "eagle", "num_speculative_tokens": 2}"#],
                "--speculative-config: method \"eagle\" is not served: only \"ngram\"",
            ),
            (
                &["--speculative-config", r#"{"method": "ngram"}"#],
                "--speculative-config: \"num_speculative_tokens\" is required",
            ),
            (
                &["--speculative-config", r#"{"method": "ngram", "num_speculative_tokens": 17}"#],
                "--speculative-config: num_speculative_tokens must be 1..=16, got 17",
            ),
            (
                &[
                    "--speculative-config",
                    r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 1, "prompt_lookup_min": 3}"#,
                ],
                "prompt_lookup_max (1) must be >= prompt_lookup_min (3)",
            ),
            (
                &[
                    "--speculative-config",
                    r#"{"method": "ngram", "num_speculative_tokens": 4, "k": 1}"#,
                ],
                "--speculative-config: unknown field `k`",
            ),
        ];
        let listed = ExecutorListArgs { executors: vec!["127.0.0.1:5".into(), " ".into()] };
        let err = listed.resolve().unwrap_err();
        assert!(err.to_string().contains("--executor \"\" is not an address"), "{err}");
        for (args, want) in cases {
            let err = parse(args).scheduler.resolve().expect_err("refused");
            assert!(err.to_string().contains(want), "{args:?}: {err}");
        }
        let front: &[(&[&str], &str)] = &[
            (&["--max-queued-requests", "0"], "--max-queued-requests must be at least 1"),
            (&["--failover-timeout", "0"], "--failover-timeout must be between 1 and 86400"),
            (&["--max-model-len", "0"], "--max-model-len must be at least 1"),
            (&["--max-prompt-tokens", "0"], "--max-prompt-tokens must be at least 1"),
            (&["--max-output-tokens", "0"], "--max-output-tokens must be at least 1"),
            (&["--max-stop-strings", "0"], "--max-stop-strings must be at least 1"),
            (&["--max-stop-string-bytes", "0"], "--max-stop-string-bytes must be at least 1"),
            (&["--max-stop-token-ids", "0"], "--max-stop-token-ids must be at least 1"),
            (&["--max-logprobs", "21"], "--max-logprobs is 21; executors compute at most 20"),
            (&["--max-request-bytes", "100"], "--max-request-bytes is 100; at least 1024"),
        ];
        for (args, want) in front {
            let err = parse(args).front.resolve().expect_err("refused");
            assert!(err.to_string().contains(want), "{args:?}: {err}");
        }
    }

    #[test]
    fn the_scheduling_policy_flag_orders_the_core_by_priority() {
        let geometry = ExecutorGeometry {
            block_size: 16,
            num_blocks: 100,
            max_model_len: 2048,
            kv_agent: false,
        };
        let fcfs = parse(&[]).scheduler.resolve().unwrap();
        assert!(!fcfs.orders_by_priority());
        let config = fcfs.core_config("e", geometry).unwrap();
        assert_eq!(config.preemption_policy, core::PreemptionPolicy::Fcfs);
        let by_priority = parse(&["--scheduling-policy", "priority"]).scheduler.resolve().unwrap();
        assert!(by_priority.orders_by_priority());
        let config = by_priority.core_config("e", geometry).unwrap();
        assert_eq!(config.preemption_policy, core::PreemptionPolicy::Priority);
        assert!(Cli::try_parse_from(["x", "--scheduling-policy", "lifo"]).is_err());
    }

    #[test]
    fn vllm_flags_set_the_core_as_vllm_names_them() {
        let geometry = ExecutorGeometry {
            block_size: 16,
            num_blocks: 100,
            max_model_len: 2048,
            kv_agent: false,
        };
        let default = parse(&[]).scheduler.resolve().unwrap().core_config("e", geometry).unwrap();
        assert!(default.enable_prefix_caching);
        assert_eq!(default.preemption_mode, core::PreemptionMode::Recompute);
        assert_eq!(default.long_prefill_token_threshold, None);
        let set = parse(&[
            "--enable-prefix-caching",
            "false",
            "--preemption-mode",
            "yield",
            "--long-prefill-token-threshold",
            "128",
        ]);
        let config = set.scheduler.resolve().unwrap().core_config("e", geometry).unwrap();
        assert!(!config.enable_prefix_caching);
        assert_eq!(config.preemption_mode, core::PreemptionMode::Yield);
        assert_eq!(config.long_prefill_token_threshold, Some(128));
        assert!(Cli::try_parse_from(["x", "--preemption-mode", "swap"]).is_err());
    }

    #[test]
    fn the_core_config_is_the_flags_plus_the_executor_geometry() {
        let cli = parse(&["--max-num-seqs", "8", "--max-num-batched-tokens", "64"]);
        let settings = cli.scheduler.resolve().unwrap();
        let geometry = ExecutorGeometry {
            block_size: 16,
            num_blocks: 100,
            max_model_len: 2048,
            kv_agent: true,
        };
        let core = settings.core_config("e", geometry).unwrap();
        assert_eq!((core.max_num_seqs, core.max_num_batched_tokens), (8, 64));
        assert_eq!((core.block_size, core.num_blocks, core.max_model_len), (16, 100, 2048));
        assert_eq!(core.max_steps_in_flight, MAX_STEPS_IN_FLIGHT);
        let broken = ExecutorGeometry { num_blocks: 0, ..geometry };
        let err = settings.core_config("gpu-a", broken).unwrap_err();
        assert!(
            err.to_string().starts_with("executor gpu-a: num_blocks must be at least 1"),
            "{err}"
        );
    }
}
