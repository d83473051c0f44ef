//! What a request asks of its sampler, and the checks that keep bad values out.
//!
//! Here rather than in the executor because both ends need it: the front refuses a request
//! with a bad value before it is placed, and the executor checks every value again before it
//! samples (a scheduler is not trusted to have checked).

use ferry_proto::v1;

/// The most alternatives a request may ask for per position (as OpenAI's `top_logprobs`).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// The most entries a request's `logit_bias` may have.
pub const MAX_LOGIT_BIAS: usize = 300;

/// The largest bias one token may get, either way (OpenAI's range).
pub const MAX_BIAS: f32 = 100.0;

/// The most ids a request's `allowed_token_ids` may list (it travels with every placement).
pub const MAX_ALLOWED_TOKEN_IDS: usize = 4096;

/// The most token ids a request's `bad_words` may take, all sequences together.
pub const MAX_BAD_WORD_TOKENS: usize = 1024;

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
    /// Score the prompt's tokens too, each with this many alternatives.
    pub prompt_logprobs: Option<u32>,
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
    #[error("sampling parameter `{param}` is {requested}, expected at most {max}")]
    TooManyTopLogprobs {
        /// `top_logprobs` or `prompt_logprobs`.
        param: &'static str,
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
    /// A `logit_bias` or `allowed_token_ids` entry is out of range.
    #[error("{0}")]
    Adjust(String),
}

/// Per-request changes to the logits that come before the penalties: OpenAI's `logit_bias`
/// and vLLM's `allowed_token_ids`. They change what is drawn, not the log-probabilities a
/// client sees (those of the model's own distribution, as vLLM's `raw_logprobs`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogitAdjust {
    /// (token id, bias) added to the token's logit, in id order.
    pub bias: Vec<(u32, f32)>,
    /// The only ids that may be sampled, in order, without repeats; empty: any.
    pub allowed: Vec<u32>,
    /// Token sequences that may not be generated: the last token of each is masked when the
    /// output ends with the rest.
    pub bad_words: Vec<Vec<u32>>,
}

impl LogitAdjust {
    /// The adjustments of a wire `SamplingParams` (unchecked: see [`Self::validate`]).
    pub fn from_proto(p: &v1::SamplingParams) -> Self {
        let mut bias: Vec<(u32, f32)> = p.logit_bias.iter().map(|(t, b)| (*t, *b)).collect();
        bias.sort_unstable_by_key(|(t, _)| *t);
        let mut allowed = p.allowed_token_ids.clone();
        allowed.sort_unstable();
        allowed.dedup();
        let bad_words = p.bad_words.iter().map(|w| w.ids.clone()).collect();
        Self { bias, allowed, bad_words }
    }

    /// vLLM's `bad_words` as token sequences: each word alone and, when that makes another
    /// first token of the same length, after a space (a word at the start of the text and in
    /// its middle tokenize differently).
    pub fn bad_word_sequences(
        tokenizer: &crate::Tokenizer,
        words: &[String],
    ) -> Result<Vec<v1::TokenSequence>, crate::TokenizerError> {
        let plain = |text: &str| -> Result<Vec<u32>, crate::TokenizerError> {
            let mut ids = tokenizer.encode(text)?;
            if tokenizer.add_bos && ids.first().copied() == tokenizer.bos_token_id {
                ids.remove(0);
            }
            Ok(ids)
        };
        let mut out = Vec::with_capacity(2 * words.len());
        for word in words {
            let word = word.trim_start();
            let alone = plain(word)?;
            let spaced = plain(&format!(" {word}"))?;
            let distinct = spaced.len() == alone.len() && spaced.first() != alone.first();
            if !alone.is_empty() {
                out.push(v1::TokenSequence { ids: alone });
            }
            if distinct && !spaced.is_empty() {
                out.push(v1::TokenSequence { ids: spaced });
            }
        }
        Ok(out)
    }

    /// Whether it changes nothing.
    pub fn is_empty(&self) -> bool {
        self.bias.is_empty() && self.allowed.is_empty() && self.bad_words.is_empty()
    }

    /// Checks the sizes, the token ids against a `vocab`-token vocabulary and the biases'
    /// range, with vLLM's wording where it has one.
    pub fn validate(&self, vocab: usize) -> Result<(), SamplingError> {
        let bad = |m: String| Err(SamplingError::Adjust(m));
        if self.bias.len() > MAX_LOGIT_BIAS {
            return bad(format!(
                "logit_bias has {} entries; at most {MAX_LOGIT_BIAS}",
                self.bias.len()
            ));
        }
        if let Some((t, _)) = self.bias.iter().find(|(t, _)| *t as usize >= vocab) {
            return bad(format!(
                "token_id {t} in logit_bias is out of vocabulary (vocabulary size: {vocab})"
            ));
        }
        if let Some((t, b)) = self.bias.iter().find(|(_, b)| !(-MAX_BIAS..=MAX_BIAS).contains(b)) {
            return bad(format!("logit_bias for token {t} is {b}; it must be in [-100, 100]"));
        }
        if self.allowed.len() > MAX_ALLOWED_TOKEN_IDS {
            return bad(format!(
                "allowed_token_ids has {} ids; at most {MAX_ALLOWED_TOKEN_IDS}",
                self.allowed.len()
            ));
        }
        if let Some(t) = self.allowed.iter().find(|t| **t as usize >= vocab) {
            return bad(format!(
                "allowed_token_ids contains out-of-vocab token id {t} (vocabulary size: {vocab})"
            ));
        }
        let ids: usize = self.bad_words.iter().map(Vec::len).sum();
        if ids > MAX_BAD_WORD_TOKENS {
            return bad(format!(
                "bad_words take {ids} token ids; at most {MAX_BAD_WORD_TOKENS} in all"
            ));
        }
        if self.bad_words.iter().any(Vec::is_empty) {
            return bad("bad_words has an empty token sequence".into());
        }
        if let Some(t) = self.bad_words.iter().flatten().find(|t| **t as usize >= vocab) {
            return bad(format!(
                "bad_words contains out-of-vocab token id {t} (vocabulary size: {vocab})"
            ));
        }
        Ok(())
    }

    /// Adds the biases, sets every token outside `allowed` to `-inf`, and the last token of
    /// each bad word whose other tokens end `output`.
    pub fn apply(&self, logits: &mut [f32], output: &[u32]) {
        for &(t, b) in &self.bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        for word in &self.bad_words {
            let Some((last, rest)) = word.split_last() else { continue };
            if output.ends_with(rest) {
                if let Some(l) = logits.get_mut(*last as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if self.allowed.is_empty() {
            return;
        }
        let mut next = self.allowed.iter().peekable();
        for (i, l) in logits.iter_mut().enumerate() {
            if next.peek().is_some_and(|t| **t as usize == i) {
                next.next();
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
    }
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
            prompt_logprobs: p.prompt_logprobs,
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
        for (param, n) in [
            ("top_logprobs", self.top_logprobs),
            ("prompt_logprobs", self.prompt_logprobs.unwrap_or(0)),
        ] {
            if n > MAX_TOP_LOGPROBS {
                return Err(SamplingError::TooManyTopLogprobs {
                    param,
                    requested: n,
                    max: MAX_TOP_LOGPROBS,
                });
            }
        }
        Ok(())
    }

    /// Whether the token is the argmax rather than a draw.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Whether the repetition penalty changes anything.
    pub fn repetition_on(&self) -> bool {
        self.repetition_penalty != 0.0 && self.repetition_penalty != 1.0
    }

    /// Whether the presence or frequency penalty changes anything.
    pub fn additive_on(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Whether top-k leaves out any of a `vocab`-token vocabulary.
    pub fn top_k_on(&self, vocab: usize) -> bool {
        self.top_k > 0 && (self.top_k as usize) < vocab
    }

    /// Whether top-p can leave out any token.
    pub fn top_p_on(&self) -> bool {
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
