//! Why the engine refuses a step, or one request of it: each fault with the id it is about, so
//! that [`StepError::request`] can tell a fault one request answers alone (it is refused and the
//! rest of the step runs) from a fault of the step as a whole (nothing changes).

use crate::engine::kv::KvOpError;
use crate::engine::sampling::SamplingError;
use crate::forward::paged::BatchError;

/// A step the engine refuses. Nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// An id the step relies on is not a live request.
    #[error("request {id}: unknown ({what})")]
    Unknown {
        /// The id.
        id: u64,
        /// Which part of the step named it.
        what: &'static str,
    },
    /// A new request reuses a live id, or the step names an id twice.
    #[error("request {id}: {what}")]
    Duplicate {
        /// The id.
        id: u64,
        /// What was duplicated.
        what: &'static str,
    },
    /// A request's data is unusable.
    #[error("request {id}: {reason}")]
    Invalid {
        /// The id.
        id: u64,
        /// What is wrong, with the limit.
        reason: String,
    },
    /// `total_num_tokens` is not the sum of the work.
    #[error("total_num_tokens is {declared} but the work adds up to {actual}")]
    TokenCount {
        /// What the step says.
        declared: u64,
        /// The sum of `work[].num_tokens`.
        actual: u64,
    },
    /// Sampling parameters out of range.
    #[error("request {id}: {source}")]
    Sampling {
        /// The id.
        id: u64,
        /// What is wrong.
        #[source]
        source: SamplingError,
    },
    /// The batch does not fit the KV pool or the model.
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// A KV operation is refused.
    #[error(transparent)]
    Kv(#[from] KvOpError),
    /// A prefix-cache change names a block past the pool.
    #[error("the step's cache changes name block {block}, past the pool's {num_blocks} blocks")]
    CacheBlock {
        /// The block named.
        block: u32,
        /// Blocks in the pool.
        num_blocks: usize,
    },
}

impl StepError {
    /// The one request this fault is about, if it is about one: refusing that request alone
    /// answers it.
    pub(super) fn request(&self) -> Option<u64> {
        match self {
            Self::Unknown { id, .. }
            | Self::Duplicate { id, .. }
            | Self::Invalid { id, .. }
            | Self::Sampling { id, .. } => Some(*id),
            Self::TokenCount { .. } | Self::Batch(_) | Self::Kv(_) | Self::CacheBlock { .. } => {
                None
            }
        }
    }
}
