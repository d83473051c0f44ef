//! The executors a scheduler drives right now: a set of links that grows as executors are
//! discovered (or listed with `--executor`) and shrinks as they die or their etcd lease lapses.
//!
//! Why a set and not a fixed list: with etcd, membership changes at run time, and the front
//! must place new requests — and move the requests of a lost executor — only on links that are
//! up. A removed link is closed: its loop fails its requests, whose streams the front then
//! moves to the survivors (DESIGN.md §7).

use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::watch;

use crate::link::LinkHandle;
use crate::metrics::SchedulerMetrics;
use crate::tier::{LiveAgents, TierIndex};

/// The live links, by executor name.
pub struct ExecutorSet {
    /// What the links and the front count.
    pub metrics: Arc<SchedulerMetrics>,
    /// What each node's KV agent holds (the KV tier), as the links wrote it there.
    pub tier: Arc<TierIndex>,
    /// The KV agents registered in etcd (all taken as live without etcd).
    pub agents: LiveAgents,
    links: RwLock<Vec<LinkHandle>>,
    /// Set when this scheduler hands its work over for good (drain): nothing waits for links.
    retired: std::sync::atomic::AtomicBool,
    /// Bumped on every change, so waiters wake up without polling.
    changed: watch::Sender<u64>,
}

impl Default for ExecutorSet {
    fn default() -> Self {
        Self {
            metrics: SchedulerMetrics::new(),
            tier: Arc::default(),
            agents: LiveAgents::default(),
            links: RwLock::new(Vec::new()),
            retired: std::sync::atomic::AtomicBool::new(false),
            changed: watch::channel(0).0,
        }
    }
}

impl ExecutorSet {
    /// An empty set.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    /// Adds a link; one with the same name is replaced and closed. A retired set closes it.
    pub fn insert(&self, link: LinkHandle) {
        if self.is_retired() {
            link.close("this scheduler is draining");
            return;
        }
        let old = {
            let mut links = self.links.write().unwrap_or_else(std::sync::PoisonError::into_inner);
            let old = links.iter().position(|l| l.name == link.name).map(|i| links.remove(i));
            links.push(link);
            old
        };
        if let Some(old) = old {
            old.close("replaced by a new session to the same executor");
        }
        self.bump();
    }

    /// Removes and closes the link named `name` (its requests fail over); false if absent.
    pub fn remove(&self, name: &str, reason: &str) -> bool {
        let old = {
            let mut links = self.links.write().unwrap_or_else(std::sync::PoisonError::into_inner);
            links.iter().position(|l| &*l.name == name).map(|i| links.remove(i))
        };
        match old {
            Some(link) => {
                link.close(reason);
                self.bump();
                true
            }
            None => false,
        }
    }

    /// Removes and closes every link (their requests wait in the front for new ones).
    pub fn clear(&self, reason: &str) {
        let old = std::mem::take(
            &mut *self.links.write().unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for link in &old {
            link.close(reason);
        }
        if !old.is_empty() {
            self.bump();
        }
    }

    /// Closes every link for good (drain): requests waiting for an executor give up at once,
    /// so whoever sent them (a front) moves them elsewhere.
    pub fn retire(&self, reason: &str) {
        self.retired.store(true, std::sync::atomic::Ordering::SeqCst);
        self.clear(reason);
        self.bump();
    }

    fn is_retired(&self) -> bool {
        self.retired.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether a link named `name` is in the set and up.
    pub fn contains_alive(&self, name: &str) -> bool {
        self.alive().iter().any(|l| &*l.name == name)
    }

    /// The links that are up, in insertion order; dead ones are dropped from the set.
    pub fn alive(&self) -> Vec<LinkHandle> {
        let (alive, pruned) = {
            let mut links = self.links.write().unwrap_or_else(std::sync::PoisonError::into_inner);
            let before = links.len();
            links.retain(LinkHandle::is_alive);
            (links.clone(), links.len() != before)
        };
        if pruned {
            self.bump();
        }
        alive
    }

    /// The live links, waiting up to `patience` for one to appear when there is none.
    pub async fn wait_alive(&self, patience: Duration) -> Vec<LinkHandle> {
        let mut changes = self.changed.subscribe();
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let alive = self.alive();
            if !alive.is_empty() || self.is_retired() {
                return alive;
            }
            // A link dies without telling the set; re-check now and then as well.
            let tick = deadline.min(tokio::time::Instant::now() + Duration::from_millis(200));
            tokio::select! {
                _ = changes.changed() => {}
                () = tokio::time::sleep_until(tick) => {}
            }
            if tokio::time::Instant::now() >= deadline {
                return self.alive();
            }
        }
    }

    /// Names of the live links.
    pub fn names(&self) -> Vec<String> {
        self.alive().iter().map(|l| l.name.to_string()).collect()
    }
}
