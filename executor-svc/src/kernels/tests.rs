use super::*;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn q4_weight(rows: usize, cols: usize, seed: &mut u64) -> QWeight {
    let nblocks = rows * cols / BLOCK;
    let mut w = QWeight { format: WeightFormat::Q4, rows, cols, d: vec![], m: vec![], q: vec![] };
    for _ in 0..nblocks {
        w.d.push(lcg(seed).abs() * 0.1);
        w.m.push(lcg(seed) * 0.2);
        for _ in 0..16 {
            w.q.push((lcg(seed).abs() * 255.0) as u8);
        }
    }
    w
}

fn q8_weight(rows: usize, cols: usize, seed: &mut u64) -> QWeight {
    let nblocks = rows * cols / BLOCK;
    let mut w = QWeight { format: WeightFormat::Q8, rows, cols, d: vec![], m: vec![], q: vec![] };
    for _ in 0..nblocks {
        w.d.push(lcg(seed).abs() * 0.01);
        for _ in 0..32 {
            w.q.push(((lcg(seed) * 127.0) as i8) as u8);
        }
    }
    // The extreme code -128 must work too (|w| = 128 does not fit an i8).
    w.q[0] = (-128i8) as u8;
    w
}

fn check_against_f32(w: &QWeight, rows: usize, seed: &mut u64) {
    let x: Vec<f32> = (0..rows * w.cols).map(|_| lcg(seed)).collect();
    let mut acts = QActs::default();
    acts.quantize(&x, rows, w.cols);
    let mut out = vec![0f32; rows * w.rows];
    matmul(&acts, w, &mut out);
    let mut wrow = vec![0f32; w.cols];
    for o in 0..w.rows {
        w.dequantize_row(o, &mut wrow);
        for r in 0..rows {
            let exact: f32 =
                x[r * w.cols..(r + 1) * w.cols].iter().zip(&wrow).map(|(a, b)| a * b).sum();
            let norm: f32 = wrow.iter().map(|v| v.abs()).sum::<f32>() / w.cols as f32;
            let tol = 0.01 * norm * (w.cols as f32).sqrt() + 1e-4;
            let got = out[r * w.rows + o];
            assert!((got - exact).abs() < tol, "r{r} o{o}: {got} vs {exact} (tol {tol})");
            // The portable path is bit-identical to whatever path matmul took.
            assert_eq!(got.to_bits(), portable::dot(&acts, r, w, o).to_bits());
        }
    }
}

#[test]
fn q4_and_q8_products_match_f32_within_quantization_error() {
    let mut seed = 7;
    check_against_f32(&q4_weight(70, 96, &mut seed), 5, &mut seed);
    check_against_f32(&q8_weight(130, 64, &mut seed), 3, &mut seed);
}

#[test]
fn results_do_not_depend_on_the_batch() {
    let mut seed = 11;
    let w = q4_weight(200, 576, &mut seed);
    let x: Vec<f32> = (0..9 * 576).map(|_| lcg(&mut seed)).collect();
    let mut all = QActs::default();
    all.quantize(&x, 9, 576);
    let mut out_all = vec![0f32; 9 * 200];
    matmul(&all, &w, &mut out_all);
    for r in 0..9 {
        let mut one = QActs::default();
        one.quantize(&x[r * 576..(r + 1) * 576], 1, 576);
        let mut out_one = vec![0f32; 200];
        matmul(&one, &w, &mut out_one);
        for o in 0..200 {
            assert_eq!(out_one[o].to_bits(), out_all[r * 200 + o].to_bits(), "row {r} col {o}");
        }
    }
}
