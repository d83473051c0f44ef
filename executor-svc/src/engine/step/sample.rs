//! A step's results from its batch's output: each planned request's prompt log-probabilities,
//! its sampled token (every sampling row of the step drawn together, in parallel from
//! [`PARALLEL_DRAWS`] rows on), or a verification's tokens (each draft position sampled exactly
//! as decoding would). On the simulator, whose batch computes no logits, the tokens are its
//! deterministic ones.

use std::collections::{HashMap, HashSet};

use ferry_proto::v1;

use super::batch::{logit_rows, Planned};
use super::{Engine, ExecRequest};
use crate::engine::backend::BatchOutput;
use crate::engine::grammar::{self, Grammar, TokenMask};
use crate::engine::sampling::{LogitAdjust, Sampler, SamplingParams, PARALLEL_DRAWS};
use crate::engine::simulated_gpu::sim_token_except;

impl Engine {
    /// Turns the forward's `output` into each planned request's result: prompt
    /// log-probabilities, a sampled token, or a verification's tokens. The outputs, the
    /// requests that cannot go on (with why), and the simulated time.
    pub(super) fn sample_batch(
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
    crate::forward::paged::in_pool(|| jobs.into_par_iter().map_init(Sampler::new, draw).collect())
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
