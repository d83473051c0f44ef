//! Causal attention over the paged KV cache, a tile of query tokens at a time.
//!
//! Each head's result is defined by one fixed sequence of operations (see [`attend`]), which
//! every path follows: the portable loop (the definition, and the reference forward's), and
//! the AVX-512 and AVX2 kernels, which compute a tile of up to [`TILE`] consecutive query
//! tokens together — one or more KV heads' query heads for each of them — reading each cached
//! key and value once per tile (converted to f32 once, into an L1-sized chunk every row of the
//! tile then reads) instead of once per query token. So a prefill's attention and a decode's give
//! the same bits as the reference forward, whatever the tiling or the instruction set.

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
}

impl Heads {
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
/// the first `n_ctx + t` positions; `out` (as long as `q`) gets, per head,
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
    if heads.hd == simd::HD && heads.group <= simd::MAX_HEADS {
        if let Some(isa) = simd::detect() {
            // SAFETY: the instruction set was detected at run time.
            unsafe { simd::attend(isa, heads, q, n_ctx, run, scratch, out) };
            return;
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
        scores.clear();
        each_position(
            0..n,
            lane,
            &run,
            |r| r.keys,
            |_, key| {
                scores.push(dot(qh, &key[..hd]) * heads.scale);
            },
        );
        softmax(&mut scores);
        oh.fill(0.0);
        each_position(
            0..n,
            lane,
            &run,
            |r| r.values,
            |p, value| {
                for (o, v) in oh.iter_mut().zip(&value[..hd]) {
                    *o = scores[p].mul_add(v.f32(), *o);
                }
            },
        );
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    //! [`super::attend`] with AVX-512 or AVX2 + FMA, for heads of 64 (other sizes take the
    //! portable path): the same fused multiply-adds per lane as [`super::dot`], the same
    //! reduction trees, the same [`super::exp`] lane by lane, so the same bits.
    //!
    //! A tile's keys, then its values, are converted to f32 a chunk of positions at a time;
    //! every row (token × head) of the tile then reads the chunk from L1. Scores are computed
    //! 16 (AVX-512) or 8 (AVX2) positions at a time and reduced together with shuffles; the
    //! weighted sum of values keeps up to three heads' outputs (AVX-512; AVX2 one) in
    //! registers across a chunk.
    use std::arch::x86_64::{
        __m256, __m512, _mm256_add_epi32, _mm256_add_ps, _mm256_andnot_ps, _mm256_castps256_ps128,
        _mm256_castsi256_ps, _mm256_cmp_ps, _mm256_cvtph_ps, _mm256_cvtps_epi32, _mm256_div_ps,
        _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_max_ps,
        _mm256_min_ps, _mm256_mul_ps, _mm256_permute2f128_ps, _mm256_round_ps, _mm256_set1_epi32,
        _mm256_set1_ps, _mm256_setzero_ps, _mm256_shuffle_ps, _mm256_slli_epi32, _mm256_storeu_ps,
        _mm256_sub_ps, _mm512_add_epi32, _mm512_add_ps, _mm512_castps512_ps256,
        _mm512_castsi512_ps, _mm512_cmp_ps_mask, _mm512_cvtph_ps, _mm512_cvtps_epi32,
        _mm512_extractf32x8_ps, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_maskz_mov_ps,
        _mm512_max_ps, _mm512_mul_ps, _mm512_permutexvar_ps, _mm512_reduce_max_ps,
        _mm512_roundscale_ps, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setr_epi32,
        _mm512_setzero_ps, _mm512_shuffle_f32x4, _mm512_shuffle_ps, _mm512_slli_epi32,
        _mm512_storeu_ps, _mm512_sub_ps, _mm_add_ps, _mm_add_ss, _mm_cvtss_f32, _mm_loadu_si128,
        _mm_max_ps, _mm_movehdup_ps, _mm_movehl_ps, _CMP_LT_OQ,
    };

    use super::{
        AttnScratch, Elem, Heads, KvRun, CHUNK, EXP_FLOOR, EXP_P, LN2_HI, LN2_LO, LOG2E,
        SILU_EXP_MAX,
    };

    /// The head size of the SIMD paths (SmolLM2 and most small Llama-family models).
    pub const HD: usize = 64;

    /// Most query heads sharing a KV head that the SIMD paths take (more: the portable path).
    pub const MAX_HEADS: usize = 16;

    /// `_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC`: round half to even, as
    /// `f32::round_ties_even`.
    const NEAREST: i32 = 0x08;

    /// Which kernel the CPU runs.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Isa {
        /// AVX2 + FMA + F16C.
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

    /// [`super::attend`] with the kernel for `isa`, for heads of [`HD`] and groups of at most
    /// [`MAX_HEADS`].
    ///
    /// # Safety
    /// The CPU must support `isa`.
    pub unsafe fn attend<'a, T: Elem>(
        isa: Isa,
        heads: Heads,
        q: &[f32],
        n_ctx: usize,
        run: impl Fn(usize) -> KvRun<'a, T>,
        scratch: &mut AttnScratch,
        out: &mut [f32],
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            match isa {
                Isa::Avx512 => avx512(heads, q, n_ctx, run, scratch, out),
                Isa::Avx2 => avx2(heads, q, n_ctx, run, scratch, out),
            }
        }
    }

    /// One instruction set's pieces of the tiled attention.
    trait Arch {
        /// Positions scored together.
        const W: usize;

        /// `W` consecutive keys' (`HD` floats apart from `keys`) dot products with `q`, times
        /// `scale`, to `out[..W]`.
        unsafe fn dots(q: *const f32, keys: *const f32, scale: f32, out: *mut f32);

        /// One key's dot product with `q`.
        unsafe fn dot(q: *const f32, key: *const f32) -> f32;

        /// `HD` cached elements at `src` as f32 to `dst`.
        unsafe fn convert<T: Elem>(src: *const T, dst: *mut f32);

        /// [`super::softmax`] of `row`.
        unsafe fn softmax(row: &mut [f32]);

        /// For `n` heads (rows of weights `stride` apart from `w`, outputs consecutive from
        /// `out`): `out = fma(w_p, v_p, out)` for the `len` values from `values` (`HD` apart).
        unsafe fn values(
            n: usize,
            w: *const f32,
            stride: usize,
            values: *const f32,
            len: usize,
            out: *mut f32,
        );

        /// Heads whose outputs [`Arch::values`] keeps in registers together.
        const HEADS: usize;
    }

    /// The tiled attention, over an instruction set's pieces. Always inlined into the
    /// `#[target_feature]` entry point, so the pieces inline into it.
    ///
    /// # Safety
    /// The CPU must support `A`'s instructions; `heads.hd == HD`, `heads.group ≤ MAX_HEADS`.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    unsafe fn tiled<'a, T: Elem, A: Arch>(
        heads: Heads,
        q: &[f32],
        n_ctx: usize,
        run: impl Fn(usize) -> KvRun<'a, T>,
        scratch: &mut AttnScratch,
        out: &mut [f32],
    ) {
        let (g, kv) = (heads.group, heads.kv);
        let rows = q.len() / HD;
        let tokens = rows / (kv * g);
        // Positions the last token attends to: each row's scores are that far apart.
        let n_max = n_ctx + tokens - 1;
        let AttnScratch { scores, chunk } = scratch;
        if scores.len() < rows * n_max {
            scores.resize(rows * n_max, 0.0);
        }
        chunk.resize(kv * CHUNK * HD, 0.0);
        let (kb, sc) = (chunk.as_mut_ptr(), scores.as_mut_ptr());
        // SAFETY (whole body): `q` and `out` hold `rows` heads of `HD`; `scores` `rows` rows of
        // `n_max`; the chunk `kv` runs of `CHUNK` positions of `HD` (KV head `j`'s from
        // `j · CHUNK · HD`); positions read are below each row's context (`n_ctx + t ≤
        // n_max`), which `run` covers, each with `kv` heads' vectors from the lane on.
        unsafe {
            // A decode's single token has little to compute per cached position, so it waits
            // on memory unless the lines are asked for ahead; a prefill tile's tokens compute
            // long enough on each chunk for the hardware to keep up.
            let mut fetch = (tokens == 1).then(|| Fetch::new(&run, heads.lane, kv, n_max));
            // Scores, a chunk of keys at a time.
            let mut c0 = 0;
            while c0 < n_max {
                let c1 = (c0 + CHUNK).min(n_max);
                super::each_position(
                    c0..c1,
                    heads.lane,
                    &run,
                    |r| r.keys,
                    |p, key| {
                        if let Some(f) = &mut fetch {
                            f.ahead_of(p);
                        }
                        for j in 0..kv {
                            A::convert(key.as_ptr().add(j * HD), kb.add((j * CHUNK + p - c0) * HD));
                        }
                    },
                );
                for t in 0..tokens {
                    let end = (n_ctx + t).min(c1);
                    for j in 0..kv {
                        let kj = kb.add(j * CHUNK * HD);
                        for h in 0..g {
                            let row = (t * kv + j) * g + h;
                            let (qr, sr) = (q.as_ptr().add(row * HD), sc.add(row * n_max));
                            let mut p = c0;
                            while p + A::W <= end {
                                A::dots(qr, kj.add((p - c0) * HD), heads.scale, sr.add(p));
                                p += A::W;
                            }
                            for p in p..end {
                                *sr.add(p) = A::dot(qr, kj.add((p - c0) * HD)) * heads.scale;
                            }
                        }
                    }
                }
                c0 = c1;
            }
            for row in 0..rows {
                A::softmax(&mut scores[row * n_max..row * n_max + n_ctx + row / (kv * g)]);
            }
            let sc = scores.as_ptr();
            // Weighted values, a chunk at a time, the outputs carried from chunk to chunk.
            out.fill(0.0);
            let mut c0 = 0;
            while c0 < n_max {
                let c1 = (c0 + CHUNK).min(n_max);
                super::each_position(
                    c0..c1,
                    heads.lane,
                    &run,
                    |r| r.values,
                    |p, value| {
                        if let Some(f) = &mut fetch {
                            f.ahead_of(n_max + p);
                        }
                        for j in 0..kv {
                            let at = kb.add((j * CHUNK + p - c0) * HD);
                            A::convert(value.as_ptr().add(j * HD), at);
                        }
                    },
                );
                for t in 0..tokens {
                    let end = (n_ctx + t).min(c1);
                    if end <= c0 {
                        continue;
                    }
                    for j in 0..kv {
                        let vj = kb.add(j * CHUNK * HD);
                        let mut h = 0;
                        while h < g {
                            let n = (g - h).min(A::HEADS);
                            let row = (t * kv + j) * g + h;
                            let (w, o) = (sc.add(row * n_max + c0), out.as_mut_ptr().add(row * HD));
                            A::values(n, w, n_max, vj, end - c0, o);
                            h += n;
                        }
                    }
                }
                c0 = c1;
            }
        }
    }

    /// Cached positions the conversions fetch ahead (4 KiB of f16 keys for heads of 64).
    const AHEAD: usize = 32;

    /// Asks the cache for the keys, then the values, of every position in order, [`AHEAD`]
    /// positions before the conversions read them. A decode's attention waits on memory: the
    /// KV heads' elements of one position are a run of 128 bytes per head, other heads' may lie
    /// between it and the next position's, and a block's runs end every 16 positions, so the
    /// hardware prefetchers barely follow and without this each conversion waits for its lines
    /// in turn (serve's page-aligned pool, batch 16 at 384 tokens of context, a task per KV
    /// head: attention 17.8 → 13.1 ms a step).
    struct Fetch<'a, 'r, T, R> {
        run: &'r R,
        lane: usize,
        /// Bytes of a position's row from the lane on (`kv · HD` elements).
        bytes: usize,
        /// Positions: items `0..n` are keys, `n..2n` values.
        n: usize,
        /// The next item to fetch.
        next: usize,
        /// The run holding the last item fetched, and its first position.
        at: Option<(usize, KvRun<'a, T>)>,
    }

    impl<'a, 'r, T: Elem, R: Fn(usize) -> KvRun<'a, T>> Fetch<'a, 'r, T, R> {
        fn new(run: &'r R, lane: usize, kv: usize, n: usize) -> Self {
            Self { run, lane, bytes: kv * HD * std::mem::size_of::<T>(), n, next: 0, at: None }
        }

        /// Fetches the items before `item + AHEAD`.
        #[allow(clippy::inline_always)]
        #[inline(always)]
        fn ahead_of(&mut self, item: usize) {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let upto = (item + AHEAD).min(2 * self.n);
            while self.next < upto {
                let (values, p) = if self.next < self.n {
                    (false, self.next)
                } else {
                    (true, self.next - self.n)
                };
                let (start, r) = match self.at {
                    Some((start, r)) if start <= p && p < start + r.len.max(1) => (start, r),
                    _ => (p, (self.run)(p)),
                };
                self.at = Some((start, r));
                let rows = if values { r.values } else { r.keys };
                let row = rows[(p - start) * r.stride + self.lane..].as_ptr() as usize;
                // Every line the row touches (it need not start on one).
                let (first, last) = (row / 64, (row + self.bytes - 1) / 64);
                for line in first..=last {
                    // SAFETY: a prefetch never faults; the lines hold the row's elements.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>((line * 64) as *const i8) };
                }
                self.next += 1;
            }
        }
    }

    /// The AVX-512 pieces.
    struct Avx512;

    /// The AVX-512 entry point.
    #[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
    unsafe fn avx512<'a, T: Elem>(
        heads: Heads,
        q: &[f32],
        n_ctx: usize,
        run: impl Fn(usize) -> KvRun<'a, T>,
        scratch: &mut AttnScratch,
        out: &mut [f32],
    ) {
        // SAFETY: the caller's contract.
        unsafe { tiled::<T, Avx512>(heads, q, n_ctx, run, scratch, out) }
    }

    impl Arch for Avx512 {
        const W: usize = 16;
        const HEADS: usize = 3;

        #[allow(clippy::inline_always)]
        #[inline(always)]
        unsafe fn dots(q: *const f32, keys: *const f32, scale: f32, out: *mut f32) {
            // SAFETY: the trait's contract; AVX-512 in the caller.
            unsafe { dots16(q, keys, scale, out) }
        }

        #[allow(clippy::inline_always)]
        #[inline(always)]
        unsafe fn dot(q: *const f32, key: *const f32) -> f32 {
            // SAFETY: as above.
            unsafe { dot512(q, key) }
        }

        #[allow(clippy::inline_always)]
        #[inline(always)]
        unsafe fn convert<T: Elem>(src: *const T, dst: *mut f32) {
            // SAFETY: as above.
            unsafe { convert512(src, dst) }
        }

        #[allow(clippy::inline_always)]
        #[inline(always)]
        unsafe fn softmax(row: &mut [f32]) {
            // SAFETY: as above.
            unsafe { softmax512(row) }
        }

        #[allow(clippy::inline_always)]
        #[inline(always)]
        unsafe fn values(
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
                    1 => values512::<1>(w, stride, values, len, out),
                    2 => values512::<2>(w, stride, values, len, out),
                    _ => values512::<3>(w, stride, values, len, out),
                }
            }
        }
    }

    /// Sixteen consecutive keys' dot products with `q`, each as [`super::dot`] computes it,
    /// reduced together, times `scale`, stored in position order: lanes `l + (l + 8)` of key
    /// pairs `(i, i + 8)`, then `+ 4` of pairs `(i, i + 4)`, `+ 2`, `+ 1`, which leaves lane
    /// `4j + t` holding position `[0, 2, 1, 3][t] + [0, 8, 4, 12][j]` (permuted back).
    ///
    /// # Safety
    /// AVX-512 F; `q` reads `HD` floats, `keys` 16 keys of `HD`, `out` takes 16.
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn dots16(q: *const f32, keys: *const f32, scale: f32, out: *mut f32) {
        // SAFETY: the caller's contract.
        unsafe {
            let qv: [__m512; HD / 16] = std::array::from_fn(|c| _mm512_loadu_ps(q.add(16 * c)));
            let a: [__m512; 16] = std::array::from_fn(|p| {
                let mut acc = _mm512_setzero_ps();
                for (c, qc) in qv.iter().enumerate() {
                    acc = _mm512_fmadd_ps(*qc, _mm512_loadu_ps(keys.add(p * HD + 16 * c)), acc);
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

    /// One key's dot product with `q`, as [`super::dot`].
    ///
    /// # Safety
    /// AVX-512 F; both read `HD` floats.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,fma")]
    unsafe fn dot512(q: *const f32, key: *const f32) -> f32 {
        // SAFETY: the caller's contract.
        unsafe {
            let mut acc = _mm512_setzero_ps();
            for c in 0..HD / 16 {
                acc = _mm512_fmadd_ps(
                    _mm512_loadu_ps(q.add(16 * c)),
                    _mm512_loadu_ps(key.add(16 * c)),
                    acc,
                );
            }
            reduce8(_mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1)))
        }
    }

    /// `HD` cached elements as f32.
    ///
    /// # Safety
    /// AVX-512 F; `src` reads and `dst` takes `HD` elements.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn convert512<T: Elem>(src: *const T, dst: *mut f32) {
        // SAFETY: the caller's contract.
        unsafe {
            for c in 0..HD / 16 {
                let v = if T::F16 {
                    _mm512_cvtph_ps(_mm256_loadu_si256(src.add(16 * c).cast()))
                } else {
                    _mm512_loadu_ps(src.add(16 * c).cast())
                };
                _mm512_storeu_ps(dst.add(16 * c), v);
            }
        }
    }

    /// [`super::exp`] of each lane.
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

    /// [`super::softmax`], sixteen lanes at a time.
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
            let inv = 1.0 / super::sum_with_tail(lanes, tail, max);
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
    /// once for them), the outputs in registers.
    ///
    /// # Safety
    /// AVX-512 F; `G` rows of `len` weights `stride` apart at `w`, `len` values of `HD` at
    /// `values`, `G · HD` outputs at `out`.
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn values512<const G: usize>(
        w: *const f32,
        stride: usize,
        values: *const f32,
        len: usize,
        out: *mut f32,
    ) {
        const CH: usize = HD / 16;
        // SAFETY: the caller's contract.
        unsafe {
            let mut acc: [[__m512; CH]; G] = std::array::from_fn(|g| {
                std::array::from_fn(|c| _mm512_loadu_ps(out.add(g * HD + 16 * c)))
            });
            for p in 0..len {
                let v: [__m512; CH] =
                    std::array::from_fn(|c| _mm512_loadu_ps(values.add(p * HD + 16 * c)));
                for (g, head) in acc.iter_mut().enumerate() {
                    let wg = _mm512_set1_ps(*w.add(g * stride + p));
                    for (a, vc) in head.iter_mut().zip(&v) {
                        *a = _mm512_fmadd_ps(wg, *vc, *a);
                    }
                }
            }
            for (g, head) in acc.iter().enumerate() {
                for (c, a) in head.iter().enumerate() {
                    _mm512_storeu_ps(out.add(g * HD + 16 * c), *a);
                }
            }
        }
    }

    /// The AVX2 pieces.
    struct Avx2;

    /// The AVX2 entry point.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2<'a, T: Elem>(
        heads: Heads,
        q: &[f32],
        n_ctx: usize,
        run: impl Fn(usize) -> KvRun<'a, T>,
        scratch: &mut AttnScratch,
        out: &mut [f32],
    ) {
        // SAFETY: the caller's contract.
        unsafe { tiled::<T, Avx2>(heads, q, n_ctx, run, scratch, out) }
    }

    impl Arch for Avx2 {
        const W: usize = 8;
        const HEADS: usize = 1;

        #[allow(clippy::inline_always)]
        #[inline(always)]
        unsafe fn dots(q: *const f32, keys: *const f32, scale: f32, out: *mut f32) {
            // SAFETY: the trait's contract; AVX2 in the caller.
            unsafe { _mm256_storeu_ps(out, _mm256_mul_ps(dots8(q, keys), _mm256_set1_ps(scale))) }
        }

        #[allow(clippy::inline_always)]
        #[inline(always)]
        unsafe fn dot(q: *const f32, key: *const f32) -> f32 {
            // SAFETY: as above.
            unsafe { reduce8(halves(q, key)) }
        }

        #[allow(clippy::inline_always)]
        #[inline(always)]
        unsafe fn convert<T: Elem>(src: *const T, dst: *mut f32) {
            // SAFETY: as above.
            unsafe { convert256(src, dst) }
        }

        #[allow(clippy::inline_always)]
        #[inline(always)]
        unsafe fn softmax(row: &mut [f32]) {
            // SAFETY: as above.
            unsafe { softmax256(row) }
        }

        #[allow(clippy::inline_always)]
        #[inline(always)]
        unsafe fn values(
            _n: usize,
            w: *const f32,
            _stride: usize,
            values: *const f32,
            len: usize,
            out: *mut f32,
        ) {
            // SAFETY: as above.
            unsafe { values256(w, values, len, out) }
        }
    }

    /// `HD` cached elements as f32.
    ///
    /// # Safety
    /// AVX2 + F16C; `src` reads and `dst` takes `HD` elements.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn convert256<T: Elem>(src: *const T, dst: *mut f32) {
        // SAFETY: the caller's contract.
        unsafe {
            for c in 0..HD / 8 {
                let v = if T::F16 {
                    _mm256_cvtph_ps(_mm_loadu_si128(src.add(8 * c).cast()))
                } else {
                    _mm256_loadu_ps(src.add(8 * c).cast())
                };
                _mm256_storeu_ps(dst.add(8 * c), v);
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

    /// One position's sixteen running sums with `q` (two registers: lanes 0-7 and 8-15),
    /// added as `l + (l + 8)`: the first step of [`super::reduce16`].
    ///
    /// # Safety
    /// AVX2 + FMA; both pointers read `HD` floats.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn halves(q: *const f32, key: *const f32) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for c in 0..HD / 16 {
                let (qc, kc) = (q.add(16 * c), key.add(16 * c));
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(qc), _mm256_loadu_ps(kc), lo);
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(qc.add(8)), _mm256_loadu_ps(kc.add(8)), hi);
            }
            _mm256_add_ps(lo, hi)
        }
    }

    /// Eight consecutive keys' dot products with `q`, each as [`super::dot`] computes it, in
    /// position order: [`halves`], then `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))` by shuffles.
    ///
    /// # Safety
    /// AVX2 + FMA; `q` reads `HD` floats, `keys` 8 keys of `HD`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dots8(q: *const f32, keys: *const f32) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            let a: [__m256; 8] = std::array::from_fn(|p| halves(q, keys.add(p * HD)));
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

    /// [`super::exp`] of each lane.
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

    /// [`super::silu_mul_row`] over the row's whole groups of eight; returns how many
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

    /// [`super::softmax`], sixteen lanes at a time in two registers.
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
            let inv = 1.0 / super::sum_with_tail(lanes, tail, max);
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

    /// `out = fma(w_p, v_p, out)` over `len` positions for one head, the output in registers.
    ///
    /// # Safety
    /// AVX2 + FMA; `len` weights at `w`, `len` values of `HD` at `values`, `HD` outputs at
    /// `out`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn values256(w: *const f32, values: *const f32, len: usize, out: *mut f32) {
        const CH: usize = HD / 8;
        // SAFETY: the caller's contract.
        unsafe {
            let mut acc: [__m256; CH] = std::array::from_fn(|c| _mm256_loadu_ps(out.add(8 * c)));
            for p in 0..len {
                let wp = _mm256_set1_ps(*w.add(p));
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(wp, _mm256_loadu_ps(values.add(p * HD + 8 * c)), *a);
                }
            }
            for (c, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(8 * c), *a);
            }
        }
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
                Some(isa) if hd == simd::HD => unsafe {
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
    /// keys and values, and for a head size without the specialised path.
    #[test]
    fn simd_attention_matches_the_portable_loop_bit_for_bit() {
        let mut seed = 17u64;
        let isas = isas();
        assert!(
            isas.len() > 1 || !cfg!(target_arch = "x86_64") || !is_x86_feature_detected!("fma")
        );
        for hd in [64, 48] {
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
                let heads = Heads { hd, group, lane, kv, scale: 0.125 };
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
