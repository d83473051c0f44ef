//! The engine: the executor's per-request state, and one `Step` applied to it.
//!
//! A `Step` is a diff (DESIGN.md §4): requests to forget, preempt, add and update, then the
//! batch to run. Everything in it is validated first — unknown or duplicate ids, tokens outside
//! the vocabulary, blocks out of range or written by two requests, token counts that do not
//! add up, work past the known tokens, bad sampling parameters — and only a step that passes
//! as a whole changes anything.
//!
//! A fault that names one request (its data breaks a rule or a limit) refuses that request
//! alone: its parts are taken out of the step, the rest is validated again and runs as if the
//! request had not been there, and the result lists it in `refused`. The engine forgets it and
//! keeps listing it for every later step that names it (the scheduler may have sent those
//! before it heard) until a step lists it in `finished_ids`. Its KV operations are reported
//! failed, so nothing waits on them. A fault of the step as a whole (its token sum) refuses the
//! step, and the engine is left exactly as it was.
//!
//! Each request keeps its prompt, the tokens it generated, its block table and how many of its
//! tokens are in the KV cache. A request samples in a step when that step computes its last
//! known token; the sampled token joins its output at once, so the next decode (even one
//! scheduled before this result reached the scheduler) computes it.
//!
//! The parts, in the order a step meets them: `admit` takes the refused requests out and
//! `validate` checks what remains (one named check per rule), `apply` applies the request
//! diffs, `batch` runs the planned batch through the backend, `sample` turns its logits into
//! tokens (and verifies drafts), and `trace` records the spans of traced requests.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use ferry_model::lora::LoraAdapter;
use ferry_proto::v1;

use super::backend::ModelBackend;
use super::grammar::{Grammar, GrammarSource};
use super::looped::{LoopState, LoopedShape};
use super::lora::Adapters;
use super::sampling::{LogitAdjust, Sampler, SamplingParams};
use admit::Admitted;
use batch::Forward;
use trace::RequestTrace;

mod admit;
mod apply;
mod batch;
mod error;
mod sample;
mod stage;
mod trace;
mod validate;

pub use error::StepError;
pub use validate::MAX_DRAFT_TOKENS;

/// What the engine keeps per request.
#[derive(Debug)]
struct ExecRequest {
    prompt: Vec<u32>,
    output: Vec<u32>,
    sampling: SamplingParams,
    /// Its logit biases and allowed tokens.
    adjust: LogitAdjust,
    table: Vec<u32>,
    /// Leading tokens whose KV is in the cache.
    computed: usize,
    /// Preempted and not resumed: no work until a resuming update.
    preempted: bool,
    /// Its structured output's matcher, which has consumed `output`; `None` when unconstrained.
    grammar: Option<Grammar>,
    /// Its `execute` span (a child of the request's span at the scheduler), when traced.
    trace: Option<RequestTrace>,
    /// A looped model's request: its loops, exit threshold and chain in progress.
    looped: Option<LoopState>,
    /// The LoRA adapter its projections add (held while it lives: see `lora`).
    adapter: Option<Arc<LoraAdapter>>,
}

impl ExecRequest {
    fn len(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    fn token(&self, i: usize) -> u32 {
        if i < self.prompt.len() {
            self.prompt[i]
        } else {
            self.output[i - self.prompt.len()]
        }
    }
}

/// The LoRA adapters of a step's new requests, by request.
type HeldAdapters = HashMap<u64, Arc<LoraAdapter>>;

/// Fixed facts the engine needs beyond the backend's.
#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// End-of-sequence token (the simulator avoids it).
    pub eos_token_id: u32,
    /// Most requests held at once: new requests past it are refused.
    pub max_live_requests: usize,
    /// The model is looped (`--looped-layers`): its requests' work runs stage by stage.
    pub looped: Option<LoopedShape>,
}

impl EngineConfig {
    /// The default limits with `eos_token_id`.
    pub fn new(eos_token_id: u32) -> Self {
        Self {
            eos_token_id,
            max_live_requests: crate::executor_config::DEFAULT_MAX_LIVE_REQUESTS as usize,
            looped: None,
        }
    }
}

/// The executor's state and its step function.
pub struct Engine {
    backend: Box<dyn ModelBackend>,
    config: EngineConfig,
    requests: HashMap<u64, ExecRequest>,
    sampler: Sampler,
    steps_executed: u64,
    /// Scratch: token ids gathered per scheduled request.
    gathered: Vec<Vec<u32>>,
    /// KV transfers (exports and imports through the node's agent) in progress.
    kv: super::kv::KvOps,
    /// Requests refused and forgotten, with why, until a step lists them as finished.
    refused: HashMap<u64, String>,
    /// Where structured-output grammars are compiled (the served model's vocabulary).
    grammars: GrammarSource,
    /// Which block holds the KV of which content hash, as the schedulers cached them (kept
    /// across sessions, so a new leader adopts them: see `cached_blocks`).
    cached: HashMap<u32, u64>,
    /// The LoRA adapters it holds; `None`: it runs none (see [`Engine::with_adapters`]).
    adapters: Option<Adapters>,
}

impl Engine {
    /// An engine over `backend`.
    pub fn new(backend: Box<dyn ModelBackend>, config: EngineConfig) -> Self {
        Self {
            backend,
            config,
            requests: HashMap::new(),
            sampler: Sampler::new(),
            steps_executed: 0,
            gathered: Vec::new(),
            kv: super::kv::KvOps::new(None),
            refused: HashMap::new(),
            grammars: None,
            cached: HashMap::new(),
            adapters: None,
        }
    }

    /// The same engine, running requests with LoRA adapters, held in `adapters` (without it,
    /// a request naming one is refused).
    #[must_use]
    pub fn with_adapters(mut self, adapters: Adapters) -> Self {
        self.adapters = Some(adapters);
        self
    }

    /// The LoRA adapters it holds, if it runs them.
    pub fn adapters(&self) -> Option<&Adapters> {
        self.adapters.as_ref()
    }

    /// Each new request's LoRA adapter, read or found: those found, and the requests whose
    /// adapter cannot be used, with why. Held here until the requests hold them, so reading
    /// one never drops another this step needs.
    fn acquire_adapters(&mut self, step: &v1::Step) -> (HeldAdapters, Vec<(u64, String)>) {
        let (mut found, mut failed) = (HashMap::new(), Vec::new());
        if step.new_requests.iter().all(|nr| nr.lora.is_none()) {
            return (found, failed); // the usual step: nothing to acquire
        }
        // The requests this step finishes let go of their adapters before its new ones take
        // theirs (the scheduler counts on it: it admits a request of a new adapter in the step
        // that reports the last holder of another finished).
        let releasing: Vec<*const LoraAdapter> = step
            .finished_ids
            .iter()
            .filter_map(|id| self.requests.get(id)?.adapter.as_ref().map(Arc::as_ptr))
            .collect();
        for nr in &step.new_requests {
            let Some(want) = &nr.lora else { continue };
            let got = match &mut self.adapters {
                Some(adapters) => adapters.acquire(want, &releasing),
                None => Err(format!(
                    "LoRA adapter {}: this executor's backend runs no adapters",
                    want.name
                )),
            };
            match got {
                Ok(a) => {
                    found.insert(nr.id, a);
                }
                Err(why) => failed.push((nr.id, why)),
            }
        }
        (found, failed)
    }

    /// The same engine, compiling structured outputs for `model`'s vocabulary (without it,
    /// a constrained request is refused).
    #[must_use]
    pub fn with_grammars(mut self, model: GrammarSource) -> Self {
        self.grammars = model;
        self
    }

    /// The same engine, carrying out KV operations through `port` (its node's agent).
    #[must_use]
    pub fn with_kv(mut self, port: Option<super::kv::KvPort>) -> Self {
        self.kv = super::kv::KvOps::new(port);
        self
    }

    /// KV transfers in progress.
    pub fn kv_in_progress(&self) -> usize {
        self.kv.in_progress()
    }

    /// The backend's facts.
    pub fn backend(&self) -> &dyn ModelBackend {
        self.backend.as_ref()
    }

    /// Requests held.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Blocks referenced by the held requests' tables.
    pub fn blocks_in_use(&self) -> usize {
        self.requests.values().flat_map(|r| r.table.iter()).collect::<HashSet<_>>().len()
    }

    /// Steps run since start.
    pub fn steps_executed(&self) -> u64 {
        self.steps_executed
    }

    /// KV transfers started so far, by the path their blocks took to the agent.
    pub fn kv_paths(&self) -> super::kv::KvPaths {
        self.kv.paths()
    }

    /// The blocks whose KV is that of a content hash a scheduler cached, with the hash, by
    /// block id: what a new session's scheduler may adopt. A block is named only after the step
    /// that computed it ran whole, and forgotten before any step that may write it runs (the
    /// scheduler evicts a block from its cache before it reuses it, and says so in that step).
    pub fn cached_blocks(&self) -> Vec<v1::CachedBlock> {
        let mut blocks: Vec<_> = self
            .cached
            .iter()
            .map(|(&block_id, &hash)| v1::CachedBlock { block_id, hash })
            .collect();
        blocks.sort_by_key(|c| c.block_id);
        blocks
    }

    /// Forgets every request and ends every KV transfer in progress; the KV blocks and the
    /// hashes they hold stay (see [`Engine::cached_blocks`]).
    pub fn reset(&mut self) -> usize {
        self.kv.reset();
        self.refused.clear();
        let n = self.requests.len();
        for (_, r) in self.requests.drain() {
            if let Some(t) = r.trace {
                t.end("session reset");
            }
        }
        n
    }

    /// Validates and runs one step, less the requests it refuses (listed in the result); on
    /// error nothing changed.
    pub fn execute(&mut self, step: &v1::Step) -> Result<v1::StepResult, StepError> {
        let (adapters, unusable) = self.acquire_adapters(step);
        let Admitted { step, planned, refused, named_again, dropped_ops, prepared } =
            self.admit(step, unusable)?;
        let step = &*step;
        if !self.refused.is_empty() {
            for id in &step.finished_ids {
                self.refused.remove(id);
            }
        }
        // Evicted blocks first: this step may write them.
        for b in &step.evicted_blocks {
            self.cached.remove(b);
        }
        self.apply_diff(step, prepared, &adapters);
        let (mut refused, mut kv_results) = self.forget_refused(named_again, refused, dropped_ops);
        for c in &step.block_copies {
            self.backend.copy_block(c.src as usize, c.dst as usize);
        }
        self.kv.start(&step.kv_ops, self.backend.as_mut());
        // Imports that arrived are written now, before this step's forward (which does not
        // read them: their requests are scheduled only once the import is reported).
        kv_results.extend(self.kv.finish(self.backend.as_mut()));
        if let Some(stage) = planned.first().and_then(|p| p.stage) {
            return self.execute_stage(step, stage, &planned, refused, kv_results);
        }
        let t0 = Instant::now();
        let Forward { output, masks, masks_busy, grammar_wait } = self.forward(&planned)?;
        let forward_us = t0.elapsed().saturating_sub(grammar_wait).as_micros() as u64;
        let step_started = std::time::SystemTime::now() - t0.elapsed();
        let t1 = Instant::now();
        let (outputs, failed, simulated_us) = self.sample_batch(&planned, output, masks);
        for (id, reason) in failed {
            refused.push(self.refuse(id, reason));
        }
        self.steps_executed += 1;
        // The blocks this step completed hold their content now, unless a request was refused
        // (its blocks may not have been computed; leaving the step's out is always safe).
        if refused.is_empty() {
            self.cached.extend(step.cached_blocks.iter().map(|c| (c.block_id, c.hash)));
        }
        self.trace_step(step, &planned, step_started, forward_us);
        Ok(v1::StepResult {
            step_id: step.step_id,
            outputs,
            kv_results,
            refused,
            exited_ids: Vec::new(),
            timing: Some(v1::StepTiming {
                forward_us,
                sample_us: t1.elapsed().as_micros() as u64,
                simulated_us,
                grammar_us: masks_busy.as_micros() as u64,
                grammar_wait_us: grammar_wait.as_micros() as u64,
                ..Default::default()
            }),
        })
    }
}
