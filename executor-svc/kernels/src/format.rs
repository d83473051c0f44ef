//! The weight types: the packed forms the kernels read ([`WeightFormat`], and [`kind`], the same
//! as const parameters), and the conversion of each GGUF type's blocks into them, every weight
//! the value llama.cpp's dequantization gives (the float types' weights kept as they are).

use candle_core::quantized::GgmlDType;

use crate::Param;

/// How a weight matrix is stored: the packed forms the kernels read, each exactly the values
/// of one or more GGUF types (see [`QWeight::from_gguf`]). Blocks are 32 inputs; a block's
/// parameters are kept as GGUF keeps them: an f16 each (the legacy types), or (the "wide"
/// k-quants) a super-block's f16 scale times the block's integer factor, multiplied — exactly,
/// in f32 — as the kernel reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// 4-bit unsigned codes with an f16 scale and minimum per block: `w = d·q + m`
    /// (GGUF `Q4_1`; `Q4_0` maps onto it with `m = -8d`).
    Q4,
    /// 8-bit signed codes with an f16 scale per block: `w = d·q` (GGUF `Q8_0`; `Q5_0` with its
    /// codes less 16).
    Q8,
    /// 4-bit unsigned codes with a factored scale and minimum per block (GGUF `Q4_K`).
    Q4K,
    /// 5-bit unsigned codes in bytes with a factored scale and minimum per block (GGUF `Q5_K`;
    /// `Q5_1`, its f16 parameters times 1).
    Q5K,
    /// 6-bit signed codes in bytes with a factored scale per 16 inputs: `w = d·q` with the
    /// first half's `d` in the scale's place and the second half's in the minimum's (GGUF
    /// `Q6_K`).
    Q6K,
    /// The weights themselves as IEEE half floats, no scale (`d = 1`; GGUF `F16`).
    F16,
    /// The weights themselves as bfloat16, no scale (GGUF `BF16`).
    BF16,
    /// The weights themselves as f32, no scale (GGUF `F32`).
    F32,
}

/// The packed forms as the kernels' const parameters (a `match` on them compiles away).
pub mod kind {
    use crate::BLOCK;

    /// [`super::WeightFormat::Q4`].
    pub const Q4: u8 = 0;
    /// [`super::WeightFormat::Q8`].
    pub const Q8: u8 = 1;
    /// [`super::WeightFormat::Q4K`].
    pub const Q4K: u8 = 2;
    /// [`super::WeightFormat::Q5K`].
    pub const Q5K: u8 = 3;
    /// [`super::WeightFormat::Q6K`].
    pub const Q6K: u8 = 4;
    /// [`super::WeightFormat::F16`].
    pub const F16: u8 = 5;
    /// [`super::WeightFormat::BF16`].
    pub const BF16: u8 = 6;
    /// [`super::WeightFormat::F32`].
    pub const F32: u8 = 7;

    /// Whether codes are bytes (else nibbles: input `i` in the low nibble of byte `i`, input
    /// `i + 16` in its high nibble).
    pub const fn bytes(f: u8) -> bool {
        matches!(f, Q8 | Q5K | Q6K)
    }

    /// Whether the codes are the weights as floats of [`float_bytes`] bytes, with no
    /// parameters (a scale of 1).
    pub const fn float(f: u8) -> bool {
        matches!(f, F16 | BF16 | F32)
    }

    /// Code bytes per block of one column.
    pub const fn code_bytes(f: u8) -> usize {
        if float(f) {
            BLOCK * float_bytes(f)
        } else if bytes(f) {
            BLOCK
        } else {
            BLOCK / 2
        }
    }

    /// Bytes of one float code (0 for integer codes).
    pub const fn float_bytes(f: u8) -> usize {
        match f {
            F16 | BF16 => 2,
            F32 => 4,
            _ => 0,
        }
    }

    /// Whether a block has a minimum (`acc += s_b · m`, `s_b` the block's activation sum).
    pub const fn has_min(f: u8) -> bool {
        matches!(f, Q4 | Q4K | Q5K)
    }

    /// Whether the parameters are factored: an f16 scale times an integer (else an f16).
    pub const fn wide(f: u8) -> bool {
        matches!(f, Q4K | Q5K | Q6K)
    }

    /// Whether each half block (16 inputs) has its own scale.
    pub const fn halves(f: u8) -> bool {
        f == Q6K
    }
}

impl WeightFormat {
    /// Its kernel constant.
    pub const fn kind(self) -> u8 {
        match self {
            WeightFormat::Q4 => kind::Q4,
            WeightFormat::Q8 => kind::Q8,
            WeightFormat::Q4K => kind::Q4K,
            WeightFormat::Q5K => kind::Q5K,
            WeightFormat::Q6K => kind::Q6K,
            WeightFormat::F16 => kind::F16,
            WeightFormat::BF16 => kind::BF16,
            WeightFormat::F32 => kind::F32,
        }
    }

    /// Code bytes per block of one column.
    pub const fn code_bytes(self) -> usize {
        kind::code_bytes(self.kind())
    }

    /// Whether the codes are the weights as floats (no scale or minimum).
    pub const fn float(self) -> bool {
        kind::float(self.kind())
    }

    /// Whether blocks have a minimum.
    pub const fn has_min(self) -> bool {
        kind::has_min(self.kind())
    }

    /// Whether its parameters are factored (an f16 scale times an integer).
    pub const fn wide(self) -> bool {
        kind::wide(self.kind())
    }

    /// Whether a block has a second parameter (a minimum, or `Q6K`'s second scale).
    pub(crate) const fn two_params(self) -> bool {
        kind::has_min(self.kind()) || kind::halves(self.kind())
    }
}

pub(crate) fn f16(lo: u8, hi: u8) -> f32 {
    from_f16(u16::from_le_bytes([lo, hi]))
}

pub(crate) fn from_f16(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// A float code of kind `f` (its [`kind::float_bytes`] little-endian bytes) as f32, exactly.
pub(crate) fn float_code(f: u8, b: &[u8]) -> f32 {
    match f {
        kind::F16 => f16(b[0], b[1]),
        kind::BF16 => f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16),
        _ => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

/// GGUF's block of each type Ferry reads: elements and bytes.
pub(crate) fn gguf_block(dtype: GgmlDType) -> Option<(usize, usize)> {
    Some(match dtype {
        GgmlDType::Q4_0 => (32, 18),
        GgmlDType::Q4_1 => (32, 20),
        GgmlDType::Q5_0 => (32, 22),
        GgmlDType::Q5_1 => (32, 24),
        GgmlDType::Q8_0 => (32, 34),
        GgmlDType::Q4K => (256, 144),
        GgmlDType::Q5K => (256, 176),
        GgmlDType::Q6K => (256, 210),
        GgmlDType::F16 | GgmlDType::BF16 => (32, 64),
        GgmlDType::F32 => (32, 128),
        _ => return None,
    })
}

/// The packed form of a GGUF type.
pub(crate) fn format_of(dtype: GgmlDType) -> WeightFormat {
    match dtype {
        GgmlDType::Q4_0 | GgmlDType::Q4_1 => WeightFormat::Q4,
        GgmlDType::Q5_0 | GgmlDType::Q8_0 => WeightFormat::Q8,
        GgmlDType::Q4K => WeightFormat::Q4K,
        GgmlDType::Q5_1 | GgmlDType::Q5K => WeightFormat::Q5K,
        GgmlDType::F16 => WeightFormat::F16,
        GgmlDType::BF16 => WeightFormat::BF16,
        GgmlDType::F32 => WeightFormat::F32,
        _ => WeightFormat::Q6K,
    }
}

/// A k-quant's 6-bit scale and minimum of sub-block `j` (llama.cpp's `get_scale_min_k4`).
fn scale_min_k4(j: usize, s: &[u8]) -> (i8, i8) {
    let (sc, m) = if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    };
    // Six bits: positive as i8.
    (sc as i8, m as i8)
}

/// Decodes one GGUF block of `dtype` into blocks of 32 in the packed form's natural order:
/// `push(d, m, codes)` for each, in order. A k-quant's scale and minimum are an f16 times a 6-
/// or 8-bit integer (exact in f32), and so is every `d·q`.
pub(crate) fn decode_block(
    dtype: GgmlDType,
    raw: &[u8],
    push: &mut impl FnMut(Param, Param, &[u8]),
) {
    let half = |i: usize| f16(raw[i], raw[i + 1]);
    let plain = Param::plain;
    let mut codes = [0u8; 32];
    match dtype {
        GgmlDType::Q4_0 => push(plain(half(0)), plain(-8.0 * half(0)), &raw[2..18]),
        GgmlDType::Q4_1 => push(plain(half(0)), plain(half(2)), &raw[4..20]),
        GgmlDType::Q8_0 => push(plain(half(0)), plain(0.0), &raw[2..34]),
        // The weights as they are, little-endian: a scale of 1.
        GgmlDType::F16 | GgmlDType::BF16 | GgmlDType::F32 => push(plain(1.0), plain(0.0), raw),
        GgmlDType::Q5_0 | GgmlDType::Q5_1 => {
            let (d, m, at) =
                if dtype == GgmlDType::Q5_0 { (half(0), 0.0, 2) } else { (half(0), half(2), 4) };
            let qh = u32::from_le_bytes([raw[at], raw[at + 1], raw[at + 2], raw[at + 3]]);
            let qs = &raw[at + 4..at + 20];
            for j in 0..16 {
                let lo = (qs[j] & 0xF) | ((((qh >> j) & 1) as u8) << 4);
                let hi = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                (codes[j], codes[j + 16]) = (lo, hi);
            }
            if dtype == GgmlDType::Q5_0 {
                // Signed codes: w = d·(q - 16).
                for c in &mut codes {
                    *c = (*c as i8 - 16) as u8;
                }
            }
            push(plain(d), plain(m), &codes);
        }
        GgmlDType::Q4K | GgmlDType::Q5K => {
            // The minimum is subtracted: `-dmin` (exact) times the block's factor.
            let (d, dmin, scales) = (half(0), half(2), &raw[4..16]);
            let param = |scale: f32, factor: i8| Param { scale, factor };
            let (qh, qs) = if dtype == GgmlDType::Q4K {
                (None, &raw[16..144])
            } else {
                (Some(&raw[16..48]), &raw[48..176])
            };
            for sub in 0..8 {
                let (sc, mn) = scale_min_k4(sub, scales);
                // Sub-block `sub` is the low (even) or high (odd) nibbles of 32 bytes.
                let bytes = &qs[32 * (sub / 2)..32 * (sub / 2) + 32];
                let nib = |l: usize| if sub % 2 == 0 { bytes[l] & 0xF } else { bytes[l] >> 4 };
                match qh {
                    None => {
                        for (i, c) in codes[..16].iter_mut().enumerate() {
                            *c = nib(i) | (nib(i + 16) << 4);
                        }
                        push(param(d, sc), param(-dmin, mn), &codes[..16]);
                    }
                    Some(qh) => {
                        for (l, c) in codes.iter_mut().enumerate() {
                            *c = nib(l) | (((qh[l] >> sub) & 1) << 4);
                        }
                        push(param(d, sc), param(-dmin, mn), &codes);
                    }
                }
            }
        }
        _ => {
            // Q6_K: 256 six-bit codes less 32, a signed 8-bit scale per 16, an f16 scale.
            let (ql, qh, sc, d) = (&raw[..128], &raw[128..192], &raw[192..208], half(208));
            let mut q = [0u8; 256];
            for n in 0..2 {
                let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
                for l in 0..32 {
                    let six = |low: u8, shift: u32| {
                        ((low | (((qh[l] >> shift) & 3) << 4)) as i8 - 32) as u8
                    };
                    q[128 * n + l] = six(ql[l] & 0xF, 0);
                    q[128 * n + l + 32] = six(ql[l + 32] & 0xF, 2);
                    q[128 * n + l + 64] = six(ql[l] >> 4, 4);
                    q[128 * n + l + 96] = six(ql[l + 32] >> 4, 6);
                }
            }
            for b in 0..8 {
                let scale = |i: usize| Param { scale: d, factor: sc[i] as i8 };
                push(scale(2 * b), scale(2 * b + 1), &q[32 * b..32 * b + 32]);
            }
        }
    }
}
