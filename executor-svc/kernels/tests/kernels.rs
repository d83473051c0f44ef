//! The kernels against f64 sums of their dequantized weights, against the portable product bit
//! for bit, and packing against unpacking, for every weight format. A test target of its own
//! (not the library's `cfg(test)` module): it builds in seconds, where compiling the whole
//! library a second time as a test harness cost ~30 s of the tests' build.

use ferry_kernels::*;

/// An f32 that f16 holds exactly (weights' scales are f16 in GGUF).
fn h(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// Every packed form.
const FORMATS: [WeightFormat; 8] = [
    WeightFormat::Q4,
    WeightFormat::Q8,
    WeightFormat::Q4K,
    WeightFormat::Q5K,
    WeightFormat::Q6K,
    WeightFormat::F16,
    WeightFormat::BF16,
    WeightFormat::F32,
];

/// A float format's code for `v`, little-endian (rounded to the format).
fn float_bytes(format: WeightFormat, v: f32) -> Vec<u8> {
    match format {
        WeightFormat::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
        WeightFormat::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
        _ => v.to_le_bytes().to_vec(),
    }
}

/// Float code `e` of a block, decoded by `half` (not the kernels' conversion).
fn float_value(format: WeightFormat, codes: &[u8], e: usize) -> f64 {
    let at = |n: usize| &codes[e * n..e * n + n];
    match format {
        WeightFormat::F16 => f64::from(half::f16::from_le_bytes([at(2)[0], at(2)[1]]).to_f32()),
        WeightFormat::BF16 => f64::from(half::bf16::from_le_bytes([at(2)[0], at(2)[1]]).to_f32()),
        _ => f64::from(f32::from_le_bytes(at(4).try_into().unwrap())),
    }
}

/// A random block of `format` in natural order: scale, minimum (`Q6K`: second scale), codes.
/// The wide formats' parameters are an f16 times a small integer, as in a k-quant.
fn block(format: WeightFormat, seed: &mut u64) -> (Param, Param, Vec<u8>) {
    let int = |seed: &mut u64, n: f32| (lcg(seed).abs() * n).floor() as i8;
    let plain = Param::plain;
    let k = |scale: f32, factor: i8| Param { scale, factor };
    match format {
        WeightFormat::Q4 => (
            plain(h(lcg(seed).abs() * 0.1)),
            plain(h(lcg(seed) * 0.2)),
            (0..16).map(|_| (lcg(seed).abs() * 255.0) as u8).collect(),
        ),
        WeightFormat::Q8 => (
            plain(h(lcg(seed).abs() * 0.01)),
            plain(0.0),
            (0..32).map(|_| ((lcg(seed) * 127.0) as i8) as u8).collect(),
        ),
        WeightFormat::Q4K => (
            k(h(lcg(seed).abs() * 0.01), int(seed, 63.0)),
            k(-h(lcg(seed).abs() * 0.01), int(seed, 63.0)),
            (0..16).map(|_| (lcg(seed).abs() * 255.0) as u8).collect(),
        ),
        WeightFormat::Q5K => (
            k(h(lcg(seed).abs() * 0.005), int(seed, 63.0)),
            k(-h(lcg(seed).abs() * 0.01), int(seed, 63.0)),
            (0..32).map(|_| (lcg(seed).abs() * 31.9) as u8).collect(),
        ),
        WeightFormat::Q6K => (
            k(h(lcg(seed).abs() * 0.001), (lcg(seed) * 127.0).round() as i8),
            k(h(lcg(seed).abs() * 0.001), (lcg(seed) * 127.0).round() as i8),
            (0..32).map(|_| ((lcg(seed) * 32.0).floor() as i8) as u8).collect(),
        ),
        // Weights over several binades, some tiny (f16 subnormals), signs mixed.
        _ => (
            plain(1.0),
            plain(0.0),
            (0..32)
                .flat_map(|i| {
                    let v = lcg(seed) * if i % 7 == 0 { 1e-6 } else { 0.3 };
                    float_bytes(format, v)
                })
                .collect(),
        ),
    }
}

/// Random blocks of a `rows × cols` matrix, row by row; where a row has whole super-blocks
/// (256 inputs), a k-quant's blocks share their super-block's scales (their factors differ),
/// as in a GGUF file, unless `per_block`.
fn blocks(
    format: WeightFormat,
    (rows, cols): (usize, usize),
    per_block: bool,
    seed: &mut u64,
) -> Vec<(Param, Param, Vec<u8>)> {
    let bpr = cols / BLOCK;
    let mut all: Vec<_> = (0..rows * bpr).map(|_| block(format, seed)).collect();
    if format.wide() && !per_block && bpr.is_multiple_of(8) {
        for i in 0..all.len() {
            let first = i / 8 * 8;
            (all[i].0.scale, all[i].1.scale) = (all[first].0.scale, all[first].1.scale);
        }
    }
    all
}

/// Weight `e` of a block in natural order, in f64: `d·q + m`, `d·q` (`Q8`), or `Q6K`'s
/// `d·q` and `m·q` by half.
fn source_value(format: WeightFormat, d: f32, m: f32, codes: &[u8], e: usize) -> f64 {
    if format.float() {
        return float_value(format, codes, e);
    }
    let c = if format.code_bytes() == 32 {
        f64::from(codes[e] as i8)
    } else {
        f64::from(if e < 16 { codes[e] & 0x0F } else { codes[e - 16] >> 4 })
    };
    match format {
        WeightFormat::Q6K if e >= 16 => f64::from(m) * c,
        WeightFormat::Q8 | WeightFormat::Q6K => f64::from(d) * c,
        _ => f64::from(d) * c + f64::from(m),
    }
}

/// A matrix from random natural-order blocks, packed as the loader does.
fn weight(format: WeightFormat, rows: usize, cols: usize, seed: &mut u64) -> QWeight {
    let mut all = blocks(format, (rows, cols), false, seed);
    if matches!(format, WeightFormat::Q8 | WeightFormat::Q6K) {
        // The extreme code -128 must work too (|w| = 128 does not fit an i8).
        all[0].2[0] = (-128i8) as u8;
    }
    pack(format, (rows, cols), &all)
}

fn pack(
    format: WeightFormat,
    (rows, cols): (usize, usize),
    all: &[(Param, Param, Vec<u8>)],
) -> QWeight {
    let bpr = cols / BLOCK;
    QWeight::pack(format, rows, cols, |r, b| {
        let (d, m, codes) = &all[r * bpr + b];
        NaturalBlock { d: *d, m: *m, codes }
    })
}

fn q4_weight(rows: usize, cols: usize, seed: &mut u64) -> QWeight {
    weight(WeightFormat::Q4, rows, cols, seed)
}

/// `Σ_k x·w` in f64 from the dequantized weights, and `Σ_k |x|·(|d·q| + |m|)`, the size that
/// bounds the f32 rounding of the block-factored sums.
fn exact(x: &[f32], w: &QWeight, o: usize) -> (f64, f64) {
    let mut row = vec![0f32; w.cols];
    w.dequantize_row(o, &mut row);
    let mut codes = [0u8; MAX_CODE_BYTES];
    let (mut sum, mut size) = (0f64, 0f64);
    for b in 0..w.cols / BLOCK {
        let (d, m) = w.natural_block(o, b, &mut codes);
        let (d, m) = (d.value(), m.value());
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
fn products_of_every_format_match_f64_within_f32_rounding() {
    let mut seed = 7;
    for rows in [1, 5, 23] {
        for format in FORMATS {
            check_against_f64(&weight(format, 70, 96, &mut seed), rows, &mut seed);
            check_against_f64(&weight(format, 19, 256, &mut seed), rows, &mut seed);
        }
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
/// panel chunk or several, equal or not; every format).
#[test]
fn every_kernel_gives_the_same_bits() {
    let mut seed = 5;
    let kernels = Kernel::available();
    eprintln!("kernels compared: {kernels:?}");
    let mut weights = vec![
        q4_weight(77, 160, &mut seed),
        q4_weight(40, 64, &mut seed),
        q4_weight(35, 576, &mut seed),
    ];
    for format in FORMATS[1..].iter().copied() {
        weights.push(weight(format, 61, 96, &mut seed));
        weights.push(weight(format, 20, 288, &mut seed));
        // Whole super-blocks: a k-quant's scales kept once per 8 blocks.
        weights.push(weight(format, 35, 512, &mut seed));
    }
    for w in weights {
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
    for format in FORMATS {
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
    for format in FORMATS {
        for (cols, per_block) in [(96, true), (256, false), (256, true)] {
            let rows = 21;
            let all = blocks(format, (rows, cols), per_block, &mut seed);
            let w = pack(format, (rows, cols), &all);
            check_source_product(&w, &all, &mut seed);
        }
    }
}

fn check_source_product(w: &QWeight, blocks: &[(Param, Param, Vec<u8>)], seed: &mut u64) {
    let (format, rows, cols, n) = (w.format, w.rows, w.cols, 3);
    let bpr = cols / BLOCK;
    let x: Vec<f32> = (0..n * cols).map(|_| lcg(seed)).collect();
    let mut out = vec![0f32; n * rows];
    matmul(&x, n, w, &mut out);
    for r in 0..n {
        for o in 0..rows {
            let (mut exact, mut size) = (0f64, 0f64);
            for b in 0..bpr {
                let (d, m, codes) = &blocks[o * bpr + b];
                let (d, m) = (d.value(), m.value());
                for e in 0..BLOCK {
                    let wv = source_value(format, d, m, codes, e);
                    let xv = f64::from(x[r * cols + b * BLOCK + e]);
                    exact += wv * xv;
                    size += xv.abs() * (wv.abs() + 2.0 * f64::from(m.abs()));
                }
            }
            let got = f64::from(out[r * rows + o]);
            assert!((got - exact).abs() <= 1e-6 * size, "{format:?} r{r} o{o}: {got} vs {exact}");
        }
    }
}

/// A k-quant keeps its super-block's scales once per 8 blocks, as GGUF does: `Q4K` in 4.625
/// bits a weight (16 code bytes, two factor bytes per block, four scale bytes per 8 blocks),
/// `Q6K` in 8.5625; blocks that do not share scales keep their own (and stay exact: above).
#[test]
fn k_quants_keep_shared_scales_once() {
    let mut seed = 17;
    let (rows, cols) = (32, 512);
    let blocks_n = rows * cols / BLOCK;
    for (format, codes) in [(WeightFormat::Q4K, 16), (WeightFormat::Q6K, 32)] {
        let shared = weight(format, rows, cols, &mut seed);
        assert_eq!(shared.bytes(), blocks_n * (codes + 2) + blocks_n / 8 * 4, "{format:?}");
        let own = pack(format, (rows, cols), &blocks(format, (rows, cols), true, &mut seed));
        assert_eq!(own.bytes(), blocks_n * (codes + 2 + 4), "{format:?}");
    }
}

/// Dequantized rows (the embeddings) are the weights as f64 computes them, rounded once to f32
/// (as llama.cpp's dequantization rounds `d·q + m`; `d·q` alone is exact).
#[test]
fn dequantized_rows_are_exact() {
    let mut seed = 13;
    for format in FORMATS {
        let w = weight(format, 20, 96, &mut seed);
        let mut row = vec![0f32; 96];
        let mut codes = [0u8; MAX_CODE_BYTES];
        for o in 0..20 {
            w.dequantize_row(o, &mut row);
            for b in 0..3 {
                let (d, m) = w.natural_block(o, b, &mut codes);
                for e in 0..BLOCK {
                    let want = source_value(format, d.value(), m.value(), &codes, e);
                    assert_eq!(row[b * BLOCK + e], want as f32, "{format:?} o{o} b{b} e{e}");
                }
            }
        }
    }
}
