//! Parallel sampling in the core: the samples of one request fork from their source's prompt
//! KV (references to its full blocks, a copy of the partial one), then run, are preempted and
//! finish on their own; every block is free at the end.

use crate::common::{req, small_cfg, tokens, Harness};
use ferry_sched_core::*;

/// A source with prompt of `len` tokens and `extra` more samples (ids 2, 3, …).
fn samples(h: &mut Harness, len: usize, extra: u64, max_tokens: usize) {
    let mut source = req(1, tokens(10, len), max_tokens);
    source.fork = Fork::Source;
    source.ignore_eos = true;
    h.add(source);
    for id in 2..2 + extra {
        let mut r = req(id, tokens(10, len), max_tokens);
        r.fork = Fork::Of(RequestId(1));
        r.ignore_eos = true;
        h.add(r);
    }
}

fn table(h: &Harness, id: u64) -> Vec<BlockId> {
    h.core.block_table(RequestId(id)).expect("live").to_vec()
}

#[test]
fn samples_share_the_prompts_full_blocks_and_copy_the_partial_one() {
    // Prompt of 11 tokens in blocks of 4: the fork point is 10 tokens, two full blocks and a
    // partial one holding tokens 8 and 9.
    let mut h = Harness::new(small_cfg());
    samples(&mut h, 11, 3, 5);
    let plan = h.schedule();
    assert_eq!(crate::common::scheduled_ids(&plan), vec![1], "the samples wait for the source");
    assert_eq!(plan.scheduled[0].num_tokens, 10, "the source stops before its last token");
    assert!(!plan.scheduled[0].samples_token);
    assert_eq!(h.core.request_view(RequestId(2)).unwrap().last_decision, Decision::ForkWait);
    h.apply(&Harness::outcome(&plan, 7));

    let plan = h.schedule();
    assert_eq!(crate::common::scheduled_ids(&plan), vec![1, 2, 3, 4]);
    assert!(plan.scheduled.iter().all(|w| w.num_tokens == 1 && w.samples_token));
    let source = table(&h, 1);
    assert_eq!(source.len(), 3);
    let mut copies = Vec::new();
    for id in 2..=4 {
        let t = table(&h, id);
        assert_eq!(t[..2], source[..2], "sample {id} shares the full prompt blocks");
        assert_ne!(t[2], source[2], "sample {id} has its own partial block");
        copies.push(BlockCopy { id: RequestId(id), src: source[2], dst: t[2] });
        let new = plan.new_requests.iter().find(|n| n.id == RequestId(id)).unwrap();
        assert_eq!(new.num_computed_tokens, 10, "the forked KV counts as computed");
    }
    assert_eq!(plan.block_copies, copies);
    let stats = h.core.stats();
    assert_eq!((stats.forks, stats.fork_shared_blocks, stats.fork_copied_blocks), (3, 6, 3));
    // Shared blocks count one reference per table holding them (invariant 4 checks it after
    // every step): 3 + 3 * 1 blocks in use, not 4 * 3.
    assert_eq!(stats.kv_usage, 6.0 / 64.0);
    h.apply(&Harness::outcome(&plan, 7));
    let done = h.drain(7, 20);
    assert_eq!(done.len(), 4);
    assert!(done.iter().all(|d| d.stats.output_tokens == 5 && d.stats.prompt_tokens == 11));
    h.core.check_drained().unwrap();
}

#[test]
fn a_prompt_ending_a_block_before_its_last_token_forks_without_a_copy() {
    // Prompt of 9: the fork point (8 tokens) fills two blocks exactly.
    let mut h = Harness::new(small_cfg());
    samples(&mut h, 9, 1, 3);
    let plan = h.schedule();
    h.apply(&Harness::outcome(&plan, 7));
    let plan = h.schedule();
    assert!(plan.block_copies.is_empty());
    let (a, b) = (table(&h, 1), table(&h, 2));
    assert_eq!(a[..2], b[..2]);
    assert_ne!(a[2], b[2], "each sample's first own position starts a block of its own");
    assert_eq!(h.core.stats().fork_copied_blocks, 0);
    h.apply(&Harness::outcome(&plan, 7));
    h.drain(7, 20);
    h.core.check_drained().unwrap();
}

#[test]
fn a_preempted_sample_drops_only_its_references() {
    // 12 blocks of 4: a prompt of 18 tokens shares 4 blocks; four samples of 24 output tokens
    // need 4 + 4 * 6 blocks at the end, more than there are, so samples are preempted.
    let cfg = SchedulerConfig { num_blocks: 12, max_preemptions: 8, ..small_cfg() };
    let mut h = Harness::new(cfg);
    samples(&mut h, 18, 3, 20);
    let mut preempted_while_shared = false;
    for _ in 0..400 {
        if h.core.is_drained() {
            break;
        }
        let before = h.core.stats().num_preemptions;
        let plan = h.schedule();
        if h.core.stats().num_preemptions > before {
            // The survivors still hold the shared prompt blocks, each counted once per table.
            let live: Vec<_> = (1..=4).filter_map(|id| h.core.block_table(RequestId(id))).collect();
            let shared = live.iter().filter(|t| !t.is_empty()).count();
            preempted_while_shared |= shared >= 2;
        }
        h.apply(&Harness::outcome(&plan, 7));
    }
    assert!(h.core.is_drained(), "drains");
    assert!(h.core.stats().num_preemptions > 0, "the cache was too small for all samples");
    assert!(preempted_while_shared, "a sample was preempted while siblings held the prompt");
    h.core.check_drained().unwrap();
}

#[test]
fn a_sample_whose_source_ended_computes_its_prompt_itself() {
    let mut h = Harness::new(small_cfg());
    samples(&mut h, 11, 1, 4);
    let plan = h.schedule();
    h.apply(&Harness::outcome(&plan, 7));
    h.core.abort(RequestId(1), Timestamp(h.now)).unwrap();
    let plan = h.schedule();
    assert_eq!(crate::common::scheduled_ids(&plan), vec![2]);
    assert!(plan.block_copies.is_empty());
    let new = &plan.new_requests[0];
    // With prefix caching, the aborted source's full blocks are found in the cache.
    assert_eq!(new.num_computed_tokens, 8);
    assert_eq!(h.core.stats().forks, 0);
    h.apply(&Harness::outcome(&plan, 7));
    assert_eq!(h.drain(7, 20).len(), 1);
    h.core.check_drained().unwrap();
}

#[test]
fn a_copy_step_in_flight_fences_its_sources_blocks() {
    // Two steps in flight: the source is aborted while the step that copies its partial block
    // is in flight; its blocks stay fenced until that step is applied.
    let cfg = SchedulerConfig { max_steps_in_flight: 2, ..small_cfg() };
    let mut h = Harness::new(cfg);
    samples(&mut h, 11, 1, 4);
    let plan = h.schedule();
    h.apply(&Harness::outcome(&plan, 7));
    let copy_step = h.schedule();
    assert_eq!(copy_step.block_copies.len(), 1);
    h.core.abort(RequestId(1), Timestamp(h.now)).unwrap();
    h.core.check_invariants().unwrap();
    assert!(h.core.stats().fenced_blocks >= 1, "the copied block is fenced");
    h.apply(&Harness::outcome(&copy_step, 7));
    assert_eq!(h.core.stats().fenced_blocks, 0);
    h.drain(7, 20);
    h.core.check_drained().unwrap();
}

#[test]
fn an_invalid_fork_is_refused_and_changes_nothing() {
    let mut h = Harness::new(small_cfg());
    let mut alone = req(1, tokens(10, 6), 4);
    h.add(alone.clone());
    let of = |source: u64, prompt: Vec<u32>| {
        let mut r = req(9, prompt, 4);
        r.fork = Fork::Of(RequestId(source));
        r
    };
    let cases = [
        (of(5, tokens(10, 6)), "not a live request"),
        (of(1, tokens(10, 6)), "not an unfinished Fork::Source"),
    ];
    for (r, want) in cases {
        let e = h.core.add_request(r).unwrap_err();
        assert!(e.to_string().contains(want), "{e}");
    }
    alone.id = RequestId(2);
    alone.fork = Fork::Source;
    h.add(alone.clone());
    let e = h.core.add_request(of(2, tokens(11, 6))).unwrap_err();
    assert!(e.to_string().contains("prompt or cache salt differs"), "{e}");
    let mut export = of(2, tokens(10, 6));
    export.kv_export = Some(TransferId(4));
    let e = h.core.add_request(export).unwrap_err();
    assert!(e.to_string().contains("cannot import or export"), "{e}");
    assert!(!h.core.contains(RequestId(9)));
    h.core.check_invariants().unwrap();
}
