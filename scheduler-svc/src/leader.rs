//! Scheduler leadership per pool through etcd's election API (DESIGN.md §7).
//!
//! One scheduler leads a pool and drives its executors; standbys wait in the election. The
//! leader's epoch is its election key's revision, which grows with every new leader, and every
//! executor session carries it: an executor refuses a scheduler older than the newest it has
//! seen, so a deposed leader cannot disturb its successor.
//!
//! Because executors fence, a leader does not need etcd to serve safely, and it keeps serving
//! while etcd is unreachable, however long: it admits and runs requests on the executors it
//! holds. It stops only on proof that its leadership is over: etcd, reachable again, says its
//! lease is gone (expired or revoked) or its election key was deleted, or an executor refuses
//! it naming a newer epoch (a successor was elected meanwhile). Then it is deposed at once:
//! its sessions close, discovery and every connect attempt are cancelled, and its requests
//! fail at once, so the fronts move their streams to the leader. Then it campaigns again.
//!
//! The election's logic is written against [`Election`], which etcd implements
//! ([`EtcdElection`]); tests drive it with a scripted election in paused time.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{LeaseKeepAliveStream, LeaseKeeper as EtcdKeeper};
use ferry_runtime::cluster::{etcd_backoff, lease_gone, ClusterArgs, LeaseClient};
use ferry_runtime::Backoff;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::executors::ExecutorSet;
use crate::link::SessionOpener;

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

/// What leadership needs of a coordination service. Each call may fail (the service is
/// unreachable); the logic in [`lead`] decides what a failure means.
pub trait Election: Clone + Send + Sync + 'static {
    /// A new lease of `ttl`.
    fn grant(&mut self, ttl: Duration) -> impl Future<Output = Result<i64, String>> + Send;
    /// Campaigns for `name` with `value` under `lease`; `Some` once elected, `None` if the call
    /// ended without a decision (it is then made again).
    fn campaign(
        &mut self,
        name: &str,
        value: &str,
        lease: i64,
    ) -> impl Future<Output = Result<Option<Elected>, String>> + Send;
    /// Resolves, with the reason, once the service says the leadership `elected` names is over
    /// (its election key is gone: the lease was revoked or expired). Never resolves while it
    /// cannot tell (the lease keeper decides then).
    fn deposed(&mut self, elected: &Elected) -> impl Future<Output = String> + Send;
    /// Refreshes `lease`: `Ok(true)` while it lives, `Ok(false)` once the service says it
    /// expired or was revoked.
    fn refresh(&mut self, lease: i64) -> impl Future<Output = Result<bool, String>> + Send;
    /// Revokes `lease` (best effort).
    fn revoke(&mut self, lease: i64) -> impl Future<Output = ()> + Send;
}

/// A won election: the epoch (the election key's revision) and the key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Elected {
    /// The leadership epoch.
    pub epoch: u64,
    /// The election key that holds it.
    pub key: Vec<u8>,
}

/// Campaigns for `candidate`'s pool in etcd until `resign` turns true; while leading, drives
/// the executors it discovers (sessions under the epoch) and publishes `Some(epoch)` on
/// `leading` (`None` otherwise). Resigning (drain) closes the sessions and revokes the lease,
/// so a standby leads at once and the fronts move their streams to it.
pub async fn run(
    cluster: ClusterArgs,
    candidate: Candidate,
    opener: SessionOpener,
    set: Arc<ExecutorSet>,
    leading: watch::Sender<Option<u64>>,
    resign: watch::Receiver<bool>,
) {
    let etcd = LeaseClient::new(cluster.clone()).await;
    let election = EtcdElection { etcd, keep_alive: None };
    let name = cluster.election_name(&candidate.pool);
    let ttl = cluster.ttl();
    let drive = {
        let set = set.clone();
        move |epoch: u64, lease: i64| -> JoinHandle<()> {
            let (cluster, opener, set) = (cluster.clone(), opener.clone(), set.clone());
            tokio::spawn(async move {
                // Executors open sessions only for the token this leadership publishes.
                let token: Arc<[u8]> = ferry_runtime::secret::random().into();
                publish_token(&cluster, epoch, lease, &token).await;
                let opener = opener.at_epoch(epoch, token);
                crate::discovery::run(cluster, opener, set).await;
            })
        }
    };
    // Boxed: the election loop's state is large, and this future lives in a spawned task.
    Box::pin(lead(Seat { election, name, candidate, ttl }, drive, set, leading, resign)).await;
}

/// Puts leadership `epoch`'s `token` at its key under the election's `lease` (so it goes
/// with the leadership), retrying until etcd takes it; the leadership's task is aborted if
/// it ends first.
async fn publish_token(cluster: &ClusterArgs, epoch: u64, lease: i64, token: &[u8]) {
    let key = cluster.leadership_key(epoch);
    let value = ferry_runtime::secret::to_hex(token);
    let mut backoff = etcd_backoff();
    loop {
        let put = async {
            let mut client = cluster.client().await?;
            let options = etcd_client::PutOptions::new().with_lease(lease);
            client.put(key.as_str(), value.as_str(), Some(options)).await
        };
        match put.await {
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(error = %e, epoch, "cannot publish the leadership token; retrying");
                backoff.wait().await;
            }
        }
    }
}

/// One candidacy: the election, the pool's election name, who runs and the lease TTL.
pub struct Seat<E> {
    /// The coordination service.
    pub election: E,
    /// The election's name (`/ferry/<cluster>/scheduler/<pool>`).
    pub name: String,
    /// Who campaigns.
    pub candidate: Candidate,
    /// The lease's time to live.
    pub ttl: Duration,
}

/// The election loop: campaign, lead (running `drive(epoch, lease)` while leading), step down when
/// the lease is lost, campaign again; until `resign`.
pub async fn lead<E: Election>(
    seat: Seat<E>,
    drive: impl Fn(u64, i64) -> JoinHandle<()>,
    set: Arc<ExecutorSet>,
    leading: watch::Sender<Option<u64>>,
    mut resign: watch::Receiver<bool>,
) {
    let Seat { mut election, name, candidate, ttl } = seat;
    // Paces lease grants after failures, and campaigns after a leadership was lost, so an
    // election that keeps failing is not retried in a tight loop.
    let mut backoff = etcd_backoff();
    loop {
        if *resign.borrow() {
            return;
        }
        let lease = match election.grant(ttl).await {
            Ok(lease) => lease,
            Err(e) => {
                tracing::debug!(error = %e, "election: lease grant failed; retrying");
                backoff.wait().await;
                continue;
            }
        };
        backoff.reset();
        let mut keeper = LeaseKeeper::new(election.clone(), lease, ttl);
        // Campaign while keeping the lease alive; a campaign call that ends without a decision
        // (etcd's request timeout) is simply made again (same lease: same candidacy).
        let mut retry = etcd_backoff();
        let epoch = loop {
            let mut campaigner = election.clone();
            let campaign = campaigner.campaign(&name, &candidate.address, lease);
            tokio::select! {
                won = campaign => match won {
                    Ok(Some(elected)) => break Some(elected),
                    Ok(None) => retry.reset(),
                    Err(e) => {
                        tracing::debug!(error = %e, "election: campaign interrupted; campaigning again");
                        retry.wait().await;
                    }
                },
                why = keeper.until_lost() => {
                    tracing::warn!(reason = %why, "lost the election lease while standing by");
                    break None;
                }
                () = resigned(&mut resign) => {
                    let _ = tokio::time::timeout(Duration::from_secs(1), election.revoke(lease)).await;
                    return;
                }
            }
        };
        let Some(elected) = epoch else { continue };
        let epoch = elected.epoch;
        tracing::info!(pool = %candidate.pool, epoch, "leading the pool");
        set.lead(epoch);
        leading.send_replace(Some(epoch));
        let led_since = Instant::now();
        let driving = drive(epoch, lease);
        let mut watcher = election.clone();
        let why = tokio::select! {
            why = keeper.until_lost() => why,
            why = watcher.deposed(&elected) => why,
            newest = set.fence.outranks(epoch) => {
                format!("an executor has seen the newer leadership epoch {newest}")
            }
            () = resigned(&mut resign) => "it resigned to drain".to_string(),
        };
        // Stop scheduling at once: no step goes out under a leadership that is over.
        driving.abort();
        let resigning = *resign.borrow();
        if resigning {
            set.retire("this scheduler resigned to drain");
        } else {
            set.depose(&format!("this scheduler lost its leadership: {why}"));
        }
        leading.send_replace(None);
        tracing::warn!(pool = %candidate.pool, epoch, reason = %why, "no longer leading");
        let _ = tokio::time::timeout(Duration::from_secs(1), election.revoke(lease)).await;
        if resigning {
            return;
        }
        if led_since.elapsed() >= ttl {
            backoff.reset();
        }
        tokio::select! {
            _ = backoff.wait() => {}
            () = resigned(&mut resign) => return,
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
struct LeaseKeeper<E> {
    election: E,
    lease: i64,
    ttl: Duration,
    last_ok: Instant,
}

impl<E: Election> LeaseKeeper<E> {
    fn new(election: E, lease: i64, ttl: Duration) -> Self {
        Self { election, lease, ttl, last_ok: Instant::now() }
    }

    /// Refreshes the lease every third of its TTL; returns once the service answers that it
    /// expired (or was revoked). While the service cannot be reached it keeps trying, however
    /// long: not hearing from etcd is no proof that the lease is gone.
    async fn until_lost(&mut self) -> String {
        let period = self.ttl / 3;
        let mut retry =
            Backoff::new(Duration::from_millis(100), period.max(Duration::from_millis(100)));
        let mut warned = false;
        loop {
            match tokio::time::timeout(period, self.election.refresh(self.lease)).await {
                Ok(Ok(true)) => {
                    if warned {
                        let outage = self.last_ok.elapsed();
                        tracing::warn!(?outage, "etcd reachable again; the lease lives");
                    }
                    warned = false;
                    self.last_ok = Instant::now();
                    retry.reset();
                    tokio::time::sleep(period).await;
                }
                Ok(Ok(false)) => return "etcd says the lease expired or was revoked".into(),
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "election: lease refresh failed; retrying");
                    retry.wait().await;
                }
                Err(_) => {} // timed out: try again
            }
            if !warned && self.last_ok.elapsed() >= self.ttl {
                warned = true;
                tracing::warn!(
                    ttl = ?self.ttl,
                    "no lease refresh for a whole TTL (etcd unreachable); serving on: executors \
                     refuse this scheduler if a successor is elected meanwhile"
                );
            }
        }
    }
}

/// An open keep-alive stream for one lease: etcd's sender half and its answers.
type KeepAliveStream = Arc<tokio::sync::Mutex<(EtcdKeeper, LeaseKeepAliveStream)>>;

/// [`Election`] on etcd's election and lease APIs.
#[derive(Clone)]
pub struct EtcdElection {
    /// Moves to the next member when a refresh fails.
    etcd: LeaseClient,
    /// The open keep-alive stream and the lease it refreshes.
    keep_alive: Option<(i64, KeepAliveStream)>,
}

impl Election for EtcdElection {
    async fn grant(&mut self, ttl: Duration) -> Result<i64, String> {
        let secs = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX);
        Ok(self.etcd.client.lease_grant(secs, None).await.map_err(|e| e.to_string())?.id())
    }

    async fn campaign(
        &mut self,
        name: &str,
        value: &str,
        lease: i64,
    ) -> Result<Option<Elected>, String> {
        let r = self.etcd.client.campaign(name, value, lease).await.map_err(|e| e.to_string())?;
        Ok(r.leader().map(|key| Elected {
            epoch: u64::try_from(key.rev()).unwrap_or(0),
            key: key.key().to_vec(),
        }))
    }

    async fn deposed(&mut self, elected: &Elected) -> String {
        // Every event on the key since it was created: a delete that already happened is seen.
        let start = i64::try_from(elected.epoch).unwrap_or(0);
        let options = etcd_client::WatchOptions::new().with_start_revision(start);
        let watched = self.etcd.client.watch(elected.key.clone(), Some(options)).await;
        let Ok(mut events) = watched else { return std::future::pending().await };
        loop {
            match events.message().await {
                Ok(Some(r)) => {
                    if r.events().iter().any(|e| e.event_type() == etcd_client::EventType::Delete) {
                        return "its election key was deleted (its lease was revoked or expired)"
                            .to_string();
                    }
                }
                // The watch broke (etcd unreachable): the lease keeper decides.
                Ok(None) | Err(_) => return std::future::pending().await,
            }
        }
    }

    async fn refresh(&mut self, lease: i64) -> Result<bool, String> {
        if self.keep_alive.as_ref().is_none_or(|(l, _)| *l != lease) {
            let stream = match self.etcd.client.lease_keep_alive(lease).await {
                Ok(stream) => stream,
                Err(e) if lease_gone(&e) => return Ok(false),
                Err(e) => {
                    self.etcd.failed().await;
                    return Err(e.to_string());
                }
            };
            self.keep_alive = Some((lease, Arc::new(tokio::sync::Mutex::new(stream))));
        }
        let (_, stream) = self.keep_alive.as_ref().expect("set above");
        let stream = stream.clone();
        let mut guard = stream.lock().await;
        let (keeper, responses) = &mut *guard;
        let answer = async {
            keeper.keep_alive().await?;
            responses.message().await
        };
        let answer = answer.await;
        if let Ok(Some(r)) = answer {
            Ok(r.ttl() > 0)
        } else if answer.as_ref().is_err_and(lease_gone) {
            Ok(false)
        } else {
            drop(guard);
            self.keep_alive = None;
            self.etcd.failed().await;
            Err("the keep-alive stream broke".into())
        }
    }

    async fn revoke(&mut self, lease: i64) {
        let _ = self.etcd.client.lease_revoke(lease).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tokio::sync::watch;
    use tokio::time::Instant;

    use super::{lead, Candidate, Elected, Election, Seat};
    use crate::executors::{ExecutorSet, Standing};
    use crate::link::fake::{fake_link, leader_link, FakeExecutor};

    /// What the scripted election does and saw.
    #[derive(Default)]
    struct Script {
        /// Refreshes fail (etcd unreachable) while set.
        unreachable: bool,
        /// etcd answers that the lease expired while set.
        expired: bool,
        /// Campaigns after the first wait while set (a standby keeps the seat).
        hold_seat: bool,
        grants: u64,
        campaigns: u64,
        revoked: Vec<i64>,
        refreshes: u64,
    }

    #[derive(Clone, Default)]
    struct Scripted(Arc<Mutex<Script>>);

    impl Election for Scripted {
        async fn grant(&mut self, _ttl: Duration) -> Result<i64, String> {
            let mut s = self.0.lock().unwrap();
            s.grants += 1;
            Ok(i64::try_from(s.grants).unwrap())
        }

        async fn campaign(
            &mut self,
            _: &str,
            _: &str,
            _lease: i64,
        ) -> Result<Option<Elected>, String> {
            let n = {
                let mut s = self.0.lock().unwrap();
                s.campaigns += 1;
                s.campaigns
            };
            if n > 1 && self.0.lock().unwrap().hold_seat {
                std::future::pending::<()>().await;
            }
            // The first win is epoch 7.
            Ok(Some(Elected { epoch: 6 + n, key: Vec::new() }))
        }

        async fn deposed(&mut self, _elected: &Elected) -> String {
            std::future::pending().await
        }

        async fn refresh(&mut self, _lease: i64) -> Result<bool, String> {
            let mut s = self.0.lock().unwrap();
            s.refreshes += 1;
            if s.unreachable {
                return Err("etcd unreachable".into());
            }
            Ok(!s.expired)
        }

        async fn revoke(&mut self, lease: i64) {
            self.0.lock().unwrap().revoked.push(lease);
        }
    }

    const TTL: Duration = Duration::from_secs(3);

    /// The fake executors the leader drove, kept alive for the test.
    type Driven = Arc<Mutex<Vec<FakeExecutor>>>;

    /// Starts `lead` on `script`; while leading, a fake executor link is driven (as discovery
    /// would open one). Returns the leadership's epoch and the resign switch.
    fn start(
        script: &Scripted,
        set: &Arc<ExecutorSet>,
    ) -> (watch::Receiver<Option<u64>>, watch::Sender<bool>, Driven) {
        let seat = Seat {
            election: script.clone(),
            name: "/ferry/test/scheduler/default".into(),
            candidate: Candidate {
                pool: "default".into(),
                scheduler_id: "s".into(),
                address: "a".into(),
            },
            ttl: TTL,
        };
        let (leading_tx, leading) = watch::channel(None);
        let (resign_tx, resign) = watch::channel(false);
        let executors = Arc::new(Mutex::new(Vec::new()));
        let drive = {
            let (set, executors) = (set.clone(), executors.clone());
            move |epoch: u64, _lease: i64| {
                let token = Arc::new(|_, p| p as u32);
                let (link, exec) =
                    leader_link(&format!("e{epoch}"), epoch, token, set.link_shared());
                set.insert(link);
                executors.lock().unwrap().push(exec);
                tokio::spawn(std::future::pending::<()>())
            }
        };
        tokio::spawn(lead(seat, drive, set.clone(), leading_tx, resign));
        (leading, resign_tx, executors)
    }

    /// A leader elected at epoch 7, driving its fake executor "e7"; campaigns after that wait
    /// (another candidate holds the seat). Keep the last item alive for the test.
    async fn elected_at_7(
    ) -> (Scripted, Arc<ExecutorSet>, watch::Receiver<Option<u64>>, (watch::Sender<bool>, Driven))
    {
        let script = Scripted::default();
        script.0.lock().unwrap().hold_seat = true;
        let set = ExecutorSet::new();
        let (mut leading, resign, execs) = start(&script, &set);
        leading.wait_for(|l| *l == Some(7)).await.unwrap();
        assert_eq!(set.names(), ["e7"], "it drives its executors while leading");
        (script, set, leading, (resign, execs))
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_serves_through_an_etcd_outage_of_any_length_and_steps_down_when_told() {
        let (script, set, mut leading, _run) = elected_at_7().await;
        let link = set.alive().pop().unwrap();
        // etcd goes away for a hundred TTLs: the leadership and its session stay.
        script.0.lock().unwrap().unreachable = true;
        let outage = Instant::now();
        let refreshes_before = script.0.lock().unwrap().refreshes;
        tokio::time::sleep(TTL * 100).await;
        assert_eq!(*leading.borrow(), Some(7), "still leading after {:?}", outage.elapsed());
        assert!(link.is_alive() && set.names() == ["e7"], "its session stays up");
        assert_eq!(set.standing(), Standing::Serving(7));
        let tries = script.0.lock().unwrap().refreshes - refreshes_before;
        assert!(tries >= 100, "it kept asking etcd: {tries} refreshes in 100 TTLs");
        // etcd is back and keeps the lease (it extends leases when it restarts): nothing moves.
        script.0.lock().unwrap().unreachable = false;
        tokio::time::sleep(TTL).await;
        assert_eq!(*leading.borrow(), Some(7));
        assert!(link.is_alive());
        // etcd says the lease is gone: deposed at once, sessions closed, campaigning again.
        let told = Instant::now();
        script.0.lock().unwrap().expired = true;
        leading.wait_for(Option::is_none).await.unwrap();
        assert!(told.elapsed() <= TTL / 3, "stepped down {:?} after etcd said so", told.elapsed());
        assert!(set.names().is_empty() && !link.is_alive(), "its sessions are closed at once");
        assert_eq!(set.standing(), Standing::Deposed);
        script.0.lock().unwrap().expired = false;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let s = script.0.lock().unwrap();
        assert_eq!((s.grants, s.campaigns), (2, 2), "a new lease and a new campaign");
        assert_eq!(s.revoked, [1], "the lost lease was revoked");
    }

    #[tokio::test(start_paused = true)]
    async fn an_executor_naming_a_newer_epoch_deposes_the_leader_at_once_even_without_etcd() {
        let (script, set, mut leading, _run) = elected_at_7().await;
        let link = set.alive().pop().unwrap();
        // etcd is unreachable, so only an executor can tell: it has seen epoch 9.
        script.0.lock().unwrap().unreachable = true;
        tokio::time::sleep(TTL * 3).await;
        let told = Instant::now();
        set.fence.saw(9);
        leading.wait_for(Option::is_none).await.unwrap();
        assert_eq!(told.elapsed(), Duration::ZERO, "deposed as soon as it heard");
        assert!(!link.is_alive(), "its sessions are closed");
        assert_eq!(set.standing(), Standing::Deposed);
        // Nothing waits for an executor on a deposed scheduler: the fronts move the requests.
        let waited = Instant::now();
        assert!(set.wait_alive(Duration::from_secs(30)).await.is_empty());
        assert_eq!(waited.elapsed(), Duration::ZERO, "a lost request gives up at once");
        // A session its old epoch opened late is not taken.
        let late = fake_link("late", Arc::new(|_, p| p as u32), set.metrics.clone()).0;
        set.insert(late.clone());
        assert!(!late.is_alive(), "a deposed set takes no link");
        assert_eq!(script.0.lock().unwrap().revoked, [1], "it gave up the old lease");
    }

    #[tokio::test]
    async fn a_serving_set_takes_only_links_of_its_own_epoch() {
        let set = ExecutorSet::new();
        let link = |name: &str| fake_link(name, Arc::new(|_, p| p as u32), set.metrics.clone()).0;
        let zero = link("zero"); // fake links are opened under epoch 0
        set.insert(zero.clone());
        assert!(zero.is_alive(), "without etcd the set serves epoch 0");
        set.lead(8);
        assert!(!zero.is_alive(), "leading under a new epoch closes what the old one opened");
        let stale = link("stale");
        set.insert(stale.clone());
        assert!(!stale.is_alive() && set.names().is_empty(), "a link of another epoch is closed");
        set.fence.saw(8);
        assert_eq!(set.standing(), Standing::Serving(8), "its own epoch does not outrank it");
        set.fence.saw(11);
        assert_eq!(set.standing(), Standing::Deposed, "a newer epoch does");
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_lease_ends_the_leadership_at_once_and_resigning_retires_the_set() {
        let script = Scripted::default();
        let set = ExecutorSet::new();
        let (mut leading, resign, _execs) = start(&script, &set);
        leading.wait_for(|l| *l == Some(7)).await.unwrap();
        let asked = Instant::now();
        script.0.lock().unwrap().expired = true;
        leading.wait_for(Option::is_none).await.unwrap();
        assert!(asked.elapsed() <= TTL / 3, "no waiting out the TTL: {:?}", asked.elapsed());
        // It is elected again, under a newer epoch, once etcd keeps its lease again.
        script.0.lock().unwrap().expired = false;
        let epoch = leading.wait_for(|l| l.is_some_and(|e| e > 7)).await.unwrap().unwrap();
        assert_eq!(set.names(), [format!("e{epoch}")]);
        // Resigning hands over: the set is retired, the lease revoked, the loop ends.
        resign.send(true).unwrap();
        leading.wait_for(Option::is_none).await.unwrap();
        let late = fake_link("late", Arc::new(|_, p| p as u32), set.metrics.clone()).0;
        set.insert(late.clone());
        assert!(!late.is_alive(), "a retired set takes no new link");
        assert_eq!(script.0.lock().unwrap().revoked, [1, 2]);
    }
}
