//! The KV tier's index (DESIGN.md §6): which blocks each node's KV agent holds, by hash, as
//! this scheduler wrote them there (an executor's `Store`, or a transfer that arrived). The
//! front looks up a new request's prompt in it and, when another node's agent (or its own)
//! holds a longer prefix than the executor's cache, the executor imports those blocks instead
//! of computing them.
//!
//! Kept per agent and KV layout (an agent stores blocks of several models or dtypes side by
//! side, under the same hashes). The index is a hint, not the truth: an agent evicts blocks by LRU, restarts empty, or dies,
//! and the index does not hear of it. That is safe — an import of a block that is gone fails
//! (`NOT_FOUND`) and the request computes its prompt as if it had never tried — and the
//! failure drops the agent's entries for those blocks. Kept per agent, bounded (oldest
//! forgotten first), and outliving the executors: an agent's blocks stay importable after its
//! executor died. A scheduler that starts leading learns what the agents hold from them
//! ([`recover`], when a session opens with an executor whose agent it knows nothing of), so
//! the index outlives a leader too.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;

use ferry_proto::v1;

/// Blocks remembered per agent; past it the oldest entries are forgotten.
pub const MAX_BLOCKS_PER_AGENT: usize = 1 << 18;

#[derive(Default)]
struct AgentBlocks {
    held: HashSet<u64>,
    order: VecDeque<u64>,
}

/// The KV agents registered in etcd now, by address without scheme (`host:port`, as executors
/// name their agent); unknown (every agent taken as live) without etcd or before the first
/// snapshot. An agent that is not registered is not read from or sent to.
#[derive(Default)]
pub struct LiveAgents {
    agents: std::sync::RwLock<Option<HashSet<String>>>,
}

impl LiveAgents {
    /// `address` without its scheme.
    pub fn normalize(address: &str) -> &str {
        address.split_once("://").map_or(address, |(_, rest)| rest).trim_end_matches('/')
    }

    /// Whether the agent at `address` may be used.
    pub fn is_live(&self, address: &str) -> bool {
        let agents = self.agents.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        agents.as_ref().is_none_or(|set| set.contains(Self::normalize(address)))
    }

    /// The registered agents are `addresses`, all of them.
    pub fn set(&self, addresses: impl IntoIterator<Item = String>) {
        let set = addresses.into_iter().map(|a| Self::normalize(&a).to_string()).collect();
        *self.agents.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(set);
    }

    /// How many are registered (`None`: unknown).
    pub fn count(&self) -> Option<usize> {
        self.agents
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(HashSet::len)
    }
}

/// A KV layout as the index tells layouts apart: its id (every field, the model's
/// fingerprint included; an agent stores blocks of several layouts side by side, under the
/// same hashes). 0 for none.
pub fn layout_key(layout: Option<&v1::KvLayout>) -> u64 {
    layout.map_or(0, v1::KvLayout::id)
}

/// What each agent holds, per layout, as far as this scheduler knows.
#[derive(Default)]
pub struct TierIndex {
    /// By (agent address, [`layout_key`]).
    agents: Mutex<HashMap<(String, u64), AgentBlocks>>,
}

impl TierIndex {
    fn agents(&self) -> std::sync::MutexGuard<'_, HashMap<(String, u64), AgentBlocks>> {
        self.agents.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `agent` now holds the blocks of `layout` named `hashes`.
    pub fn stored(&self, agent: &str, layout: u64, hashes: &[u64]) {
        if agent.is_empty() || hashes.is_empty() {
            return;
        }
        let mut agents = self.agents();
        let a = agents.entry((agent.to_string(), layout)).or_default();
        for &h in hashes {
            if a.held.insert(h) {
                a.order.push_back(h);
            }
        }
        while a.order.len() > MAX_BLOCKS_PER_AGENT {
            if let Some(old) = a.order.pop_front() {
                a.held.remove(&old);
            }
        }
    }

    /// `agent` no longer holds (some of) `hashes` of `layout`: forget them all.
    pub fn forget(&self, agent: &str, layout: u64, hashes: &[u64]) {
        let mut agents = self.agents();
        if let Some(a) = agents.get_mut(&(agent.to_string(), layout)) {
            for h in hashes {
                a.held.remove(h);
            }
            a.order.retain(|h| a.held.contains(h));
        }
    }

    /// Forgets everything `agent` held (it is gone: its store went with it).
    pub fn forget_agent(&self, agent: &str) {
        let agent = LiveAgents::normalize(agent);
        self.agents().retain(|(a, _), _| LiveAgents::normalize(a) != agent);
    }

    /// The agent among those `usable` holding the longest run of `hashes` (of `layout`) from
    /// the first, and its length in blocks; `prefer` wins ties (an executor's own agent is read
    /// without crossing nodes).
    pub fn longest_prefix(
        &self,
        hashes: &[u64],
        layout: u64,
        prefer: &str,
        usable: impl Fn(&str) -> bool,
    ) -> Option<(String, usize)> {
        let agents = self.agents();
        let mut best: Option<(&str, usize)> = None;
        for ((agent, l), a) in agents.iter() {
            if *l != layout || !usable(agent) {
                continue;
            }
            let n = hashes.iter().take_while(|h| a.held.contains(h)).count();
            let better = match best {
                None => n > 0,
                Some((b, m)) => n > m || (n == m && agent == prefer && b != prefer),
            };
            if better {
                best = Some((agent, n));
            }
        }
        best.map(|(a, n)| (a.to_string(), n))
    }

    /// Blocks remembered, over every agent and layout.
    pub fn total(&self) -> usize {
        self.agents().values().map(|a| a.held.len()).sum()
    }

    /// Blocks of `layout` remembered for `agent`.
    pub fn len(&self, agent: &str, layout: u64) -> usize {
        self.agents().get(&(agent.to_string(), layout)).map_or(0, |a| a.held.len())
    }
}

/// A client of the KV agent at `agent` (`host:port` or a URL), connected, for the scheduler's
/// calls: a transfer's cancel, the tier's recovery.
///
/// # Errors
/// The address unusable or the agent unreachable, as text.
pub(crate) async fn agent_client(
    agent: &str,
) -> Result<v1::kv_transfer_client::KvTransferClient<tonic::transport::Channel>, String> {
    let endpoint = ferry_runtime::tls::endpoint(agent).map_err(|e| e.to_string())?;
    let channel = ferry_runtime::tls::connect(&endpoint, ferry_runtime::tls::Role::KvAgent)
        .await
        .map_err(|e| ferry_runtime::error_chain(&e))?;
    Ok(v1::kv_transfer_client::KvTransferClient::new(channel))
}

/// Fills `index` with what `agent` holds in `layout` (keyed `key`, its [`layout_key`]), asking
/// the agent (`ListBlocks`): a new leader's index starts empty, but the agents' stores outlived
/// the old leader. Returns how many blocks it learned of.
///
/// # Errors
/// The agent unreachable or refusing, as text.
pub async fn recover(
    index: &TierIndex,
    agent: &str,
    (layout, key): (&v1::KvLayout, u64),
) -> Result<usize, String> {
    let mut client = agent_client(agent).await?.max_decoding_message_size(16 << 20);
    let request =
        v1::ListBlocksRequest { layout: Some(layout.clone()), limit: MAX_BLOCKS_PER_AGENT as u32 };
    let listed = client.list_blocks(request).await.map_err(|s| s.message().to_string())?;
    let hashes = listed.into_inner().block_hashes;
    index.stored(agent, key, &hashes);
    Ok(hashes.len())
}

#[cfg(test)]
mod tests {
    use super::TierIndex;

    #[test]
    fn the_longest_prefix_wins_and_the_own_agent_breaks_ties() {
        let index = TierIndex::default();
        index.stored("a:1", 1, &[1, 2, 3]);
        index.stored("b:1", 1, &[1, 2]);
        index.stored("c:1", 2, &[1, 2, 3, 4]);
        assert_eq!(
            index.longest_prefix(&[1, 2, 3, 4], 1, "b:1", |_| true),
            Some(("a:1".into(), 3))
        );
        assert_eq!(index.longest_prefix(&[1, 2, 9], 1, "b:1", |_| true), Some(("b:1".into(), 2)));
        assert_eq!(
            index.longest_prefix(&[1, 2, 3, 4], 2, "a:1", |_| true),
            Some(("c:1".into(), 4)),
            "another layout's blocks are another layout's"
        );
        assert_eq!(
            index.longest_prefix(&[9, 1, 2], 1, "a:1", |_| true),
            None,
            "a run starts at the first block"
        );
        index.forget("a:1", 1, &[2]);
        assert_eq!(index.longest_prefix(&[1, 2, 3], 1, "x", |_| true), Some(("b:1".into(), 2)));
        assert_eq!(index.len("a:1", 1), 2);
        assert_eq!(
            index.longest_prefix(&[1, 2, 3], 1, "x", |a| a != "b:1"),
            Some(("a:1".into(), 1))
        );
        index.forget_agent("http://a:1");
        assert_eq!(index.len("a:1", 1), 0, "a gone agent's blocks are forgotten");
    }

    #[test]
    fn agents_are_live_until_etcd_says_which_are() {
        let live = super::LiveAgents::default();
        assert!(live.is_live("10.0.0.1:7000"), "unknown: every agent is taken as live");
        live.set(["http://10.0.0.1:7000".to_string()]);
        assert!(live.is_live("10.0.0.1:7000"));
        assert!(live.is_live("http://10.0.0.1:7000/"));
        assert!(!live.is_live("10.0.0.2:7000"));
        assert_eq!(live.count(), Some(1));
    }
}
