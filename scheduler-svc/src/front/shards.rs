//! The scheduler shards a front in its own process sends requests to, and the choice among
//! them (DESIGN.md §2, §7).
//!
//! Each shard is a scheduler pool with its own leader and standbys, driving the executors the
//! shards' assignment gives it (`ferry_sched_core::shards`). A front follows every pool up in
//! its cluster (or those `--pool` names), each pool's leader as [`Leader`] does. A request goes
//! to one shard: with one leader known, that one; with several, each leader is asked where the
//! prompt would run there (`Generation/Locate`: its router's pick, with the pick's cached
//! prefix and load) and the request goes to the best answer by the router's own rule — the
//! longest cached prefix less a load term, then the lightest load (counting the requests this
//! front is sending there and the shard has not answered for yet), then the first pool by
//! name — which is the
//! choice one router over every shard's executors would make ([`routing::best`]). A leader that
//! does not answer in [`LOCATE_TIMEOUT`] is passed over. A stream whose shard fails is placed
//! again the same way (its shard's standby usually leads by then), so a shard's failure moves
//! only that shard's streams.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ferry_proto::v1::{self, generation_client::GenerationClient};
use ferry_runtime::cluster::{ClusterArgs, MembershipEvent};
use ferry_sched_core::routing::{self, Candidate};

use super::remote::Leader;

/// How long a shard's leader has to say where a prompt would run.
pub const LOCATE_TIMEOUT: Duration = Duration::from_millis(500);

/// The shards a front sends requests to.
pub struct Shards {
    cluster: ClusterArgs,
    /// Each pool followed, by name.
    leaders: Mutex<BTreeMap<String, Arc<Shard>>>,
}

/// A pool followed: its leader, and the requests this front is sending it now.
struct Shard {
    leader: Arc<Leader>,
    /// Requests chosen for this shard whose submission has not returned: the shard's answers
    /// do not count them yet, so a burst of requests asked at once would otherwise all go to
    /// the shard that answered best before any of them landed.
    placing: AtomicUsize,
}

/// A request on its way to a shard: counted in the shard's load until dropped (once the
/// shard has taken it, or refused it).
pub struct Placing {
    shard: Arc<Shard>,
}

impl Placing {
    /// The shard's leader.
    pub fn leader(&self) -> &Leader {
        &self.shard.leader
    }
}

impl Drop for Placing {
    fn drop(&mut self) {
        self.shard.placing.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Shards {
    /// Follows the leaders of `pools`, or, when empty, of every pool that comes up in
    /// `cluster` (a watch on the pools' elections).
    pub fn follow(cluster: ClusterArgs, pools: Vec<String>) -> Arc<Self> {
        let this = Arc::new(Shards { cluster, leaders: Mutex::default() });
        if pools.is_empty() {
            tokio::spawn(discover(Arc::downgrade(&this)));
        } else {
            for pool in pools {
                this.add(pool);
            }
        }
        this
    }

    /// Starts following `pool` (once).
    fn add(&self, pool: String) {
        let mut leaders = self.leaders.lock().unwrap_or_else(PoisonError::into_inner);
        if let std::collections::btree_map::Entry::Vacant(e) = leaders.entry(pool) {
            tracing::info!(pool = %e.key(), "following a scheduler pool");
            let leader = Leader::follow(self.cluster.clone(), e.key().clone());
            e.insert(Arc::new(Shard { leader, placing: AtomicUsize::new(0) }));
        }
    }

    /// The pools whose leader is known now, by name.
    fn led(&self) -> Vec<Arc<Shard>> {
        let leaders = self.leaders.lock().unwrap_or_else(PoisonError::into_inner);
        leaders.values().filter(|s| s.leader.current().is_some()).cloned().collect()
    }

    /// Each pool followed and its leader's address, if one is known.
    pub fn leaders(&self) -> Vec<(String, Option<String>)> {
        let leaders = self.leaders.lock().unwrap_or_else(PoisonError::into_inner);
        leaders.iter().map(|(pool, s)| (pool.clone(), s.leader.current())).collect()
    }

    /// Whether some pool's leader is known now.
    pub fn any_led(&self) -> bool {
        !self.led().is_empty()
    }

    /// The shard a request of `prompt` and `delivered` tokens (for the model with
    /// `fingerprint`) goes to: the only one, or the best answer to `Locate` counting the
    /// requests this front is sending each, weighed with `load_tokens` as the leaders weigh
    /// their executors ([`routing::pick`]; the first led pool when none answers).
    pub async fn choose(
        &self,
        (prompt, delivered): (&[u32], &[u32]),
        fingerprint: &str,
        load_tokens: usize,
    ) -> Option<Placing> {
        let led = self.led();
        let placing = |shard: &Arc<Shard>| {
            shard.placing.fetch_add(1, Ordering::Relaxed);
            Placing { shard: shard.clone() }
        };
        if led.len() <= 1 {
            return led.first().map(placing);
        }
        let ask = v1::LocateRequest {
            token_ids: [prompt, delivered].concat(),
            model_fingerprint: fingerprint.to_string(),
        };
        let asks = led.iter().map(|s| locate(&s.leader, ask.clone()));
        let answers = futures_util::future::join_all(asks).await;
        let candidates: Vec<(usize, Candidate)> = answers
            .into_iter()
            .enumerate()
            .filter_map(|(k, a)| Some((k, a.filter(|a| a.executors > 0)?)))
            .map(|(k, a)| {
                let c = Candidate {
                    holds_adapter: false,
                    prefix_hit_tokens: a.prefix_hit_tokens as usize,
                    load: a.load as usize + led[k].placing.load(Ordering::Relaxed),
                };
                (k, c)
            })
            .collect();
        let k = routing::pick(candidates.iter().map(|(_, c)| *c), load_tokens)
            .map_or(0, |i| candidates[i].0);
        Some(placing(&led[k]))
    }
}

/// Asks `leader` where `ask`'s prompt would run there; `None` if it does not answer in time.
async fn locate(leader: &Leader, ask: v1::LocateRequest) -> Option<v1::LocateResponse> {
    let address = leader.current()?;
    let mut client = GenerationClient::new(leader.channel(&address).ok()?);
    let answer = tokio::time::timeout(LOCATE_TIMEOUT, client.locate(ask)).await;
    match answer {
        Ok(Ok(r)) => Some(r.into_inner()),
        Ok(Err(status)) => {
            tracing::debug!(leader = %address, %status, "a shard did not locate a prompt");
            None
        }
        Err(_) => None,
    }
}

/// Follows every pool that has a candidate in its election, for as long as the shards live.
async fn discover(shards: std::sync::Weak<Shards>) {
    let Some(cluster) = shards.upgrade().map(|s| s.cluster.clone()) else { return };
    let client = cluster.client_patiently().await;
    let mut events = ferry_runtime::cluster::watch_members(client, cluster.schedulers_prefix());
    while let Some(ev) = events.recv().await {
        let Some(shards) = shards.upgrade() else { return };
        let keys = match ev {
            MembershipEvent::Snapshot(list) => list.into_iter().map(|(k, _)| k).collect(),
            MembershipEvent::Put(k, _) => vec![k],
            MembershipEvent::Delete(_) => Vec::new(),
        };
        for key in keys {
            if let Some(pool) = ferry_runtime::cluster::candidate_pool(&key) {
                shards.add(pool.to_string());
            }
        }
    }
}
