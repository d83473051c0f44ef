//! The x86-64 kernels, chosen at run time: AVX-512 VNNI (`vpdpbusd`, on 256-bit registers) where
//! the CPU has it, else AVX2 (`maddubs` + `madd`). Both produce the same eight integer lane sums
//! per block (lane `j` = elements `4j..4j+4`) as the portable path, and the float accumulation
//! per lane is one fused multiply-add by `d_w · d_x`, so all three give identical results.
//!
//! Tiles of `R` rows × `C` columns share each loaded weight block across rows and each
//! activation block across columns; the operations per output element do not depend on the
//! tile, so tiling changes speed, never results.

use std::arch::x86_64::*;

use super::{reduce_lanes, OutPtr, QActs, QWeight, WeightFormat, BLOCK};

/// Which x86 kernel the CPU can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX2 + FMA.
    Avx2,
    /// AVX2 + FMA + AVX-512 VNNI/VL.
    Vnni,
}

/// The best kernel this CPU supports, if any.
pub fn detect() -> Option<Isa> {
    static ISA: std::sync::OnceLock<Option<Isa>> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return None;
        }
        if std::env::var_os("FERRY_NO_VNNI").is_none()
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl")
        {
            Some(Isa::Vnni)
        } else {
            Some(Isa::Avx2)
        }
    })
}

/// Computes columns `cols` of every row with the kernel for `isa`.
///
/// # Safety
/// `isa` must have been detected on this CPU; `out` as in `super::matmul_cols`.
pub unsafe fn matmul_cols(
    isa: Isa,
    x: &QActs,
    w: &QWeight,
    cols: std::ops::Range<usize>,
    out: OutPtr,
) {
    let q8 = w.format == WeightFormat::Q8;
    unsafe {
        match (isa, q8) {
            (Isa::Vnni, false) => tiles::<true, false>(x, w, cols, out),
            (Isa::Vnni, true) => tiles::<true, true>(x, w, cols, out),
            (Isa::Avx2, false) => tiles::<false, false>(x, w, cols, out),
            (Isa::Avx2, true) => tiles::<false, true>(x, w, cols, out),
        }
    }
}

/// Walks `cols` × rows in tiles: 4 rows × 2 columns, or 1 row × 4 columns for a single row.
#[inline(always)]
unsafe fn tiles<const VNNI: bool, const Q8: bool>(
    x: &QActs,
    w: &QWeight,
    cols: std::ops::Range<usize>,
    out: OutPtr,
) {
    unsafe {
        if x.rows == 1 {
            let mut c = cols.start;
            while c + 4 <= cols.end {
                tile::<VNNI, Q8, 1, 4>(x, 0, w, c, out);
                c += 4;
            }
            while c < cols.end {
                tile::<VNNI, Q8, 1, 1>(x, 0, w, c, out);
                c += 1;
            }
            return;
        }
        let mut r = 0;
        // With AVX-512's 32 vector registers, 8 rows × 2 columns (16 accumulators) share each
        // loaded weight block across twice as many rows (prefill ~15 % faster, measured).
        if VNNI {
            while x.rows - r >= 8 {
                let mut c = cols.start;
                while c + 2 <= cols.end {
                    tile::<VNNI, Q8, 8, 2>(x, r, w, c, out);
                    c += 2;
                }
                if c < cols.end {
                    tile::<VNNI, Q8, 8, 1>(x, r, w, c, out);
                }
                r += 8;
            }
        }
        while r < x.rows {
            let rows = (x.rows - r).min(4);
            let mut c = cols.start;
            while c < cols.end {
                let two = c + 2 <= cols.end;
                match (rows, two) {
                    (4, true) => tile::<VNNI, Q8, 4, 2>(x, r, w, c, out),
                    (3, true) => tile::<VNNI, Q8, 3, 2>(x, r, w, c, out),
                    (2, true) => tile::<VNNI, Q8, 2, 2>(x, r, w, c, out),
                    (1, true) => tile::<VNNI, Q8, 1, 2>(x, r, w, c, out),
                    (4, false) => tile::<VNNI, Q8, 4, 1>(x, r, w, c, out),
                    (3, false) => tile::<VNNI, Q8, 3, 1>(x, r, w, c, out),
                    (2, false) => tile::<VNNI, Q8, 2, 1>(x, r, w, c, out),
                    _ => tile::<VNNI, Q8, 1, 1>(x, r, w, c, out),
                }
                c += if two { 2 } else { 1 };
            }
            r += rows;
        }
    }
}

/// Dispatches one tile to the function compiled for the instruction set.
#[inline(always)]
unsafe fn tile<const VNNI: bool, const Q8: bool, const R: usize, const C: usize>(
    x: &QActs,
    r0: usize,
    w: &QWeight,
    c0: usize,
    out: OutPtr,
) {
    unsafe {
        if VNNI {
            tile_vnni::<Q8, R, C>(x, r0, w, c0, out)
        } else {
            tile_avx2::<Q8, R, C>(x, r0, w, c0, out)
        }
    }
}

/// Loads weight block `wb` as 32 bytes: Q4 codes unpacked to 0..15, Q8 codes as they are.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load_weights<const Q8: bool>(p: *const u8) -> __m256i {
    unsafe {
        if Q8 {
            _mm256_loadu_si256(p.cast())
        } else {
            let packed = _mm_loadu_si128(p.cast());
            let low = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(packed, low);
            let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
            _mm256_set_m128i(hi, lo)
        }
    }
}

macro_rules! tile_fn {
    ($name:ident, $features:literal, $int_dot:ident) => {
        #[target_feature(enable = $features)]
        unsafe fn $name<const Q8: bool, const R: usize, const C: usize>(
            x: &QActs,
            r0: usize,
            w: &QWeight,
            c0: usize,
            out: OutPtr,
        ) {
            let bpr = w.cols / BLOCK;
            let wbytes = if Q8 { 32 } else { 16 };
            debug_assert!((c0 + C) * bpr <= w.d.len() && (r0 + R) * bpr <= x.d.len());
            // SAFETY (whole body): every pointer below stays inside the tile's rows and
            // columns, which the caller keeps within `x.rows` and `w.rows`. Rows and columns
            // are addressed from one base pointer each plus a stride, to keep registers free.
            unsafe {
                let wq = w.q.as_ptr().add(c0 * bpr * wbytes);
                let wd = w.d.as_ptr().add(c0 * bpr);
                let xq = x.q.as_ptr().add(r0 * bpr * BLOCK);
                let xd = x.d.as_ptr().add(r0 * bpr);
                let xl = x.lane_sums.as_ptr().add(r0 * bpr * 8);
                let mut acc = [[_mm256_setzero_ps(); C]; R];
                for b in 0..bpr {
                    let mut wv = [_mm256_setzero_si256(); C];
                    let mut dw = [_mm256_setzero_ps(); C];
                    for c in 0..C {
                        wv[c] = load_weights::<Q8>(wq.add((c * bpr + b) * wbytes));
                        dw[c] = _mm256_broadcast_ss(&*wd.add(c * bpr + b));
                    }
                    for r in 0..R {
                        let xv = _mm256_loadu_si256(xq.add((r * bpr + b) * BLOCK).cast());
                        let xs = if Q8 {
                            _mm256_loadu_si256(xl.add((r * bpr + b) * 8).cast())
                        } else {
                            _mm256_setzero_si256()
                        };
                        let dx = _mm256_broadcast_ss(&*xd.add(r * bpr + b));
                        for c in 0..C {
                            let p = $int_dot::<Q8>(wv[c], xv, xs);
                            acc[r][c] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(p),
                                _mm256_mul_ps(dw[c], dx),
                                acc[r][c],
                            );
                        }
                    }
                }
                // The Q4 minimum's share, Σ_b m·s, in eight lanes over blocks: plain multiply
                // then add, exactly as `super::min_term` does.
                let full = bpr / 8 * 8;
                for r in 0..R {
                    for c in 0..C {
                        let (row, col) = (r0 + r, c0 + c);
                        let mut lanes = [0f32; 8];
                        _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r][c]);
                        let mut min = 0.0;
                        if !Q8 {
                            let m = w.m.as_ptr().add(col * bpr);
                            let s = x.s.as_ptr().add(row * bpr);
                            let mut am = _mm256_setzero_ps();
                            let mut b = 0;
                            while b < full {
                                let prod = _mm256_mul_ps(
                                    _mm256_loadu_ps(m.add(b)),
                                    _mm256_loadu_ps(s.add(b)),
                                );
                                am = _mm256_add_ps(am, prod);
                                b += 8;
                            }
                            let mut ml = [0f32; 8];
                            _mm256_storeu_ps(ml.as_mut_ptr(), am);
                            for l in 0..bpr - full {
                                ml[l] += *m.add(full + l) * *s.add(full + l);
                            }
                            min = reduce_lanes(ml);
                        }
                        *out.0.add(row * w.rows + col) = reduce_lanes(lanes) + min;
                    }
                }
            }
        }
    };
}

/// Lane sums with `vpdpbusd`. Q8 weights are signed, so they are biased to unsigned
/// (`w + 128`) and `128 · Σx` per lane is taken back off: exact integer arithmetic.
#[inline]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
unsafe fn dot_vnni<const Q8: bool>(w: __m256i, x: __m256i, x_lane_sums: __m256i) -> __m256i {
    if Q8 {
        let biased = _mm256_xor_si256(w, _mm256_set1_epi8(i8::MIN));
        let raw = _mm256_dpbusd_epi32(_mm256_setzero_si256(), biased, x);
        _mm256_sub_epi32(raw, _mm256_slli_epi32(x_lane_sums, 7))
    } else {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
    }
}

/// Lane sums with `maddubs` + `madd`. For Q8, `maddubs` needs an unsigned operand: |w| times x
/// carrying w's sign (no saturation: 2 · 128 · 127 < 32768).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2<const Q8: bool>(w: __m256i, x: __m256i, _x_lane_sums: __m256i) -> __m256i {
    let p16 = if Q8 {
        _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
    } else {
        _mm256_maddubs_epi16(w, x)
    };
    _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
}

tile_fn!(tile_vnni, "avx2,fma,avx512vnni,avx512vl", dot_vnni);
tile_fn!(tile_avx2, "avx2,fma", dot_avx2);
