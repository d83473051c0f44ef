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
}
