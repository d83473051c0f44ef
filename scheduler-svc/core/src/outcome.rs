//! What comes back from the executor ([`StepOutcome`]) and what the core tells the service layer
//! in return ([`RequestEvent`]).
//!
//! Why flat: a step result carries one sampled token per decoding request; a flat list of
//! `(id, token)` pairs lets the caller reuse one `Vec` for every step, and leaves room for
//! several tokens per request once speculative verification exists.

use crate::request::FinishReason;
use crate::types::{RequestId, StepId, TokenId, TransferId};

/// One sampled token for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampledToken {
    /// The request.
    pub id: RequestId,
    /// The token the executor sampled.
    pub token: TokenId,
}

/// How a KV transfer ended, as reported by the executor (or decided by the service layer on a
/// deadline or a dead agent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvResult {
    /// The transfer.
    pub transfer_id: TransferId,
    /// True if all blocks were moved and verified.
    pub ok: bool,
}

/// The executor's result for one step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutcome {
    /// The step this result is for.
    pub step_id: StepId,
    /// One entry per scheduled work with `samples_token`.
    pub sampled: Vec<SampledToken>,
    /// KV transfers that ended since the previous result.
    pub kv_results: Vec<KvResult>,
    /// Requests the executor refused (their data broke one of its rules or limits): each
    /// finishes with [`FinishReason::Error`], alone, and samples nothing in this step. An id
    /// already finished, or unknown, is ignored (the executor names a refused request again in
    /// every step sent before the scheduler heard).
    pub refused: Vec<RequestId>,
    /// A looped model's requests whose recurrent loop in this step passed the exit criterion
    /// for every token of their chain: their chains go to the coda next.
    pub exited: Vec<RequestId>,
}

/// Latency and size figures of a finished request (vLLM's per-request histograms).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FinishStats {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Output tokens generated.
    pub output_tokens: usize,
    /// Prompt tokens served from the prefix cache at its first admission.
    pub prefix_hit_tokens: usize,
    /// Times it was preempted.
    pub num_preemptions: u32,
    /// Arrival → first scheduled, seconds (`None` if never scheduled).
    pub queue_time: Option<f64>,
    /// Arrival → first token, seconds.
    pub time_to_first_token: Option<f64>,
    /// Arrival → finish, seconds.
    pub e2e_latency: f64,
}

/// A request that finished.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FinishedRequest {
    /// The request.
    pub id: RequestId,
    /// Why.
    pub reason: FinishReason,
    /// Its final counters.
    pub stats: FinishStats,
}

/// Something the service layer must pass on (stream a token, close a stream, record a metric).
///
/// A step emits one `Token` per decoding request and rarely anything else, so the rare, large
/// `Finished` payload is boxed: the enum is 32 bytes instead of 96, and at 16 384 running
/// requests a step writes 0.5 MiB of events instead of 1.5 MiB.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestEvent {
    /// A token was appended to the request's output.
    Token {
        /// The request.
        id: RequestId,
        /// The token.
        token: TokenId,
        /// Its index in the output.
        index: usize,
        /// A looped model's request: the recurrent loops the token's chain ran (fewer than
        /// its `max_loops` if it exited early); 0 for a plain model's.
        loops: u8,
    },
    /// The request finished.
    Finished(Box<FinishedRequest>),
    /// A KV import ended (an import that failed is prefilled locally instead).
    Imported {
        /// The request.
        id: RequestId,
        /// The transfer.
        transfer_id: TransferId,
        /// True if the KV arrived.
        ok: bool,
    },
    /// A prefill-only request's prompt is done and its KV export starts.
    ExportStarted {
        /// The request.
        id: RequestId,
        /// The transfer id the export is issued under.
        transfer_id: TransferId,
    },
}
