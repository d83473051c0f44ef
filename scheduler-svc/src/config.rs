//! The scheduler's and the front's configuration: flags (vLLM's names where one exists, each
//! also a `FERRY_…` environment variable), resolved once at start-up into checked settings.
//!
//! The pipeline, in one place: clap parses [`SchedulerArgs`] (the scheduling policy's flags,
//! [`SchedulingArgs`], shared with every program that runs the core, plus this service's own)
//! and [`FrontArgs`]; `resolve` checks every rule — cross-field ones included, by asking the
//! scheduling core itself whether it would run with these values — and returns
//! [`SchedulerSettings`] / [`FrontSettings`], which exist only when valid. A bad flag is an
//! error that names the flag, before anything binds or loads. When an executor handshakes,
//! [`SchedulerSettings::core_config`] adds what that executor stated.
//!
//! This module is the top of the crate's configuration: it builds the settings types that the
//! link and the front define for themselves, and nothing below imports it.

use std::time::Duration;

use clap::Args;
use ferry_sched_core as core;
pub use ferry_sched_flags::{
    parse_speculative_config, FlagError, PreemptionModeArg, SchedulingArgs, SchedulingPolicy,
};

pub use crate::front::keys::ApiKeys;
pub use crate::front::{FrontSettings, RequestLimits};
pub use crate::link::SchedulerSettings;

/// Flags of the scheduling role: how each executor's core schedules, and how this scheduler
/// finds and keeps its executors.
#[derive(Clone, Debug, Args)]
pub struct SchedulerArgs {
    /// The scheduling policy (shared with `ferry-sim` and `ferry-bench`).
    #[command(flatten)]
    pub scheduling: SchedulingArgs,
    /// How long start-up keeps trying to reach each listed executor, in seconds.
    #[arg(long, env = "FERRY_EXECUTOR_CONNECT_TIMEOUT", default_value_t = 60)]
    pub executor_connect_timeout: u64,
    /// The pool this scheduler leads (with etcd: one leader per pool, the others stand by).
    #[arg(long, env = "FERRY_POOL", default_value = ferry_runtime::cluster::DEFAULT_POOL)]
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
    /// Routing: tokens of a request's prefix cached on an executor that one more live request
    /// there outweighs. A new request goes to the executor with the greatest cached prefix
    /// less this much per request it holds, so a popular prompt spreads once its executor is
    /// busier by the prefix's worth; 0: the longest cached prefix wins however busy.
    #[arg(long, env = "FERRY_ROUTE_LOAD_TOKENS", default_value_t = ferry_sched_core::routing::LOAD_TOKENS as u32)]
    pub route_load_tokens: u32,
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
    /// Serve LoRA adapters: a request's `model` may name one (vLLM's flag).
    #[arg(long, env = "FERRY_ENABLE_LORA")]
    pub enable_lora: bool,
    /// With --enable-lora: adapters served from the start, each `name=path` (a PEFT folder or a
    /// LoRA GGUF; a relative path is in the model's folder, on this node and the executors'),
    /// on the first model served, or vLLM's `{"name":…,"path":…,"base_model_name":…}`.
    #[arg(long, env = "FERRY_LORA_MODULES", value_delimiter = ' ', num_args = 1.., value_parser = crate::front::adapters::parse_module, requires = "enable_lora")]
    pub lora_modules: Vec<crate::front::LoraModule>,
}

/// Largest `--executor-connect-timeout` and `--failover-timeout`: a day.
pub const MAX_TIMEOUT_SECS: u64 = 86_400;

/// A flag value, or a combination, that Ferry will not run with. Each message names the
/// flags involved and the limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A scheduling flag (or a combination) the core will not run with.
    #[error(transparent)]
    Flags(FlagError),
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
        let policy = self.scheduling.policy().map_err(|e| match e {
            // What the core refuses with its default geometry, it would refuse of any executor.
            FlagError::Core(source) => {
                ConfigError::Executor { executor: "(defaults)".into(), source }
            }
            flag => ConfigError::Flags(flag),
        })?;
        let static_token = match &self.leadership_token_file {
            Some(path) => ferry_runtime::secret::read_token_file(path)
                .map_err(|why| ConfigError::TokenFile { why })?
                .into(),
            None => std::sync::Arc::from([]),
        };
        let prefill_throttle = self.scheduling.prefill_throttle().map_err(ConfigError::Flags)?;
        Ok(SchedulerSettings {
            scheduler_id,
            pool: self.pool.clone(),
            connect_timeout,
            static_token,
            policy,
            prefill_throttle,
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
            route_load_tokens: self.route_load_tokens as usize,
            keys: ApiKeys::load(
                self.api_key.as_deref(),
                self.api_keys_file.as_deref(),
                self.api_key_guards_health_and_metrics,
            )
            .map_err(|why| ConfigError::ApiKeys { why })?
            .map(std::sync::Arc::new),
            limits: self.limits()?,
            max_model_len: self.max_model_len.map(|n| n as usize),
            accepts_priority: true,
            lora: crate::front::LoraSettings {
                enabled: self.enable_lora,
                modules: self.lora_modules.clone(),
                max_rank: ferry_model::lora::DEFAULT_MAX_LORA_RANK,
            },
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use ferry_sched_flags::Geometry;

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
    fn every_bad_flag_is_refused_with_its_name() {
        let cases: &[(&[&str], &str)] = &[
            (&["--executor-connect-timeout", "0"], "--executor-connect-timeout must be between"),
            (&["--pool", "a/b"], "--pool \"a/b\" must be non-empty"),
            (&["--scheduler-id", ""], "--scheduler-id \"\" must be non-empty"),
            // The scheduling flags' own checks are `ferry-sched-flags`' tests; one shows that
            // their errors reach the service's user unchanged.
            (&["--speculative-config", "{"], "--speculative-config: EOF while parsing"),
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
    fn the_core_config_is_the_flags_plus_the_executor_geometry() {
        let cli = parse(&["--max-num-seqs", "8", "--max-num-batched-tokens", "64"]);
        let settings = cli.scheduler.resolve().unwrap();
        let geometry = Geometry {
            block_size: 16,
            num_blocks: 100,
            max_model_len: 2048,
            kv_agent: true,
            looped: None,
            max_loras: 0,
        };
        let core = settings.core_config("e", geometry).unwrap();
        assert_eq!((core.max_num_seqs, core.max_num_batched_tokens), (8, 64));
        assert_eq!((core.block_size, core.num_blocks, core.max_model_len), (16, 100, 2048));
        assert_eq!(core.max_steps_in_flight, ferry_sched_flags::STEPS_IN_FLIGHT);
        let broken = Geometry { num_blocks: 0, ..geometry };
        let err = settings.core_config("gpu-a", broken).unwrap_err();
        assert!(
            err.to_string().starts_with("executor gpu-a: num_blocks must be at least 1"),
            "{err}"
        );
        let by_priority = parse(&["--scheduling-policy", "priority"]).scheduler.resolve().unwrap();
        assert!(by_priority.orders_by_priority());
        assert!(!settings.orders_by_priority());
    }
}
