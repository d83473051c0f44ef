//! A member's registration: its key kept in etcd under a lease for as long as the
//! [`Registration`] lives. The lease is kept across etcd outages (etcd extends its leases when it
//! restarts or elects a new raft leader, so nobody watching sees the member leave and come back)
//! and granted again only when etcd says it is gone.

use std::time::Duration;

use etcd_client::{Client, PutOptions};
use tokio::sync::watch;

use super::etcd_connection::{etcd_backoff, lease_gone, LeaseClient};
use super::key_layout::{MemberInfo, MemberKind};
use super::ClusterArgs;
use crate::backoff::Backoff;

impl ClusterArgs {
    /// Registers `id` of `kind` at this service's advertised address (for a service bound to
    /// `bound`), in scheduler pool `pool` if given; `None` without etcd.
    pub async fn register(
        &self,
        kind: MemberKind,
        (id, pool): (&str, Option<&str>),
        bound: std::net::SocketAddr,
    ) -> Result<Option<Registration>, etcd_client::Error> {
        if !self.enabled() {
            return Ok(None);
        }
        self.client().await?; // the flags make a client (certificates read, endpoints parsed)
        let key = format!("{}{id}", self.prefix(kind));
        let value = MemberInfo { address: self.advertised(bound), pool: pool.map(str::to_string) };
        let value = value.to_value();
        Ok(Some(Registration::spawn(self.clone(), key, value)))
    }
}

/// Whether a registration is in etcd now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseState {
    /// Not (yet, or no longer) registered: etcd unreachable or the lease lapsed.
    Lost,
    /// Registered and kept alive.
    Held,
}

/// A key kept in etcd under a lease for as long as this lives; dropping it (or
/// [`Registration::withdraw`]) revokes the lease, which deletes the key at once.
pub struct Registration {
    stop: watch::Sender<bool>,
    pub(super) state: watch::Receiver<LeaseState>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Registration {
    /// Starts keeping `key = value` in `cluster`'s etcd under a lease of its TTL.
    pub fn spawn(cluster: ClusterArgs, key: String, value: String) -> Self {
        let (stop, stop_rx) = watch::channel(false);
        let (state_tx, state) = watch::channel(LeaseState::Lost);
        let task = tokio::spawn(keep_registered(cluster, key, value, stop_rx, state_tx));
        Registration { stop, state, task: Some(task) }
    }

    /// Whether the key is in etcd now.
    pub fn state(&self) -> LeaseState {
        *self.state.borrow()
    }

    /// Waits until the key is in etcd.
    pub async fn held(&mut self) {
        let _ = self.state.wait_for(|s| *s == LeaseState::Held).await;
    }

    /// Removes the key now (revoking the lease) and stops keeping it.
    pub async fn withdraw(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn keep_registered(
    cluster: ClusterArgs,
    key: String,
    value: String,
    mut stop: watch::Receiver<bool>,
    state: watch::Sender<LeaseState>,
) {
    let ttl = cluster.ttl();
    let mut etcd = LeaseClient::new(cluster).await;
    let mut failed = false;
    let mut backoff = etcd_backoff();
    let ttl_secs = ttl.as_secs().max(1) as i64;
    // The lease held, kept across etcd outages: etcd extends its leases when it restarts or
    // elects a new raft leader, so the same lease (and key) usually survives an outage of any
    // length, and nobody watching sees the member leave and come back.
    let mut lease = None;
    // Refreshes of a lease that may live are retried often enough to beat its expiry.
    let mut retry =
        Backoff::new(Duration::from_millis(100), (ttl / 3).max(Duration::from_millis(100)));
    loop {
        if *stop.borrow() {
            return;
        }
        if std::mem::take(&mut failed) {
            etcd.failed().await;
        }
        let client = &mut etcd.client;
        let id = match lease {
            Some(id) => id,
            None => match client.lease_grant(ttl_secs, None).await {
                Ok(r) => r.id(),
                Err(e) => {
                    tracing::debug!(%key, error = %e, "etcd: lease grant failed; retrying");
                    failed = true;
                    tokio::select! { _ = backoff.wait() => continue, _ = stop.changed() => return }
                }
            },
        };
        lease = Some(id);
        // Put (again, after an outage: idempotent) so the key is there under this lease.
        let put = client.put(key.clone(), value.clone(), Some(PutOptions::new().with_lease(id)));
        if let Err(e) = put.await {
            tracing::debug!(%key, error = %e, "etcd: registration failed; retrying");
            if lease_gone(&e) {
                lease = None;
            } else {
                failed = true;
            }
            // A lease that may live is asked about again soon enough to beat its expiry.
            let wait = if lease.is_some() { &mut retry } else { &mut backoff };
            tokio::select! { _ = wait.wait() => continue, _ = stop.changed() => return }
        }
        let kept = keep_alive(client, id, ttl, &mut stop, &state).await;
        if state.send_replace(LeaseState::Lost) == LeaseState::Held {
            retry.reset();
        }
        match kept {
            KeepAlive::Stopped => {
                let revoke = client.lease_revoke(id);
                let _ = tokio::time::timeout(Duration::from_secs(1), revoke).await;
                return;
            }
            KeepAlive::Expired => {
                tracing::warn!(%key, "etcd says the registration's lease expired; registering again");
                lease = None;
                backoff.reset();
            }
            KeepAlive::Broken(why) => {
                failed = true;
                tracing::warn!(%key, reason = %why, "etcd unreachable; keeping the registration's lease");
                tokio::select! { _ = retry.wait() => {}, _ = stop.changed() => return }
            }
        }
    }
}

enum KeepAlive {
    Stopped,
    /// etcd says the lease is gone.
    Expired,
    /// etcd could not be asked.
    Broken(String),
}

/// Refreshes `lease` every third of its TTL until told to stop, etcd says it expired, or etcd
/// cannot be asked.
async fn keep_alive(
    client: &mut Client,
    lease: i64,
    ttl: Duration,
    stop: &mut watch::Receiver<bool>,
    state: &watch::Sender<LeaseState>,
) -> KeepAlive {
    let (mut keeper, mut responses) = match client.lease_keep_alive(lease).await {
        Ok(k) => k,
        Err(e) if lease_gone(&e) => return KeepAlive::Expired,
        Err(e) => return KeepAlive::Broken(format!("keep-alive stream: {e}")),
    };
    let period = ttl / 3;
    let mut first = true;
    loop {
        if !first {
            tokio::select! {
                _ = stop.changed() => return KeepAlive::Stopped,
                () = tokio::time::sleep(period) => {}
            }
        }
        // Bounded: a send on a stream whose connection died may never return.
        match tokio::time::timeout(period, keeper.keep_alive()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return KeepAlive::Broken(format!("keep-alive: {e}")),
            Err(_) => return KeepAlive::Broken("keep-alive request timed out".into()),
        }
        match tokio::time::timeout(period, responses.message()).await {
            Ok(Ok(Some(r))) if r.ttl() > 0 => {}
            Ok(Ok(Some(_))) => return KeepAlive::Expired,
            Ok(Err(e)) if lease_gone(&e) => return KeepAlive::Expired,
            Ok(Ok(None)) => return KeepAlive::Broken("keep-alive stream closed".into()),
            Ok(Err(e)) => return KeepAlive::Broken(format!("keep-alive: {e}")),
            Err(_) => return KeepAlive::Broken("keep-alive timed out".into()),
        }
        if first {
            // Held once etcd has said the lease lives (after the put).
            state.send_replace(LeaseState::Held);
            first = false;
        }
    }
}
