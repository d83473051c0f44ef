//! A request as the core sees it: its lifecycle status, its token progress, and its stop rules.
//!
//! Why here: the fields that move together (computed tokens, output placeholders, block table,
//! block hashes) live in one record so the step builder and the result path update them with
//! the same helpers; the record is split in a hot part and a cold one by how often a decode
//! step touches a field (see [`Request`]). Status is lifecycle only; pending work lives in
//! `work_queues`, admission in the slot counter — the three are separate on purpose (a finished
//! request may still hold its slot while an in-flight step references it).
//!
//! Token accounting (vLLM v1): `num_computed` counts tokens whose KV is computed *or scheduled*
//! in a built step; `placeholders` counts tokens a built step will sample whose value has not
//! come back yet. So the next work is `num_tokens() + placeholders - num_computed` tokens, and a
//! request never has more computed tokens than its block table can hold.
//!
//! The parts: `new_request` is what a caller adds ([`NewRequest`], with its KV import and
//! parallel-sampling role); `status` the lifecycle and decisions a caller can read back;
//! `record` the core's own record ([`Request`]) with its token accounting and stop rule;
//! `stop_tokens` the small id sets and one-word filter that rule reads.

mod new_request;
mod record;
mod status;
mod stop_tokens;

pub use new_request::{Fork, KvImport, NewRequest};
pub(crate) use record::{Request, StepMark, TransferState};
pub use status::{Decision, FinishReason, RequestStatus, RequestTimes, StopCause};
