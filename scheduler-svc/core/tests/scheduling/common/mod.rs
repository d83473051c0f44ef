//! Test harness shared by the integration tests: a seeded RNG and a simulated executor that
//! drives a [`Scheduler`] through a workload, checking invariants after every schedule and
//! every apply, and checking that the workload drains.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet, VecDeque};

use ferry_sched_core::*;

/// `SplitMix64`: tiny, seedable, good enough for test workloads.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5851_f42d_4c95_7f2d)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        if hi <= lo {
            return lo;
        }
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// True with probability `pct` percent.
    pub fn pct(&mut self, pct: u64) -> bool {
        self.next_u64() % 100 < pct
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.range(0, items.len() - 1)]
    }
}

/// A request and the step it arrives at.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub step: u64,
    pub req: NewRequest,
}

/// How the simulated executor and the driver behave.
#[derive(Debug, Clone)]
pub struct SimOpts {
    /// Percent chance a sampled token is EOS (token 0).
    pub eos_pct: u64,
    /// Percent chance per step of aborting a random live request.
    pub abort_pct: u64,
    /// Percent chance a KV transfer fails.
    pub kv_fail_pct: u64,
    /// Steps until a KV transfer is reported.
    pub kv_delay: u64,
    /// With two steps in flight: percent chance of building another step before applying.
    pub pipeline_pct: u64,
    /// Percent chance, per step, of re-adding a retired id (id reuse).
    pub reuse_pct: u64,
    /// Percent chance per step that the executor refuses one of the step's requests (it then
    /// samples nothing for it in that step or any later one).
    pub refuse_pct: u64,
    /// Percent chance a sampled token repeats the prompt (the token at the same position
    /// modulo the prompt's length), so outputs quote their prompts and n-gram drafts are
    /// sometimes right.
    pub echo_pct: u64,
    /// Percent chance a step is one a data-parallel group throttles (not an aligned prefill
    /// round): [`Scheduler::schedule_throttled`].
    pub throttle_pct: u64,
    /// A looped model's recurrent loop reports its chain's exit with this probability.
    pub exit_pct: u64,
    /// Give up (livelock) after this many steps.
    pub max_steps: u64,
    pub seed: u64,
}

impl Default for SimOpts {
    fn default() -> Self {
        SimOpts {
            eos_pct: 5,
            abort_pct: 0,
            kv_fail_pct: 0,
            kv_delay: 1,
            pipeline_pct: 70,
            reuse_pct: 0,
            refuse_pct: 0,
            echo_pct: 0,
            throttle_pct: 0,
            exit_pct: 0,
            max_steps: 20_000,
            seed: 0,
        }
    }
}

/// What a run observed.
#[derive(Debug, Default)]
pub struct Report {
    pub steps: u64,
    pub finished: HashMap<RequestId, FinishReason>,
    pub preemptions: u64,
    pub tokens: u64,
    pub max_running: usize,
    pub imports: u64,
    pub exports: u64,
    pub max_in_flight_seen: usize,
    /// Blocks the core had the executor write to the KV tier.
    pub tier_stored: u64,
    /// Live requests the executor refused (each finished with an error at once).
    pub refused: u64,
    /// Verifications, their draft tokens and the draft tokens accepted.
    pub spec_drafts: u64,
    pub spec_draft_tokens: u64,
    pub spec_accepted: u64,
    /// Samples that forked from their source's prompt KV, and the partial blocks they copied.
    pub forks: u64,
    pub fork_copies: u64,
    /// Blocks the executor's copy of the prefix cache took in (checked to hold their content).
    pub cached_reported: u64,
    /// Steps that held prefills back for the throttle (checked to carry no prompt work).
    pub prefills_deferred: u64,
    /// A looped model's chains completed, those that exited early, those a preemption
    /// dropped, and steps that ran prompt and decode work of one stage together.
    pub chains: u64,
    pub chains_exited_early: u64,
    pub chains_dropped: u64,
    pub mixed_stage_steps: u64,
    /// Times a request waited for its LoRA adapter (`max_loras` others held).
    pub lora_waits: u64,
}

/// The events whose coverage the property tests assert, in [`Report::events`]' order.
pub const EVENTS: [&str; 10] = [
    "preemption",
    "KV import",
    "KV export",
    "abort",
    "pipelined steps",
    "refusal",
    "verification accepting some drafts and rejecting others",
    "sample forking from its source, copying a partial block",
    "prefills deferred by a data-parallel group's throttle",
    "request waiting for its LoRA adapter (max_loras others held)",
];

impl Report {
    /// Which of [`EVENTS`] happened in this run.
    pub fn events(&self) -> [bool; 10] {
        [
            self.preemptions > 0,
            self.imports > 0,
            self.exports > 0,
            self.finished.values().any(|&f| f == FinishReason::Abort),
            self.max_in_flight_seen > 1,
            self.refused > 0,
            self.spec_accepted > 0 && self.spec_accepted < self.spec_draft_tokens,
            self.fork_copies > 0,
            self.prefills_deferred > 0,
            self.lora_waits > 0,
        ]
    }
}

/// Asserts that each of [`EVENTS`] happened in at least `min_pct` percent of `runs` runs
/// (`seen`: in how many it did), so a generator that stops exercising one fails instead of
/// passing vacuously.
pub fn assert_coverage(seen: [u64; 10], runs: u64, min_pct: [u64; 10], unit: &str) {
    for ((name, n), min_pct) in EVENTS.iter().zip(seen).zip(min_pct) {
        eprintln!("{name}: {n} of {runs} {unit}");
        assert!(
            n * 100 >= runs * min_pct,
            "{name} occurred in {n} of {runs} {unit}, below the {min_pct} % this test must cover"
        );
    }
}

/// The token the simulated executor samples at output position `pos`: deterministic in
/// (seed, id, position, prompt); EOS (0) with probability `eos_pct`, else the prompt's token
/// at `pos` modulo its length with probability `echo_pct`, else a random one.
fn sample(seed: u64, id: RequestId, pos: usize, prompt: &[u32], opts: &SimOpts) -> u32 {
    let mut r = Rng::new(seed ^ id.0.wrapping_mul(0x100_0193) ^ ((pos as u64) << 40));
    if r.pct(opts.eos_pct) {
        0
    } else if !prompt.is_empty() && r.pct(opts.echo_pct) {
        prompt[pos % prompt.len()]
    } else {
        r.range(1, 40) as u32
    }
}

fn check(core: &Scheduler, when: &str, step: u64) -> Result<(), String> {
    core.check_invariants().map_err(|e| format!("step {step} after {when}: {e}"))
}

/// Drive `cfg` through `arrivals` with a simulated executor until drained. One function: it
/// reads top to bottom as one step's phases (arrivals, aborts, schedule, execute, apply, check),
/// which sharing a dozen locals between helpers would obscure.
#[allow(clippy::too_many_lines)]
pub fn run(cfg: &SchedulerConfig, arrivals: &[Arrival], opts: &SimOpts) -> Result<Report, String> {
    let mut core = Scheduler::new(cfg.clone()).map_err(|e| format!("config: {e}"))?;
    let mut rng = Rng::new(opts.seed.wrapping_mul(7919));
    // A stream of its own, so the other draws (and the regression seeds' runs) stay.
    let mut throttle_rng = Rng::new(opts.seed ^ 0x5448_524f);
    let mut report = Report::default();
    let mut pending: VecDeque<StepOutcome> = VecDeque::new();
    let mut transfers: Vec<(TransferId, u64, bool)> = Vec::new();
    let mut events = Vec::new();
    let mut live: Vec<RequestId> = Vec::new();
    let mut outputs: HashMap<RequestId, usize> = HashMap::new();
    let mut max_tokens: HashMap<RequestId, usize> = HashMap::new();
    let mut retired: Vec<NewRequest> = Vec::new();
    let mut finished_once: HashSet<RequestId> = HashSet::new();
    let mut next = 0;
    let mut order: Vec<&Arrival> = arrivals.iter().collect();
    order.sort_by_key(|a| a.step);
    let mut step = 0u64;
    let mut next_reuse_transfer = 1_000_000u64;
    let mut exec = ExecutorModel::default();
    let mut reuses_left = arrivals.len() / 2;
    // The executor's refusals: from a stream of their own, so the other draws stay.
    let mut refusals = Rng::new(opts.seed ^ 0x7265_6675);
    let mut refused: HashSet<RequestId> = HashSet::new();
    // Each request's prompt and salt (a reused id keeps its request), for the content checks.
    let sequences: HashMap<RequestId, (Vec<u32>, u64)> =
        arrivals.iter().map(|a| (a.req.id, (a.req.prompt.to_vec(), a.req.cache_salt))).collect();
    loop {
        step += 1;
        let now = Timestamp(step * 1_000_000);
        if step > opts.max_steps {
            return Err(format!(
                "did not drain after {} steps: {:?}; live {:?}",
                opts.max_steps,
                core.stats(),
                core.request_views().take(8).collect::<Vec<_>>()
            ));
        }
        while next < order.len() && order[next].step <= step {
            let req = order[next].req.clone();
            next += 1;
            add(&mut core, req, &mut live, &mut outputs, &mut max_tokens, &mut finished_once)?;
        }
        if !retired.is_empty() && reuses_left > 0 && rng.pct(opts.reuse_pct) {
            reuses_left -= 1;
            let mut req = retired.swap_remove(0);
            if !core.contains(req.id) {
                req.fork = Fork::None; // its source is gone: a reused id comes alone
                req.arrival = now;
                next_reuse_transfer += 1;
                if let Some(imp) = &mut req.kv_import {
                    imp.transfer_id = TransferId(next_reuse_transfer);
                }
                if let Some(tid) = &mut req.kv_export {
                    *tid = TransferId(next_reuse_transfer);
                }
                refused.remove(&req.id); // the executor forgot it when it was finished
                add(&mut core, req, &mut live, &mut outputs, &mut max_tokens, &mut finished_once)?;
            }
        }
        if !live.is_empty() && rng.pct(opts.abort_pct) {
            let id = live[rng.range(0, live.len() - 1)];
            match core.abort(id, now) {
                Ok(done) => {
                    if done.reason != FinishReason::Abort || !finished_once.insert(id) {
                        return Err(format!("abort of {id} reported {done:?} / twice"));
                    }
                    report.finished.insert(id, FinishReason::Abort);
                    live.retain(|&l| l != id);
                }
                Err(e) => return Err(format!("abort of live {id} failed: {e}")),
            }
            check(&core, "abort", step)?;
        }
        let apply_now = pending.len() >= cfg.max_steps_in_flight
            || (!pending.is_empty() && (!rng.pct(opts.pipeline_pct) || next == order.len()));
        if apply_now {
            let outcome = pending.pop_front().expect("non-empty");
            exec.on_apply();
            events.clear();
            let refused_live: Vec<RequestId> =
                outcome.refused.iter().copied().filter(|id| live.contains(id)).collect();
            core.apply_result(&outcome, now, &mut events)
                .map_err(|e| format!("step {step}: apply: {e}"))?;
            for id in refused_live {
                let ended = events.iter().any(|e| {
                    matches!(e, RequestEvent::Finished(d) if d.id == id && d.reason == FinishReason::Error)
                });
                if !ended {
                    return Err(format!("step {step}: refused {id} did not finish with an error"));
                }
                report.refused += 1;
            }
            for e in &events {
                match e {
                    &RequestEvent::Token { id, index, .. } => {
                        let n = outputs.entry(id).or_default();
                        if index != *n {
                            return Err(format!("{id}: token index {index}, expected {n}"));
                        }
                        *n += 1;
                        report.tokens += 1;
                        if *n > max_tokens[&id] {
                            return Err(format!("{id}: more than max_tokens"));
                        }
                    }
                    RequestEvent::Finished(done) => {
                        if !finished_once.insert(done.id) {
                            return Err(format!("{} finished twice", done.id));
                        }
                        if done.stats.output_tokens != outputs.get(&done.id).copied().unwrap_or(0) {
                            return Err(format!("{}: finish counters disagree", done.id));
                        }
                        report.finished.insert(done.id, done.reason);
                        live.retain(|&l| l != done.id);
                    }
                    RequestEvent::Imported { .. } => report.imports += 1,
                    RequestEvent::ExportStarted { .. } => report.exports += 1,
                }
            }
            check(&core, "apply", step)?;
        }
        // Remember retired ids for reuse.
        if opts.reuse_pct > 0 && reuses_left > 0 {
            for a in arrivals {
                if finished_once.contains(&a.req.id)
                    && !core.contains(a.req.id)
                    && retired.len() < 4
                    && !retired.iter().any(|r| r.id == a.req.id)
                    && !live.contains(&a.req.id)
                {
                    retired.push(a.req.clone());
                }
            }
        }
        if std::env::var("FERRY_CORE_TRACE").is_ok() {
            eprintln!(
                "step {step}: pending {} drained {:?} stats {:?}",
                pending.len(),
                core.check_drained(),
                core.stats()
            );
        }
        if next == order.len() && pending.is_empty() && core.is_drained() {
            core.check_drained().map_err(|e| e.to_string())?;
            report.steps = step;
            report.preemptions = core.stats().num_preemptions;
            report.forks = core.stats().forks;
            report.fork_copies = core.stats().fork_copied_blocks;
            report.chains = core.stats().chains_completed;
            report.chains_exited_early = core.stats().chains_exited_early;
            report.chains_dropped = core.stats().chains_dropped;
            if !live.is_empty() {
                return Err(format!("drained with {} requests never finished", live.len()));
            }
            report.lora_waits = core.stats().lora_waits;
            return Ok(report);
        }
        // Build a step unless the pipeline is full or there is nothing left to tell the executor.
        let idle = next == order.len() && core.request_views().next().is_none();
        if pending.len() < cfg.max_steps_in_flight && !idle {
            let deferred = core.stats().prefills_deferred;
            let throttle = throttle_rng.pct(opts.throttle_pct);
            core.schedule_throttled(now, throttle).map_err(|e| format!("step {step}: {e}"))?;
            let plan = core.last_plan();
            if core.stats().prefills_deferred > deferred {
                report.prefills_deferred += 1;
                let prompt = plan.scheduled.iter().find(|w| w.work.is_prompt());
                if !throttle || prompt.is_some() || !plan.new_requests.is_empty() {
                    return Err(format!("step {step}: a deferred step ran prompt work {prompt:?}"));
                }
            }
            let content = |owner: RequestId, index: usize| {
                block_content_hash(&sequences, owner, index, cfg.block_size, opts)
            };
            // A fork's copy holds the KV of its prompt but the last token.
            let forked_from = |src: Content, owner: RequestId, index: usize| {
                let (prompt, salt) = &sequences[&owner];
                let upto = prompt.len() - 1;
                holds_prefix(&sequences, src, index, (prompt, *salt), upto, cfg.block_size, opts)
            };
            exec.on_plan(plan, &core, cfg.block_size, &content, &forked_from)
                .map_err(|e| format!("step {step}: protocol: {e}"))?;
            let mut outcome = StepOutcome { step_id: plan.step_id, ..StepOutcome::default() };
            if !plan.scheduled.is_empty() && refusals.pct(opts.refuse_pct) {
                let k = refusals.range(0, plan.scheduled.len() - 1);
                refused.insert(plan.scheduled[k].id);
            }
            // A refused request samples nothing, here or in any later step that names it.
            let mut named: Vec<RequestId> =
                plan.scheduled.iter().map(|w| w.id).filter(|id| refused.contains(id)).collect();
            named.dedup();
            outcome.refused = named;
            report.cached_reported += exec
                .on_ran(plan, !outcome.refused.is_empty(), &content)
                .map_err(|e| format!("step {step}: executor's cache: {e}"))?;
            for w in plan.scheduled.iter().filter(|w| w.samples_token && !refused.contains(&w.id)) {
                let pos =
                    outputs.get(&w.id).copied().unwrap_or(0) + pending_samples(&pending, w.id);
                let prompt = &sequences[&w.id].0;
                // A verification returns what decoding would, one token at a time, as long as
                // each is the draft's next: the accepted drafts and the token after them.
                let draft = plan.draft_of(w);
                for j in 0..=draft.len() {
                    let token = sample(opts.seed, w.id, pos + j, prompt, opts);
                    outcome.sampled.push(SampledToken { id: w.id, token });
                    if draft.get(j) != Some(&token) {
                        break;
                    }
                }
                if !draft.is_empty() {
                    let accepted = outcome.sampled.iter().filter(|s| s.id == w.id).count() - 1;
                    report.spec_drafts += 1;
                    report.spec_draft_tokens += draft.len() as u64;
                    report.spec_accepted += accepted as u64;
                    exec.rejected(w.id, draft.len() - accepted);
                }
            }
            for w in plan.scheduled.iter().filter(|w| w.work.operation() == Operation::Recurrent) {
                let start = exec.tables.get(&w.id).map_or(0, |t| t.1);
                let mut r = Rng::new(
                    opts.seed
                        ^ w.id.0.wrapping_mul(0x9e37)
                        ^ (u64::from(w.loop_index) << 32)
                        ^ ((start as u64) << 40),
                );
                if !refused.contains(&w.id) && r.pct(opts.exit_pct) {
                    outcome.exited.push(w.id);
                }
            }
            let ops: HashSet<_> = plan.scheduled.iter().map(|w| w.work.operation()).collect();
            if ops.len() > 1 || ops.iter().any(|&op| op != plan.operation) {
                return Err(format!("step {step}: {:?} step runs {ops:?}", plan.operation));
            }
            let prompt = plan.scheduled.iter().any(|w| w.work.is_prompt());
            let decode = plan.scheduled.iter().any(|w| !w.work.is_prompt());
            if plan.operation != Operation::Whole && prompt && decode {
                report.mixed_stage_steps += 1;
            }
            for op in &plan.kv_ops {
                let tid = match *op {
                    KvOp::Import { transfer_id, .. } | KvOp::Export { transfer_id, .. } => {
                        transfer_id
                    }
                    KvOp::Store { block_ids, .. } => {
                        report.tier_stored += plan.blocks(block_ids).len() as u64;
                        continue;
                    }
                };
                transfers.push((tid, step + opts.kv_delay, !rng.pct(opts.kv_fail_pct)));
            }
            // Transfers due are reported with this step's result.
            transfers.retain(|&(tid, due, ok)| {
                if due <= step {
                    outcome.kv_results.push(KvResult { transfer_id: tid, ok });
                    false
                } else {
                    true
                }
            });
            report.max_running = report.max_running.max(core.stats().num_running);
            pending.push_back(outcome);
            report.max_in_flight_seen = report.max_in_flight_seen.max(pending.len());
            check(&core, "schedule", step)?;
        }
    }
}

/// What an executor would know, rebuilt only from step plans: checks that the diff protocol
/// is enough to reconstruct every block table and computed-token count, and that no block is
/// handed to another request while an in-flight step still writes it.
#[derive(Default)]
struct ExecutorModel {
    tables: HashMap<RequestId, (Vec<BlockId>, usize)>,
    /// A looped model's requests' loops (their KV planes).
    loops: HashMap<RequestId, u8>,
    /// A looped model's requests' chain in progress, as the executor sees it: loops run.
    chains: HashMap<RequestId, u8>,
    writes: VecDeque<Vec<(BlockId, RequestId)>>,
    /// What each block holds, as the executor would see it after the steps so far.
    content: HashMap<BlockId, Content>,
    /// The executor's copy of the prefix cache, kept from the plans' cache changes as the real
    /// executor keeps it (evictions before the step, registrations after it when nothing was
    /// refused): what a new leader would adopt. It must never name a block whose content is
    /// another's.
    cached: HashMap<BlockId, BlockHash>,
}

/// A block's content in the simulated executor.
#[derive(Clone, Copy)]
enum Content {
    /// Computed, for block `.1` of request `.0`'s sequence.
    Computed(RequestId, usize),
    /// Imported: the KV of the block named by this hash.
    Imported(BlockHash),
}

/// The hash of block `index` of request `owner`'s sequence: its prompt, then the simulated
/// executor's tokens (a function of the request and position alone).
fn block_content_hash(
    sequences: &HashMap<RequestId, (Vec<u32>, u64)>,
    owner: RequestId,
    index: usize,
    block_size: usize,
    opts: &SimOpts,
) -> Option<BlockHash> {
    let (tokens, salt) = sequence(sequences, owner, (index + 1) * block_size, opts)?;
    let mut hashes = Vec::new();
    extend_block_hashes(&mut hashes, &tokens, block_size, salt);
    hashes.get(index).copied()
}

/// The first `len` tokens of request `owner`'s sequence (its prompt, then the simulated
/// executor's tokens), and its salt.
fn sequence(
    sequences: &HashMap<RequestId, (Vec<u32>, u64)>,
    owner: RequestId,
    len: usize,
    opts: &SimOpts,
) -> Option<(Vec<u32>, u64)> {
    let (prompt, salt) = sequences.get(&owner)?;
    let mut tokens = prompt.clone();
    tokens.extend(
        (0..len.saturating_sub(prompt.len())).map(|k| sample(opts.seed, owner, k, prompt, opts)),
    );
    tokens.truncate(len);
    Some((tokens, *salt))
}

/// True if `content`, as block `index` of a table, holds the KV of the first `upto` tokens of
/// `prompt` under `salt` (those of them in that block): computed for a sequence that starts
/// with them, or imported under the hash of such a sequence's block.
fn holds_prefix(
    sequences: &HashMap<RequestId, (Vec<u32>, u64)>,
    content: Content,
    index: usize,
    (prompt, salt): (&[u32], u64),
    upto: usize,
    block_size: usize,
    opts: &SimOpts,
) -> bool {
    let starts_with = |owner: RequestId| {
        sequence(sequences, owner, upto, opts)
            .is_some_and(|(t, s)| t.len() == upto && t == prompt[..upto] && s == salt)
    };
    match content {
        Content::Computed(owner, i) => i == index && starts_with(owner),
        Content::Imported(hash) => sequences.keys().any(|&owner| {
            starts_with(owner)
                && block_content_hash(sequences, owner, index, block_size, opts) == Some(hash)
        }),
    }
}

impl ExecutorModel {
    fn on_plan(
        &mut self,
        plan: &StepPlan,
        core: &Scheduler,
        block_size: usize,
        content_hash: &dyn Fn(RequestId, usize) -> Option<BlockHash>,
        forked_from: &dyn Fn(Content, RequestId, usize) -> bool,
    ) -> Result<(), String> {
        self.on_kv_ops(plan, content_hash)?;
        for id in &plan.finished {
            if self.tables.remove(id).is_none() {
                return Err(format!("finished {id} unknown to the executor"));
            }
        }
        for id in &plan.preempted {
            if !self.tables.contains_key(id) {
                return Err(format!("preempted {id} unknown to the executor"));
            }
            self.chains.remove(id);
        }
        for n in &plan.new_requests {
            if self.tables.contains_key(&n.id) {
                return Err(format!("new {} already known", n.id));
            }
            self.tables.insert(n.id, (plan.blocks(n.block_ids).to_vec(), n.num_computed_tokens));
            self.loops.insert(n.id, n.max_loops);
        }
        for c in &plan.cached_requests {
            let Some((table, computed)) = self.tables.get_mut(&c.id) else {
                return Err(format!("cached {} unknown", c.id));
            };
            if c.resumed {
                *table = plan.blocks(c.block_ids).to_vec();
                *computed = c.num_computed_tokens;
                self.chains.remove(&c.id);
            } else {
                table.extend_from_slice(plan.blocks(c.block_ids));
                if *computed != c.num_computed_tokens {
                    return Err(format!(
                        "{}: executor computed {} vs {}",
                        c.id, computed, c.num_computed_tokens
                    ));
                }
            }
        }
        self.on_copies(plan, forked_from)?;
        let mut writes = Vec::new();
        for w in &plan.scheduled {
            self.chain_stage(w)?;
            let Some((table, computed)) = self.tables.get_mut(&w.id) else {
                return Err(format!("scheduled {} unknown to the executor", w.id));
            };
            let core_table = core.block_table(w.id).ok_or("scheduled request retired")?;
            if table.as_slice() != core_table {
                return Err(format!(
                    "{}: executor table {:?} != core {:?}",
                    w.id, table, core_table
                ));
            }
            let end = *computed + w.num_tokens;
            // A looped request's table holds a row of planes per block of positions; a stage
            // writes its own plane, and its chain's tokens count as computed at its coda.
            let (planes, plane) = match core.config().looped {
                Some(m) if w.work.operation() != Operation::Whole => {
                    let loops = self.loops[&w.id];
                    (usize::from(m.planes(loops)), m.plane(w.work.operation(), w.loop_index, loops))
                }
                _ => (1, Some(0)),
            };
            if end > table.len() / planes * block_size {
                return Err(format!("{}: writes past its blocks", w.id));
            }
            for pos in (*computed..end).filter(|_| plane.is_some()) {
                let index = pos / block_size;
                let b = table[index * planes + usize::from(plane.unwrap_or(0))];
                // A block the executor names cached is written only with the same content (a
                // prompt cached whole recomputes its last token).
                if let Some(&h) = self.cached.get(&b) {
                    if content_hash(w.id, index) != Some(h) {
                        return Err(format!(
                            "{}: writes block {b:?}, which the executor caches as {h:?}",
                            w.id
                        ));
                    }
                }
                writes.push((b, w.id));
                self.content.insert(b, Content::Computed(w.id, index));
            }
            if matches!(w.work.operation(), Operation::Whole | Operation::Coda) {
                *computed = end;
            }
        }
        // Fence safety, with or without prefix caching: no block is written for one request
        // while a step still in flight writes it for another.
        for &(b, owner) in &writes {
            for step in &self.writes {
                if let Some(&(_, other)) = step.iter().find(|&&(ob, o)| ob == b && o != owner) {
                    return Err(format!(
                        "block {b:?} written by {owner} while in-flight step writes it for {other}"
                    ));
                }
            }
        }
        self.writes.push_back(writes);
        Ok(())
    }

    /// A chain's stages come in order: prelude, loops 1, 2, … within the request's loops (each
    /// after the last), coda after a loop.
    fn chain_stage(&mut self, w: &ScheduledWork) -> Result<(), String> {
        let chain = self.chains.get(&w.id).copied();
        match (w.work.operation(), chain) {
            (Operation::Prelude, _) => {
                self.chains.insert(w.id, 0);
            }
            (Operation::Recurrent, Some(l))
                if w.loop_index == l + 1 && w.loop_index <= self.loops[&w.id] =>
            {
                self.chains.insert(w.id, w.loop_index);
            }
            (Operation::Coda, Some(l)) if l > 0 => {
                self.chains.remove(&w.id);
            }
            (Operation::Whole, None) => {}
            (op, chain) => {
                return Err(format!("{}: {op:?} loop {} after {chain:?}", w.id, w.loop_index));
            }
        }
        Ok(())
    }

    /// Evictions first (the step may write those blocks), then the KV operations, which run
    /// at the start of the step: tier stores read, imports write.
    fn on_kv_ops(
        &mut self,
        plan: &StepPlan,
        content_hash: &dyn Fn(RequestId, usize) -> Option<BlockHash>,
    ) -> Result<(), String> {
        for b in &plan.cache.evicted {
            self.cached.remove(b);
        }
        // A block copied to the KV tier (at the start of the step, after every earlier step
        // ran) holds the content its hash names.
        for op in &plan.kv_ops {
            if let KvOp::Store { block_ids, block_hashes } = *op {
                let (blocks, hashes) = (plan.blocks(block_ids), plan.hashes(block_hashes));
                if blocks.is_empty() || blocks.len() != hashes.len() {
                    return Err(format!(
                        "a tier store of {} blocks names {} hashes",
                        blocks.len(),
                        hashes.len()
                    ));
                }
                for (&b, &h) in blocks.iter().zip(hashes) {
                    let holds = match self.content.get(&b) {
                        Some(&Content::Computed(owner, index)) => content_hash(owner, index),
                        Some(&Content::Imported(hash)) => Some(hash),
                        None => None,
                    };
                    if holds != Some(h) {
                        return Err(format!(
                            "block {b:?} stored to the KV tier as {h:?} holds {holds:?}"
                        ));
                    }
                }
            } else if let KvOp::Import { block_ids, block_hashes, .. } = *op {
                let hashes = plan.hashes(block_hashes);
                for (i, b) in plan.blocks(block_ids).iter().enumerate() {
                    if let Some(&h) = self.cached.get(b) {
                        return Err(format!(
                            "import into {b:?}, which the executor caches as {h:?}"
                        ));
                    }
                    match hashes.get(i) {
                        Some(&h) => self.content.insert(*b, Content::Imported(h)),
                        None => self.content.remove(b),
                    };
                }
            }
        }
        Ok(())
    }

    /// Block copies run before the forward: the block read holds the KV of a request with the
    /// same prompt at the same block of the table the copy starts.
    fn on_copies(
        &mut self,
        plan: &StepPlan,
        forked_from: &dyn Fn(Content, RequestId, usize) -> bool,
    ) -> Result<(), String> {
        // Block copies run before the forward: the block read holds the KV of a request with
        // the same prompt at the same block of the table the copy starts.
        for c in &plan.block_copies {
            // The forked sample starts a table in this step: new, or resumed after a
            // preemption.
            let mut starts = plan.new_requests.iter().map(|n| (&n.id, n.block_ids)).chain(
                plan.cached_requests.iter().filter(|c| c.resumed).map(|c| (&c.id, c.block_ids)),
            );
            let Some((owner, at)) = starts.find_map(|(id, span)| {
                Some((id, plan.blocks(span).iter().position(|&b| b == c.dst)?))
            }) else {
                return Err(format!(
                    "block copy into {:?}, which no table starting here holds",
                    c.dst
                ));
            };
            let Some(&src) = self.content.get(&c.src) else {
                return Err(format!("{owner}: block copy {c:?} reads a block never written"));
            };
            if !forked_from(src, *owner, at) {
                return Err(format!(
                    "{owner}: block copy {c:?} into block {at} of its table reads {}",
                    match src {
                        Content::Computed(from, index) => format!("{from}'s block {index}"),
                        Content::Imported(h) => format!("imported {h:?}"),
                    }
                ));
            }
            if let Some(&h) = self.cached.get(&c.dst) {
                return Err(format!(
                    "block copy into {:?}, which the executor caches as {h:?}",
                    c.dst
                ));
            }
            self.content.insert(c.dst, src);
        }
        Ok(())
    }

    /// The step ran: its registrations join the executor's copy of the cache unless a request
    /// was refused, and each holds the content its hash names.
    fn on_ran(
        &mut self,
        plan: &StepPlan,
        refused: bool,
        content_hash: &dyn Fn(RequestId, usize) -> Option<BlockHash>,
    ) -> Result<u64, String> {
        if refused {
            return Ok(0);
        }
        for &(b, h) in &plan.cache.cached {
            let holds = match self.content.get(&b) {
                Some(&Content::Computed(owner, index)) => content_hash(owner, index),
                Some(&Content::Imported(hash)) => Some(hash),
                None => None,
            };
            if holds != Some(h) {
                return Err(format!("block {b:?} reported cached as {h:?} holds {holds:?}"));
            }
            self.cached.insert(b, h);
        }
        Ok(plan.cache.cached.len() as u64)
    }

    fn on_apply(&mut self) {
        self.writes.pop_front();
    }

    /// A verification of `id` rejected `n` draft tokens: the executor computes from the first
    /// of them again.
    fn rejected(&mut self, id: RequestId, n: usize) {
        if let Some((_, computed)) = self.tables.get_mut(&id) {
            *computed -= n;
        }
    }
}

fn pending_samples(pending: &VecDeque<StepOutcome>, id: RequestId) -> usize {
    pending.iter().map(|o| o.sampled.iter().filter(|s| s.id == id).count()).sum()
}

fn add(
    core: &mut Scheduler,
    req: NewRequest,
    live: &mut Vec<RequestId>,
    outputs: &mut HashMap<RequestId, usize>,
    max_tokens: &mut HashMap<RequestId, usize>,
    finished_once: &mut HashSet<RequestId>,
) -> Result<(), String> {
    let id = req.id;
    let mt = req.max_tokens;
    core.add_request(req).map_err(|e| format!("add {id}: {e}"))?;
    live.push(id);
    outputs.insert(id, 0);
    max_tokens.insert(id, mt);
    finished_once.remove(&id);
    Ok(())
}

/// Make `arrivals[i]` the source of `extra` more samples of itself (parallel sampling), added
/// right after it with ids from `next_id` on. A request that moves KV stays alone.
pub fn add_samples(arrivals: &mut Vec<Arrival>, i: usize, extra: usize, next_id: &mut u64) {
    let a = &mut arrivals[i];
    if extra == 0 || a.req.kv_import.is_some() || a.req.kv_export.is_some() {
        return;
    }
    a.req.fork = Fork::Source;
    let (source, step) = (a.req.id, a.step);
    for _ in 0..extra {
        let mut req = arrivals[i].req.clone();
        req.id = RequestId(*next_id);
        *next_id += 1;
        req.fork = Fork::Of(source);
        arrivals.push(Arrival { step, req });
    }
}

// ---- helpers for the rule tests -------------------------------------------------------------

/// A small configuration: blocks of 4 tokens, 64 blocks, 4 slots, 32 tokens per step.
pub fn small_cfg() -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks: 64,
        max_num_seqs: 4,
        max_num_batched_tokens: 32,
        max_model_len: 128,
        enable_chunked_prefill: true,
        long_prefill_token_threshold: None,
        lookahead: 16,
        preemption_policy: PreemptionPolicy::Fcfs,
        preemption_mode: PreemptionMode::Recompute,
        max_preemptions: 4,
        max_kv_fetches: 2,
        enable_prefix_caching: true,
        max_steps_in_flight: 1,
        kv_tier_store_blocks_per_step: 0,
        speculative: None,
        looped: None,
        max_loras: 0,
    }
}

/// `len` distinct prompt tokens starting at `base`.
pub fn tokens(base: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| base + i).collect()
}

/// A request with EOS token 0.
pub fn req(id: u64, prompt: Vec<u32>, max_tokens: usize) -> NewRequest {
    let mut r = NewRequest::new(RequestId(id), prompt, max_tokens, Timestamp(0));
    r.eos_token_ids = vec![0];
    r
}

/// A scheduler plus a virtual clock, checking invariants after every call.
pub struct Harness {
    pub core: Scheduler,
    pub now: u64,
}

impl Harness {
    pub fn new(cfg: SchedulerConfig) -> Self {
        Harness { core: Scheduler::new(cfg).expect("valid test config"), now: 0 }
    }

    pub fn add(&mut self, mut r: NewRequest) {
        r.arrival = Timestamp(self.now);
        self.core.add_request(r).expect("valid test request");
        self.core.check_invariants().unwrap();
    }

    /// Build a step (one second of virtual time later) and return a copy of it.
    pub fn schedule(&mut self) -> StepPlan {
        self.now += 1_000_000_000;
        let plan = self.core.schedule(Timestamp(self.now)).expect("room for a step").clone();
        self.core.check_invariants().unwrap();
        plan
    }

    /// The result where every sampling request samples `token`.
    pub fn outcome(plan: &StepPlan, token: u32) -> StepOutcome {
        StepOutcome {
            step_id: plan.step_id,
            sampled: plan
                .scheduled
                .iter()
                .filter(|w| w.samples_token)
                .map(|w| SampledToken { id: w.id, token })
                .collect(),
            kv_results: Vec::new(),
            refused: Vec::new(),
            exited: Vec::new(),
        }
    }

    pub fn apply(&mut self, outcome: &StepOutcome) -> Vec<RequestEvent> {
        let mut events = Vec::new();
        self.core.apply_result(outcome, Timestamp(self.now), &mut events).expect("valid outcome");
        self.core.check_invariants().unwrap();
        events
    }

    /// A synchronous step in which every sampler samples `token`.
    pub fn step(&mut self, token: u32) -> (StepPlan, Vec<RequestEvent>) {
        let plan = self.schedule();
        let events = self.apply(&Self::outcome(&plan, token));
        (plan, events)
    }

    /// Step until drained (at most `max` steps), sampling `token`; returns the finishes.
    pub fn drain(&mut self, token: u32, max: usize) -> Vec<FinishedRequest> {
        let mut done = Vec::new();
        for _ in 0..max {
            if self.core.is_drained() {
                return done;
            }
            let (_, events) = self.step(token);
            done.extend(events.iter().filter_map(|e| match e {
                RequestEvent::Finished(f) => Some(**f),
                _ => None,
            }));
        }
        panic!("not drained after {max} steps: {:?}", self.core.check_drained());
    }

    pub fn view(&self, id: u64) -> RequestView {
        self.core.request_view(RequestId(id)).expect("live request")
    }
}

/// Ids of a plan's scheduled work, in order.
pub fn scheduled_ids(plan: &StepPlan) -> Vec<u64> {
    plan.scheduled.iter().map(|w| w.id.0).collect()
}

/// Finishes among events.
pub fn finishes(events: &[RequestEvent]) -> Vec<FinishedRequest> {
    events
        .iter()
        .filter_map(|e| match e {
            RequestEvent::Finished(f) => Some(**f),
            _ => None,
        })
        .collect()
}
