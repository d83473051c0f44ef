//! Quantized matrix products for the CPU forward, in the llama.cpp style: weights stay in
//! their 4- or 8-bit GGUF blocks, each activation row is quantized to 8 bits per block of 32,
//! and the block dot products are integer sums.
//!
//! Why this and not candle's `QMatMul` or an f32 GEMM: candle's Q4_1 path runs at about
//! 9 GFLOP/s on this model's shapes and f32 weights are memory-bound at batch 1 (540 MB read
//! per token). Integer block dots read 85 MB per token and vectorise well.
//!
//! Determinism, which the sampler's seeded reproducibility rests on: every output element is
//! computed by the same sequence of operations whatever the batch size, the row or column
//! tiling, the thread split, or the instruction set (AVX2 or the portable path). Integer sums
//! are exact; the float accumulation mimics eight SIMD lanes in a fixed order (lane `j` holds
//! elements `4j..4j+4` of each block) and ends with one fixed reduction. So a request's logits
//! do not depend on what else is in its batch, and the reference forward, which uses these
//! same kernels, can be compared bit for bit.

mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

use candle_core::quantized::{GgmlDType, QTensor};
use rayon::prelude::*;

/// Elements per quantization block.
pub const BLOCK: usize = 32;

/// How a weight matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// 4-bit unsigned codes with a scale and a minimum per block: `w = d·q + m`
    /// (GGUF Q4_1; Q4_0 maps onto it with `m = -8d`).
    Q4,
    /// 8-bit signed codes with a scale per block: `w = d·q` (GGUF Q8_0).
    Q8,
}

/// A weight matrix `[rows (outputs), cols (inputs)]` in blocks of 32 along the inputs.
#[derive(Clone, Debug)]
pub struct QWeight {
    /// Storage format.
    pub format: WeightFormat,
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of 32).
    pub cols: usize,
    /// Per block: scale.
    d: Vec<f32>,
    /// Per block: minimum (Q4 only).
    m: Vec<f32>,
    /// Codes: Q4 packs 16 bytes per block (element i < 16 in the low nibble of byte i,
    /// element i + 16 in its high nibble); Q8 stores 32 signed bytes per block.
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
    half::f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

impl QWeight {
    /// Takes a GGUF tensor's blocks as they are (Q4_0, Q4_1, Q8_0).
    pub fn from_qtensor(t: &QTensor) -> Result<Self, KernelError> {
        let dims = t.shape().dims().to_vec();
        let [rows, cols] = dims[..] else { return Err(KernelError::Shape(dims)) };
        if cols % BLOCK != 0 {
            return Err(KernelError::Shape(dims));
        }
        let data = t.data()?;
        let nblocks = rows * cols / BLOCK;
        let (format, block_bytes) = match t.dtype() {
            GgmlDType::Q4_0 => (WeightFormat::Q4, 18),
            GgmlDType::Q4_1 => (WeightFormat::Q4, 20),
            GgmlDType::Q8_0 => (WeightFormat::Q8, 34),
            other => return Err(KernelError::Unsupported(other)),
        };
        if data.len() != nblocks * block_bytes {
            return Err(KernelError::Shape(dims));
        }
        let mut w = Self {
            format,
            rows,
            cols,
            d: Vec::with_capacity(nblocks),
            m: Vec::with_capacity(if format == WeightFormat::Q4 { nblocks } else { 0 }),
            q: Vec::with_capacity(nblocks * if format == WeightFormat::Q4 { 16 } else { 32 }),
        };
        for b in data.chunks_exact(block_bytes) {
            let d = f16(b[0], b[1]);
            w.d.push(d);
            match t.dtype() {
                GgmlDType::Q4_0 => {
                    w.m.push(-8.0 * d);
                    w.q.extend_from_slice(&b[2..18]);
                }
                GgmlDType::Q4_1 => {
                    w.m.push(f16(b[2], b[3]));
                    w.q.extend_from_slice(&b[4..20]);
                }
                _ => w.q.extend_from_slice(&b[2..34]),
            }
        }
        Ok(w)
    }

    fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    /// The dequantized weight row `r` (for embeddings and tests).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let bpr = self.blocks_per_row();
        for b in 0..bpr {
            let blk = r * bpr + b;
            let dst = &mut out[b * BLOCK..(b + 1) * BLOCK];
            match self.format {
                WeightFormat::Q4 => {
                    let q = &self.q[blk * 16..blk * 16 + 16];
                    for i in 0..16 {
                        dst[i] = self.d[blk].mul_add(f32::from(q[i] & 0x0F), self.m[blk]);
                        dst[i + 16] = self.d[blk].mul_add(f32::from(q[i] >> 4), self.m[blk]);
                    }
                }
                WeightFormat::Q8 => {
                    let q = &self.q[blk * 32..blk * 32 + 32];
                    for i in 0..32 {
                        dst[i] = self.d[blk] * f32::from(q[i] as i8);
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
        let mut out = QWeight {
            format: first.format,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            d: Vec::new(),
            m: Vec::new(),
            q: Vec::new(),
        };
        for p in parts {
            out.d.extend_from_slice(&p.d);
            out.m.extend_from_slice(&p.m);
            out.q.extend_from_slice(&p.q);
        }
        Some(out)
    }

    /// Bytes of weight data (for the memory report).
    pub fn bytes(&self) -> usize {
        self.q.len() + 4 * (self.d.len() + self.m.len())
    }
}

/// Activation rows quantized to 8 bits per block of 32.
#[derive(Clone, Debug, Default)]
pub struct QActs {
    /// Rows.
    pub rows: usize,
    /// Columns (a multiple of 32).
    pub cols: usize,
    /// Codes, 32 per block.
    q: Vec<i8>,
    /// Per block: scale.
    d: Vec<f32>,
    /// Per block: `d · Σq` (what a Q4 weight's minimum multiplies).
    s: Vec<f32>,
    /// Per block: the integer sum of each lane of four codes (8 per block), which the VNNI
    /// path needs to undo its unsigned bias on Q8 weights.
    lane_sums: Vec<i32>,
}

impl QActs {
    /// Quantizes `x` (`rows × cols`, row-major) into `self`, reusing its buffers.
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize) {
        debug_assert_eq!(x.len(), rows * cols);
        debug_assert_eq!(cols % BLOCK, 0);
        let nblocks = rows * cols / BLOCK;
        self.rows = rows;
        self.cols = cols;
        self.q.resize(nblocks * BLOCK, 0);
        self.d.resize(nblocks, 0.0);
        self.s.resize(nblocks, 0.0);
        self.lane_sums.resize(nblocks * 8, 0);
        for (b, block) in x.chunks_exact(BLOCK).enumerate() {
            let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (dst, v) in self.q[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(block) {
                let q = (v * inv).round() as i8;
                *dst = q;
                sum += i32::from(q);
            }
            self.d[b] = d;
            self.s[b] = d * sum as f32;
            let codes = &self.q[b * BLOCK..(b + 1) * BLOCK];
            for (lane, sum) in self.lane_sums[b * 8..(b + 1) * 8].iter_mut().enumerate() {
                *sum = codes[4 * lane..4 * lane + 4].iter().map(|c| i32::from(*c)).sum();
            }
        }
    }
}

/// A raw pointer that may cross to rayon's threads; each thread writes a disjoint column range.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: the threads write disjoint elements (distinct output columns), and the buffer
// outlives the parallel section that uses the pointer.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Fewest output columns per parallel task, so tiny products are not split into tasks that
/// cost more to schedule than to compute.
const MIN_COLS_PER_TASK: usize = 16;

/// `out[r, o] = Σ_k x[r, k] · w[o, k]` for every row of `x` and every output `o`;
/// `out` is `x.rows × w.rows`, row-major.
pub fn matmul(x: &QActs, w: &QWeight, out: &mut [f32]) {
    assert_eq!(x.cols, w.cols, "activation width must match the weight's inputs");
    assert_eq!(out.len(), x.rows * w.rows, "output buffer must be rows × outputs");
    let ptr = OutPtr(out.as_mut_ptr());
    // A few tasks per thread balance the load; more only add scheduling cost.
    let tasks = (rayon::current_num_threads() * 3).min(w.rows.div_ceil(MIN_COLS_PER_TASK)).max(1);
    let per_task = w.rows.div_ceil(tasks);
    (0..tasks).into_par_iter().for_each(move |t| {
        let cols = t * per_task..((t + 1) * per_task).min(w.rows);
        // SAFETY: task `t` writes only columns in `cols` of each row; tasks do not overlap.
        unsafe { matmul_cols(x, w, cols, ptr) };
    });
}

/// Computes output columns `cols` of every row, in tiles of rows × columns.
///
/// # Safety
/// `out` must point to `x.rows × w.rows` floats, and no other thread may write these columns.
unsafe fn matmul_cols(x: &QActs, w: &QWeight, cols: std::ops::Range<usize>, out: OutPtr) {
    #[cfg(target_arch = "x86_64")]
    if let Some(isa) = x86::detect() {
        // SAFETY: the instruction set was detected at run time; the caller owns `cols`.
        unsafe { x86::matmul_cols(isa, x, w, cols, out) };
        return;
    }
    for o in cols {
        for r in 0..x.rows {
            // SAFETY: the caller owns column `o` of every row.
            unsafe { *out.0.add(r * w.rows + o) = portable::dot(x, r, w, o) };
        }
    }
}

/// `Σ_b m[b] · s[b]`: the Q4 minimum's share of a dot product, in eight running sums with plain
/// multiplies and adds, the same code on every path.
#[inline(never)]
fn min_term(m: &[f32], s: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (mc, sc) in m.chunks(8).zip(s.chunks(8)) {
        for l in 0..mc.len() {
            acc[l] += mc[l] * sc[l];
        }
    }
    reduce_lanes(acc)
}

/// The fixed reduction of eight lane accumulators that both paths end with.
#[inline(always)]
fn reduce_lanes(a: [f32; 8]) -> f32 {
    let q = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let h = [q[0] + q[2], q[1] + q[3]];
    h[0] + h[1]
}

#[cfg(test)]
mod tests;
