//! The AVX-512 pieces of the tiled attention ([`super::Arch`]): sixteen positions scored
//! together, up to three heads' outputs kept in registers across a chunk of values, and
//! [`super::super::exp`] and the softmax sixteen lanes at a time, each the same operations
//! per lane as the portable definition, so the same bits.
//!
//! `unsafe`: AVX-512 intrinsics behind `#[target_feature]`, reached only through
//! [`super::attend`] with the instruction set detected at run time (each function states
//! what it reads and writes).

use std::arch::x86_64::{
    __m512, _mm256_add_ps, _mm256_loadu_si256, _mm512_add_epi32, _mm512_add_ps,
    _mm512_castps512_ps256, _mm512_castsi512_ps, _mm512_cmp_ps_mask, _mm512_cvtph_ps,
    _mm512_cvtps_epi32, _mm512_extractf32x8_ps, _mm512_fmadd_ps, _mm512_loadu_ps,
    _mm512_maskz_mov_ps, _mm512_max_ps, _mm512_mul_ps, _mm512_permutexvar_ps, _mm512_reduce_max_ps,
    _mm512_roundscale_ps, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setr_epi32, _mm512_setzero_ps,
    _mm512_shuffle_f32x4, _mm512_shuffle_ps, _mm512_slli_epi32, _mm512_storeu_ps, _mm512_sub_ps,
    _CMP_LT_OQ,
};

use super::super::{AttnScratch, Elem, Heads, KvRun, EXP_FLOOR, EXP_P, LN2_HI, LN2_LO, LOG2E};
use super::{reduce8, tiled, Arch, MAX_CH, NEAREST, VALUE_COLS};

/// The AVX-512 pieces.
struct Avx512;

/// The AVX-512 entry point.
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
pub(super) unsafe fn avx512<'a, T: Elem>(
    heads: Heads,
    q: &[f32],
    n_ctx: usize,
    run: impl Fn(usize) -> KvRun<'a, T>,
    scratch: &mut AttnScratch,
    out: &mut [f32],
) {
    // SAFETY: the caller's contract (a head size `super::supports` takes).
    unsafe {
        match heads.hd {
            64 => tiled::<T, Avx512, 64>(heads, q, n_ctx, run, scratch, out),
            128 => tiled::<T, Avx512, 128>(heads, q, n_ctx, run, scratch, out),
            _ => tiled::<T, Avx512, 256>(heads, q, n_ctx, run, scratch, out),
        }
    }
}

impl Arch for Avx512 {
    const W: usize = 16;
    const HEADS: usize = 3;

    #[allow(clippy::inline_always)]
    #[inline(always)]
    unsafe fn dots<const H: usize>(q: *const f32, keys: *const f32, scale: f32, out: *mut f32) {
        // SAFETY: the trait's contract; AVX-512 in the caller.
        unsafe { dots16::<H>(q, keys, scale, out) }
    }

    #[allow(clippy::inline_always)]
    #[inline(always)]
    unsafe fn dot<const H: usize>(q: *const f32, key: *const f32) -> f32 {
        // SAFETY: as above.
        unsafe { dot512::<H>(q, key) }
    }

    #[allow(clippy::inline_always)]
    #[inline(always)]
    unsafe fn convert<const H: usize, T: Elem>(src: *const T, dst: *mut f32) {
        // SAFETY: as above.
        unsafe { convert512::<H, T>(src, dst) }
    }

    #[allow(clippy::inline_always)]
    #[inline(always)]
    unsafe fn softmax(row: &mut [f32]) {
        // SAFETY: as above.
        unsafe { softmax512(row) }
    }

    #[allow(clippy::inline_always)]
    #[inline(always)]
    unsafe fn values<const H: usize>(
        n: usize,
        w: *const f32,
        stride: usize,
        values: *const f32,
        len: usize,
        out: *mut f32,
    ) {
        // SAFETY: as above.
        unsafe {
            match n {
                1 => values512::<1, H>(w, stride, values, len, out),
                2 => values512::<2, H>(w, stride, values, len, out),
                _ => values512::<3, H>(w, stride, values, len, out),
            }
        }
    }
}

/// Sixteen consecutive keys' dot products with `q`, each as [`super::super::dot`] computes it,
/// reduced together, times `scale`, stored in position order: lanes `l + (l + 8)` of key
/// pairs `(i, i + 8)`, then `+ 4` of pairs `(i, i + 4)`, `+ 2`, `+ 1`, which leaves lane
/// `4j + t` holding position `[0, 2, 1, 3][t] + [0, 8, 4, 12][j]` (permuted back).
///
/// # Safety
/// AVX-512 F; `q` reads `H` floats, `keys` 16 keys of `H`, `out` takes 16.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn dots16<const H: usize>(q: *const f32, keys: *const f32, scale: f32, out: *mut f32) {
    // SAFETY: the caller's contract (chunks past the head's `H / 16` are never loaded).
    unsafe {
        let qv: [__m512; MAX_CH] = std::array::from_fn(|c| {
            if c < H / 16 {
                _mm512_loadu_ps(q.add(16 * c))
            } else {
                _mm512_setzero_ps()
            }
        });
        let a: [__m512; 16] = std::array::from_fn(|p| {
            let mut acc = _mm512_setzero_ps();
            for (c, qc) in qv.iter().enumerate().take(H / 16) {
                acc = _mm512_fmadd_ps(*qc, _mm512_loadu_ps(keys.add(p * H + 16 * c)), acc);
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
        let e = _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(d[0], d[1]),
            _mm512_shuffle_ps::<0b11_01_11_01>(d[0], d[1]),
        );
        let order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
        let e = _mm512_permutexvar_ps(order, e);
        _mm512_storeu_ps(out, _mm512_mul_ps(e, _mm512_set1_ps(scale)));
    }
}

/// One key's dot product with `q`, as [`super::super::dot`].
///
/// # Safety
/// AVX-512 F; both read `H` floats.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma")]
unsafe fn dot512<const H: usize>(q: *const f32, key: *const f32) -> f32 {
    // SAFETY: the caller's contract.
    unsafe {
        let mut acc = _mm512_setzero_ps();
        for c in 0..H / 16 {
            acc = _mm512_fmadd_ps(
                _mm512_loadu_ps(q.add(16 * c)),
                _mm512_loadu_ps(key.add(16 * c)),
                acc,
            );
        }
        reduce8(_mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1)))
    }
}

/// `H` cached elements as f32.
///
/// # Safety
/// AVX-512 F; `src` reads and `dst` takes `H` elements.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn convert512<const H: usize, T: Elem>(src: *const T, dst: *mut f32) {
    // SAFETY: the caller's contract.
    unsafe {
        for c in 0..H / 16 {
            let v = if T::F16 {
                _mm512_cvtph_ps(_mm256_loadu_si256(src.add(16 * c).cast()))
            } else {
                _mm512_loadu_ps(src.add(16 * c).cast())
            };
            _mm512_storeu_ps(dst.add(16 * c), v);
        }
    }
}

/// [`super::super::exp`] of each lane.
///
/// # Safety
/// AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn exp16(x: __m512) -> __m512 {
    let n = _mm512_roundscale_ps::<NEAREST>(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)));
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_P[0]);
    for &c in &EXP_P[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0));
    let bits = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    let y = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32::<23>(bits)));
    let kept = !_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_FLOOR));
    _mm512_maskz_mov_ps(kept, y)
}

/// [`super::super::softmax`], sixteen lanes at a time.
///
/// # Safety
/// AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn softmax512(row: &mut [f32]) {
    let whole = row.len() / 16 * 16;
    let (body, tail) = row.split_at_mut(whole);
    let ptr = body.as_mut_ptr();
    // SAFETY: `body` holds `whole` floats.
    let inv = unsafe {
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for c in (0..whole).step_by(16) {
            m = _mm512_max_ps(m, _mm512_loadu_ps(ptr.add(c)));
        }
        let max = tail.iter().copied().fold(_mm512_reduce_max_ps(m), f32::max);
        let (mv, mut acc) = (_mm512_set1_ps(max), _mm512_setzero_ps());
        for c in (0..whole).step_by(16) {
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(ptr.add(c)), mv));
            _mm512_storeu_ps(ptr.add(c), e);
            acc = _mm512_add_ps(acc, e);
        }
        let lanes = std::mem::transmute::<__m512, [f32; 16]>(acc);
        let inv = 1.0 / super::super::sum_with_tail(lanes, tail, max);
        let iv = _mm512_set1_ps(inv);
        for c in (0..whole).step_by(16) {
            _mm512_storeu_ps(ptr.add(c), _mm512_mul_ps(_mm512_loadu_ps(ptr.add(c)), iv));
        }
        inv
    };
    for s in tail {
        *s *= inv;
    }
}

/// `out = fma(w_p, v_p, out)` over `len` positions for `G` heads at once (each value read
/// once for them), [`VALUE_COLS`] columns of each, the outputs in registers.
///
/// # Safety
/// AVX-512 F; `G` rows of `len` weights `stride` apart at `w`, `len` values `H` apart at
/// `values`, `G` heads of outputs `H` apart at `out`, each with [`VALUE_COLS`] columns.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn values512<const G: usize, const H: usize>(
    w: *const f32,
    stride: usize,
    values: *const f32,
    len: usize,
    out: *mut f32,
) {
    const CH: usize = VALUE_COLS / 16;
    // SAFETY: the caller's contract.
    unsafe {
        let mut acc: [[__m512; CH]; G] = std::array::from_fn(|g| {
            std::array::from_fn(|c| _mm512_loadu_ps(out.add(g * H + 16 * c)))
        });
        for p in 0..len {
            let v: [__m512; CH] =
                std::array::from_fn(|c| _mm512_loadu_ps(values.add(p * H + 16 * c)));
            for (g, head) in acc.iter_mut().enumerate() {
                let wg = _mm512_set1_ps(*w.add(g * stride + p));
                for (a, vc) in head.iter_mut().zip(&v) {
                    *a = _mm512_fmadd_ps(wg, *vc, *a);
                }
            }
        }
        for (g, head) in acc.iter().enumerate() {
            for (c, a) in head.iter().enumerate() {
                _mm512_storeu_ps(out.add(g * H + 16 * c), *a);
            }
        }
    }
}
