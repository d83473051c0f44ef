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

use ferry_proto::v1;

/// The most alternatives a request may ask for per position (as OpenAI's `top_logprobs`).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Presence and frequency penalties must lie in `[-MAX_ADDITIVE_PENALTY, MAX_ADDITIVE_PENALTY]`
/// (OpenAI's range).
pub const MAX_ADDITIVE_PENALTY: f32 = 2.0;

/// How a request's next token is chosen. All-zero ([`Default`]) is greedy with every knob off,
/// like the proto's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 selects greedy decoding.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 disables it, 1 is greedy.
    pub top_k: u32,
    /// Keep the smallest set of most likely tokens whose probability sums to at least this;
    /// 0 or 1 disables it.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables it.
    pub min_p: f32,
    /// Seed of this request's draws; together with the position it fixes each draw.
    pub seed: u64,
    /// Multiplicative penalty on tokens seen in the prompt or the output (>1 discourages):
    /// a positive logit is divided by it, a non-positive one multiplied. 0 or 1 disables it.
    pub repetition_penalty: f32,
    /// Subtracted from the logit of every token that appears in the output.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per appearance in the output.
    pub frequency_penalty: f32,
    /// Return the sampled token's log-probability.
    pub logprobs: bool,
    /// Also return this many most likely tokens with their log-probabilities; honoured only
    /// with `logprobs`.
    pub top_logprobs: u32,
}

/// Why a token could not be sampled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A parameter is NaN, infinite or out of its range.
    #[error("sampling parameter `{param}` is {value}, expected {expected}")]
    InvalidParam {
        /// The parameter's name, as in the API.
        param: &'static str,
        /// The value received.
        value: f32,
        /// The allowed range, in words.
        expected: &'static str,
    },
    /// More alternatives were asked for than [`MAX_TOP_LOGPROBS`].
    #[error("sampling parameter `top_logprobs` is {requested}, expected at most {max}")]
    TooManyTopLogprobs {
        /// The number asked for.
        requested: u32,
        /// [`MAX_TOP_LOGPROBS`].
        max: u32,
    },
    /// The logits row is empty (a vocabulary of size 0).
    #[error("cannot sample from empty logits")]
    EmptyLogits,
    /// Every logit is `-inf` or NaN (after penalties), so no token has any probability.
    #[error("cannot sample: no token has a finite logit")]
    NoFiniteLogit,
}

/// One sampled token and, when asked for, its log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The chosen token id.
    pub token: u32,
    /// Its log-probability under the raw model distribution, when `logprobs` was set.
    pub logprob: Option<f32>,
    /// The `top_logprobs` most likely tokens under the raw distribution as (id, logprob), best
    /// first, lower id first on ties; empty unless `logprobs` was set.
    pub top_logprobs: Vec<(u32, f32)>,
}

impl SamplingParams {
    /// Converts the wire form; `default_seed` is used when the request set no seed (the
    /// executor derives it from the request id, so it is stable across restarts).
    pub fn from_proto(p: &v1::SamplingParams, default_seed: u64) -> Self {
        Self {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            seed: p.seed.unwrap_or(default_seed),
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            logprobs: p.logprobs,
            top_logprobs: p.top_logprobs,
        }
    }

    /// Checks every value is a number in its range, naming the first one that is not.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let max = MAX_ADDITIVE_PENALTY;
        check("temperature", self.temperature, 0.0, f32::MAX, "a finite number >= 0")?;
        check("top_p", self.top_p, 0.0, 1.0, "a number in [0, 1]")?;
        check("min_p", self.min_p, 0.0, 1.0, "a number in [0, 1]")?;
        check(
            "repetition_penalty",
            self.repetition_penalty,
            0.0,
            f32::MAX,
            "a finite number >= 0",
        )?;
        check("presence_penalty", self.presence_penalty, -max, max, "a number in [-2, 2]")?;
        check("frequency_penalty", self.frequency_penalty, -max, max, "a number in [-2, 2]")?;
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(SamplingError::TooManyTopLogprobs {
                requested: self.top_logprobs,
                max: MAX_TOP_LOGPROBS,
            });
        }
        Ok(())
    }

    /// Whether the token is the argmax rather than a draw.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    fn repetition_on(&self) -> bool {
        self.repetition_penalty != 0.0 && self.repetition_penalty != 1.0
    }

    fn additive_on(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    fn top_k_on(&self, vocab: usize) -> bool {
        self.top_k > 0 && (self.top_k as usize) < vocab
    }

    fn top_p_on(&self) -> bool {
        self.top_p > 0.0 && self.top_p < 1.0
    }
}

fn check(
    param: &'static str,
    value: f32,
    lo: f32,
    hi: f32,
    expected: &'static str,
) -> Result<(), SamplingError> {
    // `contains` is false for NaN, so NaN is rejected along with the out-of-range values.
    if (lo..=hi).contains(&value) {
        Ok(())
    } else {
        Err(SamplingError::InvalidParam { param, value, expected })
    }
}

/// A 64-bit hash of (seed, position): the counter-based generator behind every draw. SplitMix64's
/// finaliser applied twice; for a fixed seed, distinct positions give distinct hashes.
pub fn position_hash(seed: u64, position: u64) -> u64 {
    splitmix64(splitmix64(seed) ^ position)
}

/// The uniform number in `[0, 1)` used to draw the token at `position` of a request seeded with
/// `seed`.
pub fn position_uniform(seed: u64, position: u64) -> f64 {
    // The top 53 bits fill an f64 mantissa exactly, so the result is < 1.
    (position_hash(seed, position) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
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
        self.apply_penalties(logits, params, prompt, output);
        let token = if params.is_greedy() {
            argmax(logits)?
        } else {
            self.draw(logits, params, position_uniform(params.seed, position))?
        };
        let logprob = log_z.map(|log_z| {
            let raw = self
                .raw_touched
                .iter()
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
            weights.iter_mut().for_each(|w| *w = 0.0);
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

/// Lanes of the hand-unrolled reductions, so the compiler can vectorise them.
const LANES: usize = 8;

/// Tokens per block of the inverse-CDF walk.
const DRAW_BLOCK: usize = 512;

/// A key whose order is the sampling rank: higher value first, then lower id. Unique per id,
/// so "the k best" and "the nucleus" are exact sets whatever the ties.
fn rank_key(value: f32, id: u32) -> u64 {
    // Map the float's bits to an unsigned integer with the same order (no NaN reaches here).
    let bits = value.to_bits();
    let ordered = if bits >> 31 == 1 { !bits } else { bits | 0x8000_0000 };
    (u64::from(ordered) << 32) | u64::from(!id)
}

/// The value encoded in a [`rank_key`].
fn key_value(key: u64) -> f32 {
    let ordered = (key >> 32) as u32;
    f32::from_bits(if ordered >> 31 == 1 { ordered & 0x7FFF_FFFF } else { !ordered })
}

/// The weight encoded in a [`rank_key`] of a weight.
fn key_weight(key: u64) -> f64 {
    f64::from(key_value(key))
}

/// Tokens per block for the top-k prefilter.
const MAX_BLOCK: usize = 64;

/// The rank keys of the k best logits (0 < k < len), in no order; the first is the k-th best.
///
/// Selecting over the whole vocabulary costs ~100 us at 49k tokens, so for a small k it first
/// finds a floor: the k-th best of the per-block maxima. Each of those k blocks holds a token
/// at or above the floor, so the k best all are, and only blocks whose maximum reaches the
/// floor (k of them, plus ties) are scanned.
fn top_k_keys<'k>(logits: &[f32], k: usize, keys: &'k mut Vec<u64>) -> &'k mut [u64] {
    keys.clear();
    let blocks = logits.len().div_ceil(MAX_BLOCK);
    let floor = if k <= blocks / 2 {
        let maxima = logits.chunks(MAX_BLOCK).enumerate();
        keys.extend(maxima.map(|(b, c)| rank_key(max_logit(c), b as u32)));
        let at = keys.len() - k;
        let floor = key_value(*keys.select_nth_unstable(at).1);
        keys.clear();
        floor
    } else {
        f32::NEG_INFINITY
    };
    for (b, block) in logits.chunks(MAX_BLOCK).enumerate() {
        if max_logit(block) < floor {
            continue;
        }
        let first = (b * MAX_BLOCK) as u32;
        let ids = (first..).zip(block).filter(|(_, &l)| l >= floor);
        keys.extend(ids.map(|(id, &l)| rank_key(l, id)));
    }
    let at = keys.len() - k;
    keys.select_nth_unstable(at);
    &mut keys[at..]
}

/// The rank key of the worst token of the top-p nucleus: the smallest set of best-ranked
/// tokens whose weights sum to at least `top_p` of the total. On return `keys` holds (in no
/// order) the keys of a superset of the nucleus. A weighted quickselect: expected
/// O(n) however large the nucleus, where sorting it would cost O(n log n).
fn nucleus_cutoff(weights: &[f32], top_p: f32, keys: &mut Vec<u64>) -> u64 {
    // The mass still to cover within `rest`; always > 0 (the best token weighs 1).
    let mut need = f64::from(top_p) * mass_at_least(weights, 0.0);
    // Only tokens at least as heavy as `floor` can be in the nucleus once the tokens at or
    // above it hold `need`; halving it from 1/2 keeps the selection to the head of a peaked
    // distribution at the price of a few vectorised passes.
    let mut floor = 0.5;
    while floor > 1e-12 && mass_at_least(weights, floor) < need {
        floor *= 0.5;
    }
    if floor <= 1e-12 {
        floor = 0.0;
    }
    keys.clear();
    for (b, block) in weights.chunks(MAX_BLOCK).enumerate() {
        let heaviest = max_logit(block);
        if heaviest < floor || heaviest <= 0.0 {
            continue;
        }
        let first = (b * MAX_BLOCK) as u32;
        let ids = (first..).zip(block).filter(|(_, &w)| w > 0.0 && w >= floor);
        keys.extend(ids.map(|(id, &w)| rank_key(w, id)));
    }
    let mut rest = &mut keys[..];
    while rest.len() > 1 {
        let mid = rest.len() / 2;
        let (worse, pivot, better) = std::mem::take(&mut rest).select_nth_unstable(mid);
        let better_mass: f64 = better.iter().map(|&k| key_weight(k)).sum();
        let pivot = *pivot;
        if better_mass >= need {
            rest = better; // non-empty, as need > 0
        } else if better_mass + key_weight(pivot) >= need {
            return pivot;
        } else {
            need -= better_mass + key_weight(pivot);
            rest = worse;
        }
    }
    // One token left: the nucleus ends there (or rounding fell short: keep everything).
    rest.first().copied().unwrap_or(0)
}

/// Inverse-CDF draw over `weights` in id order: the first token whose cumulative weight
/// exceeds `u` times the total. Walks per-block sums, then within the block; the total is the
/// sum of the same block sums, so the walk always lands in a block, and rounding within it
/// falls back to that block's last drawable token.
fn inverse_cdf(weights: &[f32], u: f64) -> u32 {
    let total: f64 = weights.chunks(DRAW_BLOCK).map(block_sum).sum();
    let target = u * total;
    let mut cumulative = 0.0;
    let mut last_block = 0;
    for (b, block) in weights.chunks(DRAW_BLOCK).enumerate() {
        let mass = block_sum(block);
        if mass <= 0.0 {
            continue;
        }
        last_block = b;
        if cumulative + mass > target {
            let mut pick = 0;
            for (i, &w) in block.iter().enumerate().filter(|&(_, &w)| w > 0.0) {
                pick = i;
                cumulative += f64::from(w);
                if cumulative > target {
                    break;
                }
            }
            return (b * DRAW_BLOCK + pick) as u32;
        }
        cumulative += mass;
    }
    // Only when u * total rounds up to total: the last drawable token.
    let block = weights.chunks(DRAW_BLOCK).nth(last_block).unwrap_or_default();
    (last_block * DRAW_BLOCK + block.iter().rposition(|&w| w > 0.0).unwrap_or(0)) as u32
}

/// The total of the weights that are at least `floor`, by blocks of lanes.
fn mass_at_least(weights: &[f32], floor: f32) -> f64 {
    weights
        .chunks(DRAW_BLOCK)
        .map(|block| {
            let mut lanes = [0.0f32; LANES];
            let chunks = block.chunks_exact(LANES);
            let tail = chunks.remainder().iter().filter(|&&w| w >= floor);
            let tail: f64 = tail.map(|&w| f64::from(w)).sum();
            for chunk in chunks {
                for (lane, &w) in lanes.iter_mut().zip(chunk) {
                    *lane += if w >= floor { w } else { 0.0 };
                }
            }
            lanes.iter().map(|&l| f64::from(l)).sum::<f64>() + tail
        })
        .sum()
}

/// The sum of a block of weights, in lanes (each lane sums at most DRAW_BLOCK / LANES values
/// in f32, so precision is not at risk).
fn block_sum(block: &[f32]) -> f64 {
    let mut lanes = [0.0f32; LANES];
    let chunks = block.chunks_exact(LANES);
    let tail: f64 = chunks.remainder().iter().map(|&w| f64::from(w)).sum();
    for chunk in chunks {
        for (lane, &w) in lanes.iter_mut().zip(chunk) {
            *lane += w;
        }
    }
    lanes.iter().map(|&l| f64::from(l)).sum::<f64>() + tail
}

/// The highest logit (NaN-free input), in lanes.
fn max_logit(logits: &[f32]) -> f32 {
    let larger = |m: f32, l: f32| if l > m { l } else { m };
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder().iter().copied().fold(f32::NEG_INFINITY, larger);
    for chunk in chunks {
        for (lane, &l) in lanes.iter_mut().zip(chunk) {
            *lane = larger(*lane, l);
        }
    }
    lanes.into_iter().fold(tail, larger)
}

/// The highest logit's id, lowest id on ties.
fn argmax(logits: &[f32]) -> Result<u32, SamplingError> {
    let max = max_logit(logits);
    if max == f32::NEG_INFINITY {
        return Err(SamplingError::NoFiniteLogit);
    }
    Ok(logits.iter().position(|&l| l == max).unwrap_or(0) as u32)
}

/// `ln(sum(exp(logits)))`, using `scratch` for the exponentials.
fn log_sum_exp(logits: &[f32], scratch: &mut Vec<f32>) -> f64 {
    let max = max_logit(logits);
    if max == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    scratch.clear();
    scratch.extend(logits.iter().map(|&l| exp_nonpositive(l - max)));
    let sum: f64 = scratch.chunks(DRAW_BLOCK).map(block_sum).sum();
    f64::from(max) + sum.ln()
}

/// `e^x` for `x <= 0` (including `-inf`), within 2 ulp, and 0 below -87 (where the true value
/// is under 2^-125, below any weight that matters next to the best token's 1).
///
/// Why not `f32::exp`: it is a libm call per token, which does not vectorise (~5 ns each, a
/// quarter of a millisecond per 49k-token row), and libm results differ between platforms,
/// which would let two executors draw different tokens from the same logits. This uses only
/// IEEE-exact basic operations (no fused multiply-add), so it is fast and bit-reproducible.
/// Range reduction and polynomial are Cephes' `expf`.
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4; // 0.693359375 exactly, as f32
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to the nearest integer n (its ulp is 1) and leaves n in the low
    // mantissa bits, so 2^n is built with integer operations (an `as i32` cast would saturate
    // and check for NaN, which stops vectorisation).
    const ROUND: f32 = 12_582_912.0;
    let clamped = if x > -87.0 { x } else { -87.0 };
    let shifted = clamped * LOG2_E + ROUND;
    let n = shifted - ROUND; // in [-126, 0]
    let r = clamped - n * LN2_HI - n * LN2_LO; // |r| <= ln(2) / 2
    let poly = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e_r = poly * r * r + r + 1.0;
    let biased = shifted.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127);
    let two_n = f32::from_bits(biased << 23);
    if x > -87.0 {
        e_r * two_n
    } else {
        0.0
    }
}

/// The `n` highest logits as (id, logit), best first, lower id first on ties.
fn top_n(logits: &[f32], n: usize, keys: &mut Vec<u64>, out: &mut Vec<(u32, f32)>) {
    out.clear();
    if n == 0 {
        return;
    }
    let best = if n < logits.len() {
        top_k_keys(logits, n, keys)
    } else {
        keys.clear();
        keys.extend(logits.iter().enumerate().map(|(id, &l)| rank_key(l, id as u32)));
        &mut keys[..]
    };
    best.sort_unstable_by(|a, b| b.cmp(a));
    out.extend(best.iter().map(|&k| (!(k as u32), key_value(k))));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_temperature(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, seed: 7, ..SamplingParams::default() }
    }

    /// Deterministic pseudo-random logits in [0, 4).
    fn random_logits(vocab: usize, salt: u64) -> Vec<f32> {
        (0..vocab as u64).map(|i| (position_uniform(salt, i) * 4.0) as f32).collect()
    }

    fn sample_once(logits: &[f32], params: &SamplingParams, position: u64) -> Sampled {
        let mut row = logits.to_vec();
        sample(&mut row, params, &[], &[], position).expect("valid input")
    }

    fn draw_counts(logits: &[f32], params: &SamplingParams, draws: u64) -> Vec<u64> {
        let mut sampler = Sampler::new();
        let mut counts = vec![0; logits.len()];
        for position in 0..draws {
            let mut row = logits.to_vec();
            let token = sampler.sample(&mut row, params, &[], &[], position).unwrap().token;
            counts[token as usize] += 1;
        }
        counts
    }

    fn softmax(logits: &[f32], temperature: f32) -> Vec<f64> {
        let scaled: Vec<f64> =
            logits.iter().map(|&l| f64::from(l) / f64::from(temperature)).collect();
        let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = scaled.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = exps.iter().sum();
        exps.iter().map(|e| e / sum).collect()
    }

    fn chi_square(counts: &[u64], probs: &[f64]) -> f64 {
        let n: u64 = counts.iter().sum();
        counts
            .iter()
            .zip(probs)
            .filter(|(_, &p)| p > 0.0)
            .map(|(&c, &p)| {
                let expected = p * n as f64;
                (c as f64 - expected).powi(2) / expected
            })
            .sum()
    }

    /// The rank key of the k-th best logit (0 < k < len).
    fn kth_best(logits: &[f32], k: usize, keys: &mut Vec<u64>) -> u64 {
        top_k_keys(logits, k, keys)[0]
    }

    /// (id, value) best first, lower id first on ties.
    fn best_first(values: &[f32]) -> Vec<(u32, f32)> {
        let mut ranked: Vec<(u32, f32)> =
            values.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        ranked
    }

    fn argmax_of(logits: &[f32]) -> u32 {
        argmax(logits).unwrap()
    }

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let p = SamplingParams::default();
        assert_eq!(sample_once(&[1.0, 3.0, 3.0, -2.0], &p, 0).token, 1);
        assert_eq!(sample_once(&[5.0], &p, 9).token, 0);
        let logits = random_logits(49_152, 1);
        assert_eq!(sample_once(&logits, &p, 3).token, argmax_of(&logits));
        // Truncation knobs cannot change an argmax.
        let knobs = SamplingParams { top_p: 0.1, min_p: 0.5, top_k: 3, ..p };
        assert_eq!(sample_once(&logits, &knobs, 3).token, argmax_of(&logits));
    }

    #[test]
    fn top_k_one_equals_greedy_at_any_temperature() {
        let logits = random_logits(1000, 2);
        for temperature in [0.0, 0.5, 1.0, 5.0, 100.0] {
            let p = SamplingParams { top_k: 1, ..with_temperature(temperature) };
            for position in 0..50 {
                assert_eq!(sample_once(&logits, &p, position).token, argmax_of(&logits));
            }
        }
    }

    #[test]
    fn same_seed_and_position_give_the_same_token_whatever_ran_before() {
        let logits = random_logits(500, 3);
        let p = SamplingParams { top_p: 0.9, ..with_temperature(1.0) };
        let mut busy = Sampler::new();
        for position in 0..20 {
            let mut other = random_logits(800, position);
            let noise = SamplingParams { seed: 99, repetition_penalty: 1.3, ..p };
            busy.sample(&mut other, &noise, &[1, 2, 3], &[4, 4], position).unwrap();
        }
        for position in 0..20 {
            let mut row = logits.clone();
            let from_busy = busy.sample(&mut row, &p, &[], &[], position).unwrap().token;
            assert_eq!(from_busy, sample_once(&logits, &p, position).token);
        }
    }

    #[test]
    fn draws_vary_with_position_and_seed() {
        let flat = vec![0.0; 50];
        let p = with_temperature(1.0);
        let by_position: std::collections::HashSet<u32> =
            (0..100).map(|pos| sample_once(&flat, &p, pos).token).collect();
        assert!(by_position.len() > 25, "only {} distinct tokens", by_position.len());
        let by_seed: std::collections::HashSet<u32> = (0..100)
            .map(|seed| sample_once(&flat, &SamplingParams { seed, ..p }, 5).token)
            .collect();
        assert!(by_seed.len() > 25, "only {} distinct tokens", by_seed.len());
    }

    #[test]
    fn uniform_is_in_unit_interval_with_mean_one_half() {
        let n = 100_000;
        let mut sum = 0.0;
        for position in 0..n {
            let u = position_uniform(42, position);
            assert!((0.0..1.0).contains(&u));
            sum += u;
        }
        assert!((sum / n as f64 - 0.5).abs() < 0.005);
    }

    #[test]
    fn a_restarted_request_continues_exactly() {
        // A toy model whose logits depend on the history, as a real one's do.
        fn logits_after(history: &[u32]) -> Vec<f32> {
            let salt = history.iter().fold(0u64, |h, &t| position_hash(h, u64::from(t)));
            random_logits(300, salt)
        }
        let p = SamplingParams {
            top_k: 40,
            top_p: 0.95,
            repetition_penalty: 1.2,
            frequency_penalty: 0.3,
            ..with_temperature(0.8)
        };
        let prompt = [5, 6, 7];
        let generate = |sampler: &mut Sampler, output: &mut Vec<u32>, until: usize| {
            while output.len() < until {
                let history: Vec<u32> = prompt.iter().chain(output.iter()).copied().collect();
                let mut row = logits_after(&history);
                let position = history.len() as u64;
                output.push(sampler.sample(&mut row, &p, &prompt, output, position).unwrap().token);
            }
        };
        let mut straight = Vec::new();
        generate(&mut Sampler::new(), &mut straight, 20);
        let mut resumed = straight[..10].to_vec();
        generate(&mut Sampler::new(), &mut resumed, 20);
        assert_eq!(straight, resumed);
    }

    #[test]
    fn temperature_one_matches_softmax() {
        let logits = [2.0, 1.0, 0.5, 0.0, -1.0];
        let counts = draw_counts(&logits, &with_temperature(1.0), 20_000);
        // 4 degrees of freedom: 18.5 is the 0.1% critical value; the draws are fixed, so this
        // is a regression check on the generator and the inverse CDF, not a flaky test.
        let chi = chi_square(&counts, &softmax(&logits, 1.0));
        assert!(chi < 18.5, "chi-square {chi}, counts {counts:?}");
    }

    #[test]
    fn temperature_scales_the_distribution() {
        let logits = [2.0, 1.0, 0.5, 0.0, -1.0];
        for temperature in [0.5, 2.0] {
            let counts = draw_counts(&logits, &with_temperature(temperature), 20_000);
            let chi = chi_square(&counts, &softmax(&logits, temperature));
            assert!(chi < 18.5, "T={temperature}: chi-square {chi}, counts {counts:?}");
        }
    }

    #[test]
    fn top_p_matches_softmax_when_nothing_is_cut() {
        let probs = [0.4f32, 0.3, 0.2, 0.1];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
        let p = SamplingParams { top_p: 0.95, ..with_temperature(1.0) };
        let counts = draw_counts(&logits, &p, 20_000);
        let chi = chi_square(&counts, &softmax(&logits, 1.0));
        assert!(chi < 16.3, "chi-square {chi}, counts {counts:?}"); // 3 dof, 0.1%
    }

    #[test]
    fn top_k_keeps_the_k_best_renormalised() {
        let logits = [2.0, 1.0, 0.5, 0.0, -1.0];
        let p = SamplingParams { top_k: 3, ..with_temperature(1.0) };
        let counts = draw_counts(&logits, &p, 20_000);
        assert_eq!(&counts[3..], &[0, 0]);
        let chi = chi_square(&counts[..3], &softmax(&logits[..3], 1.0));
        assert!(chi < 13.9, "chi-square {chi}, counts {counts:?}"); // 2 dof, 0.1%

        let big = random_logits(1000, 4);
        let best: Vec<u32> = best_first(&big)[..10].iter().map(|c| c.0).collect();
        let p = SamplingParams { top_k: 10, ..with_temperature(3.0) };
        let counts = draw_counts(&big, &p, 2000);
        let drawn: Vec<u32> = (0..1000).filter(|&i| counts[i as usize] > 0).collect();
        assert!(drawn.iter().all(|t| best.contains(t)), "drew {drawn:?}, top 10 {best:?}");
        assert!(drawn.len() >= 8);
    }

    #[test]
    fn top_p_keeps_the_nucleus_only() {
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let p = SamplingParams { top_p: 0.75, ..with_temperature(1.0) };
        let counts = draw_counts(&logits, &p, 5000);
        assert!(counts[0] > 0 && counts[1] > 0, "{counts:?}");
        assert_eq!(&counts[2..], &[0, 0]);
        // 0.5 / 0.8 of the nucleus.
        let share = counts[0] as f64 / 5000.0;
        assert!((share - 0.625).abs() < 0.03, "{share}");
    }

    #[test]
    fn top_p_nucleus_equals_brute_force_even_with_ties() {
        // Quantised weights make many ties, which the nucleus breaks by lower id.
        let tied: Vec<f32> =
            random_logits(3000, 8).iter().map(|l| (l * 4.0).round() / 16.0).collect();
        let smooth: Vec<f32> = random_logits(5000, 5).iter().map(|l| (l - 4.0).exp()).collect();
        for weights in [tied, smooth] {
            for top_p in [0.01, 0.3, 0.5, 0.9, 0.999] {
                let ranked = best_first(&weights);
                let target = f64::from(top_p) * weights.iter().map(|&w| f64::from(w)).sum::<f64>();
                let mut cumulative = 0.0;
                let len = 1 + ranked
                    .iter()
                    .position(|&(_, w)| {
                        cumulative += f64::from(w);
                        cumulative >= target
                    })
                    .unwrap();
                let cutoff = nucleus_cutoff(&weights, top_p, &mut Vec::new());
                let (id, w) = ranked[len - 1];
                assert_eq!(cutoff, rank_key(w, id), "top_p {top_p}, brute-force length {len}");
            }
        }
        let logits = random_logits(5000, 5);
        let p = SamplingParams { top_p: 0.5, ..with_temperature(1.0) };
        let weights: Vec<f32> = logits.iter().map(|l| (l - 4.0).exp()).collect();
        let cutoff = nucleus_cutoff(&weights, 0.5, &mut Vec::new());
        let mut drawn = std::collections::HashSet::new();
        for position in 0..300 {
            let token = sample_once(&logits, &p, position).token;
            assert!(rank_key(weights[token as usize], token) >= cutoff);
            drawn.insert(token);
        }
        assert!(drawn.len() > 100, "{}", drawn.len());
    }

    #[test]
    fn kth_best_breaks_ties_by_lower_id() {
        let logits = [1.0, 3.0, 2.0, 3.0, 2.0, 2.0, f32::NEG_INFINITY];
        let mut keys = Vec::new();
        assert_eq!(kth_best(&logits, 1, &mut keys), rank_key(3.0, 1));
        assert_eq!(kth_best(&logits, 2, &mut keys), rank_key(3.0, 3));
        assert_eq!(kth_best(&logits, 4, &mut keys), rank_key(2.0, 4));
        assert_eq!(kth_best(&logits, 6, &mut keys), rank_key(1.0, 0));
        assert!(rank_key(-1.0, 0) < rank_key(-0.5, 9) && rank_key(0.0, 0) < rank_key(1e-30, 0));
        for value in [0.0, -0.0, 1.5, -3.25, f32::MAX, f32::NEG_INFINITY, 1e-40] {
            assert_eq!(key_value(rank_key(value, 17)).to_bits(), value.to_bits());
        }
        // The block-maximum prefilter (small k) agrees with brute force, ties included.
        let tied: Vec<f32> = random_logits(10_000, 9).iter().map(|l| (l * 8.0).round()).collect();
        let ranked = best_first(&tied);
        for k in [1, 5, 50, 78, 200, 5000, 9999] {
            let (id, l) = ranked[k - 1];
            assert_eq!(kth_best(&tied, k, &mut keys), rank_key(l, id), "k {k}");
            let mut top = Vec::new();
            top_n(&tied, k, &mut keys, &mut top);
            assert_eq!(top, ranked[..k], "k {k}");
        }
    }

    #[test]
    fn fast_exp_matches_std_exp() {
        let mut x = 0.0f32;
        while x > -87.0 {
            let (fast, exact) = (f64::from(exp_nonpositive(x)), f64::from(x).exp());
            assert!(((fast - exact) / exact).abs() < 3e-7, "x {x}: {fast} vs {exact}");
            x -= 0.000_37;
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-88.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn inverse_cdf_walks_blocks_and_skips_zero_weights() {
        let mut weights = vec![0.0; 3 * DRAW_BLOCK + 7];
        weights[5] = 1.0;
        weights[DRAW_BLOCK + 3] = 1.0;
        weights[3 * DRAW_BLOCK + 2] = 2.0;
        assert_eq!(inverse_cdf(&weights, 0.0), 5);
        assert_eq!(inverse_cdf(&weights, 0.24), 5);
        assert_eq!(inverse_cdf(&weights, 0.26), DRAW_BLOCK as u32 + 3);
        assert_eq!(inverse_cdf(&weights, 0.51), 3 * DRAW_BLOCK as u32 + 2);
        assert_eq!(inverse_cdf(&weights, 1.0 - f64::EPSILON), 3 * DRAW_BLOCK as u32 + 2);
    }

    #[test]
    fn min_p_drops_tokens_below_its_share_of_the_best() {
        let logits: Vec<f32> = [0.6f32, 0.3, 0.05, 0.05].iter().map(|p| p.ln()).collect();
        for top_k in [0, 3] {
            let p = SamplingParams { min_p: 0.1, top_k, ..with_temperature(1.0) };
            let counts = draw_counts(&logits, &p, 3000);
            assert!(counts[0] > 0 && counts[1] > 0, "{counts:?}");
            assert_eq!(&counts[2..], &[0, 0], "top_k {top_k}");
        }
    }

    #[test]
    fn repetition_penalty_lowers_prompt_and_output_tokens() {
        let p = SamplingParams { repetition_penalty: 2.0, ..SamplingParams::default() };
        let mut logits = vec![2.0, -1.0, 1.5, 0.5];
        let token = sample(&mut logits, &p, &[0, 0], &[1], 4).unwrap().token;
        // Positive logits are divided, negative ones multiplied, each token once.
        assert_eq!(logits, vec![1.0, -2.0, 1.5, 0.5]);
        assert_eq!(token, 2);
        // Under sampling the repeated favourite loses probability.
        let flat = [1.0, 1.0];
        let p = SamplingParams { repetition_penalty: 2.0, ..with_temperature(1.0) };
        let mut sampler = Sampler::new();
        let hits = (0..2000)
            .filter(|&pos| {
                let mut row = flat.to_vec();
                sampler.sample(&mut row, &p, &[0], &[], pos).unwrap().token == 0
            })
            .count();
        assert!((650..850).contains(&hits), "{hits}"); // softmax([0.5, 1])[0] = 0.378
    }

    #[test]
    fn presence_and_frequency_penalise_output_tokens_only() {
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplingParams::default()
        };
        let mut logits = vec![1.0; 4];
        sample(&mut logits, &p, &[0, 3], &[1, 1, 1, 2], 7).unwrap();
        assert_eq!(logits, vec![1.0, 1.0 - 0.5 - 0.75, 1.0 - 0.5 - 0.25, 1.0]);
        let frequency_only = SamplingParams { frequency_penalty: 1.0, ..SamplingParams::default() };
        let mut logits = vec![0.0; 3];
        sample(&mut logits, &frequency_only, &[], &[2, 1, 2, 2], 4).unwrap();
        assert_eq!(logits, vec![0.0, -1.0, -3.0]);
    }

    #[test]
    fn penalties_leave_no_state_behind_and_ignore_ids_outside_the_vocabulary() {
        let p = SamplingParams {
            repetition_penalty: 1.5,
            presence_penalty: 1.0,
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new();
        let mut big = vec![1.0; 100];
        sampler.sample(&mut big, &p, &[10, 99], &[50, 50], 4).unwrap();
        let mut small = vec![1.0; 20];
        sampler.sample(&mut small, &p, &[3, 50, u32::MAX], &[4, 99], 5).unwrap();
        let mut expected = vec![1.0; 20];
        expected[3] = 1.0 / 1.5;
        expected[4] = 1.0 / 1.5 - 1.0;
        assert_eq!(small, expected);
        assert!(sampler.marks.iter().all(|&m| m == 0));
    }

    #[test]
    fn logprobs_are_log_softmax_of_the_raw_logits() {
        let raw = [1.0f32, 2.0, 3.0, 0.5];
        let log_z = raw.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
        let p = SamplingParams {
            logprobs: true,
            top_logprobs: 3,
            repetition_penalty: 1.5,
            presence_penalty: 1.0,
            ..with_temperature(0.7)
        };
        for position in 0..20 {
            let mut row = raw.to_vec();
            let got = sample(&mut row, &p, &[2], &[1], position).unwrap();
            let expected = f64::from(raw[got.token as usize]) - log_z;
            assert!((f64::from(got.logprob.unwrap()) - expected).abs() < 1e-5);
            let ids: Vec<u32> = got.top_logprobs.iter().map(|e| e.0).collect();
            assert_eq!(ids, vec![2, 1, 0]);
            for (id, lp) in got.top_logprobs {
                assert!((f64::from(lp) - (f64::from(raw[id as usize]) - log_z)).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn top_logprobs_length_ties_and_opt_in() {
        let with = SamplingParams { logprobs: true, top_logprobs: 2, ..SamplingParams::default() };
        let got = sample_once(&[1.0, 1.0, 1.0], &with, 0);
        assert_eq!(got.top_logprobs.iter().map(|e| e.0).collect::<Vec<_>>(), vec![0, 1]);
        let more_than_vocab = SamplingParams { top_logprobs: MAX_TOP_LOGPROBS, ..with };
        assert_eq!(sample_once(&[0.0, 1.0, 2.0], &more_than_vocab, 0).top_logprobs.len(), 3);
        let big = sample_once(&random_logits(49_152, 6), &more_than_vocab, 0);
        assert_eq!(big.top_logprobs.len(), 20);
        assert!(big.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
        let only_logprob = SamplingParams { top_logprobs: 0, ..with };
        let got = sample_once(&[0.0, 1.0], &only_logprob, 0);
        assert!(got.logprob.is_some() && got.top_logprobs.is_empty());
        let off = SamplingParams { logprobs: false, ..with };
        let got = sample_once(&[0.0, 1.0], &off, 0);
        assert_eq!(got, Sampled { token: 1, logprob: None, top_logprobs: vec![] });
    }

    #[test]
    fn validation_names_the_bad_parameter() {
        let ok = SamplingParams::default();
        let cases = [
            ("temperature", SamplingParams { temperature: -0.1, ..ok }),
            ("temperature", SamplingParams { temperature: f32::NAN, ..ok }),
            ("temperature", SamplingParams { temperature: f32::INFINITY, ..ok }),
            ("top_p", SamplingParams { top_p: 1.5, ..ok }),
            ("top_p", SamplingParams { top_p: -0.1, ..ok }),
            ("min_p", SamplingParams { min_p: 1.1, ..ok }),
            ("min_p", SamplingParams { min_p: -0.01, ..ok }),
            ("repetition_penalty", SamplingParams { repetition_penalty: -1.0, ..ok }),
            ("presence_penalty", SamplingParams { presence_penalty: 2.5, ..ok }),
            ("frequency_penalty", SamplingParams { frequency_penalty: -3.0, ..ok }),
            ("frequency_penalty", SamplingParams { frequency_penalty: f32::NAN, ..ok }),
        ];
        for (name, params) in cases {
            match params.validate() {
                Err(e @ SamplingError::InvalidParam { param, .. }) => {
                    assert_eq!(param, name);
                    assert!(e.to_string().contains(name), "{e}");
                }
                other => panic!("{name}: expected InvalidParam, got {other:?}"),
            }
            assert!(sample(&mut [1.0], &params, &[], &[], 0).is_err());
        }
        let too_many = SamplingParams { top_logprobs: MAX_TOP_LOGPROBS + 1, ..ok };
        assert_eq!(
            too_many.validate(),
            Err(SamplingError::TooManyTopLogprobs { requested: 21, max: 20 })
        );
        let edges = SamplingParams { top_p: 1.0, min_p: 1.0, presence_penalty: -2.0, ..ok };
        assert_eq!(edges.validate(), Ok(()));
    }

    #[test]
    fn bad_logits_are_errors_or_excluded_never_panics() {
        for p in [SamplingParams::default(), with_temperature(1.0)] {
            assert_eq!(sample(&mut [], &p, &[], &[], 0), Err(SamplingError::EmptyLogits));
            let mut dead = [f32::NEG_INFINITY, f32::NAN];
            assert_eq!(sample(&mut dead, &p, &[], &[], 0), Err(SamplingError::NoFiniteLogit));
            for position in 0..100 {
                let token = sample_once(&[f32::NAN, 0.0, f32::NAN, -1.0], &p, position).token;
                assert!(token == 1 || token == 3);
                let token = sample_once(&[0.0, f32::INFINITY, f32::INFINITY], &p, position).token;
                assert!(token == 1 || token == 2);
            }
        }
        let subnormal = with_temperature(1e-45);
        assert_eq!(sample_once(&[0.0, 1.0, 0.5], &subnormal, 0).token, 1);
        let tiny_penalty = SamplingParams { repetition_penalty: 1e-38, ..with_temperature(1.0) };
        let token = sample(&mut [3.0, 1.0], &tiny_penalty, &[0], &[], 0).unwrap().token;
        assert_eq!(token, 0);
    }

    #[test]
    fn proto_conversion_fills_a_missing_seed() {
        let wire = v1::SamplingParams {
            temperature: 0.8,
            top_k: 5,
            top_logprobs: 2,
            logprobs: true,
            ..Default::default()
        };
        let p = SamplingParams::from_proto(&wire, 1234);
        assert_eq!((p.seed, p.temperature, p.top_k, p.top_logprobs), (1234, 0.8, 5, 2));
        assert!(p.logprobs);
        let seeded = v1::SamplingParams { seed: Some(9), ..wire };
        assert_eq!(SamplingParams::from_proto(&seeded, 1234).seed, 9);
    }
}
