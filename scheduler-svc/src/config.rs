//! The scheduler's configuration: every field a flag (vLLM's name where one exists) and a
//! `FERRY_…` environment variable, checked once at start-up.

use clap::Args;

/// Everything a scheduler needs to start.
#[derive(Clone, Debug, Args)]
pub struct SchedulerConfig {
    /// Executor addresses to schedule for (repeatable), until discovery through etcd.
    #[arg(long = "executor", env = "FERRY_EXECUTORS", value_delimiter = ',')]
    pub executors: Vec<String>,
    /// Most requests that hold an admission slot at once, per executor.
    #[arg(long, env = "FERRY_MAX_NUM_SEQS", default_value_t = 256)]
    pub max_num_seqs: u32,
    /// Most tokens one step may compute, per executor.
    #[arg(long, env = "FERRY_MAX_NUM_BATCHED_TOKENS", default_value_t = 2048)]
    pub max_num_batched_tokens: u32,
    /// Most requests the front holds at once (running and queued, all executors); past it new
    /// requests are refused with 429 / RESOURCE_EXHAUSTED.
    #[arg(long, env = "FERRY_MAX_QUEUED_REQUESTS", default_value_t = 4096)]
    pub max_queued_requests: u32,
    /// How long start-up keeps trying to reach each executor, in seconds.
    #[arg(long, env = "FERRY_EXECUTOR_CONNECT_TIMEOUT", default_value_t = 60)]
    pub executor_connect_timeout: u64,
    /// With etcd: how long a request whose executor was lost waits for another to take it,
    /// in seconds (without etcd it moves only to an executor already up).
    #[arg(long, env = "FERRY_FAILOVER_TIMEOUT", default_value_t = 30)]
    pub failover_timeout: u64,
    /// The pool this scheduler leads (with etcd: one leader per pool, the others stand by).
    #[arg(long, env = "FERRY_POOL", default_value = "default")]
    pub pool: String,
    /// This scheduler's id, shown by executors as their session's owner
    /// (default `scheduler-<pid>`).
    #[arg(long = "scheduler-id", env = "FERRY_SCHEDULER_ID")]
    pub scheduler_id: Option<String>,
    /// Split long prompts into chunks that share steps with decodes.
    #[arg(long, env = "FERRY_ENABLE_CHUNKED_PREFILL", default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_chunked_prefill: bool,
}

impl SchedulerConfig {
    /// The configuration with every flag at its default (environment variables still apply),
    /// from the same declarations the command line uses.
    pub fn from_defaults() -> Result<Self, clap::Error> {
        use clap::{Args, FromArgMatches};
        let cmd = Self::augment_args(clap::Command::new("ferry-scheduler"));
        Self::from_arg_matches(&cmd.try_get_matches_from(["ferry-scheduler"])?)
    }

    /// This scheduler's id.
    pub fn scheduler_id(&self) -> String {
        self.scheduler_id.clone().unwrap_or_else(|| format!("scheduler-{}", std::process::id()))
    }

    /// Checks what clap's types cannot, naming the limit.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_num_seqs == 0 {
            return Err(ConfigError::MaxNumSeqs);
        }
        if self.max_queued_requests == 0 {
            return Err(ConfigError::MaxQueued);
        }
        if self.max_num_batched_tokens == 0 {
            return Err(ConfigError::MaxNumBatchedTokens);
        }
        if let Some(bad) = self.executors.iter().find(|a| a.trim().is_empty()) {
            return Err(ConfigError::Executor(bad.clone()));
        }
        Ok(())
    }
}

/// A configuration value out of range.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// No slots.
    #[error("--max-num-seqs must be at least 1")]
    MaxNumSeqs,
    /// No room for requests.
    #[error("--max-queued-requests must be at least 1")]
    MaxQueued,
    /// No token budget.
    #[error("--max-num-batched-tokens must be at least 1")]
    MaxNumBatchedTokens,
    /// Empty executor address.
    #[error("--executor {0:?} is not an address")]
    Executor(String),
}
