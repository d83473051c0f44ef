//! The checks of a step's scheduled work: each request scheduled once, live or added by the
//! step, not left preempted, with a valid work key and a token count within its known tokens
//! (a decode computes one; a verification, its last token and each draft token); and the
//! step's declared token sum equal to its work's. What passes is the batch's plan.

use std::collections::HashSet;

use ferry_proto::v1;

use super::Prospect;
use crate::engine::step::batch::Planned;
use crate::engine::step::StepError;

/// Most draft tokens one verification may carry (the scheduler's `MAX_SPECULATIVE_TOKENS`).
pub const MAX_DRAFT_TOKENS: usize = 16;

/// Each work item names a request once, a live one or one the step adds, and can run
/// ([`work_fault`]); the plan of each, in the step's order.
pub(super) fn scheduled_work(
    prospect: &Prospect,
    step: &v1::Step,
) -> Result<Vec<Planned>, StepError> {
    let requests = &prospect.engine.requests;
    let mut planned = Vec::with_capacity(step.work.len());
    let mut seen = HashSet::new();
    for wk in &step.work {
        if !seen.insert(wk.id) {
            return Err(StepError::Duplicate { id: wk.id, what: "is scheduled twice" });
        }
        let (total, computed) = match prospect.lengths.get(&wk.id) {
            Some(&l) => l,
            None if prospect.live(wk.id) => {
                let r = &requests[&wk.id];
                (r.len(), r.computed)
            }
            None => return Err(StepError::Unknown { id: wk.id, what: "in work" }),
        };
        if let Some(reason) = work_fault(prospect, wk, computed, total) {
            return Err(StepError::Invalid { id: wk.id, reason });
        }
        let n = wk.num_tokens as usize;
        let draft = if wk.key == v1::WorkKey::Verify as i32 {
            wk.draft_token_ids.clone()
        } else {
            Vec::new()
        };
        planned.push(Planned { id: wk.id, start: computed, n, total, draft });
    }
    Ok(planned)
}

/// Why work `wk` (from position `computed` of `total` known tokens) cannot run, if it cannot:
/// its request is preempted and not resumed, its key is not valid, it computes no tokens or
/// runs past the known ones, a decode computes other than one token, or a verification breaks
/// a rule of [`verify_fault`].
fn work_fault(
    prospect: &Prospect,
    wk: &v1::ScheduledWork,
    computed: usize,
    total: usize,
) -> Option<String> {
    let requests = &prospect.engine.requests;
    let is_preempted = prospect.preempted.contains(&wk.id)
        || (requests.get(&wk.id).is_some_and(|r| r.preempted)
            && !prospect.resumed.contains(&wk.id));
    let n = wk.num_tokens as usize;
    match v1::WorkKey::try_from(wk.key) {
        _ if is_preempted => Some("is preempted and was not resumed".to_string()),
        Ok(v1::WorkKey::Unspecified) | Err(_) => Some(format!("work key {} is not valid", wk.key)),
        Ok(v1::WorkKey::Verify) => {
            let constrained = match prospect.prepared.get(&wk.id) {
                Some(parts) => parts.grammar.is_some(),
                None => requests.get(&wk.id).is_some_and(|r| r.grammar.is_some()),
            };
            let vocab = prospect.facts.shape.vocab_size;
            verify_fault(wk, computed, total, vocab, prospect.max_len(), constrained)
        }
        _ if n == 0 => Some("num_tokens is 0".into()),
        _ if computed + n > total => {
            Some(format!("{n} tokens from position {computed} run past its {total} known tokens"))
        }
        Ok(v1::WorkKey::Decode) if n != 1 => Some(format!("a decode computes 1 token, not {n}")),
        _ => None,
    }
}

/// The step's `total_num_tokens` is the sum of its work's token counts.
pub(super) fn token_sum(step: &v1::Step, planned: &[Planned]) -> Result<(), StepError> {
    let sum: u64 = planned.iter().map(|p| p.n as u64).sum();
    if sum != u64::from(step.total_num_tokens) {
        return Err(StepError::TokenCount {
            declared: u64::from(step.total_num_tokens),
            actual: sum,
        });
    }
    Ok(())
}

/// Why verify work `wk` (from position `computed` of `total` known tokens) cannot run, if it
/// cannot: a verification computes the last known token and each draft token, within the
/// vocabulary and the model's length, and a structured output's grammar cannot check several
/// positions at once.
fn verify_fault(
    wk: &v1::ScheduledWork,
    computed: usize,
    total: usize,
    vocab: usize,
    max_len: usize,
    constrained: bool,
) -> Option<String> {
    let k = wk.draft_token_ids.len();
    let n = wk.num_tokens as usize;
    if k == 0 {
        return Some("a verify carries no draft tokens".into());
    }
    if k > MAX_DRAFT_TOKENS {
        return Some(format!("a verify carries {k} draft tokens, at most {MAX_DRAFT_TOKENS}"));
    }
    if n != k + 1 {
        return Some(format!(
            "a verify of {k} draft tokens computes {} tokens (its last token and each draft \
             token), not {n}",
            k + 1
        ));
    }
    if computed + 1 != total {
        return Some(format!(
            "a verify starts at its last known token (position {}), not at {computed}",
            total.saturating_sub(1)
        ));
    }
    if total + k > max_len {
        return Some(format!(
            "{total} tokens and {k} draft tokens run past the model's maximum length {max_len}"
        ));
    }
    if let Some(t) = wk.draft_token_ids.iter().find(|t| **t as usize >= vocab) {
        return Some(format!("draft token id {t} is outside the vocabulary (size {vocab})"));
    }
    if constrained {
        return Some(
            "a structured output cannot verify draft tokens (its grammar checks one \
                     token at a time)"
                .into(),
        );
    }
    None
}
