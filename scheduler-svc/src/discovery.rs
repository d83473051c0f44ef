//! Executor discovery through etcd (DESIGN.md §7): watch `/ferry/<cluster>/executors/`, open
//! a session to each executor that registers, and close it when its key goes away (it withdrew
//! on drain, or its lease lapsed because it stopped answering).
//!
//! A key that goes away while the executor's session is alive is checked first: etcd trouble
//! (a raft election, a slow member) can lapse a lease whose holder is fine. The executor is
//! asked over the gRPC health service; one still `SERVING` keeps its session (and re-registers
//! by itself), one draining (`NOT_SERVING`, which it reports before withdrawing) or silent is
//! closed, and its requests move.
//!
//! The set of registered executors this scheduler's shard owns is the wanted state; a reconcile
//! pass every second (and on every change) connects any wanted executor that has no live link,
//! so a session that broke while the executor stays registered is re-opened. While etcd is
//! unreachable the watcher is silent and the wanted state stays as last seen: serving goes on.
//!
//! Shards: several scheduler pools may share a cluster. The pools that are up are those with a
//! candidate in their election (`scheduler/<pool>/`, watched too); which executors a pool owns
//! is [`ferry_sched_core::shards::assign`] of the registered executors (each with its `--pool`
//! label, if any) over the pools up — the same answer in every leader, with nothing written. An
//! executor that another shard owns now (one joined, or its label says so) has its session
//! closed here, its requests moved to this shard's other executors, and the owner's handshake,
//! refused while this session streamed, then opens. Nothing is connected before the pools up
//! are known.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use ferry_runtime::cluster::{watch_members, ClusterArgs, MemberInfo, MemberKind, MembershipEvent};
use ferry_runtime::tls;
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use tokio::task::JoinHandle;

use crate::executors::ExecutorSet;
use crate::link::{LinkError, LinkHandle, SessionOpener};

/// How long an executor that refused a session (another model, say) waits before it is asked
/// again: a refusal is not fixed by asking every second, but may be by a restart.
const REFUSED_RETRY: Duration = Duration::from_secs(10);

/// How long an executor whose registration vanished has to say it still serves.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Keeps `set` equal to the executors registered in etcd until aborted, opening sessions with
/// `opener` (which carries the leadership epoch).
pub async fn run(cluster: ClusterArgs, opener: SessionOpener, set: Arc<ExecutorSet>) {
    let client = cluster.client_patiently().await;
    let events = watch_members(client.clone(), cluster.prefix(MemberKind::Executor));
    let pools = watch_members(client.clone(), cluster.schedulers_prefix());
    let agents = watch_members(client, cluster.prefix(MemberKind::KvAgent));
    let own = opener.settings.pool.clone();
    let wanted = Wanted::new(connector(opener), health_probe(), set.clone()).sharded(own);
    // One task: aborting it (leadership lost) stops both.
    tokio::join!(reconcile_loop(wanted, events, Some(pools)), track_agents(agents, &set));
}

/// Keeps `set.agents` equal to the KV agents registered in etcd; an agent whose key goes away
/// (it withdrew, or its lease lapsed) is not used for transfers and its blocks leave the KV
/// tier's index (its store is gone, or going, with it).
async fn track_agents(mut events: tokio::sync::mpsc::Receiver<MembershipEvent>, set: &ExecutorSet) {
    let mut known: HashMap<String, String> = HashMap::new();
    while let Some(ev) = events.recv().await {
        let address = |value: &str| MemberInfo::from_value(value).ok().map(|i| i.address);
        let gone: Vec<String> = match ev {
            MembershipEvent::Snapshot(list) => {
                let now: HashMap<String, String> = list
                    .into_iter()
                    .filter_map(|(name, value)| Some((name, address(&value)?)))
                    .collect();
                let gone = known
                    .iter()
                    .filter(|(name, a)| now.get(*name) != Some(*a))
                    .map(|(_, a)| a.clone())
                    .collect();
                known = now;
                gone
            }
            MembershipEvent::Put(name, value) => {
                let Some(a) = address(&value) else { continue };
                // A re-registration (a new lease) at the same address changes nothing.
                known.insert(name, a.clone()).filter(|old| *old != a).into_iter().collect()
            }
            MembershipEvent::Delete(name) => known.remove(&name).into_iter().collect(),
        };
        for a in &gone {
            tracing::info!(agent = %a, "KV agent gone: not used, its blocks forgotten");
            set.tier.forget_agent(a);
        }
        set.agents.set(known.values().cloned());
    }
}

/// Opens a session to executor `(name, url)`: through a [`SessionOpener`] in service, a fake
/// in tests.
type Connect =
    Arc<dyn Fn(String, String) -> BoxFuture<'static, Result<LinkHandle, LinkError>> + Send + Sync>;

fn connector(opener: SessionOpener) -> Connect {
    Arc::new(move |name, url| {
        let opener = opener.clone();
        Box::pin(async move { opener.open_patiently(&name, &url).await })
    })
}

/// Asks the executor at a url whether it still serves: a health service in service, a fake in
/// tests.
type Probe = Arc<dyn Fn(String) -> BoxFuture<'static, bool> + Send + Sync>;

/// Whether the executor at the url answers `SERVING` on the gRPC health service within
/// [`PROBE_TIMEOUT`].
fn health_probe() -> Probe {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    Arc::new(|url| {
        Box::pin(async move {
            let check = async {
                let endpoint = tls::endpoint(&url).ok()?;
                let channel = tls::connect(&endpoint, tls::Role::Executor).await.ok()?;
                let mut client = HealthClient::new(channel);
                let reply = client.check(HealthCheckRequest { service: String::new() }).await;
                Some(reply.ok()?.into_inner().status == ServingStatus::Serving as i32)
            };
            tokio::time::timeout(PROBE_TIMEOUT, check).await.ok().flatten().unwrap_or(false)
        })
    })
}

/// Applies membership `events` (and the pools' candidates, `pools`, when sharded) to `wanted`
/// and reconciles on every change and every second, until the events end.
async fn reconcile_loop(
    mut wanted: Wanted,
    mut events: tokio::sync::mpsc::Receiver<MembershipEvent>,
    mut pools: Option<tokio::sync::mpsc::Receiver<MembershipEvent>>,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let answered = wanted.answered.clone();
    loop {
        let pool_event = async {
            match pools.as_mut() {
                Some(rx) => rx.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            ev = events.recv() => match ev {
                Some(ev) => wanted.apply(ev),
                None => return,
            },
            Some(ev) = pool_event => wanted.apply_pools(ev),
            () = answered.notified() => {}
            _ = tick.tick() => {}
        }
        wanted.reconcile();
    }
}

/// Keeps a session open to each of the executors listed by hand (`--executor`, as
/// `(name, url)`), reconnecting when one is lost and comes back at the same address, until
/// aborted.
pub async fn run_static(
    listed: Vec<(String, String)>,
    opener: SessionOpener,
    set: Arc<ExecutorSet>,
) {
    let mut wanted = Wanted::new(connector(opener), health_probe(), set);
    let listed = listed
        .into_iter()
        .map(|(name, url)| (name, MemberInfo { address: url, pool: None }.to_value()))
        .collect();
    wanted.apply(MembershipEvent::Snapshot(listed));
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        wanted.reconcile();
    }
}

/// A registered executor and the task connecting to it, if one runs.
struct Member {
    address: String,
    /// Its `--pool` label.
    pool: Option<String>,
    /// The task opening a session, while one runs; it answers when the executor refused.
    connecting: Option<JoinHandle<Option<tokio::time::Instant>>>,
    /// When the executor last refused a session: not asked again for [`REFUSED_RETRY`].
    refused_at: Option<tokio::time::Instant>,
    /// Set when its registration vanished while its session lived.
    unlisted: Option<Unlisted>,
}

/// An executor whose registration vanished while its session lived.
enum Unlisted {
    /// It is being asked whether it still serves (the task answers).
    Asking(JoinHandle<bool>),
    /// It said it serves: its session is kept (not reopened if it breaks) until it registers
    /// again.
    Serving,
}

impl Member {
    fn new(info: MemberInfo) -> Self {
        let MemberInfo { address, pool } = info;
        Self { address, pool, connecting: None, refused_at: None, unlisted: None }
    }

    /// Cancels what runs for this member.
    fn cancel(&mut self) {
        if let Some(task) = self.connecting.take() {
            task.abort();
        }
        self.listed();
    }

    /// Its registration is back (or it is going): no longer unlisted, its question cancelled.
    fn listed(&mut self) {
        if let Some(Unlisted::Asking(task)) = self.unlisted.take() {
            task.abort();
        }
    }
}

/// The executors that should have a live link, and the links being opened to them.
struct Wanted {
    connect: Connect,
    probe: Probe,
    /// Woken when a probe answers, so its answer is acted on at once.
    answered: Arc<tokio::sync::Notify>,
    set: Arc<ExecutorSet>,
    members: HashMap<String, Member>,
    /// With etcd: this scheduler's pool and the pools up; `None` when listed by hand (every
    /// member is wanted).
    shards: Option<Shards>,
}

/// This scheduler's pool among the pools that are up.
struct Shards {
    own: String,
    /// The election candidates' keys (`<pool>/<lease>`); `None` until etcd has listed them.
    candidates: Option<BTreeSet<String>>,
}

impl Shards {
    /// The pools up (this one always: it leads), sorted.
    fn up(&self) -> Option<Vec<&str>> {
        let candidates = self.candidates.as_ref()?;
        let mut pools: BTreeSet<&str> =
            candidates.iter().filter_map(|k| ferry_runtime::cluster::candidate_pool(k)).collect();
        pools.insert(&self.own);
        Some(pools.into_iter().collect())
    }
}

/// Dropped when discovery stops (this scheduler no longer leads): every connection under way
/// is cancelled with it, so none opens a session under a leadership that is over.
impl Drop for Wanted {
    fn drop(&mut self) {
        for m in self.members.values_mut() {
            m.cancel();
        }
    }
}

impl Wanted {
    fn new(connect: Connect, probe: Probe, set: Arc<ExecutorSet>) -> Self {
        let answered = Arc::new(tokio::sync::Notify::new());
        Self { connect, probe, answered, set, members: HashMap::new(), shards: None }
    }

    /// Owning only what the shards' assignment gives pool `own`.
    fn sharded(mut self, own: String) -> Self {
        self.shards = Some(Shards { own, candidates: None });
        self
    }

    /// Applies a change in the pools' election candidates.
    fn apply_pools(&mut self, ev: MembershipEvent) {
        let Some(shards) = self.shards.as_mut() else { return };
        let candidates = shards.candidates.get_or_insert_with(BTreeSet::new);
        match ev {
            MembershipEvent::Snapshot(list) => {
                *candidates = list.into_iter().map(|(k, _)| k).collect();
            }
            MembershipEvent::Put(k, _) => {
                candidates.insert(k);
            }
            MembershipEvent::Delete(k) => {
                candidates.remove(&k);
            }
        }
    }

    /// Each member's owning pool, when it is not this scheduler's: `Some(None)` for none
    /// (its labelled pool is down), `None` for this one's; everything is this one's when
    /// listed by hand, and nothing (every name → `Some(None)`) before the pools are known.
    fn elsewhere(&self) -> HashMap<String, Option<String>> {
        let Some(shards) = &self.shards else { return HashMap::new() };
        let Some(up) = shards.up() else {
            return self.members.keys().map(|n| (n.clone(), None)).collect();
        };
        let members: Vec<(&str, Option<&str>)> =
            self.members.iter().map(|(n, m)| (n.as_str(), m.pool.as_deref())).collect();
        let owners = ferry_sched_core::shards::assign(&members, &up);
        members
            .iter()
            .zip(owners)
            .filter(|(_, owner)| owner.map(|s| up[s]) != Some(shards.own.as_str()))
            .map(|((n, _), owner)| (n.to_string(), owner.map(|s| up[s].to_string())))
            .collect()
    }

    fn apply(&mut self, ev: MembershipEvent) {
        match ev {
            MembershipEvent::Snapshot(list) => {
                let gone: Vec<String> = self
                    .members
                    .keys()
                    .filter(|name| !list.iter().any(|(n, _)| n == *name))
                    .cloned()
                    .collect();
                for name in gone {
                    self.forget(&name);
                }
                for (name, value) in list {
                    self.upsert(name, &value);
                }
            }
            MembershipEvent::Put(name, value) => self.upsert(name, &value),
            MembershipEvent::Delete(name) => self.forget(&name),
        }
    }

    fn upsert(&mut self, name: String, value: &str) {
        let info = match MemberInfo::from_value(value) {
            Ok(info) => info,
            Err(e) => {
                tracing::warn!(executor = %name, error = %e, "unreadable registration ignored");
                return;
            }
        };
        if let Some(m) =
            self.members.get_mut(&name).filter(|m| m.address == info.address && m.pool == info.pool)
        {
            m.listed(); // a re-registration (new lease) of what we already have
            return;
        }
        let address = ferry_runtime::tls::dialled_url(&info.address);
        tracing::info!(executor = %name, %address, "executor registered");
        if let Some(mut old) = self.members.remove(&name) {
            old.cancel();
            self.set.remove(&name, "it registered again at a new address or in another pool");
        }
        self.members.insert(name, Member::new(info));
    }

    /// Its registration is gone: a member without a live session is dropped now; one with a
    /// live session is asked whether it still serves first (see [`Unlisted`]).
    fn forget(&mut self, name: &str) {
        let Some(m) = self.members.get_mut(name) else { return };
        if m.unlisted.is_some() {
            return;
        }
        if !self.set.contains_alive(name) {
            self.drop_member(name, "executor deregistered (withdrew or its lease lapsed)");
            return;
        }
        tracing::info!(executor = %name, "registration gone while its session lives: asking it");
        let (probe, answered) = ((self.probe)(m.address.clone()), self.answered.clone());
        m.unlisted = Some(Unlisted::Asking(tokio::spawn(async move {
            let serving = probe.await;
            answered.notify_one();
            serving
        })));
    }

    fn drop_member(&mut self, name: &str, why: &str) {
        if let Some(mut m) = self.members.remove(name) {
            m.cancel();
            tracing::warn!(executor = %name, "{why}");
            self.set.remove(name, "its etcd registration is gone (withdrawn or lease lapsed)");
        }
    }

    /// Settles members whose registration vanished: asked and not serving (or no longer
    /// linked), they are dropped.
    fn settle_unlisted(&mut self) {
        let mut gone = Vec::new();
        for (name, m) in &mut self.members {
            let (serving, answered) = match m.unlisted.take() {
                None => continue,
                Some(Unlisted::Asking(task)) if !task.is_finished() => {
                    m.unlisted = Some(Unlisted::Asking(task));
                    continue;
                }
                Some(Unlisted::Asking(task)) => (task.now_or_never().and_then(Result::ok), true),
                Some(Unlisted::Serving) => (Some(true), false),
            };
            if serving == Some(true) && self.set.contains_alive(name) {
                m.unlisted = Some(Unlisted::Serving);
                if answered {
                    tracing::warn!(
                        executor = %name,
                        "executor serves on though its registration lapsed (etcd trouble?): \
                         its session is kept until it registers again"
                    );
                }
            } else {
                gone.push(name.clone());
            }
        }
        for name in gone {
            self.drop_member(&name, "executor deregistered (withdrew, lease lapsed, not serving)");
        }
    }

    /// Starts a connection to every wanted executor without a live link or a connection under
    /// way (an executor that refused waits [`REFUSED_RETRY`] before it is asked again).
    fn reconcile(&mut self) {
        self.settle_unlisted();
        let elsewhere = self.elsewhere();
        let now = tokio::time::Instant::now();
        for (name, m) in &mut self.members {
            if m.unlisted.is_some() {
                continue; // not registered: never (re)connected
            }
            if let Some(owner) = elsewhere.get(name) {
                // Another shard's now (or nobody's): let go, so that its owner can open.
                if let Some(task) = m.connecting.take() {
                    task.abort();
                }
                if self.set.contains_alive(name) {
                    let why = match owner {
                        Some(pool) => format!("executor assigned to scheduler pool {pool:?}"),
                        None => "executor's pool (--pool) has no scheduler up".to_string(),
                    };
                    tracing::info!(executor = %name, "{why}: its session closes here");
                    self.set.remove(name, &why);
                }
                continue;
            }
            if let Some(task) = m.connecting.take_if(|t| t.is_finished()) {
                if let Some(Ok(Some(at))) = task.now_or_never() {
                    m.refused_at = Some(at);
                }
            }
            if m.connecting.is_some() || self.set.contains_alive(name) {
                continue;
            }
            if m.refused_at.is_some_and(|at| now < at + REFUSED_RETRY) {
                continue;
            }
            let (name, url, set) = (name.clone(), m.address.clone(), self.set.clone());
            let opening = (self.connect)(name.clone(), url.clone());
            m.connecting = Some(tokio::spawn(async move {
                match opening.await {
                    Ok(link) => {
                        let address = ferry_runtime::tls::dialled_url(&url);
                        tracing::info!(executor = %name, %address, "executor session open");
                        set.insert(link);
                        None
                    }
                    Err(e @ LinkError::Refused { .. }) => {
                        tracing::error!(executor = %name, error = %e, "executor refused the session");
                        Some(tokio::time::Instant::now())
                    }
                    Err(e) => {
                        tracing::warn!(executor = %name, error = %e, "executor not reachable");
                        None
                    }
                }
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use ferry_runtime::cluster::{MemberInfo, MembershipEvent};

    use super::{reconcile_loop, Connect, Probe, Wanted};
    use crate::executors::ExecutorSet;
    use crate::link::fake::{fake_link, FakeExecutor, TokenFn};
    use crate::link::LinkError;

    /// A connector that opens fake links, except to `refuser`, which refuses; it counts the
    /// attempts per executor and keeps the fake executors.
    struct Fakes {
        attempts: Mutex<HashMap<String, usize>>,
        executors: Mutex<HashMap<String, FakeExecutor>>,
    }

    fn connector(set: &Arc<ExecutorSet>, fakes: &Arc<Fakes>) -> Connect {
        let (set, fakes) = (set.clone(), fakes.clone());
        let token: TokenFn = Arc::new(|_, pos| 100 + pos as u32);
        Arc::new(move |name: String, url: String| {
            *fakes.attempts.lock().unwrap().entry(name.clone()).or_default() += 1;
            let result = if name == "refuser" {
                Err(LinkError::Refused { addr: url, reason: "another model".into() })
            } else {
                let (link, exec) = fake_link(&name, token.clone(), set.metrics.clone());
                fakes.executors.lock().unwrap().insert(name, exec);
                Ok(link)
            };
            Box::pin(async move { result })
        })
    }

    /// A probe under which the executors at `serving`'s urls still serve.
    fn probe(serving: &Arc<Mutex<Vec<String>>>) -> Probe {
        let serving = serving.clone();
        Arc::new(move |url: String| {
            let answer = serving.lock().unwrap().contains(&url);
            Box::pin(async move { answer })
        })
    }

    fn member(name: &str) -> (String, String) {
        (
            name.to_string(),
            MemberInfo { address: format!("http://{name}:1"), pool: None }.to_value(),
        )
    }

    /// Waits (in paused time) until `cond` holds, failing after a minute.
    async fn until(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_mins(1);
        while !cond() {
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting until {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn reconcile_connects_members_reconnects_lost_ones_and_backs_off_refusals() {
        let set = ExecutorSet::new();
        let fakes = Arc::new(Fakes { attempts: Mutex::default(), executors: Mutex::default() });
        let (events, rx) = tokio::sync::mpsc::channel(8);
        let none = probe(&Arc::default());
        let wanted = Wanted::new(connector(&set, &fakes), none, set.clone());
        tokio::spawn(reconcile_loop(wanted, rx, None));
        let attempts = |name: &str| fakes.attempts.lock().unwrap().get(name).copied().unwrap_or(0);
        let names = || {
            let mut n = set.names();
            n.sort();
            n
        };
        events
            .send(MembershipEvent::Snapshot(vec![member("a"), member("b"), member("refuser")]))
            .await
            .unwrap();
        until("a and b are connected", || names() == ["a", "b"]).await;
        until("the refuser was asked", || attempts("refuser") == 1).await;

        // A session that breaks while its executor stays registered is opened again.
        fakes.executors.lock().unwrap()["a"].kill();
        until("a is connected again", || attempts("a") == 2 && names() == ["a", "b"]).await;

        // A refusal is not retried every second, but after a pause.
        let refused_at = tokio::time::Instant::now();
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(attempts("refuser"), 1, "asked again within 5 s of a refusal");
        until("the refuser is asked again", || attempts("refuser") == 2).await;
        assert!(refused_at.elapsed() >= Duration::from_secs(9), "{:?}", refused_at.elapsed());

        // A deregistered executor that does not serve (it drains) is closed and leaves the set.
        let b = set.alive().into_iter().find(|l| &*l.name == "b").unwrap();
        events.send(MembershipEvent::Delete("b".into())).await.unwrap();
        until("b is gone", || names() == ["a"]).await;
        assert!(!b.is_alive(), "its session was closed");
        assert_eq!(attempts("b"), 1, "a deregistered executor is not reconnected");
    }

    #[tokio::test(start_paused = true)]
    async fn stopping_discovery_cancels_the_connections_under_way() {
        /// Set when the connection attempt holding it is dropped (cancelled).
        struct Dropped(Arc<Mutex<bool>>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                *self.0.lock().unwrap() = true;
            }
        }
        let started = Arc::new(Mutex::new(false));
        let cancelled = Arc::new(Mutex::new(false));
        let connect: Connect = {
            let (started, cancelled) = (started.clone(), cancelled.clone());
            Arc::new(move |_name: String, _url: String| {
                *started.lock().unwrap() = true;
                let guard = Dropped(cancelled.clone());
                Box::pin(async move {
                    let _guard = guard;
                    std::future::pending::<Result<_, LinkError>>().await
                })
            })
        };
        let set = ExecutorSet::new();
        let none = probe(&Arc::default());
        let (events, rx) = tokio::sync::mpsc::channel(8);
        let discovery = tokio::spawn(reconcile_loop(Wanted::new(connect, none, set), rx, None));
        events.send(MembershipEvent::Snapshot(vec![member("slow")])).await.unwrap();
        until("a connection is under way", || *started.lock().unwrap()).await;
        assert!(!*cancelled.lock().unwrap());
        // Leadership lost: the discovery task is aborted, and its connection with it.
        discovery.abort();
        until("the connection is cancelled", || *cancelled.lock().unwrap()).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_lapsed_registration_of_a_serving_executor_keeps_its_session() {
        let set = ExecutorSet::new();
        let fakes = Arc::new(Fakes { attempts: Mutex::default(), executors: Mutex::default() });
        let serving = Arc::new(Mutex::new(vec!["http://a:1".to_string()]));
        let wanted = Wanted::new(connector(&set, &fakes), probe(&serving), set.clone());
        let (events, rx) = tokio::sync::mpsc::channel(8);
        tokio::spawn(reconcile_loop(wanted, rx, None));
        let attempts = |name: &str| fakes.attempts.lock().unwrap().get(name).copied().unwrap_or(0);
        events.send(MembershipEvent::Snapshot(vec![member("a")])).await.unwrap();
        until("a is connected", || set.names() == ["a"]).await;
        let a = set.alive().pop().unwrap();

        // Its lease lapses (etcd trouble) while it serves: the session stays.
        events.send(MembershipEvent::Delete("a".into())).await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(a.is_alive(), "a serving executor's session was closed");
        assert_eq!(set.names(), ["a"]);
        // It registers again: a member like before, reconnected if its session breaks.
        events.send(MembershipEvent::Put("a".into(), member("a").1)).await.unwrap();
        fakes.executors.lock().unwrap()["a"].kill();
        until("a is connected again", || attempts("a") == 2 && set.names() == ["a"]).await;

        // Unlisted again, and its session then breaks: it is not reconnected (not registered).
        events.send(MembershipEvent::Delete("a".into())).await.unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(set.names(), ["a"]);
        fakes.executors.lock().unwrap()["a"].kill();
        until("a is gone", || set.names().is_empty()).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(attempts("a"), 2, "an unregistered executor was reconnected");

        // Registered once more, then unlisted while it drains (NOT_SERVING): closed at once.
        events.send(MembershipEvent::Put("a".into(), member("a").1)).await.unwrap();
        until("a is connected a third time", || set.names() == ["a"]).await;
        let a = set.alive().pop().unwrap();
        serving.lock().unwrap().clear();
        events.send(MembershipEvent::Delete("a".into())).await.unwrap();
        until("a is gone again", || set.names().is_empty()).await;
        assert!(!a.is_alive(), "the draining executor's session was not closed");
    }

    #[tokio::test(start_paused = true)]
    async fn a_shard_drives_only_the_executors_the_assignment_gives_it() {
        let set = ExecutorSet::new();
        let fakes = Arc::new(Fakes { attempts: Mutex::default(), executors: Mutex::default() });
        let none = probe(&Arc::default());
        let wanted =
            Wanted::new(connector(&set, &fakes), none, set.clone()).sharded("s0".to_string());
        let (events, rx) = tokio::sync::mpsc::channel(8);
        let (pools, pools_rx) = tokio::sync::mpsc::channel(8);
        tokio::spawn(reconcile_loop(wanted, rx, Some(pools_rx)));
        let names = || {
            let mut n = set.names();
            n.sort();
            n
        };
        let labelled = |name: &str, pool: &str| {
            let info = MemberInfo { address: format!("http://{name}:1"), pool: Some(pool.into()) };
            (name.to_string(), info.to_value())
        };
        let execs = ["e0", "e1", "e2", "e3", "e4", "e5"];
        let mut listed: Vec<(String, String)> = execs.iter().map(|n| member(n)).collect();
        listed.push(labelled("mine", "s0"));
        listed.push(labelled("theirs", "s1"));
        events.send(MembershipEvent::Snapshot(listed)).await.unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(names().is_empty(), "connected before the pools up were known: {:?}", names());

        // Alone, the shard drives every unlabelled executor and its own labelled one.
        pools.send(MembershipEvent::Snapshot(vec![("s0/1".into(), String::new())])).await.unwrap();
        let everything: Vec<&str> = ["e0", "e1", "e2", "e3", "e4", "e5", "mine"].into();
        until("s0 drives all but s1's", || names() == everything).await;

        // A second shard comes up: this one lets go of what the assignment now gives it.
        pools.send(MembershipEvent::Put("s1/2".into(), String::new())).await.unwrap();
        let up = ["s0", "s1"];
        let members: Vec<(&str, Option<&str>)> = execs.iter().map(|n| (*n, None)).collect();
        let owners = ferry_sched_core::shards::assign(&members, &up);
        let mut kept: Vec<&str> =
            execs.iter().zip(&owners).filter(|(_, o)| **o == Some(0)).map(|(n, _)| *n).collect();
        kept.push("mine");
        assert_eq!(kept.len(), 4, "three of six, and its labelled one");
        until("s0 keeps its share", || names() == kept).await;
        let released = fakes.executors.lock().unwrap().len();
        assert_eq!(released, 7, "each connected once");

        // The second shard goes away: its executors come back.
        pools.send(MembershipEvent::Delete("s1/2".into())).await.unwrap();
        until("s0 drives all again", || names() == everything).await;
    }
}
