//! AVX2: two registers per group; fused tiles of one row × 32 columns or up to 4 rows × 16
//! (partial sums in registers; the accumulators may spill), panel tiles of 6 × 16: twelve
//! partial sums in registers, enough independent chains to keep both FMA units busy (a 3 × 16
//! tile's six covered only three quarters of the latency: prefill products 1.1–1.2× faster at
//! 256 rows), the accumulators, touched once per block, in memory.
//!
//! The primitives `kernels!` builds the AVX2 kernels from. `unsafe`: AVX2 intrinsics behind
//! `#[target_feature]`, run only after `detect` found the instruction set.

use std::arch::x86_64::{
    __m256, _mm256_and_si256, _mm256_broadcastsi128_si256, _mm256_castsi256_ps, _mm256_cvtepi32_ps,
    _mm256_cvtepi8_epi32, _mm256_cvtepu16_epi32, _mm256_cvtph_ps, _mm256_fmadd_ps, _mm256_load_ps,
    _mm256_loadu_ps, _mm256_loadu_si256, _mm256_mul_ps, _mm256_set1_epi32, _mm256_set1_epi8,
    _mm256_set1_ps, _mm256_setzero_ps, _mm256_shuffle_epi8, _mm256_slli_epi32, _mm256_srai_epi32,
    _mm256_srli_epi32, _mm256_store_ps, _mm_loadl_epi64, _mm_loadu_si128, _mm_setr_epi32,
};

use super::{
    kind, store_group, Line, OutPtr, QWeight, BLOCK, GROUP, PANEL, PANEL_BYTES, PANEL_ROWS_BYTES,
};

type V = __m256;

#[inline]
#[target_feature(enable = "avx2,fma")]
fn zero() -> V {
    _mm256_setzero_ps()
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn fma(a: V, b: V, c: V) -> V {
    _mm256_fmadd_ps(a, b, c)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn mul(a: V, b: V) -> V {
    _mm256_mul_ps(a, b)
}

/// Every lane `*p`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn splat(p: *const f32) -> V {
    // SAFETY: the caller's pointer is readable.
    _mm256_set1_ps(unsafe { *p })
}

/// 8 floats from a 32-byte aligned address.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_line(p: *const f32) -> V {
    // SAFETY: the caller's pointer is aligned and readable.
    unsafe { _mm256_load_ps(p) }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn store_line(p: *mut f32, v: V) {
    // SAFETY: the caller's pointer is aligned and writable.
    unsafe { _mm256_store_ps(p, v) }
}

/// 8 f16 values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16s(p: *const u16) -> V {
    // SAFETY: 8 values readable at `p`.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
}

/// 8 bfloat16 values (each the top half of its f32).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn bf16s(p: *const u16) -> V {
    // SAFETY: 8 values readable at `p`.
    let h = unsafe { _mm_loadu_si128(p.cast()) };
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
}

/// 8 signed bytes, as floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn i8s(p: *const i8) -> V {
    // SAFETY: 8 values readable at `p`.
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(p.cast()) }))
}

/// 8 f32 values.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn f32s(p: *const f32) -> V {
    // SAFETY: 8 values readable at `p`.
    unsafe { _mm256_loadu_ps(p) }
}

/// Bits `S..S + 4` of 8 dwords, as floats. The bottom and top nibbles take one mask or one
/// shift; the others are picked by a byte shuffle from the dwords' low (`S % 8 == 0`) or
/// high nibbles, which the eight extractions of a load share: a shuffle runs beside the
/// fused multiply-adds (port 5) where a shift and a mask compete with them.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn nibble<const S: i32>(p: *const u8) -> V {
    // SAFETY: 32 bytes readable at `p`.
    let d = unsafe { _mm256_loadu_si256(p.cast()) };
    let q = match S {
        0 => _mm256_and_si256(d, _mm256_set1_epi32(0x0F)),
        28 => _mm256_srli_epi32::<28>(d),
        _ => {
            let nibbles = if S % 8 == 0 { d } else { _mm256_srli_epi32::<4>(d) };
            let low = _mm256_and_si256(nibbles, _mm256_set1_epi8(0x0F));
            // Byte `S / 8` of each dword to its bottom byte, zeros above (index 0x80).
            let pick = |dword: i32| (0x8080_8000_u32 as i32) | (4 * dword + S / 8);
            let lane = _mm_setr_epi32(pick(0), pick(1), pick(2), pick(3));
            let pick = _mm256_broadcastsi128_si256(lane);
            _mm256_shuffle_epi8(low, pick)
        }
    };
    _mm256_cvtepi32_ps(q)
}

/// The signed byte at bits `24 - L..32 - L` of 8 dwords, as floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn byte<const L: i32>(p: *const u8) -> V {
    // SAFETY: 32 bytes readable at `p`.
    let d = unsafe { _mm256_loadu_si256(p.cast()) };
    let d = if L == 0 { d } else { _mm256_slli_epi32::<L>(d) };
    _mm256_cvtepi32_ps(_mm256_srai_epi32::<24>(d))
}

kernels!("avx2,fma,f16c", nv: 2, cg: 1, cg1: 2, fused: 4, tile: 6);
