//! Whether this scheduler stands by for its pool's leader, and where that leader is: what its
//! Admin API, its Generation API and its HTTP `/health` tell a caller on a standby, instead of
//! empty answers or "no executor is connected".

use std::sync::Arc;

use ferry_runtime::cluster::ClusterArgs;
use tokio::sync::watch;

use crate::front::remote::Leader;

/// A scheduler's standing in its pool (with etcd).
pub struct Standing {
    pool: String,
    /// The epoch while this scheduler leads.
    leading: watch::Receiver<Option<u64>>,
    /// The pool's leader, followed through etcd as fronts follow it.
    leader: Arc<Leader>,
}

impl Standing {
    /// The standing of the scheduler campaigning in `pool`, which leads while `leading` says.
    pub fn follow(
        cluster: ClusterArgs,
        pool: String,
        leading: watch::Receiver<Option<u64>>,
    ) -> Self {
        let leader = Leader::follow(cluster, pool.clone());
        Self { pool, leading, leader }
    }

    /// `None` while this scheduler leads; else what a caller is told: that it stands by, and
    /// where the leader is.
    pub fn standby_notice(&self) -> Option<String> {
        if self.leading.borrow().is_some() {
            return None;
        }
        let pool = &self.pool;
        Some(match self.leader.current() {
            Some(leader) => format!(
                "this scheduler is a standby of pool {pool:?}: its leader, at {leader}, serves \
                 the pool (and its Admin API)"
            ),
            None => format!(
                "this scheduler is a standby of pool {pool:?}, and no leader is elected yet; \
                 retry shortly"
            ),
        })
    }
}
