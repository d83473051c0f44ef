//! Where a new request goes: the router's choice among executors, as a pure function of what
//! each one reports, so the front (over live links) and the simulator (over simulated
//! executors) decide exactly alike.
//!
//! Ferry's rule: for a request with a LoRA adapter, an executor that holds the adapter first
//! (the others would read it, and may drop one their running requests soon need); then the
//! executor whose cache holds the longest prefix of the request's tokens
//! (exact: the control plane owns every executor's block table, so this is a lookup, not a
//! guess from events), less `load_tokens` tokens for each live request it holds; among equals,
//! the one with the fewest live requests; among those, the first listed. The load term bounds
//! the imbalance a shared prefix may cause: with the prefix alone, every request that starts
//! with a popular system prompt goes to the one executor that computed it first, however busy,
//! while the others idle. With it, an executor that caches `h` more tokens of the prompt than
//! another takes new requests until it holds `h / load_tokens` more than that one; then the
//! other computes the prefix once, and both hold it. `load_tokens` 0 is the prefix alone; a
//! large one is least-load (with the prefix breaking ties).

/// What the router knows of one candidate executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Candidate {
    /// It holds the LoRA adapter the request runs with (always false for one without): it
    /// need not read the adapter, nor drop another to make room.
    pub holds_adapter: bool,
    /// Tokens of the request's prefix its cache holds now.
    pub prefix_hit_tokens: usize,
    /// Requests it holds (added and not finished).
    pub load: usize,
}

/// Tokens of cached prefix that one more live request outweighs, unless told otherwise
/// (`--route-load-tokens`): chosen in the simulator (README, "Benchmarks", `ferry-sim`), where
/// it keeps the hit rate of prefix-first routing in multi-turn chat and the latency of
/// least-load under one shared system prompt.
pub const LOAD_TOKENS: usize = 128;

impl Candidate {
    /// The router's order: greater is better (see the module's rule).
    fn rank(self, load_tokens: usize) -> (bool, i128, std::cmp::Reverse<usize>) {
        let penalty = self.load as i128 * load_tokens as i128;
        (self.holds_adapter, self.prefix_hit_tokens as i128 - penalty, std::cmp::Reverse(self.load))
    }
}

/// The index of the candidate Ferry's router picks (`None` if there are none): the longest
/// cached prefix less `load_tokens` per live request, then the lightest load, then the first.
pub fn pick(candidates: impl IntoIterator<Item = Candidate>, load_tokens: usize) -> Option<usize> {
    candidates
        .into_iter()
        .enumerate()
        .max_by_key(|&(k, c)| (c.rank(load_tokens), std::cmp::Reverse(k)))
        .map(|(k, _)| k)
}

/// The candidate [`pick`] picks, itself: what a group of executors (a scheduler shard) answers
/// for the group, so that a front choosing among groups by [`pick`] makes the choice [`pick`]
/// would make among all their executors (the order is a function of each candidate alone, so
/// the best of the bests is the best; among equals, the first group's first).
pub fn best(
    candidates: impl IntoIterator<Item = Candidate>,
    load_tokens: usize,
) -> Option<Candidate> {
    let candidates: Vec<Candidate> = candidates.into_iter().collect();
    pick(candidates.iter().copied(), load_tokens).map(|k| candidates[k])
}

/// How many of a `prompt_len`-token prompt's tokens an import covers on an executor with
/// `block_size`-token blocks: its whole blocks, short of the last token (the decode executor
/// computes at least that one, with the first output token, to go on sampling). 0: none.
pub fn import_tokens(prompt_len: usize, block_size: usize) -> usize {
    if block_size == 0 {
        return 0;
    }
    prompt_len.saturating_sub(1) / block_size * block_size
}

/// Whether a pool of `num_blocks` blocks, `kv_usage` of them held (cached free blocks count as
/// free), has room now for a `prompt_len`-token prompt: a decode executor without it would
/// hold the moved KV waiting, while the request could as well wait there whole.
pub fn has_room(num_blocks: usize, kv_usage: f64, block_size: usize, prompt_len: usize) -> bool {
    let free = (num_blocks as f64 * (1.0 - kv_usage)).floor();
    free >= (prompt_len / block_size.max(1) + 1) as f64
}

/// Whether a new request is worth disaggregating once its decode executor is chosen: the part
/// of its prompt that executor does not cache is at least `min_tokens` (prefilling a mostly
/// cached prompt where it decodes is cheaper than moving it), and whole blocks of it can move.
pub fn worth_disaggregating(
    prompt_len: usize,
    cached_on_decode: usize,
    min_tokens: usize,
    block_size: usize,
) -> bool {
    prompt_len - cached_on_decode.min(prompt_len) >= min_tokens
        && import_tokens(prompt_len, block_size) > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(prefix_hit_tokens: usize, load: usize) -> Candidate {
        Candidate { holds_adapter: false, prefix_hit_tokens, load }
    }

    #[test]
    fn the_longest_prefix_wins_then_the_lightest_load_then_the_first() {
        assert_eq!(pick([], 0), None);
        assert_eq!(pick([c(0, 5), c(32, 9), c(16, 0)], 0), Some(1));
        assert_eq!(pick([c(16, 5), c(16, 2), c(16, 2)], 0), Some(1));
        assert_eq!(pick([c(0, 0), c(0, 0)], 0), Some(0));
    }

    #[test]
    fn an_executor_holding_the_adapter_comes_before_prefix_and_load() {
        let holds =
            |prefix_hit_tokens, load| Candidate { holds_adapter: true, prefix_hit_tokens, load };
        assert_eq!(pick([c(1000, 0), holds(0, 9)], 32), Some(1), "before a cached prefix and load");
        assert_eq!(pick([holds(0, 3), holds(64, 3), c(64, 0)], 16), Some(1), "then the prefix");
        assert_eq!(pick([holds(0, 3), holds(0, 2)], 16), Some(1), "then the load");
    }

    #[test]
    fn a_cached_prefix_outweighs_load_up_to_load_tokens_per_request() {
        // 1,000 tokens cached on the first, none on the second: 31 more live requests are
        // worth less than the prefix at 32 tokens each, 32 more are not.
        assert_eq!(pick([c(1000, 31), c(0, 0)], 32), Some(0));
        assert_eq!(pick([c(1000, 32), c(0, 0)], 32), Some(1));
        assert_eq!(pick([c(1000, 40), c(1000, 39)], 32), Some(1), "both hold it: the lighter");
        assert_eq!(pick([c(16, 3), c(0, 2)], 16), Some(1), "a tie in rank: the lighter");
        assert_eq!(pick([c(0, 1), c(1000, 0)], usize::MAX), Some(1), "no overflow");
    }

    #[test]
    fn a_shared_prefix_spreads_over_every_executor_under_load() {
        // Requests that all start with one 1,000-token prefix, none finishing: the first
        // computes it on executor 0; each executor that takes one from then on caches it.
        let (execs, load_tokens) = (4, 32);
        let mut held = vec![c(0, 0); execs];
        for _ in 0..200 {
            let k = pick(held.iter().copied(), load_tokens).unwrap();
            held[k] = c(1000, held[k].load + 1);
        }
        let loads: Vec<usize> = held.iter().map(|h| h.load).collect();
        assert_eq!(loads, [50, 50, 50, 50], "every executor takes its share: {loads:?}");
        let prefix_only: Vec<usize> = {
            let mut held = vec![c(0, 0); execs];
            for _ in 0..200 {
                let k = pick(held.iter().copied(), 0).unwrap();
                held[k] = c(1000, held[k].load + 1);
            }
            held.iter().map(|h| h.load).collect()
        };
        assert_eq!(prefix_only, [200, 0, 0, 0], "the prefix alone piles every request on one");
    }

    proptest::proptest! {
        /// Choosing a shard by its best executor, then the executor within it, is choosing
        /// among all executors at once, whatever the load term.
        #[test]
        fn the_best_of_each_group_then_the_best_group_is_the_best_of_all(
            groups in proptest::collection::vec(
                proptest::collection::vec((0usize..4, 0usize..4), 1..5), 1..5),
            load_tokens in proptest::sample::select(vec![0usize, 1, 8, 16, 32, 1000]),
        ) {
            let cand = |&(p, l): &(usize, usize)| c(p * 16, l);
            let all: Vec<Candidate> = groups.iter().flatten().map(cand).collect();
            let bests: Vec<Candidate> = groups
                .iter()
                .map(|g| best(g.iter().map(cand), load_tokens).unwrap())
                .collect();
            let g = pick(bests.iter().copied(), load_tokens).unwrap();
            let within = pick(groups[g].iter().map(cand), load_tokens).unwrap();
            let flat = groups[..g].iter().map(Vec::len).sum::<usize>() + within;
            proptest::prop_assert_eq!(Some(flat), pick(all, load_tokens));
        }
    }

    #[test]
    fn imports_cover_whole_blocks_short_of_the_last_token() {
        assert_eq!(import_tokens(33, 16), 32);
        assert_eq!(import_tokens(32, 16), 16, "the last token is computed on the decode side");
        assert_eq!(import_tokens(16, 16), 0);
        assert_eq!(import_tokens(1000, 0), 0);
    }

    #[test]
    fn disaggregation_needs_room_and_enough_uncached_prompt() {
        // 80 blocks, 87.5 % held: 10 free, a 144-token prompt needs 144 / 16 + 1 = 10.
        assert!(has_room(80, 0.875, 16, 144));
        assert!(!has_room(80, 0.875, 16, 160));
        assert!(worth_disaggregating(1000, 700, 256, 16));
        assert!(!worth_disaggregating(1000, 800, 256, 16), "mostly cached where it decodes");
        assert!(!worth_disaggregating(16, 0, 1, 16), "no whole block to move");
    }
}
