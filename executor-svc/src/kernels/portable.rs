//! The portable block dot product: the same arithmetic as the SIMD path, written lane by lane,
//! so results are bit-identical on machines without AVX2.

use super::{min_term, reduce_lanes, QActs, QWeight, WeightFormat, BLOCK};

/// One output element: row `r` of `x` against weight row `o`.
pub fn dot(x: &QActs, r: usize, w: &QWeight, o: usize) -> f32 {
    let bpr = w.cols / BLOCK;
    let mut acc = [0f32; 8];
    for b in 0..bpr {
        let (xb, wb) = (r * bpr + b, o * bpr + b);
        let xq = &x.q[xb * BLOCK..(xb + 1) * BLOCK];
        let dd = w.d[wb] * x.d[xb];
        match w.format {
            WeightFormat::Q4 => {
                let wq = &w.q[wb * 16..wb * 16 + 16];
                let code =
                    |e: usize| i32::from(if e < 16 { wq[e] & 0x0F } else { wq[e - 16] >> 4 });
                for (j, a) in acc.iter_mut().enumerate() {
                    let isum: i32 = (4 * j..4 * j + 4).map(|e| code(e) * i32::from(xq[e])).sum();
                    *a = (isum as f32).mul_add(dd, *a);
                }
            }
            WeightFormat::Q8 => {
                let wq = &w.q[wb * 32..wb * 32 + 32];
                for (j, a) in acc.iter_mut().enumerate() {
                    let isum: i32 =
                        (4 * j..4 * j + 4).map(|e| i32::from(wq[e] as i8) * i32::from(xq[e])).sum();
                    *a = (isum as f32).mul_add(dd, *a);
                }
            }
        }
    }
    let min = match w.format {
        WeightFormat::Q4 => min_term(&w.m[o * bpr..(o + 1) * bpr], &x.s[r * bpr..(r + 1) * bpr]),
        WeightFormat::Q8 => 0.0,
    };
    reduce_lanes(acc) + min
}
