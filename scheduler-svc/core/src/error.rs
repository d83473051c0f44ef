//! Typed errors for every bad input the core can receive.
//!
//! Why: the core never panics on input from the network; each rejection is classified here,
//! once, so the service layer maps it to a status code in one table.

use thiserror::Error;

use crate::types::{RequestId, StepId, TransferId};

/// Why a request was not added.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AddError {
    /// The prompt has no tokens.
    #[error("request {0}: empty prompt")]
    EmptyPrompt(RequestId),
    /// Prompt at or past the model's maximum length.
    #[error(
        "request {id}: prompt of {prompt_len} tokens, model allows fewer than {max_model_len}"
    )]
    PromptTooLong {
        /// Request.
        id: RequestId,
        /// Prompt tokens.
        prompt_len: usize,
        /// Model maximum length.
        max_model_len: usize,
    },
    /// `max_tokens` is zero.
    #[error("request {0}: max_tokens must be at least 1")]
    ZeroMaxTokens(RequestId),
    /// Prompt + `max_tokens` past the model's maximum length.
    #[error("request {id}: prompt {prompt_len} + max_tokens {max_tokens} > max_model_len {max_model_len}")]
    MaxTokensPastModelLen {
        /// Request.
        id: RequestId,
        /// Prompt tokens.
        prompt_len: usize,
        /// Requested output tokens.
        max_tokens: usize,
        /// Model maximum length.
        max_model_len: usize,
    },
    /// `min_tokens` larger than `max_tokens`.
    #[error("request {0}: min_tokens > max_tokens")]
    MinTokensAboveMax(RequestId),
    /// As many prior output tokens as `max_tokens` (nothing left to generate), or prior output
    /// combined with a KV import or export.
    #[error("request {id}: {output_len} prior output tokens leave nothing to generate within max_tokens {max_tokens}")]
    OutputComplete {
        /// Request.
        id: RequestId,
        /// Prior output tokens given.
        output_len: usize,
        /// Its `max_tokens`.
        max_tokens: usize,
    },
    /// Prior output tokens with a KV export (a prefill-only request is new).
    #[error("request {0}: prior output tokens cannot be combined with a KV export")]
    OutputWithTransfer(RequestId),
    /// A live request already has this id.
    #[error("request {0}: id already in use")]
    DuplicateId(RequestId),
    /// Even alone, the request would need more blocks than the cache has.
    #[error("request {id}: needs {blocks_needed} blocks, the cache has {num_blocks}")]
    NeverFits {
        /// Request.
        id: RequestId,
        /// Blocks for prompt + `max_tokens`.
        blocks_needed: usize,
        /// Blocks in the pool.
        num_blocks: usize,
    },
    /// Chunked prefill is off and the prompt exceeds the step token budget.
    #[error("request {id}: prompt of {prompt_len} tokens exceeds the step budget {budget} and chunked prefill is off")]
    PromptOverBudget {
        /// Request.
        id: RequestId,
        /// Prompt tokens.
        prompt_len: usize,
        /// `max_num_batched_tokens`.
        budget: usize,
    },
    /// The KV import is malformed or imports are disabled.
    #[error("request {id}: invalid KV import: {reason}")]
    InvalidImport {
        /// Request.
        id: RequestId,
        /// What is wrong.
        reason: &'static str,
    },
    /// A parallel-sampling fork that cannot be: its source is not a live
    /// [`crate::Fork::Source`] with the same prompt and salt, or it is combined with a KV
    /// transfer or prior output.
    #[error("request {id}: invalid sample fork: {reason}")]
    InvalidFork {
        /// Request.
        id: RequestId,
        /// What is wrong.
        reason: &'static str,
    },
    /// A looped model's request that asks for what a looped request cannot do (a KV
    /// transfer, a fork), or for more loops than the model runs, or loops on a plain model.
    #[error("request {id}: {reason}")]
    Looped {
        /// Request.
        id: RequestId,
        /// What is wrong.
        reason: String,
    },
    /// The import's transfer id is already in use.
    #[error("request {id}: transfer {transfer_id} already in use")]
    DuplicateTransfer {
        /// Request.
        id: RequestId,
        /// Transfer.
        transfer_id: TransferId,
    },
}

/// Why an abort was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AbortError {
    /// No such request (never added, or already retired).
    #[error("request {0}: unknown")]
    Unknown(RequestId),
    /// Already finished (its finish was reported; nothing to abort).
    #[error("request {0}: already finished")]
    AlreadyFinished(RequestId),
}

/// Why no step could be built.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ScheduleError {
    /// `max_steps_in_flight` steps await their results.
    #[error("{0} steps already in flight; apply a result first")]
    TooManyStepsInFlight(usize),
}

/// Why a step result or a KV report was refused (nothing was changed).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ApplyError {
    /// No step with this id is in flight.
    #[error("{0}: not in flight")]
    UnknownStep(StepId),
    /// Results must be applied in step order.
    #[error("{got}: results must be applied in order, expected {expected}")]
    OutOfOrder {
        /// The step the result names.
        got: StepId,
        /// The oldest step in flight.
        expected: StepId,
    },
    /// A sampled token for a request that was not scheduled to sample in that step.
    #[error("{step}: request {id} did not sample in this step")]
    UnexpectedToken {
        /// Step.
        step: StepId,
        /// Request.
        id: RequestId,
    },
    /// Two sampled tokens for one request in one step.
    #[error("{step}: request {id} sampled twice")]
    DuplicateToken {
        /// Step.
        step: StepId,
        /// Request.
        id: RequestId,
    },
    /// More tokens for a verification than its draft allows (the draft tokens it accepted and
    /// one more), or for other work more than one.
    #[error(
        "{step}: request {id} returned {got} tokens, at most {most} (its draft tokens and one)"
    )]
    TooManyTokens {
        /// Step.
        step: StepId,
        /// Request.
        id: RequestId,
        /// Tokens in the result.
        got: usize,
        /// At most.
        most: usize,
    },
    /// Requests scheduled to sample that have no token in the result.
    #[error("{step}: {missing} sampled tokens missing")]
    MissingTokens {
        /// Step.
        step: StepId,
        /// How many.
        missing: usize,
    },
    /// An exit reported for a request whose work in that step was not a recurrent loop.
    #[error("{step}: request {id} reported an exit but ran no recurrent loop in this step")]
    UnexpectedExit {
        /// Step.
        step: StepId,
        /// Request.
        id: RequestId,
    },
    /// A KV result for a transfer the core does not have in progress.
    #[error("{0}: unknown or not in progress")]
    UnknownTransfer(TransferId),
}
