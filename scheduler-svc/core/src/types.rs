//! Small value types shared by every part of the core: identifiers, token ids and time.
//!
//! The core has no clock. Every entry point that needs time takes a [`Timestamp`] from the
//! caller, so the same inputs always give the same decisions and tests can run in virtual time.
//! Time is only ever *recorded* (for metrics); no scheduling decision reads it.

use std::fmt;

/// A token id from the model's vocabulary.
pub type TokenId = u32;

/// A client request, named by the service layer. Unique among live requests of one core; an id
/// becomes reusable once its request has retired (see [`crate::Scheduler::contains`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

/// One scheduling step, numbered from 1 in the order the core builds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct StepId(pub u64);

impl fmt::Display for StepId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step-{}", self.0)
    }
}

/// Index of a KV block in one executor's block pool (`0..num_blocks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The block's index as a `usize`, for indexing per-block arrays.
    #[inline]
    #[must_use]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A KV transfer (export from a prefill executor or import into this one). Import ids are
/// chosen by the caller (the cluster scheduler that created the export); export ids are
/// issued by this core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(pub u64);

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "xfer-{}", self.0)
    }
}

/// A point in time, in nanoseconds from an origin the caller picks (monotonic).
///
/// Passed into the core by its caller; the core only stores and subtracts timestamps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// A timestamp from seconds since the origin (negative or NaN clamps to zero).
    #[must_use]
    pub fn from_secs_f64(secs: f64) -> Self {
        if secs.is_nan() || secs <= 0.0 {
            Timestamp(0)
        } else {
            Timestamp((secs * 1e9) as u64)
        }
    }

    /// Seconds since the origin.
    #[must_use]
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }

    /// Seconds from `earlier` to `self`, zero if `earlier` is later.
    #[must_use]
    pub fn secs_since(self, earlier: Timestamp) -> f64 {
        self.0.saturating_sub(earlier.0) as f64 / 1e9
    }
}
