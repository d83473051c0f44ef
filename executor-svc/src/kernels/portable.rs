//! The portable block dot product: the same arithmetic as the SIMD path, written element by
//! element, so results are bit-identical on machines without AVX2.

use super::{QActs, QWeight, WeightFormat, BLOCK};

/// One output element: row `r` of `x` against weight row `o`.
pub fn dot(x: &QActs, r: usize, w: &QWeight, o: usize) -> f32 {
    let bpr = w.cols / BLOCK;
    let mut codes = [0u8; 32];
    let mut acc = 0f32;
    for b in 0..bpr {
        let xb = r * bpr + b;
        let (d, m) = w.natural_block(o, b, &mut codes);
        let isum: i32 = match w.format {
            WeightFormat::Q4 => (0..16)
                .map(|i| {
                    i32::from(codes[i] & 0x0F) * x.code(xb, i)
                        + i32::from(codes[i] >> 4) * x.code(xb, i + 16)
                })
                .sum(),
            WeightFormat::Q8 => (0..32).map(|i| i32::from(codes[i] as i8) * x.code(xb, i)).sum(),
        };
        acc = (isum as f32).mul_add(d * x.d[xb], acc);
        if w.format == WeightFormat::Q4 {
            acc = m.mul_add(x.s[xb], acc);
        }
    }
    acc
}
