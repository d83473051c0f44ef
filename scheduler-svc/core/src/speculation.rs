//! Draft proposals for speculative decoding, by prompt lookup (vLLM's `ngram` method).
//!
//! Why here: the scheduler must know a proposal's length before it budgets a step's tokens
//! and allocates the blocks the draft tokens will be written to, and it holds every token of
//! a request (prompt and output) once the request has no sample in flight, so the proposal
//! costs no round trip. A draft model would run on the executor instead (docs/ARCHITECTURE.md
//! says how it plugs into the same `Verify` work); this module is only one proposer.
//!
//! The rule: for n from `prompt_lookup_max` down to `prompt_lookup_min`, look for the last n
//! tokens of the sequence earlier in it; at the longest n that occurs, take its most recent
//! occurrence that is followed by `max_tokens` tokens (or, when none is, the earliest, which
//! is followed by the most), and propose the tokens that followed it, never past the end of
//! the sequence. No match: no proposal, and the request decodes as usual. (So a run of one
//! repeated token proposes a full draft of it, not the one token after its latest bigram.)
//!
//! Cost: O(sequence length × n) comparisons per lookup in the worst case, most rejected at
//! the first token; a 4 k-token sequence takes a few microseconds.

use crate::types::TokenId;

/// Append to `out` the draft tokens proposed for the sequence `head ++ tail` (prompt and
/// output, kept apart so no copy is made), at most `max_tokens`, looking up n-grams of
/// `max_n` down to `min_n` tokens (`min_n` ≥ 1). Returns how many were appended.
pub(crate) fn propose_ngram(
    head: &[TokenId],
    tail: &[TokenId],
    min_n: usize,
    max_n: usize,
    max_tokens: usize,
    out: &mut Vec<TokenId>,
) -> usize {
    debug_assert!(min_n >= 1, "an empty n-gram matches everywhere");
    let len = head.len() + tail.len();
    let at = |i: usize| if i < head.len() { head[i] } else { tail[i - head.len()] };
    if max_tokens == 0 {
        return 0;
    }
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = len - n;
        // Candidate starts: every earlier occurrence ends before the suffix's last token, so
        // at least one token follows it; most recent first, and an earlier one is followed by
        // more tokens than a later one.
        let mut found = None;
        for start in (0..suffix).rev() {
            if (0..n).rev().all(|j| at(start + j) == at(suffix + j)) {
                found = Some(start);
                if len - (start + n) >= max_tokens {
                    break;
                }
            }
        }
        if let Some(start) = found {
            let from = start + n;
            let to = (from + max_tokens).min(len);
            out.extend((from..to).map(at));
            return to - from;
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::propose_ngram;

    fn propose(seq: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        // Split anywhere: the answer must not depend on where the prompt ends.
        let split = seq.len() / 3;
        let n = propose_ngram(&seq[..split], &seq[split..], min_n, max_n, k, &mut out);
        assert_eq!(n, out.len());
        for split in 0..=seq.len() {
            let mut again = Vec::new();
            propose_ngram(&seq[..split], &seq[split..], min_n, max_n, k, &mut again);
            assert_eq!(again, out, "split at {split}");
        }
        out
    }

    #[test]
    fn proposes_what_followed_the_last_ngram() {
        // "1 2 3 4 5 ... 1 2 3" -> the tokens after the earlier "1 2 3".
        assert_eq!(propose(&[1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 2, 4, 3), vec![4, 5, 6]);
        assert_eq!(propose(&[1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 2, 4, 10), vec![4, 5, 6, 9, 1, 2, 3]);
    }

    #[test]
    fn prefers_the_longest_ngram_then_the_latest_occurrence() {
        // The bigram "2 3" occurs twice (followed by 7, then by 8); the trigram "1 2 3" only
        // before 7. Longest wins.
        assert_eq!(propose(&[1, 2, 3, 7, 0, 2, 3, 8, 1, 2, 3], 2, 3, 1), vec![7]);
        // With trigrams off, the latest bigram occurrence wins.
        assert_eq!(propose(&[1, 2, 3, 7, 0, 2, 3, 8, 1, 2, 3], 2, 2, 1), vec![8]);
        // ... unless it is too close to the end for a full draft: then the latest that has
        // room, else the earliest.
        assert_eq!(propose(&[1, 2, 3, 7, 0, 2, 3, 8, 1, 2, 3], 2, 2, 4), vec![8, 1, 2, 3]);
        assert_eq!(propose(&[1, 2, 3, 7, 0, 2, 3, 8, 1, 2, 3], 2, 2, 5), vec![7, 0, 2, 3, 8]);
        assert_eq!(propose(&[2, 3, 7, 2, 3, 8, 2, 3], 2, 2, 5), vec![7, 2, 3, 8, 2]);
        assert_eq!(propose(&[2, 3, 7, 2, 3, 8, 2, 3], 2, 2, 9), vec![7, 2, 3, 8, 2, 3]);
    }

    #[test]
    fn no_match_no_proposal() {
        assert!(propose(&[1, 2, 3, 4, 5], 2, 4, 4).is_empty());
        assert!(propose(&[5], 1, 4, 4).is_empty(), "a single token has nothing before it");
        assert!(propose(&[1, 2, 1, 2], 1, 4, 0).is_empty(), "zero drafts asked");
        // A unigram match needs min_n = 1.
        assert!(propose(&[1, 9, 2, 3, 1], 2, 4, 2).is_empty());
        assert_eq!(propose(&[1, 9, 2, 3, 1], 1, 4, 2), vec![9, 2]);
    }

    #[test]
    fn a_repeated_token_proposes_a_full_draft_of_itself() {
        // "7 7 7 7": the last bigram occurs at 0..2, followed by two 7s.
        assert_eq!(propose(&[7, 7, 7, 7], 2, 2, 4), vec![7, 7]);
        assert_eq!(propose(&[7, 7, 7, 7, 7, 7], 2, 2, 4), vec![7; 4]);
        assert_eq!(propose(&[7, 7, 7, 7, 7, 7], 2, 3, 4), vec![7, 7, 7]);
    }
}
