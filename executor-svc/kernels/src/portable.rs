//! The portable product: the same arithmetic as the SIMD paths (the kernels' module head),
//! written element by element, so results are bit-identical on machines without AVX2.

use super::format::{float_code, kind};
use super::{code_at, QWeight, BLOCK, GROUP};

/// One output element: activation row `x` against weight column `o`.
pub fn dot(x: &[f32], w: &QWeight, o: usize) -> f32 {
    let (g, j) = (o / GROUP, o % GROUP);
    let bpr = w.cols / BLOCK;
    let f = w.format.kind();
    let cb = w.format.code_bytes();
    let mut acc = 0f32;
    for (b, xb) in x.chunks_exact(BLOCK).enumerate() {
        let gb = g * bpr + b;
        let (d, m) = w.params(gb, j);
        let codes = &w.q[gb * GROUP * cb..(gb + 1) * GROUP * cb];
        let code = |k: usize| {
            let size = kind::float_bytes(f);
            if size > 0 {
                let at = code_at(w.format, k * size, j);
                float_code(f, &codes[at..at + size])
            } else if kind::bytes(f) {
                f32::from(codes[code_at(w.format, k, j)] as i8)
            } else {
                let byte = codes[code_at(w.format, k % 16, j)];
                f32::from(if k < 16 { byte & 0x0F } else { byte >> 4 })
            }
        };
        let part = |ks: std::ops::Range<usize>| ks.fold(0f32, |p, k| xb[k].mul_add(code(k), p));
        if kind::halves(f) {
            // A scale per half block: each half's sum times its own.
            acc = part(0..16).mul_add(d, acc);
            acc = part(16..32).mul_add(m, acc);
        } else {
            acc = part(0..32).mul_add(d, acc);
            if kind::has_min(f) {
                acc = block_sum(xb).mul_add(m, acc);
            }
        }
    }
    acc
}

/// A block's activations summed in order from 0.
pub fn block_sum(xb: &[f32]) -> f32 {
    xb.iter().fold(0f32, |s, &v| s + v)
}
