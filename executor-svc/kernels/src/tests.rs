use super::*;

/// An f32 that f16 holds exactly (weights' scales are f16 in GGUF).
fn h(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// A matrix from random GGUF-order blocks (`codes` bytes each), packed as the loader does.
fn weight(format: WeightFormat, rows: usize, cols: usize, seed: &mut u64) -> QWeight {
    let nblocks = rows * cols / BLOCK;
    let cb = format.code_bytes();
    let mut d = vec![];
    let mut m = vec![];
    let mut q: Vec<u8> = vec![];
    for _ in 0..nblocks {
        match format {
            WeightFormat::Q4 => {
                d.push(h(lcg(seed).abs() * 0.1));
                m.push(h(lcg(seed) * 0.2));
                q.extend((0..16).map(|_| (lcg(seed).abs() * 255.0) as u8));
            }
            WeightFormat::Q8 => {
                d.push(h(lcg(seed).abs() * 0.01));
                m.push(0.0);
                q.extend((0..32).map(|_| ((lcg(seed) * 127.0) as i8) as u8));
            }
        }
    }
    if format == WeightFormat::Q8 {
        // The extreme code -128 must work too (|w| = 128 does not fit an i8).
        q[0] = (-128i8) as u8;
    }
    let bpr = cols / BLOCK;
    QWeight::pack(format, rows, cols, |r, b| {
        let i = r * bpr + b;
        NaturalBlock { d: d[i], m: m[i], codes: &q[i * cb..(i + 1) * cb] }
    })
}

fn q4_weight(rows: usize, cols: usize, seed: &mut u64) -> QWeight {
    weight(WeightFormat::Q4, rows, cols, seed)
}

fn q8_weight(rows: usize, cols: usize, seed: &mut u64) -> QWeight {
    weight(WeightFormat::Q8, rows, cols, seed)
}

/// `Σ_k x·w` in f64 from the dequantized weights, and `Σ_k |x|·(|d·q| + |m|)`, the size that
/// bounds the f32 rounding of the block-factored sums.
fn exact(x: &[f32], w: &QWeight, o: usize) -> (f64, f64) {
    let mut row = vec![0f32; w.cols];
    w.dequantize_row(o, &mut row);
    let mut codes = [0u8; 32];
    let (mut sum, mut size) = (0f64, 0f64);
    for b in 0..w.cols / BLOCK {
        let (d, m) = w.natural_block(o, b, &mut codes);
        for k in 0..BLOCK {
            let xv = f64::from(x[b * BLOCK + k]);
            let wv = f64::from(row[b * BLOCK + k]);
            sum += xv * wv;
            size +=
                xv.abs() * ((wv - f64::from(m)).abs() + f64::from(m).abs() + f64::from(d).abs());
        }
    }
    (sum, size)
}

fn check_against_f64(w: &QWeight, rows: usize, seed: &mut u64) {
    let x: Vec<f32> = (0..rows * w.cols).map(|_| lcg(seed)).collect();
    let mut out = vec![0f32; rows * w.rows];
    matmul(&x, rows, w, &mut out);
    for o in 0..w.rows {
        for r in 0..rows {
            let xr = &x[r * w.cols..(r + 1) * w.cols];
            let (sum, size) = exact(xr, w, o);
            let got = out[r * w.rows + o];
            // f32 rounding of a chain of 32 products and one of two terms per block: a few
            // units of 2^-24 of the size (8-bit activations would be 2^-8 and fail this).
            assert!(
                (f64::from(got) - sum).abs() <= 1e-6 * size,
                "r{r} o{o}: {got} vs {sum} (size {size})"
            );
            // The portable path is bit-identical to whatever path matmul took.
            assert_eq!(got.to_bits(), portable::dot(xr, w, o).to_bits());
        }
    }
}

#[test]
fn q4_and_q8_products_match_f64_within_f32_rounding() {
    let mut seed = 7;
    for rows in [1, 5, 23] {
        check_against_f64(&q4_weight(70, 96, &mut seed), rows, &mut seed);
        check_against_f64(&q8_weight(130, 64, &mut seed), rows, &mut seed);
    }
}

/// A row's results are the same bits alone, in a small batch (fused path) and in a large one
/// (panel path, several row tiles).
#[test]
fn results_do_not_depend_on_the_batch() {
    let mut seed = 11;
    let w = q4_weight(200, 576, &mut seed);
    let x: Vec<f32> = (0..40 * 576).map(|_| lcg(&mut seed)).collect();
    for n in [3, 9, 40] {
        let mut out_all = vec![0f32; n * 200];
        matmul(&x[..n * 576], n, &w, &mut out_all);
        for r in 0..n {
            let mut out_one = vec![0f32; 200];
            matmul(&x[r * 576..(r + 1) * 576], 1, &w, &mut out_one);
            for o in 0..200 {
                assert_eq!(
                    out_one[o].to_bits(),
                    out_all[r * 200 + o].to_bits(),
                    "batch {n}: row {r} col {o}"
                );
            }
        }
    }
}

/// Every kernel this CPU can run gives the portable path's bits, for every tile shape (1 to
/// 40 rows: fused tiles in one pass or several with a partial last, panel and padded tiles,
/// each side of the fused path's limit; whole, paired and padded column groups; inputs in one
/// panel chunk or several, equal or not; both formats).
#[test]
fn every_kernel_gives_the_same_bits() {
    let mut seed = 5;
    let kernels = Kernel::available();
    eprintln!("kernels compared: {kernels:?}");
    for w in [
        q4_weight(77, 160, &mut seed),
        q8_weight(61, 96, &mut seed),
        q4_weight(40, 64, &mut seed),
        q4_weight(35, 576, &mut seed),
        q8_weight(20, 288, &mut seed),
    ] {
        for rows in [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 25, 32, 33, 40, 120] {
            let x: Vec<f32> = (0..rows * w.cols).map(|_| lcg(&mut seed) * 3.0).collect();
            let mut expected = vec![0f32; rows * w.rows];
            matmul_with(&x, rows, &w, &mut expected, Kernel::Portable);
            for &k in &kernels[1..] {
                let mut got = vec![f32::NAN; rows * w.rows];
                matmul_with(&x, rows, &w, &mut got, k);
                for (i, (a, b)) in got.iter().zip(&expected).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{k:?} {:?} rows {rows}: element {i}",
                        w.format
                    );
                }
            }
        }
    }
}

/// Packing keeps every block: rows read back in GGUF order, also through `concat`.
#[test]
fn packing_round_trips() {
    let mut seed = 3;
    for format in [WeightFormat::Q4, WeightFormat::Q8] {
        let a = weight(format, 13, 64, &mut seed);
        let b = weight(format, 6, 64, &mut seed);
        let both = QWeight::concat(&[&a, &b]).expect("same format and width");
        assert_eq!(both.rows, 19);
        let (mut x, mut y) = (vec![0f32; 64], vec![0f32; 64]);
        for r in 0..19 {
            both.dequantize_row(r, &mut x);
            if r < 13 {
                a.dequantize_row(r, &mut y);
            } else {
                b.dequantize_row(r - 13, &mut y);
            }
            assert_eq!(x, y, "{format:?} row {r}");
        }
    }
}

/// Against the GGUF-order source blocks, not the packed copy: the product equals the exact
/// (f64) product of the dequantized weights and the activations up to f32 rounding, so no
/// packing mistake can hide behind a consistent read-back.
#[test]
fn products_equal_the_exact_product_of_the_source_blocks() {
    let mut seed = 9;
    for format in [WeightFormat::Q4, WeightFormat::Q8] {
        let (rows, cols, n) = (21, 96, 3);
        let bpr = cols / BLOCK;
        let cb = format.code_bytes();
        let d: Vec<f32> = (0..rows * bpr).map(|_| h(lcg(&mut seed).abs() * 0.1)).collect();
        let m: Vec<f32> = (0..rows * bpr).map(|_| h(lcg(&mut seed) * 0.2)).collect();
        let q: Vec<u8> =
            (0..rows * bpr * cb).map(|_| (lcg(&mut seed).abs() * 255.0) as u8).collect();
        let w = QWeight::pack(format, rows, cols, |r, b| {
            let i = r * bpr + b;
            NaturalBlock { d: d[i], m: m[i], codes: &q[i * cb..(i + 1) * cb] }
        });
        let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed)).collect();
        let mut out = vec![0f32; n * rows];
        matmul(&x, n, &w, &mut out);
        for r in 0..n {
            for o in 0..rows {
                let (mut exact, mut size) = (0f64, 0f64);
                for b in 0..bpr {
                    let i = o * bpr + b;
                    let codes = &q[i * cb..(i + 1) * cb];
                    for e in 0..BLOCK {
                        let c = match format {
                            WeightFormat::Q4 => {
                                f64::from(if e < 16 { codes[e] & 0x0F } else { codes[e - 16] >> 4 })
                            }
                            WeightFormat::Q8 => f64::from(codes[e] as i8),
                        };
                        let wv = f64::from(d[i]) * c
                            + if format == WeightFormat::Q4 { f64::from(m[i]) } else { 0.0 };
                        let xv = f64::from(x[r * cols + b * BLOCK + e]);
                        exact += wv * xv;
                        let mm =
                            if format == WeightFormat::Q4 { f64::from(m[i]).abs() } else { 0.0 };
                        size += xv.abs() * (f64::from(d[i]) * c.abs() + mm);
                    }
                }
                let got = f64::from(out[r * rows + o]);
                assert!(
                    (got - exact).abs() <= 1e-6 * size,
                    "{format:?} r{r} o{o}: {got} vs {exact}"
                );
            }
        }
    }
}

/// Dequantized rows (the embeddings) are the exact weights `d·q + m`, as f64 computes them.
#[test]
fn dequantized_rows_are_exact() {
    let mut seed = 13;
    for w in [q4_weight(20, 96, &mut seed), q8_weight(20, 96, &mut seed)] {
        let mut row = vec![0f32; 96];
        let mut codes = [0u8; 32];
        for o in 0..20 {
            w.dequantize_row(o, &mut row);
            for b in 0..3 {
                let (d, m) = w.natural_block(o, b, &mut codes);
                for e in 0..BLOCK {
                    let c = match w.format {
                        WeightFormat::Q4 => {
                            f64::from(if e < 16 { codes[e] & 0x0F } else { codes[e - 16] >> 4 })
                        }
                        WeightFormat::Q8 => f64::from(codes[e] as i8),
                    };
                    let want = f64::from(d) * c + f64::from(m);
                    assert_eq!(
                        f64::from(row[b * BLOCK + e]),
                        want,
                        "{:?} o{o} b{b} e{e}",
                        w.format
                    );
                }
            }
        }
    }
}
