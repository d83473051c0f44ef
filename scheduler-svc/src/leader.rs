//! Scheduler leadership per pool through etcd's election API (DESIGN.md §7).
//!
//! One scheduler leads a pool and drives its executors; standbys wait in the election. The
//! leader's epoch is its election key's revision, which grows with every new leader, and every
//! executor session carries it: an executor refuses a scheduler older than the newest it has
//! seen, so a deposed leader cannot disturb its successor.
//!
//! A leader stops scheduling at once — closes every executor session and stops discovery —
//! when etcd says its lease is gone (expired or revoked), or when it could not refresh the
//! lease for a whole TTL (etcd unreachable: a standby may be elected once the lease lapses, so
//! this leader must assume it has been). Its requests wait in the front and move on once
//! leadership (its own, re-won, or nobody's) lets executors be reached again. Then it
//! campaigns again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::Client;
use ferry_runtime::cluster::ClusterArgs;
use tokio::sync::watch;

use crate::config::SchedulerConfig;
use crate::executors::ExecutorSet;

/// Who this scheduler is in the election.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// The pool it schedules.
    pub pool: String,
    /// Its id (the executors show it as their session's scheduler).
    pub scheduler_id: String,
    /// The address its front answers at (the election value, for fronts and operators).
    pub address: String,
}

/// Campaigns for the pool until `resign` turns true; while leading, runs executor discovery
/// under the epoch and publishes `Some(epoch)` on `leading` (`None` otherwise). Resigning
/// (drain) closes the sessions and revokes the lease, so a standby leads at once and the
/// fronts move their streams to it.
pub async fn run(
    cluster: ClusterArgs,
    candidate: Candidate,
    config: SchedulerConfig,
    set: Arc<ExecutorSet>,
    leading: watch::Sender<Option<u64>>,
    mut resign: watch::Receiver<bool>,
) {
    let mut client = cluster.client_patiently().await;
    let name = format!("/ferry/{}/scheduler/{}", cluster.cluster, candidate.pool);
    let ttl = cluster.ttl();
    loop {
        if *resign.borrow() {
            return;
        }
        let lease = match client.lease_grant(ttl.as_secs() as i64, None).await {
            Ok(r) => r.id(),
            Err(e) => {
                tracing::debug!(error = %e, "etcd: lease for the election failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let mut keeper = LeaseKeeper::new(client.clone(), lease, ttl);
        // Campaign while keeping the lease alive; a campaign call times out with the client's
        // request timeout and is simply made again (same lease: same candidacy).
        let epoch = loop {
            let mut campaigner = client.clone();
            let campaign = campaigner.campaign(name.clone(), candidate.address.clone(), lease);
            tokio::select! {
                won = campaign => match won {
                    Ok(r) => match r.leader() {
                        Some(key) => break Some(key.rev() as u64),
                        None => continue,
                    },
                    Err(e) => {
                        tracing::debug!(error = %e, "etcd: campaign interrupted; campaigning again");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                },
                why = keeper.until_lost() => {
                    tracing::warn!(reason = %why, "lost the election lease while standing by");
                    break None;
                }
                () = resigned(&mut resign) => {
                    let _ = tokio::time::timeout(Duration::from_secs(1), client.lease_revoke(lease)).await;
                    return;
                }
            }
        };
        let Some(epoch) = epoch else { continue };
        tracing::info!(pool = %candidate.pool, epoch, "leading the pool");
        leading.send_replace(Some(epoch));
        let discovery = tokio::spawn(crate::discovery::run(
            cluster.clone(),
            config.clone(),
            set.clone(),
            candidate.scheduler_id.clone(),
            epoch,
        ));
        let why = tokio::select! {
            why = keeper.until_lost() => why,
            () = resigned(&mut resign) => "it resigned to drain".to_string(),
        };
        // Stop scheduling at once: no step goes out under a leadership that may be over.
        discovery.abort();
        let resigning = *resign.borrow();
        if resigning {
            set.retire("this scheduler resigned to drain");
        } else {
            set.clear(&format!("this scheduler lost its leadership: {why}"));
        }
        leading.send_replace(None);
        tracing::warn!(pool = %candidate.pool, epoch, reason = %why, "no longer leading");
        let revoke = client.lease_revoke(lease);
        let _ = tokio::time::timeout(Duration::from_secs(1), revoke).await;
        if resigning {
            return;
        }
    }
}

/// Resolves once `resign` turns true (never if its sender is gone without resigning).
async fn resigned(resign: &mut watch::Receiver<bool>) {
    if resign.wait_for(|r| *r).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Keeps one lease alive and says when it is lost.
struct LeaseKeeper {
    client: Client,
    lease: i64,
    ttl: Duration,
    last_ok: Instant,
}

impl LeaseKeeper {
    fn new(client: Client, lease: i64, ttl: Duration) -> Self {
        Self { client, lease, ttl, last_ok: Instant::now() }
    }

    /// Refreshes the lease every third of its TTL; returns why it is lost: etcd answered that
    /// it expired (or was revoked), or no refresh succeeded for a whole TTL.
    async fn until_lost(&mut self) -> String {
        let period = self.ttl / 3;
        let mut stream = None;
        loop {
            if self.last_ok.elapsed() >= self.ttl {
                return format!("no lease refresh succeeded for {:?} (etcd unreachable)", self.ttl);
            }
            if stream.is_none() {
                match self.client.lease_keep_alive(self.lease).await {
                    Ok(s) => stream = Some(s),
                    Err(e) => {
                        tracing::debug!(error = %e, "etcd: keep-alive stream failed; retrying");
                        tokio::time::sleep(period.min(Duration::from_millis(300))).await;
                        continue;
                    }
                }
            }
            let (keeper, responses) = stream.as_mut().expect("set above");
            let refreshed = async {
                keeper.keep_alive().await?;
                responses.message().await
            };
            match tokio::time::timeout(period, refreshed).await {
                Ok(Ok(Some(r))) if r.ttl() > 0 => {
                    self.last_ok = Instant::now();
                    tokio::time::sleep(period).await;
                }
                Ok(Ok(Some(_))) => return "etcd says the lease expired or was revoked".into(),
                Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {
                    stream = None;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}
