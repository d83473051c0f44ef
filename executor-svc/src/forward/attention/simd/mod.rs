//! [`super::attend`] with AVX-512 or AVX2 + FMA, for heads of 64, 128 or 256 ([`supports`]; other
//! sizes take the portable path): the same fused multiply-adds per lane as [`super::dot`], the
//! same reduction trees, the same [`super::exp`] lane by lane, so the same bits.
//!
//! A tile's keys, then its values, are converted to f32 a chunk of positions at a time;
//! every row (token × head) of the tile then reads the chunk from L1. Scores are computed
//! 16 (AVX-512) or 8 (AVX2) positions at a time and reduced together with shuffles; the
//! weighted sum of values keeps up to three heads' outputs (AVX-512; AVX2 one) in
//! registers across a chunk.
//!
//! This file holds what the instruction sets share — the dispatch, the tiled loop over an
//! [`Arch`]'s pieces, the prefetch of a decode's keys and values — and `avx512` and `avx2` each
//! hold one instruction set's pieces. `unsafe`: the intrinsics behind `#[target_feature]`,
//! entered only through [`attend`] with the instruction set [`detect`]ed at run time.

use std::arch::x86_64::{
    __m256, _mm256_castps256_ps128, _mm256_extractf128_ps, _mm_add_ps, _mm_add_ss, _mm_cvtss_f32,
    _mm_movehdup_ps, _mm_movehl_ps,
};

use super::{AttnScratch, Elem, Heads, KvRun, CHUNK};
use avx2::avx2;
use avx512::avx512;

mod avx2;
mod avx512;

pub use avx2::silu_mul8;

/// Whether the SIMD paths take heads of `hd`: 64 (SmolLM2 and most small Llama-family
/// models), 128 (Llama 3, Mistral, Qwen 2.5 7B and Qwen 3) and 256 (Gemma 2 and 3).
pub const fn supports(hd: usize) -> bool {
    hd == 64 || hd == 128 || hd == 256
}

/// Most chunks of 16 elements in a head the kernels hold (256 / 16).
const MAX_CH: usize = 16;

/// Columns of a head that [`Arch::values`] keeps in registers per call (the rest of a head of
/// 128 or 256 is one or three more calls: each output element's chain of fused multiply-adds
/// is its own).
const VALUE_COLS: usize = 64;

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

/// [`super::attend`] with the kernel for `isa`, for heads [`supports`] takes and groups of at most
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

/// Lanes `l + (l + 4)`, then `+ 2`, `+ 1` of eight sums (the end of [`super::reduce16`]): a
/// dot product's last steps on both instruction sets.
#[inline]
#[target_feature(enable = "avx2")]
fn reduce8(b: __m256) -> f32 {
    let c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    let d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)))
}

/// One instruction set's pieces of the tiled attention.
trait Arch {
    /// Positions scored together.
    const W: usize;

    /// `W` consecutive keys' (`H` floats apart from `keys`) dot products with `q`, times
    /// `scale`, to `out[..W]`.
    unsafe fn dots<const H: usize>(q: *const f32, keys: *const f32, scale: f32, out: *mut f32);

    /// One key's dot product with `q` (`H` floats each).
    unsafe fn dot<const H: usize>(q: *const f32, key: *const f32) -> f32;

    /// `H` cached elements at `src` as f32 to `dst`.
    unsafe fn convert<const H: usize, T: Elem>(src: *const T, dst: *mut f32);

    /// [`super::softmax`] of `row`.
    unsafe fn softmax(row: &mut [f32]);

    /// For `n` heads (rows of weights `stride` apart from `w`, outputs `H` apart from `out`):
    /// `out = fma(w_p, v_p, out)` over [`VALUE_COLS`] columns for the `len` values from
    /// `values` (`H` apart).
    unsafe fn values<const H: usize>(
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
/// The CPU must support `A`'s instructions; `heads.hd == H`, `heads.group ≤ MAX_HEADS`.
#[allow(clippy::inline_always)]
#[inline(always)]
unsafe fn tiled<'a, T: Elem, A: Arch, const H: usize>(
    heads: Heads,
    q: &[f32],
    n_ctx: usize,
    run: impl Fn(usize) -> KvRun<'a, T>,
    scratch: &mut AttnScratch,
    out: &mut [f32],
) {
    let (g, kv) = (heads.group, heads.kv);
    let rows = q.len() / H;
    let tokens = rows / (kv * g);
    // Positions the last token attends to: each row's scores are that far apart.
    let n_max = n_ctx + tokens - 1;
    let AttnScratch { scores, chunk } = scratch;
    if scores.len() < rows * n_max {
        scores.resize(rows * n_max, 0.0);
    }
    chunk.resize(kv * CHUNK * H, 0.0);
    let (kb, sc) = (chunk.as_mut_ptr(), scores.as_mut_ptr());
    // SAFETY (whole body): `q` and `out` hold `rows` heads of `H`; `scores` `rows` rows of
    // `n_max`; the chunk `kv` runs of `CHUNK` positions of `H` (KV head `j`'s from
    // `j · CHUNK · H`); positions read are below each row's context (`n_ctx + t ≤
    // n_max`), which `run` covers, each with `kv` heads' vectors from the lane on.
    unsafe {
        // A decode's single token has little to compute per cached position, so it waits
        // on memory unless the lines are asked for ahead; a prefill tile's tokens compute
        // long enough on each chunk for the hardware to keep up.
        let mut fetch = (tokens == 1).then(|| Fetch::new(&run, heads.lane, kv * H, n_max));
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
                        A::convert::<H, T>(
                            key.as_ptr().add(j * H),
                            kb.add((j * CHUNK + p - c0) * H),
                        );
                    }
                },
            );
            for t in 0..tokens {
                let end = (n_ctx + t).min(c1);
                for j in 0..kv {
                    let kj = kb.add(j * CHUNK * H);
                    for h in 0..g {
                        let row = (t * kv + j) * g + h;
                        let (qr, sr) = (q.as_ptr().add(row * H), sc.add(row * n_max));
                        let mut p = c0;
                        while p + A::W <= end {
                            A::dots::<H>(qr, kj.add((p - c0) * H), heads.scale, sr.add(p));
                            p += A::W;
                        }
                        for p in p..end {
                            *sr.add(p) = A::dot::<H>(qr, kj.add((p - c0) * H)) * heads.scale;
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
                        let at = kb.add((j * CHUNK + p - c0) * H);
                        A::convert::<H, T>(value.as_ptr().add(j * H), at);
                    }
                },
            );
            for t in 0..tokens {
                let end = (n_ctx + t).min(c1);
                if end <= c0 {
                    continue;
                }
                for j in 0..kv {
                    let vj = kb.add(j * CHUNK * H);
                    let mut h = 0;
                    while h < g {
                        let n = (g - h).min(A::HEADS);
                        let row = (t * kv + j) * g + h;
                        let (w, o) = (sc.add(row * n_max + c0), out.as_mut_ptr().add(row * H));
                        for col in (0..H).step_by(VALUE_COLS) {
                            A::values::<H>(n, w, n_max, vj.add(col), end - c0, o.add(col));
                        }
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
    /// Bytes of a position's row from the lane on (`kv` heads' elements).
    bytes: usize,
    /// Positions: items `0..n` are keys, `n..2n` values.
    n: usize,
    /// The next item to fetch.
    next: usize,
    /// The run holding the last item fetched, and its first position.
    at: Option<(usize, KvRun<'a, T>)>,
}

impl<'a, 'r, T: Elem, R: Fn(usize) -> KvRun<'a, T>> Fetch<'a, 'r, T, R> {
    /// `elements`: of a position's row from the lane on (KV heads × head size).
    fn new(run: &'r R, lane: usize, elements: usize, n: usize) -> Self {
        Self { run, lane, bytes: elements * std::mem::size_of::<T>(), n, next: 0, at: None }
    }

    /// Fetches the items before `item + AHEAD`.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn ahead_of(&mut self, item: usize) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let upto = (item + AHEAD).min(2 * self.n);
        while self.next < upto {
            let (values, p) =
                if self.next < self.n { (false, self.next) } else { (true, self.next - self.n) };
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
