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

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::time::Instant;

use ferry_proto::v1;

use super::backend::{BatchOutput, ModelBackend};
use super::grammar::{self, Grammar, GrammarSource, MaskJob, TokenMask};
use super::sampling::{LogitAdjust, Sampler, SamplingError, SamplingParams, PARALLEL_DRAWS};
use super::sim::sim_token_except;
use crate::model::paged::{BatchError, SeqSlice};

/// A step the engine refuses. Nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// An id the step relies on is not a live request.
    #[error("request {id}: unknown ({what})")]
    Unknown {
        /// The id.
        id: u64,
        /// Which part of the step named it.
        what: &'static str,
    },
    /// A new request reuses a live id, or the step names an id twice.
    #[error("request {id}: {what}")]
    Duplicate {
        /// The id.
        id: u64,
        /// What was duplicated.
        what: &'static str,
    },
    /// A request's data is unusable.
    #[error("request {id}: {reason}")]
    Invalid {
        /// The id.
        id: u64,
        /// What is wrong, with the limit.
        reason: String,
    },
    /// `total_num_tokens` is not the sum of the work.
    #[error("total_num_tokens is {declared} but the work adds up to {actual}")]
    TokenCount {
        /// What the step says.
        declared: u64,
        /// The sum of `work[].num_tokens`.
        actual: u64,
    },
    /// Sampling parameters out of range.
    #[error("request {id}: {source}")]
    Sampling {
        /// The id.
        id: u64,
        /// What is wrong.
        #[source]
        source: SamplingError,
    },
    /// The batch does not fit the KV pool or the model.
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// A KV operation is refused.
    #[error(transparent)]
    Kv(#[from] super::kv::KvOpError),
}

impl StepError {
    /// The one request this fault is about, if it is about one: refusing that request alone
    /// answers it.
    fn request(&self) -> Option<u64> {
        match self {
            Self::Unknown { id, .. }
            | Self::Duplicate { id, .. }
            | Self::Invalid { id, .. }
            | Self::Sampling { id, .. } => Some(*id),
            Self::TokenCount { .. } | Self::Batch(_) | Self::Kv(_) => None,
        }
    }
}

/// A step cleared to run: what remains of it once the refused requests are out.
struct Admitted<'s> {
    step: Cow<'s, v1::Step>,
    planned: Vec<Planned>,
    /// Refused in this step, with why.
    refused: Vec<(u64, String)>,
    /// Requests refused earlier that this step still names.
    named_again: Vec<u64>,
    /// KV operations of refused requests, not started, with why.
    dropped_ops: Vec<(v1::KvOperation, String)>,
    /// What validating the new requests prepared for them.
    prepared: Prepared,
}

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
}

/// A traced request's span on this executor and what it did here.
#[derive(Debug)]
struct RequestTrace {
    cx: opentelemetry::Context,
    steps: u64,
    tokens_computed: u64,
}

impl RequestTrace {
    /// Opens the `execute` span under the scheduler's `traceparent`; `None` when untraced.
    fn start(traceparent: &str, id: u64) -> Option<Self> {
        use opentelemetry::trace::{TraceContextExt, Tracer};
        if traceparent.is_empty() {
            return None;
        }
        let parent = ferry_runtime::telemetry::from_traceparent(traceparent);
        if !parent.span().span_context().is_sampled() {
            return None;
        }
        let tracer = ferry_runtime::telemetry::tracer();
        let span = tracer
            .span_builder("execute")
            .with_attributes([opentelemetry::KeyValue::new("ferry.request_id", id as i64)])
            .start_with_context(&tracer, &parent);
        Some(Self { cx: parent.with_span(span), steps: 0, tokens_computed: 0 })
    }

    fn end(self, how: &'static str) {
        use opentelemetry::trace::TraceContextExt;
        use opentelemetry::KeyValue;
        let span = self.cx.span();
        span.set_attribute(KeyValue::new("ferry.steps", self.steps as i64));
        span.set_attribute(KeyValue::new("ferry.tokens_computed", self.tokens_computed as i64));
        span.set_attribute(KeyValue::new("ferry.ended_by", how));
        span.end();
    }
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

/// Fixed facts the engine needs beyond the backend's.
#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// End-of-sequence token (the simulator avoids it).
    pub eos_token_id: u32,
    /// Most requests held at once: new requests past it are refused.
    pub max_live_requests: usize,
}

impl EngineConfig {
    /// The default limits with `eos_token_id`.
    pub fn new(eos_token_id: u32) -> Self {
        Self { eos_token_id, max_live_requests: crate::config::DEFAULT_MAX_LIVE_REQUESTS as usize }
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
}

/// The requests' tables as a step leaves them, for checking its KV operations.
struct StepTables<'a> {
    requests: &'a HashMap<u64, ExecRequest>,
    finished: &'a HashSet<u64>,
    updated: &'a HashMap<u64, Vec<u32>>,
    held: HashSet<u32>,
}

impl super::kv::RequestTables for StepTables<'_> {
    fn table(&self, id: u64) -> Option<&[u32]> {
        if let Some(t) = self.updated.get(&id) {
            return Some(t);
        }
        let live = !self.finished.contains(&id);
        self.requests.get(&id).filter(|_| live).map(|r| r.table.as_slice())
    }

    fn holds(&self, block: u32) -> bool {
        self.held.contains(&block)
    }
}

/// The prospective state of one scheduled request, computed before anything changes.
struct Planned {
    id: u64,
    start: usize,
    n: usize,
    total: usize,
    /// A verification's draft tokens (empty for other work): they follow the `total` known
    /// tokens, and the step computes the last known token and each of them.
    draft: Vec<u32>,
}

impl Planned {
    /// Token `i` of the sequence this work computes: a known token, or a draft token.
    fn token(&self, r: &ExecRequest, i: usize) -> u32 {
        if i < self.total {
            r.token(i)
        } else {
            self.draft[i - self.total]
        }
    }
}

/// Most draft tokens one verification may carry (the scheduler's `MAX_SPECULATIVE_TOKENS`).
pub const MAX_DRAFT_TOKENS: usize = 16;

/// Why verify work `wk` (from position `computed` of `total` known tokens) cannot run, if it
/// cannot: a verification computes the last known token and each draft token, within the
/// vocabulary and the model's length, and a structured output's grammar cannot check several
/// positions at once.
fn verify_fault(
    wk: &v1::ScheduledWork,
    computed: usize,
    total: usize,
    vocab: usize,
    max_len: usize,
    constrained: bool,
) -> Option<String> {
    let k = wk.draft_token_ids.len();
    let n = wk.num_tokens as usize;
    if k == 0 {
        return Some("a verify carries no draft tokens".into());
    }
    if k > MAX_DRAFT_TOKENS {
        return Some(format!("a verify carries {k} draft tokens, at most {MAX_DRAFT_TOKENS}"));
    }
    if n != k + 1 {
        return Some(format!(
            "a verify of {k} draft tokens computes {} tokens (its last token and each draft \
             token), not {n}",
            k + 1
        ));
    }
    if computed + 1 != total {
        return Some(format!(
            "a verify starts at its last known token (position {}), not at {computed}",
            total.saturating_sub(1)
        ));
    }
    if total + k > max_len {
        return Some(format!(
            "{total} tokens and {k} draft tokens run past the model's maximum length {max_len}"
        ));
    }
    if let Some(t) = wk.draft_token_ids.iter().find(|t| **t as usize >= vocab) {
        return Some(format!("draft token id {t} is outside the vocabulary (size {vocab})"));
    }
    if constrained {
        return Some(
            "a structured output cannot verify draft tokens (its grammar checks one \
                     token at a time)"
                .into(),
        );
    }
    None
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
        }
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

    /// Forgets every request and ends every KV transfer in progress.
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
        let Admitted { step, planned, refused, named_again, dropped_ops, prepared } =
            self.admit(step)?;
        let step = &*step;
        if !self.refused.is_empty() {
            for id in &step.finished_ids {
                self.refused.remove(id);
            }
        }
        self.apply_diff(step, prepared);
        let (mut refused, mut kv_results) = self.forget_refused(named_again, refused, dropped_ops);
        for c in &step.block_copies {
            self.backend.copy_block(c.src as usize, c.dst as usize);
        }
        self.kv.start(&step.kv_ops, self.backend.as_mut());
        // Imports that arrived are written now, before this step's forward (which does not
        // read them: their requests are scheduled only once the import is reported).
        kv_results.extend(self.kv.finish(self.backend.as_mut()));
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
        self.trace_step(step, &planned, step_started, forward_us);
        Ok(v1::StepResult {
            step_id: step.step_id,
            outputs,
            kv_results,
            refused,
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

    /// Turns the forward's `output` into each planned request's result: prompt
    /// log-probabilities, a sampled token, or a verification's tokens. The outputs, the
    /// requests that cannot go on (with why), and the simulated time.
    fn sample_batch(
        &mut self,
        planned: &[Planned],
        output: BatchOutput,
        mut masks: HashMap<u64, (Grammar, Result<TokenMask, String>)>,
    ) -> (Vec<v1::RequestOutput>, Vec<(u64, String)>, u64) {
        let mut outputs = Vec::new();
        let (mut logits, simulated_us) = match output {
            BatchOutput::Logits(l) => (Some(l.into_iter()), 0),
            BatchOutput::Synthetic { duration } => {
                (None, u64::try_from(duration.as_micros()).unwrap_or(u64::MAX))
            }
        };
        let vocab = self.backend.facts().shape.vocab_size as u32;
        // A simulated end token (none when the model served has none) is never emitted.
        let eos = self.backend.sim_eos().unwrap_or(self.config.eos_token_id);
        let (mut failed, mut draws) = (Vec::new(), Vec::new());
        for p in planned {
            let r = self.requests.get_mut(&p.id).expect("planned requests exist after apply_diff");
            // This request's rows of logits: the prompt positions it scores (when asked), then
            // its last when it samples.
            let mut rows = logits.as_mut().map(|it| it.by_ref().take(logit_rows(p, r)));
            let (prompt_logprobs, prompt_logprobs_from) = match rows.as_mut() {
                Some(rows) => score_prompt(&mut self.sampler, r, p, rows),
                None => (Vec::new(), 0),
            };
            if !p.draft.is_empty() {
                let rows = rows.map(Iterator::collect);
                match verify(&mut self.sampler, r, p, rows, vocab, eos) {
                    Ok((token_ids, logprobs)) => outputs.push(v1::RequestOutput {
                        id: p.id,
                        token_ids,
                        logprobs,
                        ..Default::default()
                    }),
                    Err(why) => failed.push((p.id, why)),
                }
                continue;
            }
            // The chunk's last row: the sampling row when it samples.
            let mut row = rows.and_then(Iterator::last);
            r.computed = p.start + p.n;
            if r.computed != p.total {
                if !prompt_logprobs.is_empty() {
                    outputs.push(v1::RequestOutput {
                        id: p.id,
                        prompt_logprobs,
                        prompt_logprobs_from,
                        ..Default::default()
                    });
                }
                continue;
            }
            let position = r.len() as u64;
            if logits.is_none() {
                let token = sim_token_except(r.sampling.seed, position, vocab, eos);
                r.output.push(token);
                outputs.push(v1::RequestOutput {
                    id: p.id,
                    token_ids: vec![token],
                    prompt_logprobs,
                    prompt_logprobs_from,
                    ..Default::default()
                });
                continue;
            }
            // Drawn below, all the step's rows together; the output is completed then.
            let row = row.take().expect("the backend returns a row per sampling request");
            let at = outputs.len();
            draws.push((Draw { at, id: p.id }, row, masks.remove(&p.id), position));
            outputs.push(v1::RequestOutput {
                id: p.id,
                prompt_logprobs,
                prompt_logprobs_from,
                ..Default::default()
            });
        }
        let mut dropped = HashSet::new();
        for (d, result) in draw_rows(&self.requests, &mut self.sampler, draws) {
            match result {
                Ok((token, logprobs, grammar)) => {
                    let r = self.requests.get_mut(&d.id).expect("drawn requests exist");
                    r.output.push(token);
                    if grammar.is_some() {
                        r.grammar = grammar;
                    }
                    outputs[d.at].token_ids = vec![token];
                    outputs[d.at].logprobs = logprobs.into_iter().collect();
                }
                Err(why) => {
                    failed.push((d.id, why));
                    dropped.insert(d.id);
                }
            }
        }
        // A request whose draw failed reports nothing (its prompt log-probabilities neither).
        outputs.retain(|o| !dropped.contains(&o.id));
        (outputs, failed, simulated_us)
    }

    /// Runs the batch of `planned` through the backend while the masks of the constrained
    /// requests that sample in it are computed beside it; on error nothing changed.
    fn forward(&mut self, planned: &[Planned]) -> Result<Forward, StepError> {
        // Gather the tokens each scheduled request computes.
        self.gathered.resize_with(planned.len(), Vec::new);
        for (buf, p) in self.gathered.iter_mut().zip(planned) {
            let r = &self.requests[&p.id];
            buf.clear();
            buf.extend((p.start..p.start + p.n).map(|i| p.token(r, i)));
        }
        // The masks of the constrained requests that sample, computed beside the forward.
        let mask_job = MaskJob {
            matchers: planned
                .iter()
                .filter(|p| p.start + p.n == p.total)
                .filter_map(|p| {
                    let r = self.requests.get_mut(&p.id)?;
                    r.grammar.take().map(|m| (p.id, m))
                })
                .collect(),
        };
        let batch: Vec<SeqSlice> = planned
            .iter()
            .zip(&self.gathered)
            .map(|(p, toks)| {
                let r = &self.requests[&p.id];
                SeqSlice {
                    tokens: toks,
                    start: p.start,
                    block_table: &r.table,
                    logits: logit_rows(p, r),
                }
            })
            .collect();
        let backend = &mut self.backend;
        let (output, masks, grammar_wait) = mask_job.beside(|| {
            if batch.is_empty() {
                Ok(BatchOutput::Logits(Vec::new()))
            } else {
                backend.run(&batch)
            }
        });
        let masks_busy = masks.busy;
        let masks: HashMap<u64, _> =
            masks.masks.into_iter().map(|(id, m, mask)| (id, (m, mask))).collect();
        match output {
            Ok(output) => Ok(Forward { output, masks, masks_busy, grammar_wait }),
            Err(e) => {
                // Nothing ran: the matchers go back unchanged.
                for (id, (m, _)) in masks {
                    if let Some(r) = self.requests.get_mut(&id) {
                        r.grammar = Some(m);
                    }
                }
                Err(e.into())
            }
        }
    }

    /// Records a `step` span (its own trace) linked to the `execute` spans of the traced
    /// requests in the batch, with the batch's shape; nothing when none is traced.
    fn trace_step(
        &mut self,
        step: &v1::Step,
        planned: &[Planned],
        started: std::time::SystemTime,
        forward_us: u64,
    ) {
        use opentelemetry::trace::{Link, Span, TraceContextExt, Tracer};
        use opentelemetry::KeyValue;
        let mut links = Vec::new();
        let (mut prefill, mut decode) = (0i64, 0i64);
        for p in planned {
            let is_decode = p.n == 1 && p.start + 1 == p.total && p.start > 0;
            if is_decode {
                decode += 1;
            } else {
                prefill += p.n as i64;
            }
            if let Some(t) = self.requests.get_mut(&p.id).and_then(|r| r.trace.as_mut()) {
                t.steps += 1;
                t.tokens_computed += p.n as u64;
                links.push(Link::with_context(t.cx.span().span_context().clone()));
            }
        }
        if links.is_empty() {
            return;
        }
        let tracer = ferry_runtime::telemetry::tracer();
        let mut span = tracer
            .span_builder("step")
            .with_start_time(started)
            .with_links(links)
            .with_attributes([
                KeyValue::new("ferry.step_id", step.step_id as i64),
                KeyValue::new("ferry.batch_size", planned.len() as i64),
                KeyValue::new("ferry.prefill_tokens", prefill),
                KeyValue::new("ferry.decode_tokens", decode),
                KeyValue::new("ferry.forward_us", forward_us as i64),
            ])
            .start_with_context(&tracer, &opentelemetry::Context::new());
        span.end();
    }

    /// Forgets the requests refused in this step and remembers why. The result's refusals
    /// (those refused earlier and named again, then these) and its failed KV operations (the
    /// refused requests' operations, never started).
    fn forget_refused(
        &mut self,
        named_again: Vec<u64>,
        refused: Vec<(u64, String)>,
        dropped_ops: Vec<(v1::KvOperation, String)>,
    ) -> (Vec<v1::RefusedRequest>, Vec<v1::KvOperationResult>) {
        let failed = dropped_ops
            .into_iter()
            .map(|(op, why)| v1::KvOperationResult {
                transfer_id: op.transfer_id,
                ok: false,
                error: why,
                failure: v1::KvFailure::Executor.into(),
                ..Default::default()
            })
            .collect();
        let mut out: Vec<v1::RefusedRequest> = named_again
            .into_iter()
            .map(|id| v1::RefusedRequest { id, reason: self.refused[&id].clone() })
            .collect();
        for (id, reason) in refused {
            out.push(self.refuse(id, reason));
        }
        (out, failed)
    }

    /// Forgets request `id` and remembers why, until a step lists it as finished.
    fn refuse(&mut self, id: u64, reason: String) -> v1::RefusedRequest {
        tracing::warn!(request = id, %reason, "request refused");
        if let Some(t) = self.requests.remove(&id).and_then(|r| r.trace) {
            t.end("refused");
        }
        self.refused.insert(id, reason.clone());
        v1::RefusedRequest { id, reason }
    }

    /// Takes the refused requests out of `step` until what remains passes [`Self::validate`]:
    /// those refused earlier that it still names, then each that a fault names, one at a time
    /// (each takes a part out, so this ends). A fault of the step as a whole is its error.
    fn admit<'s>(&self, step: &'s v1::Step) -> Result<Admitted<'s>, StepError> {
        let mut admitted = Admitted {
            step: Cow::Borrowed(step),
            planned: Vec::new(),
            refused: Vec::new(),
            named_again: Vec::new(),
            dropped_ops: Vec::new(),
            prepared: HashMap::new(),
        };
        if !self.refused.is_empty() {
            let mut earlier: Vec<u64> =
                self.refused.keys().filter(|id| !step.finished_ids.contains(id)).copied().collect();
            earlier.sort_unstable();
            for id in earlier {
                if let Some((rest, ops)) = without(&admitted.step, id) {
                    admitted.step = Cow::Owned(rest);
                    let why = format!("request {id} was refused: {}", self.refused[&id]);
                    admitted.dropped_ops.extend(ops.into_iter().map(|op| (op, why.clone())));
                    admitted.named_again.push(id);
                }
            }
        }
        loop {
            let fault = match self.validate(&admitted.step) {
                Ok((planned, prepared)) => {
                    admitted.planned = planned;
                    admitted.prepared = prepared;
                    return Ok(admitted);
                }
                Err(fault) => fault,
            };
            let Some(id) = fault.request() else { return Err(fault) };
            let Some((rest, ops)) = without(&admitted.step, id) else { return Err(fault) };
            admitted.step = Cow::Owned(rest);
            let why = fault.to_string();
            admitted.dropped_ops.extend(ops.into_iter().map(|op| (op, why.clone())));
            admitted.refused.push((id, why));
        }
    }

    /// Checks the whole step against the state it would produce; changes nothing. One function:
    /// its checks build one picture of the step (which ids are new, resumed, finished) that
    /// each later check reads, and it reads top to bottom in the order a step is applied.
    #[allow(clippy::too_many_lines)]
    fn validate(&self, step: &v1::Step) -> Result<(Vec<Planned>, Prepared), StepError> {
        let facts = self.backend.facts();
        let finished: HashSet<u64> = step.finished_ids.iter().copied().collect();
        let live = |id: &u64| self.requests.contains_key(id) && !finished.contains(id);
        let mut preempted = HashSet::new();
        for id in &step.preempted_ids {
            if !live(id) {
                return Err(StepError::Unknown { id: *id, what: "in preempted_ids" });
            }
            preempted.insert(*id);
        }
        let block_ok = |id: u64, blocks: &[u32]| match blocks
            .iter()
            .find(|b| **b as usize >= facts.num_blocks)
        {
            Some(b) => Err(StepError::Invalid {
                id,
                reason: format!("block {b} is out of range (pool has {} blocks)", facts.num_blocks),
            }),
            None => Ok(()),
        };
        // Prospective (tables, lengths, computed) of every request the step touches.
        let max_len = facts.shape.max_model_len;
        // The longest table a request can need: its blocks for the model's length, and one ahead.
        let max_table = max_len.div_ceil(facts.block_size.max(1)) + 1;
        let table_ok = |id: u64, len: usize| {
            if len > max_table {
                return Err(StepError::Invalid {
                    id,
                    reason: format!(
                        "a block table of {len} blocks; {max_len} tokens need at most {max_table}"
                    ),
                });
            }
            Ok(())
        };
        let mut tables: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut prepared = HashMap::new();
        let no_sampling = v1::SamplingParams::default();
        let mut lengths: HashMap<u64, (usize, usize)> = HashMap::new();
        // Requests live once the step's finished ones go (counted only when the limit is near).
        let live_before =
            if self.requests.len() + step.new_requests.len() > self.config.max_live_requests {
                self.requests.len()
                    - finished.iter().filter(|id| self.requests.contains_key(id)).count()
            } else {
                0
            };
        for (num_live, nr) in (live_before..).zip(&step.new_requests) {
            if live(&nr.id) || lengths.contains_key(&nr.id) {
                return Err(StepError::Duplicate { id: nr.id, what: "is already a live request" });
            }
            if num_live >= self.config.max_live_requests {
                return Err(StepError::Invalid {
                    id: nr.id,
                    reason: format!(
                        "the executor holds {num_live} requests, its limit (--max-live-requests)"
                    ),
                });
            }
            if nr.prompt_token_ids.is_empty() {
                return Err(StepError::Invalid { id: nr.id, reason: "empty prompt".into() });
            }
            let len = nr.prompt_token_ids.len() + nr.output_token_ids.len();
            if len > max_len {
                return Err(StepError::Invalid {
                    id: nr.id,
                    reason: format!("{len} tokens; the model's maximum length is {max_len}"),
                });
            }
            table_ok(nr.id, nr.block_ids.len())?;
            if let Some(t) = nr
                .prompt_token_ids
                .iter()
                .chain(&nr.output_token_ids)
                .find(|t| **t as usize >= facts.shape.vocab_size)
            {
                return Err(StepError::Invalid {
                    id: nr.id,
                    reason: format!(
                        "token id {t} is outside the vocabulary (size {})",
                        facts.shape.vocab_size
                    ),
                });
            }
            if nr.num_computed_tokens as usize > len {
                return Err(StepError::Invalid {
                    id: nr.id,
                    reason: format!(
                        "num_computed_tokens {} exceeds its {len} tokens",
                        nr.num_computed_tokens
                    ),
                });
            }
            block_ok(nr.id, &nr.block_ids)?;
            let proto = nr.sampling.as_ref().unwrap_or(&no_sampling);
            let sampling = SamplingParams::from_proto(proto, nr.id);
            sampling.validate().map_err(|source| StepError::Sampling { id: nr.id, source })?;
            let adjust = LogitAdjust::from_proto(proto);
            adjust
                .validate(facts.shape.vocab_size)
                .map_err(|source| StepError::Sampling { id: nr.id, source })?;
            if proto.prompt_logprobs.is_some() && !self.backend.computes_logits() {
                return Err(StepError::Invalid {
                    id: nr.id,
                    reason: "prompt_logprobs need the model's logits, and this executor (a \
                             simulated one) computes none"
                        .into(),
                });
            }
            let grammar = match &proto.structured_output {
                Some(constraint) => Some(
                    grammar::compile(&self.grammars, constraint, &nr.output_token_ids)
                        .map_err(|reason| StepError::Invalid { id: nr.id, reason })?,
                ),
                None => None,
            };
            prepared.insert(nr.id, NewParts { sampling, adjust, grammar });
            tables.insert(nr.id, nr.block_ids.clone());
            lengths.insert(nr.id, (len, nr.num_computed_tokens as usize));
        }
        let mut resumed = HashSet::new();
        for cu in &step.cached_requests {
            if !live(&cu.id) {
                return Err(StepError::Unknown { id: cu.id, what: "in cached_requests" });
            }
            if tables.contains_key(&cu.id) {
                return Err(StepError::Duplicate { id: cu.id, what: "is updated twice" });
            }
            let r = &self.requests[&cu.id];
            block_ok(cu.id, &cu.new_block_ids)?;
            let table = if cu.resumed {
                resumed.insert(cu.id);
                cu.new_block_ids.clone()
            } else {
                let mut t = r.table.clone();
                t.extend_from_slice(&cu.new_block_ids);
                t
            };
            table_ok(cu.id, table.len())?;
            // Only a resume sets the computed count (a recompute restarts lower).
            let computed = if cu.resumed { cu.num_computed_tokens as usize } else { r.computed };
            if computed > r.len() {
                return Err(StepError::Invalid {
                    id: cu.id,
                    reason: format!(
                        "num_computed_tokens {} exceeds its {} tokens",
                        cu.num_computed_tokens,
                        r.len()
                    ),
                });
            }
            tables.insert(cu.id, table);
            lengths.insert(cu.id, (r.len(), computed));
        }
        let mut planned = Vec::with_capacity(step.work.len());
        let mut seen = HashSet::new();
        let mut sum = 0u64;
        for wk in &step.work {
            if !seen.insert(wk.id) {
                return Err(StepError::Duplicate { id: wk.id, what: "is scheduled twice" });
            }
            let (total, computed) = match lengths.get(&wk.id) {
                Some(&l) => l,
                None if live(&wk.id) => {
                    let r = &self.requests[&wk.id];
                    (r.len(), r.computed)
                }
                None => return Err(StepError::Unknown { id: wk.id, what: "in work" }),
            };
            let is_preempted = preempted.contains(&wk.id)
                || (self.requests.get(&wk.id).is_some_and(|r| r.preempted)
                    && !resumed.contains(&wk.id));
            let n = wk.num_tokens as usize;
            let reason = match v1::WorkKey::try_from(wk.key) {
                _ if is_preempted => Some("is preempted and was not resumed".to_string()),
                Ok(v1::WorkKey::Unspecified) | Err(_) => {
                    Some(format!("work key {} is not valid", wk.key))
                }
                Ok(v1::WorkKey::Verify) => {
                    let constrained = match prepared.get(&wk.id) {
                        Some(parts) => parts.grammar.is_some(),
                        None => self.requests.get(&wk.id).is_some_and(|r| r.grammar.is_some()),
                    };
                    let vocab = facts.shape.vocab_size;
                    verify_fault(wk, computed, total, vocab, max_len, constrained)
                }
                _ if n == 0 => Some("num_tokens is 0".into()),
                _ if computed + n > total => Some(format!(
                    "{n} tokens from position {computed} run past its {total} known tokens"
                )),
                Ok(v1::WorkKey::Decode) if n != 1 => {
                    Some(format!("a decode computes 1 token, not {n}"))
                }
                _ => None,
            };
            if let Some(reason) = reason {
                return Err(StepError::Invalid { id: wk.id, reason });
            }
            sum += n as u64;
            let draft = if wk.key == v1::WorkKey::Verify as i32 {
                wk.draft_token_ids.clone()
            } else {
                Vec::new()
            };
            planned.push(Planned { id: wk.id, start: computed, n, total, draft });
        }
        if sum != u64::from(step.total_num_tokens) {
            return Err(StepError::TokenCount {
                declared: u64::from(step.total_num_tokens),
                actual: sum,
            });
        }
        if !step.kv_ops.is_empty() {
            // Only an import asks which blocks live requests hold (it writes only free ones).
            let imports =
                step.kv_ops.iter().any(|op| matches!(op.op, Some(v1::kv_operation::Op::Import(_))));
            let held = if imports {
                self.requests
                    .iter()
                    .filter(|(id, _)| !finished.contains(id) && !tables.contains_key(id))
                    .flat_map(|(_, r)| r.table.iter().copied())
                    .chain(tables.values().flatten().copied())
                    .collect()
            } else {
                HashSet::new()
            };
            let view = StepTables {
                requests: &self.requests,
                finished: &finished,
                updated: &tables,
                held,
            };
            self.kv.validate(&step.kv_ops, facts.num_blocks, &view).map_err(|e| {
                // A bad export or import is its request's fault.
                match super::kv::request_of(&e, &step.kv_ops) {
                    Some(id) => StepError::Invalid { id, reason: e.to_string() },
                    None => e.into(),
                }
            })?;
        }
        for c in &step.block_copies {
            copy_fault(c, facts.num_blocks, &tables, &self.requests, &finished)
                .map_err(|reason| StepError::Invalid { id: c.id, reason })?;
        }
        // The batch against the KV pool: coverage, ranges, no block written by two requests.
        // Token ids were checked when they arrived, so placeholders stand in for them here.
        let longest = planned.iter().map(|p| p.n).max().unwrap_or(0);
        let zeros = vec![0u32; longest];
        let batch: Vec<SeqSlice> = planned
            .iter()
            .map(|p| SeqSlice {
                tokens: &zeros[..p.n],
                start: p.start,
                block_table: tables.get(&p.id).unwrap_or_else(|| &self.requests[&p.id].table),
                logits: 0,
            })
            .collect();
        self.backend.check(&batch).map_err(|e| match e.sequence() {
            Some(seq) => StepError::Invalid { id: planned[seq].id, reason: e.to_string() },
            None => e.into(),
        })?;
        Ok((planned, prepared))
    }

    /// Applies the request diffs of a validated step; `prepared` holds its new requests'
    /// parts.
    fn apply_diff(&mut self, step: &v1::Step, mut prepared: Prepared) {
        for id in &step.finished_ids {
            if let Some(t) = self.requests.remove(id).and_then(|r| r.trace) {
                t.end("finished");
            }
        }
        for id in &step.preempted_ids {
            if let Some(r) = self.requests.get_mut(id) {
                r.preempted = true;
                if let Some(t) = &r.trace {
                    use opentelemetry::trace::TraceContextExt;
                    t.cx.span().add_event("preempted", Vec::new());
                }
            }
        }
        for nr in &step.new_requests {
            let NewParts { sampling, adjust, grammar } =
                prepared.remove(&nr.id).expect("validated: every new request is prepared");
            self.requests.insert(
                nr.id,
                ExecRequest {
                    prompt: nr.prompt_token_ids.clone(),
                    output: nr.output_token_ids.clone(),
                    sampling,
                    adjust,
                    table: nr.block_ids.clone(),
                    computed: nr.num_computed_tokens as usize,
                    preempted: false,
                    grammar,
                    trace: RequestTrace::start(&nr.traceparent, nr.id),
                },
            );
        }
        for cu in &step.cached_requests {
            let r = self.requests.get_mut(&cu.id).expect("validated: cached requests are live");
            if cu.resumed {
                r.table.clone_from(&cu.new_block_ids);
                r.preempted = false;
                r.computed = cu.num_computed_tokens as usize;
            } else {
                r.table.extend_from_slice(&cu.new_block_ids);
            }
        }
    }
}

/// What a step's forward produced: the batch's output, the constrained requests' matchers with
/// their masks, the time the masks took, and how long the step waited for them.
struct Forward {
    output: BatchOutput,
    masks: HashMap<u64, (Grammar, Result<TokenMask, String>)>,
    masks_busy: std::time::Duration,
    grammar_wait: std::time::Duration,
}

/// A new request's sampling parts, read from the wire and checked once, while validating the
/// step: its parameters, its logit adjustments, and its grammar compiled (with its earlier
/// output replayed) when it has a structured output.
struct NewParts {
    sampling: SamplingParams,
    adjust: LogitAdjust,
    grammar: Option<Grammar>,
}

/// The parts of a step's new requests, by id.
type Prepared = HashMap<u64, NewParts>;

/// Rows of logits planned `p` needs: all of its chunk when it scores prompt tokens in it
/// (`prompt_logprobs`), else its last when it samples.
fn logit_rows(p: &Planned, r: &ExecRequest) -> usize {
    if !p.draft.is_empty() {
        return p.n; // a verification samples at each position
    }
    let samples = p.start + p.n == p.total;
    if r.sampling.prompt_logprobs.is_some() && p.start + 1 < r.prompt.len() {
        p.n
    } else {
        usize::from(samples)
    }
}

/// The prompt log-probabilities planned `p` computes: the first rows of its chunk, those
/// that predict a prompt token, taken from `rows` and scored ([`logit_rows`] gave the whole
/// chunk); and the prompt position of the first. Empty unless asked.
fn score_prompt(
    sampler: &mut Sampler,
    r: &ExecRequest,
    p: &Planned,
    rows: &mut impl Iterator<Item = Vec<f32>>,
) -> (Vec<v1::PositionLogprobs>, u32) {
    let Some(top) = r.sampling.prompt_logprobs else { return (Vec::new(), 0) };
    if p.start + 1 >= r.prompt.len() {
        return (Vec::new(), 0);
    }
    // Row i (position start + i) predicts the token at start + i + 1.
    let scored = (p.start + p.n).min(r.prompt.len() - 1) - p.start;
    let out = rows
        .take(scored)
        .enumerate()
        .map(|(i, mut row)| {
            let token = r.prompt[p.start + i + 1];
            let (logprob, best) = sampler.score(&mut row, token, top);
            v1::PositionLogprobs {
                sampled: Some(v1::TokenLogprob { token_id: token, logprob }),
                top: best
                    .into_iter()
                    .map(|(token_id, logprob)| v1::TokenLogprob { token_id, logprob })
                    .collect(),
            }
        })
        .collect();
    (out, (p.start + 1) as u32)
}

/// Verifies `p`'s draft for `r`: samples each position in turn exactly as decoding would
/// (the same position-keyed draw, penalties over the tokens before it, `rows` in order; the
/// simulator's tokens when there are none), keeping each draft token its sample equals. The
/// first sample that differs replaces its draft token and ends the run; when all are equal,
/// the last row's sample follows them. So the output is the one decoding gives, token for
/// token, for greedy and seeded sampling alike, and a draft token is accepted with exactly its
/// probability under the request's sampling (rejection sampling of a one-point proposal; see
/// `sampling::verify_draft`). Returns the tokens (accepted drafts and one more) and their
/// log-probabilities when asked.
fn verify(
    sampler: &mut Sampler,
    r: &mut ExecRequest,
    p: &Planned,
    rows: Option<Vec<Vec<f32>>>,
    vocab: u32,
    eos: u32,
) -> Result<(Vec<u32>, Vec<v1::PositionLogprobs>), String> {
    let mut rows = rows.map(Vec::into_iter);
    let mut tokens = Vec::with_capacity(p.draft.len() + 1);
    let mut logprobs = Vec::new();
    for j in 0..=p.draft.len() {
        let position = r.len() as u64;
        let (token, lp) = match rows.as_mut() {
            Some(rows) => {
                let row = rows.next().expect("the backend returns a row per verified position");
                let (token, lp, _) = Inputs::of(r).sample(sampler, row, None, position)?;
                (token, lp)
            }
            None => (sim_token_except(r.sampling.seed, position, vocab, eos), None),
        };
        r.output.push(token);
        tokens.push(token);
        logprobs.extend(lp);
        if p.draft.get(j) != Some(&token) {
            break;
        }
    }
    // The rejected drafts' KV is stale: the next step computes from the last token on.
    r.computed = r.len() - 1;
    Ok((tokens, logprobs))
}

/// Where a step's sampling row goes: request `id`, whose output is `outputs[at]`.
struct Draw {
    at: usize,
    id: u64,
}

/// A row to draw: where it goes, the logits, the grammar and mask when constrained (taken out
/// for the step), the position it samples.
type Row = (Draw, Vec<f32>, Option<(Grammar, Result<TokenMask, String>)>, u64);

/// What drawing a row gives: the token, its log-probabilities, the advanced grammar.
type Drawn = Result<(u32, Option<v1::PositionLogprobs>, Option<Grammar>), String>;

/// Draws every row, in order. A draw depends only on its row, the request's parameters and
/// tokens, and (seed, position), so from [`PARALLEL_DRAWS`] rows on they are drawn in parallel
/// on the forward's threads (a decode batch's sampling is a tenth of its step).
fn draw_rows(
    requests: &HashMap<u64, ExecRequest>,
    sampler: &mut Sampler,
    rows: Vec<Row>,
) -> Vec<(Draw, Drawn)> {
    use rayon::prelude::*;
    let jobs: Vec<_> = rows
        .into_iter()
        .map(|(d, row, constrained, position)| {
            (Inputs::of(&requests[&d.id]), d, row, constrained, position)
        })
        .collect();
    let draw = |sampler: &mut Sampler,
                (inputs, d, row, constrained, position): (Inputs, Draw, _, _, _)| {
        let drawn = inputs.sample(sampler, row, constrained, position);
        (d, drawn)
    };
    if jobs.len() < PARALLEL_DRAWS {
        return jobs.into_iter().map(|job| draw(sampler, job)).collect();
    }
    crate::model::paged::in_pool(|| jobs.into_par_iter().map_init(Sampler::new, draw).collect())
}

/// What a draw reads of its request.
struct Inputs<'a> {
    sampling: &'a SamplingParams,
    adjust: &'a LogitAdjust,
    prompt: &'a [u32],
    output: &'a [u32],
}

impl<'a> Inputs<'a> {
    fn of(r: &'a ExecRequest) -> Self {
        Self { sampling: &r.sampling, adjust: &r.adjust, prompt: &r.prompt, output: &r.output }
    }

    /// Samples the next token from `row` at `position`, after its grammar's mask when it has
    /// one (`constrained`: its matcher, taken out for the step, and the mask); the token, its
    /// log-probabilities and the advanced grammar, or why this request cannot go on (the
    /// others can).
    fn sample(
        &self,
        sampler: &mut Sampler,
        mut row: Vec<f32>,
        constrained: Option<(Grammar, Result<TokenMask, String>)>,
        position: u64,
    ) -> Drawn {
        let mut grammar = None;
        if let Some((g, mask)) = constrained {
            grammar::apply_mask(&mut row, &mask?);
            grammar = Some(g);
        }
        // An error is about this request's logits (all masked, or none finite).
        let s = sampler
            .sample_adjusted(
                &mut row,
                self.sampling,
                self.adjust,
                self.prompt,
                self.output,
                position,
            )
            .map_err(|e| format!("sampling: {e}"))?;
        if let Some(g) = grammar.as_mut() {
            g.advance(s.token)?;
        }
        let logprobs = s.logprob.map(|logprob| v1::PositionLogprobs {
            sampled: Some(v1::TokenLogprob { token_id: s.token, logprob }),
            top: s
                .top_logprobs
                .iter()
                .map(|&(token_id, logprob)| v1::TokenLogprob { token_id, logprob })
                .collect(),
        });
        Ok((s.token, logprobs, grammar))
    }
}

/// What is wrong with block copy `c`, if anything: both blocks in the pool and distinct, the
/// block written new to its request's table in this step, the block read held by a live
/// request (after this step's diff: `tables` holds the tables it sets).
fn copy_fault(
    c: &v1::BlockCopy,
    num_blocks: usize,
    tables: &HashMap<u64, Vec<u32>>,
    requests: &HashMap<u64, ExecRequest>,
    finished: &HashSet<u64>,
) -> Result<(), String> {
    if c.src as usize >= num_blocks || c.dst as usize >= num_blocks || c.src == c.dst {
        return Err(format!(
            "block copy {} -> {}: blocks must be distinct and below {num_blocks}",
            c.src, c.dst
        ));
    }
    if !tables.get(&c.id).is_some_and(|t| t.contains(&c.dst)) {
        return Err(format!(
            "block copy into block {}, which this step does not give the request",
            c.dst
        ));
    }
    let held = tables.values().any(|t| t.contains(&c.src))
        || requests.iter().any(|(id, r)| {
            !finished.contains(id) && !tables.contains_key(id) && r.table.contains(&c.src)
        });
    if !held {
        return Err(format!("block copy from block {}, which no live request holds", c.src));
    }
    Ok(())
}

/// `step` without request `id`'s parts (its new request, update, work, preemption and KV
/// operations, which come back beside it), or `None` when it names no part of it. Its
/// `finished_ids` stay: forgetting a request is never a fault.
fn without(step: &v1::Step, id: u64) -> Option<(v1::Step, Vec<v1::KvOperation>)> {
    let ops_of = |op: &v1::KvOperation| super::kv::request_of_op(op) == Some(id);
    let named = step.new_requests.iter().any(|r| r.id == id)
        || step.cached_requests.iter().any(|r| r.id == id)
        || step.work.iter().any(|w| w.id == id)
        || step.preempted_ids.contains(&id)
        || step.kv_ops.iter().any(ops_of)
        || step.block_copies.iter().any(|c| c.id == id);
    if !named {
        return None;
    }
    let mut rest = step.clone();
    rest.new_requests.retain(|r| r.id != id);
    rest.cached_requests.retain(|r| r.id != id);
    let its_tokens: u32 = rest.work.iter().filter(|w| w.id == id).map(|w| w.num_tokens).sum();
    rest.total_num_tokens = rest.total_num_tokens.wrapping_sub(its_tokens);
    rest.work.retain(|w| w.id != id);
    rest.preempted_ids.retain(|p| *p != id);
    rest.block_copies.retain(|c| c.id != id);
    let (dropped, kept) = std::mem::take(&mut rest.kv_ops).into_iter().partition(ops_of);
    rest.kv_ops = kept;
    Some((rest, dropped))
}
