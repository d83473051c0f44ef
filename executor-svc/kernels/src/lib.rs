//! Products against quantized weights for the CPU forward, in f32: the weights stay in blocks of
//! their GGUF codes in memory (`Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q8_0`, `Q4_K`, `Q5_K`, `Q6_K`,
//! and the unquantized `F16`, `BF16`, `F32`; see [`WeightFormat`]), their codes become floats
//! exactly as the product reads them, and the activations stay f32. So the products are those of the true model, up to f32 rounding
//! of the sums (llama.cpp instead quantizes activations to 8 bits, which moves this model's logits
//! by about 0.2 and flips greedy answers).
//!
//! The arithmetic of one output element, for activation row `x` and weight column `o` with
//! blocks of 32 `(q, d, m)` (`w = d·q + m`; `Q8_0` has `m = 0`, `Q4_0` has `m = -8d`; a
//! k-quant's `d` and `m` are its super-block's scales times the block's 6-bit ones; the float
//! types are their own codes, with `d = 1`, `m = 0`), is fixed:
//!
//! ```text
//! acc = 0
//! for each block b, in order:
//!     p = 0;  for k in 0..32, in order:  p = fma(x[32b + k], q[k], p)     (q[k] exact in f32)
//!     acc = fma(p, d, acc)
//!     acc = fma(s_b, m, acc)      (with a minimum; s_b = x[32b] + x[32b + 1] + … in order)
//! ```
//!
//! (`Q6_K` has a scale per 16 inputs: `p` over each half, then `acc = fma(p, d_half, acc)`.)
//!
//! which is `Σ x·w` with the scale and minimum applied once per block rather than once per
//! weight: one fused multiply-add per weight, after the code's conversion to float.
//!
//! Two ways to these numbers, chosen by the number of rows (tokens) in the product:
//! - **few rows** (a decode batch, up to [`x86::Isa::fused_rows`]: 32 with AVX-512, 16 with
//!   AVX2): each weight block is converted in registers and used at once by a tile of up to 8
//!   (AVX2: 4) rows, in passes over each group of columns while its codes stay in L1, so the
//!   weights are read from memory once and nothing is written back;
//! - **many rows** (prefill, large decode batches): compute-bound; a panel of 16 or 32 output
//!   columns is converted once for all inputs into a buffer that stays in L2, and a register-
//!   tiled f32 micro-kernel (6 rows × 32 columns with AVX-512, 6 × 16 with AVX2) runs every row
//!   through it: the shape of a BLAS GEMM, with the conversion as its packing step.
//!
//! Determinism, which the sampler's seeded reproducibility rests on: the sequence above is the
//! same whatever the batch size, the path (fused or panel), the tiling, the thread split or the
//! instruction set (AVX-512, AVX2 or portable). So a request's logits do not depend on what else
//! is in its batch, and the reference forward, which uses these same kernels, can be compared
//! bit for bit. (Speed comes from many independent chains at once, one per output column and
//! row, never from splitting one chain.)

// The hand-written SIMD kernels: `unsafe` for the intrinsics and the runtime CPU-feature
// dispatch that makes them sound (see `x86`).
#![allow(unsafe_code)]
// `inline(always)` on the block and tile helpers: each is a loop body that must fuse into its
// caller's `#[target_feature]` context, or the intrinsics it calls are not inlined. `OutPtr` goes
// by value because each worker thread owns its part.
#![allow(clippy::inline_always, clippy::needless_pass_by_value)]

pub mod format;
mod pack;
pub mod portable;
mod stacked;
#[cfg(target_arch = "x86_64")]
pub mod x86;

use format::from_f16;
pub use format::{kind, WeightFormat};
pub use pack::{KernelError, NaturalBlock, Param};
use rayon::prelude::*;
pub use stacked::{matmul_stacked, Matrix, Stacked};

/// Elements per quantization block.
pub const BLOCK: usize = 32;

/// Most code bytes of one column's block (`F32`'s).
pub const MAX_CODE_BYTES: usize = 4 * BLOCK;

/// Output columns interleaved together in the packed weight layout (one 512-bit register of f32,
/// two 256-bit ones).
pub const GROUP: usize = 16;

/// A weight matrix `[rows (outputs), cols (inputs)]` in blocks of 32 along the inputs, packed
/// by groups of [`GROUP`] outputs (the last group padded with zero columns).
///
/// For group `g` and block `b` (index `gb = g · blocks_per_row + b`), column `16g + j`:
/// - its scale and minimum (`Q6K`: its two halves' scales) are `d[s·16 + j]` and `m[s·16 + j]`
///   (f16 bits), times `dq[gb·16 + j]` and `mq[gb·16 + j]` (small integers) in the wide
///   formats, with `s = gb >> shift`: a k-quant keeps its super-block's scales once per 8 blocks
///   (`shift` 3) and each block's 6- or 8-bit factors, as GGUF does (4.6 bits a weight for `Q4K`,
///   where the products in f32 took 6); `shift` is 0, a scale per block, where the blocks of a
///   super-block do not share one (`Q5_1`, or inputs not a multiple of 256);
/// - the code bytes at `gb · 16 · code_bytes`, four bytes of a column at a time: byte
///   `64t + 4j + e` is byte `4t + e` of column `j`'s block. So 64 bytes are 16 dwords, one
///   per column, and input `4t + e`'s codes for the whole group are one shift away: byte `e` of
///   each dword (byte codes), or its low nibble (nibble codes; its high nibble is input
///   `16 + 4t + e`).
///   The float formats (no parameters) instead keep each input's 16 columns together: input
///   `k` of column `j` at bytes `(16k + j)·size ..`, so one load is a whole group's input.
#[derive(Clone, Debug)]
pub struct QWeight {
    /// Storage format.
    pub format: WeightFormat,
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of 32).
    pub cols: usize,
    /// Per group and block (wide formats: super-block): the columns' scales, as f16 bits.
    d: Vec<u16>,
    /// Per group and block (wide formats: super-block): the columns' minimums, as f16 bits
    /// (`Q6K`: the scale of its second halves).
    m: Vec<u16>,
    /// Per group and block: the columns' scale factors (the wide formats).
    dq: Vec<i8>,
    /// Per group and block: the columns' minimum factors (`Q6K`: second halves' scale factors).
    mq: Vec<i8>,
    /// Blocks per scale of `d` and `m`, as a power of two (0 but for the wide formats).
    shift: u32,
    /// Interleaved codes, as described above.
    q: Vec<u8>,
}

/// Where column `j`'s code byte `i` (in natural order) sits in its group-block of `format`
/// (see [`QWeight`]).
#[inline]
fn code_at(format: WeightFormat, i: usize, j: usize) -> usize {
    if format.float() {
        let size = kind::float_bytes(format.kind());
        (GROUP * (i / size) + j) * size + i % size
    } else {
        4 * GROUP * (i / 4) + 4 * j + i % 4
    }
}

impl QWeight {
    fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    /// Groups of [`GROUP`] output columns (the last one possibly padded).
    fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// Column `j`'s scale and minimum (`Q6K`: second scale) in group-block `gb`, as stored.
    fn param_parts(&self, gb: usize, j: usize) -> (Param, Param) {
        if self.format.float() {
            return (Param::plain(1.0), Param::plain(0.0));
        }
        let (at, s) = (gb * GROUP + j, (gb >> self.shift) * GROUP + j);
        let part = |scales: &[u16], factors: &[i8]| Param {
            scale: from_f16(scales[s]),
            factor: if self.format.wide() { factors[at] } else { 1 },
        };
        let m = if self.format.two_params() { part(&self.m, &self.mq) } else { Param::plain(0.0) };
        (part(&self.d, &self.dq), m)
    }

    /// Column `j`'s scale and minimum (`Q6K`: second scale) in group-block `gb`.
    fn params(&self, gb: usize, j: usize) -> (f32, f32) {
        let (d, m) = self.param_parts(gb, j);
        (d.value(), m.value())
    }

    /// Row `r`'s block `b` in natural order: scale, minimum and code bytes (written to the
    /// first [`WeightFormat::code_bytes`] of `codes`).
    pub fn natural_block(
        &self,
        r: usize,
        b: usize,
        codes: &mut [u8; MAX_CODE_BYTES],
    ) -> (Param, Param) {
        let (g, j) = (r / GROUP, r % GROUP);
        let gb = g * self.blocks_per_row() + b;
        let cb = self.format.code_bytes();
        let base = gb * GROUP * cb;
        for (i, code) in codes[..cb].iter_mut().enumerate() {
            *code = self.q[base + code_at(self.format, i, j)];
        }
        self.param_parts(gb, j)
    }

    /// Weight `(o, k)`: `d·q + m` rounded once (as llama.cpp's dequantization), or `d·q` (`Q8`;
    /// `Q6K` with its half's scale), exact.
    #[inline]
    fn value(&self, o: usize, k: usize) -> f32 {
        let (g, j, b, e) = (o / GROUP, o % GROUP, k / BLOCK, k % BLOCK);
        let gb = g * self.blocks_per_row() + b;
        let (d, m) = self.params(gb, j);
        let f = self.format.kind();
        let size = kind::float_bytes(f);
        if size > 0 {
            let at = gb * GROUP * BLOCK * size + code_at(self.format, e * size, j);
            return format::float_code(f, &self.q[at..at + size]);
        }
        let q = if kind::bytes(f) {
            f32::from(self.q[gb * GROUP * 32 + code_at(self.format, e, j)] as i8)
        } else {
            let byte = self.q[gb * GROUP * 16 + code_at(self.format, e % 16, j)];
            f32::from(if e < 16 { byte & 0x0F } else { byte >> 4 })
        };
        if kind::has_min(f) {
            q.mul_add(d, m)
        } else if kind::halves(f) && e >= 16 {
            q * m
        } else {
            q * d
        }
    }

    /// The dequantized weight row `r` (for embeddings and tests).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        for (k, v) in out[..self.cols].iter_mut().enumerate() {
            *v = self.value(r, k);
        }
    }

    /// Bytes of weight data (for the memory report).
    pub fn bytes(&self) -> usize {
        self.q.len() + 2 * (self.d.len() + self.m.len()) + self.dq.len() + self.mq.len()
    }
}

/// Where a product's outputs go: output `(r, o)` at `ptr + r·ld + o` (`ld` is the weight's
/// outputs, or a stacked matrix's when `ptr` starts at one part's first column). A raw pointer
/// that may cross to rayon's threads; each thread writes a disjoint column range.
#[derive(Clone, Copy)]
struct OutPtr {
    ptr: *mut f32,
    ld: usize,
}

impl OutPtr {
    /// Output `(r, o)`.
    ///
    /// # Safety
    /// `(r, o)` must lie inside the output the pointer was made for.
    #[inline(always)]
    unsafe fn at(self, r: usize, o: usize) -> *mut f32 {
        // SAFETY: the caller's contract.
        unsafe { self.ptr.add(r * self.ld + o) }
    }
}
// SAFETY: the threads write disjoint elements (distinct output columns), and the buffer
// outlives the parallel section that uses the pointer.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Column groups in the widest tile (a single row's fused tile with AVX-512).
const TILE_GROUPS: usize = 4;

/// Column groups in the widest tile of several rows (fused or panel, AVX-512).
const TILE_GROUPS_ROWS: usize = 2;

/// Fewest tiles per parallel task, so tiny products are not split into tasks that cost more to
/// schedule than to compute.
const MIN_UNITS_PER_TASK: usize = 1;

/// `out[r, o] = Σ_k x[r, k] · w[o, k]` for the `rows` rows of `x` (row-major, `w.cols` wide)
/// and every output `o`; `out` is `rows × w.rows`, row-major.
pub fn matmul(x: &[f32], rows: usize, w: &QWeight, out: &mut [f32]) {
    matmul_with(x, rows, w, out, Kernel::best());
}

/// Which implementation computes a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Scalar Rust, for any CPU.
    Portable,
    /// An x86 SIMD kernel.
    #[cfg(target_arch = "x86_64")]
    X86(x86::Isa),
}

impl Kernel {
    /// The fastest kernel this CPU runs (`FERRY_KERNEL=avx2` or `portable` picks a slower one,
    /// to measure or test it).
    pub fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        if let Some(isa) = x86::detect() {
            return Kernel::X86(isa);
        }
        Kernel::Portable
    }

    /// Every kernel this CPU can run (whatever `FERRY_KERNEL` says), the portable one first.
    pub fn available() -> Vec<Kernel> {
        #[allow(unused_mut)]
        let mut kernels = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        kernels.extend(x86::supported().into_iter().map(Kernel::X86));
        kernels
    }

    /// Its name, for reports.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Kernel::X86(isa) => isa.name(),
        }
    }
}

/// [`matmul`] with a chosen kernel (for benches and tests; every kernel gives the same bits).
pub fn matmul_with(x: &[f32], rows: usize, w: &QWeight, out: &mut [f32], kernel: Kernel) {
    assert_eq!(out.len(), rows * w.rows, "output buffer must be rows × outputs");
    matmul_columns(x, rows, w, (out, w.rows, 0), kernel);
}

/// [`matmul_with`] into columns `col0 .. col0 + w.rows` of `out`, whose rows are `ld` wide (a
/// stacked matrix's output, one part at a time).
fn matmul_columns(
    x: &[f32],
    rows: usize,
    w: &QWeight,
    (out, ld, col0): (&mut [f32], usize, usize),
    kernel: Kernel,
) {
    assert_eq!(x.len(), rows * w.cols, "activations must be rows × the weight's inputs");
    assert!(col0 + w.rows <= ld && out.len() == rows * ld, "output columns out of range");
    // SAFETY: `col0` lies inside the buffer (checked above).
    let ptr = OutPtr { ptr: unsafe { out.as_mut_ptr().add(col0) }, ld };
    let sums = if w.format.has_min() { block_sums(x) } else { Vec::new() };
    let sums = &sums[..];
    let groups = w.groups();
    // Units of whole tiles (up to four groups for one row, two for more), so no task splits a
    // tile's columns; a few tasks per thread balance the load (units spread evenly over them),
    // more only add scheduling cost. (Two-group units split a 60-group product into 6 equal
    // tasks where four-group units left them 2 and 3 units: 7 against 8 per thread.)
    let unit = if rows == 1 { TILE_GROUPS } else { TILE_GROUPS_ROWS };
    let units = groups.div_ceil(unit);
    let tasks = (rayon::current_num_threads() * 3).min(units.div_ceil(MIN_UNITS_PER_TASK)).max(1);
    (0..tasks).into_par_iter().for_each(move |t| {
        let range =
            (t * units / tasks * unit).min(groups)..((t + 1) * units / tasks * unit).min(groups);
        // SAFETY: task `t` writes only the columns of groups in `range`; tasks do not overlap.
        unsafe { matmul_groups(x, sums, rows, w, range, ptr, kernel) };
    });
}

/// Computes the output columns of column groups `groups`, for every row.
///
/// # Safety
/// `out` must point to `rows × w.rows` floats, no other thread may write these columns, and
/// an x86 kernel must have been detected on this CPU.
unsafe fn matmul_groups(
    x: &[f32],
    sums: &[f32],
    rows: usize,
    w: &QWeight,
    groups: std::ops::Range<usize>,
    out: OutPtr,
    kernel: Kernel,
) {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        Kernel::X86(isa) => unsafe { x86::matmul_groups(isa, x, sums, rows, w, groups, out) },
        Kernel::Portable => {
            for g in groups {
                for o in g * GROUP..((g + 1) * GROUP).min(w.rows) {
                    for r in 0..rows {
                        let v = portable::dot(&x[r * w.cols..(r + 1) * w.cols], w, o);
                        // SAFETY: the caller owns column `o` of every row.
                        unsafe { *out.at(r, o) = v };
                    }
                }
            }
        }
    }
}

/// Each block's sum of activations, `x[32b] + x[32b + 1] + …` in order from 0 (what a Q4
/// block's minimum multiplies). Eight blocks at a time, so eight independent chains of
/// additions keep the adders busy where one block's 32 additions in order wait on each other;
/// a long prefill's rows split between the threads. (One block at a time, on one thread, was
/// about 2 % of a long prefill, the other thread idle.)
fn block_sums(x: &[f32]) -> Vec<f32> {
    /// Blocks per task.
    const PER_TASK: usize = 1024;
    const LANES: usize = 8;
    let mut sums = vec![0f32; x.len() / BLOCK];
    let tasks = sums.par_chunks_mut(PER_TASK).zip(x.par_chunks(PER_TASK * BLOCK));
    tasks.for_each(|(sums, x)| {
        let mut groups = sums.chunks_exact_mut(LANES);
        let mut xs = x.chunks_exact(LANES * BLOCK);
        for (s, xb) in (&mut groups).zip(&mut xs) {
            let mut lanes = [0f32; LANES];
            for k in 0..BLOCK {
                for (j, lane) in lanes.iter_mut().enumerate() {
                    *lane += xb[j * BLOCK + k];
                }
            }
            s.copy_from_slice(&lanes);
        }
        let rest = groups.into_remainder().iter_mut().zip(xs.remainder().chunks_exact(BLOCK));
        for (s, xb) in rest {
            *s = portable::block_sum(xb);
        }
    });
    sums
}

/// Writes one row's sums of group `g` to the output, skipping padding columns.
///
/// # Safety
/// As [`matmul_groups`]: the caller owns these columns of row `r`.
#[inline(always)]
unsafe fn store_group(w: &QWeight, r: usize, g: usize, sums: &[f32; GROUP], out: OutPtr) {
    let n = (w.rows - g * GROUP).min(GROUP);
    // SAFETY: columns `16g .. 16g + n` of row `r` lie inside the output; the caller owns them.
    unsafe {
        std::ptr::copy_nonoverlapping(sums.as_ptr(), out.at(r, g * GROUP), n);
    }
}
