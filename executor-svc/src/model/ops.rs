//! The small numeric kernels both forwards share, on row-major `f32` slices: RMS norm, the
//! rotary embedding (adjacent-pair convention of GGUF Llama), SiLU gating, and the product
//! against a quantized `[out, in]` weight.

use crate::kernels::{matmul, QActs, QWeight};

/// `acts · wᵀ` → `acts.rows × w.rows`, row-major.
pub fn linear(acts: &QActs, w: &QWeight) -> Vec<f32> {
    let mut out = vec![0f32; acts.rows * w.rows];
    matmul(acts, w, &mut out);
    out
}

/// RMS-normalises each row of `x` (width `weight.len()`) and scales it by `weight`, in place.
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let width = weight.len();
    for row in x.chunks_exact_mut(width) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
        let scale = 1.0 / (mean_sq + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v *= scale * w;
        }
    }
}

/// Rotates one head vector for position `pos`: pairs (x[2i], x[2i+1]) turn by
/// `pos · theta^(-2i/d)`.
pub fn rope(head: &mut [f32], pos: usize, theta: f32) {
    let d = head.len();
    for i in 0..d / 2 {
        let freq = theta.powf(-(2.0 * i as f32) / d as f32);
        let (sin, cos) = (pos as f32 * freq).sin_cos();
        let (a, b) = (head[2 * i], head[2 * i + 1]);
        head[2 * i] = a * cos - b * sin;
        head[2 * i + 1] = a * sin + b * cos;
    }
}

/// `gate ← silu(gate) · up`, element-wise.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Index of the largest value (the first on ties); `None` for an empty slice.
pub fn argmax(xs: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in xs.iter().enumerate() {
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

/// Dot product with eight running partial sums in a fixed order (vectorisable, and the same
/// arithmetic wherever it is called, so the paged and reference forwards agree bit for bit).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..a.len() {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) + tail
}

/// Causal attention of one query head over `n_ctx` cached positions:
/// `out = softmax(q·Kᵀ · scale) · V`, where `key(p)` and `value(p)` return position `p`'s
/// head vectors. `scores` is scratch space. Both forwards call this, visiting positions in
/// order, so their results are identical however the cache is laid out.
pub fn attend<'a>(
    q: &[f32],
    n_ctx: usize,
    key: impl Fn(usize) -> &'a [f32],
    value: impl Fn(usize) -> &'a [f32],
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    scores.clear();
    scores.extend((0..n_ctx).map(|p| dot(q, key(p)) * scale));
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    out.fill(0.0);
    for (p, s) in scores.iter().enumerate() {
        let weight = s * inv;
        for (o, v) in out.iter_mut().zip(value(p)) {
            *o += weight * v;
        }
    }
}
