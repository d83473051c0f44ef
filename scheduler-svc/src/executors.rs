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

use ferry_runtime::prometheus::{Render, Text};
use ferry_sched_core::SchedulerStats;
use tokio::sync::watch;

use crate::fence::Fence;
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
        self.wait_serving(None, patience).await
    }

    /// The live links whose executors run the model with `fingerprint`.
    pub fn serving(&self, fingerprint: &str) -> Vec<LinkHandle> {
        let mut links = self.alive();
        links.retain(|l| l.info.model_fingerprint == fingerprint);
        links
    }

    /// The live links whose executors run the model with `fingerprint` (any model: `None`),
    /// waiting up to `patience` for one to appear when there is none.
    pub async fn wait_serving(
        &self,
        fingerprint: Option<&str>,
        patience: Duration,
    ) -> Vec<LinkHandle> {
        let mut changes = self.changed.subscribe();
        let deadline = tokio::time::Instant::now() + patience;
        let serving = || fingerprint.map_or_else(|| self.alive(), |f| self.serving(f));
        loop {
            let alive = serving();
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
                return serving();
            }
        }
    }

    /// Names of the live links.
    pub fn names(&self) -> Vec<String> {
        self.alive().iter().map(|l| l.name.to_string()).collect()
    }

    /// What a link of this set shares with the others: where it counts, where it records what
    /// it wrote to its node's agent, and where it reports newer leadership epochs (tests open
    /// links of a set with it; a scheduler's `SessionOpener` carries the same three).
    #[cfg(test)]
    pub(crate) fn link_shared(&self) -> crate::link::Shared {
        crate::link::Shared {
            metrics: self.metrics.clone(),
            tier: self.tier.clone(),
            fence: self.fence.clone(),
        }
    }

    /// The set's gauges for `/metrics`, each series labelled with the name of the model its
    /// executor runs, from `models`: (fingerprint, name) pairs, the default model first (the
    /// label of the set's own gauges).
    pub fn gauges(self: &Arc<Self>, models: Vec<(String, String)>) -> ExecutorGauges {
        ExecutorGauges { models, set: self.clone() }
    }
}

/// The gauges of the executors a scheduler drives, read from the live links at scrape time:
/// vLLM's per-executor running, waiting and KV usage, the sessions up, and the KV tier's size.
pub struct ExecutorGauges {
    /// (fingerprint, name) of each model, the default first.
    models: Vec<(String, String)>,
    set: Arc<ExecutorSet>,
}

impl ExecutorGauges {
    /// The name of the model with `fingerprint` (the default's if none has it).
    fn model_name(&self, fingerprint: &str) -> &str {
        let named = self.models.iter().find(|(f, _)| f == fingerprint);
        named.or(self.models.first()).map_or("", |(_, n)| n.as_str())
    }
}

impl Render for ExecutorGauges {
    fn render(&self, t: &mut Text) {
        type Pick = fn(&SchedulerStats) -> f64;
        let m = [("model_name", self.model_name(""))];
        let links = self.set.alive();
        let stats: Vec<(String, &str, SchedulerStats)> = links
            .iter()
            .map(|l| (l.name.to_string(), self.model_name(&l.info.model_fingerprint), l.stats()))
            .collect();
        let gauges: [(&str, &str, Pick); 4] = [
            ("vllm:num_requests_running", "Requests running on the executor.", |s| {
                s.num_running as f64
            }),
            ("vllm:num_requests_waiting", "Requests waiting to be admitted.", |s| {
                s.num_waiting as f64
            }),
            ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", |s| {
                s.kv_usage
            }),
            // vLLM's name for it before 0.10, which its published dashboard still reads.
            (
                "vllm:gpu_cache_usage_perc",
                "Fraction of KV cache blocks in use (1 = full); vLLM's older name.",
                |s| s.kv_usage,
            ),
        ];
        for (name, help, pick) in gauges {
            t.family(name, "gauge", help);
            for (exec, model, s) in &stats {
                t.sample(name, &[("model_name", model), ("executor", exec)], pick(s));
            }
        }
        render_lora_info(t, &links);
        let name = "ferry_executors_connected";
        t.family(name, "gauge", "Executor sessions up, by the model they run.");
        for (fingerprint, model) in &self.models {
            let up = links.iter().filter(|l| l.info.model_fingerprint == *fingerprint).count();
            t.sample(name, &[("model_name", model)], up as f64);
        }
        t.gauge(
            "ferry_kv_tier_indexed_blocks",
            "KV blocks the KV tier's index says the agents hold.",
            &m,
            self.set.tier.total() as f64,
        );
        if let Some(n) = self.set.agents.count() {
            t.gauge(
                "ferry_kv_agents_registered",
                "KV agents registered in etcd (transfers go only to these).",
                &m,
                n as f64,
            );
        }
    }
}

/// vLLM's `vllm:lora_requests_info`, one sample per executor that runs adapters: its
/// `max_lora`, the adapters it holds for its requests (`running_lora_adapters`) and those of
/// requests waiting to start (`waiting_lora_adapters`), comma-separated; the value is the
/// time of the scrape (vLLM's: of its last update), in seconds since the epoch.
fn render_lora_info(t: &mut Text, links: &[LinkHandle]) {
    let name = "vllm:lora_requests_info";
    let runs: Vec<&LinkHandle> = links.iter().filter(|l| l.runs_adapters()).collect();
    if runs.is_empty() {
        return;
    }
    t.family(name, "gauge", "Running stats on LoRA requests.");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let now = now.map_or(0.0, |d| d.as_secs_f64());
    for l in runs {
        let (running, waiting) = l.lora_view().requests_info();
        let (running, waiting) = (running.join(","), waiting.join(","));
        let max = l.info.max_loras.to_string();
        let labels = [
            ("executor", &*l.name),
            ("max_lora", max.as_str()),
            ("running_lora_adapters", running.as_str()),
            ("waiting_lora_adapters", waiting.as_str()),
        ];
        t.sample(name, &labels, now);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::link::fake::raw_session;
    use crate::link::tests::{spec, submit};
    use crate::link::LinkEvent;

    #[tokio::test(start_paused = true)]
    async fn a_step_refused_for_a_newer_epoch_deposes_the_set_before_its_requests_fail() {
        let set = ExecutorSet::new();
        set.lead(7);
        let (link, mut steps, results) = raw_session("e", 7, set.link_shared());
        set.insert(link.clone());
        let mut a = submit(&link, 1, spec(&[1, 2], 4)).await;
        let _ = steps.recv().await.unwrap();
        results.send(Err(ferry_proto::fencing::stale_epoch(7, 9))).await.unwrap();
        // The request hears Failed only after the set knows: its move does not wait here.
        let failed = a.recv().await;
        assert!(matches!(failed, Some(LinkEvent::Failed)), "{failed:?}");
        assert_eq!(set.fence.newest(), 9);
        assert_eq!(set.standing(), Standing::Deposed);
        assert!(set.wait_alive(Duration::from_secs(30)).await.is_empty());
        // Any other refusal ends the session but proves nothing about leadership.
        let other = ExecutorSet::new();
        let (link, mut steps, results) = raw_session("f", 0, other.link_shared());
        let mut b = submit(&link, 1, spec(&[1, 2], 4)).await;
        let _ = steps.recv().await.unwrap();
        results
            .send(Err(tonic::Status::failed_precondition("session 3 is not current")))
            .await
            .unwrap();
        assert!(matches!(b.recv().await, Some(LinkEvent::Failed)));
        assert_eq!(other.standing(), Standing::Serving(0));
    }
}
