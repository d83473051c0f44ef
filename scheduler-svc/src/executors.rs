//! The executors a scheduler drives right now: a set of links that grows as executors are
//! discovered (or listed with `--executor`) and shrinks as they die or their etcd lease lapses.
//!
//! Why a set and not a fixed list: with etcd, membership changes at run time, and the front
//! must place new requests — and move the requests of a lost executor — only on links that are
//! up. A removed link is closed: its loop fails its requests, whose streams the front then
//! moves to the survivors (DESIGN.md §7).
//!
//! The set also knows where its scheduler stands ([`Standing`]): serving under a leadership
//! epoch, deposed, or retired. Only a serving set takes links (of its own epoch), and only a
//! serving set makes a request that lost its executor wait for another: a deposed or retired
//! scheduler gives its requests up at once, so the fronts move them to the leader.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::watch;

use crate::link::LinkHandle;
use crate::metrics::SchedulerMetrics;
use crate::tier::{LiveAgents, TierIndex};

/// Where a scheduler stands with its executors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// It drives executors under this leadership epoch (0 without etcd).
    Serving(u64),
    /// It lost its leadership (it may win it again): it takes no link, and nothing waits here.
    Deposed,
    /// It handed its work over for good (drain).
    Retired,
}

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

/// The live links, by executor name.
pub struct ExecutorSet {
    /// What the links and the front count.
    pub metrics: Arc<SchedulerMetrics>,
    /// What each node's KV agent holds (the KV tier), as the links wrote it there.
    pub tier: Arc<TierIndex>,
    /// The KV agents registered in etcd (all taken as live without etcd).
    pub agents: LiveAgents,
    /// What the links learn of newer leaderships.
    pub fence: Arc<Fence>,
    links: RwLock<Vec<LinkHandle>>,
    standing: RwLock<Standing>,
    /// Bumped on every change, so waiters wake up without polling.
    changed: watch::Sender<u64>,
}

impl Default for ExecutorSet {
    fn default() -> Self {
        Self {
            metrics: SchedulerMetrics::new(),
            tier: Arc::default(),
            agents: LiveAgents::default(),
            fence: Arc::default(),
            links: RwLock::new(Vec::new()),
            standing: RwLock::new(Standing::Serving(0)),
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

    /// Adds a link; one with the same name is replaced and closed. A set that is not serving
    /// the link's epoch closes it instead (a session opened under an older leadership, or
    /// after this scheduler was deposed or retired).
    pub fn insert(&self, link: LinkHandle) {
        match self.standing() {
            Standing::Serving(epoch) if epoch == link.epoch => {}
            Standing::Serving(epoch) => {
                let why = format!(
                    "opened under epoch {}, but this scheduler leads under {epoch}",
                    link.epoch
                );
                link.close(&why);
                return;
            }
            Standing::Deposed => return link.close("this scheduler no longer leads its pool"),
            Standing::Retired => return link.close("this scheduler is draining"),
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

    /// Removes and closes every link.
    fn clear(&self, reason: &str) {
        let old = std::mem::take(
            &mut *self.links.write().unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for link in &old {
            link.close(reason);
        }
    }

    fn stand(&self, standing: Standing, reason: &str) {
        {
            let mut s = self.standing.write().unwrap_or_else(std::sync::PoisonError::into_inner);
            if *s == Standing::Retired {
                return; // for good
            }
            *s = standing;
        }
        self.clear(reason);
        self.bump();
    }

    /// Serves under leadership `epoch` from now on: links of that epoch are taken (any left
    /// from before are closed).
    pub fn lead(&self, epoch: u64) {
        self.stand(Standing::Serving(epoch), "this scheduler leads under a new epoch");
    }

    /// Closes every link until [`Self::lead`]: this scheduler lost its leadership. Requests
    /// waiting for an executor give up at once, so whoever sent them (a front) moves them to
    /// the leader.
    pub fn depose(&self, reason: &str) {
        self.stand(Standing::Deposed, reason);
    }

    /// Closes every link for good (drain): requests waiting for an executor give up at once,
    /// so whoever sent them (a front) moves them elsewhere.
    pub fn retire(&self, reason: &str) {
        self.stand(Standing::Retired, reason);
    }

    /// Where this scheduler stands: deposed as well once an executor has seen an epoch newer
    /// than the one it serves under.
    pub fn standing(&self) -> Standing {
        let standing = *self.standing.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        match standing {
            Standing::Serving(epoch) if self.fence.newest() > epoch => Standing::Deposed,
            other => other,
        }
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
            if !alive.is_empty() || !matches!(self.standing(), Standing::Serving(_)) {
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
