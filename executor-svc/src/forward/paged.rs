//! The serving forward: one pass over a variable-length batch that mixes prefill chunks and
//! decodes, with no padding, reading and writing KV through each sequence's block table.
//!
//! Every sequence contributes the tokens it computes this step, starting at its own position
//! (after a prefix-cache hit, a previous chunk, or a resume), so positions are right for all of
//! them. Matrix products run once over all the batch's tokens; attention runs per token and head
//! over that token's own sequence only. Logits are computed only for sequences that sample.
//!
//! Arithmetic is identical to [`super::reference::forward`] (same kernels, same attention
//! order), so a sequence's logits are bit-identical to the reference's whatever else is batched.

use std::time::{Duration, Instant};

use ferry_model::lora::{LoraAdapter, Product};
use rayon::prelude::*;

pub use super::batch::{check_geometry, check_tokens, BatchError, SeqSlice};

use super::attention::{attend, AttnScratch, Heads, TILE};
use super::kv_cache::{KvDtype, PagedKvCache, SharedKv};
use super::llama::{BlockOutput, LlamaWeights};
use super::lora::add_updates;
use super::ops::{add_rms_norm, gate_mul_into, linear, linear_into, rms_norm, rope_angles};

/// Where a forward's time went (accumulated over forwards until [`PhaseTimes::take`]): a few
/// clock reads per layer, so always on.
#[derive(Clone, Copy, Debug, Default)]
pub struct PhaseTimes {
    /// Matrix products (projections, MLP, output head).
    pub matmul: std::time::Duration,
    /// Attention over the cache (with the rotary embedding and the cache writes).
    pub attention: std::time::Duration,
    /// The rest: embeddings, norms, activations, residual adds.
    pub other: std::time::Duration,
}

impl PhaseTimes {
    /// The times so far, resetting them.
    #[must_use]
    pub fn take(&mut self) -> PhaseTimes {
        std::mem::take(self)
    }
}

/// Buffers reused across layers and steps: a prefill batch's intermediates are tens of MB,
/// and fresh allocations of that size come from the kernel page by page, zeroed, every layer.
#[derive(Debug, Default)]
pub struct ForwardScratch {
    /// Where the forwards' time went.
    pub times: PhaseTimes,
    /// Normalised hidden states.
    hn: Vec<f32>,
    /// Rows of `[q | k | v]`.
    qkv: Vec<f32>,
    /// Attention output.
    attn: Vec<f32>,
    /// Attention output tile by tile, KV head by KV head.
    tiled_out: Vec<f32>,
    /// Output of the attention or down projection, before the residual add.
    pub(super) proj: Vec<f32>,
    /// Rows of `[gate | up]`.
    gate_up: Vec<f32>,
    /// `silu(gate) · up`.
    act: Vec<f32>,
    /// Each row's rotary sines and cosines.
    angles: Vec<(f32, f32)>,
    /// The same at the windowed layers' own frequencies, where the model has them.
    local_angles: Vec<(f32, f32)>,
    /// The parts' own buffers, when a batch is split between the threads.
    parts: Vec<ForwardScratch>,
}

/// The batch row by row: each row's (sequence, position), and the attention's tiles — up to
/// [`TILE`] consecutive rows of one sequence, as (first row, rows).
pub(super) struct Layout<'a> {
    pub(super) batch: &'a [SeqSlice<'a>],
    pub(super) rows: Vec<(usize, usize)>,
    tiles: Vec<(usize, usize)>,
    /// Each row's LoRA adapter; empty when no sequence has one.
    pub(super) adapters: Vec<Option<&'a LoraAdapter>>,
}

impl<'a> Layout<'a> {
    pub(super) fn of(batch: &'a [SeqSlice<'a>]) -> Self {
        let (mut rows, mut tiles) = (Vec::new(), Vec::new());
        for (seq, sl) in batch.iter().enumerate() {
            for start in (0..sl.tokens.len()).step_by(TILE) {
                tiles.push((rows.len() + start, TILE.min(sl.tokens.len() - start)));
            }
            rows.extend((0..sl.tokens.len()).map(|i| (seq, sl.start + i)));
        }
        let adapters = if batch.iter().any(|s| s.adapter.is_some()) {
            rows.iter().map(|&(seq, _)| batch[seq].adapter).collect()
        } else {
            Vec::new()
        };
        Self { batch, rows, tiles, adapters }
    }
}

/// Layer `l`'s attention of every row of `qkv` (keys and values already cached) into `attn`
/// (rows of all heads), through `tiled_out` (as many floats, tile by tile, KV head by KV
/// head).
#[allow(clippy::too_many_arguments)]
fn attend_layer(
    w: &LlamaWeights,
    cache: &SharedKv,
    l: usize,
    layout: &Layout,
    qkv: &[f32],
    tiled_out: &mut [f32],
    attn: &mut Vec<f32>,
    threads: usize,
) {
    let s = &w.shape;
    let (q_dim, hd, group) = (s.q_dim(), s.head_dim, s.num_heads / s.num_kv_heads);
    let (qkv_width, layer_heads) = (q_dim + 2 * s.kv_dim(), Heads::of_layer(s, l));
    let Layout { batch, rows, tiles, .. } = layout;
    // A tile's tokens attend together, each with the KV heads' query heads, reading each
    // cached key and value once for all of them. Tasks take a tile's KV heads together when
    // there are tiles enough to share among the threads (a decode step of many sequences):
    // each task then reads its positions whole (every head's keys of a position are one
    // contiguous run, a block's are one stream), where a task per KV head reads a third of
    // each position's lines; with few tiles (one sequence's decode, a short prefill) a task
    // per KV head keeps every thread busy. The threads are those that work on this part of the
    // batch (one each when the batch is split), the others being busy with theirs.
    let kvt = if tiles.len() >= 4 * threads { s.num_kv_heads } else { 1 };
    let per_tile = s.num_kv_heads / kvt;
    let gw = group * hd;
    let mut outs = Vec::with_capacity(tiles.len() * per_tile);
    let mut rest = &mut tiled_out[..];
    for &(_, len) in tiles {
        for _ in 0..per_tile {
            let (out, tail) = std::mem::take(&mut rest).split_at_mut(len * kvt * gw);
            outs.push(out);
            rest = tail;
        }
    }
    // Each worker thread keeps its scratch (scores up to hundreds of KiB for a long prompt)
    // from task to task, layer to layer and step to step.
    thread_local! {
        static SCRATCH: std::cell::RefCell<(AttnScratch, Vec<f32>)> = std::cell::RefCell::default();
    }
    outs.into_par_iter().enumerate().for_each(|(i, out)| {
        SCRATCH.with_borrow_mut(|(scratch, q)| {
            let ((r0, len), k0) = (tiles[i / per_tile], i % per_tile * kvt);
            let (seq, pos) = rows[r0];
            let table = batch[seq].block_table;
            q.clear();
            for r in r0..r0 + len {
                let at = r * qkv_width + k0 * gw;
                q.extend_from_slice(&qkv[at..at + kvt * gw]);
            }
            let heads = Heads { lane: k0 * hd, kv: kvt, ..layer_heads };
            match cache.dtype {
                // SAFETY (both): this part's sequences' positions, which no thread writes
                // while the layer's attention runs (this part wrote them before it; other
                // parts write only their own sequences' blocks).
                KvDtype::F32 => {
                    let run = |p| unsafe { cache.run::<f32>(l, table, p) };
                    attend(heads, q, pos + 1, run, scratch, out);
                }
                KvDtype::F16 => {
                    let run = |p| unsafe { cache.run::<u16>(l, table, p) };
                    attend(heads, q, pos + 1, run, scratch, out);
                }
            }
        });
    });
    // Back to rows of all heads.
    attn.resize(rows.len() * q_dim, 0.0);
    let mut from = tiled_out.chunks_exact(kvt * gw);
    for &(r0, len) in tiles {
        for k in 0..per_tile {
            for r in r0..r0 + len {
                let at = r * q_dim + k * kvt * gw;
                attn[at..at + kvt * gw].copy_from_slice(from.next().expect("a tile per row"));
            }
        }
    }
}

/// Checks `batch` against the cache and the model; nothing is touched.
pub fn validate(
    w: &LlamaWeights,
    cache: &PagedKvCache,
    batch: &[SeqSlice],
) -> Result<(), BatchError> {
    check_geometry(w.shape.vocab_size, cache.block_size, cache.num_blocks, batch)
}

/// Runs `batch` through the model, writing each new token's keys and values into the cache.
/// Returns the logits (`vocab` each) of the rows the sequences ask for, in batch order.
///
/// The whole forward runs on a rayon worker (`install`): its ~150 parallel sections per token
/// (5 per layer) then fork and join inside the pool, where the other workers are still spinning
/// between sections, instead of each being injected from outside and waking sleeping threads
/// (a futex round trip per section, which cost a decode step milliseconds).
pub fn forward(
    w: &LlamaWeights,
    cache: &mut PagedKvCache,
    batch: &[SeqSlice],
    scratch: &mut ForwardScratch,
) -> Result<Vec<Vec<f32>>, BatchError> {
    if rayon::current_thread_index().is_some() {
        return forward_in_pool(w, cache, batch, scratch);
    }
    pool().install(|| forward_in_pool(w, cache, batch, scratch))
}

/// Runs `f` on the forward's pool (so its parallel sections use the forward's threads).
pub fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    pool().install(f)
}

/// The pool the forward runs in: as many threads as rayon's global pool would have.
fn pool() -> &'static rayon::ThreadPool {
    static POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("ferry-forward-{i}"))
            .build()
            .unwrap_or_else(|_| {
                rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a 1-thread pool")
            })
    })
}

fn forward_in_pool(
    w: &LlamaWeights,
    cache: &mut PagedKvCache,
    batch: &[SeqSlice],
    scratch: &mut ForwardScratch,
) -> Result<Vec<Vec<f32>>, BatchError> {
    validate(w, cache, batch)?;
    let kv = cache.shared();
    let threads = rayon::current_num_threads();
    let parts = parts_of(batch, threads);
    if parts.len() == 1 {
        return Ok(forward_part(w, &kv, batch, scratch, threads));
    }
    let per_part = (threads / parts.len()).max(1);
    // Each part on its own thread, with its own buffers; a thread that finishes first takes
    // tasks from the others' parallel sections.
    let mut subs = std::mem::take(&mut scratch.parts);
    subs.resize_with(parts.len(), ForwardScratch::default);
    let outs: Vec<Vec<Vec<f32>>> = parts
        .par_iter()
        .zip(subs.par_iter_mut())
        .map(|(range, sub)| forward_part(w, &kv, &batch[range.clone()], sub, per_part))
        .collect();
    // The parts ran at once: their phases' mean is the forward's.
    let n = parts.len() as u32;
    for sub in &mut subs {
        let t = sub.times.take();
        scratch.times.matmul += t.matmul / n;
        scratch.times.attention += t.attention / n;
        scratch.times.other += t.other / n;
    }
    scratch.parts = subs;
    Ok(outs.into_iter().flatten().collect())
}

/// The batch cut into up to `threads` runs of whole sequences, each with about an equal share
/// of the tokens (contiguous, so the parts' logits come back in batch order).
///
/// Every product and attention is row by row and sequence by sequence, so a part computes
/// exactly what the whole batch would for its rows; what the split saves is synchronisation.
/// One forward over the batch forks and joins the threads about ten times a layer (each
/// product, the attention, the row-wise steps between), 300 times a step, and a decode step's
/// sections are short (a 16-row product is a few hundred microseconds): the threads spent much
/// of a step waiting on each other (hundreds of thousands of `sched_yield`s a second). Parts
/// fork once a step; a part that ends early helps the others through their sections' tasks.
fn parts_of(batch: &[SeqSlice], threads: usize) -> Vec<std::ops::Range<usize>> {
    let n = threads.min(batch.len());
    if n <= 1 {
        return std::iter::once(0..batch.len()).collect();
    }
    let total: usize = batch.iter().map(|s| s.tokens.len()).sum();
    let (mut parts, mut start, mut tokens) = (Vec::with_capacity(n), 0, 0);
    for (i, s) in batch.iter().enumerate() {
        tokens += s.tokens.len();
        let (left, after) = (n - parts.len() - 1, batch.len() - i - 1);
        // Close this part once it has its share, or when only a sequence is left for each part
        // to come.
        let share = tokens * n >= total * (parts.len() + 1);
        if left > 0 && after >= left && (share || after == left) {
            parts.push(start..i + 1);
            start = i + 1;
        }
    }
    parts.push(start..batch.len());
    parts
}

/// The forward of a validated batch (or a part of one, which `threads` threads work on): the
/// logits of the rows its sequences ask for, in order.
fn forward_part(
    w: &LlamaWeights,
    cache: &SharedKv,
    batch: &[SeqSlice],
    scratch: &mut ForwardScratch,
    threads: usize,
) -> Vec<Vec<f32>> {
    let start = Instant::now();
    let layout = Layout::of(batch);
    let mut x = embed(w, &layout);
    let layers = 0..w.layers.len();
    let (mut matmul, attention) =
        run_layers(w, cache, &layout, &mut x, scratch, layers, &[], threads);
    // The last layer's MLP output joins the residual stream only in the rows that need logits
    // (a prefill's other rows are done), then the final norm and the output head.
    let h = w.shape.hidden;
    let mut last = Vec::new();
    let mut row = 0;
    for sl in batch {
        row += sl.tokens.len();
        let rows = (row - sl.logits) * h..row * h;
        last.extend(x[rows.clone()].iter().zip(&scratch.proj[rows]).map(|(a, b)| a + b));
    }
    let t = Instant::now();
    let logits = head(w, last);
    matmul += t.elapsed();
    let times = &mut scratch.times;
    times.matmul += matmul;
    times.attention += attention;
    times.other += start.elapsed().saturating_sub(matmul + attention);
    logits
}

/// Each row's embedding, the residual stream a forward starts from.
pub(super) fn embed(w: &LlamaWeights, layout: &Layout) -> Vec<f32> {
    let h = w.shape.hidden;
    let mut x = vec![0f32; layout.rows.len() * h];
    x.par_chunks_mut(h).zip(layout.rows.par_iter()).for_each(|(row, &(seq, pos))| {
        let sl = &layout.batch[seq];
        w.embed_row(sl.tokens[pos - sl.start] as usize, row);
    });
    x
}

/// The final norm and the output head over `last` (rows of the residual stream): a row of
/// logits each.
pub(super) fn head(w: &LlamaWeights, mut last: Vec<f32>) -> Vec<Vec<f32>> {
    let s = &w.shape;
    if last.is_empty() {
        return Vec::new();
    }
    rms_norm(&mut last, &w.norm, s.rms_eps);
    let mut logits = linear(&last, &w.lm_head);
    w.finish_logits(&mut logits);
    logits.chunks_exact(s.vocab_size).map(<[f32]>::to_vec).collect()
}

/// Runs `layers` over the residual stream `x` (one row per token of `layout`), writing each
/// row's keys and values into the cache except the rows `keep_kv` marks (a looped chain's
/// tokens that exited: their slots hold the KV they exited with). The last layer's MLP output
/// is left in `scratch.proj`, not added to `x`. The time spent in products and attention.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_layers(
    w: &LlamaWeights,
    cache: &SharedKv,
    layout: &Layout,
    x: &mut [f32],
    scratch: &mut ForwardScratch,
    layers: std::ops::Range<usize>,
    keep_kv: &[bool],
    threads: usize,
) -> (Duration, Duration) {
    let s = &w.shape;
    let (q_dim, kv_dim) = (s.q_dim(), s.kv_dim());
    let (rows, batch) = (&layout.rows, layout.batch);
    let n = rows.len();
    let ForwardScratch {
        hn, qkv, attn, tiled_out, proj, gate_up, act, angles, local_angles, ..
    } = scratch;
    // Each row's rotary angles, for every head of every layer (and of the windowed layers, at
    // their own frequencies).
    let half = w.rope_freqs.len();
    for (angles, freqs) in
        [(&mut *angles, Some(&w.rope_freqs)), (&mut *local_angles, w.local_rope_freqs.as_ref())]
    {
        let Some(freqs) = freqs else { continue };
        angles.resize(n * half, (0.0, 0.0));
        for (r, &(_, pos)) in rows.iter().enumerate() {
            rope_angles(pos, freqs, s.rope_mscale, &mut angles[r * half..(r + 1) * half]);
        }
    }
    tiled_out.resize(n * q_dim, 0.0);
    let (mut matmul, mut attention) = (Duration::ZERO, Duration::ZERO);
    let qkv_width = q_dim + 2 * kv_dim;
    let first = layers.start;
    for l in layers {
        let layer = &w.layers[l];
        // The previous layer's MLP output joins the residual stream here (the first layer has
        // none), with this layer's attention norm in the same pass.
        add_rms_norm(x, (l > first).then_some(&proj[..]), &layer.attn_norm, s.rms_eps, hn);
        let t = Instant::now();
        linear_into(hn, &layer.wqkv, qkv);
        add_updates(&layout.adapters, l, Product::Qkv, hn, qkv);
        matmul += t.elapsed();
        let t = Instant::now();
        // Bias, head norms and rotation, as the family has them, in place, rows in parallel.
        let angles: &[(f32, f32)] = if w.local_rope(l) { local_angles } else { angles };
        qkv.par_chunks_mut(qkv_width).zip(angles.par_chunks(half)).for_each(|(row, angles)| {
            layer.prepare_qkv(row, s, angles);
        });
        for (r, &(seq, pos)) in rows.iter().enumerate() {
            if keep_kv.get(r).copied().unwrap_or(false) {
                continue;
            }
            let row = &qkv[r * qkv_width..(r + 1) * qkv_width];
            let at = cache.locate(batch[seq].block_table, pos);
            // SAFETY: this part's sequence's position; no other thread uses it this step.
            unsafe { cache.write(l, at, &row[q_dim..q_dim + kv_dim], &row[q_dim + kv_dim..]) };
        }
        attend_layer(w, cache, l, layout, qkv, tiled_out, attn, threads);
        attention += t.elapsed();
        let t = Instant::now();
        linear_into(attn, &layer.wo, proj);
        add_updates(&layout.adapters, l, Product::O, attn, proj);
        matmul += t.elapsed();
        layer.post_norm(BlockOutput::Attention, proj, s.rms_eps);
        add_rms_norm(x, Some(proj), &layer.ffn_norm, s.rms_eps, hn);
        let t = Instant::now();
        linear_into(hn, &layer.w_gate_up, gate_up);
        add_updates(&layout.adapters, l, Product::GateUp, hn, gate_up);
        matmul += t.elapsed();
        gate_mul_into(s.family.activation, gate_up, s.intermediate, act);
        let t = Instant::now();
        linear_into(act, &layer.w_down, proj);
        add_updates(&layout.adapters, l, Product::Down, act, proj);
        matmul += t.elapsed();
        layer.post_norm(BlockOutput::FeedForward, proj, s.rms_eps);
    }
    (matmul, attention)
}

#[cfg(test)]
#[path = "paged_tests.rs"]
mod tests;
