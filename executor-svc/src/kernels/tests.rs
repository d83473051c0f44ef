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
            // 16-bit activations: errors of about 2^-16 of the block maximum per element (8-bit
            // ones would be 256 times larger and fail this).
            let tol = 2e-4 * norm * (w.cols as f32).sqrt() + 1e-5;
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

/// Every kernel this CPU can run gives the portable path's bits, for every tile shape (1 to
/// 17 rows, whole and padded column groups, both formats).
#[test]
fn every_kernel_gives_the_same_bits() {
    let mut seed = 5;
    let mut kernels = vec![Kernel::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        if let Some(isa) = x86::detect() {
            kernels.push(Kernel::X86(x86::Isa::Avx2));
            if isa == x86::Isa::Vnni {
                kernels.push(Kernel::X86(x86::Isa::Vnni));
            }
        }
    }
    for w in
        [q4_weight(77, 160, &mut seed), q8_weight(61, 96, &mut seed), q4_weight(40, 64, &mut seed)]
    {
        for rows in [1, 2, 3, 4, 5, 7, 8, 9, 13, 17] {
            let x: Vec<f32> = (0..rows * w.cols).map(|_| lcg(&mut seed) * 3.0).collect();
            let mut acts = QActs::default();
            acts.quantize(&x, rows, w.cols);
            let mut expected = vec![0f32; rows * w.rows];
            matmul_with(&acts, &w, &mut expected, Kernel::Portable);
            for &k in &kernels[1..] {
                let mut got = vec![f32::NAN; rows * w.rows];
                matmul_with(&acts, &w, &mut got, k);
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
/// (f64) product of the dequantized weights and the quantized activations up to float
/// rounding, so no packing mistake can hide behind a consistent read-back.
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
        let mut acts = QActs::default();
        acts.quantize(&x, n, cols);
        let mut out = vec![0f32; n * rows];
        matmul(&acts, &w, &mut out);
        for r in 0..n {
            for o in 0..rows {
                let (mut exact, mut size) = (0f64, 0f64);
                for b in 0..bpr {
                    let i = o * bpr + b;
                    let codes = &q[i * cb..(i + 1) * cb];
                    for e in 0..BLOCK {
                        let wv = match format {
                            WeightFormat::Q4 => {
                                let c = if e < 16 { codes[e] & 0x0F } else { codes[e - 16] >> 4 };
                                f64::from(d[i]) * f64::from(c) + f64::from(m[i])
                            }
                            WeightFormat::Q8 => f64::from(d[i]) * f64::from(codes[e] as i8),
                        };
                        let xb = r * bpr + b;
                        let xv = f64::from(acts.d[xb]) * f64::from(acts.code(xb, e));
                        exact += wv * xv;
                        size += (wv * xv).abs();
                    }
                }
                let got = f64::from(out[r * rows + o]);
                assert!(
                    (got - exact).abs() <= 1e-5 * size,
                    "{format:?} r{r} o{o}: {got} vs {exact}"
                );
            }
        }
    }
}

/// The 16-bit split keeps both bytes in [-127, 127] and reconstructs every code, at the block
/// maximum, at zero and in between; an all-zero block gets scale zero.
#[test]
fn activation_codes_split_into_two_bytes_exactly() {
    let mut seed = 1;
    let mut x: Vec<f32> = (0..4 * BLOCK).map(|_| lcg(&mut seed) * 50.0).collect();
    x[3] = 50.0;
    x[40] = -50.0;
    x[2 * BLOCK..3 * BLOCK].fill(0.0);
    let mut acts = QActs::default();
    acts.quantize(&x, 1, 4 * BLOCK);
    assert_eq!(acts.d[2], 0.0);
    assert!(acts.q.iter().all(|b| *b >= -127));
    for (i, v) in x.iter().enumerate() {
        let (b, e) = (i / BLOCK, i % BLOCK);
        let code = acts.code(b, e);
        assert!(code.abs() <= ACT_MAX as i32);
        assert!((acts.d[b] * code as f32 - v).abs() <= acts.d[b] * 0.5001, "element {i}");
    }
    assert_eq!(acts.code(0, 3), ACT_MAX as i32);
    assert_eq!(acts.code(1, 8), -(ACT_MAX as i32));
}

/// The AVX2 build of the quantizer gives the portable build's codes and scales, and the
/// parallel split over blocks changes nothing.
/// The output view over `a`'s buffers.
fn out(a: &mut QActs) -> QBlocks<'_> {
    QBlocks { q: &mut a.q, d: &mut a.d, s: &mut a.s, bias: &mut a.bias }
}

#[test]
fn quantization_is_the_same_with_and_without_avx2() {
    let mut seed = 23;
    let mut x: Vec<f32> = (0..40 * 96).map(|_| lcg(&mut seed) * 7.0).collect();
    // A block whose scale is exactly 1, with ties for both roundings, and an all-zero block.
    let ties = [32512.0, 2.5, -3.5, 127.5, -127.5, 0.5, -0.5, 382.0, -382.0, 637.0, 32511.5];
    x[..ties.len()].copy_from_slice(&ties);
    x[32..64].fill(0.0);
    let mut split = QActs::default();
    split.quantize(&x, 40, 96);
    let mut plain = split.clone();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    quantize_scalar(&x, out(&mut plain));
    let same = |a: &QActs, b: &QActs| {
        assert_eq!(a.q, b.q);
        assert_eq!(a.bias, b.bias);
        assert_eq!(bits(&a.d), bits(&b.d));
        assert_eq!(bits(&a.s), bits(&b.s));
    };
    same(&split, &plain);
    #[cfg(target_arch = "x86_64")]
    if x86::detect().is_some() {
        let mut fast = plain.clone();
        fast.q.fill(0);
        // SAFETY: AVX2 was detected.
        unsafe { x86::quantize(&x, out(&mut fast)) };
        same(&fast, &plain);
    }
}
