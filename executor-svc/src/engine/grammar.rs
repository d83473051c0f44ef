//! Structured outputs on the executor: each constrained request's grammar matcher, its token
//! mask, and the mask applied to the request's logits before sampling.
//!
//! Why here: the executor samples (DESIGN.md §4), and a scheduler may send the next decode
//! before it has heard the last token, so only the executor knows a request's output when its
//! next token is drawn. The scheduler is not trusted to have checked a grammar: the executor
//! compiles it again from the request's `SamplingParams.structured_output`.
//!
//! What it guarantees:
//! - A matcher has consumed exactly the request's output: a new request's `output_token_ids`
//!   (tokens generated before a preemption or a move) are replayed into it when it arrives, and
//!   each token sampled here is consumed as it joins the output. An output the grammar refuses
//!   refuses the request, with why.
//! - Masks are computed on a thread beside the batch's forward ([`MaskJob`]), so a step waits
//!   for them only when they take longer than the forward. Requests that do not sample in the
//!   step (a prefill chunk that is not the last) compute no mask.
//! - A token outside the mask gets a logit of `-inf` before anything else of sampling runs, so
//!   penalties, temperature and truncation act on the allowed tokens only and the returned
//!   log-probabilities are those of the masked distribution (as vLLM's, whose bitmask is applied
//!   to the logits before its sampler).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_model::structured::Matcher;
pub use ferry_model::structured::TokenMask;
use ferry_model::ModelFile;
use ferry_proto::v1;

/// Where an executor's grammars come from: the model file it serves (its vocabulary). `None`
/// for a backend without a vocabulary (the simulator), which refuses constrained requests.
pub type GrammarSource = Option<Arc<ModelFile>>;

/// One request's grammar matcher: where its output stands in its grammar.
pub struct Grammar(Box<Matcher>);

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").field("stopped", &self.0.is_stopped()).finish()
    }
}

impl Grammar {
    /// Consumes the token just sampled; `Err` says why the grammar refused it. Past the
    /// grammar's end the mask allowed the end-of-sequence token alone, and it changes nothing
    /// (a request that ignores EOS keeps drawing it until `max_tokens`).
    pub fn advance(&mut self, token: u32) -> Result<(), String> {
        if self.0.is_stopped() {
            return Ok(());
        }
        self.0.consume_token(token).map_err(|e| format!("structured output: {e}"))
    }

    /// The tokens allowed next (at the grammar's end, the end-of-sequence token alone).
    fn mask(&mut self) -> Result<TokenMask, String> {
        self.0.compute_mask_or_eos().map_err(|e| format!("structured output: {e}"))
    }
}

/// A matcher for `constraint` that has consumed `output`, or why there cannot be one.
pub fn compile(
    source: &GrammarSource,
    constraint: &v1::StructuredOutput,
    output: &[u32],
) -> Result<Grammar, String> {
    let Some(model) = source else {
        return Err("structured outputs need the model's vocabulary, and this executor \
                    (a simulated one) has none"
            .into());
    };
    let matcher = model
        .grammars()
        .and_then(|g| g.compile_after(constraint, output))
        .map_err(|e| format!("structured output: {e}"))?;
    Ok(Grammar(Box::new(matcher)))
}

/// Masks of the step's constrained requests, computed on a thread beside the forward.
pub struct MaskJob {
    /// (request id, its matcher) for each constrained request that samples in the step.
    pub matchers: Vec<(u64, Grammar)>,
}

/// What a [`MaskJob`] produced.
pub struct Masks {
    /// The matchers, back, each with its mask or why it has none.
    pub masks: Vec<(u64, Grammar, Result<TokenMask, String>)>,
    /// Time spent computing them.
    pub busy: Duration,
}

impl MaskJob {
    /// Computes every mask (at the grammar's end, the end-of-sequence token alone).
    pub fn run(self) -> Masks {
        let t0 = Instant::now();
        let masks = self
            .matchers
            .into_iter()
            .map(|(id, mut g)| {
                let mask = g.mask();
                (id, g, mask)
            })
            .collect();
        Masks { masks, busy: t0.elapsed() }
    }

    /// Runs `forward` on this thread while the masks are computed on another; with no
    /// constrained request, just `forward`. Returns the forward's result, the masks, and how
    /// long the masks kept the step waiting after the forward.
    pub fn beside<T>(self, forward: impl FnOnce() -> T) -> (T, Masks, Duration) {
        if self.matchers.is_empty() {
            return (forward(), Masks { masks: Vec::new(), busy: Duration::ZERO }, Duration::ZERO);
        }
        std::thread::scope(|s| {
            let job = s.spawn(|| self.run());
            let out = forward();
            let t = Instant::now();
            let masks = job.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (out, masks, t.elapsed())
        })
    }
}

/// Sets the logit of every token outside `mask` to `-inf` (tokens past the mask's vocabulary
/// included).
pub fn apply_mask(logits: &mut [f32], mask: &TokenMask) {
    let words = mask.as_slice();
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = words.get(w).copied().unwrap_or(0);
        if bits == u32::MAX && chunk.len() == 32 {
            continue;
        }
        for (i, l) in chunk.iter_mut().enumerate() {
            if bits & (1 << i) == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_leaves_only_its_tokens_finite() {
        let mut mask = TokenMask::alloc(70);
        for t in [0, 31, 32, 33, 69] {
            mask.allow_token(t);
        }
        // Longer than the mask: the tail is outside the vocabulary the grammar knows.
        let mut logits = vec![1.0f32; 75];
        apply_mask(&mut logits, &mask);
        let finite: Vec<usize> = (0..75).filter(|&i| logits[i].is_finite()).collect();
        assert_eq!(finite, vec![0, 31, 32, 33, 69]);
    }

    #[test]
    fn a_full_word_is_left_untouched() {
        let mut mask = TokenMask::alloc(64);
        mask.set_all(true);
        let mut logits: Vec<f32> = (0..64).map(|i| i as f32).collect();
        apply_mask(&mut logits, &mask);
        assert!(logits.iter().enumerate().all(|(i, l)| *l == i as f32));
    }

    #[test]
    fn a_simulated_executor_refuses_a_grammar_with_why() {
        let c =
            v1::StructuredOutput { kind: Some(v1::structured_output::Kind::Regex("a+".into())) };
        let err = compile(&None, &c, &[]).unwrap_err();
        assert!(err.contains("simulated"), "{err}");
    }
}
