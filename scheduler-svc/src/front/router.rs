//! The router: which executor a request goes to (DESIGN.md §2). The longest cached prefix less
//! `--route-load-tokens` per live request, then the lightest load, then the first listed — the
//! policy itself is
//! [`ferry_sched_core::routing`], one pure function that the simulator runs too; this module
//! asks the live links for what it weighs (each core's prefix hit, each executor's load, role,
//! agent and room) and answers with a link.
//!
//! Prefill-only executors take a request only when no other is up; disaggregation
//! ([`super::disagg`]) asks here which executors can take part in a transfer.

use std::sync::Arc;

use ferry_proto::v1;
use ferry_sched_core::routing::{self, Candidate};

use crate::link::{LinkHandle, Reservation};
use crate::request::RequestSpec;
use crate::tier::LiveAgents;

pub(crate) use routing::import_tokens;

/// The executor for a sequence: the longest cached prefix less `load_tokens` per live request,
/// then the lightest load, then the first listed ([`routing::pick`]). Prefill-only executors
/// are used only when no other is up.
/// The pick comes with its [`Reservation`]: keep it until the request is added.
/// A request of `spec` with a LoRA adapter goes to an executor that runs adapters (any, when
/// none does: it refuses the request, saying why), preferring one that holds it; its prefix
/// hits are those under its salt ([`crate::link::shared_salt`]).
pub(crate) async fn pick(
    alive: &[LinkHandle],
    tokens: &[u32],
    spec: &RequestSpec,
    load_tokens: usize,
) -> Option<(LinkHandle, Reservation)> {
    let adapter = spec.lora.as_ref().map(|l| l.name.as_str());
    let mut alive = decoders(alive);
    if adapter.is_some() && alive.iter().any(LinkHandle::runs_adapters) {
        alive.retain(LinkHandle::runs_adapters);
    }
    let k = if alive.len() <= 1 {
        0
    } else {
        let salt = crate::link::shared_salt(spec);
        routing::pick(weigh(&alive, tokens, adapter, salt).await, load_tokens)?
    };
    alive.get(k).map(|l| (l.clone(), l.reserve()))
}

/// What [`pick`] weighs, and the candidate it picks: the number of executors it chooses among
/// and the chosen one's prefix hit and load (`None` when there is none). A front over several
/// shards asks each shard this (`Generation/Locate`) and picks among the answers, which is
/// [`pick`] over all their executors ([`routing::best`]).
pub(crate) async fn locate(
    alive: &[LinkHandle],
    tokens: &[u32],
    load_tokens: usize,
) -> (usize, Option<Candidate>) {
    let alive = &decoders(alive);
    (alive.len(), routing::best(weigh(alive, tokens, None, Some(0)).await, load_tokens))
}

/// The links a request may run on: those that decode, or every one when none does.
fn decoders(alive: &[LinkHandle]) -> Vec<LinkHandle> {
    let decoders: Vec<LinkHandle> = alive.iter().filter(|l| !prefill_only(l)).cloned().collect();
    if decoders.is_empty() {
        alive.to_vec()
    } else {
        decoders
    }
}

/// Each link's prefix hit for `tokens` under `salt` and its load, and whether it holds LoRA
/// adapter `adapter`.
async fn weigh(
    alive: &[LinkHandle],
    tokens: &[u32],
    adapter: Option<&str>,
    salt: Option<u64>,
) -> Vec<Candidate> {
    let tokens: Arc<[u32]> = tokens.into();
    let asks = alive.iter().map(|l| cached_prefix(l, tokens.clone(), salt));
    let hits = futures_util::future::join_all(asks).await;
    alive
        .iter()
        .zip(hits)
        .map(|(l, hit)| Candidate {
            holds_adapter: adapter.is_some_and(|a| l.holds_adapter(a)),
            prefix_hit_tokens: hit,
            load: l.routing_load(),
        })
        .collect()
}

/// Leading tokens of `tokens` `link`'s cache holds under prefix-cache `salt` (none for a
/// request that shares no blocks: `None`).
pub(crate) async fn cached_prefix(
    link: &LinkHandle,
    tokens: Arc<[u32]>,
    salt: Option<u64>,
) -> usize {
    match salt {
        Some(salt) => link.prefix_hit(tokens, salt).await,
        None => 0,
    }
}

/// Whether `link`'s executor only prefills (it never gets a request to decode).
pub(crate) fn prefill_only(link: &LinkHandle) -> bool {
    link.info.role() == v1::ExecutorRole::Prefill
}

/// Whether `link`'s executor has a KV agent that is up (registered in etcd, when the agents
/// are known): it can take part in transfers.
pub(crate) fn has_agent(link: &LinkHandle, agents: &LiveAgents) -> bool {
    !link.info.kv_agent_address.is_empty() && agents.is_live(&link.info.kv_agent_address)
}

/// Whether `link`'s KV pool has room now for a `prompt_len`-token prompt
/// ([`routing::has_room`]).
pub(crate) fn has_room(link: &LinkHandle, prompt_len: usize) -> bool {
    let (blocks, bs) = (link.info.num_blocks as usize, link.info.block_size as usize);
    routing::has_room(blocks, link.stats().kv_usage, bs, prompt_len)
}

#[cfg(test)]
mod tests {
    use super::{has_room, pick};
    use crate::link::fake::{fake_link, raw_link, test_config};
    use crate::metrics::SchedulerMetrics;
    use crate::request::RequestSpec;

    /// A burst: placements chosen before any of them is added see each other's choices, so
    /// they spread over the executors (without reservations all eight chose the first).
    #[tokio::test]
    async fn picks_not_yet_added_count_in_the_executors_load() {
        let metrics = crate::metrics::SchedulerMetrics::new();
        let links: Vec<_> = (0..4)
            .map(|i| fake_link(&format!("e{i}"), std::sync::Arc::new(|_, _| 5), metrics.clone()))
            .collect();
        let alive: Vec<_> = links.iter().map(|(l, _)| l.clone()).collect();
        let mut held = Vec::new();
        for i in 0..8u32 {
            held.push(
                pick(&alive, &[i, i + 1, i + 2], &RequestSpec::default(), 128).await.unwrap(),
            );
        }
        let mut chosen: Vec<&str> = held.iter().map(|(l, _)| l.name.as_ref()).collect();
        chosen.sort_unstable();
        assert_eq!(chosen, ["e0", "e0", "e1", "e1", "e2", "e2", "e3", "e3"]);
        assert!(alive.iter().all(|l| l.routing_load() == 2));
        drop(held);
        assert!(alive.iter().all(|l| l.routing_load() == 0), "a dropped pick is forgotten");
    }

    #[tokio::test]
    async fn a_decode_executor_needs_room_for_the_prompt_now() {
        let metrics = crate::metrics::SchedulerMetrics::new();
        let (link, _exec) = fake_link("d", std::sync::Arc::new(|_, _| 5), metrics);
        let cfg = test_config();
        let capacity = cfg.num_blocks * cfg.block_size;
        assert!(has_room(&link, capacity / 2));
        assert!(!has_room(&link, capacity), "one block more than the pool: no room");
    }

    #[tokio::test]
    async fn a_request_with_an_adapter_goes_where_the_adapter_is() {
        let (a, _a_steps, _a_results) = raw_link("a", SchedulerMetrics::new());
        let (b, _b_steps, _b_results) = raw_link("b", SchedulerMetrics::new());
        let links = [a.clone(), b.clone()];
        let name = |(l, _): (crate::link::LinkHandle, _)| l.name.to_string();
        let lora = Some(ferry_proto::v1::LoraAdapterRef { name: "x".into(), path: "x".into() });
        let (x, base) = (&RequestSpec { lora, ..Default::default() }, &RequestSpec::default());
        let held = [a.reserve(), a.reserve()];
        assert_eq!(pick(&links, &[1, 2], x, 16).await.map(name).unwrap(), "b", "load");
        drop(held);
        a.note_adapter(1, "x".into());
        let busy = [a.reserve(), a.reserve()];
        assert_eq!(pick(&links, &[1, 2], x, 16).await.map(name).unwrap(), "a", "held");
        assert_eq!(pick(&links, &[1, 2], base, 16).await.map(name).unwrap(), "b", "no adapter");
        // Two more adapters on a (its --max-loras is 2): x is dropped, as the executor drops it.
        a.note_adapter(2, "y".into());
        a.note_adapter(3, "z".into());
        assert!(!a.holds_adapter("x") && a.holds_adapter("y") && a.holds_adapter("z"));
        assert_eq!(pick(&links, &[1, 2], x, 16).await.map(name).unwrap(), "b");
        drop(busy);
    }
}
