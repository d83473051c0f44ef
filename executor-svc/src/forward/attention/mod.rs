//! Causal attention over the paged KV cache, a tile of query tokens at a time.
//!
//! Each head's result is defined by one fixed sequence of operations (see [`attend`]), which
//! every path follows: the portable loop (the definition, and the reference forward's), and
//! the AVX-512 and AVX2 kernels, which compute a tile of up to [`TILE`] consecutive query
//! tokens together — one or more KV heads' query heads for each of them — reading each cached
//! key and value once per tile (converted to f32 once, into an L1-sized chunk every row of the
//! tile then reads) instead of once per query token. So a prefill's attention and a decode's give
//! the same bits as the reference forward, whatever the tiling or the instruction set.
//!
//! This file is the portable definition and what every path shares (the dot product's order,
//! [`exp`], the softmax, the MLP's gating beside them); `simd` holds the tiled loop and its
//! dispatch, `simd/avx512.rs` and `simd/avx2.rs` each one instruction set's pieces.

#[cfg(target_arch = "x86_64")]
mod simd;

/// Query tokens the serving forward gives [`attend`] at a time (a prefill's tokens of one
/// sequence, in order): each cached key and value is read once for all of them.
pub const TILE: usize = 16;

/// Cached positions converted to f32 together, per KV head (16 KiB for heads of 64: with one
/// KV head they stay in L1 while the tile's rows use them).
const CHUNK: usize = 64;

/// Lanes of the attention dot product and sums: element `i` goes to lane `i % 16`.
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

/// The sum of `xs` in [`dot`]'s order: sixteen running sums, reduced as [`reduce16`], the
/// elements past the last whole chunk added last.
#[inline]
fn sum16(xs: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = xs.len() / LANES;
    for c in 0..chunks {
        for l in 0..LANES {
            acc[l] += xs[c * LANES + l];
        }
    }
    let tail = xs[chunks * LANES..].iter().fold(0f32, |t, x| t + x);
    reduce16(&acc) + tail
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

/// `log2(e)`.
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` in two parts (Cody–Waite): `n · ln 2` is subtracted exactly enough.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// `exp(r) ≈ 1 + r + r² · P(r)` on `|r| ≤ ln 2 / 2` (Cephes' `expf`), highest degree first.
const EXP_P: [f32; 6] =
    [1.987_569_2e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];
/// Below this `exp` is taken as 0 (`e^-80 ≈ 1.8e-35`: no softmax weight beside the maximum's
/// 1 notices it).
const EXP_FLOOR: f32 = -80.0;

/// `eˣ` (within about 2 ulp), by one fixed sequence of operations the SIMD paths repeat lane
/// by lane: `n = round(x · log2 e)` (ties to even), `r = x − n · ln 2` in two fused steps,
/// Horner's rule in fused multiply-adds, times `2ⁿ` built from its bits; 0 below −80.
#[inline]
pub fn exp(x: f32) -> f32 {
    if x < EXP_FLOOR {
        return 0.0;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let p = EXP_P[1..].iter().fold(EXP_P[0], |p, &c| p.mul_add(r, c));
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Largest argument [`silu_mul_row`] gives [`exp`]: `e^88 ≈ 1.7e38` is still finite (from 89 on
/// `2ⁿ`'s bits would overflow), and a gate below −88 gives `g / (1 + e^88)`, within 1e-36 of
/// the true `g·eᵍ`: far below what the next product's rounding notices.
const SILU_EXP_MAX: f32 = 88.0;

/// `silu(g)·u = g / (1 + e^−g) · u` for each element of one row (`dst`, `gate` and `up` the
/// same length), with [`exp`] (its argument held at most [`SILU_EXP_MAX`]; below −80 it is 0,
/// so a large gate passes unchanged): the MLP's gating. The AVX2 path does the same operations
/// lane by lane, so the same bits; this sits beside the attention for the vector `exp` they
/// share (libm's `expf` one element at a time was 2 % of a loaded server's time, the whole
/// gating 4 %).
pub fn silu_mul_row(gate: &[f32], up: &[f32], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    let done = if simd::detect().is_some() {
        // SAFETY: the CPU has AVX2 and FMA (every detected kernel does).
        unsafe { simd::silu_mul8(gate, up, dst) }
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    silu_mul_portable(&gate[done..], &up[done..], &mut dst[done..]);
}

/// [`silu_mul_row`] one element at a time.
fn silu_mul_portable(gate: &[f32], up: &[f32], dst: &mut [f32]) {
    for ((d, &g), &u) in dst.iter_mut().zip(gate).zip(up) {
        *d = g / (1.0 + exp((-g).min(SILU_EXP_MAX))) * u;
    }
}

/// Turns a row of scores into softmax weights: `e_p = exp(s_p − max)`, then `e_p · (1 / Σ)`
/// with the sum in [`sum16`]'s order.
fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for s in row.iter_mut() {
        *s = exp(*s - max);
    }
    let inv = 1.0 / sum16(row);
    for s in row.iter_mut() {
        *s *= inv;
    }
}

/// The softmax's sum on the SIMD paths: `lanes` are [`sum16`]'s sixteen running sums over
/// the whole chunks; the scores past them (`tail`) become `exp(s − max)` here and are summed in
/// order, added last.
#[cfg(target_arch = "x86_64")]
fn sum_with_tail(lanes: [f32; LANES], tail: &mut [f32], max: f32) -> f32 {
    let mut t = 0f32;
    for s in tail.iter_mut() {
        *s = exp(*s - max);
        t += *s;
    }
    reduce16(&lanes) + t
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

/// The KV heads an [`attend`] call covers, the query heads that share each, and where the KV
/// heads' vectors are.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    /// Floats per head.
    pub hd: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// Offset of the first KV head's vectors in each cached position.
    pub lane: usize,
    /// KV heads, one after the other from `lane` (KV head `j`'s vectors at `lane + j · hd`).
    pub kv: usize,
    /// The scores' factor (`1 / √hd`).
    pub scale: f32,
    /// Positions a token attends to at most, its own included: the last `window` of its
    /// context (a sliding window; `usize::MAX` for none).
    pub window: usize,
    /// Scores soft-capped at this, `c · tanh(s / c)` after the scale (Gemma 2).
    pub softcap: Option<f32>,
}

impl Heads {
    /// Every head of layer `l` of a model of `shape`, from the first KV head: its head size,
    /// grouping, scale, window and soft cap.
    pub fn of_layer(shape: &ferry_model::LlamaShape, l: usize) -> Self {
        Self {
            hd: shape.head_dim,
            group: shape.num_heads / shape.num_kv_heads,
            lane: 0,
            kv: shape.num_kv_heads,
            scale: shape.query_scale,
            window: shape.layer_window(l),
            softcap: shape.attn_softcap,
        }
    }

    /// Query head `i` of `q` (counted across tokens): its token, and its KV head's lane.
    fn of(&self, i: usize) -> (usize, usize) {
        (i / (self.kv * self.group), self.lane + (i / self.group) % self.kv * self.hd)
    }
}

/// Buffers [`attend`] reuses from call to call.
#[derive(Debug, Default)]
pub struct AttnScratch {
    /// Each row's scores, then weights.
    scores: Vec<f32>,
    /// A chunk of keys or values as f32.
    chunk: Vec<f32>,
}

/// Causal attention of `tokens` consecutive query tokens over `n_ctx + tokens − 1` cached
/// positions: `q` holds each token's `heads.kv × heads.group` query heads (`hd` each; KV head
/// `j` serves the `j`-th `group` of them) one token after the other, token `t` attending to
/// the first `n_ctx + t` positions (the last `heads.window` of them with a sliding window); `out` (as long as `q`) gets, per head,
/// `softmax(q·Kᵀ · scale) · V`. `run(p)` gives the run of positions starting at `p` (a paged
/// cache: to the end of `p`'s block; a contiguous one: to the end), with the first KV head's
/// vectors at offset `heads.lane` of each position.
///
/// Each head's result is one fixed sequence of operations whatever the tile, the layout or
/// the instruction set: scores `dot(q, k_p) · scale` ([`dot`]), weights by [`softmax`] (its
/// own [`exp`]), then `out = fma(w_p, v_p, out)` per position in order from 0. So both
/// forwards, and every path, give the same bits.
pub fn attend<'a, T: Elem>(
    heads: Heads,
    q: &[f32],
    n_ctx: usize,
    run: impl Fn(usize) -> KvRun<'a, T>,
    scratch: &mut AttnScratch,
    out: &mut [f32],
) {
    debug_assert_eq!(q.len(), out.len());
    debug_assert!(n_ctx >= 1 && q.len().is_multiple_of(heads.kv * heads.group * heads.hd));
    #[cfg(target_arch = "x86_64")]
    {
        // The tiled kernels attend from position 0 and do not cap: where a window leaves
        // earlier positions out (a sliding-window model past its window), or scores are
        // capped, the portable path computes.
        let last = n_ctx + q.len() / (heads.kv * heads.group * heads.hd) - 1;
        let plain = last <= heads.window && heads.softcap.is_none();
        if simd::supports(heads.hd) && heads.group <= simd::MAX_HEADS && plain {
            if let Some(isa) = simd::detect() {
                // SAFETY: the instruction set was detected at run time.
                unsafe { simd::attend(isa, heads, q, n_ctx, run, scratch, out) };
                return;
            }
        }
    }
    attend_with(heads, q, n_ctx, run, out);
}

/// Calls `f(position, row)` for each position in `range` in order, where `row` is the
/// position's slice (keys or values, chosen by `pick`) from offset `lane` on. Always inlined:
/// its closure must fuse into the `#[target_feature]` caller for the intrinsics to inline.
#[allow(clippy::inline_always)]
#[inline(always)]
fn each_position<'a, T: Elem>(
    range: std::ops::Range<usize>,
    lane: usize,
    run: &impl Fn(usize) -> KvRun<'a, T>,
    pick: impl Fn(&KvRun<'a, T>) -> &'a [T],
    mut f: impl FnMut(usize, &'a [T]),
) {
    let mut p = range.start;
    while p < range.end {
        let r = run(p);
        let len = r.len.min(range.end - p).max(1);
        let rows = pick(&r);
        for i in 0..len {
            f(p + i, &rows[i * r.stride + lane..]);
        }
        p += len;
    }
}

/// The attention in plain Rust, one head of one token at a time: the definition the SIMD
/// paths follow.
fn attend_with<'a, T: Elem>(
    heads: Heads,
    q: &[f32],
    n_ctx: usize,
    run: impl Fn(usize) -> KvRun<'a, T>,
    out: &mut [f32],
) {
    let hd = heads.hd;
    let mut scores = Vec::new();
    for (i, (qh, oh)) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)).enumerate() {
        let (token, lane) = heads.of(i);
        let n = n_ctx + token;
        let first = n.saturating_sub(heads.window);
        scores.clear();
        each_position(
            first..n,
            lane,
            &run,
            |r| r.keys,
            |_, key| {
                let s = dot(qh, &key[..hd]) * heads.scale;
                scores.push(heads.softcap.map_or(s, |c| (s / c).tanh() * c));
            },
        );
        softmax(&mut scores);
        oh.fill(0.0);
        each_position(
            first..n,
            lane,
            &run,
            |r| r.values,
            |p, value| {
                for (o, v) in oh.iter_mut().zip(&value[..hd]) {
                    *o = scores[p - first].mul_add(v.f32(), *o);
                }
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator of values in [-2, 2).
    fn values(seed: &mut u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    /// The kernels this CPU runs, `None` being whatever `attend` picks.
    fn isas() -> Vec<Option<simd::Isa>> {
        #[allow(unused_mut)]
        let mut isas = vec![None];
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
        isas
    }

    /// Every kernel in `isas` on a tile of `tokens` tokens × `group` heads against the
    /// portable loop run one head of one token at a time (the reference forward's way).
    #[allow(clippy::too_many_arguments)]
    fn check<'a, T: Elem>(
        isas: &[Option<simd::Isa>],
        q: &[f32],
        heads: Heads,
        n_ctx: usize,
        run: impl Fn(usize) -> KvRun<'a, T> + Copy,
        what: &str,
    ) {
        let hd = heads.hd;
        let mut plain = vec![0f32; q.len()];
        for (i, (qh, oh)) in q.chunks_exact(hd).zip(plain.chunks_exact_mut(hd)).enumerate() {
            let (token, lane) = heads.of(i);
            let one = Heads { group: 1, kv: 1, lane, ..heads };
            attend_with(one, qh, n_ctx + token, run, oh);
        }
        let mut scratch = AttnScratch::default();
        for isa in isas {
            let mut fast = vec![f32::NAN; q.len()];
            match isa {
                None => attend(heads, q, n_ctx, run, &mut scratch, &mut fast),
                #[cfg(target_arch = "x86_64")]
                Some(isa) if simd::supports(hd) => unsafe {
                    // SAFETY: only the instruction sets this CPU has are listed.
                    simd::attend(*isa, heads, q, n_ctx, run, &mut scratch, &mut fast);
                },
                Some(_) => continue,
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&fast),
                bits(&plain),
                "{isa:?}, {what}: head {hd}, {} KV heads of group {}, {} tokens from context \
                 {n_ctx}",
                heads.kv,
                heads.group,
                q.len() / hd / heads.group / heads.kv,
            );
        }
    }

    /// Every SIMD attention this CPU runs gives the portable loop's bits, head by head and
    /// token by token: for tiles of 1 to 17 tokens, contexts that are and are not multiples
    /// of 8, 16 and the 64-position chunks, over runs of uneven lengths, for groups of 1 to
    /// 4 heads of one KV head and groups of 1 and 3 of two KV heads at once, over f32 and f16
    /// keys and values, for heads of 64, 128 and 256, and for a head size without the
    /// specialised path.
    #[test]
    fn simd_attention_matches_the_portable_loop_bit_for_bit() {
        let mut seed = 17u64;
        let isas = isas();
        assert!(
            isas.len() > 1 || !cfg!(target_arch = "x86_64") || !is_x86_feature_detected!("fma")
        );
        for hd in [64, 128, 256, 48] {
            let (stride, lane, positions) = (3 * hd, hd, 160);
            // Room for two KV heads from the lane (and a query for each).
            let keys = values(&mut seed, positions * stride);
            let vals = values(&mut seed, positions * stride);
            let q = values(&mut seed, 17 * 2 * 4 * hd);
            // Runs end at multiples of 5, like blocks of 5 positions.
            let run = |p: usize| KvRun {
                keys: &keys[p * stride..],
                values: &vals[p * stride..],
                stride,
                len: 5 - p % 5,
            };
            // The same values as f16 bits (what an f16 cache holds).
            let bits = |v: &[f32]| -> Vec<u16> {
                v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect()
            };
            let (keys16, values16) = (bits(&keys), bits(&vals));
            let run16 = |p: usize| KvRun {
                keys: &keys16[p * stride..],
                values: &values16[p * stride..],
                stride,
                len: 5 - p % 5,
            };
            for (group, kv) in (1..=4).map(|g| (g, 1)).chain([(1, 2), (3, 2)]) {
                let heads =
                    Heads { hd, group, lane, kv, scale: 0.125, window: usize::MAX, softcap: None };
                for (tokens, n_ctx) in
                    [(1, 1), (1, 7), (1, 16), (1, 17), (1, 64), (1, 65), (1, 143)]
                        .into_iter()
                        .chain([(2, 1), (3, 8), (5, 15), (16, 1), (16, 49), (17, 60), (9, 120)])
                {
                    let q = &q[..tokens * kv * group * hd];
                    check(&isas, q, heads, n_ctx, run, "f32");
                    check(&isas, q, heads, n_ctx, run16, "f16");
                }
            }
        }
    }

    /// A sliding window of `w` positions: each token's result is the unwindowed attention over
    /// its last `w` positions alone (bit for bit), for single tokens and tiles, windows that
    /// do and do not cut (where they do, the result differs from attending to everything).
    #[test]
    fn a_sliding_window_attends_to_the_last_positions_alone() {
        let mut seed = 23u64;
        for hd in [64, 128, 256, 48] {
            let (stride, positions) = (hd, 120);
            let keys = values(&mut seed, positions * stride);
            let vals = values(&mut seed, positions * stride);
            let q = values(&mut seed, 9 * 2 * hd);
            let from = |first: usize| {
                let (keys, vals) = (&keys, &vals);
                move |p: usize| KvRun {
                    keys: &keys[(first + p) * stride..],
                    values: &vals[(first + p) * stride..],
                    stride,
                    len: 7 - (first + p) % 7,
                }
            };
            let all = Heads {
                hd,
                group: 2,
                lane: 0,
                kv: 1,
                scale: 0.125,
                window: usize::MAX,
                softcap: None,
            };
            let mut scratch = AttnScratch::default();
            let mut cut = 0;
            for (window, tokens, n_ctx) in [(8, 1, 30), (8, 9, 30), (50, 9, 20), (16, 4, 13)] {
                let heads = Heads { window, ..all };
                let q = &q[..tokens * 2 * hd];
                let mut got = vec![f32::NAN; q.len()];
                attend(heads, q, n_ctx, from(0), &mut scratch, &mut got);
                let mut everything = vec![f32::NAN; q.len()];
                attend(all, q, n_ctx, from(0), &mut scratch, &mut everything);
                for t in 0..tokens {
                    let n = n_ctx + t;
                    let first = n.saturating_sub(window);
                    let row = t * 2 * hd..(t + 1) * 2 * hd;
                    let mut want = vec![f32::NAN; 2 * hd];
                    attend(all, &q[row.clone()], n - first, from(first), &mut scratch, &mut want);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got[row.clone()]), bits(&want), "window {window}, token {t}");
                    if first > 0 {
                        assert_ne!(got[row.clone()], everything[row], "window {window}, {t}");
                        cut += 1;
                    } else {
                        assert_eq!(bits(&got[row.clone()]), bits(&everything[row]));
                    }
                }
            }
            assert!(cut >= 10, "the windows cut {cut} tokens' contexts");
        }
    }

    /// The dot product is within f32 rounding of the exact one; `exp` within 2 ulp of the
    /// f64 exponential over the softmax's range and 0 below −80; softmax weights sum to 1.
    #[test]
    fn dot_and_exp_are_accurate() {
        let mut seed = 5u64;
        let (a, b) = (values(&mut seed, 64), values(&mut seed, 64));
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
        let size: f64 = a.iter().zip(&b).map(|(x, y)| f64::from((x * y).abs())).sum();
        assert!((f64::from(dot(&a, &b)) - exact).abs() < 1e-6 * size);
        let mut worst = 0f64;
        let mut x = -80.0f32;
        while x <= 0.0 {
            let (got, want) = (f64::from(exp(x)), f64::from(x).exp());
            let ulp = f64::from(f32::EPSILON) * want.abs().max(f64::from(f32::MIN_POSITIVE));
            worst = worst.max((got - want).abs() / ulp);
            x += 0.001_37;
        }
        assert!(worst <= 2.0, "exp is {worst} ulp off");
        assert_eq!((exp(-80.5), exp(f32::NEG_INFINITY), exp(0.0)), (0.0, 0.0, 1.0));
        // Softmax weights sum to 1.
        for len in [1, 15, 16, 17, 40, 100] {
            let mut row: Vec<f32> = values(&mut seed, len).iter().map(|v| v * 30.0).collect();
            softmax(&mut row);
            let total: f32 = row.iter().sum();
            assert!((total - 1.0).abs() < 1e-5, "weights sum to {total}");
        }
    }

    /// The MLP's gating: the vector path gives the portable path's bits on rows of every
    /// length (whole groups of eight and a tail), gates from −200 to 200 included, and each
    /// element is within 4 ulp of the f64 `g / (1 + e^−g) · u` (the true value, not the 1e-36
    /// the cap leaves, below −88).
    #[test]
    fn silu_gating_is_accurate_and_the_same_on_every_path() {
        let mut seed = 9u64;
        for len in [1, 7, 8, 9, 31, 1536] {
            let mut gate: Vec<f32> = values(&mut seed, len).iter().map(|v| v * 12.0).collect();
            let up = values(&mut seed, len);
            gate[0] = if len % 2 == 0 { 200.0 } else { -200.0 };
            let (mut fast, mut slow) = (vec![0f32; len], vec![0f32; len]);
            silu_mul_row(&gate, &up, &mut fast);
            silu_mul_portable(&gate, &up, &mut slow);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&slow), "row of {len}");
            for ((&g, &u), &got) in gate.iter().zip(&up).zip(&fast) {
                let want = f64::from(g) / (1.0 + (-f64::from(g)).exp()) * f64::from(u);
                let ulp = f64::from(f32::EPSILON) * want.abs();
                assert!(
                    (f64::from(got) - want).abs() <= 4.0 * ulp || g < -88.0 && got.abs() < 1e-35,
                    "silu({g})·{u} = {got}, not {want}"
                );
            }
        }
    }
}
