//! AVX-512: one register per group; fused tiles of one row × 64 columns or up to 8 rows × 32
//! (partial sums in registers; the accumulators, touched once per block, may spill), panel
//! tiles of 6 × 32 (12 partial sums + 12 accumulators).
//!
//! The primitives `kernels!` builds the AVX-512 kernels from. `unsafe`: AVX-512 intrinsics
//! behind `#[target_feature]`, run only after `detect` found the instruction set.

use std::arch::x86_64::{
    __m512, _mm256_loadu_si256, _mm512_castsi512_ps, _mm512_cvtepi32_ps, _mm512_cvtepi8_epi32,
    _mm512_cvtepu16_epi32, _mm512_cvtph_ps, _mm512_fmadd_ps, _mm512_load_ps, _mm512_loadu_ps,
    _mm512_loadu_si512, _mm512_mul_ps, _mm512_permutexvar_ps, _mm512_set1_ps, _mm512_setr_ps,
    _mm512_setzero_ps, _mm512_slli_epi32, _mm512_srai_epi32, _mm512_srli_epi32, _mm512_store_ps,
    _mm_loadu_si128,
};

use super::{
    kind, store_group, Line, OutPtr, QWeight, BLOCK, GROUP, PANEL, PANEL_BYTES, PANEL_ROWS_BYTES,
};

type V = __m512;

#[inline]
#[target_feature(enable = "avx512f")]
fn zero() -> V {
    _mm512_setzero_ps()
}

#[inline]
#[target_feature(enable = "avx512f")]
fn fma(a: V, b: V, c: V) -> V {
    _mm512_fmadd_ps(a, b, c)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn mul(a: V, b: V) -> V {
    _mm512_mul_ps(a, b)
}

/// Every lane `*p`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn splat(p: *const f32) -> V {
    // SAFETY: the caller's pointer is readable.
    _mm512_set1_ps(unsafe { *p })
}

/// 16 floats from a 64-byte aligned address.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load_line(p: *const f32) -> V {
    // SAFETY: the caller's pointer is aligned and readable.
    unsafe { _mm512_load_ps(p) }
}

#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store_line(p: *mut f32, v: V) {
    // SAFETY: the caller's pointer is aligned (a `Line`) and writable.
    unsafe { _mm512_store_ps(p, v) }
}

/// 16 f16 values.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn f16s(p: *const u16) -> V {
    // SAFETY: 16 values readable at `p`.
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
}

/// 16 bfloat16 values (each the top half of its f32).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bf16s(p: *const u16) -> V {
    // SAFETY: 16 values readable at `p`.
    let h = unsafe { _mm256_loadu_si256(p.cast()) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}

/// 16 signed bytes, as floats.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn i8s(p: *const i8) -> V {
    // SAFETY: 16 values readable at `p`.
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(p.cast()) }))
}

/// 16 f32 values.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn f32s(p: *const f32) -> V {
    // SAFETY: 16 values readable at `p`.
    unsafe { _mm512_loadu_ps(p) }
}

/// `0.0, 1.0, …, 15.0`: a nibble's float, by `vpermps` (which reads only an index's low
/// four bits, so the low nibble needs no mask).
#[inline]
#[target_feature(enable = "avx512f")]
fn nibble_floats() -> V {
    _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    )
}

/// Bits `S..S + 4` of 16 dwords, as floats (`vpermps` reads only an index's low four
/// bits, so no mask).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn nibble<const S: u32>(p: *const u8) -> V {
    // SAFETY: 64 bytes readable at `p`.
    let d = unsafe { _mm512_loadu_si512(p.cast()) };
    let d = if S == 0 { d } else { _mm512_srli_epi32::<S>(d) };
    _mm512_permutexvar_ps(d, nibble_floats())
}

/// The signed byte at bits `24 - L..32 - L` of 16 dwords, as floats.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn byte<const L: u32>(p: *const u8) -> V {
    // SAFETY: 64 bytes readable at `p`.
    let d = unsafe { _mm512_loadu_si512(p.cast()) };
    let d = if L == 0 { d } else { _mm512_slli_epi32::<L>(d) };
    _mm512_cvtepi32_ps(_mm512_srai_epi32::<24>(d))
}

kernels!("avx512f,avx2,fma,f16c", nv: 1, cg: 2, cg1: 4, fused: 8, tile: 6);
