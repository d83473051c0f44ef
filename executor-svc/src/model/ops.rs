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

/// The rotary frequencies `theta^(-2i/d)` for `i < d/2`, computed once per model.
pub fn rope_frequencies(head_dim: usize, theta: f32) -> Vec<f32> {
    (0..head_dim / 2).map(|i| theta.powf(-(2.0 * i as f32) / head_dim as f32)).collect()
}

/// Rotates one head vector for position `pos`: pairs (x[2i], x[2i+1]) turn by
/// `pos · freqs[i]`.
pub fn rope(head: &mut [f32], pos: usize, freqs: &[f32]) {
    for (i, freq) in freqs.iter().enumerate() {
        let (sin, cos) = (pos as f32 * freq).sin_cos();
        let (a, b) = (head[2 * i], head[2 * i + 1]);
        head[2 * i] = a * cos - b * sin;
        head[2 * i + 1] = a * sin + b * cos;
    }
}

/// From rows of `[gate | up]` (each `width` wide), `silu(gate) · up` per row.
pub fn silu_mul(fused: &[f32], width: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(fused.len() / 2);
    for row in fused.chunks_exact(2 * width) {
        let (gate, up) = row.split_at(width);
        out.extend(gate.iter().zip(up).map(|(g, u)| g / (1.0 + (-g).exp()) * u));
    }
    out
}

/// Splits rows of `[q | k | v]` into three row-major matrices of widths `q_width` and `kv_width`.
pub fn split_qkv(fused: &[f32], q_width: usize, kv_width: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = fused.len() / (q_width + 2 * kv_width);
    let (mut q, mut k, mut v) = (
        Vec::with_capacity(rows * q_width),
        Vec::with_capacity(rows * kv_width),
        Vec::with_capacity(rows * kv_width),
    );
    for row in fused.chunks_exact(q_width + 2 * kv_width) {
        q.extend_from_slice(&row[..q_width]);
        k.extend_from_slice(&row[q_width..q_width + kv_width]);
        v.extend_from_slice(&row[q_width + kv_width..]);
    }
    (q, k, v)
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

/// Dot product with eight running partial sums (lane `l` takes elements `8c + l`), plain
/// multiplies and adds, one fixed reduction. The AVX version below performs exactly these
/// operations, so results are the same with or without it.
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

/// Keys and values of consecutive cached positions: position `first + i` at `i · stride` in
/// both slices, for `i < len`.
#[derive(Clone, Copy, Debug)]
pub struct KvRun<'a> {
    /// Keys, from the run's first position on.
    pub keys: &'a [f32],
    /// Values, laid out like the keys.
    pub values: &'a [f32],
    /// Floats from one position to the next.
    pub stride: usize,
    /// Positions in the run.
    pub len: usize,
}

/// Causal attention of one query head over `n_ctx` cached positions:
/// `out = softmax(q·Kᵀ · scale) · V`. `run(p)` gives the run of positions starting at `p`
/// (a paged cache: to the end of `p`'s block; a contiguous one: to the end), with the head's
/// vectors at offset `lane` of each position. `scores` is scratch space. Both forwards call
/// this, visiting positions in order, so their results are identical however the cache is laid
/// out.
#[allow(clippy::too_many_arguments)]
pub fn attend<'a>(
    q: &[f32],
    n_ctx: usize,
    lane: usize,
    run: impl Fn(usize) -> KvRun<'a>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if simd::available() {
        // SAFETY: AVX was detected at run time.
        unsafe { simd::attend(q, n_ctx, lane, run, scale, scores, out) };
        return;
    }
    attend_with(q, n_ctx, lane, run, scale, scores, out, dot, axpy);
}

/// `out += weight · v`, element-wise, multiply then add.
#[inline]
fn axpy(out: &mut [f32], weight: f32, v: &[f32]) {
    for (o, x) in out.iter_mut().zip(v) {
        *o += weight * x;
    }
}

/// Calls `f(position, row)` for each of the `n_ctx` positions in order, where `row` is the
/// position's slice (keys or values, chosen by `pick`) from offset `lane` on.
#[inline(always)]
fn each_position<'a>(
    n_ctx: usize,
    lane: usize,
    run: &impl Fn(usize) -> KvRun<'a>,
    pick: impl Fn(&KvRun<'a>) -> &'a [f32],
    mut f: impl FnMut(usize, &'a [f32]),
) {
    let mut p = 0;
    while p < n_ctx {
        let r = run(p);
        let len = r.len.min(n_ctx - p).max(1);
        let rows = pick(&r);
        for i in 0..len {
            f(p + i, &rows[i * r.stride + lane..]);
        }
        p += len;
    }
}

/// The attention steps, generic over the two vector primitives.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn attend_with<'a>(
    q: &[f32],
    n_ctx: usize,
    lane: usize,
    run: impl Fn(usize) -> KvRun<'a>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    dot: impl Fn(&[f32], &[f32]) -> f32,
    axpy: impl Fn(&mut [f32], f32, &[f32]),
) {
    let hd = q.len();
    scores.clear();
    scores.resize(n_ctx, 0.0);
    each_position(n_ctx, lane, &run, |r| r.keys, |p, key| scores[p] = dot(q, &key[..hd]) * scale);
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    out.fill(0.0);
    each_position(
        n_ctx,
        lane,
        &run,
        |r| r.values,
        |p, value| axpy(out, scores[p] * inv, &value[..hd]),
    );
}

#[cfg(target_arch = "x86_64")]
mod simd {
    //! AVX versions of [`super::dot`] and [`super::axpy`]: the same lanes, the same plain
    //! multiplies and adds (no fused multiply-add), so the same results.
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        static AVX: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVX.get_or_init(|| is_x86_feature_detected!("avx"))
    }

    #[inline]
    #[target_feature(enable = "avx")]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let chunks = n / 8;
        let mut acc = _mm256_setzero_ps();
        for c in 0..chunks {
            // SAFETY: c·8 + 8 ≤ n for both slices.
            let (x, y) = unsafe {
                (_mm256_loadu_ps(a.as_ptr().add(c * 8)), _mm256_loadu_ps(b.as_ptr().add(c * 8)))
            };
            acc = _mm256_add_ps(acc, _mm256_mul_ps(x, y));
        }
        let mut l = [0f32; 8];
        // SAFETY: `l` holds eight floats.
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), acc) };
        let mut tail = 0f32;
        for i in chunks * 8..n {
            tail += a[i] * b[i];
        }
        ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])) + tail
    }

    #[inline]
    #[target_feature(enable = "avx")]
    fn axpy(out: &mut [f32], weight: f32, v: &[f32]) {
        let n = out.len().min(v.len());
        let chunks = n / 8;
        let w = _mm256_set1_ps(weight);
        for c in 0..chunks {
            // SAFETY: c·8 + 8 ≤ n for both slices.
            unsafe {
                let o = out.as_mut_ptr().add(c * 8);
                let x = _mm256_loadu_ps(v.as_ptr().add(c * 8));
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_mul_ps(w, x)));
            }
        }
        for i in chunks * 8..n {
            out[i] += weight * v[i];
        }
    }

    /// [`super::attend`] with the AVX primitives.
    ///
    /// # Safety
    /// The CPU must support AVX.
    #[target_feature(enable = "avx")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend<'a>(
        q: &[f32],
        n_ctx: usize,
        lane: usize,
        run: impl Fn(usize) -> super::KvRun<'a>,
        scale: f32,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        super::attend_with(
            q,
            n_ctx,
            lane,
            run,
            scale,
            scores,
            out,
            |a, b| dot(a, b),
            |o, w, v| axpy(o, w, v),
        );
    }
}
