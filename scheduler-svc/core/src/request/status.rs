//! A request's lifecycle as the core reports it: its status, why it finished, the last thing
//! the scheduler decided about it, and its timestamps.
//!
//! Status is lifecycle only: pending work and admission slots are kept elsewhere (see the
//! module head of `request`), so a finished request may still hold its slot.

use crate::types::{Timestamp, TokenId};

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// A stop condition on the last sampled token.
    Stop(StopCause),
    /// `max_tokens` reached, or prompt + output reached the model's maximum length.
    Length,
    /// Aborted by the caller.
    Abort,
    /// Gave up: a KV export failed.
    Error,
    /// Prefill-only request whose KV was exported; it continues on another executor.
    Transferred,
}

/// The token that stopped a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopCause {
    /// One of the model's end-of-sequence tokens.
    Eos(TokenId),
    /// One of the request's stop token ids.
    StopToken(TokenId),
}

/// Lifecycle of a request (not its pending work, not its slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestStatus {
    /// In the waiting queue, no slot; may hold KV blocks (yielded, or imported without a slot).
    Waiting,
    /// Its KV arrives from elsewhere: queued for a fetch, or holding blocks being filled.
    Receiving,
    /// Holds an admission slot; has at most one pending work item.
    Active,
    /// Its KV is being exported (prefill-only role); holds slot and blocks until reported.
    Transferring,
    /// Terminal. It may still hold its slot until no in-flight step references it.
    Finished(FinishReason),
}

impl RequestStatus {
    /// True once finished.
    #[must_use]
    pub fn is_finished(self) -> bool {
        matches!(self, RequestStatus::Finished(_))
    }
}

/// The last thing the scheduler decided about a request (for the admin listing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// Added to the waiting queue.
    Queued,
    /// Waiting for a KV fetch slot or for blocks to import into.
    ImportQueued,
    /// Blocks allocated, import in progress.
    Importing,
    /// Admitted into a slot this step.
    Admitted,
    /// Got work in the last step.
    Scheduled,
    /// Not scheduled: the step's token budget ran out.
    NoBudget,
    /// Not admitted / scheduled: not enough free blocks.
    NoBlocks,
    /// Not admitted: all slots taken.
    NoSlot,
    /// Not admitted: a step still in flight references it.
    InFlight,
    /// Not scheduled: the blocks it needs are fenced by an in-flight step; next step.
    FenceWait,
    /// Not admitted: a sample waiting for its source's prompt KV to fork from.
    ForkWait,
    /// Not admitted: its LoRA adapter is not held and the executor holds `max_loras` others.
    LoraWait,
    /// Preempted (recompute).
    Preempted,
    /// Yielded its slot, kept its KV.
    Yielded,
    /// Some or all of its KV was reclaimed while it waited.
    Reclaimed,
    /// Its KV export is in progress.
    Exporting,
    /// Finished.
    Finished,
}

/// Per-request timestamps (for queue time, TTFT, end-to-end latency).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestTimes {
    /// When it arrived.
    pub arrival: Timestamp,
    /// First time it was scheduled.
    pub first_scheduled: Option<Timestamp>,
    /// When its first output token was applied.
    pub first_token: Option<Timestamp>,
    /// Each preemption.
    pub preemptions: Vec<Timestamp>,
    /// When it finished.
    pub finished: Option<Timestamp>,
}
