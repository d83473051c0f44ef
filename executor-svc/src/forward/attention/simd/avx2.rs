//! The AVX2 + FMA pieces of the tiled attention ([`super::Arch`]): eight positions scored
//! together, one head's output kept in registers across a chunk of values, and
//! [`super::super::exp`], the softmax and the MLP's gating ([`silu_mul8`]) eight lanes at a
//! time, each the same operations per lane as the portable definition, so the same bits.
//!
//! `unsafe`: AVX2 intrinsics behind `#[target_feature]`, reached only through
//! [`super::attend`] and [`super::super::silu_mul_row`] with the instruction set detected
//! at run time (each function states what it reads and writes).

use std::arch::x86_64::{
    __m256, _mm256_add_epi32, _mm256_add_ps, _mm256_andnot_ps, _mm256_castps256_ps128,
    _mm256_castsi256_ps, _mm256_cmp_ps, _mm256_cvtph_ps, _mm256_cvtps_epi32, _mm256_div_ps,
    _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_max_ps, _mm256_min_ps,
    _mm256_mul_ps, _mm256_permute2f128_ps, _mm256_round_ps, _mm256_set1_epi32, _mm256_set1_ps,
    _mm256_setzero_ps, _mm256_shuffle_ps, _mm256_slli_epi32, _mm256_storeu_ps, _mm256_sub_ps,
    _mm_loadu_si128, _mm_max_ps, _CMP_LT_OQ,
};

use super::super::{
    AttnScratch, Elem, Heads, KvRun, EXP_FLOOR, EXP_P, LN2_HI, LN2_LO, LOG2E, SILU_EXP_MAX,
};
use super::{reduce8, tiled, Arch, NEAREST, VALUE_COLS};

/// The AVX2 pieces.
struct Avx2;

/// The AVX2 entry point.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn avx2<'a, T: Elem>(
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
            64 => tiled::<T, Avx2, 64>(heads, q, n_ctx, run, scratch, out),
            128 => tiled::<T, Avx2, 128>(heads, q, n_ctx, run, scratch, out),
            _ => tiled::<T, Avx2, 256>(heads, q, n_ctx, run, scratch, out),
        }
    }
}

impl Arch for Avx2 {
    const W: usize = 8;
    const HEADS: usize = 1;

    #[allow(clippy::inline_always)]
    #[inline(always)]
    unsafe fn dots<const H: usize>(q: *const f32, keys: *const f32, scale: f32, out: *mut f32) {
        // SAFETY: the trait's contract; AVX2 in the caller.
        unsafe {
            _mm256_storeu_ps(out, _mm256_mul_ps(dots8::<H>(q, keys), _mm256_set1_ps(scale)));
        }
    }

    #[allow(clippy::inline_always)]
    #[inline(always)]
    unsafe fn dot<const H: usize>(q: *const f32, key: *const f32) -> f32 {
        // SAFETY: as above.
        unsafe { reduce8(halves::<H>(q, key)) }
    }

    #[allow(clippy::inline_always)]
    #[inline(always)]
    unsafe fn convert<const H: usize, T: Elem>(src: *const T, dst: *mut f32) {
        // SAFETY: as above.
        unsafe { convert256::<H, T>(src, dst) }
    }

    #[allow(clippy::inline_always)]
    #[inline(always)]
    unsafe fn softmax(row: &mut [f32]) {
        // SAFETY: as above.
        unsafe { softmax256(row) }
    }

    #[allow(clippy::inline_always)]
    #[inline(always)]
    unsafe fn values<const H: usize>(
        _n: usize,
        w: *const f32,
        _stride: usize,
        values: *const f32,
        len: usize,
        out: *mut f32,
    ) {
        // SAFETY: as above.
        unsafe { values256::<H>(w, values, len, out) }
    }
}

/// `H` cached elements as f32.
///
/// # Safety
/// AVX2 + F16C; `src` reads and `dst` takes `H` elements.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn convert256<const H: usize, T: Elem>(src: *const T, dst: *mut f32) {
    // SAFETY: the caller's contract.
    unsafe {
        for c in 0..H / 8 {
            let v = if T::F16 {
                _mm256_cvtph_ps(_mm_loadu_si128(src.add(8 * c).cast()))
            } else {
                _mm256_loadu_ps(src.add(8 * c).cast())
            };
            _mm256_storeu_ps(dst.add(8 * c), v);
        }
    }
}

/// One position's sixteen running sums with `q` (two registers: lanes 0-7 and 8-15),
/// added as `l + (l + 8)`: the first step of [`super::super::reduce16`].
///
/// # Safety
/// AVX2 + FMA; both pointers read `H` floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn halves<const H: usize>(q: *const f32, key: *const f32) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for c in 0..H / 16 {
            let (qc, kc) = (q.add(16 * c), key.add(16 * c));
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(qc), _mm256_loadu_ps(kc), lo);
            hi = _mm256_fmadd_ps(_mm256_loadu_ps(qc.add(8)), _mm256_loadu_ps(kc.add(8)), hi);
        }
        _mm256_add_ps(lo, hi)
    }
}

/// Eight consecutive keys' dot products with `q`, each as [`super::super::dot`] computes it, in
/// position order: [`halves`], then `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))` by shuffles.
///
/// # Safety
/// AVX2 + FMA; `q` reads `H` floats, `keys` 8 keys of `H`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots8<const H: usize>(q: *const f32, keys: *const f32) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        let a: [__m256; 8] = std::array::from_fn(|p| halves::<H>(q, keys.add(p * H)));
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

/// [`super::super::exp`] of each lane.
///
/// # Safety
/// AVX2 + FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8(x: __m256) -> __m256 {
    let n = _mm256_round_ps::<NEAREST>(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)));
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_P[0]);
    for &c in &EXP_P[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
    let bits = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    let y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(bits)));
    let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_FLOOR));
    _mm256_andnot_ps(below, y)
}

/// [`super::super::silu_mul_row`] over the row's whole groups of eight; returns how many
/// elements it wrote (the rest are the caller's).
///
/// # Safety
/// AVX2 + FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn silu_mul8(gate: &[f32], up: &[f32], dst: &mut [f32]) -> usize {
    let whole = dst.len().min(gate.len()).min(up.len()) / 8 * 8;
    let (one, cap) = (_mm256_set1_ps(1.0), _mm256_set1_ps(SILU_EXP_MAX));
    for i in (0..whole).step_by(8) {
        // SAFETY: `i + 8 ≤ whole`, within each slice.
        unsafe {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let u = _mm256_loadu_ps(up.as_ptr().add(i));
            let e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), cap));
            let s = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), s);
        }
    }
    whole
}

/// [`super::super::softmax`], sixteen lanes at a time in two registers.
///
/// # Safety
/// AVX2 + FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax256(row: &mut [f32]) {
    let whole = row.len() / 16 * 16;
    let (body, tail) = row.split_at_mut(whole);
    let ptr = body.as_mut_ptr();
    // SAFETY: `body` holds `whole` floats.
    let inv = unsafe {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        for c in (0..whole).step_by(8) {
            m = _mm256_max_ps(m, _mm256_loadu_ps(ptr.add(c)));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m4: [f32; 4] = std::mem::transmute(m4);
        let max = m4.into_iter().chain(tail.iter().copied()).fold(f32::NEG_INFINITY, f32::max);
        let mv = _mm256_set1_ps(max);
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for c in (0..whole).step_by(16) {
            let e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(ptr.add(c)), mv));
            let e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(ptr.add(c + 8)), mv));
            _mm256_storeu_ps(ptr.add(c), e0);
            _mm256_storeu_ps(ptr.add(c + 8), e1);
            lo = _mm256_add_ps(lo, e0);
            hi = _mm256_add_ps(hi, e1);
        }
        let lanes: [f32; 16] = std::mem::transmute([lo, hi]);
        let inv = 1.0 / super::super::sum_with_tail(lanes, tail, max);
        let iv = _mm256_set1_ps(inv);
        for c in (0..whole).step_by(8) {
            _mm256_storeu_ps(ptr.add(c), _mm256_mul_ps(_mm256_loadu_ps(ptr.add(c)), iv));
        }
        inv
    };
    for s in tail {
        *s *= inv;
    }
}

/// `out = fma(w_p, v_p, out)` over `len` positions for one head's [`VALUE_COLS`] columns,
/// the output in registers.
///
/// # Safety
/// AVX2 + FMA; `len` weights at `w`, `len` values `H` apart at `values`, [`VALUE_COLS`]
/// outputs at `out`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn values256<const H: usize>(w: *const f32, values: *const f32, len: usize, out: *mut f32) {
    const CH: usize = VALUE_COLS / 8;
    // SAFETY: the caller's contract.
    unsafe {
        let mut acc: [__m256; CH] = std::array::from_fn(|c| _mm256_loadu_ps(out.add(8 * c)));
        for p in 0..len {
            let wp = _mm256_set1_ps(*w.add(p));
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(wp, _mm256_loadu_ps(values.add(p * H + 8 * c)), *a);
            }
        }
        for (c, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(8 * c), *a);
        }
    }
}
