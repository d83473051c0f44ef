//! The checks of a step's scheduled work: each request scheduled once, live or added by the
//! step, not left preempted, with a valid work key and a token count within its known tokens
//! (a decode computes one; a verification, its last token and each draft token); and the
//! step's declared token sum equal to its work's. What passes is the batch's plan.

use std::collections::HashSet;

use ferry_proto::v1;

use super::Prospect;
use crate::engine::looped::Stage;
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
        let stage = v1::WorkKey::try_from(wk.key).ok().and_then(|k| Stage::of(k, wk.loop_index));
        let first = step.work.first().and_then(|w| {
            v1::WorkKey::try_from(w.key).ok().and_then(|k| Stage::of(k, w.loop_index))
        });
        let (start, loops) = match stage {
            None if first.is_some() => {
                let reason = "a looped model's step runs one stage, and this work is none".into();
                return Err(StepError::Invalid { id: wk.id, reason });
            }
            None => (computed, 0),
            Some(stage) => stage_start(prospect, step, wk, stage, first, computed)
                .map_err(|reason| StepError::Invalid { id: wk.id, reason })?,
        };
        if let Some(reason) = work_fault(prospect, wk, start, total) {
            return Err(StepError::Invalid { id: wk.id, reason });
        }
        let n = wk.num_tokens as usize;
        let draft = if wk.key == v1::WorkKey::Verify as i32 {
            wk.draft_token_ids.clone()
        } else {
            Vec::new()
        };
        planned.push(Planned { id: wk.id, start, n, total, draft, stage, loops });
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

/// Where looped stage work `wk` starts, and its request's loops: its prelude at the request's computed tokens (it starts
/// a chain), its later stages at its chain's, which they must match — the chain's tokens, the
/// next loop (within the request's loops, while a token still loops), a coda after a loop.
/// Every work of the step runs the stage of the step's first (`first`), on a looped model, for
/// a looped request.
fn stage_start(
    prospect: &Prospect,
    step: &v1::Step,
    wk: &v1::ScheduledWork,
    stage: Stage,
    first: Option<Stage>,
    computed: usize,
) -> Result<(usize, u8), String> {
    if prospect.engine.config.looped.is_none() {
        return Err("stage work for a model that does not loop".into());
    }
    if first.map(Stage::kind) != Some(stage.kind()) {
        return Err(format!("a step runs one stage: {stage:?} after {first:?}"));
    }
    let live = prospect.engine.requests.get(&wk.id).filter(|_| prospect.live(wk.id));
    let max_loops = match live {
        Some(r) => r.looped.as_ref().map_or(0, |l| l.max_loops),
        None => step.new_requests.iter().find(|n| n.id == wk.id).map_or(0, |n| n.max_loops as u8),
    };
    if max_loops == 0 {
        return Err("stage work for a request that does not loop (max_loops 0)".into());
    }
    // A chain is gone once its request is preempted or resumed (in this step or before).
    let restarted = prospect.preempted.contains(&wk.id) || prospect.resumed.contains(&wk.id);
    let chain = live.and_then(|r| r.looped.as_ref()?.chain.as_ref()).filter(|_| !restarted);
    let n = wk.num_tokens as usize;
    let Some(chain) = chain.filter(|_| stage != Stage::Prelude) else {
        return match stage {
            Stage::Prelude => Ok((computed, max_loops)),
            _ => Err(format!("{stage:?} without a chain: its prelude comes first")),
        };
    };
    if n != chain.n {
        return Err(format!("{stage:?} of {n} tokens, its chain has {}", chain.n));
    }
    match stage {
        Stage::Recurrent(l) if l != chain.loops + 1 || l > max_loops => Err(format!(
            "loop {l} after {} of its chain, whose request runs at most {max_loops}",
            chain.loops
        )),
        Stage::Recurrent(_) if chain.all_exited() => {
            Err("a loop for a chain whose every token left the loop".into())
        }
        Stage::Coda if chain.loops == 0 => Err("a coda before any loop".into()),
        _ => Ok((chain.start, max_loops)),
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
