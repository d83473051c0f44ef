//! A simulated executor: it builds a step with its core's `schedule`, takes the roofline's time
//! for that very batch, and at the step's end applies its result (one deterministic token per
//! sampling request) with the core's `apply_result`; then it records what the result told
//! (tokens, finishes, exports going out) and steps again while it has work.
//!
//! Invariant: one step in flight per executor (`busy`), as in a synchronous engine; an idle
//! executor is woken by new work or by the arrival of a transfer's bytes.

use ferry_roofline::{stage_cost, step_duration, SimBatchItem};
use ferry_sched_core::{FinishReason, KvOp, RequestEvent, SampledToken, Timestamp};

use crate::workload::{mix, shared_token};

use super::data_parallel::DataParallel;
use super::{ns, Event, Sim};

/// What planning an executor's step gave.
enum Planned {
    /// A step of `secs` computing `tokens` tokens.
    Step { secs: f64, tokens: u32 },
    /// Nothing to run; its empty result was applied (`resolved`: it reported transfers that
    /// ended, which may have made work).
    Idle { resolved: bool },
}

impl Sim<'_> {
    /// Executor `e` builds a step now unless one is running (it then steps when that ends);
    /// in a data-parallel group, the group's next round starts unless one runs.
    pub(super) fn wake(&mut self, e: usize) -> Result<(), String> {
        if let Some(dp) = self.spec.data_parallel {
            return self.wake_group(dp, dp.group_of(e));
        }
        if self.execs[e].busy {
            return Ok(());
        }
        match self.plan_step(e, false)? {
            Planned::Step { secs, .. } => self.post_step(e, secs),
            Planned::Idle { resolved: true } => return self.wake(e),
            Planned::Idle { resolved: false } => {}
        }
        Ok(())
    }

    /// Starts group `g`'s next round unless one runs or no rank has work: every rank plans its
    /// step, and the round ends for all when the slowest step and the all-to-all are done.
    fn wake_group(&mut self, dp: DataParallel, g: usize) -> Result<(), String> {
        let members = dp.members(g, self.execs.len());
        // A rank woken while the round is being planned (a continuation handed to it by a
        // rank's empty result) waits for the next round.
        if self.groups[g].planning {
            self.groups[g].rewake = true;
            return Ok(());
        }
        if members.clone().any(|m| self.execs[m].busy) {
            return Ok(());
        }
        // The round before, if one ran, has ended (every rank's step is done).
        let has_work = members.clone().any(|m| !self.execs[m].core.is_drained());
        self.groups[g].clock.end(has_work);
        if !has_work {
            return Ok(());
        }
        let throttle = self.groups[g].clock.start().throttle;
        let (mut longest, mut tokens, mut resolved) = (0.0f64, 0u32, false);
        let mut stepping = Vec::new();
        (self.groups[g].planning, self.groups[g].rewake) = (true, false);
        for m in members {
            match self.plan_step(m, throttle)? {
                Planned::Step { secs, tokens: t } => {
                    longest = longest.max(secs);
                    tokens = tokens.max(t);
                    stepping.push(m);
                }
                Planned::Idle { resolved: r } => resolved |= r,
            }
        }
        self.groups[g].planning = false;
        if stepping.is_empty() {
            // Nothing could run (waiting on transfers or fences): a transfer that ended, or
            // work handed to a rank meanwhile, may have made some; otherwise the next event
            // wakes the group.
            let again = resolved || self.groups[g].rewake;
            return if again { self.wake_group(dp, g) } else { Ok(()) };
        }
        self.dp_rounds += 1;
        let secs = longest + dp.all_to_all_secs(&self.spec.hardware, &self.spec.model, tokens);
        for m in stepping {
            self.post_step(m, secs);
        }
        Ok(())
    }

    /// Marks executor `e` busy for `secs` and posts its step's end.
    fn post_step(&mut self, e: usize, secs: f64) {
        let x = &mut self.execs[e];
        x.busy = true;
        x.step_secs = secs;
        self.post(self.now + ns(secs).max(1), Event::StepDone(e));
    }

    /// Builds executor `e`'s next step (`throttle`: a data-parallel group's throttled round)
    /// and says how long it takes, or, with nothing to run, applies its empty result now.
    fn plan_step(&mut self, e: usize, throttle: bool) -> Result<Planned, String> {
        let now = Timestamp(self.now);
        let (spec, items, work, kv_ops, tracks) =
            (self.spec, &mut self.items, &mut self.work, &mut self.kv_ops, &self.tracks);
        let (hardware, model) =
            (self.pools[self.model_of[e]].hardware, self.pools[self.model_of[e]].model);
        let (agent, tier_writes) = (&mut self.agents[e], &mut self.tier_writes);
        let x = &mut self.execs[e];
        let op;
        let idle = {
            let plan = x
                .core
                .schedule_throttled(now, throttle)
                .map_err(|err| format!("executor {e}: {err}"))?;
            x.outcome.step_id = plan.step_id;
            op = plan.operation;
            work.clear();
            work.extend_from_slice(&plan.scheduled);
            kv_ops.clear();
            kv_ops.extend_from_slice(&plan.kv_ops);
            // KV-tier writes land in the node's agent now (off the step's critical path).
            if let Some(tier) = spec.kv_tier {
                for op in &plan.kv_ops {
                    if let KvOp::Store { block_hashes, .. } = op {
                        let hashes = plan.hashes(*block_hashes);
                        for h in hashes {
                            agent.put(*h, tier.blocks_per_agent);
                        }
                        *tier_writes += hashes.len() as u64;
                    }
                }
            }
            plan.is_idle()
        };
        x.outcome.sampled.clear();
        x.outcome.kv_results.clear();
        x.outcome.exited.clear();
        items.clear();
        for w in work.iter() {
            if let Some(looped) = spec.looped.filter(|_| w.loop_index > 0) {
                if looped.exits_after(w.loop_index) {
                    x.outcome.exited.push(w.id);
                }
            }
            // Computed tokens advance when a step is built: the context is what came before.
            let computed =
                x.core.request_view(w.id).map_or(w.num_tokens, |v| v.num_computed_tokens);
            items.push(SimBatchItem {
                new_tokens: w.num_tokens as u32,
                context_len: computed.saturating_sub(w.num_tokens) as u32,
            });
            if w.samples_token {
                // A conversation's answer is its own sequence's next tokens, so the next turn,
                // which repeats it, finds its KV cached.
                let conversation = tracks.get(&w.id.0).and_then(|t| t.conversation);
                let token = if let Some(c) = conversation {
                    shared_token(c, computed as u64, model.vocab_size)
                } else {
                    let vocab = u64::from(model.vocab_size.max(1));
                    (mix((w.id.0 << 24) ^ computed as u64) % vocab) as u32
                };
                x.outcome.sampled.push(SampledToken { id: w.id, token });
            }
        }
        self.start_transfers(e);
        if idle {
            // Nothing to run (the plan may still tell the executor of finished requests): its
            // result is due now, with the transfers that ended; those may make work.
            self.due_kv_results(e);
            let x = &mut self.execs[e];
            let resolved = !x.outcome.kv_results.is_empty();
            self.events.clear();
            x.core
                .apply_result(&x.outcome, now, &mut self.events)
                .map_err(|err| format!("executor {e}: {err}"))?;
            x.busy = false;
            self.check(e)?;
            self.handle_events(e)?;
            return Ok(Planned::Idle { resolved });
        }
        let x = &mut self.execs[e];
        let secs = match spec.looped {
            Some(looped) => {
                let span = looped.span(op, model.num_layers);
                stage_cost(&hardware, &model, &self.items, span).total().as_secs_f64()
            }
            None => step_duration(&hardware, &model, &self.items).as_secs_f64(),
        };
        let tokens = self.items.iter().map(|i| i.new_tokens).sum();
        x.kv_usage = x.core.stats().kv_usage;
        self.kv_max = self.kv_max.max(x.kv_usage);
        self.check(e)?;
        Ok(Planned::Step { secs, tokens })
    }

    /// With `check_invariants`, checks executor `e`'s core, naming it in the error.
    fn check(&self, e: usize) -> Result<(), String> {
        if self.spec.check_invariants {
            self.execs[e]
                .core
                .check_invariants()
                .map_err(|v| format!("executor {e}: invariant broken: {v:?}"))?;
        }
        Ok(())
    }

    /// Executor `e`'s step ended: with a control-plane cost, its shard's scheduler streams the
    /// result when its CPU is free ([`Self::streamed`] then); at once otherwise.
    pub(super) fn step_done(&mut self, e: usize) -> Result<(), String> {
        if let Some(cp) = self.spec.control_plane {
            let tokens = self.execs[e].outcome.sampled.len();
            let done = self.charge(e, cp.token_secs * tokens as f64);
            if done > self.now {
                self.post(done, Event::Streamed(e));
                return Ok(());
            }
        }
        self.streamed(e)
    }

    /// Executor `e`'s step result, streamed: applied, its tokens delivered now, and the
    /// executor steps again.
    pub(super) fn streamed(&mut self, e: usize) -> Result<(), String> {
        let now = Timestamp(self.now);
        self.due_kv_results(e);
        let x = &mut self.execs[e];
        self.busy_secs += x.step_secs;
        self.kv_weighted += x.kv_usage * x.step_secs;
        self.events.clear();
        x.core
            .apply_result(&x.outcome, now, &mut self.events)
            .map_err(|err| format!("executor {e}: {err}"))?;
        x.busy = false;
        self.check(e)?;
        let kv = self.execs[e].kv_usage;
        let tokens = self.handle_events(e)?;
        self.timeline.step(self.secs(), tokens, self.tracks.len() as u64, kv);
        // A continuation added here may have stepped it already.
        self.wake(e)
    }

    /// What executor `e`'s last result told: tokens, finishes, exports going out.
    /// The tokens it carried are returned.
    fn handle_events(&mut self, e: usize) -> Result<u64, String> {
        let secs = self.secs();
        let events = std::mem::take(&mut self.events);
        let mut tokens = 0;
        for event in &events {
            match event {
                RequestEvent::Token { id, index, token, .. } => {
                    tokens += 1;
                    let Some(t) = self.tracks.get_mut(&id.0) else { continue };
                    if *index == 0 {
                        t.first = secs;
                        self.ttft.record(secs - t.arrival);
                        self.by_model[t.model].ttft.record(secs - t.arrival);
                    } else {
                        self.itl.record(secs - t.last);
                    }
                    t.last = secs;
                    if let Some(h) = &mut t.handoff {
                        h.first_token = Some(*token);
                    }
                }
                RequestEvent::Finished(f) => {
                    self.execs[e].live -= 1;
                    if f.reason == FinishReason::Transferred {
                        continue; // its continuation goes on elsewhere
                    }
                    let Some(t) = self.tracks.remove(&f.id.0) else { continue };
                    self.finished += 1;
                    self.last_finish = self.now;
                    let n = f.stats.output_tokens;
                    self.output_tokens += n as u64;
                    // Counted for the model of the executor that ran it: a request routed to
                    // another model's executor would show as a gap between a model's requests
                    // and its finishes.
                    let counts = &mut self.by_model[self.model_of[e]];
                    (counts.finished, counts.output_tokens) =
                        (counts.finished + 1, counts.output_tokens + n as u64);
                    self.prompt_tokens += u64::from(t.prompt);
                    let ttft = t.first - t.arrival;
                    let tpot = if n > 1 { (t.last - t.first) / (n - 1) as f64 } else { 0.0 };
                    if n > 1 {
                        self.tpot.record(tpot);
                    }
                    self.e2e.record(t.last - t.arrival);
                    if ttft <= self.spec.slo.ttft && tpot <= self.spec.slo.tpot {
                        self.met_slo += 1;
                    }
                    if let Some(done) = &t.turn {
                        self.next_turn += 1;
                        let key = self.next_turn;
                        let think = done.follow_ups.first().map_or(0.0, |f| f.think);
                        let at = self.now + ns(think);
                        let vocab = self.pool_of(e).model.vocab_size;
                        if let Some(next) = done.next_turn(key, at as f64 / 1e9, vocab) {
                            self.turns.insert(key, next);
                            self.post(at, Event::NextTurn(key));
                        }
                    }
                }
                // After its first token (an event before this one): the front hands the
                // request on when its export starts, and so does the simulator.
                RequestEvent::ExportStarted { id, .. } => self.hand_on(id.0)?,
                RequestEvent::Imported { .. } => {}
            }
        }
        self.events = events;
        Ok(tokens)
    }
}
