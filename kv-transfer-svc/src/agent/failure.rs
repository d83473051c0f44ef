//! Why a transfer failed, and how it ends: the reasons metrics count ([`Failure`], each with
//! the gRPC status a transfer that failed for it is answered with), and ending a transfer that
//! failed or was cancelled without a trace in the store.
//!
//! Invariants (the agent's, kept here): a transfer that ends without being read unpins its
//! blocks and removes those it added (blocks that were there before stay), and leaves a
//! tombstone saying why, so a reader waiting for it, or a late push under its id, gets that
//! reason at once.

use std::sync::atomic::Ordering;

use ferry_kv_wire::frames::FrameError;
use tokio::time::Instant;
use tonic::Status;

use super::{Agent, Ended};

/// Why a transfer failed, as metrics count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Failure {
    /// Its deadline passed.
    Deadline,
    /// Someone cancelled it.
    Cancelled,
    /// A chunk's checksum did not match.
    Checksum,
    /// The stream ended before every block arrived.
    Truncated,
    /// A malformed stream or request.
    Malformed,
    /// The store was full of pinned blocks.
    StoreFull,
    /// The other side's layout differs.
    Layout,
    /// The peer agent (or the sender) failed.
    Peer,
}

impl Failure {
    /// Every reason, in label order.
    pub const ALL: [Failure; 8] = [
        Failure::Deadline,
        Failure::Cancelled,
        Failure::Checksum,
        Failure::Truncated,
        Failure::Malformed,
        Failure::StoreFull,
        Failure::Layout,
        Failure::Peer,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Failure::Deadline => "deadline",
            Failure::Cancelled => "cancelled",
            Failure::Checksum => "checksum",
            Failure::Truncated => "truncated",
            Failure::Malformed => "malformed",
            Failure::StoreFull => "store_full",
            Failure::Layout => "layout",
            Failure::Peer => "peer",
        }
    }

    pub(super) fn of(e: &FrameError) -> Self {
        match e {
            FrameError::Checksum { .. } => Failure::Checksum,
            FrameError::Truncated { .. } => Failure::Truncated,
            FrameError::Layout(_) => Failure::Layout,
            _ => Failure::Malformed,
        }
    }

    /// The gRPC status for a transfer that failed for this reason (a checksum mismatch is
    /// `DATA_LOSS`, so that whoever hears of it tells it apart by its code).
    pub(super) fn status(self, why: String) -> Status {
        match self {
            Failure::Deadline => Status::deadline_exceeded(why),
            Failure::Cancelled => Status::cancelled(why),
            Failure::Checksum => Status::data_loss(why),
            Failure::Truncated | Failure::Malformed => Status::invalid_argument(why),
            Failure::StoreFull => Status::resource_exhausted(why),
            Failure::Layout => Status::failed_precondition(why),
            Failure::Peer => Status::unavailable(why),
        }
    }
}

impl Agent {
    pub(super) fn count_failure(&self, failure: Failure) {
        self.counters.failures[failure as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Ends transfer `tid` as failed: unpins its blocks, removes the ones it added, leaves a
    /// tombstone; returns the status to answer with.
    pub(super) fn fail(&self, tid: &str, failure: Failure, why: String) -> Status {
        self.count_failure(failure);
        {
            let mut st = self.state();
            if let Some(inc) = st.incoming.remove(tid) {
                for key in &inc.pinned {
                    st.store.unpin(*key);
                }
                for key in &inc.added {
                    st.store.remove(*key);
                }
            }
            if let Some(cancel) = st.outgoing.remove(tid) {
                cancel.send_replace(true);
            }
            st.ended
                .insert(tid.to_string(), Ended { failure, why: why.clone(), at: Instant::now() });
        }
        self.bump();
        failure.status(why)
    }

    /// Cancels transfer `tid`: arriving or forwarding, it ends now and its blocks leave the
    /// store; a reader waiting for it fails with CANCELLED. True if it was in progress.
    pub fn cancel(&self, tid: &str, reason: &str) -> bool {
        let found = {
            let st = self.state();
            st.incoming.contains_key(tid) || st.outgoing.contains_key(tid)
        };
        let why = if reason.is_empty() {
            format!("transfer {tid} was cancelled")
        } else {
            format!("transfer {tid} was cancelled: {reason}")
        };
        if found {
            let _ = self.fail(tid, Failure::Cancelled, why);
        } else {
            self.state().ended.entry(tid.to_string()).or_insert(Ended {
                failure: Failure::Cancelled,
                why,
                at: Instant::now(),
            });
            self.bump();
        }
        found
    }
}

/// Why a stream of frames failed, from the error its reader gave: a chunk whose checksum the
/// data channel's reader found wrong (`DATA_LOSS`), or the sender's failure.
pub(super) fn stream_failure(tid: &str, s: &Status) -> (Failure, String) {
    match s.code() {
        tonic::Code::DataLoss => (Failure::Checksum, format!("transfer {tid}: {}", s.message())),
        code => {
            let failure =
                if code == tonic::Code::Aborted { Failure::Truncated } else { Failure::Peer };
            (failure, format!("transfer {tid}: the sender failed: {}", s.message()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Failure;

    #[test]
    fn a_failure_counts_at_its_place_in_the_list_of_reasons() {
        for (i, f) in Failure::ALL.iter().enumerate() {
            assert_eq!(*f as usize, i, "{f:?}");
        }
    }
}
