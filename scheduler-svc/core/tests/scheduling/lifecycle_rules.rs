//! One test per lifecycle rule: abort at any moment and id reuse, stop conditions,
//! asynchronous stepping (placeholders, fences, unretired finished requests, result
//! validation), KV import and export, typed errors for bad input, timestamps and counters.

use crate::common::{finishes, req, scheduled_ids, small_cfg, tokens, Harness};
use ferry_sched_core::*;

fn async_cfg() -> SchedulerConfig {
    SchedulerConfig { max_steps_in_flight: 2, ..small_cfg() }
}

#[test]
fn abort_of_a_waiting_request_retires_it_at_once() {
    let mut h = Harness::new(small_cfg());
    h.add(req(1, tokens(1, 4), 3));
    let done = h.core.abort(RequestId(1), Timestamp(5)).unwrap();
    assert_eq!(done.reason, FinishReason::Abort);
    assert_eq!(done.stats.queue_time, None);
    assert!(!h.core.contains(RequestId(1)), "the executor never knew it");
    h.add(req(1, tokens(1, 4), 3));
    h.drain(7, 20);
}

#[test]
fn abort_of_a_running_request_holds_its_slot_until_reported() {
    let mut h = Harness::new(small_cfg());
    h.add(req(1, tokens(1, 6), 5));
    h.step(7);
    h.core.abort(RequestId(1), Timestamp(5)).unwrap();
    assert_eq!(
        h.core.abort(RequestId(1), Timestamp(5)),
        Err(AbortError::AlreadyFinished(RequestId(1)))
    );
    assert_eq!(h.core.stats().kv_usage, 0.0, "no step in flight: blocks free at once");
    assert_eq!(h.core.stats().slots_held, 1, "unretired finished request keeps its slot");
    assert_eq!(
        h.core.add_request(req(1, tokens(1, 6), 5)),
        Err(AddError::DuplicateId(RequestId(1)))
    );
    let (plan, _) = h.step(7);
    assert_eq!(plan.finished, [RequestId(1)]);
    assert!(!h.core.contains(RequestId(1)));
    assert_eq!(h.core.abort(RequestId(1), Timestamp(5)), Err(AbortError::Unknown(RequestId(1))));
    h.add(req(1, tokens(1, 6), 5));
    h.drain(7, 20);
}

#[test]
fn abort_with_a_step_in_flight_fences_blocks_and_drops_its_result() {
    let mut h = Harness::new(async_cfg());
    h.add(req(1, tokens(1, 6), 5));
    h.add(req(2, tokens(50, 6), 5));
    let plan = h.schedule();
    h.core.abort(RequestId(1), Timestamp(5)).unwrap();
    let stats = h.core.stats();
    assert_eq!(stats.fenced_blocks, 2, "the in-flight step still writes them");
    let events = h.apply(&Harness::outcome(&plan, 7));
    assert!(events.iter().all(|e| !matches!(e, RequestEvent::Token { id: RequestId(1), .. })));
    assert_eq!(h.core.stats().fenced_blocks, 0);
    assert!(h.core.contains(RequestId(1)), "retires once its finish is reported");
    let (plan, _) = h.step(7);
    assert_eq!(plan.finished, [RequestId(1)]);
    assert!(!h.core.contains(RequestId(1)));
    h.drain(7, 20);
}

/// The result of `plan` as an executor that refused `refused` gives it: no token for them.
fn refusing(plan: &StepPlan, token: u32, refused: &[u64]) -> StepOutcome {
    let mut outcome = Harness::outcome(plan, token);
    outcome.sampled.retain(|s| !refused.contains(&s.id.0));
    outcome.refused = refused.iter().map(|&id| RequestId(id)).collect();
    outcome
}

#[test]
fn a_refused_request_finishes_with_an_error_alone_and_frees_what_it_held() {
    let mut h = Harness::new(async_cfg());
    h.add(req(1, tokens(1, 6), 5));
    h.add(req(2, tokens(50, 6), 5));
    // Two steps in flight when the executor refuses request 1 in the first: it names it again
    // in the second (sent before the scheduler heard), which samples nothing for it either.
    let first = h.schedule();
    let second = h.schedule();
    assert_eq!(scheduled_ids(&second), [1, 2]);
    let events = h.apply(&refusing(&first, 7, &[1]));
    let done = finishes(&events);
    assert_eq!(done.len(), 1);
    assert_eq!((done[0].id, done[0].reason), (RequestId(1), FinishReason::Error));
    assert!(events.iter().any(|e| matches!(e, RequestEvent::Token { id: RequestId(2), .. })));
    assert_eq!(h.core.stats().fenced_blocks, 2, "the second step may still write its blocks");
    let events = h.apply(&refusing(&second, 7, &[1]));
    assert!(finishes(&events).is_empty(), "finished once");
    assert_eq!(h.core.stats().fenced_blocks, 0);
    // The next step tells the executor to forget it; request 2 runs on to its end.
    let (plan, _) = h.step(7);
    assert_eq!(plan.finished, [RequestId(1)]);
    assert!(!h.core.contains(RequestId(1)));
    let rest = h.drain(7, 20);
    assert_eq!(
        rest.iter().map(|f| (f.id, f.reason)).collect::<Vec<_>>(),
        [(RequestId(2), FinishReason::Length)]
    );
    assert_eq!(rest[0].stats.output_tokens, 5);
    assert_eq!(h.core.stats().kv_usage, 0.0);
    // A refusal naming an unknown id, or a token for a refused request, is handled as such.
    h.add(req(3, tokens(1, 6), 5));
    let plan = h.schedule();
    let mut bad = Harness::outcome(&plan, 7);
    bad.refused = vec![RequestId(3)];
    let mut events = Vec::new();
    let err = h.core.apply_result(&bad, Timestamp(h.now), &mut events).unwrap_err();
    assert_eq!(err, ApplyError::UnexpectedToken { step: plan.step_id, id: RequestId(3) });
    let mut unknown = Harness::outcome(&plan, 7);
    unknown.refused = vec![RequestId(99)];
    h.apply(&unknown);
    h.drain(7, 20);
}

/// Step with the given tokens (one per step) until the request finishes.
fn finish_with(mut r: NewRequest, sampled: &[u32]) -> (FinishReason, usize) {
    let mut h = Harness::new(small_cfg());
    r.id = RequestId(1);
    h.add(r);
    for &t in sampled {
        let (_, events) = h.step(t);
        if let Some(f) = finishes(&events).first() {
            return (f.reason, f.stats.output_tokens);
        }
    }
    panic!("did not finish");
}

#[test]
fn stop_conditions_follow_vllm() {
    let base = req(1, tokens(10, 4), 6);
    assert_eq!(finish_with(base.clone(), &[5, 0, 5]), (FinishReason::Stop(StopCause::Eos(0)), 2));
    let mut ignore = base.clone();
    ignore.ignore_eos = true;
    ignore.stop_token_ids = vec![3];
    assert_eq!(
        finish_with(ignore, &[0, 0, 3, 5]),
        (FinishReason::Stop(StopCause::StopToken(3)), 3),
        "ignore_eos ignores only EOS"
    );
    let mut min = base.clone();
    min.min_tokens = 3;
    assert_eq!(finish_with(min, &[0, 0, 0, 5]), (FinishReason::Stop(StopCause::Eos(0)), 3));
    assert_eq!(finish_with(base, &[5; 8]), (FinishReason::Length, 6));
    // The model's maximum length: prompt 120 + 8 outputs = 128.
    let long = req(1, tokens(10, 120), 8);
    assert_eq!(finish_with(long, &[5; 12]), (FinishReason::Length, 8));
}

#[test]
fn asynchronous_steps_use_placeholders_and_stop_at_max_tokens() {
    let mut h = Harness::new(async_cfg());
    h.add(req(1, tokens(1, 4), 3));
    let p1 = h.schedule();
    let p2 = h.schedule();
    assert_eq!(p2.scheduled[0].work, WorkKey::Decode, "decodes the token step 1 will sample");
    assert!(p2.scheduled[0].samples_token);
    assert_eq!(h.core.schedule(Timestamp(0)).unwrap_err(), ScheduleError::TooManyStepsInFlight(2));
    let mut events = Vec::new();
    let now = Timestamp(h.now);
    let bad = |h: &mut Harness, o: &StepOutcome, events: &mut Vec<RequestEvent>| {
        h.core.apply_result(o, now, events).unwrap_err()
    };
    assert!(matches!(
        bad(&mut h, &Harness::outcome(&p2, 5), &mut events),
        ApplyError::OutOfOrder { .. }
    ));
    let mut unknown = Harness::outcome(&p1, 5);
    unknown.step_id = StepId(99);
    assert!(matches!(bad(&mut h, &unknown, &mut events), ApplyError::UnknownStep(_)));
    let mut stray = Harness::outcome(&p1, 5);
    stray.sampled[0].id = RequestId(42);
    assert!(matches!(bad(&mut h, &stray, &mut events), ApplyError::UnexpectedToken { .. }));
    let mut missing = Harness::outcome(&p1, 5);
    missing.sampled.clear();
    assert!(matches!(bad(&mut h, &missing, &mut events), ApplyError::MissingTokens { .. }));
    let mut dup = Harness::outcome(&p1, 5);
    dup.sampled.push(dup.sampled[0]);
    assert!(matches!(
        bad(&mut h, &dup, &mut events),
        ApplyError::DuplicateToken { .. } | ApplyError::MissingTokens { .. }
    ));
    assert!(events.is_empty(), "rejected results change nothing");
    h.core.check_invariants().unwrap();

    h.apply(&Harness::outcome(&p1, 5));
    let p3 = h.schedule();
    assert_eq!(scheduled_ids(&p3), [1], "1 applied + 1 in flight < max_tokens 3");
    h.apply(&Harness::outcome(&p2, 5));
    let p4 = h.schedule();
    assert!(p4.scheduled.is_empty(), "3 tokens already sampled or in flight");
    let events = h.apply(&Harness::outcome(&p3, 5));
    assert_eq!(finishes(&events)[0].reason, FinishReason::Length);
    h.apply(&Harness::outcome(&p4, 5));
    let (plan, _) = h.step(5);
    assert_eq!(plan.finished, [RequestId(1)]);
    assert!(h.core.is_drained());
}

#[test]
fn a_request_finished_by_step_n_keeps_its_slot_while_step_n_plus_1_runs() {
    let mut h = Harness::new(async_cfg());
    h.add(req(1, tokens(1, 4), 10));
    let p1 = h.schedule();
    let p2 = h.schedule();
    let events = h.apply(&Harness::outcome(&p1, 0));
    assert_eq!(finishes(&events)[0].reason, FinishReason::Stop(StopCause::Eos(0)));
    assert_eq!(h.core.stats().slots_held, 1);
    assert_eq!(h.view(1).status, RequestStatus::Finished(FinishReason::Stop(StopCause::Eos(0))));
    let events = h.apply(&Harness::outcome(&p2, 5));
    assert!(events.is_empty(), "the in-flight token of a finished request is dropped");
    let (plan, _) = h.step(5);
    assert_eq!(plan.finished, [RequestId(1)]);
    assert!(h.core.is_drained());
}

fn import_req(id: u64, transfer: u64, prompt_len: usize, import: usize) -> NewRequest {
    let mut r = req(id, tokens(id as u32 * 100, prompt_len), 3);
    r.kv_import = Some(KvImport { transfer_id: TransferId(transfer), num_tokens: import });
    r
}

fn kv_outcome(plan: &StepPlan, results: &[(u64, bool)]) -> StepOutcome {
    let mut o = Harness::outcome(plan, 5);
    o.kv_results =
        results.iter().map(|&(t, ok)| KvResult { transfer_id: TransferId(t), ok }).collect();
    o
}

#[test]
fn an_imported_request_resumes_from_its_kv() {
    let mut h = Harness::new(small_cfg());
    h.add(import_req(1, 77, 9, 8));
    assert_eq!(h.view(1).status, RequestStatus::Receiving);
    let p1 = h.schedule();
    assert!(p1.scheduled.is_empty());
    let KvOp::Import { transfer_id, block_ids, block_hashes, num_tokens, .. } = p1.kv_ops[0] else {
        panic!("expected an import op");
    };
    assert_eq!((transfer_id, num_tokens), (TransferId(77), 8));
    assert_eq!((block_ids.len, block_hashes.len), (2, 2));
    let events = h.apply(&kv_outcome(&p1, &[(77, true)]));
    assert!(matches!(events[0], RequestEvent::Imported { ok: true, .. }));
    assert_eq!(h.view(1).status, RequestStatus::Active);
    let (p2, _) = h.step(5);
    assert_eq!(p2.new_requests[0].num_computed_tokens, 8);
    assert_eq!(p2.scheduled[0].num_tokens, 1, "only the last prompt token is computed");
    h.drain(5, 20);
}

#[test]
fn a_failed_import_is_prefilled_locally() {
    let mut h = Harness::new(small_cfg());
    h.add(import_req(1, 77, 9, 8));
    let p1 = h.schedule();
    let events = h.apply(&kv_outcome(&p1, &[(77, false)]));
    assert!(matches!(events[0], RequestEvent::Imported { ok: false, .. }));
    assert_eq!(h.view(1).blocks_held, 0);
    let (p2, _) = h.step(5);
    assert_eq!(p2.new_requests[0].num_computed_tokens, 0);
    assert_eq!(p2.scheduled[0].num_tokens, 9);
    h.drain(5, 20);
}

#[test]
fn at_most_max_kv_fetches_imports_hold_blocks() {
    let mut h = Harness::new(small_cfg());
    for id in 1..=3 {
        h.add(import_req(id, 70 + id, 9, 8));
    }
    let p1 = h.schedule();
    assert_eq!(p1.kv_ops.len(), 2);
    assert_eq!(h.view(3).blocks_held, 0);
    h.apply(&kv_outcome(&p1, &[(71, true)]));
    let p2 = h.schedule();
    assert!(matches!(p2.kv_ops[0], KvOp::Import { transfer_id: TransferId(73), .. }));
    h.apply(&kv_outcome(&p2, &[(72, true), (73, true)]));
    h.drain(5, 30);
    assert_eq!(
        h.core.kv_transfer_finished(TransferId(71), true, Timestamp(0), &mut Vec::new()),
        Err(ApplyError::UnknownTransfer(TransferId(71)))
    );
}

fn export_req(id: u64, transfer: u64) -> NewRequest {
    let mut r = req(id, tokens(id as u32 * 100, 6), 5);
    r.kv_export = Some(TransferId(transfer));
    r
}

#[test]
fn a_prefill_only_request_exports_its_kv_and_finishes_transferred() {
    let mut h = Harness::new(small_cfg());
    h.add(export_req(1, 55));
    let (_, events) = h.step(5);
    assert!(matches!(events[0], RequestEvent::Token { index: 0, .. }));
    assert!(matches!(events[1], RequestEvent::ExportStarted { transfer_id: TransferId(55), .. }));
    assert_eq!(h.view(1).status, RequestStatus::Transferring);
    assert_eq!(h.core.stats().num_transferring, 1);
    let p2 = h.schedule();
    assert!(p2.scheduled.is_empty(), "no decode for a prefill-only request");
    let KvOp::Export { block_ids, block_hashes, num_tokens, .. } = p2.kv_ops[0] else {
        panic!("expected an export op");
    };
    assert_eq!(num_tokens, 6);
    assert_eq!(p2.blocks(block_ids), h.core.block_table(RequestId(1)).unwrap());
    assert_eq!(p2.hashes(block_hashes), &h.core.block_hashes(RequestId(1)).unwrap()[..1]);
    let events = h.apply(&kv_outcome(&p2, &[(55, true)]));
    assert_eq!(finishes(&events)[0].reason, FinishReason::Transferred);
    h.drain(5, 5);
}

#[test]
fn a_prefill_only_request_done_with_its_first_token_exports_nothing() {
    let mut h = Harness::new(small_cfg());
    let mut done = export_req(1, 55);
    done.max_tokens = 1;
    h.add(done);
    let (_, events) = h.step(5);
    assert_eq!(finishes(&events)[0].reason, FinishReason::Length);
    assert!(!events.iter().any(|e| matches!(e, RequestEvent::ExportStarted { .. })));
    let p2 = h.schedule();
    assert!(p2.kv_ops.is_empty(), "no export for a finished request");
    h.apply(&kv_outcome(&p2, &[]));
    h.drain(5, 5);
    // Its transfer id was released with it.
    h.add(export_req(2, 55));
}

#[test]
fn a_continuation_with_prior_output_imports_its_prompt_and_computes_the_rest() {
    let mut h = Harness::new(small_cfg());
    let mut moved = import_req(1, 77, 9, 8);
    moved.output = vec![4242];
    moved.max_tokens = 5;
    h.add(moved);
    let p1 = h.schedule();
    assert!(matches!(p1.kv_ops[0], KvOp::Import { num_tokens: 8, .. }));
    h.apply(&kv_outcome(&p1, &[(77, true)]));
    let (p2, _) = h.step(5);
    assert_eq!(p2.new_requests[0].num_computed_tokens, 8);
    assert_eq!(&*p2.new_requests[0].output, [4242], "the prior output goes to the executor");
    assert_eq!(p2.scheduled[0].num_tokens, 2, "the last prompt token and the prior output one");
    h.drain(5, 20);
}

#[test]
fn a_failed_export_finishes_with_error() {
    let mut h = Harness::new(small_cfg());
    h.add(export_req(1, 55));
    h.step(5);
    let p2 = h.schedule();
    let events = h.apply(&kv_outcome(&p2, &[(55, false)]));
    assert_eq!(finishes(&events)[0].reason, FinishReason::Error);
    h.drain(5, 5);
}

#[test]
fn an_export_aborted_midway_keeps_its_blocks_until_reported() {
    let mut h = Harness::new(small_cfg());
    h.add(export_req(1, 55));
    h.step(5);
    let (_, _) = h.step(5); // export op issued
    h.core.abort(RequestId(1), Timestamp(0)).unwrap();
    assert!(h.core.stats().kv_usage > 0.0, "the executor may still be reading them");
    let mut events = Vec::new();
    h.core.kv_transfer_finished(TransferId(55), false, Timestamp(0), &mut events).unwrap();
    h.core.check_invariants().unwrap();
    assert!(events.is_empty(), "already finished by the abort");
    assert_eq!(h.core.stats().kv_usage, 0.0);
    h.drain(5, 5);
}

#[test]
fn bad_requests_are_typed_errors() {
    let mut core =
        Scheduler::new(SchedulerConfig { num_blocks: 4, max_model_len: 32, ..small_cfg() })
            .unwrap();
    let id = RequestId(1);
    let mut add = |r: NewRequest| core.add_request(r);
    assert_eq!(add(req(1, vec![], 2)), Err(AddError::EmptyPrompt(id)));
    assert!(matches!(add(req(1, tokens(0, 32), 1)), Err(AddError::PromptTooLong { .. })));
    assert_eq!(add(req(1, tokens(0, 4), 0)), Err(AddError::ZeroMaxTokens(id)));
    assert!(matches!(add(req(1, tokens(0, 4), 29)), Err(AddError::MaxTokensPastModelLen { .. })));
    let mut min = req(1, tokens(0, 4), 2);
    min.min_tokens = 3;
    assert_eq!(add(min), Err(AddError::MinTokensAboveMax(id)));
    assert!(matches!(
        add(req(1, tokens(0, 10), 8)),
        Err(AddError::NeverFits { blocks_needed: 5, num_blocks: 4, .. })
    ));
    assert_eq!(add(req(1, tokens(0, 10), 7)), Ok(()), "17 tokens of KV fit 4 blocks of 4");
    assert_eq!(add(req(1, tokens(0, 2), 1)), Err(AddError::DuplicateId(id)));
    assert!(matches!(add(import_req(2, 9, 4, 4)), Err(AddError::InvalidImport { .. })));
    assert_eq!(add(import_req(2, 9, 4, 3)), Ok(()));
    assert!(matches!(add(import_req(3, 9, 4, 3)), Err(AddError::DuplicateTransfer { .. })));
    assert!(matches!(add(export_req(4, 9)), Err(AddError::DuplicateTransfer { .. })));
    let mut no_fetch =
        Scheduler::new(SchedulerConfig { max_kv_fetches: 0, ..small_cfg() }).unwrap();
    assert!(matches!(
        no_fetch.add_request(import_req(1, 1, 4, 2)),
        Err(AddError::InvalidImport { .. })
    ));
    assert!(matches!(
        Scheduler::new(SchedulerConfig { block_size: 0, ..small_cfg() }),
        Err(ConfigError::Zero { field: "block_size" })
    ));
}

#[test]
fn timestamps_give_queue_time_ttft_and_e2e() {
    let mut h = Harness::new(small_cfg());
    h.add(req(1, tokens(1, 4), 3));
    let done = h.drain(5, 10);
    let s = done[0].stats;
    assert_eq!(s.queue_time, Some(1.0), "scheduled in the first step, 1 s after arrival");
    assert_eq!(s.time_to_first_token, Some(1.0));
    assert_eq!(s.e2e_latency, 3.0);
    assert_eq!((s.prompt_tokens, s.output_tokens), (4, 3));
    let stats = h.core.stats();
    assert_eq!((stats.prompt_tokens, stats.generation_tokens), (4, 3));
    assert_eq!(stats.requests_finished, 1);
}

#[test]
fn drain_is_checked() {
    let mut h = Harness::new(small_cfg());
    h.add(req(1, tokens(1, 4), 3));
    let err = h.core.check_drained().unwrap_err();
    assert_eq!(err.rule, 7);
    h.drain(5, 10);
    h.core.check_drained().unwrap();
}

#[test]
fn a_shared_prompt_reaches_the_executor_without_a_copy() {
    let mut h = Harness::new(small_cfg());
    let prompt: std::sync::Arc<[u32]> = tokens(1, 6).into();
    h.add(NewRequest::new(RequestId(1), prompt.clone(), 3, Timestamp(0)));
    let plan = h.schedule();
    assert!(std::sync::Arc::ptr_eq(&plan.new_requests[0].prompt, &prompt), "same allocation");
    h.apply(&Harness::outcome(&plan, 7));
    h.drain(7, 20);
}

#[test]
fn a_moved_request_continues_from_its_prior_output() {
    let mut h = Harness::new(small_cfg());
    let mut r = req(1, tokens(1, 6), 5);
    r.output = vec![900, 901];
    h.add(r);
    let (plan, events) = h.step(7);
    let new = &plan.new_requests[0];
    assert_eq!(&*new.output, &[900, 901], "the executor gets the prior output as output");
    assert_eq!(new.num_computed_tokens, 0);
    assert_eq!(plan.scheduled[0].num_tokens, 8, "prompt and prior output are recomputed");
    assert!(plan.scheduled[0].samples_token);
    assert!(events.contains(&RequestEvent::Token {
        id: RequestId(1),
        token: 7,
        index: 2,
        loops: 0
    }));
    let done = h.drain(7, 10);
    assert_eq!(done[0].reason, FinishReason::Length);
    assert_eq!(done[0].stats.output_tokens, 5, "max_tokens counts the prior output");
}

#[test]
fn prior_output_must_leave_something_to_generate() {
    let mut h = Harness::new(small_cfg());
    let mut r = req(1, tokens(1, 6), 2);
    r.output = vec![900, 901];
    assert_eq!(
        h.core.add_request(r),
        Err(AddError::OutputComplete { id: RequestId(1), output_len: 2, max_tokens: 2 })
    );
    let mut r = export_req(2, 1);
    r.output = vec![900];
    assert_eq!(h.core.add_request(r), Err(AddError::OutputWithTransfer(RequestId(2))));
    assert!(h.core.is_drained(), "refused requests leave nothing behind");
}

/// The KV-tier ops of `plan`: (blocks, hashes) of each store.
fn stores(plan: &StepPlan) -> Vec<(Vec<BlockId>, Vec<BlockHash>)> {
    plan.kv_ops
        .iter()
        .filter_map(|op| match *op {
            KvOp::Store { block_ids, block_hashes } => {
                Some((plan.blocks(block_ids).to_vec(), plan.hashes(block_hashes).to_vec()))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn a_finished_request_writes_the_blocks_it_computed_to_the_kv_tier_a_few_per_step() {
    let cfg = SchedulerConfig { kv_tier_store_blocks_per_step: 2, ..small_cfg() };
    let mut h = Harness::new(cfg);
    // 13 prompt tokens + 3 generated; the last token's KV is never computed: 15 tokens, 3 full
    // blocks of its own.
    h.add(req(1, tokens(1, 13), 3));
    let mut finished = false;
    for _ in 0..6 {
        let (plan, events) = h.step(7);
        assert!(stores(&plan).is_empty(), "nothing is stored while it runs");
        if !finishes(&events).is_empty() {
            finished = true;
            break;
        }
    }
    assert!(finished);
    let mut expected = Vec::new();
    extend_block_hashes(&mut expected, &[tokens(1, 13), vec![7, 7]].concat(), 4, 0);
    // Two blocks per step, in order, each under its content's hash.
    let (first, _) = h.step(7);
    let (second, _) = h.step(7);
    let (third, _) = h.step(7);
    let got: Vec<_> = [&first, &second].iter().flat_map(|p| stores(p)).collect();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].1, expected[..2]);
    assert_eq!(got[1].1, expected[2..3]);
    assert!(stores(&third).is_empty());
    // A request that found the first three blocks in the cache writes only what it computed.
    let prompt = [tokens(1, 12), vec![90, 91, 92, 93, 94]].concat();
    h.add(req(2, prompt.clone(), 1));
    let mut written = Vec::new();
    for _ in 0..6 {
        let (plan, _) = h.step(7);
        written.extend(stores(&plan).into_iter().flat_map(|(_, hashes)| hashes));
    }
    let mut own = Vec::new();
    extend_block_hashes(&mut own, &prompt, 4, 0);
    assert_eq!(written, own[3..4], "only block 3, its own");
}

#[test]
fn a_block_evicted_before_its_turn_is_not_written_to_the_kv_tier() {
    // A cache so small that the next request evicts every cached block.
    let cfg = SchedulerConfig {
        kv_tier_store_blocks_per_step: 1,
        num_blocks: 5,
        max_model_len: 20,
        ..small_cfg()
    };
    let mut h = Harness::new(cfg);
    h.add(req(1, tokens(1, 16), 1));
    let mut finished = false;
    for _ in 0..4 {
        let (_, events) = h.step(7);
        if !finishes(&events).is_empty() {
            finished = true;
            break;
        }
    }
    assert!(finished);
    // Request 1's 4 full blocks wait to be stored; request 2 takes all 5 blocks in the next
    // step, before the stores are put in it, so none goes out.
    h.add(req(2, tokens(100, 19), 1));
    let mut stored = Vec::new();
    for _ in 0..8 {
        let (plan, _) = h.step(7);
        stored.extend(stores(&plan).into_iter().flat_map(|(_, hashes)| hashes));
    }
    let mut second = Vec::new();
    extend_block_hashes(&mut second, &tokens(100, 19), 4, 0);
    assert_eq!(stored, second[..4], "only request 2's own blocks, after it finished");
}
