//! A looped model's stages: one stage (the prelude, a loop of the recurrent block, or the coda)
//! of a model's layers over a batch, from the tokens' embeddings or from the hidden states the
//! previous stage left, to the hidden states the next one starts from or, for the coda, the
//! logits.
//!
//! The arithmetic is the serving forward's (`paged`): the same layers in the same order, the
//! residual add of a stage's last layer done where the next layer would have done it. So a
//! prelude, one loop and a coda compute exactly what the plain forward computes, and `k` loops
//! exactly what a model whose recurrent layers are repeated `k` times computes.

use std::ops::Range;
use std::time::Instant;

use super::kv_cache::PagedKvCache;
use super::llama::LlamaWeights;
use super::paged::{
    check_geometry, check_tokens, embed, head, in_pool, run_layers, BatchError, ForwardScratch,
    Layout, SeqSlice,
};

/// One stage to run.
#[derive(Debug, Clone)]
pub struct StageRun<'a> {
    /// The stage's layers (empty: an embedding-only prelude, a head-only coda).
    pub layers: Range<usize>,
    /// The hidden state of each row of the batch (rows × hidden) to start from; `None`: the
    /// tokens' embeddings (the prelude).
    pub input: Option<&'a [f32]>,
    /// Rows whose keys and values are not written (tokens that left the loop: their slots
    /// already hold the KV they left with).
    pub keep_kv: &'a [bool],
    /// Produce the logits of the rows the sequences ask for (the coda), else every row's
    /// hidden state.
    pub logits: bool,
}

/// What a stage produced.
#[derive(Debug, Clone, PartialEq)]
pub enum StageOutput {
    /// Every row's hidden state (rows × hidden), in batch order.
    Hidden(Vec<f32>),
    /// The rows' logits (`vocab` each) that the sequences ask for, in batch order.
    Logits(Vec<Vec<f32>>),
}

/// Runs `run` over `batch`: the block tables are those of the stage's KV plane (checked when
/// the stage has layers).
pub fn forward_stage(
    w: &LlamaWeights,
    cache: &mut PagedKvCache,
    batch: &[SeqSlice],
    scratch: &mut ForwardScratch,
    run: &StageRun,
) -> Result<StageOutput, BatchError> {
    let (bs, blocks) = (cache.block_size, cache.num_blocks);
    // A stage without layers touches no KV: only its tokens are checked.
    if run.layers.is_empty() {
        check_tokens(w.shape.vocab_size, batch)?;
    } else {
        check_geometry(w.shape.vocab_size, bs, blocks, batch)?;
    }
    let kv = cache.shared();
    Ok(in_pool(|| {
        let start = Instant::now();
        let h = w.shape.hidden;
        let layout = Layout::of(batch);
        let mut x = match run.input {
            Some(input) => {
                assert_eq!(input.len(), layout.rows.len() * h, "a hidden state per row");
                input.to_vec()
            }
            None => embed(w, &layout),
        };
        let threads = rayon::current_num_threads();
        let layers = run.layers.clone();
        let (mut matmul, attention) = if layers.is_empty() {
            Default::default()
        } else {
            let times = run_layers(w, &kv, &layout, &mut x, scratch, layers, run.keep_kv, threads);
            // The stage's last MLP output joins the residual stream, as the next layer would.
            x.iter_mut().zip(&scratch.proj).for_each(|(a, b)| *a += b);
            times
        };
        let out = if run.logits {
            let mut last = Vec::new();
            let mut row = 0;
            for sl in batch {
                row += sl.tokens.len();
                last.extend_from_slice(&x[(row - sl.logits) * h..row * h]);
            }
            let t = Instant::now();
            let logits = head(w, last);
            matmul += t.elapsed();
            StageOutput::Logits(logits)
        } else {
            StageOutput::Hidden(x)
        };
        let times = &mut scratch.times;
        times.matmul += matmul;
        times.attention += attention;
        times.other += start.elapsed().saturating_sub(matmul + attention);
        out
    }))
}
