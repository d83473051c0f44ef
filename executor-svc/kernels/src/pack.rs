//! Packing: GGUF blocks (or any blocks in natural order) into a [`QWeight`]'s interleaved
//! groups, every weight exactly the value llama.cpp's dequantization gives, and matrices with
//! the same inputs stacked into one.

use candle_core::quantized::{GgmlDType, QTensor};

use crate::format::{decode_block, format_of, gguf_block};
use crate::{code_at, QWeight, WeightFormat, BLOCK, GROUP, MAX_CODE_BYTES};

/// A block parameter as GGUF stores it: an f16 `scale` times a small integer `factor` (a
/// k-quant's super-block scale and the block's own 6- or 8-bit scale); 1 for the other types.
/// The product is exact in f32.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Param {
    /// The f16 scale (as f32).
    pub scale: f32,
    /// The integer factor.
    pub factor: i8,
}

impl Param {
    /// A parameter with no factor.
    pub const fn plain(scale: f32) -> Self {
        Self { scale, factor: 1 }
    }

    /// Its value, `scale · factor` (exact).
    pub fn value(self) -> f32 {
        self.scale * f32::from(self.factor)
    }
}

/// Why a tensor cannot be used as a quantized weight.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A type with no kernel here.
    #[error(
        "weight type {0:?} is not supported (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, \
         BF16 and F32 are)"
    )]
    Unsupported(GgmlDType),
    /// Shape not a matrix with whole blocks of inputs.
    #[error(
        "weight shape {0:?} is not [rows, cols] with cols a multiple of {1} (its type's block)"
    )]
    Shape(Vec<usize>, usize),
    /// candle failed to hand over the data.
    #[error("reading weight data: {0}")]
    Candle(#[from] candle_core::Error),
}

/// One column's block in the packed form's natural order: scale, minimum (`Q6K`: the second
/// half's scale) and code bytes (nibble codes: 16 bytes, element `i` in the low nibble of byte
/// `i` and element `i + 16` in its high nibble; byte codes: 32 bytes, signed for `Q8` and
/// `Q6K`, unsigned for `Q5K`; float codes: the 32 weights, little-endian, scale 1).
#[derive(Clone, Copy, Debug)]
pub struct NaturalBlock<'a> {
    /// Scale.
    pub d: Param,
    /// Minimum (`Q6K`: the second half's scale; ignored for `Q8`).
    pub m: Param,
    /// Code bytes.
    pub codes: &'a [u8],
}

impl QWeight {
    /// Packs a matrix from its blocks in natural order, given as `block(row, b)`. Scales and
    /// minimums are kept as f16, as GGUF stores them (`Q4_0`'s `-8d` is exact in f16 too); the
    /// narrow formats' parameters are their values, the wide formats' an f16 scale (shared by
    /// the 8 blocks of a super-block where they all share theirs) and an integer factor.
    ///
    /// # Panics
    /// If a wide format's scale is not an f16: it would not be kept exactly.
    pub fn pack<'a>(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        block: impl Fn(usize, usize) -> NaturalBlock<'a>,
    ) -> Self {
        assert_eq!(cols % BLOCK, 0, "inputs must be a multiple of the block size");
        let bpr = cols / BLOCK;
        let params = rows.div_ceil(GROUP) * bpr * GROUP;
        let cb = format.code_bytes();
        let shift = if format.wide() { Self::super_block_shift(rows, bpr, &block) } else { 0 };
        let (scales, factors) = match (format.float(), format.wide()) {
            (true, _) => (0, 0),
            (false, true) => (params >> shift, params),
            (false, false) => (params, 0),
        };
        let second = |n: usize| if format.two_params() { n } else { 0 };
        let mut w = Self {
            format,
            rows,
            cols,
            d: vec![0; scales],
            m: vec![0; second(scales)],
            dq: vec![0; factors],
            mq: vec![0; second(factors)],
            shift,
            // Padding columns: code 0 and scale 0, so weight 0.
            q: vec![0; params * cb],
        };
        let f16_of = |v: f32| half::f16::from_f32(v).to_bits();
        let exact_f16_of = |v: f32| {
            let h = half::f16::from_f32(v);
            assert!(h.to_f32() == v || v.is_nan(), "a k-quant scale {v} is not an f16");
            h.to_bits()
        };
        for r in 0..rows {
            let (g, j) = (r / GROUP, r % GROUP);
            for b in 0..bpr {
                let gb = g * bpr + b;
                let nb = block(r, b);
                debug_assert_eq!(nb.codes.len(), cb);
                let (at, s) = (gb * GROUP + j, (gb >> shift) * GROUP + j);
                if format.float() {
                    debug_assert!(nb.d.value() == 1.0, "float codes have no parameters");
                } else if format.wide() {
                    (w.d[s], w.dq[at]) = (exact_f16_of(nb.d.scale), nb.d.factor);
                    if format.two_params() {
                        (w.m[s], w.mq[at]) = (exact_f16_of(nb.m.scale), nb.m.factor);
                    }
                } else {
                    w.d[at] = f16_of(nb.d.value());
                    if format.has_min() {
                        w.m[at] = f16_of(nb.m.value());
                    }
                }
                let base = gb * GROUP * cb;
                for (i, &code) in nb.codes.iter().enumerate() {
                    w.q[base + code_at(format, i, j)] = code;
                }
            }
        }
        w
    }

    /// 3 where every super-block of 8 blocks shares its scales (a k-quant's), else 0.
    fn super_block_shift<'a>(
        rows: usize,
        bpr: usize,
        block: &impl Fn(usize, usize) -> NaturalBlock<'a>,
    ) -> u32 {
        const SHIFT: u32 = 3;
        let per = 1 << SHIFT;
        let shared = bpr.is_multiple_of(per)
            && (0..rows).all(|r| {
                (0..bpr).all(|b| {
                    let (first, this) = (block(r, b / per * per), block(r, b));
                    let bits = |p: Param| p.scale.to_bits();
                    bits(first.d) == bits(this.d) && bits(first.m) == bits(this.m)
                })
            });
        if shared {
            SHIFT
        } else {
            0
        }
    }

    /// Takes a GGUF tensor's blocks and packs them.
    pub fn from_qtensor(t: &QTensor) -> Result<Self, KernelError> {
        let dims = t.shape().dims().to_vec();
        let [rows, cols] = dims[..] else { return Err(KernelError::Shape(dims, BLOCK)) };
        Self::from_gguf(t.dtype(), rows, cols, &t.data()?)
    }

    /// Packs a `[rows, cols]` matrix from its GGUF data of type `dtype` (`Q4_0`, `Q4_1`,
    /// `Q5_0`, `Q5_1`, `Q8_0`, `Q4_K`, `Q5_K`, `Q6_K`, `F16`, `BF16`, `F32`), every weight
    /// exactly the value llama.cpp's dequantization gives.
    pub fn from_gguf(
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<Self, KernelError> {
        let (elements, block_bytes) = gguf_block(dtype).ok_or(KernelError::Unsupported(dtype))?;
        if !cols.is_multiple_of(elements) {
            return Err(KernelError::Shape(vec![rows, cols], elements));
        }
        if data.len() != rows * cols / elements * block_bytes {
            return Err(KernelError::Shape(vec![rows, cols], elements));
        }
        let format = format_of(dtype);
        let cb = format.code_bytes();
        let blocks = rows * cols / BLOCK;
        let (mut d, mut m, mut codes) = (
            Vec::with_capacity(blocks),
            Vec::with_capacity(blocks),
            Vec::with_capacity(blocks * cb),
        );
        for raw in data.chunks_exact(block_bytes) {
            decode_block(dtype, raw, &mut |bd: Param, bm: Param, c: &[u8]| {
                d.push(bd);
                m.push(bm);
                codes.extend_from_slice(c);
            });
        }
        let bpr = cols / BLOCK;
        Ok(Self::pack(format, rows, cols, |r, b| {
            let i = r * bpr + b;
            NaturalBlock { d: d[i], m: m[i], codes: &codes[i * cb..(i + 1) * cb] }
        }))
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
        // Row by row in natural order, then packed again.
        let mut d = Vec::new();
        let mut m = Vec::new();
        let mut codes = Vec::new();
        let mut block = [0u8; MAX_CODE_BYTES];
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
}
