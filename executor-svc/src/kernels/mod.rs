//! Quantized matrix products for the CPU forward, in the llama.cpp style: weights stay in
//! their 4- or 8-bit GGUF blocks, each activation row is quantized per block of 32, and the
//! block dot products are integer sums.
//!
//! Activations get 16 bits, not llama.cpp's 8: with 8 the logits of the default model wander by
//! about 0.2 from the f32 forward's (the rounding of each layer's activations re-draws the
//! next), enough to flip greedy answers whose top two tokens are 0.1 apart (the test chat's
//! first token is one); with 16 they stay within about 0.003. A 16-bit code is stored as two
//! signed bytes, `x = 255·hi + lo`, so the integer products still run on byte instructions
//! (`vpdpbusd`, `maddubs`), at twice the integer work and the same weight traffic.
//!
//! Why this and not candle's `QMatMul` or an f32 GEMM: candle's `Q4_1` path runs at about
//! 9 GFLOP/s on this model's shapes and f32 weights are memory-bound at batch 1 (540 MB read
//! per token). Integer block dots read under 100 MB per token and vectorise well.
//!
//! Layout: weights are repacked at load into groups of [`GROUP`] output columns, interleaved
//! four codes at a time, so that one 256-bit register holds the same four inputs of eight
//! columns. A block's product for eight columns is then eight integer multiply-adds against
//! broadcast activation bytes, and its float work (scale, accumulate) is one vector operation
//! for all eight columns instead of eight horizontal ones (llama.cpp's "repacked" CPU formats
//! do the same).
//!
//! Determinism, which the sampler's seeded reproducibility rests on: every output element is
//! computed by the same sequence of operations whatever the batch size, the row or column
//! tiling, the thread split, or the instruction set (AVX-512 VNNI, AVX2 or the portable path).
//! Per block, the integer dot product is exact; the float accumulation is, per output, one
//! running sum over blocks in order: `acc = fma(isum, d_w·d_x, acc)`, and for Q4 then
//! `acc = fma(m_w, d_x·Σx, acc)`. So a request's logits do not depend on what else is in its
//! batch, and the reference forward, which uses these same kernels, can be compared bit for
//! bit.

// `inline(always)` on the block and tile helpers: each is a loop body that must fuse into its
// caller's `#[target_feature]` context, or the intrinsics it calls are not inlined (measured:
// 2-3x slower per product without it). The views (`QBlocks`, `OutPtr`) go by value because
// each worker thread owns its part.
#![allow(clippy::inline_always, clippy::needless_pass_by_value)]

mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

use candle_core::quantized::{GgmlDType, QTensor};
use rayon::prelude::*;

/// Elements per quantization block.
pub const BLOCK: usize = 32;

/// Output columns interleaved together in the packed weight layout (one 256-bit register of
/// 32-bit sums).
pub const GROUP: usize = 8;

/// How a weight matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// 4-bit unsigned codes with a scale and a minimum per block: `w = d·q + m`
    /// (GGUF `Q4_1`; `Q4_0` maps onto it with `m = -8d`).
    Q4,
    /// 8-bit signed codes with a scale per block: `w = d·q` (GGUF `Q8_0`).
    Q8,
}

impl WeightFormat {
    /// Packed code bytes per block of one column.
    const fn code_bytes(self) -> usize {
        match self {
            WeightFormat::Q4 => 16,
            WeightFormat::Q8 => 32,
        }
    }
}

/// A weight matrix `[rows (outputs), cols (inputs)]` in blocks of 32 along the inputs, packed
/// by groups of [`GROUP`] outputs (the last group padded with zero columns).
///
/// For group `g` and block `b` (index `gb = g · blocks_per_row + b`):
/// - `d[gb·8 + j]` and `m[gb·8 + j]` are column `8g + j`'s scale and minimum;
/// - Q4: the 128 code bytes at `gb·128`: byte `32t + 4j + e` is byte `4t + e` of column `j`'s
///   GGUF block (low nibble: element `4t + e`, high nibble: element `16 + 4t + e`);
/// - Q8: the 256 code bytes at `gb·256`: byte `32k + 4j + e` is element `4k + e` of column
///   `j`, stored `+128` (unsigned), the operand form of `vpdpbusd`.
#[derive(Clone, Debug)]
pub struct QWeight {
    /// Storage format.
    pub format: WeightFormat,
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of 32).
    pub cols: usize,
    /// Per group and block: the eight columns' scales, as f16 bits (GGUF's own precision;
    /// half the bytes of f32, which decode at batch 1 reads for every token).
    d: Vec<u16>,
    /// Per group and block: the eight columns' minimums (Q4 only), as f16 bits.
    m: Vec<u16>,
    /// Interleaved codes, as described above.
    q: Vec<u8>,
}

/// Why a tensor cannot be used as a quantized weight.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A type with no kernel here.
    #[error("weight type {0:?} is not supported (Q4_0, Q4_1 and Q8_0 are)")]
    Unsupported(GgmlDType),
    /// Shape not a matrix with a multiple of 32 inputs.
    #[error("weight shape {0:?} is not [rows, cols] with cols a multiple of 32")]
    Shape(Vec<usize>),
    /// candle failed to hand over the data.
    #[error("reading weight data: {0}")]
    Candle(#[from] candle_core::Error),
}

fn f16(lo: u8, hi: u8) -> f32 {
    from_f16(u16::from_le_bytes([lo, hi]))
}

fn from_f16(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// One column's block in GGUF order: scale, minimum (Q4) and code bytes (Q4: 16 bytes, element
/// `i` in the low nibble of byte `i` and element `i + 16` in its high nibble; Q8: 32 signed
/// bytes).
#[derive(Clone, Copy, Debug)]
pub struct NaturalBlock<'a> {
    /// Scale.
    pub d: f32,
    /// Minimum (Q4; ignored for Q8).
    pub m: f32,
    /// Code bytes.
    pub codes: &'a [u8],
}

impl QWeight {
    /// Packs a matrix from its blocks in GGUF order, given as `block(row, b)`. Scales and
    /// minimums are kept as f16, as GGUF stores them (`Q4_0`'s `-8d` is exact in f16 too).
    pub fn pack<'a>(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        block: impl Fn(usize, usize) -> NaturalBlock<'a>,
    ) -> Self {
        assert_eq!(cols % BLOCK, 0, "inputs must be a multiple of the block size");
        let bpr = cols / BLOCK;
        let groups = rows.div_ceil(GROUP);
        let cb = format.code_bytes();
        let mut w = Self {
            format,
            rows,
            cols,
            d: vec![0; groups * bpr * GROUP],
            m: vec![0; if format == WeightFormat::Q4 { groups * bpr * GROUP } else { 0 }],
            // Padding columns: Q4 code 0, Q8 code 0 stored as 128; their scales are zero.
            q: vec![if format == WeightFormat::Q8 { 0x80 } else { 0 }; groups * bpr * GROUP * cb],
        };
        for r in 0..rows {
            let (g, j) = (r / GROUP, r % GROUP);
            for b in 0..bpr {
                let gb = g * bpr + b;
                let nb = block(r, b);
                debug_assert_eq!(nb.codes.len(), cb);
                w.d[gb * GROUP + j] = half::f16::from_f32(nb.d).to_bits();
                let base = gb * GROUP * cb;
                match format {
                    WeightFormat::Q4 => {
                        w.m[gb * GROUP + j] = half::f16::from_f32(nb.m).to_bits();
                        for t in 0..4 {
                            let at = base + 32 * t + 4 * j;
                            w.q[at..at + 4].copy_from_slice(&nb.codes[4 * t..4 * t + 4]);
                        }
                    }
                    WeightFormat::Q8 => {
                        for k in 0..8 {
                            let at = base + 32 * k + 4 * j;
                            for e in 0..4 {
                                w.q[at + e] = nb.codes[4 * k + e] ^ 0x80;
                            }
                        }
                    }
                }
            }
        }
        w
    }

    /// Takes a GGUF tensor's blocks (`Q4_0`, `Q4_1`, `Q8_0`) and packs them.
    pub fn from_qtensor(t: &QTensor) -> Result<Self, KernelError> {
        let dims = t.shape().dims().to_vec();
        let [rows, cols] = dims[..] else { return Err(KernelError::Shape(dims)) };
        if cols % BLOCK != 0 {
            return Err(KernelError::Shape(dims));
        }
        let data = t.data()?;
        let bpr = cols / BLOCK;
        let (format, block_bytes) = match t.dtype() {
            GgmlDType::Q4_0 => (WeightFormat::Q4, 18),
            GgmlDType::Q4_1 => (WeightFormat::Q4, 20),
            GgmlDType::Q8_0 => (WeightFormat::Q8, 34),
            other => return Err(KernelError::Unsupported(other)),
        };
        if data.len() != rows * bpr * block_bytes {
            return Err(KernelError::Shape(dims));
        }
        let dtype = t.dtype();
        Ok(Self::pack(format, rows, cols, |r, b| {
            let raw = &data[(r * bpr + b) * block_bytes..(r * bpr + b + 1) * block_bytes];
            let d = f16(raw[0], raw[1]);
            match dtype {
                GgmlDType::Q4_0 => NaturalBlock { d, m: -8.0 * d, codes: &raw[2..18] },
                GgmlDType::Q4_1 => NaturalBlock { d, m: f16(raw[2], raw[3]), codes: &raw[4..20] },
                _ => NaturalBlock { d, m: 0.0, codes: &raw[2..34] },
            }
        }))
    }

    fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    /// Groups of [`GROUP`] output columns (the last one possibly padded).
    fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// Row `r`'s block `b` in GGUF order: scale, minimum and code bytes (written to `codes`).
    fn natural_block(&self, r: usize, b: usize, codes: &mut [u8; 32]) -> (f32, f32) {
        let (g, j) = (r / GROUP, r % GROUP);
        let gb = g * self.blocks_per_row() + b;
        let base = gb * GROUP * self.format.code_bytes();
        match self.format {
            WeightFormat::Q4 => {
                for t in 0..4 {
                    let at = base + 32 * t + 4 * j;
                    codes[4 * t..4 * t + 4].copy_from_slice(&self.q[at..at + 4]);
                }
                (from_f16(self.d[gb * GROUP + j]), from_f16(self.m[gb * GROUP + j]))
            }
            WeightFormat::Q8 => {
                for k in 0..8 {
                    let at = base + 32 * k + 4 * j;
                    for e in 0..4 {
                        codes[4 * k + e] = self.q[at + e] ^ 0x80;
                    }
                }
                (from_f16(self.d[gb * GROUP + j]), 0.0)
            }
        }
    }

    /// The dequantized weight row `r` (for embeddings and tests).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let mut codes = [0u8; 32];
        for b in 0..self.blocks_per_row() {
            let (d, m) = self.natural_block(r, b, &mut codes);
            let dst = &mut out[b * BLOCK..(b + 1) * BLOCK];
            match self.format {
                WeightFormat::Q4 => {
                    for i in 0..16 {
                        dst[i] = d.mul_add(f32::from(codes[i] & 0x0F), m);
                        dst[i + 16] = d.mul_add(f32::from(codes[i] >> 4), m);
                    }
                }
                WeightFormat::Q8 => {
                    for i in 0..32 {
                        dst[i] = d * f32::from(codes[i] as i8);
                    }
                }
            }
        }
    }

    /// Stacks matrices with the same format and inputs into one (their rows one after the
    /// other), so one product computes them all: Q, K and V, or gate and up.
    pub fn concat(parts: &[&QWeight]) -> Option<QWeight> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.format != first.format || p.cols != first.cols) {
            return None;
        }
        let bpr = first.blocks_per_row();
        let cb = first.format.code_bytes();
        // Row by row in GGUF order, then packed again.
        let mut d = Vec::new();
        let mut m = Vec::new();
        let mut codes = Vec::new();
        let mut block = [0u8; 32];
        for p in parts {
            for r in 0..p.rows {
                for b in 0..bpr {
                    let (bd, bm) = p.natural_block(r, b, &mut block);
                    d.push(bd);
                    m.push(bm);
                    codes.extend_from_slice(&block[..cb]);
                }
            }
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        Some(Self::pack(first.format, rows, first.cols, |r, b| {
            let i = r * bpr + b;
            NaturalBlock { d: d[i], m: m[i], codes: &codes[i * cb..(i + 1) * cb] }
        }))
    }

    /// Bytes of weight data (for the memory report).
    pub fn bytes(&self) -> usize {
        self.q.len() + 2 * (self.d.len() + self.m.len())
    }
}

/// Largest activation code: `255 · 127 + 127`, so both bytes of `255·hi + lo` stay in
/// `[-127, 127]` (the AVX2 sign trick cannot negate -128).
const ACT_MAX: f32 = 32512.0;

/// Activation rows quantized to 16-bit codes per block of 32, each code `x = 255·hi + lo`.
#[derive(Clone, Debug, Default)]
pub struct QActs {
    /// Rows.
    pub rows: usize,
    /// Columns (a multiple of 32).
    pub cols: usize,
    /// Per block, 64 bytes: the 32 high bytes, then the 32 low bytes.
    q: Vec<i8>,
    /// Per block: scale.
    d: Vec<f32>,
    /// Per block: `d · Σx` (what a Q4 weight's minimum multiplies).
    s: Vec<f32>,
    /// Per block: `128 · Σx`, which the VNNI path takes off to undo the `+128` of Q8 codes.
    bias: Vec<i32>,
}

impl QActs {
    /// Quantizes `x` (`rows × cols`, row-major) into `self`, reusing its buffers.
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize) {
        /// Blocks per task when a large batch (prefill) is split over the pool.
        const PER_TASK: usize = 64;
        debug_assert_eq!(x.len(), rows * cols);
        debug_assert_eq!(cols % BLOCK, 0);
        let nblocks = rows * cols / BLOCK;
        self.rows = rows;
        self.cols = cols;
        self.q.resize(nblocks * 2 * BLOCK, 0);
        self.d.resize(nblocks, 0.0);
        self.s.resize(nblocks, 0.0);
        self.bias.resize(nblocks, 0);
        // Blocks are independent: large batches (prefill) split them over the pool.
        x.par_chunks(PER_TASK * BLOCK)
            .zip(self.q.par_chunks_mut(PER_TASK * 2 * BLOCK))
            .zip(self.d.par_chunks_mut(PER_TASK))
            .zip(self.s.par_chunks_mut(PER_TASK))
            .zip(self.bias.par_chunks_mut(PER_TASK))
            .for_each(|((((x, q), d), s), bias)| quantize_blocks(x, QBlocks { q, d, s, bias }));
    }

    /// The 16-bit code of element `e` of block `b` (blocks numbered over all rows).
    #[inline]
    fn code(&self, b: usize, e: usize) -> i32 {
        let block = &self.q[b * 2 * BLOCK..(b + 1) * 2 * BLOCK];
        255 * i32::from(block[e]) + i32::from(block[BLOCK + e])
    }
}

/// Destination slices for a run of quantized blocks (parts of a [`QActs`]' buffers).
struct QBlocks<'a> {
    q: &'a mut [i8],
    d: &'a mut [f32],
    s: &'a mut [f32],
    bias: &'a mut [i32],
}

/// Quantizes the blocks of `x` into `out`, with the AVX2 build where the CPU has it.
fn quantize_blocks(x: &[f32], out: QBlocks) {
    #[cfg(target_arch = "x86_64")]
    if x86::detect().is_some() {
        // SAFETY: AVX2 was detected at run time.
        unsafe { x86::quantize(x, out) };
        return;
    }
    quantize_scalar(x, out);
}

/// The quantization proper, written so that it vectorises where the caller enables AVX2 (the
/// operations are the same either way, so are the codes): per block, `d = max|x| / ACT_MAX`,
/// codes rounded to nearest (ties to even), split into `hi = round(code / 255)` (exact: an
/// integer code is never within 0.002 of a tie) and `lo = code - 255·hi`.
#[inline(always)]
fn quantize_scalar(x: &[f32], acts: QBlocks) {
    for (b, block) in x.chunks_exact(BLOCK).enumerate() {
        let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / ACT_MAX;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let (hi, lo) = acts.q[b * 2 * BLOCK..(b + 1) * 2 * BLOCK].split_at_mut(BLOCK);
        let mut sum = 0i32;
        for ((v, h), l) in block.iter().zip(hi.iter_mut()).zip(lo.iter_mut()) {
            let code = (v * inv).round_ties_even().clamp(-ACT_MAX, ACT_MAX);
            let high = (code / 255.0).round_ties_even();
            let (code, high) = (code as i32, high as i32);
            *h = high as i8;
            *l = (code - 255 * high) as i8;
            sum += code;
        }
        acts.d[b] = d;
        acts.s[b] = d * sum as f32;
        acts.bias[b] = 128 * sum;
    }
}

/// A raw pointer that may cross to rayon's threads; each thread writes a disjoint column range.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: the threads write disjoint elements (distinct output columns), and the buffer
// outlives the parallel section that uses the pointer.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Fewest column groups per parallel task, so tiny products are not split into tasks that
/// cost more to schedule than to compute.
const MIN_GROUPS_PER_TASK: usize = 2;

/// `out[r, o] = Σ_k x[r, k] · w[o, k]` for every row of `x` and every output `o`;
/// `out` is `x.rows × w.rows`, row-major.
pub fn matmul(x: &QActs, w: &QWeight, out: &mut [f32]) {
    matmul_with(x, w, out, Kernel::best());
}

/// Which implementation computes a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// Scalar Rust, for any CPU.
    Portable,
    /// An x86 SIMD kernel.
    #[cfg(target_arch = "x86_64")]
    X86(x86::Isa),
}

impl Kernel {
    fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        if let Some(isa) = x86::detect() {
            return Kernel::X86(isa);
        }
        Kernel::Portable
    }
}

fn matmul_with(x: &QActs, w: &QWeight, out: &mut [f32], kernel: Kernel) {
    assert_eq!(x.cols, w.cols, "activation width must match the weight's inputs");
    assert_eq!(out.len(), x.rows * w.rows, "output buffer must be rows × outputs");
    let ptr = OutPtr(out.as_mut_ptr());
    let groups = w.groups();
    // A few tasks per thread balance the load; more only add scheduling cost.
    let tasks = (rayon::current_num_threads() * 3).min(groups.div_ceil(MIN_GROUPS_PER_TASK)).max(1);
    let per_task = groups.div_ceil(tasks);
    (0..tasks).into_par_iter().for_each(move |t| {
        let range = t * per_task..((t + 1) * per_task).min(groups);
        // SAFETY: task `t` writes only the columns of groups in `range`; tasks do not overlap.
        unsafe { matmul_groups(x, w, range, ptr, kernel) };
    });
}

/// Computes the output columns of column groups `groups`, for every row.
///
/// # Safety
/// `out` must point to `x.rows × w.rows` floats, no other thread may write these columns, and
/// an x86 kernel must have been detected on this CPU.
unsafe fn matmul_groups(
    x: &QActs,
    w: &QWeight,
    groups: std::ops::Range<usize>,
    out: OutPtr,
    kernel: Kernel,
) {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        Kernel::X86(isa) => unsafe { x86::matmul_groups(isa, x, w, groups, out) },
        Kernel::Portable => {
            for g in groups {
                for o in g * GROUP..((g + 1) * GROUP).min(w.rows) {
                    for r in 0..x.rows {
                        // SAFETY: the caller owns column `o` of every row.
                        unsafe { *out.0.add(r * w.rows + o) = portable::dot(x, r, w, o) };
                    }
                }
            }
        }
    }
}

/// Writes one row's eight sums of group `g` to the output, skipping padding columns.
///
/// # Safety
/// As [`matmul_groups`]: the caller owns these columns of row `r`.
#[inline(always)]
unsafe fn store_group(w: &QWeight, r: usize, g: usize, sums: &[f32; GROUP], out: OutPtr) {
    let n = (w.rows - g * GROUP).min(GROUP);
    // SAFETY: columns `8g .. 8g + n` of row `r` lie inside the output; the caller owns them.
    unsafe {
        std::ptr::copy_nonoverlapping(sums.as_ptr(), out.0.add(r * w.rows + g * GROUP), n);
    }
}

#[cfg(test)]
mod tests;
