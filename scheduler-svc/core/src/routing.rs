//! Where a new request goes: the router's choice among executors, as a pure function of what
//! each one reports, so the front (over live links) and the simulator (over simulated
//! executors) decide exactly alike.
//!
//! Ferry's rule: the executor whose cache holds the longest prefix of the request's tokens
//! (exact: the control plane owns every executor's block table, so this is a lookup, not a
//! guess from events); among equals, the one with the fewest live requests; among those, the
//! first listed.

/// What the router knows of one candidate executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Tokens of the request's prefix its cache holds now.
    pub prefix_hit_tokens: usize,
    /// Requests it holds (added and not finished).
    pub load: usize,
}

/// The index of the candidate Ferry's router picks (`None` if there are none): the longest
/// cached prefix, then the lightest load, then the first.
pub fn pick(candidates: impl IntoIterator<Item = Candidate>) -> Option<usize> {
    candidates
        .into_iter()
        .enumerate()
        .max_by_key(|(k, c)| {
            (c.prefix_hit_tokens, std::cmp::Reverse(c.load), std::cmp::Reverse(*k))
        })
        .map(|(k, _)| k)
}

/// The candidate [`pick`] picks, itself: what a group of executors (a scheduler shard) answers
/// for the group, so that a front choosing among groups by [`pick`] makes the choice [`pick`]
/// would make among all their executors (the order is lexicographic: the best of the bests is
/// the best; among equals, the first group's first).
pub fn best(candidates: impl IntoIterator<Item = Candidate>) -> Option<Candidate> {
    let candidates: Vec<Candidate> = candidates.into_iter().collect();
    pick(candidates.iter().copied()).map(|k| candidates[k])
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
        Candidate { prefix_hit_tokens, load }
    }

    #[test]
    fn the_longest_prefix_wins_then_the_lightest_load_then_the_first() {
        assert_eq!(pick([]), None);
        assert_eq!(pick([c(0, 5), c(32, 9), c(16, 0)]), Some(1));
        assert_eq!(pick([c(16, 5), c(16, 2), c(16, 2)]), Some(1));
        assert_eq!(pick([c(0, 0), c(0, 0)]), Some(0));
    }

    proptest::proptest! {
        /// Choosing a shard by its best executor, then the executor within it, is choosing
        /// among all executors at once.
        #[test]
        fn the_best_of_each_group_then_the_best_group_is_the_best_of_all(
            groups in proptest::collection::vec(
                proptest::collection::vec((0usize..4, 0usize..4), 1..5), 1..5)
        ) {
            let cand = |&(p, l): &(usize, usize)| c(p * 16, l);
            let all: Vec<Candidate> = groups.iter().flatten().map(cand).collect();
            let bests: Vec<Candidate> =
                groups.iter().map(|g| best(g.iter().map(cand)).unwrap()).collect();
            let g = pick(bests.iter().copied()).unwrap();
            let within = pick(groups[g].iter().map(cand)).unwrap();
            let flat = groups[..g].iter().map(Vec::len).sum::<usize>() + within;
            proptest::prop_assert_eq!(Some(flat), pick(all));
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
