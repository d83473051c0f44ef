//! The scenarios of `ferry-bench core` and the driver that runs them: a scheduler fed by a
//! simulated executor (one sampled token per sampling entry), its population kept steady by
//! replacing finished requests (or, open, fed only by arrivals).
//!
//! Each step times `schedule()` and `apply_result()` and adds the two; building the simulated
//! executor's result and replacing finished requests happen outside the timed region. The
//! clock (`std::time::Instant`) is read only around the calls it times; the scheduler itself
//! gets a virtual `Timestamp`, as in the service.

use std::time::Instant;

use ferry_sched_core::{
    NewRequest, PreemptionMode, PreemptionPolicy, RequestEvent, RequestId, SampledToken, Scheduler,
    SchedulerConfig, StepOutcome, Timestamp,
};

/// Shape of a scenario's requests and cache.
#[derive(Debug, Clone)]
pub(super) struct Scenario {
    pub(super) name: String,
    cfg: SchedulerConfig,
    /// Requests kept in the system (running + waiting); 0 for an open system fed only by
    /// `arrivals_per_step`.
    population: usize,
    prompt_len: usize,
    max_tokens: usize,
    /// New arrivals per step on top of replacements.
    arrivals_per_step: usize,
    /// Untimed steps to reach a steady state before warmup.
    pub(super) setup_steps: usize,
}

/// `n` requests decoding, with room for `horizon` steps each.
fn decode_scenario(n: usize, horizon: usize) -> Scenario {
    let prompt_len = 64;
    let max_tokens = horizon + 200;
    let max_model_len = prompt_len + 16 + max_tokens + 1;
    let cfg = SchedulerConfig {
        block_size: 16,
        num_blocks: n * max_model_len.div_ceil(16) + 64,
        max_num_seqs: n,
        max_num_batched_tokens: (2 * n).max(8192),
        lookahead: n,
        max_model_len,
        ..SchedulerConfig::default()
    };
    Scenario {
        name: format!("decode-{n}"),
        cfg,
        population: n,
        prompt_len,
        max_tokens,
        arrivals_per_step: 0,
        setup_steps: (n * (prompt_len + 16)).div_ceil((2 * n).max(8192)) + 4,
    }
}

/// The scenarios, sized for `iterations` timed and warm-up steps (small ones when `quick`).
pub(super) fn scenarios(quick: bool, iterations: usize) -> Vec<Scenario> {
    let mut out = Vec::new();
    let decode_sizes: &[usize] = if quick { &[64, 256] } else { &[64, 256, 1024, 4096, 16384] };
    let horizon = iterations + 400;
    for &n in decode_sizes {
        out.push(decode_scenario(n, horizon));
    }
    // Chunked prefill mixed with decode: one long prompt arrives per step.
    let mixed_lifetime = if quick { 32 } else { 256 };
    out.push(Scenario {
        name: "mixed-prefill".into(),
        cfg: SchedulerConfig {
            block_size: 16,
            num_blocks: 64 * 1024,
            max_num_seqs: 1024,
            max_num_batched_tokens: 2048,
            long_prefill_token_threshold: Some(512),
            max_model_len: 4096,
            ..SchedulerConfig::default()
        },
        population: 0,
        prompt_len: 1000,
        max_tokens: mixed_lifetime,
        arrivals_per_step: 1,
        setup_steps: mixed_lifetime + 50,
    });
    // Preemption pressure: the cache holds about half of the running requests' full contexts.
    let n = if quick { 64 } else { 512 };
    let (prompt_len, max_tokens) = (64usize, 512usize);
    out.push(Scenario {
        name: "preemption".into(),
        cfg: SchedulerConfig {
            block_size: 16,
            num_blocks: n * (prompt_len + max_tokens).div_ceil(16) / 2,
            max_num_seqs: n,
            max_num_batched_tokens: 4096.max(n),
            max_model_len: 2048,
            preemption_policy: PreemptionPolicy::Fcfs,
            preemption_mode: PreemptionMode::Recompute,
            ..SchedulerConfig::default()
        },
        population: n,
        prompt_len,
        max_tokens,
        arrivals_per_step: 0,
        setup_steps: 300,
    });
    // A long waiting queue behind 256 running requests.
    let waiting = if quick { 2_000 } else { 100_000 };
    out.push(Scenario {
        name: format!("waiting-{}k", waiting / 1000),
        cfg: SchedulerConfig {
            block_size: 16,
            num_blocks: 256 * 16 + 64,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 1024,
            ..SchedulerConfig::default()
        },
        population: 256 + waiting,
        prompt_len: 32,
        max_tokens: 64,
        arrivals_per_step: 0,
        setup_steps: 100,
    });
    out
}

/// Drives one scheduler with a simulated executor.
pub(super) struct Driver {
    pub(super) core: Scheduler,
    next_id: u64,
    step: u64,
    outcome: StepOutcome,
    events: Vec<RequestEvent>,
    prompt: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
}

impl Driver {
    fn now(&self) -> Timestamp {
        Timestamp(self.step * 20_000_000)
    }

    fn add(&mut self) {
        self.next_id += 1;
        let id = self.next_id;
        // Distinct prompts (no accidental prefix sharing), lengths staggered over a block so
        // requests do not all cross a block boundary in the same step.
        let len = self.prompt_len + (id % 16) as usize;
        self.prompt.clear();
        self.prompt.extend((0..len).map(|i| (id as u32).wrapping_mul(31).wrapping_add(i as u32)));
        let mut req =
            NewRequest::new(RequestId(id), self.prompt.as_slice(), self.max_tokens, self.now());
        req.ignore_eos = true;
        self.core.add_request(req).expect("bench scenarios only add valid requests");
    }

    /// One step with `arrivals` new requests, replacing finished ones if `replace`; returns
    /// the timed part in microseconds.
    fn step(&mut self, arrivals: usize, replace: bool) -> f64 {
        self.step += 1;
        let now = self.now();
        let t0 = Instant::now();
        let plan = self.core.schedule(now).expect("the driver applies every step before the next");
        let scheduled = t0.elapsed();
        self.outcome.step_id = plan.step_id;
        self.outcome.sampled.clear();
        self.outcome.kv_results.clear();
        for w in plan.scheduled.iter().filter(|w| w.samples_token) {
            self.outcome.sampled.push(SampledToken {
                id: w.id,
                token: (w.id.0 as u32).wrapping_add(self.step as u32) % 30_000 + 1,
            });
        }
        self.events.clear();
        let t1 = Instant::now();
        self.core
            .apply_result(&self.outcome, now, &mut self.events)
            .expect("the simulated result matches the plan");
        let applied = t1.elapsed();
        let finished =
            self.events.iter().filter(|e| matches!(e, RequestEvent::Finished(_))).count();
        let replacements = if replace { finished } else { 0 };
        for _ in 0..replacements + arrivals {
            self.add();
        }
        (scheduled + applied).as_secs_f64() * 1e6
    }
}

/// Runs `sc`: its population, `untimed` steps, then `timed` steps (their costs, in µs).
pub(super) fn measure(sc: &Scenario, untimed: usize, timed: usize) -> (Driver, Vec<f64>) {
    let core = Scheduler::new(sc.cfg.clone()).expect("bench configs are valid");
    let mut d = Driver {
        core,
        next_id: 0,
        step: 0,
        outcome: StepOutcome::default(),
        events: Vec::new(),
        prompt: Vec::new(),
        prompt_len: sc.prompt_len,
        max_tokens: sc.max_tokens,
    };
    for _ in 0..sc.population {
        d.add();
    }
    // A fixed population is kept steady by replacing finished requests; an open one (only
    // arrivals) reaches its own steady state.
    let replace = sc.population > 0;
    for _ in 0..untimed {
        d.step(sc.arrivals_per_step, replace);
    }
    let times = (0..timed).map(|_| d.step(sc.arrivals_per_step, replace)).collect();
    (d, times)
}
