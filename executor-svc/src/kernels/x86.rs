//! The x86-64 kernels, chosen at run time: AVX-512 VNNI (`vpdpbusd`, on 256-bit registers) where
//! the CPU has it, else AVX2 (`maddubs` + `madd`). Both compute each block's exact integer dot
//! product for eight interleaved columns at once (one 32-bit lane per column), then scale and
//! accumulate all eight in one fused multiply-add, the same operations per output as the
//! portable path, so all three give identical results.
//!
//! Tiles of `R` rows × `CG` column groups share each loaded weight register across rows and
//! each broadcast activation across groups; the operations per output element do not depend on
//! the tile, so tiling changes speed, never results.

// See the kernels' module head for `inline(always)` and the views passed by value. Activation
// bytes are read four at a time as `[u8; 4]` (alignment 1, which a byte buffer always has) and
// turned into an `i32` lane value: one plain load, no alignment assumed.
#![allow(clippy::inline_always, clippy::needless_pass_by_value)]

use std::arch::x86_64::{
    __m256, __m256i, _mm256_abs_epi8, _mm256_add_epi32, _mm256_and_ps, _mm256_and_si256,
    _mm256_castps256_ps128, _mm256_castsi256_ps, _mm256_castsi256_si128, _mm256_cvtepi32_ps,
    _mm256_cvtph_ps, _mm256_cvtps_epi32, _mm256_div_ps, _mm256_dpbusd_epi32, _mm256_extractf128_ps,
    _mm256_extracti128_si256, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_loadu_si256,
    _mm256_madd_epi16, _mm256_maddubs_epi16, _mm256_max_ps, _mm256_min_ps, _mm256_mul_ps,
    _mm256_packs_epi16, _mm256_packs_epi32, _mm256_permutevar8x32_epi32, _mm256_round_ps,
    _mm256_set1_epi16, _mm256_set1_epi32, _mm256_set1_epi8, _mm256_set1_ps, _mm256_setr_epi32,
    _mm256_setzero_ps, _mm256_setzero_si256, _mm256_sign_epi8, _mm256_slli_epi32,
    _mm256_srli_epi16, _mm256_storeu_ps, _mm256_storeu_si256, _mm256_sub_epi32, _mm256_sub_ps,
    _mm256_xor_si256, _mm_add_epi32, _mm_cvtsi128_si32, _mm_cvtss_f32, _mm_loadu_si128, _mm_max_ps,
    _mm_max_ss, _mm_movehdup_ps, _mm_movehl_ps, _mm_shuffle_epi32, _MM_FROUND_NO_EXC,
    _MM_FROUND_TO_NEAREST_INT,
};

use super::{store_group, OutPtr, QActs, QBlocks, QWeight, WeightFormat, BLOCK, GROUP};

/// Which x86 kernel the CPU can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 + FMA + F16C + AVX-512 VNNI/VL.
    Vnni,
}

/// The best kernel this CPU supports, if any.
pub fn detect() -> Option<Isa> {
    static ISA: std::sync::OnceLock<Option<Isa>> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            return None;
        }
        if std::env::var_os("FERRY_NO_VNNI").is_none() && has_vnni() {
            Some(Isa::Vnni)
        } else {
            Some(Isa::Avx2)
        }
    })
}

/// Whether this CPU has AVX-512 VNNI with 256-bit forms.
pub fn has_vnni() -> bool {
    is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")
}

/// [`super::quantize_scalar`] in AVX2, the same operations lane by lane: `max|x|` (exact in
/// any order), `round(v · inv)` to nearest even, the clamp, `round(code / 255)`, integer
/// `lo` and sums.
///
/// # Safety
/// The CPU must support AVX2; `out` holds `x.len() / 32` blocks.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize(x: &[f32], out: QBlocks) {
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let (lim, base) = (_mm256_set1_ps(super::ACT_MAX), _mm256_set1_ps(255.0));
    // After the two packs, dwords hold elements [0-3, 8-11, 16-19, 24-27, 4-7, ...].
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (b, block) in x.chunks_exact(BLOCK).enumerate() {
        // SAFETY: `block` has 32 floats; block `b`'s 64 code bytes lie inside `out.q`.
        unsafe {
            let v: [__m256; 4] =
                std::array::from_fn(|i| _mm256_loadu_ps(block.as_ptr().add(8 * i)));
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
                _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
            );
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let d = amax / super::ACT_MAX;
            let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            let mut hi = [_mm256_setzero_si256(); 4];
            let mut lo = [_mm256_setzero_si256(); 4];
            let mut sum = _mm256_setzero_si256();
            for i in 0..4 {
                let code = _mm256_round_ps::<NEAREST>(_mm256_mul_ps(v[i], inv));
                let code = _mm256_min_ps(
                    _mm256_max_ps(code, _mm256_sub_ps(_mm256_setzero_ps(), lim)),
                    lim,
                );
                let high =
                    _mm256_cvtps_epi32(_mm256_round_ps::<NEAREST>(_mm256_div_ps(code, base)));
                let code = _mm256_cvtps_epi32(code);
                hi[i] = high;
                lo[i] = _mm256_sub_epi32(code, _mm256_sub_epi32(_mm256_slli_epi32(high, 8), high));
                sum = _mm256_add_epi32(sum, code);
            }
            let pack = |r: [__m256i; 4]| {
                let p = _mm256_packs_epi16(
                    _mm256_packs_epi32(r[0], r[1]),
                    _mm256_packs_epi32(r[2], r[3]),
                );
                _mm256_permutevar8x32_epi32(p, order)
            };
            let q = out.q.as_mut_ptr().add(b * 2 * BLOCK);
            _mm256_storeu_si256(q.cast(), pack(hi));
            _mm256_storeu_si256(q.add(BLOCK).cast(), pack(lo));
            let s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
            let s = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)));
            out.d[b] = d;
            out.s[b] = d * s as f32;
            out.bias[b] = 128 * s;
        }
    }
}

/// Computes the columns of groups `groups`, for every row, with the kernel for `isa`.
///
/// # Safety
/// `isa` must have been detected on this CPU; `out` as in `super::matmul_groups`.
pub unsafe fn matmul_groups(
    isa: Isa,
    x: &QActs,
    w: &QWeight,
    groups: std::ops::Range<usize>,
    out: OutPtr,
) {
    let q8 = w.format == WeightFormat::Q8;
    unsafe {
        match (isa, q8) {
            (Isa::Vnni, false) => tiles::<true, false>(x, w, groups, out),
            (Isa::Vnni, true) => tiles::<true, true>(x, w, groups, out),
            (Isa::Avx2, false) => tiles::<false, false>(x, w, groups, out),
            (Isa::Avx2, true) => tiles::<false, true>(x, w, groups, out),
        }
    }
}

/// Walks rows × groups in tiles: for a single row, four groups at a time (32 columns, eight
/// independent integer sums); for more rows, blocks of up to 8 rows (VNNI: 32 registers) or
/// 4 rows (AVX2: 16 registers) against one group.
#[inline(always)]
unsafe fn tiles<const VNNI: bool, const Q8: bool>(
    x: &QActs,
    w: &QWeight,
    groups: std::ops::Range<usize>,
    out: OutPtr,
) {
    unsafe {
        if x.rows == 1 {
            let mut g = groups.start;
            while g + 4 <= groups.end {
                tile::<VNNI, Q8, 1, 4>(x, 0, w, g, out);
                g += 4;
            }
            while g < groups.end {
                tile::<VNNI, Q8, 1, 1>(x, 0, w, g, out);
                g += 1;
            }
            return;
        }
        let max_rows = if VNNI { 8 } else { 4 };
        let mut r = 0;
        while r < x.rows {
            let rows = (x.rows - r).min(max_rows);
            for g in groups.clone() {
                match rows {
                    8 => tile::<VNNI, Q8, 8, 1>(x, r, w, g, out),
                    7 => tile::<VNNI, Q8, 7, 1>(x, r, w, g, out),
                    6 => tile::<VNNI, Q8, 6, 1>(x, r, w, g, out),
                    5 => tile::<VNNI, Q8, 5, 1>(x, r, w, g, out),
                    4 => tile::<VNNI, Q8, 4, 1>(x, r, w, g, out),
                    3 => tile::<VNNI, Q8, 3, 1>(x, r, w, g, out),
                    2 => tile::<VNNI, Q8, 2, 1>(x, r, w, g, out),
                    _ => tile::<VNNI, Q8, 1, 1>(x, r, w, g, out),
                }
            }
            r += rows;
        }
    }
}

/// Dispatches one tile to the function compiled for the instruction set.
#[inline(always)]
unsafe fn tile<const VNNI: bool, const Q8: bool, const R: usize, const CG: usize>(
    x: &QActs,
    r0: usize,
    w: &QWeight,
    g0: usize,
    out: OutPtr,
) {
    unsafe {
        if VNNI {
            tile_vnni::<Q8, R, CG>(x, r0, w, g0, out);
        } else {
            tile_avx2::<Q8, R, CG>(x, r0, w, g0, out);
        }
    }
}

macro_rules! tile_fn {
    ($name:ident, $features:literal, $prep:ident, $int_dot:ident, $unbias:expr) => {
        /// One tile: rows `r0 .. r0 + R` × column groups `g0 .. g0 + CG`.
        #[target_feature(enable = $features)]
        unsafe fn $name<const Q8: bool, const R: usize, const CG: usize>(
            x: &QActs,
            r0: usize,
            w: &QWeight,
            g0: usize,
            out: OutPtr,
        ) {
            let bpr = w.cols / BLOCK;
            let gbytes = GROUP * if Q8 { 32 } else { 16 };
            debug_assert!((g0 + CG) * bpr * GROUP <= w.d.len() && (r0 + R) * bpr <= x.d.len());
            // SAFETY (whole body): every pointer below stays inside the tile's rows and
            // groups, which the caller keeps within `x.rows` and the weight's groups.
            unsafe {
                let wq = w.q.as_ptr().add(g0 * bpr * gbytes);
                let wd = w.d.as_ptr().add(g0 * bpr * GROUP);
                let wm = w.m.as_ptr().wrapping_add(g0 * bpr * GROUP);
                // Per block of an activation row: 8 dwords of high bytes, then 8 of low bytes.
                let xq = x.q.as_ptr().add(r0 * bpr * 2 * BLOCK).cast::<[u8; 4]>();
                let xd = x.d.as_ptr().add(r0 * bpr);
                let xs = x.s.as_ptr().add(r0 * bpr);
                let xb = x.bias.as_ptr().add(r0 * bpr);
                let nibble = _mm256_set1_epi8(0x0F);
                let mut acc = [[_mm256_setzero_ps(); CG]; R];
                for b in 0..bpr {
                    // Integer sums against the high and the low activation bytes.
                    let mut hi = [[_mm256_setzero_si256(); CG]; R];
                    let mut lo = [[_mm256_setzero_si256(); CG]; R];
                    for t in 0..4 {
                        // Weight registers pairing with activation dwords `t` and `t + 4`.
                        let mut wa = [_mm256_setzero_si256(); CG];
                        let mut wb = [_mm256_setzero_si256(); CG];
                        for c in 0..CG {
                            let p = wq.add((c * bpr + b) * gbytes);
                            if Q8 {
                                wa[c] = $prep(_mm256_loadu_si256(p.add(32 * t).cast()));
                                wb[c] = $prep(_mm256_loadu_si256(p.add(32 * (t + 4)).cast()));
                            } else {
                                let packed = _mm256_loadu_si256(p.add(32 * t).cast());
                                wa[c] = _mm256_and_si256(packed, nibble);
                                wb[c] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
                            }
                        }
                        for r in 0..R {
                            let row = xq.add((r * bpr + b) * (2 * BLOCK / 4));
                            let ha = _mm256_set1_epi32(i32::from_ne_bytes(*row.add(t)));
                            let hb = _mm256_set1_epi32(i32::from_ne_bytes(*row.add(t + 4)));
                            let la = _mm256_set1_epi32(i32::from_ne_bytes(*row.add(t + 8)));
                            let lb = _mm256_set1_epi32(i32::from_ne_bytes(*row.add(t + 12)));
                            for c in 0..CG {
                                let h = $int_dot::<Q8>(hi[r][c], wa[c], ha);
                                hi[r][c] = $int_dot::<Q8>(h, wb[c], hb);
                                let l = $int_dot::<Q8>(lo[r][c], wa[c], la);
                                lo[r][c] = $int_dot::<Q8>(l, wb[c], lb);
                            }
                        }
                    }
                    let mut dw = [_mm256_setzero_ps(); CG];
                    let mut mw = [_mm256_setzero_ps(); CG];
                    for c in 0..CG {
                        dw[c] =
                            _mm256_cvtph_ps(_mm_loadu_si128(wd.add((c * bpr + b) * GROUP).cast()));
                        if !Q8 {
                            mw[c] = _mm256_cvtph_ps(_mm_loadu_si128(
                                wm.add((c * bpr + b) * GROUP).cast(),
                            ));
                        }
                    }
                    for r in 0..R {
                        let dx = _mm256_set1_ps(*xd.add(r * bpr + b));
                        for c in 0..CG {
                            // 255·hi + lo, exactly.
                            let h = hi[r][c];
                            let mut i = _mm256_add_epi32(
                                _mm256_sub_epi32(_mm256_slli_epi32(h, 8), h),
                                lo[r][c],
                            );
                            if Q8 && $unbias {
                                i = _mm256_sub_epi32(i, _mm256_set1_epi32(*xb.add(r * bpr + b)));
                            }
                            acc[r][c] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(i),
                                _mm256_mul_ps(dw[c], dx),
                                acc[r][c],
                            );
                            if !Q8 {
                                let s = _mm256_set1_ps(*xs.add(r * bpr + b));
                                acc[r][c] = _mm256_fmadd_ps(mw[c], s, acc[r][c]);
                            }
                        }
                    }
                }
                for r in 0..R {
                    for c in 0..CG {
                        let g = g0 + c;
                        if (g + 1) * GROUP <= w.rows {
                            let dst = out.0.add((r0 + r) * w.rows + g * GROUP);
                            _mm256_storeu_ps(dst, acc[r][c]);
                        } else {
                            let mut sums = [0f32; GROUP];
                            _mm256_storeu_ps(sums.as_mut_ptr(), acc[r][c]);
                            store_group(w, r0 + r, g, &sums, out);
                        }
                    }
                }
            }
        }
    };
}

/// VNNI takes Q8 codes as stored (`+128`, unsigned) and subtracts `128 · Σx` afterwards.
#[inline]
#[target_feature(enable = "avx2")]
fn keep(w: __m256i) -> __m256i {
    w
}

/// AVX2 turns Q8 codes back to signed bytes, for `maddubs`'s sign trick.
#[inline]
#[target_feature(enable = "avx2")]
fn to_signed(w: __m256i) -> __m256i {
    _mm256_xor_si256(w, _mm256_set1_epi8(i8::MIN))
}

/// `acc + Σ` of four byte products per lane with `vpdpbusd` (weights unsigned).
#[inline]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
fn dot_vnni<const Q8: bool>(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, w, x)
}

/// `acc + Σ` of four byte products per lane with `maddubs` + `madd`. For Q8 (signed weights),
/// `maddubs` needs an unsigned operand: |w| times x carrying w's sign (no saturation:
/// 2 · 128 · 127 < 32768).
#[inline]
#[target_feature(enable = "avx2")]
fn dot_avx2<const Q8: bool>(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    let p16 = if Q8 {
        _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
    } else {
        _mm256_maddubs_epi16(w, x)
    };
    _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)))
}

tile_fn!(tile_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", keep, dot_vnni, true);
tile_fn!(tile_avx2, "avx2,fma,f16c", to_signed, dot_avx2, false);
