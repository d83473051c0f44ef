//! The reference forward: one sequence, a contiguous KV cache, plain loops. It is the yardstick
//! the batched, paged forward is tested against (same tokens, logits within tolerance), so it
//! favours being obviously right over being fast.

use super::attention::{attend, AttnScratch, Heads, KvRun};
use super::llama::{BlockOutput, LlamaWeights};
use super::ops::{argmax, gate_mul, linear, rms_norm, rope_angles, split_qkv};

/// Keys and values of every position so far, per layer: `positions × kv_dim`.
#[derive(Debug, Default, Clone)]
pub struct ContiguousCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    /// Round what is stored to f16, as an f16 paged cache does (the values are then exactly
    /// the ones that cache reads back).
    pub f16: bool,
}

impl ContiguousCache {
    /// An empty cache that rounds keys and values to f16.
    pub fn f16() -> Self {
        Self { f16: true, ..Self::default() }
    }
}

impl ContiguousCache {
    /// Positions cached.
    pub fn len(&self, kv_dim: usize) -> usize {
        self.keys.first().map_or(0, |k| k.len() / kv_dim)
    }
}

/// Runs `tokens` (the positions right after those in `cache`) through the model, appends their
/// keys and values to `cache`, and returns the logits of the last token.
pub fn forward(
    w: &LlamaWeights,
    tokens: &[u32],
    cache: &mut ContiguousCache,
) -> Result<Vec<f32>, String> {
    let s = &w.shape;
    let (h, q_dim, kv_dim, hd) = (s.hidden, s.q_dim(), s.kv_dim(), s.head_dim);
    let n = tokens.len();
    if cache.keys.is_empty() {
        cache.keys = vec![Vec::new(); s.num_layers];
        cache.values = vec![Vec::new(); s.num_layers];
    }
    let start = cache.len(kv_dim);
    let mut x = vec![0f32; n * h];
    for (i, &t) in tokens.iter().enumerate() {
        if t as usize >= s.vocab_size {
            return Err(format!("token id {t} is outside the vocabulary ({})", s.vocab_size));
        }
        w.embed_row(t as usize, &mut x[i * h..(i + 1) * h]);
    }
    let group = s.num_heads / s.num_kv_heads;
    // Each token's rotary angles, for every head of every layer (and of the windowed layers,
    // at their own frequencies).
    let half = w.rope_freqs.len();
    let angles_at = |freqs: &[f32]| {
        let mut angles = vec![(0.0, 0.0); n * half];
        for (i, a) in angles.chunks_exact_mut(half).enumerate() {
            rope_angles(start + i, freqs, s.rope_mscale, a);
        }
        angles
    };
    let (global, local) = (angles_at(&w.rope_freqs), w.local_rope_freqs.as_deref().map(angles_at));
    for (l, layer) in w.layers.iter().enumerate() {
        let angles = match &local {
            Some(local) if w.local_rope(l) => local,
            _ => &global,
        };
        let mut hn = x.clone();
        rms_norm(&mut hn, &layer.attn_norm, s.rms_eps);
        let mut qkv = linear(&hn, &layer.wqkv);
        for (row, a) in qkv.chunks_exact_mut(q_dim + 2 * kv_dim).zip(angles.chunks_exact(half)) {
            layer.prepare_qkv(row, s, a);
        }
        let (q, k, v) = split_qkv(&qkv, q_dim, kv_dim);
        let round = |x: &[f32]| -> Vec<f32> {
            if cache.f16 {
                x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
            } else {
                x.to_vec()
            }
        };
        let (k, v) = (round(&k), round(&v));
        cache.keys[l].extend_from_slice(&k);
        cache.values[l].extend_from_slice(&v);
        let (keys, values) = (&cache.keys[l], &cache.values[l]);
        let mut attn = vec![0f32; n * q_dim];
        let mut scratch = AttnScratch::default();
        for i in 0..n {
            for head in 0..s.num_heads {
                let kvh = head / group;
                // One head at a time (the serving forward takes a tile of tokens, each with a
                // KV head's query heads; the arithmetic per head is the same, which the
                // comparison tests check).
                attend(
                    Heads { group: 1, lane: kvh * hd, kv: 1, ..Heads::of_layer(s, l) },
                    &q[i * q_dim + head * hd..i * q_dim + (head + 1) * hd],
                    start + i + 1,
                    |p| KvRun {
                        keys: &keys[p * kv_dim..],
                        values: &values[p * kv_dim..],
                        stride: kv_dim,
                        len: keys.len() / kv_dim - p,
                    },
                    &mut scratch,
                    &mut attn[i * q_dim + head * hd..i * q_dim + (head + 1) * hd],
                );
            }
        }
        let mut o = linear(&attn, &layer.wo);
        layer.post_norm(BlockOutput::Attention, &mut o, s.rms_eps);
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let mut hn = x.clone();
        rms_norm(&mut hn, &layer.ffn_norm, s.rms_eps);
        let gate = gate_mul(s.family.activation, &linear(&hn, &layer.w_gate_up), s.intermediate);
        let mut down = linear(&gate, &layer.w_down);
        layer.post_norm(BlockOutput::FeedForward, &mut down, s.rms_eps);
        x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
    }
    let mut last = x[(n - 1) * h..].to_vec();
    rms_norm(&mut last, &w.norm, s.rms_eps);
    let mut logits = linear(&last, &w.lm_head);
    w.finish_logits(&mut logits);
    Ok(logits)
}

/// The greedy continuation of `prompt`: up to `max` tokens, each the argmax of the last logits,
/// ending before any token of `stop` when one comes.
pub fn greedy(
    w: &LlamaWeights,
    prompt: &[u32],
    max: usize,
    stop: &[u32],
) -> Result<Vec<u32>, String> {
    let mut cache = ContiguousCache::default();
    let mut logits = forward(w, prompt, &mut cache)?;
    let mut out = Vec::with_capacity(max);
    while out.len() < max {
        let next = argmax(&logits).ok_or("no logits")? as u32;
        if stop.contains(&next) {
            break;
        }
        out.push(next);
        if out.len() < max {
            logits = forward(w, &[next], &mut cache)?;
        }
    }
    Ok(out)
}
