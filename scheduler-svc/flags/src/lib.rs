//! The scheduling policy's flags: one definition, with one set of defaults, for every program
//! that runs Ferry's scheduling core — `ferry-scheduler` and `ferry serve` (through the
//! scheduler service), `ferry-bench`'s in-process runs and `ferry-sim`. A flag the simulator
//! takes is the flag the scheduler takes, so a simulated fleet runs the policy a real one
//! would with the same command line.
//!
//! Why a crate of its own: the simulator must not link tokio, tonic and etcd to parse flags,
//! and the pure core must not know a command line. Here clap parses [`SchedulingArgs`] (vLLM's
//! flag names where one exists, each also a `FERRY_…` environment variable); [`policy`]
//! checks every rule — by asking the core itself whether it would run with these values — and
//! returns a [`SchedulerPolicy`], which exists only when valid; and
//! [`SchedulerPolicy::for_executor`], the one function that builds a core's configuration,
//! adds what an executor stated (its [`Geometry`]).
//!
//! [`policy`]: SchedulingArgs::policy

mod speculative;

use ferry_sched_core as core;

pub use speculative::parse_speculative_config;

/// Steps outstanding at once per executor without speculation: one running, one queued behind
/// it (asynchronous scheduling), so the executor never waits for the scheduler.
pub const STEPS_IN_FLIGHT: usize = 2;

/// How each executor's scheduling core schedules.
#[derive(Clone, Debug, clap::Args)]
pub struct SchedulingArgs {
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
    /// KV tier: full blocks a finished request computed are written to its executor's KV
    /// agent, at most this many per step (each a copy at the step's start); 0 turns writes
    /// off. Executors without an agent write nothing.
    #[arg(long, env = "FERRY_KV_TIER_STORE_BLOCKS_PER_STEP", default_value_t = 16)]
    pub kv_tier_store_blocks_per_step: u32,
    /// Data-parallel groups (executors started with `--dp-group`, stepped together one round
    /// at a time): on rounds that are not aligned prefill rounds, a rank that has a decode to
    /// run holds its prefills back (no prompt chunk, no admission) unless requests were left
    /// waiting by its last round that did not — vLLM's prefill throttle, so ranks that decode
    /// do not wait each round for one that prefills.
    #[arg(long, env = "FERRY_THROTTLE_PREFILLS", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub throttle_prefills: bool,
    /// With --throttle-prefills: every Nth round of a group's wave is an aligned prefill round
    /// (vLLM's `--prefill-schedule-interval`, whose step counter restarts with each wave); a
    /// wave starts when a group that had no work gets some, so a lone request is not held.
    #[arg(long, env = "FERRY_PREFILL_SCHEDULE_INTERVAL", default_value_t = 4)]
    pub prefill_schedule_interval: u32,
    /// Which waiting request is admitted first and which running one gives way when blocks
    /// run out (vLLM's flag): `fcfs`, by arrival; `priority`, by each request's `priority`
    /// (lower first, then arrival); `least-work-done` (Ferry's own), arrival order, and the
    /// running request with the fewest computed tokens gives way unless it is within 5 % of
    /// its `max_tokens`. Unless `priority`, a request that sets a priority is refused.
    #[arg(long, env = "FERRY_SCHEDULING_POLICY", value_enum, default_value_t = SchedulingPolicy::Fcfs)]
    pub scheduling_policy: SchedulingPolicy,
    /// Looped models (executors started with `--looped-layers`): `separate`, a step runs the
    /// decode work of its stage, or its prompt work when there is none; `mixed`, both in one
    /// step. Every step runs one stage either way.
    #[arg(long, env = "FERRY_STAGE_POLICY", value_enum, default_value_t = StagePolicyArg::Separate)]
    pub stage_policy: StagePolicyArg,
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

/// `--stage-policy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StagePolicyArg {
    /// One kind of work (decode, else prompt) of the step's stage.
    Separate,
    /// Decode and prompt work of the step's stage together.
    Mixed,
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
    /// Arrival order; the running request with the fewest computed tokens gives way, unless
    /// it is near completion.
    LeastWorkDone,
}

/// A scheduling flag value, or a combination, that the core will not run with. Each message
/// names the flags involved and the limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlagError {
    /// `--speculative-config` is not valid.
    #[error("--speculative-config: {why}")]
    Speculative {
        /// What is wrong, with the limit.
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
    /// Anything else the core refused (the core's own words).
    #[error("{0}")]
    Core(core::ConfigError),
}

/// What an executor contributes to its core's configuration (from its handshake, or a
/// simulated executor's sizing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in its KV pool.
    pub num_blocks: usize,
    /// Largest prompt + output.
    pub max_model_len: usize,
    /// It has a KV agent (it can write to the KV tier).
    pub kv_agent: bool,
    /// Its model is looped (the policy's stage policy applies).
    pub looped: Option<core::LoopedModel>,
    /// Most LoRA adapters it holds at once (its `--max-loras`; 0: it runs none, or no limit
    /// is needed).
    pub max_loras: usize,
}

/// The scheduling flags, checked: the core's policy with placeholder executor geometry.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerPolicy(core::SchedulerConfig, core::StagePolicy);

impl SchedulingArgs {
    /// The data-parallel prefill throttle's interval of aligned rounds, when on.
    ///
    /// # Errors
    ///
    /// An interval of 0.
    pub fn prefill_throttle(&self) -> Result<Option<u64>, FlagError> {
        if self.prefill_schedule_interval == 0 {
            return Err(FlagError::Zero { flag: "prefill-schedule-interval" });
        }
        Ok(self.throttle_prefills.then_some(u64::from(self.prefill_schedule_interval)))
    }

    /// Checks every rule, the core's own included, and returns the policy.
    pub fn policy(&self) -> Result<SchedulerPolicy, FlagError> {
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
            max_steps_in_flight: if speculative.is_some() { 1 } else { STEPS_IN_FLIGHT },
            kv_tier_store_blocks_per_step: self.kv_tier_store_blocks_per_step as usize,
            preemption_policy: match self.scheduling_policy {
                SchedulingPolicy::Fcfs => core::PreemptionPolicy::Fcfs,
                SchedulingPolicy::Priority => core::PreemptionPolicy::Priority,
                SchedulingPolicy::LeastWorkDone => core::PreemptionPolicy::LeastWorkDone,
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
            core::ConfigError::Zero { field } => FlagError::Zero { flag: flag_of(field) },
            core::ConfigError::BudgetBelowSeqs { max_num_batched_tokens, max_num_seqs } => {
                FlagError::BudgetBelowSeqs { budget: max_num_batched_tokens, seqs: max_num_seqs }
            }
            other => FlagError::Core(other),
        })?;
        let stage_policy = match self.stage_policy {
            StagePolicyArg::Separate => core::StagePolicy::Separate,
            StagePolicyArg::Mixed => core::StagePolicy::Mixed,
        };
        Ok(SchedulerPolicy(policy, stage_policy))
    }
}

/// The flag behind one of the core's policy fields.
fn flag_of(field: &str) -> &'static str {
    match field {
        "max_num_seqs" => "max-num-seqs",
        "max_num_batched_tokens" => "max-num-batched-tokens",
        _ => "an internal setting",
    }
}

impl SchedulerPolicy {
    /// The core's configuration for an executor with `geometry`: the flags' policy plus what
    /// the executor stated. Refused when the executor stated something the core cannot run
    /// with (no blocks, say).
    pub fn for_executor(
        &self,
        geometry: Geometry,
    ) -> Result<core::SchedulerConfig, core::ConfigError> {
        let config = core::SchedulerConfig {
            block_size: geometry.block_size,
            num_blocks: geometry.num_blocks,
            max_model_len: geometry.max_model_len,
            kv_tier_store_blocks_per_step: if geometry.kv_agent {
                self.0.kv_tier_store_blocks_per_step
            } else {
                0
            },
            looped: geometry.looped.map(|m| core::LoopedModel { policy: self.1, ..m }),
            max_loras: geometry.max_loras,
            ..self.0.clone()
        };
        config.validate()?;
        Ok(config)
    }

    /// Whether the core orders requests by their priority (`--scheduling-policy priority`).
    pub fn orders_by_priority(&self) -> bool {
        self.0.preemption_policy == core::PreemptionPolicy::Priority
    }

    /// Most requests holding an admission slot at once, per executor.
    pub fn max_num_seqs(&self) -> usize {
        self.0.max_num_seqs
    }

    /// The policy as the core sees it, with placeholder geometry.
    pub fn core(&self) -> &core::SchedulerConfig {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        scheduling: SchedulingArgs,
    }

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("x").chain(args.iter().copied())).expect("parses")
    }

    const GEOMETRY: Geometry = Geometry {
        block_size: 16,
        num_blocks: 100,
        max_model_len: 2048,
        kv_agent: false,
        looped: None,
        max_loras: 0,
    };

    #[test]
    fn speculative_config_reads_vllms_json_and_stops_pipelining() {
        let cli = parse(&[
            "--speculative-config",
            r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}"#,
        ]);
        let policy = cli.scheduling.policy().unwrap();
        assert_eq!(policy.core().speculative, Some(core::SpeculativeConfig::ngram(4)));
        assert_eq!(policy.core().max_steps_in_flight, 1);
        let lookup = parse_speculative_config(r#"{"method":"ngram","num_speculative_tokens":3}"#);
        let lookup = lookup.unwrap();
        assert_eq!((lookup.prompt_lookup_min, lookup.prompt_lookup_max), (5, 5), "vLLM's default");
        let one = parse_speculative_config(
            r#"{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":3}"#,
        )
        .unwrap();
        assert_eq!((one.prompt_lookup_min, one.prompt_lookup_max), (3, 3));
        let off = parse(&[]).scheduling.policy().unwrap();
        assert_eq!(off.core().speculative, None);
        assert_eq!(off.core().max_steps_in_flight, STEPS_IN_FLIGHT);
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
        for (args, want) in cases {
            let err = parse(args).scheduling.policy().expect_err("refused");
            assert!(err.to_string().contains(want), "{args:?}: {err}");
        }
    }

    #[test]
    fn the_scheduling_policy_flag_chooses_the_cores_victims_and_order() {
        let fcfs = parse(&[]).scheduling.policy().unwrap();
        assert!(!fcfs.orders_by_priority());
        let config = fcfs.for_executor(GEOMETRY).unwrap();
        assert_eq!(config.preemption_policy, core::PreemptionPolicy::Fcfs);
        let by_priority = parse(&["--scheduling-policy", "priority"]).scheduling.policy().unwrap();
        assert!(by_priority.orders_by_priority());
        let config = by_priority.for_executor(GEOMETRY).unwrap();
        assert_eq!(config.preemption_policy, core::PreemptionPolicy::Priority);
        let least = parse(&["--scheduling-policy", "least-work-done"]).scheduling.policy();
        let least = least.unwrap();
        assert!(!least.orders_by_priority());
        let config = least.for_executor(GEOMETRY).unwrap();
        assert_eq!(config.preemption_policy, core::PreemptionPolicy::LeastWorkDone);
        assert!(Cli::try_parse_from(["x", "--scheduling-policy", "lifo"]).is_err());
    }

    #[test]
    fn vllm_flags_set_the_core_as_vllm_names_them() {
        let default = parse(&[]).scheduling.policy().unwrap().for_executor(GEOMETRY).unwrap();
        assert!(default.enable_prefix_caching);
        assert!(default.enable_chunked_prefill);
        assert_eq!(default.preemption_mode, core::PreemptionMode::Recompute);
        assert_eq!(default.long_prefill_token_threshold, None);
        assert_eq!((default.max_num_seqs, default.max_num_batched_tokens), (256, 2048));
        let set = parse(&[
            "--enable-prefix-caching",
            "false",
            "--preemption-mode",
            "yield",
            "--long-prefill-token-threshold",
            "128",
        ]);
        let config = set.scheduling.policy().unwrap().for_executor(GEOMETRY).unwrap();
        assert!(!config.enable_prefix_caching);
        assert_eq!(config.preemption_mode, core::PreemptionMode::Yield);
        assert_eq!(config.long_prefill_token_threshold, Some(128));
        assert!(Cli::try_parse_from(["x", "--preemption-mode", "swap"]).is_err());
    }

    #[test]
    fn the_core_config_is_the_flags_plus_the_executor_geometry() {
        let cli = parse(&["--max-num-seqs", "8", "--max-num-batched-tokens", "64"]);
        let policy = cli.scheduling.policy().unwrap();
        let with_agent = Geometry { kv_agent: true, ..GEOMETRY };
        let core = policy.for_executor(with_agent).unwrap();
        assert_eq!((core.max_num_seqs, core.max_num_batched_tokens), (8, 64));
        assert_eq!((core.block_size, core.num_blocks, core.max_model_len), (16, 100, 2048));
        assert_eq!(core.max_steps_in_flight, STEPS_IN_FLIGHT);
        assert_eq!(core.kv_tier_store_blocks_per_step, 16, "the flag's default, with an agent");
        let without = policy.for_executor(GEOMETRY).unwrap();
        assert_eq!(without.kv_tier_store_blocks_per_step, 0, "no agent, no tier writes");
        let broken = Geometry { num_blocks: 0, ..GEOMETRY };
        let err = policy.for_executor(broken).unwrap_err();
        assert!(err.to_string().starts_with("num_blocks must be at least 1"), "{err}");
    }
}
