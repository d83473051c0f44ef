//! Scheduler configuration and its validation.
//!
//! Every limit the core enforces comes from [`SchedulerConfig`]; [`SchedulerConfig::validate`]
//! rejects combinations that would make the core unable to make progress, so the rest of the
//! crate may rely on them: all sizes are non-zero and `max_num_batched_tokens >= max_num_seqs`
//! (every running request can always get at least one token in a step, which the liveness
//! argument in `scheduler::preempt` depends on).

use thiserror::Error;

/// Which request gives way when a running request cannot get a KV block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PreemptionPolicy {
    /// The request admitted last (vLLM's FCFS: `running.pop()`).
    Fcfs,
    /// The request with the largest `(priority, arrival)`; a lower priority number is more
    /// important (vLLM's convention). The waiting queue is also ordered by priority.
    Priority,
    /// The request with the fewest computed tokens; a request within 5 % of its `max_tokens`
    /// is protected (near-completion protection).
    LeastWorkDone,
}

/// What happens to a preempted request's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PreemptionMode {
    /// Free its blocks, keep its generated tokens, reset its computed tokens, put it at the front
    /// of the waiting queue; it is prefilled again (prefix-cache hits make that cheaper).
    Recompute,
    /// Release its admission slot but keep its KV blocks; it waits holding them and resumes
    /// without recompute. Blocks held by waiting requests are reclaimed from the tail, only as
    /// many as a running request needs, before any running request is preempted.
    Yield,
}

/// Everything the scheduling core needs to know about one executor pool entry.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Number of KV blocks in the executor's cache.
    pub num_blocks: usize,
    /// Admission slots: at most this many requests own execution resources at once.
    pub max_num_seqs: usize,
    /// Token budget of one step (sum of scheduled tokens over the batch).
    pub max_num_batched_tokens: usize,
    /// The model's maximum length: prompt + output tokens never exceed it.
    pub max_model_len: usize,
    /// Split prompts into chunks across steps. Off: a prompt is computed in one step, and a
    /// prompt longer than the token budget is rejected when it is added.
    pub enable_chunked_prefill: bool,
    /// Largest prefill chunk one request gets in one step (vLLM's
    /// `long_prefill_token_threshold`); `None` means only the token budget limits it.
    pub long_prefill_token_threshold: Option<usize>,
    /// How many waiting requests one step looks at when admitting.
    pub lookahead: usize,
    /// Victim choice when a running request cannot get a block.
    pub preemption_policy: PreemptionPolicy,
    /// What preemption does with the victim's KV.
    pub preemption_mode: PreemptionMode,
    /// Aging cap: a request preempted this many times is protected; it is only preempted in
    /// favour of another protected request (or itself, when nothing else can give way).
    pub max_preemptions: u32,
    /// At most this many requests hold blocks for a KV import at once.
    pub max_kv_fetches: usize,
    /// Share full blocks between requests by content hash.
    pub enable_prefix_caching: bool,
    /// Steps that may be built before the oldest one's result is applied: 1 is synchronous
    /// scheduling, 2 lets step N+1 be built while step N runs (asynchronous scheduling).
    pub max_steps_in_flight: usize,
    /// KV tier: at most this many full blocks per step are copied to the node's KV agent
    /// when the request that computed them finishes; 0 turns the write path off. Needs prefix
    /// caching (blocks are named by their hashes).
    pub kv_tier_store_blocks_per_step: usize,
    /// Speculative decoding: `None` (the default) decodes one token per step.
    pub speculative: Option<SpeculativeConfig>,
    /// The executor's model is looped: its requests' work runs stage by stage
    /// ([`crate::LoopedModel`]). Such requests never speculate and use no prefix cache (their
    /// KV depends on their loops), and neither move KV between nodes nor fork.
    pub looped: Option<crate::LoopedModel>,
    /// Most LoRA adapters the executor holds at once (its `--max-loras`; 0: no limit). A
    /// request the executor knows holds its adapter there until it finishes (preempted too);
    /// a request of another adapter waits while that many are held (vLLM's `max_loras`).
    pub max_loras: usize,
}

/// Speculative decoding by prompt lookup (vLLM's `ngram` method): a request whose last tokens
/// occurred earlier in its prompt or output proposes the tokens that followed them there, and
/// one step verifies the proposal ([`crate::WorkKey::Verify`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SpeculativeConfig {
    /// Draft tokens proposed per step at most (vLLM's `num_speculative_tokens`),
    /// `1..=`[`MAX_SPECULATIVE_TOKENS`].
    pub num_speculative_tokens: usize,
    /// Longest n-gram looked up (vLLM's `prompt_lookup_max`).
    pub prompt_lookup_max: usize,
    /// Shortest n-gram looked up (vLLM's `prompt_lookup_min`), at least 1.
    pub prompt_lookup_min: usize,
    /// No request proposes while more than this many run (vLLM's `disable_by_batch_size`):
    /// a verification computes its draft's positions too, which a large batch on a
    /// compute-bound device pays for in full even when they are rejected.
    pub disable_by_batch_size: Option<usize>,
}

/// Most draft tokens one verification may carry.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

/// Longest n-gram a lookup may use (the lookup's cost grows with it).
pub const MAX_PROMPT_LOOKUP: usize = 64;

impl SpeculativeConfig {
    /// vLLM's n-gram defaults with `num_speculative_tokens` drafts (lookup of 4 down to 2).
    #[must_use]
    pub fn ngram(num_speculative_tokens: usize) -> Self {
        SpeculativeConfig {
            num_speculative_tokens,
            prompt_lookup_max: 4,
            prompt_lookup_min: 2,
            disable_by_batch_size: None,
        }
    }

    /// Checks the ranges (see the fields).
    ///
    /// # Errors
    ///
    /// [`ConfigError::Speculative`] naming the field and its limit.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |reason: String| Err(ConfigError::Speculative(reason));
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&self.num_speculative_tokens) {
            return bad(format!(
                "num_speculative_tokens must be 1..={MAX_SPECULATIVE_TOKENS}, got {}",
                self.num_speculative_tokens
            ));
        }
        if self.prompt_lookup_min == 0 {
            return bad("prompt_lookup_min must be at least 1".into());
        }
        if self.prompt_lookup_max < self.prompt_lookup_min {
            return bad(format!(
                "prompt_lookup_max ({}) must be >= prompt_lookup_min ({})",
                self.prompt_lookup_max, self.prompt_lookup_min
            ));
        }
        if self.disable_by_batch_size == Some(0) {
            return bad("disable_by_batch_size must be at least 1".into());
        }
        if self.prompt_lookup_max > MAX_PROMPT_LOOKUP {
            return bad(format!(
                "prompt_lookup_max must be at most {MAX_PROMPT_LOOKUP}, got {}",
                self.prompt_lookup_max
            ));
        }
        Ok(())
    }
}

/// Upper bound for [`SchedulerConfig::max_steps_in_flight`]: more than a few steps in flight
/// only adds latency to every decision and fences blocks for longer.
pub const MAX_STEPS_IN_FLIGHT: usize = 4;

impl Default for SchedulerConfig {
    /// vLLM's defaults where it has one; a small cache suitable for tests.
    fn default() -> Self {
        SchedulerConfig {
            block_size: 16,
            num_blocks: 1024,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 4096,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: None,
            lookahead: 256,
            preemption_policy: PreemptionPolicy::Fcfs,
            preemption_mode: PreemptionMode::Recompute,
            max_preemptions: 8,
            max_kv_fetches: 4,
            enable_prefix_caching: true,
            max_steps_in_flight: 1,
            kv_tier_store_blocks_per_step: 0,
            speculative: None,
            looped: None,
            max_loras: 0,
        }
    }
}

/// A configuration the core refuses to run with.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// A size that must be at least one is zero.
    #[error("{field} must be at least 1")]
    Zero {
        /// The offending field.
        field: &'static str,
    },
    /// The step budget cannot give every admitted request one token.
    #[error(
        "max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs \
         ({max_num_seqs}) so every running request can get a token each step"
    )]
    BudgetBelowSeqs {
        /// Configured token budget.
        max_num_batched_tokens: usize,
        /// Configured admission slots.
        max_num_seqs: usize,
    },
    /// `max_steps_in_flight` is past [`MAX_STEPS_IN_FLIGHT`].
    #[error("max_steps_in_flight must be 1..={max}, got {got}")]
    StepsInFlight {
        /// Configured value.
        got: usize,
        /// Largest accepted value.
        max: usize,
    },
    /// The speculative decoding settings are out of range.
    #[error("speculative config: {0}")]
    Speculative(String),
    /// A looped model's loops out of range.
    #[error("a looped model's max_loops must be 1..={max}, got {got}", max = crate::MAX_LOOPS)]
    Loops {
        /// What was configured.
        got: u8,
    },
    /// A block count or block size so large that block ids would not fit in 32 bits.
    #[error("num_blocks ({0}) does not fit in a 32-bit block id")]
    TooManyBlocks(usize),
    /// A model length past 32 bits (token counts per request are kept in 32 bits).
    #[error("max_model_len ({0}) does not fit in 32 bits (at most {max})", max = u32::MAX)]
    ModelTooLong(usize),
}

impl SchedulerConfig {
    /// Check the configuration; the core only runs with a valid one.
    ///
    /// # Errors
    ///
    /// The first [`ConfigError`] found: a size that must be non-zero is zero, the step budget is
    /// below `max_num_seqs`, `max_steps_in_flight` is out of range, or a count would not fit
    /// the core's 32-bit fields.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let nonzero = [
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
            ("lookahead", self.lookahead),
        ];
        for (field, value) in nonzero {
            if value == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        if self.long_prefill_token_threshold == Some(0) {
            return Err(ConfigError::Zero { field: "long_prefill_token_threshold" });
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(ConfigError::BudgetBelowSeqs {
                max_num_batched_tokens: self.max_num_batched_tokens,
                max_num_seqs: self.max_num_seqs,
            });
        }
        if self.max_steps_in_flight == 0 || self.max_steps_in_flight > MAX_STEPS_IN_FLIGHT {
            return Err(ConfigError::StepsInFlight {
                got: self.max_steps_in_flight,
                max: MAX_STEPS_IN_FLIGHT,
            });
        }
        if let Some(spec) = &self.speculative {
            spec.validate()?;
        }
        if let Some(looped) = &self.looped {
            if !(1..=crate::MAX_LOOPS).contains(&looped.max_loops) {
                return Err(ConfigError::Loops { got: looped.max_loops });
            }
        }
        if self.num_blocks >= u32::MAX as usize {
            return Err(ConfigError::TooManyBlocks(self.num_blocks));
        }
        if u32::try_from(self.max_model_len).is_err() {
            return Err(ConfigError::ModelTooLong(self.max_model_len));
        }
        Ok(())
    }

    /// Blocks needed to hold `tokens` tokens of KV.
    #[inline]
    #[must_use]
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Largest prefill chunk one request may get in one step.
    #[inline]
    pub(crate) fn chunk_cap(&self) -> usize {
        self.long_prefill_token_threshold.unwrap_or(usize::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        assert_eq!(SchedulerConfig::default().validate(), Ok(()));
    }

    #[test]
    fn rejects_zero_sizes_and_bad_combinations() {
        let base = SchedulerConfig::default();
        let bad = SchedulerConfig { block_size: 0, ..base.clone() };
        assert_eq!(bad.validate(), Err(ConfigError::Zero { field: "block_size" }));
        let bad = SchedulerConfig { long_prefill_token_threshold: Some(0), ..base.clone() };
        assert!(matches!(bad.validate(), Err(ConfigError::Zero { .. })));
        let bad = SchedulerConfig { max_num_seqs: 10, max_num_batched_tokens: 4, ..base.clone() };
        assert!(matches!(bad.validate(), Err(ConfigError::BudgetBelowSeqs { .. })));
        let bad = SchedulerConfig { max_steps_in_flight: 0, ..base.clone() };
        assert!(matches!(bad.validate(), Err(ConfigError::StepsInFlight { .. })));
        let bad = SchedulerConfig { max_steps_in_flight: MAX_STEPS_IN_FLIGHT + 1, ..base.clone() };
        assert!(matches!(bad.validate(), Err(ConfigError::StepsInFlight { .. })));
        let bad = SchedulerConfig { max_model_len: u32::MAX as usize + 1, ..base };
        let err = bad.validate().unwrap_err();
        assert_eq!(err, ConfigError::ModelTooLong(u32::MAX as usize + 1));
        assert!(err.to_string().contains("at most 4294967295"), "{err}");
    }
}
