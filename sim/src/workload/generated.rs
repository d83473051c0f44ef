//! A workload generated from a seed: arrivals, prompt and output lengths drawn from their
//! distributions, optionally shared prefixes or multi-turn conversations. The same seed makes
//! the same requests.

use super::conversation::{Conversations, Turn, CONVERSATION_GROUPS};
use super::distributions::{Arrivals, Lengths};
use super::rng::Rng;
use super::tokens::prompt_tokens;
use super::SimRequest;

/// Groups of requests that share a prefix: `groups` system prompts of `prefix_len` tokens,
/// each request in one of them (uniformly), its own tokens after the prefix.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixGroups {
    /// Distinct shared prefixes.
    pub groups: u32,
    /// Tokens of each.
    pub prefix_len: u32,
}

/// A generated workload.
#[derive(Debug, Clone)]
pub struct Generated {
    /// When requests arrive.
    pub arrivals: Arrivals,
    /// Prompt lengths (the whole prompt, prefix included).
    pub prompt: Lengths,
    /// Output lengths.
    pub output: Lengths,
    /// Shared prefixes, if any.
    pub prefixes: Option<PrefixGroups>,
    /// Multi-turn conversations, if any (then each request opens one).
    pub conversations: Option<Conversations>,
    /// Requests in all (conversations, with `conversations`).
    pub requests: u64,
    /// Token ids are drawn below this.
    pub vocab_size: u32,
}

/// The next request of `spec` after `made` of them, the last arriving at `clock` (both
/// advanced); `None` after the last.
pub(super) fn next_request(
    spec: &Generated,
    rng: &mut Rng,
    made: &mut u64,
    clock: &mut f64,
) -> Option<SimRequest> {
    if *made >= spec.requests {
        return None;
    }
    let index = *made;
    *made += 1;
    *clock += spec.arrivals.gap(rng);
    let len = spec.prompt.draw(rng);
    let output_len = spec.output.draw(rng);
    let (group, prefix_len) = match spec.prefixes {
        Some(p) if p.groups > 0 => {
            (Some(rng.range(0, u64::from(p.groups) - 1) as u32), p.prefix_len)
        }
        _ => (None, 0),
    };
    if let Some(c) = &spec.conversations {
        // The whole prompt is the conversation's; later turns extend it.
        let conversation = CONVERSATION_GROUPS | (index as u32 & !CONVERSATION_GROUPS);
        let turns = c.turns.draw(rng).max(1);
        let follow_ups = (1..turns)
            .map(|_| Turn {
                think: rng.exponential(c.think_time),
                user_len: c.user_len.draw(rng),
                output_len: spec.output.draw(rng),
            })
            .collect();
        let prompt = prompt_tokens(index, len, Some(conversation), len, spec.vocab_size);
        return Some(SimRequest {
            index,
            arrival: *clock,
            prompt,
            output_len,
            group: Some(conversation),
            conversation: Some(conversation),
            follow_ups,
        });
    }
    let prompt = prompt_tokens(index, len, group, prefix_len, spec.vocab_size);
    Some(SimRequest {
        index,
        arrival: *clock,
        prompt,
        output_len,
        group,
        conversation: None,
        follow_ups: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{shared_token, Source};

    #[test]
    fn the_same_seed_makes_the_same_requests_and_groups_share_prefixes() {
        let spec = Generated {
            arrivals: Arrivals::Poisson { rate: 10.0 },
            prompt: Lengths::Uniform(100, 200),
            output: Lengths::Fixed(8),
            prefixes: Some(PrefixGroups { groups: 3, prefix_len: 64 }),
            conversations: None,
            requests: 50,
            vocab_size: 1000,
        };
        let all = |seed| {
            let mut s = Source::generated(spec.clone(), seed);
            std::iter::from_fn(|| s.next_request().unwrap()).collect::<Vec<_>>()
        };
        let (a, b, c) = (all(1), all(1), all(2));
        assert_eq!(a.len(), 50);
        let key = |v: &[SimRequest]| {
            v.iter().map(|r| (r.arrival.to_bits(), r.prompt.clone(), r.group)).collect::<Vec<_>>()
        };
        assert_eq!(key(&a), key(&b));
        assert_ne!(key(&a), key(&c));
        assert!(a.windows(2).all(|w| w[0].arrival <= w[1].arrival));
        for x in &a {
            for y in &a {
                let same = x.prompt[..64] == y.prompt[..64];
                assert_eq!(same, x.group == y.group, "{} {}", x.index, y.index);
                if x.index != y.index {
                    assert_ne!(x.prompt[64..], y.prompt[64..]);
                }
            }
        }
    }

    #[test]
    fn a_later_turn_repeats_the_conversation_so_far() {
        let spec = Generated {
            arrivals: Arrivals::Poisson { rate: 1.0 },
            prompt: Lengths::Fixed(100),
            output: Lengths::Fixed(30),
            prefixes: None,
            conversations: Some(Conversations {
                turns: Lengths::Fixed(3),
                think_time: 2.0,
                user_len: Lengths::Fixed(10),
            }),
            requests: 2,
            vocab_size: 5000,
        };
        let mut source = Source::generated(spec, 9);
        let first = source.next_request().unwrap().unwrap();
        let other = source.next_request().unwrap().unwrap();
        assert_eq!(first.follow_ups.len(), 2);
        assert_ne!(first.conversation, other.conversation);
        let c = first.conversation.unwrap();
        let second = first.next_turn(77, 5.0, 5000).unwrap();
        assert_eq!(second.prompt.len(), 100 + 30 + 10);
        assert_eq!(second.prompt[..100], first.prompt[..], "the first prompt");
        // The answer as the simulator samples it: the conversation's tokens after the prompt.
        for p in 100..130 {
            assert_eq!(second.prompt[p], shared_token(c, p as u64, 5000));
        }
        let third = second.next_turn(78, 9.0, 5000).unwrap();
        assert_eq!(third.prompt[..140], second.prompt[..]);
        assert!(third.next_turn(79, 12.0, 5000).is_none(), "three turns");
    }
}
