//! The portable product: the same arithmetic as the SIMD paths (the kernels' module head),
//! written element by element, so results are bit-identical on machines without AVX2.

use super::{code_at, from_f16, QWeight, WeightFormat, BLOCK, GROUP};

/// One output element: activation row `x` against weight column `o`.
pub fn dot(x: &[f32], w: &QWeight, o: usize) -> f32 {
    let (g, j) = (o / GROUP, o % GROUP);
    let bpr = w.cols / BLOCK;
    let mut acc = 0f32;
    for (b, xb) in x.chunks_exact(BLOCK).enumerate() {
        let gb = g * bpr + b;
        let d = from_f16(w.d[gb * GROUP + j]);
        let p = match w.format {
            WeightFormat::Q4 => {
                let codes = &w.q[gb * GROUP * 16..(gb + 1) * GROUP * 16];
                xb.iter().enumerate().fold(0f32, |p, (k, &v)| {
                    let byte = codes[code_at(k % 16, j)];
                    v.mul_add(f32::from(if k < 16 { byte & 0x0F } else { byte >> 4 }), p)
                })
            }
            WeightFormat::Q8 => {
                let codes = &w.q[gb * GROUP * 32..(gb + 1) * GROUP * 32];
                xb.iter()
                    .enumerate()
                    .fold(0f32, |p, (k, &v)| v.mul_add(f32::from(codes[code_at(k, j)] as i8), p))
            }
        };
        acc = p.mul_add(d, acc);
        if w.format == WeightFormat::Q4 {
            acc = block_sum(xb).mul_add(from_f16(w.m[gb * GROUP + j]), acc);
        }
    }
    acc
}

/// A block's activations summed in order from 0.
pub fn block_sum(xb: &[f32]) -> f32 {
    xb.iter().fold(0f32, |s, &v| s + v)
}
