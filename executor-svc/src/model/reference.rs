//! The reference forward: one sequence, a contiguous KV cache, plain loops. It is the yardstick
//! the batched, paged forward is tested against (same tokens, logits within tolerance), so it
//! favours being obviously right over being fast.

use super::llama::LlamaWeights;
use super::ops::{linear, rms_norm, rope, silu_mul};

/// Keys and values of every position so far, per layer: `positions × kv_dim`.
#[derive(Debug, Default, Clone)]
pub struct ContiguousCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
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
) -> candle_core::Result<Vec<f32>> {
    let s = &w.shape;
    let (h, kv_dim, hd) = (s.hidden, s.kv_dim(), s.head_dim);
    let n = tokens.len();
    if cache.keys.is_empty() {
        cache.keys = vec![Vec::new(); s.num_layers];
        cache.values = vec![Vec::new(); s.num_layers];
    }
    let start = cache.len(kv_dim);
    let mut x = Vec::with_capacity(n * h);
    for &t in tokens {
        let row = w.embed.get(t as usize * h..(t as usize + 1) * h).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "token id {t} is outside the vocabulary ({})",
                s.vocab_size
            ))
        })?;
        x.extend_from_slice(row);
    }
    let group = s.num_heads / s.num_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    for (l, layer) in w.layers.iter().enumerate() {
        let mut hn = x.clone();
        rms_norm(&mut hn, &layer.attn_norm, s.rms_eps);
        let mut q = linear(&hn, n, &layer.wq)?;
        let mut k = linear(&hn, n, &layer.wk)?;
        let v = linear(&hn, n, &layer.wv)?;
        for i in 0..n {
            for head in q[i * h..(i + 1) * h].chunks_exact_mut(hd) {
                rope(head, start + i, s.rope_theta);
            }
            for head in k[i * kv_dim..(i + 1) * kv_dim].chunks_exact_mut(hd) {
                rope(head, start + i, s.rope_theta);
            }
        }
        cache.keys[l].extend_from_slice(&k);
        cache.values[l].extend_from_slice(&v);
        let (keys, values) = (&cache.keys[l], &cache.values[l]);
        let mut attn = vec![0f32; n * h];
        for i in 0..n {
            let visible = start + i + 1;
            for head in 0..s.num_heads {
                let kvh = head / group;
                let qv = &q[i * h + head * hd..i * h + (head + 1) * hd];
                let mut scores: Vec<f32> = (0..visible)
                    .map(|p| {
                        let kp = &keys[p * kv_dim + kvh * hd..p * kv_dim + (kvh + 1) * hd];
                        qv.iter().zip(kp).map(|(a, b)| a * b).sum::<f32>() * scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                for sc in &mut scores {
                    *sc = (*sc - max).exp();
                    sum += *sc;
                }
                let out = &mut attn[i * h + head * hd..i * h + (head + 1) * hd];
                for (p, sc) in scores.iter().enumerate() {
                    let vp = &values[p * kv_dim + kvh * hd..p * kv_dim + (kvh + 1) * hd];
                    for (o, vv) in out.iter_mut().zip(vp) {
                        *o += sc / sum * vv;
                    }
                }
            }
        }
        let o = linear(&attn, n, &layer.wo)?;
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let mut hn = x.clone();
        rms_norm(&mut hn, &layer.ffn_norm, s.rms_eps);
        let mut gate = linear(&hn, n, &layer.w_gate)?;
        let up = linear(&hn, n, &layer.w_up)?;
        silu_mul(&mut gate, &up);
        let down = linear(&gate, n, &layer.w_down)?;
        x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
    }
    let mut last = x[(n - 1) * h..].to_vec();
    rms_norm(&mut last, &w.norm, s.rms_eps);
    linear(&last, 1, &w.lm_head)
}
