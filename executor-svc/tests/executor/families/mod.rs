//! Llama-family files Ferry did not write, against a forward Ferry did not write: tiny models
//! in GGUF as llama.cpp's converter lays them out (`llama_hf.py`, with the `gguf` package's
//! quantizers; plain, Llama 3 and linear rope scaling, every legacy type mixed in one file, a
//! `Q4_K_M`-like k-quant mix, `F16`, `BF16` and `F32` mixed, Qwen 2, Qwen 3, Phi-3 with a
//! sliding window, Phi-3.5 / Phi-4-mini's `LongRoPE` with a partial rotation, Gemma 2 and
//! Gemma 3), their logits from a numpy forward after Hugging Face's
//! `modeling_llama.py`, `modeling_qwen2.py`, `modeling_qwen3.py`, `modeling_phi3.py`,
//! `modeling_gemma2.py` and `modeling_gemma3.py` (f64, HF's layout, rotary
//! scalings and sliding-window mask, the weights the package dequantizes); and every weight type's
//! conversion against the package's (`formats.py`). Ferry loads each file and computes every
//! position's logits with its reference forward, and its serving forward must give the same
//! logits bit for bit. candle-transformers' quantized models are a second reference where they
//! model the family (`candle`).

mod candle;

use std::path::{Path, PathBuf};

use ferry_executor_svc::forward::paged::{self, ForwardScratch, SeqSlice};
use ferry_executor_svc::forward::reference::{forward, greedy, ContiguousCache};
use ferry_executor_svc::forward::{LoadedModel, ModelFile, PagedKvCache};

/// Largest difference of a logit from the f64 reference: Ferry computes in f32 with the
/// file's exact weights (logits here are of size 1-8; measured: within 4e-6, 3e-5 for the
/// k-quant mix, whose 256- and 512-wide sums round more).
const TOLERANCE: f32 = 1e-4;

/// Largest difference of a logit from candle's (f32 on the same dequantized weights, its own
/// order of sums). Measured: within 4.5e-6, 1.1e-5 for the k-quant mix.
const CANDLE_TOLERANCE: f32 = 1e-4;

fn references() -> (PathBuf, serde_json::Value) {
    let dir = std::env::temp_dir().join(format!("ferry-families-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/executor/families/llama_hf.py");
    let status = std::process::Command::new("python3").arg(script).arg(&dir).status().unwrap();
    assert!(status.success(), "{script} failed (needs pip's numpy and gguf: scripts/setup)");
    let expected = serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap());
    (dir, expected.unwrap())
}

fn load(path: &Path) -> Result<LoadedModel, String> {
    let file = ModelFile::open(Some(path)).map_err(|e| e.to_string())?;
    LoadedModel::load(std::sync::Arc::new(file)).map_err(|e| e.to_string())
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The largest difference, infinite where either side is not a number (which `f32::max`
/// would skip).
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logits of different lengths");
    let diff = |(x, y): (&f32, &f32)| {
        let d = (x - y).abs();
        if d.is_nan() {
            f32::INFINITY
        } else {
            d
        }
    };
    a.iter().zip(b).map(diff).fold(0.0, f32::max)
}

/// The serving forward (paged, rows in parallel) on `tokens` one step each: bit for bit the
/// reference forward's `logits` at every position, as for the default model (`paged_forward`).
fn assert_serving_forward_equals(
    w: &ferry_executor_svc::forward::LlamaWeights,
    tokens: &[u32],
    logits: &[Vec<f32>],
    name: &str,
) {
    const BLOCK: usize = 4;
    let blocks = tokens.len().div_ceil(BLOCK);
    let mut cache = PagedKvCache::new(&w.shape, BLOCK, blocks);
    let table: Vec<u32> = (0..u32::try_from(blocks).unwrap()).rev().collect();
    let mut scratch = ForwardScratch::default();
    for (i, want) in logits.iter().enumerate() {
        let step = [SeqSlice::base(&tokens[i..=i], i, &table, 1)];
        let got = paged::forward(w, &mut cache, &step, &mut scratch).unwrap().remove(0);
        let same = got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{name}: the serving forward's logits at {i} are not the reference's");
    }
}

#[test]
fn llama_files_compute_the_published_forward_in_every_weight_type_and_rope_scaling_and_extras_are_refused(
) {
    let (dir, expected) = references();
    let (mut checked, mut by_candle) = (Vec::new(), Vec::new());
    for (name, want) in expected["variants"].as_object().unwrap() {
        let model = load(Path::new(want["gguf"].as_str().unwrap())).unwrap();
        let w = &model.weights;
        let tokens = ids(&want["tokens"]);
        let mut cache = ContiguousCache::default();
        let mut worst = 0f32;
        let mut computed = Vec::new();
        for (i, (&t, logits)) in tokens.iter().zip(want["logits"].as_array().unwrap()).enumerate() {
            let got = forward(w, &[t], &mut cache).unwrap();
            computed.push(got.clone());
            let (want, unscaled) = (floats(logits), floats(&want["unscaled_logits"][i]));
            let diff = max_diff(&got, &want);
            assert!(diff < TOLERANCE, "{name}: position {i}: logits differ by {diff}");
            worst = worst.max(diff);
            // Where the variant's rotary scaling or sliding window (5 positions) changes the
            // logits, the test could tell a forward that ignored it (the references with and
            // without differ by more).
            let changes = match name.as_str() {
                "llama3" | "linear" => i >= 4,
                "phi3" => i >= 5,
                _ => false,
            };
            if changes {
                assert!(max_diff(&want, &unscaled) > 10.0 * TOLERANCE, "{name}: {i}: no effect");
            }
        }
        // Each of the variant's features changes the last position's logits: a forward that
        // left one out would fail.
        for (what, without) in want["ablations"].as_object().unwrap() {
            let diff = max_diff(&floats(without), computed.last().unwrap());
            assert!(diff > 10.0 * TOLERANCE, "{name}: {what} changes nothing here ({diff})");
        }
        eprintln!("{name}: logits within {worst:e} of the f64 reference");
        if let Some(theirs) =
            candle::logits(name, Path::new(want["gguf"].as_str().unwrap()), &tokens)
        {
            let diff =
                theirs.iter().zip(&computed).map(|(a, b)| max_diff(a, b)).fold(0.0, f32::max);
            assert!(diff < CANDLE_TOLERANCE, "{name}: logits differ from candle's by {diff}");
            eprintln!("{name}: {} positions within {diff:e} of candle's", theirs.len());
            let n = theirs.len();
            by_candle.push(format!(
                "{name}: {}",
                if n == tokens.len() { "all".into() } else { n.to_string() }
            ));
        }
        assert_serving_forward_equals(w, &tokens, &computed, name);
        // Greedy, from the reference's f64 argmax (which no near tie decides here).
        let want = ids(&want["greedy"]);
        assert_eq!(greedy(w, &tokens, want.len(), &[]).unwrap(), want, "{name}: greedy");
        checked.push(name.clone());
    }
    checked.sort();
    let every = [
        "floats",
        "gemma2",
        "gemma3",
        "k-quants",
        "linear",
        "llama",
        "llama3",
        "mixed",
        "phi3",
        "phi3-longrope",
        "qwen2",
        "qwen3",
    ];
    assert_eq!(checked, every);
    by_candle.sort();
    // The variants candle models, and the positions compared (see `candle`).
    let candle = ["floats: all", "k-quants: all", "llama: all", "mixed: all"];
    assert_eq!(by_candle, [&candle[..], &["phi3: 5", "qwen2: all", "qwen3: all"]].concat());
    for (name, refused) in expected["refused"].as_object().unwrap() {
        let err = load(Path::new(refused[0].as_str().unwrap())).unwrap_err();
        let what = refused[1].as_str().unwrap();
        assert!(err.contains(what), "{name}: the refusal does not name {what}: {err}");
    }
    std::fs::remove_dir_all(dir).ok();
}

/// Every GGUF type Ferry reads, converted by Ferry, equals the `gguf` package's dequantization
/// of the same blocks bit for bit, zeros' signs aside (`formats.py`: the legacy and float types
/// from its quantizers, the k-quants as random blocks), and the product over them matches those weights in f64.
#[test]
fn every_weight_type_converts_to_the_gguf_packages_dequantization_bit_for_bit() {
    use candle_core::quantized::GgmlDType;
    use ferry_executor_svc::kernels::{matmul, QWeight};
    let dir = std::env::temp_dir().join(format!("ferry-formats-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/executor/families/formats.py");
    let status = std::process::Command::new("python3").arg(script).arg(&dir).status().unwrap();
    assert!(status.success(), "{script} failed (needs pip's numpy and gguf: scripts/setup)");
    let listed: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("formats.json")).unwrap()).unwrap();
    let (rows, cols) =
        (listed["rows"].as_u64().unwrap() as usize, listed["cols"].as_u64().unwrap() as usize);
    let mut checked = Vec::new();
    for name in listed["types"].as_array().unwrap() {
        let name = name.as_str().unwrap();
        let dtype = match name {
            "Q4_0" => GgmlDType::Q4_0,
            "Q4_1" => GgmlDType::Q4_1,
            "Q5_0" => GgmlDType::Q5_0,
            "Q5_1" => GgmlDType::Q5_1,
            "Q8_0" => GgmlDType::Q8_0,
            "Q4_K" => GgmlDType::Q4K,
            "Q5_K" => GgmlDType::Q5K,
            "Q6_K" => GgmlDType::Q6K,
            "F16" => GgmlDType::F16,
            "BF16" => GgmlDType::BF16,
            "F32" => GgmlDType::F32,
            other => panic!("formats.py made {other}, which this test does not know"),
        };
        let raw = std::fs::read(dir.join(format!("{name}.bin"))).unwrap();
        let want: Vec<f32> = std::fs::read(dir.join(format!("{name}.f32")))
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let w = QWeight::from_gguf(dtype, rows, cols, &raw).unwrap();
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            w.dequantize_row(r, &mut row);
            for (k, (got, want)) in row.iter().zip(&want[r * cols..]).enumerate() {
                // Bit for bit, but for the sign of a zero: `Q4_0`'s `d·(q - 8)` is -0 where
                // `d < 0`, Ferry's `d·q - 8d` +0 (the same number in every sum).
                let same = got.to_bits() == want.to_bits() || (*got == 0.0 && *want == 0.0);
                assert!(same, "{name}: weight ({r}, {k}): {got:e} vs {want:e}");
            }
        }
        // The product reads the same weights: within f32 rounding of the f64 product.
        let x: Vec<f32> = (0..3 * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let mut out = vec![0f32; 3 * rows];
        matmul(&x, 3, &w, &mut out);
        for n in 0..3 {
            for r in 0..rows {
                let pairs = x[n * cols..(n + 1) * cols].iter().zip(&want[r * cols..(r + 1) * cols]);
                let (exact, size) = pairs.fold((0f64, 0f64), |(e, s), (&a, &b)| {
                    (e + f64::from(a) * f64::from(b), s + f64::from(a).abs() * f64::from(b).abs())
                });
                let got = f64::from(out[n * rows + r]);
                assert!(
                    (got - exact).abs() <= 1e-5 * size.max(1e-6),
                    "{name}: ({n}, {r}): {got} vs {exact}"
                );
            }
        }
        checked.push(name);
    }
    let every =
        ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"];
    assert_eq!(checked, every);
    // What the model file accepts at start-up (before any weight is read) is what converts.
    assert_eq!(every, ferry_model::gguf::SERVED_WEIGHT_TYPES);
    std::fs::remove_dir_all(dir).ok();
}
