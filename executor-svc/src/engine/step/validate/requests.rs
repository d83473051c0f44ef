//! The checks of the requests a step names: its preempted ids are live, its new requests are
//! new and within the executor's limit with usable data (prompt, length, token ids, blocks,
//! sampling parameters, grammar), and its updates name live requests once each. Each check
//! records what the step makes of the requests ([`Prospect`]) for the checks after it.

use std::collections::HashSet;

use ferry_proto::v1;

use super::{NewParts, Prospect};
use crate::engine::grammar;
use crate::engine::sampling::{LogitAdjust, SamplingParams};
use crate::engine::step::StepError;

/// Every id in `preempted_ids` is a live request; the set of them.
pub(super) fn preempted_ids(
    prospect: &Prospect,
    step: &v1::Step,
) -> Result<HashSet<u64>, StepError> {
    let mut preempted = HashSet::new();
    for id in &step.preempted_ids {
        if !prospect.live(*id) {
            return Err(StepError::Unknown { id: *id, what: "in preempted_ids" });
        }
        preempted.insert(*id);
    }
    Ok(preempted)
}

/// Each new request has an id not yet live, fits under `--max-live-requests`, and has usable
/// data ([`new_request_tokens`]) and sampling parts ([`new_request_sampling`]); records its
/// table, its length and its prepared parts.
pub(super) fn new_requests(prospect: &mut Prospect, step: &v1::Step) -> Result<(), StepError> {
    let engine = prospect.engine;
    let limit = engine.config.max_live_requests;
    // Requests live once the step's finished ones go (counted only when the limit is near).
    let live_before = if engine.requests.len() + step.new_requests.len() > limit {
        engine.requests.len()
            - prospect.finished.iter().filter(|id| engine.requests.contains_key(id)).count()
    } else {
        0
    };
    for (num_live, nr) in (live_before..).zip(&step.new_requests) {
        if prospect.live(nr.id) || prospect.lengths.contains_key(&nr.id) {
            return Err(StepError::Duplicate { id: nr.id, what: "is already a live request" });
        }
        if num_live >= limit {
            return Err(StepError::Invalid {
                id: nr.id,
                reason: format!(
                    "the executor holds {num_live} requests, its limit (--max-live-requests)"
                ),
            });
        }
        let len = new_request_tokens(prospect, nr)?;
        let parts = new_request_sampling(prospect, nr)?;
        prospect.prepared.insert(nr.id, parts);
        prospect.tables.insert(nr.id, nr.block_ids.clone());
        prospect.lengths.insert(nr.id, (len, nr.num_computed_tokens as usize));
    }
    Ok(())
}

/// New request `nr`'s tokens and blocks: a prompt, within the model's length, a table no
/// longer than it can need, token ids in the vocabulary, no more computed tokens than it has,
/// blocks in the pool. Its length (prompt and output tokens).
fn new_request_tokens(prospect: &Prospect, nr: &v1::NewRequest) -> Result<usize, StepError> {
    let (max_len, vocab_size) = (prospect.max_len(), prospect.facts.shape.vocab_size);
    if nr.prompt_token_ids.is_empty() {
        return Err(StepError::Invalid { id: nr.id, reason: "empty prompt".into() });
    }
    let len = nr.prompt_token_ids.len() + nr.output_token_ids.len();
    if len > max_len {
        return Err(StepError::Invalid {
            id: nr.id,
            reason: format!("{len} tokens; the model's maximum length is {max_len}"),
        });
    }
    prospect.table_fits(nr.id, nr.block_ids.len())?;
    if let Some(t) =
        nr.prompt_token_ids.iter().chain(&nr.output_token_ids).find(|t| **t as usize >= vocab_size)
    {
        return Err(StepError::Invalid {
            id: nr.id,
            reason: format!("token id {t} is outside the vocabulary (size {vocab_size})"),
        });
    }
    if nr.num_computed_tokens as usize > len {
        return Err(StepError::Invalid {
            id: nr.id,
            reason: format!(
                "num_computed_tokens {} exceeds its {len} tokens",
                nr.num_computed_tokens
            ),
        });
    }
    prospect.blocks_in_pool(nr.id, &nr.block_ids)?;
    Ok(len)
}

/// New request `nr`'s sampling: parameters in range, logit adjustments within the vocabulary,
/// prompt log-probabilities only from a backend that computes logits, and its structured
/// output's grammar compiled (its earlier output replayed). The parts, read once.
fn new_request_sampling(prospect: &Prospect, nr: &v1::NewRequest) -> Result<NewParts, StepError> {
    let engine = prospect.engine;
    let no_sampling = v1::SamplingParams::default();
    let proto = nr.sampling.as_ref().unwrap_or(&no_sampling);
    let sampling = SamplingParams::from_proto(proto, nr.id);
    sampling.validate().map_err(|source| StepError::Sampling { id: nr.id, source })?;
    let adjust = LogitAdjust::from_proto(proto);
    adjust
        .validate(prospect.facts.shape.vocab_size)
        .map_err(|source| StepError::Sampling { id: nr.id, source })?;
    if proto.prompt_logprobs.is_some() && !engine.backend.computes_logits() {
        return Err(StepError::Invalid {
            id: nr.id,
            reason: "prompt_logprobs need the model's logits, and this executor (a simulated \
                     one) computes none"
                .into(),
        });
    }
    looped_request(prospect, nr, proto)?;
    let grammar = match &proto.structured_output {
        Some(constraint) => Some(
            grammar::compile(&engine.grammars, constraint, &nr.output_token_ids)
                .map_err(|reason| StepError::Invalid { id: nr.id, reason })?,
        ),
        None => None,
    };
    Ok(NewParts { sampling, adjust, grammar })
}

/// A looped model's request states its loops (1 to the model's), an exit threshold in (0, 1]
/// if any, and no structured output (its sampling runs in the coda without a grammar's mask);
/// a plain model's states none.
fn looped_request(
    prospect: &Prospect,
    nr: &v1::NewRequest,
    proto: &v1::SamplingParams,
) -> Result<(), StepError> {
    let bad = |reason: String| Err(StepError::Invalid { id: nr.id, reason });
    let Some(shape) = prospect.engine.config.looped else {
        if nr.max_loops > 0 || proto.max_loops.is_some() || proto.exit_threshold.is_some() {
            return bad("max_loops or exit_threshold for a model that does not loop".into());
        }
        return Ok(());
    };
    if nr.max_loops == 0 || nr.max_loops > u32::from(shape.max_loops) {
        return bad(format!("max_loops must be 1..={}, got {}", shape.max_loops, nr.max_loops));
    }
    if let Some(t) = proto.exit_threshold.filter(|t| !(*t > 0.0 && *t <= 1.0)) {
        return bad(format!("exit_threshold must be in (0, 1], got {t}"));
    }
    if proto.structured_output.is_some() {
        return bad("structured outputs are not supported on a looped model".into());
    }
    Ok(())
}

/// Each update names a live request not added or updated already in this step, with blocks in
/// the pool, a table no longer than it can need, and (resumed) no more computed tokens than it
/// has; records its table and its length, and whether it resumes.
pub(super) fn updated_requests(prospect: &mut Prospect, step: &v1::Step) -> Result<(), StepError> {
    for cu in &step.cached_requests {
        if !prospect.live(cu.id) {
            return Err(StepError::Unknown { id: cu.id, what: "in cached_requests" });
        }
        if prospect.tables.contains_key(&cu.id) {
            return Err(StepError::Duplicate { id: cu.id, what: "is updated twice" });
        }
        let r = &prospect.engine.requests[&cu.id];
        prospect.blocks_in_pool(cu.id, &cu.new_block_ids)?;
        let table = if cu.resumed {
            prospect.resumed.insert(cu.id);
            cu.new_block_ids.clone()
        } else {
            let mut t = r.table.clone();
            t.extend_from_slice(&cu.new_block_ids);
            t
        };
        prospect.table_fits(cu.id, table.len())?;
        // Only a resume sets the computed count (a recompute restarts lower).
        let computed = if cu.resumed { cu.num_computed_tokens as usize } else { r.computed };
        if computed > r.len() {
            return Err(StepError::Invalid {
                id: cu.id,
                reason: format!(
                    "num_computed_tokens {} exceeds its {} tokens",
                    cu.num_computed_tokens,
                    r.len()
                ),
            });
        }
        prospect.tables.insert(cu.id, table);
        prospect.lengths.insert(cu.id, (r.len(), computed));
    }
    Ok(())
}
