//! A looped model's stage work: a chain of tokens runs prelude, recurrent loops and coda one
//! step each, every step one operation; KV per stage plane; exits; the seed's livelock
//! workload drains under Ferry's deepest-first selection and does not under prelude-first;
//! random looped workloads hold every invariant (rule 8 included) with coverage asserted.

use crate::common::{run, small_cfg, tokens, Arrival, Harness, Rng, SimOpts};
use ferry_sched_core::*;

/// `small_cfg` serving a looped model of `loops` loops with prelude and coda layers, without
/// a prefix cache (a looped request neither hits nor fills it).
fn looped_cfg(loops: u8) -> SchedulerConfig {
    SchedulerConfig { looped: Some(LoopedModel::new(loops)), ..small_cfg() }
}

fn ops(plan: &StepPlan) -> Vec<(WorkKey, usize, u8, bool)> {
    plan.scheduled.iter().map(|w| (w.work, w.num_tokens, w.loop_index, w.samples_token)).collect()
}

#[test]
fn a_chain_runs_prelude_each_loop_and_coda_one_step_each_and_the_coda_samples() {
    let mut cfg = looped_cfg(2);
    cfg.long_prefill_token_threshold = Some(4);
    let mut h = Harness::new(cfg);
    h.add(crate::common::req(1, tokens(1, 6), 2));
    let mut seen = Vec::new();
    let mut tokens_seen = Vec::new();
    for _ in 0..14 {
        let (plan, events) = h.step(7);
        assert!(plan.scheduled.iter().all(|w| w.work.operation() == plan.operation));
        seen.push(ops(&plan));
        for e in events {
            if let RequestEvent::Token { index, loops, .. } = e {
                tokens_seen.push((index, loops));
            }
        }
    }
    let chain = |key: [WorkKey; 4], n: usize, samples: bool| {
        vec![
            vec![(key[0], n, 0, false)],
            vec![(key[1], n, 1, false)],
            vec![(key[2], n, 2, false)],
            vec![(key[3], n, 0, samples)],
        ]
    };
    let prompt = [
        WorkKey::PromptPrelude,
        WorkKey::PromptRecurrent,
        WorkKey::PromptRecurrent,
        WorkKey::PromptCoda,
    ];
    let decode = [
        WorkKey::DecodePrelude,
        WorkKey::DecodeRecurrent,
        WorkKey::DecodeRecurrent,
        WorkKey::DecodeCoda,
    ];
    let mut want = chain(prompt, 4, false);
    want.extend(chain(prompt, 2, true));
    want.extend(chain(decode, 1, true));
    assert_eq!(seen[..12], want[..], "chunk 1, chunk 2 (samples), then one decode");
    assert_eq!(tokens_seen, vec![(0, 2), (1, 2)], "each token's chain ran both loops");
    assert!(h.core.is_drained());
}

#[test]
fn an_exit_sends_the_chain_to_its_coda_and_its_token_reports_the_loops_it_ran() {
    let mut h = Harness::new(looped_cfg(4));
    h.add(crate::common::req(1, tokens(1, 3), 1));
    let prelude = h.step(7).0;
    assert_eq!(prelude.operation, Operation::Prelude);
    let first_loop = h.schedule();
    assert_eq!(ops(&first_loop), vec![(WorkKey::PromptRecurrent, 3, 1, false)]);
    let mut exit = Harness::outcome(&first_loop, 7);
    exit.exited = vec![RequestId(1)];
    h.apply(&exit);
    let coda = h.schedule();
    assert_eq!(ops(&coda), vec![(WorkKey::PromptCoda, 3, 0, true)], "no loop after the exit");
    let events = h.apply(&Harness::outcome(&coda, 7));
    assert!(events.iter().any(|e| matches!(e, RequestEvent::Token { loops: 1, .. })));
    let stats = h.core.stats();
    assert_eq!((stats.chains_completed, stats.chain_loops, stats.chains_exited_early), (1, 1, 1));
}

#[test]
fn an_exit_for_work_that_ran_no_loop_is_refused_and_changes_nothing() {
    let mut h = Harness::new(looped_cfg(2));
    h.add(crate::common::req(1, tokens(1, 3), 1));
    h.add(crate::common::req(2, tokens(10, 3), 1));
    let prelude = h.schedule();
    let mut bad = Harness::outcome(&prelude, 7);
    bad.exited = vec![RequestId(1)];
    let mut events = Vec::new();
    let err = h.core.apply_result(&bad, Timestamp(h.now), &mut events).unwrap_err();
    assert_eq!(err, ApplyError::UnexpectedExit { step: prelude.step_id, id: RequestId(1) });
    bad.exited = vec![RequestId(9)];
    assert!(h.core.apply_result(&bad, Timestamp(h.now), &mut events).is_err(), "unknown id");
    h.core.check_invariants().unwrap();
    h.apply(&Harness::outcome(&prelude, 7));
    assert_eq!(h.schedule().operation, Operation::Recurrent, "the corrected result applies");
}

#[test]
fn no_stage_is_scheduled_before_the_previous_ones_result_and_kv_comes_per_plane() {
    let mut cfg = looped_cfg(3);
    cfg.max_steps_in_flight = 2;
    let planes = usize::from(LoopedModel::new(3).planes(3));
    assert_eq!(planes, 5, "prelude, three loops, coda");
    let mut h = Harness::new(cfg);
    h.add(crate::common::req(1, tokens(1, 9), 2));
    let first = h.schedule();
    assert_eq!(ops(&first), vec![(WorkKey::PromptPrelude, 9, 0, false)]);
    let rows = 9usize.div_ceil(4);
    assert_eq!(h.core.block_table(RequestId(1)).unwrap().len(), rows * planes, "every plane");
    let second = h.schedule();
    assert!(second.scheduled.is_empty(), "its loop waits for the prelude's result");
    h.apply(&Harness::outcome(&first, 7));
    h.apply(&Harness::outcome(&second, 7));
    let looped = h.schedule();
    assert_eq!(ops(&looped), vec![(WorkKey::PromptRecurrent, 9, 1, false)]);
    assert_eq!(h.core.block_table(RequestId(1)).unwrap().len(), rows * planes, "no new block");
}

#[test]
fn loops_a_model_does_not_run_are_refused_naming_the_limit() {
    let mut plain = Scheduler::new(small_cfg()).unwrap();
    let mut r = crate::common::req(1, tokens(1, 3), 2);
    r.max_loops = Some(2);
    let err = plain.add_request(r.clone()).unwrap_err();
    assert!(err.to_string().contains("does not loop"), "{err}");
    let mut looped = Scheduler::new(looped_cfg(3)).unwrap();
    r.max_loops = Some(4);
    let err = looped.add_request(r.clone()).unwrap_err();
    assert!(err.to_string().contains("max_loops must be 1..=3, got 4"), "{err}");
    r.max_loops = Some(0);
    assert!(looped.add_request(r.clone()).is_err());
    r.max_loops = Some(1);
    r.kv_export = Some(TransferId(5));
    assert!(looped.add_request(r).unwrap_err().to_string().contains("between nodes"));
    looped.check_invariants().unwrap();
    assert!(looped.is_drained(), "nothing was added");
}

/// The seed's livelock workload, from `fixtures/looped_livelock_seed2.txt`.
fn seed_workload() -> Vec<Arrival> {
    let text = include_str!("fixtures/looped_livelock_seed2.txt");
    let lines = text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty());
    lines
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let id = f[1].trim_start_matches('r').parse::<u64>().unwrap() + 1;
            let prompt: Vec<u32> = f[4..].iter().map(|t| t.parse().unwrap()).collect();
            let mut req =
                NewRequest::new(RequestId(id), prompt, f[2].parse().unwrap(), Timestamp(0));
            req.priority = f[3].parse().unwrap();
            req.ignore_eos = true;
            // The engine steps once per harness step from the first arrival (step 0) on.
            Arrival { step: f[0].parse::<u64>().unwrap() + 1, req }
        })
        .collect()
}

/// The seed's configuration: 40 blocks of 2 tokens, 4 sequences, 6 tokens a step, prefill
/// chunks of 4, priority policy with preemption, 4 loops with exit threshold 0.6 on a model
/// whose every layer loops (no prelude or coda plane: 4 planes, 80 token-planes in all). No
/// aging (`max_preemptions` unbounded), as in the seed: the argument must not lean on it.
fn seed_cfg(selection: StageSelection) -> SchedulerConfig {
    let model = LoopedModel {
        prelude_kv: false,
        coda_kv: false,
        max_loops: 4,
        policy: StagePolicy::Separate,
        selection,
    };
    SchedulerConfig {
        block_size: 2,
        num_blocks: 40,
        max_num_seqs: 4,
        max_num_batched_tokens: 6,
        long_prefill_token_threshold: Some(4),
        preemption_policy: PreemptionPolicy::Priority,
        max_preemptions: u32::MAX,
        enable_prefix_caching: false,
        looped: Some(model),
        ..small_cfg()
    }
}

/// Steps the seed's workload must drain within under Ferry's selection, with every
/// invariant checked after every step. It drains in 150 (the seed's current head: 178).
const SEED_DRAIN_BOUND: u64 = 250;

#[test]
fn the_seeds_livelock_workload_drains_and_a_prelude_first_selection_is_caught_livelocking() {
    let arrivals = seed_workload();
    assert_eq!(arrivals.len(), 10);
    let (mut drained, mut preempted) = (Vec::new(), 0);
    for seed in 0..8 {
        // The exit criterion passes on 40 % of loops, drawn per request, position and loop.
        let opts = SimOpts {
            eos_pct: 0,
            pipeline_pct: 0,
            exit_pct: 40,
            max_steps: SEED_DRAIN_BOUND,
            seed,
            ..SimOpts::default()
        };
        let cfg = seed_cfg(StageSelection::DeepestFirst);
        let report = run(&cfg, &arrivals, &opts).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(report.finished.len(), 10);
        eprintln!(
            "deepest-first, exit draws {seed}: drained in {} steps, {} preemptions",
            report.steps, report.preemptions
        );
        drained.push(report.steps);
        // Pipelined (two steps in flight), a prelude can preempt a chain whose stage is in
        // flight: the workload still drains within the bound.
        let pipelined = SchedulerConfig { max_steps_in_flight: 2, ..cfg.clone() };
        let report = run(&pipelined, &arrivals, &SimOpts { pipeline_pct: 90, ..opts })
            .unwrap_or_else(|e| panic!("pipelined, seed {seed}: {e}"));
        eprintln!("  pipelined: {} steps, {} preemptions", report.steps, report.preemptions);
        preempted += report.preemptions;
        let prelude_first = seed_cfg(StageSelection::PreludeFirst);
        let opts = SimOpts { max_steps: 2001, ..opts };
        let opts = SimOpts { max_steps: 2001, ..opts };
        let err = run(&prelude_first, &arrivals, &opts).expect_err("prelude-first livelocks");
        assert!(err.contains("did not drain after 2001 steps"), "seed {seed}: {err}");
    }
    eprintln!("steps to drain: {drained:?}");
    assert!(preempted > 0, "the pipelined runs preempt");
}

/// A random looped workload for `seed`: loops, planes, policy, chunking, preemption policy and
/// mode, pipelining, exits, aborts and refusals all drawn.
fn random_looped_case(seed: u64) -> (SchedulerConfig, Vec<Arrival>, SimOpts) {
    let mut rng = Rng::new(seed);
    let model = LoopedModel {
        prelude_kv: rng.pct(50),
        coda_kv: rng.pct(50),
        max_loops: rng.range(1, 4) as u8,
        policy: rng.pick(&[StagePolicy::Separate, StagePolicy::Mixed]),
        selection: StageSelection::DeepestFirst,
    };
    let max_num_seqs = rng.pick(&[1, 2, 4, 8]);
    let block_size = rng.pick(&[1, 2, 4]);
    // Room for the largest request (24 tokens) in every plane, and often not much more.
    let fits = 24usize.div_ceil(block_size) * usize::from(model.planes(model.max_loops));
    let cfg = SchedulerConfig {
        block_size,
        num_blocks: fits + rng.range(0, 80),
        max_num_seqs,
        max_num_batched_tokens: max_num_seqs + rng.range(0, 24),
        max_model_len: 64,
        enable_chunked_prefill: rng.pct(80),
        long_prefill_token_threshold: rng.pct(50).then(|| rng.range(1, 8)),
        preemption_policy: rng.pick(&[
            PreemptionPolicy::Fcfs,
            PreemptionPolicy::Priority,
            PreemptionPolicy::LeastWorkDone,
        ]),
        preemption_mode: rng.pick(&[PreemptionMode::Recompute, PreemptionMode::Yield]),
        max_steps_in_flight: rng.range(1, 3),
        enable_prefix_caching: rng.pct(50),
        looped: Some(model),
        ..small_cfg()
    };
    let loops = model.max_loops;
    let mut arrivals = Vec::new();
    for id in 1..=rng.range(1, 16) as u64 {
        let mut len = rng.range(1, 14);
        if !cfg.enable_chunked_prefill {
            len = len.min(cfg.max_num_batched_tokens);
        }
        let prompt: Vec<u32> = (0..len).map(|_| rng.range(1, 40) as u32).collect();
        let mut req = NewRequest::new(RequestId(id), prompt, rng.range(1, 10), Timestamp(0));
        req.eos_token_ids = vec![0];
        req.priority = rng.range(0, 2) as i32;
        req.max_loops = rng.pct(30).then(|| rng.range(1, usize::from(loops)) as u8);
        let step = rng.range(0, 30) as u64;
        arrivals.push(Arrival { step, req });
    }
    let opts = SimOpts {
        eos_pct: 8,
        abort_pct: rng.pick(&[0, 0, 3]),
        refuse_pct: rng.pick(&[0, 0, 2]),
        pipeline_pct: 70,
        exit_pct: rng.pick(&[0, 30, 60]),
        throttle_pct: rng.pick(&[0, 0, 30]),
        max_steps: 20_000,
        seed,
        ..SimOpts::default()
    };
    (cfg, arrivals, opts)
}

/// Seeds of [`random_looped_case`] that must drain, each invariant (rule 8: one pending work,
/// no stage before the previous one's result, one operation per step) checked after every
/// schedule and apply, the simulated executor writing each stage's plane. Coverage asserted:
/// early exits, chains dropped by preemption, mixed-policy steps, pipelined steps and aborts
/// each occur in a share of the seeds.
#[test]
fn random_looped_workloads_drain_holding_every_invariant() {
    let seeds = 600;
    let (mut exits, mut dropped, mut mixed, mut pipelined, mut aborts) = (0, 0, 0, 0, 0);
    for seed in 0..seeds {
        let (cfg, arrivals, opts) = random_looped_case(seed);
        let report = run(&cfg, &arrivals, &opts).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        exits += u64::from(report.chains_exited_early > 0);
        dropped += u64::from(report.chains_dropped > 0);
        mixed += u64::from(report.mixed_stage_steps > 0);
        pipelined += u64::from(report.max_in_flight_seen > 1);
        aborts += u64::from(report.finished.values().any(|&f| f == FinishReason::Abort));
        assert!(report.chains > 0 || report.finished.len() == arrivals.len(), "seed {seed}");
    }
    let shares = [
        ("chains exiting early", exits, 25),
        ("chains dropped by a preemption", dropped, 5),
        ("mixed-policy steps", mixed, 10),
        ("pipelined steps", pipelined, 30),
        ("aborts", aborts, 10),
    ];
    for (name, n, min_pct) in shares {
        eprintln!("{name}: {n} of {seeds} seeds");
        assert!(n * 100 >= seeds * min_pct, "{name} in {n} of {seeds} seeds, under {min_pct} %");
    }
}
