//! The small numeric kernels both forwards share, on row-major `f32` slices: RMS norm, the
//! rotary embedding (adjacent-pair convention of GGUF Llama), `SiLU` gating, and the product
//! against a quantized `[out, in]` weight.

use crate::kernels::{matmul, QWeight};

/// `x · wᵀ` for the rows of `x` (`w.cols` wide) → `rows × w.rows`, row-major.
pub fn linear(x: &[f32], w: &QWeight) -> Vec<f32> {
    let mut out = Vec::new();
    linear_into(x, w, &mut out);
    out
}

/// `x · wᵀ` into `out` (resized to `rows × w.rows`; its allocation is reused).
pub fn linear_into(x: &[f32], w: &QWeight, out: &mut Vec<f32>) {
    let rows = x.len() / w.cols;
    out.resize(rows * w.rows, 0.0);
    matmul(x, rows, w, out);
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

/// Lanes of the attention dot product: element `i` goes to lane `i % 16`.
const LANES: usize = 16;

/// The attention dot product, in a fixed order every path follows: sixteen running sums (lane
/// `l` takes elements `16c + l`, one fused multiply-add each, chunk by chunk), reduced as
/// [`reduce16`]; elements past the last whole chunk go to a seventeenth sum added last.
#[inline]
pub fn dot<T: Elem>(a: &[f32], b: &[T]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = a.len() / LANES;
    for c in 0..chunks {
        for l in 0..LANES {
            acc[l] = a[c * LANES + l].mul_add(b[c * LANES + l].f32(), acc[l]);
        }
    }
    let mut tail = 0f32;
    for i in chunks * LANES..a.len() {
        tail = a[i].mul_add(b[i].f32(), tail);
    }
    reduce16(&acc) + tail
}

/// A cached key or value element: an f32, or an f16's bits (read back exactly as f32).
pub trait Elem: Copy + Send + Sync + 'static {
    /// Whether it is an f16 (the SIMD paths convert with `vcvtph2ps`).
    const F16: bool;
    /// Its value.
    fn f32(self) -> f32;
}

impl Elem for f32 {
    const F16: bool = false;
    #[inline]
    fn f32(self) -> f32 {
        self
    }
}

impl Elem for u16 {
    const F16: bool = true;
    #[inline]
    fn f32(self) -> f32 {
        half::f16::from_bits(self).to_f32()
    }
}

/// The sixteen lanes' sum by halves: `l + (l + 8)`, then `+ 4`, `+ 2`, `+ 1` (a register's
/// halves, then its quarters: what the SIMD paths do with shuffles).
#[inline]
fn reduce16(a: &[f32; LANES]) -> f32 {
    let b: [f32; 8] = std::array::from_fn(|l| a[l] + a[l + 8]);
    let c: [f32; 4] = std::array::from_fn(|l| b[l] + b[l + 4]);
    let d: [f32; 2] = std::array::from_fn(|l| c[l] + c[l + 2]);
    d[0] + d[1]
}

/// Keys and values of consecutive cached positions: position `first + i` at `i · stride` in
/// both slices, for `i < len`.
#[derive(Clone, Copy, Debug)]
pub struct KvRun<'a, T = f32> {
    /// Keys, from the run's first position on.
    pub keys: &'a [T],
    /// Values, laid out like the keys.
    pub values: &'a [T],
    /// Floats from one position to the next.
    pub stride: usize,
    /// Positions in the run.
    pub len: usize,
}

/// Causal attention of the query heads `q` (`G` heads of `hd` each, `G = out.len() / hd`)
/// that share one KV head, over `n_ctx` cached positions: per head,
/// `out = softmax(q·Kᵀ · scale) · V`. `run(p)` gives the run of positions starting at `p` (a
/// paged cache: to the end of `p`'s block; a contiguous one: to the end), with the KV head's
/// vectors at offset `lane` of each position. `scores` is scratch space.
///
/// The heads of a group read each key and value once for all of them (grouped-query
/// attention's heads share them). Each head's result is computed in one fixed order whatever
/// the group, the layout or the instruction set: scores by [`dot`] times `scale`, a softmax
/// (`exp(s - max)` summed in position order), then `out = fma(w_p, v_p, out)` per position in
/// order with `w_p = e_p · (1 / Σ)`. So both forwards, and every path, give the same bits.
#[allow(clippy::too_many_arguments)]
pub fn attend<'a, T: Elem>(
    q: &[f32],
    hd: usize,
    n_ctx: usize,
    lane: usize,
    run: impl Fn(usize) -> KvRun<'a, T>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    debug_assert_eq!(q.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if hd == simd::HD {
        if let Some(isa) = simd::detect() {
            // SAFETY: the instruction set was detected at run time.
            unsafe { simd::attend(isa, q, n_ctx, lane, run, scale, scores, out) };
            return;
        }
    }
    attend_with(q, hd, n_ctx, lane, run, scale, scores, out);
}

/// `out = fma(weight, v, out)`, element-wise.
#[inline]
fn axpy<T: Elem>(out: &mut [f32], weight: f32, v: &[T]) {
    for (o, x) in out.iter_mut().zip(v) {
        *o = weight.mul_add(x.f32(), *o);
    }
}

/// Calls `f(position, row)` for each of the `n_ctx` positions in order, where `row` is the
/// position's slice (keys or values, chosen by `pick`) from offset `lane` on. Always inlined:
/// its closure must fuse into the `#[target_feature]` caller for the intrinsics to inline.
#[allow(clippy::inline_always)]
#[inline(always)]
fn each_position<'a, T: Elem>(
    n_ctx: usize,
    lane: usize,
    run: &impl Fn(usize) -> KvRun<'a, T>,
    pick: impl Fn(&KvRun<'a, T>) -> &'a [T],
    mut f: impl FnMut(usize, &'a [T]),
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

/// The attention in plain Rust: the definition the SIMD paths follow. `scores` holds the
/// heads' rows one after the other.
#[allow(clippy::too_many_arguments)]
fn attend_with<'a, T: Elem>(
    q: &[f32],
    hd: usize,
    n_ctx: usize,
    lane: usize,
    run: impl Fn(usize) -> KvRun<'a, T>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let heads = out.len() / hd;
    scores.clear();
    scores.resize(heads * n_ctx, 0.0);
    each_position(
        n_ctx,
        lane,
        &run,
        |r| r.keys,
        |p, key| {
            for g in 0..heads {
                scores[g * n_ctx + p] = dot(&q[g * hd..(g + 1) * hd], &key[..hd]) * scale;
            }
        },
    );
    let inv: Vec<f32> = scores.chunks_exact_mut(n_ctx).map(softmax_unnormalized).collect();
    out.fill(0.0);
    each_position(
        n_ctx,
        lane,
        &run,
        |r| r.values,
        |p, value| {
            for g in 0..heads {
                axpy(&mut out[g * hd..(g + 1) * hd], scores[g * n_ctx + p] * inv[g], &value[..hd]);
            }
        },
    );
}

#[cfg(target_arch = "x86_64")]
mod simd {
    //! The attention of [`super::attend`] with AVX-512 or AVX2 + FMA,
    //! for heads of 64 (other sizes take the portable path): the same fused multiply-adds per lane as
    //! [`super::dot`] and [`super::axpy`], the same reduction tree, so the same bits. Scores
    //! are computed for 16 (AVX-512) or 8 (AVX2) positions at a time and reduced together with
    //! shuffles; the weighted sum of values keeps every head's output in registers across
    //! positions, each value read once for the group. Cached values may be f16 (converted
    //! exactly on load).
    use std::arch::x86_64::{
        __m256, __m512, _mm256_add_ps, _mm256_castps256_ps128, _mm256_cvtph_ps,
        _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_mul_ps,
        _mm256_permute2f128_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_shuffle_ps,
        _mm256_storeu_ps, _mm512_add_ps, _mm512_castps512_ps256, _mm512_cvtph_ps,
        _mm512_extractf32x8_ps, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_mul_ps,
        _mm512_permutexvar_ps, _mm512_set1_ps, _mm512_setr_epi32, _mm512_setzero_ps,
        _mm512_shuffle_f32x4, _mm512_shuffle_ps, _mm512_storeu_ps, _mm_add_ps, _mm_add_ss,
        _mm_cvtss_f32, _mm_loadu_si128, _mm_movehdup_ps, _mm_movehl_ps,
    };

    use super::{Elem, KvRun};

    /// The head size of the SIMD paths (SmolLM2 and most small Llama-family models).
    pub const HD: usize = 64;

    /// Which kernel the CPU runs.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Isa {
        /// AVX2 + FMA.
        Avx2,
        /// AVX-512 F + DQ.
        Avx512,
    }

    /// The attention kernel for this CPU, if any: the products' choice (so `FERRY_KERNEL`
    /// selects both), AVX-512 needing DQ as well.
    pub fn detect() -> Option<Isa> {
        match crate::kernels::x86::detect()? {
            crate::kernels::x86::Isa::Avx512 if is_x86_feature_detected!("avx512dq") => {
                Some(Isa::Avx512)
            }
            _ => Some(Isa::Avx2),
        }
    }

    /// [`super::attend`] with the kernel for `isa`, for heads of [`HD`].
    ///
    /// # Safety
    /// The CPU must support `isa`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend<'a, T: Elem>(
        isa: Isa,
        q: &[f32],
        n_ctx: usize,
        lane: usize,
        run: impl Fn(usize) -> KvRun<'a, T>,
        scale: f32,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            match isa {
                Isa::Avx512 => avx512(q, n_ctx, lane, run, scale, scores, out),
                Isa::Avx2 => avx2(q, n_ctx, lane, run, scale, scores, out),
            }
        }
    }

    /// The softmax of every head's row of `scores` (`n_ctx` each): their `1 / Σ`.
    fn softmax_rows(scores: &mut [f32], n_ctx: usize, inv: &mut [f32; MAX_HEADS]) {
        for (g, row) in scores.chunks_exact_mut(n_ctx).enumerate() {
            inv[g] = super::softmax_unnormalized(row);
        }
    }

    /// Most heads sharing a KV head that the SIMD paths take (more: the portable path).
    const MAX_HEADS: usize = 16;

    /// The AVX-512 path: scores 16 positions at a time.
    #[target_feature(enable = "avx512f,avx512dq,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn avx512<'a, T: Elem>(
        q: &[f32],
        n_ctx: usize,
        lane: usize,
        run: impl Fn(usize) -> KvRun<'a, T>,
        scale: f32,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        const CH: usize = HD / 16;
        let heads = out.len() / HD;
        if heads > MAX_HEADS {
            return super::attend_with(q, HD, n_ctx, lane, run, scale, scores, out);
        }
        scores.clear();
        scores.resize(heads * n_ctx, 0.0);
        // SAFETY (whole body): rows come from `each_position`, each at least `HD` long (the
        // KV head's lanes of one cached position); `q`, `out` and `scores` are indexed in
        // range (`heads` rows of `n_ctx` scores, `heads · HD` query and output values).
        unsafe {
            let sc = _mm512_set1_ps(scale);
            // Lane of the reduction's result holding position `k` of the 16 (see `dots16`).
            let order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
            let mut keys = [std::ptr::null::<T>(); 16];
            let mut pending = 0;
            super::each_position(
                n_ctx,
                lane,
                &run,
                |r| r.keys,
                |p, key| {
                    keys[pending] = key.as_ptr();
                    pending += 1;
                    if pending == 16 {
                        for g in 0..heads {
                            let qv: [__m512; CH] = std::array::from_fn(|c| {
                                _mm512_loadu_ps(q.as_ptr().add(g * HD + 16 * c))
                            });
                            let d = _mm512_permutexvar_ps(order, dots16(&qv, &keys));
                            let at = scores.as_mut_ptr().add(g * n_ctx + p - 15);
                            _mm512_storeu_ps(at, _mm512_mul_ps(d, sc));
                        }
                        pending = 0;
                    }
                },
            );
            for (i, key) in keys.iter().enumerate().take(pending) {
                for g in 0..heads {
                    let mut acc = _mm512_setzero_ps();
                    for c in 0..CH {
                        let (qc, kc) = (q.as_ptr().add(g * HD + 16 * c), key.add(16 * c));
                        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qc), load16(kc), acc);
                    }
                    let b =
                        _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
                    scores[g * n_ctx + n_ctx - pending + i] = reduce8(b) * scale;
                }
            }
            let mut inv = [0f32; MAX_HEADS];
            softmax_rows(scores, n_ctx, &mut inv);
            let mut g0 = 0;
            while g0 < heads {
                let n = (heads - g0).min(3);
                let (s, o) = (&scores[g0 * n_ctx..], &mut out[g0 * HD..]);
                match n {
                    1 => values512::<T, 1>(n_ctx, lane, &run, s, &inv[g0..], o),
                    2 => values512::<T, 2>(n_ctx, lane, &run, s, &inv[g0..], o),
                    _ => values512::<T, 3>(n_ctx, lane, &run, s, &inv[g0..], o),
                }
                g0 += n;
            }
        }
    }

    /// Sixteen positions' dot products with one head's `q`, each as [`super::dot`] computes
    /// it, reduced together: lanes `l + (l + 8)` of key pairs `(i, i + 8)`, then `+ 4` of
    /// pairs `(i, i + 4)`, `+ 2`, `+ 1`. Lane `4j + t` of the result holds position
    /// `[0, 2, 1, 3][t] + [0, 8, 4, 12][j]`.
    ///
    /// # Safety
    /// AVX-512 F; each pointer reads `HD` floats.
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn dots16<T: Elem>(q: &[__m512; HD / 16], keys: &[*const T; 16]) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe {
            let a: [__m512; 16] = std::array::from_fn(|p| {
                let mut acc = _mm512_setzero_ps();
                for (c, qc) in q.iter().enumerate() {
                    acc = _mm512_fmadd_ps(*qc, load16(keys[p].add(16 * c)), acc);
                }
                acc
            });
            // Quarters [i: b0-3, i: b4-7, i+8: b0-3, i+8: b4-7], b = lanes l + (l + 8).
            let r: [__m512; 8] = std::array::from_fn(|i| {
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b01_00_01_00>(a[i], a[i + 8]),
                    _mm512_shuffle_f32x4::<0b11_10_11_10>(a[i], a[i + 8]),
                )
            });
            // Quarters [i, i+8, i+4, i+12], each c = b[l] + b[l + 4].
            let c: [__m512; 4] = std::array::from_fn(|i| {
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b10_00_10_00>(r[i], r[i + 4]),
                    _mm512_shuffle_f32x4::<0b11_01_11_01>(r[i], r[i + 4]),
                )
            });
            // Per quarter [c_i: d0, d1, c_(i+2): d0, d1], d = c[l] + c[l + 2].
            let d: [__m512; 2] = std::array::from_fn(|i| {
                _mm512_add_ps(
                    _mm512_shuffle_ps::<0b01_00_01_00>(c[i], c[i + 2]),
                    _mm512_shuffle_ps::<0b11_10_11_10>(c[i], c[i + 2]),
                )
            });
            // Per quarter [c0, c2, c1, c3]: d0 + d1.
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b10_00_10_00>(d[0], d[1]),
                _mm512_shuffle_ps::<0b11_01_11_01>(d[0], d[1]),
            )
        }
    }

    /// `out = fma(w_p, v_p, out)` over the positions, for `G` heads at once (each value read
    /// once for them), outputs in registers.
    ///
    /// # Safety
    /// AVX-512 F; as in `avx512`.
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn values512<'a, T: Elem, const G: usize>(
        n_ctx: usize,
        lane: usize,
        run: &impl Fn(usize) -> KvRun<'a, T>,
        scores: &[f32],
        inv: &[f32],
        out: &mut [f32],
    ) {
        const CH: usize = HD / 16;
        // SAFETY: as in `avx512`.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); CH]; G];
            super::each_position(
                n_ctx,
                lane,
                run,
                |r| r.values,
                |p, value| {
                    let v: [__m512; CH] =
                        std::array::from_fn(|c| load16(value.as_ptr().add(16 * c)));
                    for g in 0..G {
                        let w = _mm512_set1_ps(*scores.get_unchecked(g * n_ctx + p) * inv[g]);
                        for c in 0..CH {
                            acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
                        }
                    }
                },
            );
            for (g, head) in acc.iter().enumerate() {
                for (c, a) in head.iter().enumerate() {
                    _mm512_storeu_ps(out.as_mut_ptr().add(g * HD + 16 * c), *a);
                }
            }
        }
    }

    /// Sixteen cached values from `p`, as f32 (an f16 cache's converted exactly).
    ///
    /// # Safety
    /// AVX-512 F; 16 values readable at `p`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16<T: Elem>(p: *const T) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe {
            if T::F16 {
                _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
            } else {
                _mm512_loadu_ps(p.cast())
            }
        }
    }

    /// Eight cached values from `p`, as f32.
    ///
    /// # Safety
    /// AVX2 + F16C; 8 values readable at `p`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8<T: Elem>(p: *const T) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            if T::F16 {
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
            } else {
                _mm256_loadu_ps(p.cast())
            }
        }
    }

    /// Lanes `l + (l + 4)`, then `+ 2`, `+ 1` of eight sums (the end of [`super::reduce16`]).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn reduce8(b: __m256) -> f32 {
        let c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
        let d = _mm_add_ps(c, _mm_movehl_ps(c, c));
        _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)))
    }

    /// The AVX2 path: scores 8 positions at a time, one head's values at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn avx2<'a, T: Elem>(
        q: &[f32],
        n_ctx: usize,
        lane: usize,
        run: impl Fn(usize) -> KvRun<'a, T>,
        scale: f32,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        const CH: usize = HD / 8;
        let heads = out.len() / HD;
        if heads > MAX_HEADS {
            return super::attend_with(q, HD, n_ctx, lane, run, scale, scores, out);
        }
        scores.clear();
        scores.resize(heads * n_ctx, 0.0);
        // SAFETY (whole body): as in `avx512`.
        unsafe {
            let sc = _mm256_set1_ps(scale);
            let mut keys = [std::ptr::null::<T>(); 8];
            let mut pending = 0;
            super::each_position(
                n_ctx,
                lane,
                &run,
                |r| r.keys,
                |p, key| {
                    keys[pending] = key.as_ptr();
                    pending += 1;
                    if pending == 8 {
                        for g in 0..heads {
                            let d = dots8(q.as_ptr().add(g * HD), &keys);
                            let at = scores.as_mut_ptr().add(g * n_ctx + p - 7);
                            _mm256_storeu_ps(at, _mm256_mul_ps(d, sc));
                        }
                        pending = 0;
                    }
                },
            );
            for (i, key) in keys.iter().enumerate().take(pending) {
                for g in 0..heads {
                    let b = halves(q.as_ptr().add(g * HD), *key);
                    scores[g * n_ctx + n_ctx - pending + i] = reduce8(b) * scale;
                }
            }
            let mut inv = [0f32; MAX_HEADS];
            softmax_rows(scores, n_ctx, &mut inv);
            for (g, &inv) in inv.iter().enumerate().take(heads) {
                let mut acc = [_mm256_setzero_ps(); CH];
                super::each_position(
                    n_ctx,
                    lane,
                    &run,
                    |r| r.values,
                    |p, value| {
                        let w = _mm256_set1_ps(*scores.get_unchecked(g * n_ctx + p) * inv);
                        for (c, a) in acc.iter_mut().enumerate() {
                            *a = _mm256_fmadd_ps(w, load8(value.as_ptr().add(8 * c)), *a);
                        }
                    },
                );
                for (c, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.as_mut_ptr().add(g * HD + 8 * c), *a);
                }
            }
        }
    }

    /// One position's sixteen running sums with `q` (two registers: lanes 0-7 and 8-15),
    /// added as `l + (l + 8)`: the first step of [`super::reduce16`].
    ///
    /// # Safety
    /// AVX2 + FMA; both pointers read `HD` floats.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn halves<T: Elem>(q: *const f32, key: *const T) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for c in 0..HD / 16 {
                let (qc, kc) = (q.add(16 * c), key.add(16 * c));
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(qc), load8(kc), lo);
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(qc.add(8)), load8(kc.add(8)), hi);
            }
            _mm256_add_ps(lo, hi)
        }
    }

    /// Eight positions' dot products with `q`, each as [`super::dot`] computes it, in
    /// position order: [`halves`], then `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))` by shuffles.
    ///
    /// # Safety
    /// AVX2 + FMA; each pointer reads `HD` floats.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dots8<T: Elem>(q: *const f32, keys: &[*const T; 8]) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            let a: [__m256; 8] = std::array::from_fn(|p| halves(q, keys[p]));
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

    /// Every kernel in `isas` (`None`: whatever `attend` picks) against the portable loop,
    /// head by head.
    #[allow(clippy::too_many_arguments)]
    fn check<'a, T: Elem>(
        isas: &[Option<simd::Isa>],
        qs: &[f32],
        hd: usize,
        n_ctx: usize,
        lane: usize,
        run: impl Fn(usize) -> KvRun<'a, T> + Copy,
        what: &str,
    ) {
        let heads = qs.len() / hd;
        // Head by head through the portable loop: the definition.
        let mut plain = vec![0f32; heads * hd];
        for g in 0..heads {
            let mut s = Vec::new();
            let (qg, og) = (&qs[g * hd..(g + 1) * hd], &mut plain[g * hd..(g + 1) * hd]);
            attend_with(qg, hd, n_ctx, lane, run, 0.125, &mut s, og);
        }
        for isa in isas {
            let mut fast = vec![f32::NAN; heads * hd];
            let mut s = Vec::new();
            match isa {
                None => attend(qs, hd, n_ctx, lane, run, 0.125, &mut s, &mut fast),
                #[cfg(target_arch = "x86_64")]
                Some(isa) if hd == simd::HD => unsafe {
                    // SAFETY: only the instruction sets this CPU has are listed.
                    simd::attend(*isa, qs, n_ctx, lane, run, 0.125, &mut s, &mut fast);
                },
                Some(_) => continue,
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&fast),
                bits(&plain),
                "{isa:?}, {what}: head {hd}, {heads} heads, context {n_ctx}"
            );
        }
    }

    /// Every SIMD attention this CPU runs (16 or 8 positions at a time, a KV head's query
    /// heads together, registers across positions) gives the portable loop's bits, head by
    /// head, for contexts that are and are not multiples of 16, over runs of uneven lengths,
    /// for groups of 1 to 4 heads, over f32 and f16 keys and values, and for a head size
    /// without the specialised path; and the portable dot product is within f32 rounding of
    /// the exact one.
    #[test]
    fn simd_attention_matches_the_portable_loop_bit_for_bit() {
        let mut seed = 17u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        };
        #[allow(unused_mut)]
        let mut isas: Vec<Option<simd::Isa>> = vec![None];
        #[cfg(target_arch = "x86_64")]
        {
            use crate::kernels::x86::{supported, Isa};
            for isa in supported() {
                isas.push(Some(match isa {
                    Isa::Avx2 => simd::Isa::Avx2,
                    Isa::Avx512 if is_x86_feature_detected!("avx512dq") => simd::Isa::Avx512,
                    Isa::Avx512 => continue,
                }));
            }
        }
        assert!(
            isas.len() > 1 || !cfg!(target_arch = "x86_64") || !is_x86_feature_detected!("fma")
        );
        for hd in [64, 48] {
            let (stride, lane, positions) = (3 * hd, hd, 70);
            let keys: Vec<f32> = (0..positions * stride).map(|_| next()).collect();
            let values: Vec<f32> = (0..positions * stride).map(|_| next()).collect();
            let q: Vec<f32> = (0..4 * hd).map(|_| next()).collect();
            let exact: f64 = q[..hd].iter().zip(&keys[lane..]).map(|(a, b)| f64::from(a * b)).sum();
            let size: f64 =
                q[..hd].iter().zip(&keys[lane..]).map(|(a, b)| f64::from((a * b).abs())).sum();
            assert!((f64::from(dot(&q[..hd], &keys[lane..lane + hd])) - exact).abs() < 1e-6 * size);
            // Runs end at multiples of 5, like blocks of 5 positions.
            let run = |p: usize| KvRun {
                keys: &keys[p * stride..],
                values: &values[p * stride..],
                stride,
                len: 5 - p % 5,
            };
            // The same values as f16 bits (what an f16 cache holds).
            let bits = |v: &[f32]| -> Vec<u16> {
                v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect()
            };
            let (keys16, values16) = (bits(&keys), bits(&values));
            let run16 = |p: usize| KvRun {
                keys: &keys16[p * stride..],
                values: &values16[p * stride..],
                stride,
                len: 5 - p % 5,
            };
            for heads in 1..=4 {
                for n_ctx in [1, 7, 8, 9, 15, 16, 17, 23, 32, 70] {
                    check(&isas, &q[..heads * hd], hd, n_ctx, lane, run, "f32");
                    check(&isas, &q[..heads * hd], hd, n_ctx, lane, run16, "f16");
                }
            }
        }
    }
}
