//! The AVX2 + FMA block dot product (x86-64, detected at run time). Integer products with
//! `maddubs`/`madd` give eight lane sums per block (lane `j` = elements `4j..4j+4`); the float
//! accumulation per lane is one fused multiply-add, as in the portable path.

use std::arch::x86_64::*;

use super::{reduce_lanes, QActs, QWeight, WeightFormat, BLOCK};

/// Whether this CPU can run the kernels here.
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// One output element: row `r` of `x` against weight row `o`.
///
/// # Safety
/// The CPU must support AVX2 and FMA ([`available`]).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot(x: &QActs, r: usize, w: &QWeight, o: usize) -> f32 {
    let bpr = w.cols / BLOCK;
    let mut acc = _mm256_setzero_ps();
    let mut acc_min = 0f32;
    let ones = _mm256_set1_epi16(1);
    let low = _mm_set1_epi8(0x0F);
    for b in 0..bpr {
        let (xb, wb) = (r * bpr + b, o * bpr + b);
        // SAFETY: block indices are in range by construction of QActs / QWeight.
        let xv = unsafe { _mm256_loadu_si256(x.q.as_ptr().add(xb * BLOCK).cast()) };
        let dd = _mm256_set1_ps(w.d[wb] * x.d[xb]);
        let p16 = match w.format {
            WeightFormat::Q4 => {
                let packed = unsafe { _mm_loadu_si128(w.q.as_ptr().add(wb * 16).cast()) };
                let lo = _mm_and_si128(packed, low);
                let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
                let wv = _mm256_set_m128i(hi, lo);
                acc_min = w.m[wb].mul_add(x.s[xb], acc_min);
                _mm256_maddubs_epi16(wv, xv)
            }
            WeightFormat::Q8 => {
                let wv = unsafe { _mm256_loadu_si256(w.q.as_ptr().add(wb * 32).cast()) };
                // maddubs wants one unsigned operand: |w| times x with w's sign.
                _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv))
            }
        };
        let p32 = _mm256_madd_epi16(p16, ones);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), dd, acc);
    }
    let mut lanes = [0f32; 8];
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    reduce_lanes(lanes) + acc_min
}
