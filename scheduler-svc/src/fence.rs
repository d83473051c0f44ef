//! Leadership fencing as the executors report it: the newest leadership epoch any executor
//! has seen. A step an executor refuses for a newer epoch ([`ferry_proto::fencing`]) proves
//! that another scheduler leads, whatever etcd can be asked; every link of a scheduler reports
//! into one fence, and the executor set reads it to stand down.

use tokio::sync::watch;

/// The newest leadership epoch any executor said it has seen, as refusals report it
/// ([`ferry_proto::fencing`]): once it is above a leader's own epoch, another scheduler leads
/// for certain, whatever etcd can be asked.
#[derive(Default)]
pub struct Fence(watch::Sender<u64>);

impl Fence {
    /// Records that an executor has seen `epoch`.
    pub fn saw(&self, epoch: u64) {
        self.0.send_if_modified(|newest| {
            let newer = epoch > *newest;
            if newer {
                *newest = epoch;
            }
            newer
        });
    }

    /// The newest epoch seen so far (0: none).
    pub fn newest(&self) -> u64 {
        *self.0.borrow()
    }

    /// Resolves with the newest epoch once one above `epoch` has been seen.
    pub async fn outranks(&self, epoch: u64) -> u64 {
        let mut rx = self.0.subscribe();
        let newest = *rx.wait_for(|newest| *newest > epoch).await.expect("the sender is self");
        newest
    }
}
