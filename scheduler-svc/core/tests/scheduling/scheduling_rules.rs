//! One test per scheduling rule: step composition, chunking, lookahead, slots, prefix caching,
//! preemption (policies, modes, rollback, self-preemption, no admission after preemption).

use crate::common::{finishes, req, scheduled_ids, small_cfg, tokens, Harness};
use ferry_sched_core::*;

#[test]
fn a_step_takes_decodes_then_prompt_chunks_then_admissions() {
    let mut h =
        Harness::new(SchedulerConfig { long_prefill_token_threshold: Some(8), ..small_cfg() });
    h.add(req(1, tokens(100, 4), 5));
    h.add(req(2, tokens(200, 20), 5));
    let (plan, _) = h.step(7);
    assert_eq!(scheduled_ids(&plan), [1, 2]);
    assert_eq!(plan.scheduled[0].num_tokens, 4);
    assert!(plan.scheduled[0].samples_token);
    assert_eq!(plan.scheduled[1].num_tokens, 8, "chunk capped by the threshold");
    assert!(!plan.scheduled[1].samples_token);
    assert_eq!(plan.new_requests.len(), 2);

    h.add(req(3, tokens(300, 4), 5));
    let (plan, _) = h.step(7);
    assert_eq!(scheduled_ids(&plan), [1, 2, 3]);
    let works: Vec<_> = plan.scheduled.iter().map(|w| w.work).collect();
    assert_eq!(works, [WorkKey::Decode, WorkKey::PromptChunk, WorkKey::PromptChunk]);
    assert_eq!(plan.total_tokens, 1 + 8 + 4);
    assert_eq!(scheduled_ids(&plan).len(), plan.scheduled.len());
}

#[test]
fn chunks_are_bounded_by_the_step_budget() {
    let mut h = Harness::new(small_cfg());
    h.add(req(1, tokens(1, 50), 2));
    let (plan, _) = h.step(7);
    assert_eq!(plan.total_tokens, 32);
    assert!(!plan.scheduled[0].samples_token);
    assert_eq!(h.view(1).num_computed_tokens, 32);
    let (plan, events) = h.step(7);
    assert_eq!(plan.total_tokens, 18);
    assert!(plan.scheduled[0].samples_token, "the last chunk samples");
    assert!(matches!(events[0], RequestEvent::Token { index: 0, .. }));
    assert_eq!(h.view(1).pending_work, Some(WorkKey::Decode));
}

#[test]
fn without_chunking_prompts_are_whole_and_must_fit_the_budget() {
    let cfg = SchedulerConfig { enable_chunked_prefill: false, ..small_cfg() };
    let mut h = Harness::new(cfg);
    let err = h.core.add_request(req(9, tokens(1, 33), 2)).unwrap_err();
    assert!(matches!(err, AddError::PromptOverBudget { budget: 32, .. }));
    h.add(req(1, tokens(1, 20), 3));
    h.add(req(2, tokens(100, 20), 3));
    let (plan, _) = h.step(7);
    assert_eq!(scheduled_ids(&plan), [1], "the second prompt does not fit what is left");
    assert_eq!(plan.scheduled[0].work, WorkKey::Prompt);
    assert_eq!(plan.scheduled[0].num_tokens, 20);
    let (plan, _) = h.step(7);
    assert_eq!(scheduled_ids(&plan), [1, 2]);
    assert_eq!(plan.scheduled[1].work, WorkKey::Prompt);
}

#[test]
fn admission_scans_at_most_lookahead_waiting_requests() {
    let mut h = Harness::new(SchedulerConfig { lookahead: 2, ..small_cfg() });
    for id in 1..=4 {
        h.add(req(id, tokens(id as u32 * 10, 2), 3));
    }
    assert_eq!(h.step(7).0.new_requests.len(), 2);
    assert_eq!(h.step(7).0.new_requests.len(), 2);
}

#[test]
fn admission_slots_bound_the_running_set_and_free_on_retire() {
    let mut h = Harness::new(SchedulerConfig { max_num_seqs: 2, ..small_cfg() });
    h.add(req(1, tokens(10, 2), 1));
    h.add(req(2, tokens(20, 2), 3));
    h.add(req(3, tokens(30, 2), 3));
    let (plan, events) = h.step(7);
    assert_eq!(scheduled_ids(&plan), [1, 2]);
    assert_eq!(h.view(3).last_decision, Decision::NoSlot);
    // Request 1 finished (max_tokens 1) but keeps its slot until its finish is reported.
    assert_eq!(finishes(&events)[0].reason, FinishReason::Length);
    assert_eq!(h.core.stats().slots_held, 2);
    let (plan, _) = h.step(7);
    assert_eq!(plan.finished, [RequestId(1)]);
    assert_eq!(scheduled_ids(&plan), [2, 3], "the reported finish freed the slot");
    assert!(!h.core.contains(RequestId(1)));
}

#[test]
fn full_blocks_are_shared_by_prefix_hash_and_salt() {
    let mut h = Harness::new(small_cfg());
    let prompt = tokens(500, 10); // two full blocks of 4 + 2 tokens
    h.add(req(1, prompt.clone(), 3));
    h.step(7);
    assert_eq!(h.core.prefix_hit_tokens(&prompt, 0), 8);
    assert_eq!(h.core.prefix_hit_tokens(&prompt, 1), 0, "another salt never shares");
    assert_eq!(h.core.prefix_hit_tokens(&prompt[..8], 0), 4, "never the last token");

    h.add(req(2, prompt.clone(), 3));
    let mut salted = req(3, prompt.clone(), 3);
    salted.cache_salt = 1;
    h.add(salted);
    let (plan, _) = h.step(7);
    let new: Vec<_> = plan.new_requests.iter().map(|n| (n.id.0, n.num_computed_tokens)).collect();
    assert_eq!(new, [(2, 8), (3, 0)]);
    let t1 = h.core.block_table(RequestId(1)).unwrap().to_vec();
    let t2 = h.core.block_table(RequestId(2)).unwrap().to_vec();
    assert_eq!(t1[..2], t2[..2], "the prefix blocks are the same physical blocks");
    assert_ne!(t1[2], t2[2]);
    let stats = h.core.stats();
    assert_eq!(stats.prefix_cache_queries, 30);
    assert_eq!(stats.prefix_cache_hits, 8);
    assert_eq!(h.view(2).num_computed_tokens, 10);

    // Block names are the hash chain over full blocks.
    let mut chain = Vec::new();
    extend_block_hashes(&mut chain, &prompt, 4, 0);
    assert_eq!(h.core.block_hashes(RequestId(1)).unwrap()[..2], chain[..]);
}

#[test]
fn cached_free_blocks_are_evicted_only_when_needed_least_recent_first() {
    let mut h = Harness::new(SchedulerConfig { num_blocks: 8, ..small_cfg() });
    let prompt = tokens(500, 10);
    h.add(req(1, prompt.clone(), 2));
    h.drain(7, 10);
    assert_eq!(h.core.stats().cached_free_blocks, 2);
    assert_eq!(h.core.prefix_hit_tokens(&prompt, 0), 8, "freed full blocks stay cached");
    // Needs 7 of the 8 blocks: six uncached free ones go first, then one cached block — the
    // tail of the chain (freed first), so the prefix head survives.
    h.add(req(2, tokens(900, 28), 1));
    h.step(7);
    assert_eq!(h.core.prefix_hit_tokens(&prompt, 0), 4);
}

/// The steps tell the executor which blocks cache which hash (evictions and registrations), so
/// that a new leader's core, adopting what the executor reports, finds the same prefix hits
/// (and refuses what it cannot take: held or out-of-range blocks, a hash twice).
#[test]
fn a_new_core_adopts_the_executors_cached_blocks() {
    let mut h = Harness::new(small_cfg());
    let prompt = tokens(500, 10);
    h.add(req(1, prompt.clone(), 2));
    let mut executor = std::collections::HashMap::new();
    for _ in 0..10 {
        let (plan, _) = h.step(7);
        for b in &plan.cache.evicted {
            executor.remove(b);
        }
        executor.extend(plan.cache.cached.iter().copied());
    }
    assert_eq!(executor.len(), 2, "the prompt's two full blocks: {executor:?}");
    let mut reported: Vec<_> = executor.into_iter().collect();
    reported.push((BlockId(999), BlockHash(1)));
    reported.push((reported[0].0, BlockHash(2)));

    let mut leader = Harness::new(small_cfg());
    assert_eq!(leader.core.adopt_cached_blocks(reported.iter().copied()), 2);
    leader.core.check_invariants().unwrap();
    assert_eq!(leader.core.prefix_hit_tokens(&prompt, 0), 8);
    assert_eq!(leader.core.stats().cached_free_blocks, 2);
    leader.add(req(2, prompt.clone(), 2));
    let (plan, _) = leader.step(7);
    assert_eq!(plan.new_requests[0].num_computed_tokens, 8, "the adopted blocks are hits");
    // Only a fresh core adopts.
    assert_eq!(leader.core.adopt_cached_blocks([(BlockId(40), BlockHash(3))]), 0);
}

/// A block is registered in the prefix cache when the step computing it is built; if the
/// executor refuses the request in that step, the block was never computed, and it leaves the
/// cache (the step after says so to the executor) — a later request with the same prompt
/// computes it rather than read what is there.
#[test]
fn a_refused_requests_own_blocks_leave_the_prefix_cache() {
    let mut h = Harness::new(small_cfg());
    let prompt = tokens(500, 10);
    h.add(req(1, prompt.clone(), 3));
    let plan = h.schedule();
    assert_eq!(h.core.prefix_hit_tokens(&prompt, 0), 8, "registered as the step was built");
    let mut outcome = Harness::outcome(&plan, 7);
    outcome.refused = vec![RequestId(1)];
    outcome.sampled.clear();
    h.apply(&outcome);
    h.core.check_invariants().unwrap();
    assert_eq!(h.core.prefix_hit_tokens(&prompt, 0), 0, "the refused step computed nothing");
    h.add(req(2, prompt.clone(), 3));
    let plan = h.schedule();
    assert_eq!(plan.new_requests[0].num_computed_tokens, 0);
    assert_eq!(plan.cache.evicted.len(), 2, "the executor forgets them too: {:?}", plan.cache);
}

/// Run until the first step that preempts; returns that plan.
fn step_until_preemption(h: &mut Harness, max: usize) -> StepPlan {
    for _ in 0..max {
        let (plan, _) = h.step(7);
        if !plan.preempted.is_empty() {
            return plan;
        }
    }
    panic!("no preemption in {max} steps");
}

fn pressure_cfg(policy: PreemptionPolicy, mode: PreemptionMode) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 2,
        num_blocks: 8,
        max_num_seqs: 3,
        max_num_batched_tokens: 16,
        preemption_policy: policy,
        preemption_mode: mode,
        ..small_cfg()
    }
}

/// Request 1 runs, request 2 arrives later; under FCFS pressure request 2 (the latest
/// admitted) is the victim. Returns the harness right after that preemption.
fn second_request_preempted(mode: PreemptionMode) -> Harness {
    let mut h = Harness::new(pressure_cfg(PreemptionPolicy::Fcfs, mode));
    h.add(req(1, tokens(10, 4), 8));
    h.step(7);
    h.add(req(2, tokens(20, 4), 8));
    let plan = step_until_preemption(&mut h, 20);
    assert_eq!(plan.preempted, [RequestId(2)]);
    h
}

#[test]
fn fcfs_preempts_the_latest_admitted_and_requeues_it_at_the_front() {
    let mut h = second_request_preempted(PreemptionMode::Recompute);
    let v = h.view(2);
    assert_eq!(v.status, RequestStatus::Waiting);
    assert_eq!((v.blocks_held, v.num_computed_tokens), (0, 0), "recompute frees the KV");
    assert!(v.num_output_tokens > 0, "generated tokens are kept");
    assert_eq!(v.num_preemptions, 1);
    assert_eq!(v.last_decision, Decision::Preempted);
    // A later arrival queues behind the preempted request.
    h.add(req(3, tokens(30, 2), 2));
    let mut resumed = None;
    for _ in 0..40 {
        let (plan, _) = h.step(7);
        if let Some(c) = plan.cached_requests.iter().find(|c| c.id == RequestId(2)) {
            assert!(c.resumed);
            let toks = plan.tokens_of(c.tokens);
            assert_eq!(toks[..4], tokens(20, 4)[..]);
            assert_eq!(toks.len(), 4 + v.num_output_tokens);
            assert_eq!(plan.blocks(c.block_ids), h.core.block_table(RequestId(2)).unwrap());
            resumed = Some(scheduled_ids(&plan));
            break;
        }
    }
    let order = resumed.expect("request 2 resumes");
    let pos2 = order.iter().position(|&i| i == 2).unwrap();
    assert!(order.iter().position(|&i| i == 3).is_none_or(|p3| p3 > pos2));
    h.drain(7, 100);
}

#[test]
fn priority_preempts_the_largest_priority_then_arrival() {
    let mut h = Harness::new(pressure_cfg(PreemptionPolicy::Priority, PreemptionMode::Recompute));
    let mut low = req(1, tokens(10, 4), 8);
    low.priority = 2;
    h.add(low);
    h.step(7);
    let mut high = req(2, tokens(20, 4), 8);
    high.priority = 0;
    h.add(high);
    let plan = step_until_preemption(&mut h, 20);
    assert_eq!(plan.preempted, [RequestId(1)], "priority, not admission order, decides");
    assert!(!scheduled_ids(&plan).contains(&1), "its budget was given back");
    h.drain(7, 100);
}

#[test]
fn least_work_done_preempts_the_request_with_fewest_computed_tokens() {
    let mut h = Harness::new(SchedulerConfig {
        num_blocks: 10,
        ..pressure_cfg(PreemptionPolicy::LeastWorkDone, PreemptionMode::Recompute)
    });
    h.add(req(1, tokens(10, 2), 9));
    h.step(7);
    h.add(req(2, tokens(20, 8), 9));
    let plan = step_until_preemption(&mut h, 20);
    assert_eq!(plan.preempted, [RequestId(1)], "FCFS would have picked request 2");
    h.drain(7, 100);
}

#[test]
fn a_victim_scheduled_earlier_in_the_step_gives_back_budget_and_blocks() {
    // Request 1 (worst priority) is first in the decode queue, so it is scheduled before
    // request 2 runs out of blocks and picks it as the victim.
    let mut h = Harness::new(pressure_cfg(PreemptionPolicy::Priority, PreemptionMode::Recompute));
    let mut first = req(1, tokens(10, 4), 8);
    first.priority = 5;
    h.add(first);
    h.step(7);
    h.add(req(2, tokens(20, 4), 8));
    let plan = step_until_preemption(&mut h, 20);
    assert_eq!(plan.preempted, [RequestId(1)]);
    assert_eq!(scheduled_ids(&plan), [2]);
    assert_eq!(plan.total_tokens, plan.scheduled.iter().map(|w| w.num_tokens).sum::<usize>());
    assert_eq!(h.view(1).blocks_held, 0);
}

#[test]
fn the_worst_ranked_requester_preempts_itself() {
    let mut h = Harness::new(pressure_cfg(PreemptionPolicy::Fcfs, PreemptionMode::Recompute));
    h.add(req(1, tokens(10, 4), 8));
    h.step(7);
    h.add(req(2, tokens(20, 4), 8));
    let plan = step_until_preemption(&mut h, 20);
    // Request 2 is the latest admitted: when it needs a block, it is its own victim.
    assert_eq!(plan.preempted, [RequestId(2)]);
    assert_eq!(scheduled_ids(&plan), [1]);
}

#[test]
fn no_request_is_admitted_in_a_step_that_preempted() {
    // Two slots: request 3 waits for one, and the preemption frees one.
    let mut h = Harness::new(SchedulerConfig {
        max_num_seqs: 2,
        ..pressure_cfg(PreemptionPolicy::Fcfs, PreemptionMode::Recompute)
    });
    h.add(req(1, tokens(10, 4), 8));
    h.step(7);
    h.add(req(2, tokens(20, 4), 8));
    h.step(7);
    h.add(req(3, tokens(30, 1), 1));
    loop {
        let (plan, _) = h.step(7);
        if !plan.preempted.is_empty() {
            assert!(plan.new_requests.iter().all(|n| n.id != RequestId(3)));
            assert_eq!(h.core.stats().slots_held, 1, "a slot is free, yet nobody was admitted");
            break;
        }
        assert!(plan.new_requests.iter().all(|n| n.id != RequestId(3)), "no free slot yet");
    }
    h.drain(7, 100);
}

#[test]
fn yield_keeps_the_victims_kv_and_resumes_without_full_recompute() {
    let mut h = second_request_preempted(PreemptionMode::Yield);
    let v = h.view(2);
    assert_eq!(v.status, RequestStatus::Waiting);
    assert!(v.blocks_held > 0, "yield keeps (most of) the KV");
    assert!(v.num_computed_tokens > 0);
    // It yielded, then gave up the one tail block the requester needed.
    assert!(matches!(v.last_decision, Decision::Yielded | Decision::Reclaimed));
    for _ in 0..40 {
        let (plan, _) = h.step(7);
        if let Some(c) = plan.cached_requests.iter().find(|c| c.id == RequestId(2)) {
            assert!(c.resumed);
            assert!(c.num_computed_tokens > 0, "resumes from its kept KV");
            h.drain(7, 100);
            return;
        }
    }
    panic!("request 2 never resumed");
}

#[test]
fn waiting_requests_are_ordered_by_priority_under_the_priority_policy() {
    let mut h = Harness::new(SchedulerConfig {
        max_num_seqs: 1,
        max_num_batched_tokens: 8,
        preemption_policy: PreemptionPolicy::Priority,
        ..small_cfg()
    });
    let mut a = req(1, tokens(10, 2), 1);
    a.priority = 3;
    let mut b = req(2, tokens(20, 2), 1);
    b.priority = 1;
    h.add(a);
    h.add(b);
    let (plan, _) = h.step(7);
    assert_eq!(scheduled_ids(&plan), [2]);
}

#[test]
fn preemption_counts_and_times_are_recorded() {
    let mut h = Harness::new(pressure_cfg(PreemptionPolicy::Fcfs, PreemptionMode::Recompute));
    h.add(req(1, tokens(10, 4), 8));
    h.step(7);
    h.add(req(2, tokens(20, 4), 8));
    step_until_preemption(&mut h, 20);
    assert_eq!(h.core.stats().num_preemptions, 1);
    let done = h.drain(7, 100);
    let two = done.iter().find(|f| f.id == RequestId(2)).unwrap();
    assert_eq!(two.stats.num_preemptions, 1);
    assert_eq!(two.stats.output_tokens, 8);
}

/// A synchronous step of a data-parallel group, throttled or not.
fn group_step(h: &mut Harness, throttle: bool) -> StepPlan {
    h.now += 1_000_000_000;
    let plan = h.core.schedule_throttled(Timestamp(h.now), throttle).unwrap().clone();
    h.core.check_invariants().unwrap();
    h.apply(&Harness::outcome(&plan, 7));
    plan
}

#[test]
fn a_throttled_step_runs_decodes_and_holds_prefills_back() {
    let cfg = SchedulerConfig { long_prefill_token_threshold: Some(8), ..small_cfg() };
    let mut h = Harness::new(cfg);
    h.add(req(1, tokens(100, 4), 20));
    h.add(req(2, tokens(200, 20), 20));
    group_step(&mut h, false); // 1's prompt, 2's first chunk; nothing left waiting
    assert!(!h.core.prefill_capacity_bound());
    h.add(req(3, tokens(300, 4), 20));
    let plan = group_step(&mut h, true);
    assert_eq!(scheduled_ids(&plan), [1], "2's chunk and 3's admission wait for an aligned step");
    assert_eq!(plan.scheduled[0].work, WorkKey::Decode);
    assert_eq!(h.core.stats().prefills_deferred, 1);
    assert_eq!(h.view(3).status, RequestStatus::Waiting);
    // The aligned step takes them; nothing was lost.
    let plan = group_step(&mut h, false);
    assert_eq!(scheduled_ids(&plan), [1, 2, 3]);
    assert_eq!(h.core.stats().prefills_deferred, 1);
}

#[test]
fn a_backlog_or_no_decode_to_protect_lifts_the_throttle() {
    // Only prompt work running: there is no decode to protect, so nothing is deferred.
    let cfg =
        SchedulerConfig { max_num_seqs: 2, long_prefill_token_threshold: Some(8), ..small_cfg() };
    let mut h = Harness::new(cfg);
    h.add(req(1, tokens(100, 30), 20));
    group_step(&mut h, false);
    let plan = group_step(&mut h, true);
    assert_eq!(plan.scheduled[0].work, WorkKey::PromptChunk);
    assert_eq!(h.core.stats().prefills_deferred, 0);
    // A request decoding, one prefilling, one waiting for a slot: the step that did not
    // defer left a backlog, so prefill capacity is the bottleneck and the throttle yields.
    let mut h = Harness::new(SchedulerConfig {
        max_num_seqs: 2,
        long_prefill_token_threshold: Some(8),
        ..small_cfg()
    });
    h.add(req(1, tokens(100, 4), 20));
    h.add(req(2, tokens(200, 30), 20));
    h.add(req(3, tokens(300, 4), 20));
    group_step(&mut h, false);
    assert!(h.core.prefill_capacity_bound(), "3 waits for a slot");
    let plan = group_step(&mut h, true);
    assert_eq!(scheduled_ids(&plan), [1, 2], "2's chunk runs although the step is throttled");
    assert_eq!(h.core.stats().prefills_deferred, 0);
    // Once nothing waits the throttle holds again.
    h.core.abort(RequestId(3), Timestamp(h.now)).unwrap();
    group_step(&mut h, false);
    assert!(!h.core.prefill_capacity_bound());
    let plan = group_step(&mut h, true);
    assert_eq!(scheduled_ids(&plan), [1]);
    assert_eq!(h.core.stats().prefills_deferred, 1);
}

#[test]
fn a_throttled_step_with_no_prefill_to_hold_is_not_counted_as_deferred() {
    let mut h = Harness::new(small_cfg());
    h.add(req(1, tokens(100, 4), 20));
    group_step(&mut h, false);
    let plan = group_step(&mut h, true);
    assert_eq!(plan.scheduled[0].work, WorkKey::Decode);
    assert_eq!(h.core.stats().prefills_deferred, 0, "only a decode ran, nothing was held");
}
