//! The small numeric kernels both forwards share, on row-major `f32` slices: RMS norm, the
//! rotary embedding (adjacent-pair convention of GGUF Llama), `SiLU` gating, and the product
//! against a quantized `[out, in]` weight.

use crate::kernels::{matmul, QActs, QWeight};

/// `acts · wᵀ` → `acts.rows × w.rows`, row-major.
pub fn linear(acts: &QActs, w: &QWeight) -> Vec<f32> {
    let mut out = vec![0f32; acts.rows * w.rows];
    matmul(acts, w, &mut out);
    out
}

/// `acts · wᵀ` into `out` (resized to `acts.rows × w.rows`; its allocation is reused).
pub fn linear_into(acts: &QActs, w: &QWeight, out: &mut Vec<f32>) {
    out.resize(acts.rows * w.rows, 0.0);
    matmul(acts, w, out);
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
    let mut out = Vec::new();
    silu_mul_into(fused, width, &mut out);
    out
}

/// [`silu_mul`] into `out` (its allocation reused), rows in parallel.
pub fn silu_mul_into(fused: &[f32], width: usize, out: &mut Vec<f32>) {
    use rayon::prelude::*;
    out.resize(fused.len() / 2, 0.0);
    out.par_chunks_mut(width).zip(fused.par_chunks(2 * width)).for_each(|(dst, row)| {
        let (gate, up) = row.split_at(width);
        for ((d, g), u) in dst.iter_mut().zip(gate).zip(up) {
            *d = g / (1.0 + (-g).exp()) * u;
        }
    });
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
/// position's slice (keys or values, chosen by `pick`) from offset `lane` on. Always inlined:
/// its closure must fuse into the `#[target_feature]` caller for the intrinsics to inline.
#[allow(clippy::inline_always)]
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

/// Replaces each score by `exp(score - max)` and returns `1 / Σ`, the normalization that the
/// weighted sum of values applies.
#[inline]
fn softmax_unnormalized(scores: &mut [f32]) -> f32 {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    1.0 / sum
}

/// The attention steps, generic over the two vector primitives (always inlined into each
/// instantiation's `#[target_feature]` context, for the same reason as `each_position`).
#[allow(clippy::too_many_arguments, clippy::inline_always)]
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
    let inv = softmax_unnormalized(scores);
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
    use std::arch::x86_64::{
        __m256, _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_permute2f128_ps,
        _mm256_set1_ps, _mm256_setzero_ps, _mm256_shuffle_ps, _mm256_storeu_ps,
    };

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

    /// The head size of the specialised path (SmolLM2 and most Llama-family models).
    const HD: usize = 64;
    const CH: usize = HD / 8;

    /// [`super::attend`] with the AVX primitives. For `HD`-element heads it performs the same
    /// operations per position in a faster order: the eight-lane dot products are reduced
    /// eight positions at a time with shuffles (in the same addition tree as [`dot`]), and the
    /// weighted sum of values keeps the output in registers across positions.
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
        if q.len() != HD {
            let (dot, axpy) =
                (|a: &[f32], b: &[f32]| dot(a, b), |o: &mut [f32], w, v: &[f32]| axpy(o, w, v));
            return super::attend_with(q, n_ctx, lane, run, scale, scores, out, dot, axpy);
        }
        debug_assert!(q.len() == HD && out.len() == HD);
        scores.clear();
        scores.resize(n_ctx, 0.0);
        // SAFETY (whole body): rows come from `each_position`, each at least `HD` long (the
        // head's lanes of one cached position); `q`, `out` and `scores` are indexed in range.
        unsafe {
            let qv: [__m256; CH] = std::array::from_fn(|c| _mm256_loadu_ps(q.as_ptr().add(8 * c)));
            let mut keys = [std::ptr::null::<f32>(); 8];
            let mut pending = 0;
            let sc = _mm256_set1_ps(scale);
            super::each_position(
                n_ctx,
                lane,
                &run,
                |r| r.keys,
                |p, key| {
                    debug_assert!(key.len() >= HD);
                    keys[pending] = key.as_ptr();
                    pending += 1;
                    if pending == 8 {
                        let dots = dot8(&qv, &keys);
                        let v = _mm256_mul_ps(_mm256_add_ps(dots, _mm256_setzero_ps()), sc);
                        _mm256_storeu_ps(scores.as_mut_ptr().add(p - 7), v);
                        pending = 0;
                    }
                },
            );
            for i in 0..pending {
                let key = std::slice::from_raw_parts(keys[i], HD);
                scores[n_ctx - pending + i] = dot(q, key) * scale;
            }
            let inv = super::softmax_unnormalized(scores);
            let mut acc = [_mm256_setzero_ps(); CH];
            super::each_position(
                n_ctx,
                lane,
                &run,
                |r| r.values,
                |p, value| {
                    debug_assert!(value.len() >= HD);
                    let w = _mm256_set1_ps(scores[p] * inv);
                    for (c, a) in acc.iter_mut().enumerate() {
                        let x = _mm256_loadu_ps(value.as_ptr().add(8 * c));
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(w, x));
                    }
                },
            );
            for (c, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * c), *a);
            }
        }
    }

    /// Eight positions' dot products with `q`, each as [`dot`] computes it: eight lanes of
    /// plain multiply-then-add over the chunks, then `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`.
    ///
    /// # Safety
    /// AVX; each pointer reads `HD` floats.
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn dot8(q: &[__m256; CH], keys: &[*const f32; 8]) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            let a: [__m256; 8] = std::array::from_fn(|p| {
                let mut acc = _mm256_setzero_ps();
                for (c, qc) in q.iter().enumerate() {
                    acc =
                        _mm256_add_ps(acc, _mm256_mul_ps(*qc, _mm256_loadu_ps(keys[p].add(8 * c))));
                }
                acc
            });
            // Lanes l and l+4 of positions (p, p+4) together: [p: s0..s3 | p+4: s0..s3] with
            // s_i = l_i + l_{i+4}.
            let s: [__m256; 4] = std::array::from_fn(|p| {
                _mm256_add_ps(
                    _mm256_permute2f128_ps(a[p], a[p + 4], 0x20),
                    _mm256_permute2f128_ps(a[p], a[p + 4], 0x31),
                )
            });
            // Per 128-bit half: [p: s0+s2, s1+s3, p+1: s0+s2, s1+s3], for p = 0 and 2.
            let c: [__m256; 2] = std::array::from_fn(|i| {
                let (x, y) = (s[2 * i], s[2 * i + 1]);
                _mm256_add_ps(
                    _mm256_shuffle_ps(x, y, 0b01_00_01_00),
                    _mm256_shuffle_ps(x, y, 0b11_10_11_10),
                )
            });
            // (s0+s2) + (s1+s3), positions in order 0..8.
            _mm256_add_ps(
                _mm256_shuffle_ps(c[0], c[1], 0b10_00_10_00),
                _mm256_shuffle_ps(c[0], c[1], 0b11_01_11_01),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SIMD attention (eight positions at a time, registers across positions) gives the
    /// portable loop's bits, for contexts that are and are not multiples of eight, over runs
    /// of uneven lengths, and for a head size without the specialised path.
    #[test]
    fn simd_attention_matches_the_portable_loop_bit_for_bit() {
        let mut seed = 17u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        };
        for hd in [64, 48] {
            let (stride, lane, positions) = (3 * hd, hd, 70);
            let keys: Vec<f32> = (0..positions * stride).map(|_| next()).collect();
            let values: Vec<f32> = (0..positions * stride).map(|_| next()).collect();
            let q: Vec<f32> = (0..hd).map(|_| next()).collect();
            // Runs end at multiples of 5, like blocks of 5 positions.
            let run = |p: usize| KvRun {
                keys: &keys[p * stride..],
                values: &values[p * stride..],
                stride,
                len: 5 - p % 5,
            };
            for n_ctx in [1, 7, 8, 9, 16, 23, 70] {
                let (mut s1, mut s2) = (Vec::new(), Vec::new());
                let (mut fast, mut plain) = (vec![0f32; hd], vec![0f32; hd]);
                attend(&q, n_ctx, lane, run, 0.125, &mut s1, &mut fast);
                attend_with(&q, n_ctx, lane, run, 0.125, &mut s2, &mut plain, dot, axpy);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&fast), bits(&plain), "head {hd}, context {n_ctx}");
            }
        }
    }
}
