//! Benchmark harness: how long one step (`schedule` + `apply_result`) takes under
//! representative loads.
//!
//! This is the one module of the core that reads `std::time::Instant` — for measurement only,
//! around the calls it times; no scheduling decision ever sees it (the scheduler itself still
//! gets a virtual `Timestamp`). It lives in the library so the service binary can expose it
//! (`ferry-bench core`) and a smoke test can keep it from rotting.
//!
//! Each iteration times `schedule()` and `apply_result()` and adds the two; building the
//! simulated executor's result (one sampled token per sampling entry) and replacing finished
//! requests to keep the population steady happen outside the timed region.

use std::time::Instant;

use crate::{
    NewRequest, PreemptionMode, PreemptionPolicy, RequestEvent, RequestId, SampledToken, Scheduler,
    SchedulerConfig, StepOutcome, Timestamp,
};

/// What to run and for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchOptions {
    /// Timed iterations per scenario.
    pub iterations: usize,
    /// Untimed iterations before timing (after the population is set up).
    pub warmup: usize,
    /// Run only scenarios whose name contains this.
    pub filter: Option<String>,
    /// Small populations and few iterations: a smoke test, not a measurement.
    pub quick: bool,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions { iterations: 300, warmup: 50, filter: None, quick: false }
    }
}

/// One scenario's result.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchRow {
    /// Scenario name.
    pub scenario: String,
    /// Running requests at the end.
    pub running: usize,
    /// Waiting requests at the end.
    pub waiting: usize,
    /// Median step time (schedule + apply), microseconds.
    pub median_us: f64,
    /// 99th percentile step time, microseconds.
    pub p99_us: f64,
}

/// Shape of a scenario's requests and cache.
#[derive(Debug, Clone)]
struct Scenario {
    name: String,
    cfg: SchedulerConfig,
    /// Requests kept in the system (running + waiting); 0 for an open system fed only by
    /// `arrivals_per_step`.
    population: usize,
    prompt_len: usize,
    max_tokens: usize,
    /// New arrivals per step on top of replacements.
    arrivals_per_step: usize,
    /// Untimed steps to reach a steady state before warmup.
    setup_steps: usize,
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

fn scenarios(quick: bool, iterations: usize) -> Vec<Scenario> {
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
struct Driver {
    core: Scheduler,
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

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// Runs `sc`: its population, `untimed` steps, then `timed` steps (their costs, in µs).
fn measure(sc: &Scenario, untimed: usize, timed: usize) -> (Driver, Vec<f64>) {
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

/// The core's cost of one step (`schedule` plus `apply_result`) with `running` requests
/// decoding, median over `steps` steps, in µs: what a serving step of that batch spends
/// scheduling (the executor's bench reports it beside the forward's time).
pub fn decode_step_us(running: usize, steps: usize) -> f64 {
    let sc = decode_scenario(running.max(1), steps + 400);
    let (_, mut times) = measure(&sc, sc.setup_steps + 10, steps.max(1));
    times.sort_by(f64::total_cmp);
    percentile(&times, 0.5)
}

/// Run the scenarios selected by `opts` and return one row each.
pub fn run(opts: &BenchOptions) -> Vec<BenchRow> {
    let (iterations, warmup) = if opts.quick {
        (opts.iterations.min(5), opts.warmup.min(2))
    } else {
        (opts.iterations.max(1), opts.warmup)
    };
    let mut rows = Vec::new();
    for sc in scenarios(opts.quick, iterations + warmup) {
        if let Some(f) = &opts.filter {
            if !sc.name.contains(f.as_str()) {
                continue;
            }
        }
        let setup = if opts.quick { sc.setup_steps.min(40) } else { sc.setup_steps };
        let (d, mut times) = measure(&sc, setup + warmup, iterations);
        times.sort_by(f64::total_cmp);
        let stats = d.core.stats();
        rows.push(BenchRow {
            scenario: sc.name.clone(),
            running: stats.num_running,
            waiting: stats.num_waiting,
            median_us: percentile(&times, 0.5),
            p99_us: percentile(&times, 0.99),
        });
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_run_covers_every_scenario() {
        let rows = run(&BenchOptions { quick: true, ..BenchOptions::default() });
        let names: Vec<_> = rows.iter().map(|r| r.scenario.as_str()).collect();
        assert_eq!(names, ["decode-64", "decode-256", "mixed-prefill", "preemption", "waiting-2k"]);
        assert!(rows.iter().all(|r| r.median_us >= 0.0 && r.p99_us >= r.median_us));
        assert!(rows.iter().any(|r| r.waiting > 1000), "the waiting scenario keeps a queue");
    }
}
