//! Speculative decoding in the core: `Verify` work proposed by n-gram lookup, budgeted,
//! applied with the accepted drafts, and rolled back on rejection; outputs equal plain
//! decoding's whatever is accepted.

use std::collections::HashMap;

use crate::common::{req, small_cfg, Harness};
use ferry_sched_core::*;

fn spec_cfg(k: usize) -> SchedulerConfig {
    SchedulerConfig { speculative: Some(SpeculativeConfig::ngram(k)), ..small_cfg() }
}

/// A request that may speculate, with a prompt that repeats "1 2 3 4 5 6 7 8".
fn repeating(id: u64, max_tokens: usize) -> NewRequest {
    let prompt: Vec<u32> = (0..24).map(|i| 1 + i % 8).collect();
    let mut r = req(id, prompt, max_tokens);
    r.speculate = true;
    r
}

/// The executor's answer: at output position p the model "says" `model(id, p)`; a
/// verification returns the drafts that match it and the token after them, as a model
/// verifying them would (one token for other sampling work).
fn answer(h: &Harness, plan: &StepPlan, model: &dyn Fn(RequestId, usize) -> u32) -> StepOutcome {
    let mut outcome = StepOutcome { step_id: plan.step_id, ..StepOutcome::default() };
    for w in plan.scheduled.iter().filter(|w| w.samples_token) {
        let pos = h.core.request_view(w.id).map_or(0, |v| v.num_output_tokens);
        let draft = plan.draft_of(w);
        for j in 0..=draft.len() {
            let token = model(w.id, pos + j);
            outcome.sampled.push(SampledToken { id: w.id, token });
            if draft.get(j) != Some(&token) {
                break;
            }
        }
    }
    outcome
}

/// The prompts' cycle "1 2 ... 8", continued.
fn cycle(_: RequestId, p: usize) -> u32 {
    1 + (p as u32) % 8
}

/// Run `reqs` to the end under `cfg`; every request's tokens, the steps taken, the final stats.
fn run(
    cfg: SchedulerConfig,
    reqs: &[NewRequest],
    model: &dyn Fn(RequestId, usize) -> u32,
) -> (HashMap<RequestId, Vec<u32>>, usize, SchedulerStats) {
    let mut h = Harness::new(cfg);
    for r in reqs {
        h.add(r.clone());
    }
    let mut out: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut steps = 0;
    while !h.core.is_drained() {
        steps += 1;
        assert!(steps < 1000, "not drained");
        let plan = h.schedule();
        let outcome = answer(&h, &plan, model);
        for e in h.apply(&outcome) {
            if let RequestEvent::Token { id, token, index, .. } = e {
                let v = out.entry(id).or_default();
                assert_eq!(index, v.len());
                v.push(token);
            }
        }
    }
    h.core.check_drained().unwrap();
    (out, steps, h.core.stats())
}

/// Echoes the prompt's cycle (what n-gram drafts guess), except every 7th position.
fn echo(_: RequestId, p: usize) -> u32 {
    if p % 7 == 6 {
        30
    } else {
        1 + (p as u32) % 8
    }
}

#[test]
fn speculation_changes_no_token_and_takes_fewer_steps() {
    let reqs: Vec<_> = (1..=4).map(|id| repeating(id, 40)).collect();
    let (plain, plain_steps, plain_stats) = run(small_cfg(), &reqs, &echo);
    let (spec, spec_steps, stats) = run(spec_cfg(4), &reqs, &echo);
    assert_eq!(spec, plain, "outputs must not depend on speculation");
    assert!(plain.values().all(|t| t.len() == 40));
    assert_eq!(plain_stats.spec_drafts, 0);
    assert!(stats.spec_drafts > 0 && stats.spec_accepted_tokens > 0, "{stats:?}");
    assert!(
        stats.spec_accepted_tokens < stats.spec_draft_tokens,
        "every 7th token differs from the draft: some drafts must be rejected ({stats:?})"
    );
    // (Drafts that run into the 7th token are cut short and back off: about 30 % fewer.)
    assert!(spec_steps * 4 < plain_steps * 3, "{spec_steps} steps vs {plain_steps} without");
    let per_pos = stats.spec_accepted_per_position;
    assert_eq!(per_pos[0] + per_pos[1] + per_pos[2] + per_pos[3], stats.spec_accepted_tokens);
    assert!(per_pos[0] >= per_pos[1] && per_pos[1] >= per_pos[2], "{per_pos:?}");
    assert_eq!(per_pos[4..].iter().sum::<u64>(), 0, "no position past num_speculative_tokens");
    assert_eq!(stats.generation_tokens, plain_stats.generation_tokens);
}

#[test]
fn a_request_that_may_not_speculate_decodes() {
    let mut r = repeating(1, 20);
    r.speculate = false;
    let (_, _, stats) = run(spec_cfg(4), &[r], &echo);
    assert_eq!(stats.spec_drafts, 0);
}

#[test]
fn a_verify_computes_its_last_token_and_the_draft_and_rejection_gives_the_slots_back() {
    let mut h = Harness::new(spec_cfg(4));
    h.add(repeating(1, 40));
    let (plan, _) = h.step(1); // prompt 1..8 x3, then "1"
    assert_eq!(plan.scheduled[0].work, WorkKey::PromptChunk);
    let plan = h.schedule();
    let w = plan.scheduled[0];
    assert_eq!(w.work, WorkKey::Verify);
    assert_eq!(plan.draft_of(&w), [2, 3, 4, 5], "what followed \"8 1\" earlier");
    assert_eq!(w.num_tokens, 5, "the last token and four drafts");
    assert!(w.samples_token);
    let v = h.core.request_view(RequestId(1)).unwrap();
    assert_eq!(v.num_computed_tokens, 24 + 1 + 4);
    assert_eq!(v.blocks_held, 8, "blocks for 29 positions of 4");
    // Two drafts accepted, then 9 instead of 4.
    let sampled = [2, 3, 9].map(|token| SampledToken { id: RequestId(1), token }).to_vec();
    let events = h.apply(&StepOutcome { step_id: plan.step_id, sampled, ..Default::default() });
    let tokens: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            RequestEvent::Token { token, index, .. } => Some((*index, *token)),
            _ => None,
        })
        .collect();
    assert_eq!(tokens, [(1, 2), (2, 3), (3, 9)]);
    let v = h.core.request_view(RequestId(1)).unwrap();
    assert_eq!(v.num_output_tokens, 4);
    assert_eq!(v.num_computed_tokens, 24 + 3, "all known tokens but the last: 2 slots free");
    assert_eq!(v.blocks_held, 8, "the blocks stay; the next tokens are written to them");
    let s = h.core.stats();
    assert_eq!((s.spec_drafts, s.spec_draft_tokens, s.spec_accepted_tokens), (1, 4, 2));
    assert_eq!(s.spec_accepted_per_position[..3], [1, 1, 0]);
}

#[test]
fn a_result_with_more_tokens_than_the_draft_allows_changes_nothing() {
    let mut h = Harness::new(spec_cfg(2));
    h.add(repeating(1, 40));
    h.step(1);
    let plan = h.schedule();
    assert_eq!(plan.scheduled[0].work, WorkKey::Verify);
    assert_eq!(plan.draft_of(&plan.scheduled[0]).len(), 2);
    let too_many: Vec<_> =
        [2, 3, 4, 5].map(|token| SampledToken { id: RequestId(1), token }).to_vec();
    let bad = StepOutcome { step_id: plan.step_id, sampled: too_many, ..Default::default() };
    let mut events = Vec::new();
    let err = h.core.apply_result(&bad, Timestamp(h.now), &mut events).unwrap_err();
    assert_eq!(
        err,
        ApplyError::TooManyTokens { step: plan.step_id, id: RequestId(1), got: 4, most: 3 }
    );
    assert!(events.is_empty());
    h.core.check_invariants().unwrap();
    let ok = answer(&h, &plan, &cycle);
    assert_eq!(ok.sampled.len(), 3, "both drafts accepted, and the token after them");
    h.apply(&ok);
    assert_eq!(h.core.request_view(RequestId(1)).unwrap().num_output_tokens, 4);
}

#[test]
fn a_draft_stops_at_the_end_of_the_sequence_and_the_budget_cuts_it() {
    // "1 2 3 1 2 3 | 1": the 4-gram "1 2 3 1" occurred at the start, followed by "2 3 1" only.
    let cfg = SchedulerConfig { max_num_batched_tokens: 6, ..spec_cfg(4) };
    let mut h = Harness::new(cfg.clone());
    let mut r = repeating(1, 40);
    r.prompt = (0..6).map(|i| 1 + i % 3).collect::<Vec<u32>>().into();
    h.add(r);
    h.step(1);
    let plan = h.schedule();
    let w = plan.scheduled[0];
    assert_eq!((w.work, w.num_tokens), (WorkKey::Verify, 4));
    assert_eq!(plan.draft_of(&w), [2, 3, 1]);
    h.apply(&answer(&h, &plan, &|_, _| 9)); // nothing accepted

    // Two requests with four-token drafts share a budget of 6: the first verifies its whole
    // draft (5 tokens), the second is cut to its last token, a decode.
    let mut h = Harness::new(cfg);
    for id in [1, 2] {
        h.add(repeating(id, 40));
    }
    let mut shared = false;
    for _ in 0..40 {
        let plan = h.schedule();
        assert!(plan.total_tokens <= 6);
        let mut works: Vec<_> = plan.scheduled.iter().map(|w| (w.work, w.num_tokens)).collect();
        works.sort();
        shared |= works == [(WorkKey::Decode, 1), (WorkKey::Verify, 5)];
        h.apply(&answer(&h, &plan, &cycle));
    }
    assert!(shared, "no step had one full verification and one cut to a decode");
}

#[test]
fn a_request_whose_drafts_keep_failing_backs_off_and_a_full_batch_does_not_speculate() {
    // Decodes continue the prompt's cycle (so drafts keep being proposed) but every
    // verification's first token is 99: nothing is ever accepted, and the request waits longer
    // and longer before it proposes again.
    let mut h = Harness::new(spec_cfg(2));
    h.add(repeating(1, 100));
    h.step(1);
    let mut verified_at = Vec::new();
    for step in 0..90 {
        let plan = h.schedule();
        let w = plan.scheduled[0];
        let pos = h.core.request_view(RequestId(1)).unwrap().num_output_tokens;
        let token = if w.work == WorkKey::Verify {
            verified_at.push(step);
            99
        } else {
            cycle(w.id, pos)
        };
        let sampled = vec![SampledToken { id: w.id, token }];
        h.apply(&StepOutcome { step_id: plan.step_id, sampled, ..Default::default() });
    }
    let gaps: Vec<usize> = verified_at.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(verified_at.len() <= 7, "verified at {verified_at:?}");
    assert!(gaps.windows(2).all(|g| g[1] >= g[0]), "gaps shrink: {gaps:?}");
    assert!(gaps.last().is_some_and(|&g| g >= 30), "gaps {gaps:?}");
    assert_eq!(h.core.stats().spec_accepted_tokens, 0);

    // disable_by_batch_size: with more requests running than it allows, nobody proposes.
    let cfg = SchedulerConfig {
        speculative: Some(SpeculativeConfig {
            disable_by_batch_size: Some(1),
            ..SpeculativeConfig::ngram(4)
        }),
        ..small_cfg()
    };
    let (_, _, two) = run(cfg.clone(), &[repeating(1, 30), repeating(2, 30)], &cycle);
    let (_, _, alone) = run(cfg, &[repeating(1, 30)], &cycle);
    assert!(alone.spec_drafts > 0, "one request alone speculates");
    assert_eq!(two.spec_drafts, 0, "two running (they end together) never do");
}
