//! Ferry's scheduling core: the pure, synchronous logic that decides, step by step, which
//! requests run on one executor and which KV-cache blocks they use.
//!
//! Why a crate of its own: it has no I/O, no async runtime and no clock (time is passed in),
//! and the crate boundary lets the compiler enforce that (likewise no `unsafe` outside the
//! one-instruction prefetch hint in `prefetch`). The service layer owns one [`Scheduler`] per
//! executor and drives it:
//!
//! ```
//! use ferry_sched_core::*;
//! let mut core = Scheduler::new(SchedulerConfig::default()).unwrap();
//! core.add_request(NewRequest::new(RequestId(1), vec![1, 2, 3], 4, Timestamp(0))).unwrap();
//! let mut events = Vec::new();
//! while !core.is_drained() {
//!     let plan = core.schedule(Timestamp(0)).unwrap();
//!     // ... send the plan to the executor, get its sampled tokens back ...
//!     let sampled = plan.scheduled.iter().filter(|w| w.samples_token)
//!         .map(|w| SampledToken { id: w.id, token: 7 }).collect();
//!     let outcome = StepOutcome { step_id: plan.step_id, sampled, ..StepOutcome::default() };
//!     core.apply_result(&outcome, Timestamp(0), &mut events).unwrap();
//! }
//! assert!(matches!(events.last(), Some(RequestEvent::Finished(_))));
//! ```
//!
//! Design (DESIGN §3): lifecycle status, pending work ([`WorkKey`] queues) and admission slots
//! are three separate things; a step mixes decodes and prompt chunks under three limits
//! (slots, token budget, free blocks); full blocks are shared by content hash; a running request
//! that cannot get a block preempts a victim chosen by policy; steps may be pipelined
//! (asynchronous scheduling) with blocks fenced until the step that used them is applied;
//! `check_invariants()` verifies the whole state and tests call it after every step.

// `unsafe_code` is forbidden in every module but `prefetch`, whose head says why it needs one
// `unsafe` block and why that block is sound. A crate-level `forbid` could not be relaxed for
// one module, so it is put on each `mod` instead; the crate-level `deny` covers this file and
// any module added without the attribute.
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[forbid(unsafe_code)]
mod block_hash;
#[forbid(unsafe_code)]
mod block_pool;
#[forbid(unsafe_code)]
pub mod dp_rounds;
#[forbid(unsafe_code)]
mod error;
#[forbid(unsafe_code)]
mod lists;
#[forbid(unsafe_code)]
mod looped;
#[forbid(unsafe_code)]
mod outcome;
#[forbid(unsafe_code)]
mod plan;
#[allow(unsafe_code)]
mod prefetch;
#[forbid(unsafe_code)]
mod prefix_index;
#[forbid(unsafe_code)]
mod request;
#[forbid(unsafe_code)]
pub mod routing;
#[forbid(unsafe_code)]
mod scheduler;
#[forbid(unsafe_code)]
mod scheduler_config;
pub mod shards;
#[forbid(unsafe_code)]
mod slots;
#[forbid(unsafe_code)]
mod speculation;
#[forbid(unsafe_code)]
mod types;
#[forbid(unsafe_code)]
mod waiting;
#[forbid(unsafe_code)]
mod work_queues;

pub use block_hash::{extend_block_hashes, hash_block, BlockHash};
pub use error::{AbortError, AddError, ApplyError, ScheduleError};
pub use looped::{LoopedModel, StagePolicy, StageSelection, MAX_LOOPS};
pub use outcome::{
    FinishStats, FinishedRequest, KvResult, RequestEvent, SampledToken, StepOutcome,
};
pub use plan::{
    BlockCopy, CacheChanges, CachedRequestData, KvOp, NewRequestData, ScheduledWork, Span, StepPlan,
};
pub use request::{
    Decision, FinishReason, Fork, KvImport, NewRequest, RequestStatus, RequestTimes, StopCause,
};
pub use scheduler::{InvariantViolation, RequestView, Scheduler, SchedulerStats};
pub use scheduler_config::{
    ConfigError, PreemptionMode, PreemptionPolicy, SchedulerConfig, SpeculativeConfig,
    MAX_PROMPT_LOOKUP, MAX_SPECULATIVE_TOKENS, MAX_STEPS_IN_FLIGHT,
};
pub use types::{BlockId, RequestId, StepId, Timestamp, TokenId, TransferId};
pub use work_queues::{Operation, WorkKey};
