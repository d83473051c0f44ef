//! Per-request token sampling: turns one row of logits into a request's next token.
//!
//! Why it exists: the executor samples on its own side of the session (DESIGN.md section 4), so
//! the rules that make a generation reproducible live here, in one place.
//!
//! What it guarantees:
//! - **Determinism by position.** A draw uses no RNG state: its uniform number is a hash of the
//!   request's seed and the absolute position of the token being sampled ([`position_uniform`]).
//!   So the token depends only on (logits, params, prompt, output, position): not on what else
//!   is in the batch, and a request that is preempted, resumed, or restarted on another executor
//!   from prompt + generated tokens continues exactly.
//! - **Order of operations** (vLLM v1 / Hugging Face): NaN logits become `-inf` (a NaN token is
//!   never sampled) and `+inf` becomes `f32::MAX`; log-probabilities are taken; penalties
//!   (repetition, presence, frequency); temperature; top-k; top-p; min-p; the draw by inverse
//!   CDF over the surviving tokens.
//! - **Log-probabilities are those of the raw model distribution**: `log_softmax` of the logits
//!   as the model produced them, before penalties and temperature. This matches vLLM's default
//!   `logprobs_mode = raw_logprobs`: what a client sees does not depend on its sampling knobs.
//! - **Greedy** (temperature 0, or top-k 1) is the argmax of the penalized logits, lowest id on
//!   ties; it draws nothing.
//! - **No panic on bad input**: parameters are validated ([`SamplingParams::validate`]), empty
//!   logits or logits with no finite value are errors, history ids outside the vocabulary are
//!   ignored.
//! - **Draw order.** Filters zero the weights of the tokens they drop and the draw is an
//!   inverse CDF over the survivors in id order; top-k and top-p keep exact sets (ties broken by
//!   lower id), found by selection rather than sorting.
//!
//! Cost, for a vocabulary of V (49k) and a history of H tokens, measured on one core: greedy is
//! one pass (~30 us); temperature alone adds one vectorised exponential pass and a blockwise
//! walk (~80 us); a small top-k only exponentiates its k survivors (~40 us); top-p runs a
//! weighted quickselect over the head of the distribution (~100 us when peaked, ~400 us for a
//! flat row); raw log-probabilities add one exponential pass. Penalties cost O(H) with a
//! per-vocabulary mark table held by [`Sampler`], which owns every scratch buffer, so a
//! long-lived `Sampler` does not allocate in the steady state.

mod draw;
#[cfg(test)]
mod tests;

use draw::{
    argmax, exp_nonpositive, inverse_cdf, key_value, log_sum_exp, max_logit, nucleus_cutoff,
    top_k_keys, top_n,
};
pub use draw::{position_hash, position_uniform};
pub use ferry_model::sampling::*;

/// Rejection sampling of one draft token (speculative decoding's acceptance rule, Leviathan
/// et al. 2023, as vLLM's rejection sampler): `p` is the target's distribution at the draft's
/// position (after the request's penalties, temperature and truncation), `q` the drafter's,
/// `draft` the token it proposed. The draft is accepted with probability min(1, p/q) (tested
/// with `u_accept`); otherwise a token is drawn from the residual max(0, p - q), normalised
/// (with `u_resample`). The token returned is distributed exactly as `p` for any `q` that
/// proposed `draft` with probability `q[draft]`; the flag says whether it was the draft.
///
/// For a proposal that is certain (`q` one-hot at the draft: n-gram lookup, Ferry's only
/// proposer today) this is the same law as drawing `x ~ p` and accepting iff `x == draft`:
/// acceptance has probability p(draft), and a rejection yields `p` without the draft,
/// normalised. The executor uses that second form, with the draw decoding would make at the
/// same position, so a speculated output is not just distributed like a plain one but equal
/// to it. A draft model's `q` would use this function (docs/ARCHITECTURE.md).
pub fn verify_draft(
    p: &[f32],
    q: &[f32],
    draft: u32,
    u_accept: f64,
    u_resample: f64,
) -> (u32, bool) {
    let d = draft as usize;
    let (pd, qd) =
        (f64::from(p.get(d).copied().unwrap_or(0.0)), f64::from(q.get(d).copied().unwrap_or(0.0)));
    if qd > 0.0 && u_accept * qd < pd {
        return (draft, true);
    }
    let residual: Vec<f32> = p.iter().zip(q).map(|(&a, &b)| (a - b).max(0.0)).collect();
    if residual.iter().any(|&w| w > 0.0) {
        (inverse_cdf(&residual, u_resample), false)
    } else {
        // p == q up to rounding: the draft was accepted with probability 1 but for rounding.
        (inverse_cdf(p, u_resample), false)
    }
}

/// Samples one token with a throwaway [`Sampler`]; prefer a long-lived `Sampler` on hot paths.
pub fn sample(
    logits: &mut [f32],
    params: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
    position: u64,
) -> Result<Sampled, SamplingError> {
    Sampler::new().sample(logits, params, prompt, output, position)
}

/// Rows of a step from which the engine (and the bench, as it) draws them in parallel on the
/// forward's threads: below, a draw costs less than handing it to another thread.
pub const PARALLEL_DRAWS: usize = 4;

/// Reusable scratch space for sampling, so steady-state sampling does not allocate. One per
/// executor thread; it carries no state from one call to the next that could change a result.
#[derive(Debug, Default)]
pub struct Sampler {
    /// Per vocabulary id: 0 = not in the history, else 1 + its count in the output. Reset to
    /// all-zero before every return.
    marks: Vec<u32>,
    /// Ids whose mark is set, in first-seen order.
    touched: Vec<u32>,
    /// (id, raw logit) of the tokens the penalties changed, for the raw log-probability.
    raw_touched: Vec<(u32, f32)>,
    /// Unnormalised probabilities, indexed by token id; a filter zeroes the tokens it drops.
    weights: Vec<f32>,
    /// Rank keys ([`rank_key`]) for the top-k and top-p selections.
    keys: Vec<u64>,
    /// (id, raw logit) of the tokens a [`LogitAdjust`] biased, for the raw log-probability.
    raw_biased: Vec<(u32, f32)>,
}

impl Sampler {
    /// An empty sampler; buffers grow on first use.
    pub fn new() -> Self {
        Self::default()
    }

    /// Picks the token at `position` (the absolute index of the token being sampled, that is
    /// `prompt.len() + output.len()` for an ordinary decode) from `logits`, one row over the
    /// vocabulary. `prompt` and `output` are the request's tokens so far, for the penalties.
    ///
    /// On return `logits` holds the penalized logits (NaN as `-inf`, `+inf` as `f32::MAX`);
    /// temperature and truncation are not written back.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        params: &SamplingParams,
        prompt: &[u32],
        output: &[u32],
        position: u64,
    ) -> Result<Sampled, SamplingError> {
        self.sample_adjusted(logits, params, &LogitAdjust::default(), prompt, output, position)
    }

    /// The raw log-probability of `token` in `row` (the model's distribution: no mask, bias or
    /// penalty, as vLLM's prompt log-probabilities) and the `top` most likely tokens, best
    /// first.
    pub fn score(&mut self, row: &mut [f32], token: u32, top: u32) -> (f32, Vec<(u32, f32)>) {
        for l in row.iter_mut() {
            *l = if l.is_nan() { f32::NEG_INFINITY } else { l.min(f32::MAX) };
        }
        let mut best = Vec::new();
        top_n(row, top as usize, &mut self.keys, &mut best);
        let log_z = log_sum_exp(row, &mut self.weights);
        let logprob =
            row.get(token as usize).map_or(f32::NEG_INFINITY, |l| (f64::from(*l) - log_z) as f32);
        for entry in &mut best {
            entry.1 = (f64::from(entry.1) - log_z) as f32;
        }
        (logprob, best)
    }

    /// As [`Self::sample`], with `adjust` (logit biases, allowed tokens) applied to the logits
    /// after the raw log-probabilities are taken and before the penalties, as vLLM orders them.
    pub fn sample_adjusted(
        &mut self,
        logits: &mut [f32],
        params: &SamplingParams,
        adjust: &LogitAdjust,
        prompt: &[u32],
        output: &[u32],
        position: u64,
    ) -> Result<Sampled, SamplingError> {
        params.validate()?;
        if logits.is_empty() {
            return Err(SamplingError::EmptyLogits);
        }
        for l in logits.iter_mut() {
            *l = if l.is_nan() { f32::NEG_INFINITY } else { l.min(f32::MAX) };
        }
        let mut top_logprobs = Vec::new();
        let log_z = if params.logprobs {
            top_n(logits, params.top_logprobs as usize, &mut self.keys, &mut top_logprobs);
            Some(log_sum_exp(logits, &mut self.weights))
        } else {
            None
        };
        // The sampled token is always allowed, so only a bias can change its logit: remember
        // the raw logits of the biased tokens (at most a few hundred), not the whole row.
        self.raw_biased.clear();
        if log_z.is_some() {
            self.raw_biased.extend(
                adjust.bias.iter().filter_map(|&(t, _)| Some((t, *logits.get(t as usize)?))),
            );
        }
        adjust.apply(logits, output);
        self.apply_penalties(logits, params, prompt, output);
        let token = if params.is_greedy() {
            argmax(logits)?
        } else {
            self.draw(logits, params, position_uniform(params.seed, position))?
        };
        let logprob = log_z.map(|log_z| {
            // A biased token's raw logit is from before the bias; the penalties' record of it
            // would hold the biased one.
            let raw = self
                .raw_biased
                .iter()
                .chain(&self.raw_touched)
                .find(|(id, _)| *id == token)
                .map_or(logits[token as usize], |&(_, raw)| raw);
            (f64::from(raw) - log_z) as f32
        });
        for entry in &mut top_logprobs {
            entry.1 = (f64::from(entry.1) - log_z.unwrap_or(0.0)) as f32;
        }
        Ok(Sampled { token, logprob, top_logprobs })
    }

    /// Applies the repetition (prompt + output) and presence/frequency (output only) penalties
    /// to the tokens of the history, remembering their raw logits.
    fn apply_penalties(
        &mut self,
        logits: &mut [f32],
        params: &SamplingParams,
        prompt: &[u32],
        output: &[u32],
    ) {
        self.raw_touched.clear();
        let repetition = params.repetition_on();
        if !repetition && !params.additive_on() {
            return;
        }
        let vocab = logits.len();
        if self.marks.len() < vocab {
            self.marks.resize(vocab, 0);
        }
        self.touched.clear();
        if repetition {
            for &id in prompt {
                if (id as usize) < vocab && self.marks[id as usize] == 0 {
                    self.marks[id as usize] = 1;
                    self.touched.push(id);
                }
            }
        }
        for &id in output {
            if (id as usize) >= vocab {
                continue;
            }
            let mark = &mut self.marks[id as usize];
            if *mark == 0 {
                *mark = 1;
                self.touched.push(id);
            }
            *mark = mark.saturating_add(1);
        }
        for &id in &self.touched {
            let i = id as usize;
            let count = self.marks[i] - 1;
            self.marks[i] = 0;
            let raw = logits[i];
            let mut l = raw;
            if repetition {
                let p = params.repetition_penalty;
                l = if l > 0.0 { l / p } else { l * p };
            }
            if count > 0 {
                l -= params.presence_penalty + params.frequency_penalty * count as f32;
            }
            // A tiny repetition penalty or a negative penalty can overflow to +inf; keep the
            // logit finite so the softmax stays defined.
            logits[i] = l.min(f32::MAX);
            self.raw_touched.push((id, raw));
        }
    }

    /// Draws with the uniform `u` after temperature, top-k, top-p and min-p. Each filter zeroes
    /// the weights of the tokens it drops, so nothing is sorted: top-k and top-p each find a
    /// cutoff rank by selection, and the draw is an inverse CDF in id order.
    fn draw(
        &mut self,
        logits: &[f32],
        params: &SamplingParams,
        u: f64,
    ) -> Result<u32, SamplingError> {
        let max = max_logit(logits);
        if max == f32::NEG_INFINITY {
            return Err(SamplingError::NoFiniteLogit);
        }
        let inv_t = 1.0 / params.temperature;
        if !inv_t.is_finite() {
            // A subnormal temperature: every token but the best has probability 0.
            return argmax(logits);
        }
        // Weights are exp((l - max) / T) in [0, 1] and the best token weighs exactly 1, so
        // top-k and top-p always keep it and min-p keeps the tokens with w >= min_p.
        let weights = &mut self.weights;
        weights.clear();
        if params.top_k_on(logits.len()) {
            // Only the k survivors need an exponential.
            weights.resize(logits.len(), 0.0);
            for &key in top_k_keys(logits, params.top_k as usize, &mut self.keys).iter() {
                let id = !(key as u32) as usize;
                weights[id] = exp_nonpositive((logits[id] - max) * inv_t);
            }
        } else {
            weights.extend(logits.iter().map(|&l| exp_nonpositive((l - max) * inv_t)));
        }
        if params.top_p_on() {
            // Every nucleus token is among `keys` (see `nucleus_cutoff`): rebuild the weights
            // from those at or above the cutoff instead of a pass over the vocabulary.
            let cutoff = nucleus_cutoff(weights, params.top_p, &mut self.keys);
            weights.fill(0.0);
            for &key in self.keys.iter().filter(|&&key| key >= cutoff) {
                weights[!(key as u32) as usize] = key_value(key);
            }
        }
        if params.min_p > 0.0 {
            for w in weights.iter_mut() {
                *w = if *w < params.min_p { 0.0 } else { *w };
            }
        }
        Ok(inverse_cdf(weights, u))
    }
}
