//! Tests of the CUDA backend: the GPU forward against the CPU backend on the same batches, under
//! the CPU emulation of CUDA ([`crate::engine::cuda_emulation`]; CI sets `FERRY_CUDA_TESTS=emulated`, so they
//! cannot skip there) or on a real GPU (`FERRY_CUDA_TESTS=gpu`, `scripts/gpu-check`); and, in a
//! process without either, the clear refusal of a machine with no driver.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use ferry_model::Family;

use super::probe::{try_load, CudaLibrary};
use super::{kernels, CudaBackend, CudaError, Precision, Storage};
use crate::engine::backend::{BatchOutput, CpuBackend, ModelBackend};
use crate::engine::cuda_emulation::{device_for_tests, Emulation};
use crate::forward::llama::LayerWeights;
use crate::forward::paged::SeqSlice;
use crate::forward::{ops, KvDtype, LlamaShape, LlamaWeights};
use crate::kernels::{QWeight, Stacked};

/// A deterministic stream of values in [-1, 1).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 =
            self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn matrix(&mut self, rows: usize, cols: usize, scale: f32, dtype: GgmlDType) -> QWeight {
        let values: Vec<f32> = (0..rows * cols).map(|_| self.next() * scale).collect();
        let t = Tensor::from_vec(values, (rows, cols), &Device::Cpu).expect("tensor");
        QWeight::from_qtensor(&QTensor::quantize(&t, dtype).expect("quantize")).expect("weight")
    }

    fn norm(&mut self, width: usize) -> Vec<f32> {
        (0..width).map(|_| 1.0 + 0.1 * self.next()).collect()
    }
}

/// A small random Llama with grouped-query attention, in both weight formats.
fn tiny_model() -> LlamaWeights {
    tiny_model_of(Family::LLAMA)
}

/// A small random model of `family`: Gemma's with six layers (a global one after five
/// windowed ones), a window of 3, soft caps low enough to matter (Gemma 2), head norms and
/// local rotary frequencies (Gemma 3).
fn tiny_model_of(family: Family) -> LlamaWeights {
    let gemma = family.post_norms;
    let caps = family.softcap.map(|_| (1.5, 2.0));
    let shape = LlamaShape {
        family,
        num_layers: if gemma { 6 } else { 2 },
        hidden: 64,
        intermediate: 96,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        vocab_size: 80,
        rope_theta: 10_000.0,
        rope_scale: 1.0,
        rope_dims: 16,
        rope_mscale: 1.0,
        rope_long: false,
        rms_eps: 1e-5,
        max_model_len: 256,
        sliding_window: gemma.then_some(3),
        query_scale: 0.25,
        attn_softcap: caps.map(|c| c.0),
        final_softcap: caps.map(|c| c.1),
    };
    let (h, kv, ff) = (shape.hidden, shape.kv_dim(), shape.intermediate);
    let mut rng = Lcg(7);
    let layers = (0..shape.num_layers)
        .map(|_| LayerWeights {
            attn_norm: rng.norm(h),
            wqkv: Stacked::new(&[&rng.matrix(h + 2 * kv, h, 0.3, GgmlDType::Q8_0)]).unwrap(),
            qkv_bias: None,
            qk_norm: family.qk_norm.then(|| (rng.norm(16), rng.norm(16))),
            post_norms: gemma.then(|| (rng.norm(h), rng.norm(h))),
            wo: rng.matrix(h, h, 0.2, GgmlDType::Q4_1),
            ffn_norm: rng.norm(h),
            w_gate_up: Stacked::new(&[&rng.matrix(2 * ff, h, 0.3, GgmlDType::Q4_1)]).unwrap(),
            w_down: rng.matrix(h, ff, 0.2, GgmlDType::Q8_0),
        })
        .collect();
    let embed = rng.matrix(shape.vocab_size, h, 1.0, GgmlDType::Q8_0);
    LlamaWeights {
        shape,
        lm_head: embed.clone(),
        embed,
        layers,
        norm: rng.norm(h),
        rope_freqs: ops::rope_frequencies(shape.head_dim, shape.rope_theta, shape.rope_scale),
        local_rope_freqs: family
            .window_rope_base
            .map(|base| ops::rope_frequencies(shape.head_dim, base, 1.0)),
    }
}

#[test]
fn without_a_driver_the_backend_returns_an_error_instead_of_panicking() {
    if try_load(CudaLibrary::Driver).is_ok() {
        eprintln!("skipped: a CUDA driver is installed here");
        return;
    }
    let err = CudaBackend::new(&tiny_model(), 4, 16, 0).err().expect("no driver, no backend");
    assert!(matches!(err, CudaError::NoDriver { .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.starts_with("no CUDA driver found ("), "{message}");
    assert!(message.contains("libcuda.so.1 could not be loaded"), "{message}");
    assert!(message.ends_with("run with --backend cpu"), "{message}");
}

#[test]
fn a_shape_the_kernels_cannot_hold_is_refused_before_the_gpu_is_touched() {
    let mut w = tiny_model();
    w.shape.head_dim = 2 * kernels::MAX_HEAD_DIM;
    let err = CudaBackend::new(&w, 4, 16, 0).err().expect("refused");
    assert!(matches!(err, CudaError::Unsupported(_)), "{err:?}");
}

#[test]
fn the_kernels_compile_with_nvrtc() {
    if !device_for_tests() {
        return;
    }
    if let Err(e) = kernels::compile() {
        panic!("{e}");
    }
}

/// The CUDA backend on device 0, or `None` where [`device_for_tests`] says so.
fn gpu_backend(w: &LlamaWeights, block_size: usize, num_blocks: usize) -> Option<CudaBackend> {
    if !device_for_tests() {
        return None;
    }
    match CudaBackend::new(w, block_size, num_blocks, 0) {
        Ok(b) => Some(b),
        Err(e) => panic!("the CUDA backend failed to start: {e}"),
    }
}

fn logits(out: BatchOutput) -> Vec<Vec<f32>> {
    match out {
        BatchOutput::Logits(l) => l,
        other @ BatchOutput::Synthetic { .. } => panic!("expected logits, got {other:?}"),
    }
}

/// How far the tiny models' logits may be from the CPU backend's, relative to the largest CPU
/// logit. Both multiply f32 activations by the same (dequantized) weights; they differ in the
/// order of summation (cuBLAS's and the kernels' against the CPU's fixed FMA order) and in the
/// `expf`/`tanhf` used. Measured under the emulation: within 2e-6 (Llama, Gemma 2 and 3).
const TINY_TOLERANCE: f32 = 2e-5;

/// GPU and CPU logits agree within `tol` of the largest CPU logit's magnitude; returns the
/// largest relative difference seen.
fn assert_close(gpu: &[Vec<f32>], cpu: &[Vec<f32>], tol: f32, what: &str) -> f32 {
    assert_eq!(gpu.len(), cpu.len(), "{what}: number of logit rows");
    let mut worst = 0f32;
    for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        assert_eq!(g.len(), c.len(), "{what}: row {i} width");
        let scale = c.iter().fold(1f32, |a, v| a.max(v.abs()));
        let diff = g.iter().zip(c).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(g.iter().all(|v| v.is_finite()), "{what}: row {i} has non-finite logits");
        assert!(diff <= tol * scale, "{what}: row {i} differs by {diff} (scale {scale})");
        worst = worst.max(diff / scale);
    }
    eprintln!("{what}: logits within {worst:e} of the CPU's (relative)");
    worst
}

#[test]
fn on_a_gpu_mixed_batches_match_the_cpu_backend() {
    for family in [Family::LLAMA, Family::GEMMA2, Family::GEMMA3] {
        mixed_batches_match_the_cpu_backend(family);
    }
}

/// A tiny model of `family`, and the CUDA and CPU backends running it (blocks of 4, 32 of
/// them); `None` where [`device_for_tests`] says to skip.
fn both_backends(family: Family) -> Option<(LlamaWeights, CudaBackend, CpuBackend)> {
    let w = tiny_model_of(family);
    let gpu = gpu_backend(&w, 4, 32)?;
    Some((w, gpu, CpuBackend::new(tiny_model_of(family), 4, 32)))
}

/// [`on_a_gpu_mixed_batches_match_the_cpu_backend`] on a model of `family`.
fn mixed_batches_match_the_cpu_backend(family: Family) {
    let Some((w, mut gpu, mut cpu)) = both_backends(family) else { return };
    // Scattered tables; A and B share no block.
    let (table_a, table_b, table_c) = ([9u32, 3, 17], [4u32, 30, 1, 12], [25u32]);
    let steps: Vec<Vec<SeqSlice>> = vec![
        vec![
            // A: a whole 5-token prompt; B: the first chunk of its prompt (no logits).
            SeqSlice::base(&[1, 5, 9, 13, 17], 0, &table_a, 1),
            SeqSlice::base(&[2, 4, 6], 0, &table_b, 0),
        ],
        vec![
            // B's second chunk crosses a block boundary; A decodes; C is a 1-token prompt.
            SeqSlice::base(&[8, 10, 12, 14, 16, 18], 3, &table_b, 1),
            SeqSlice::base(&[21], 5, &table_a, 1),
            SeqSlice::base(&[33], 0, &table_c, 1),
        ],
        vec![SeqSlice::base(&[40], 6, &table_a, 1), SeqSlice::base(&[41], 9, &table_b, 1)],
    ];
    let attention =
        || (Emulation::kernel_launches("attention_f32"), Emulation::kernel_blocks("attention_f32"));
    let before = (Emulation::stats(), attention());
    for (i, batch) in steps.iter().enumerate() {
        gpu.check(batch).expect("valid batch");
        let g = logits(gpu.run(batch).expect("gpu step"));
        let c = logits(cpu.run(batch).expect("cpu step"));
        assert_close(&g, &c, TINY_TOLERANCE, &format!("{}: step {i}", family.name));
    }
    // Under the emulation, its own counts show the device did the work: per step, four
    // products per layer and the LM head (every step here samples), one attention per layer
    // of one block per row and KV head (each KV head's keys and values read once for the
    // query heads that share them).
    if let ((Some(before), (Some(launches), Some(blocks))), Some(after)) =
        (before, Emulation::stats())
    {
        let (steps_n, layers) = (steps.len() as u64, w.shape.num_layers as u64);
        assert_eq!(after.gemms - before.gemms, steps_n * (4 * layers + 1), "{}", family.name);
        let (now_launches, now_blocks) = attention();
        assert_eq!(
            now_launches.unwrap() - launches,
            steps_n * layers,
            "{}: attention launches",
            family.name
        );
        let rows: usize = steps.iter().flatten().map(|s| s.tokens.len()).sum();
        let expected = rows as u64 * layers * w.shape.num_kv_heads as u64;
        assert_eq!(now_blocks.unwrap() - blocks, expected, "{}: attention blocks", family.name);
        assert!(after.launches - before.launches > steps_n * layers * 6, "{}", family.name);
        assert!(after.fiber_switches > before.fiber_switches, "barriers were met");
    }
}

#[test]
fn on_a_gpu_bad_batches_are_refused_like_on_the_cpu() {
    let w = tiny_model();
    let Some(mut gpu) = gpu_backend(&w, 4, 8) else { return };
    let out_of_range = [SeqSlice::base(&[1], 0, &[8], 1)];
    let cpu = CpuBackend::new(tiny_model(), 4, 8);
    assert_eq!(gpu.check(&out_of_range), cpu.check(&out_of_range));
    assert!(gpu.run(&out_of_range).is_err(), "run validates before touching the device");
}

#[test]
fn on_a_gpu_the_real_model_greedy_decodes_like_the_cpu() {
    let probe = gpu_backend(&tiny_model(), 4, 4);
    if probe.is_none() {
        return;
    }
    drop(probe);
    let model = crate::forward::LoadedModel::open(None).expect("the default model");
    let prompt = model.file.tokenizer.encode("The capital of France is").expect("encode");
    let (bs, blocks) = (16, 64);
    let mut gpu = CudaBackend::new(&model.weights, bs, blocks, 0).expect("gpu backend");
    let mut cpu = CpuBackend::new(model.weights, bs, blocks);
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let (mut toks, mut start) = (prompt.clone(), 0);
    // Six steps. Under the emulation the logits are within 3.2e-6 of the largest (summation
    // order, `expf`), the greedy tokens equal (" Paris.\n\nThe answer").
    for step in 0..6 {
        let batch = [SeqSlice::base(&toks[start..], start, &table, 1)];
        let g = logits(gpu.run(&batch).expect("gpu step"));
        let c = logits(cpu.run(&batch).expect("cpu step"));
        assert_close(&g, &c, 3e-5, &format!("step {step}"));
        let (tg, tc) = (ops::argmax(&g[0]), ops::argmax(&c[0]));
        assert_eq!(tg, tc, "step {step}: greedy tokens differ");
        start = toks.len();
        toks.push(tc.expect("non-empty vocabulary") as u32);
    }
}

/// Bytes of one KV block of `w` in the transfer layout (f32).
fn block_bytes(w: &LlamaWeights, block_size: usize) -> usize {
    w.shape.num_layers * 2 * block_size * w.shape.kv_dim() * 4
}

#[test]
fn on_a_gpu_a_verification_with_drafts_matches_the_cpu_backend() {
    // Speculative decoding's verification: a sequence's last sampled token and its drafts in
    // one step, logits for every one of them (the drafts' checks and the bonus token).
    let w = tiny_model();
    let Some(mut gpu) = gpu_backend(&w, 4, 16) else { return };
    let mut cpu = CpuBackend::new(tiny_model(), 4, 16);
    let table = [5u32, 2, 11];
    let steps = [
        vec![SeqSlice::base(&[3, 1, 4, 1, 5], 0, &table, 1)],
        // The sampled token and three drafts: four logit rows.
        vec![SeqSlice::base(&[9, 2, 6, 5], 5, &table, 4)],
        // Two drafts accepted: the next step rewrites positions 8 and on.
        vec![SeqSlice::base(&[3, 5], 8, &table, 2)],
    ];
    for (i, batch) in steps.iter().enumerate() {
        let g = logits(gpu.run(batch).expect("gpu step"));
        let c = logits(cpu.run(batch).expect("cpu step"));
        assert_eq!(g.len(), batch[0].logits, "one row per verified token");
        assert_close(&g, &c, TINY_TOLERANCE, &format!("verification step {i}"));
    }
}

#[test]
fn on_a_gpu_a_copied_block_continues_like_the_original() {
    // Parallel sampling: each sample continues in its own copy of the prompt's partial block.
    let w = tiny_model();
    let bs = 4;
    let Some(mut gpu) = gpu_backend(&w, bs, 16) else { return };
    let mut cpu = CpuBackend::new(tiny_model(), bs, 16);
    let prompt = [7u32, 3, 9, 1, 4, 4];
    let shared = [SeqSlice::base(&prompt, 0, &[2, 6], 1)];
    logits(gpu.run(&shared).expect("prompt"));
    logits(cpu.run(&shared).expect("prompt"));
    gpu.copy_block(6, 9);
    cpu.copy_block(6, 9);
    let (mut original, mut copy) = (vec![0u8; block_bytes(&w, bs)], vec![0u8; block_bytes(&w, bs)]);
    gpu.read_block(6, &mut original).unwrap();
    gpu.read_block(9, &mut copy).unwrap();
    assert!(original == copy, "the copy holds every byte of the block");
    // Two samples decode on: one in the original block, one in the copy.
    let batch = [SeqSlice::base(&[12], 6, &[2, 6], 1), SeqSlice::base(&[12], 6, &[2, 9], 1)];
    let g = logits(gpu.run(&batch).expect("samples"));
    let c = logits(cpu.run(&batch).expect("samples"));
    assert_close(&g, &c, TINY_TOLERANCE, "samples after the copy");
    assert_eq!(g[0], g[1], "the same token after the same context, on either block");
}

#[test]
fn on_a_gpu_a_preempted_sequence_resumes_by_recomputing() {
    // Preemption by recomputation: the sequence's blocks go to another request, which
    // overwrites them; on resumption its prompt and output so far are computed again in the
    // blocks it gets then, and it continues as if it had never left.
    let w = tiny_model();
    let Some(mut gpu) = gpu_backend(&w, 4, 16) else { return };
    let mut cpu = CpuBackend::new(tiny_model(), 4, 16);
    let mut run = |batch: &[SeqSlice]| {
        let g = logits(gpu.run(batch).expect("gpu step"));
        let c = logits(cpu.run(batch).expect("cpu step"));
        assert_close(&g, &c, TINY_TOLERANCE, "preemption");
        g
    };
    let tokens = [11u32, 5, 8, 2, 9, 30, 6];
    run(&[SeqSlice::base(&tokens[..5], 0, &[1, 2], 1)]);
    run(&[SeqSlice::base(&tokens[5..6], 5, &[1, 2], 1)]);
    let before = run(&[SeqSlice::base(&tokens[6..], 6, &[1, 2], 1)]);
    // Preempted: another request takes (and overwrites) blocks 1 and 2.
    run(&[SeqSlice::base(&[40, 41, 42, 43, 44, 45], 0, &[2, 1], 1)]);
    // Resumed elsewhere: everything recomputed in one chunk.
    let after = run(&[SeqSlice::base(&tokens, 0, &[7, 3], 1)]);
    assert_close(&after, &before, TINY_TOLERANCE, "resumed against never preempted");
}

#[test]
fn on_a_gpu_blocks_moved_to_another_gpu_decode_exactly_as_computed_there() {
    // The KV transfer path's two ends: an export reads blocks from one executor's device, an
    // import writes them into another's. Every byte survives, and the importer decodes from
    // them exactly (bit for bit) as the exporter decodes from the blocks it computed.
    let w = tiny_model();
    let bs = 4;
    let Some(mut exporter) = gpu_backend(&w, bs, 16) else { return };
    let mut importer = CudaBackend::new(&w, bs, 16, 0).expect("a second backend");
    let prompt = [4u32, 8, 15, 16, 23, 42, 7, 1];
    exporter.run(&[SeqSlice::base(&prompt, 0, &[3, 5], 1)]).expect("prompt");
    let mut moved = Vec::new();
    for (from, to) in [(3, 10), (5, 0)] {
        let mut bytes = vec![0u8; block_bytes(&w, bs)];
        exporter.read_block(from, &mut bytes).unwrap();
        importer.write_block(to, &bytes).unwrap();
        let mut back = vec![0u8; bytes.len()];
        importer.read_block(to, &mut back).unwrap();
        assert!(back == bytes, "block {from} -> {to}: every byte kept");
        moved.push(bytes);
    }
    assert!(moved.iter().all(|b| b.iter().any(|&x| x != 0)), "the blocks hold computed KV");
    let next = |table: &'static [u32]| [SeqSlice::base(&[9], 8, table, 1)];
    let there = logits(exporter.run(&next(&[3, 5, 7])).expect("exporter decodes"));
    let here = logits(importer.run(&next(&[10, 0, 2])).expect("importer decodes"));
    assert_eq!(here, there, "decoding from moved blocks is decoding from computed ones");
}

/// How far half-precision weights and activations (products' inputs rounded to float16 or
/// bfloat16, f32 accumulation) and an f16 KV cache take the tiny models' logits from the CPU
/// backend's (f32 products, the same f16 KV cache), relative to the largest logit: float16
/// (11 bits) and bfloat16 (8 bits). Measured under the emulation: within 1.7e-3 with float16,
/// 2.4e-2 with bfloat16 (Gemma 2, whose capped logits make the scale small).
fn half_tolerance(storage: Storage) -> f32 {
    if storage == Storage::Bf16 {
        6e-2
    } else {
        5e-3
    }
}

#[test]
fn on_a_gpu_half_precision_weights_and_kv_stay_close_to_the_cpu_backend() {
    for (family, storage) in [
        (Family::LLAMA, Storage::F16),
        (Family::LLAMA, Storage::Bf16),
        (Family::GEMMA2, Storage::Bf16),
        (Family::GEMMA3, Storage::F16),
    ] {
        let w = tiny_model_of(family);
        let precision = Precision { weights: storage, kv: KvDtype::F16 };
        if !device_for_tests() {
            return;
        }
        let mut gpu = CudaBackend::with_precision(&w, 4, 32, 0, precision).expect("backend");
        // Q8_0 and Q4_1 values are a 16-bit scale times small integers: not all fit 16 bits.
        assert!(
            gpu.weights.rounding > 0.0 && gpu.weights.rounding < 1e-2,
            "{}",
            gpu.weights.rounding
        );
        let mut cpu = CpuBackend::with_dtype(tiny_model_of(family), KvDtype::F16, 4, 32);
        let to_half = Emulation::kernel_launches("to_half");
        let (a, b) = ([9u32, 3, 17], [4u32, 30, 1]);
        let steps = [
            vec![
                SeqSlice::base(&[1, 5, 9, 13, 17], 0, &a, 1),
                SeqSlice::base(&[2, 4, 6], 0, &b, 1),
            ],
            vec![SeqSlice::base(&[21], 5, &a, 1), SeqSlice::base(&[8, 10], 3, &b, 2)],
        ];
        for (i, batch) in steps.iter().enumerate() {
            let g = logits(gpu.run(batch).expect("gpu step"));
            let c = logits(cpu.run(batch).expect("cpu step"));
            let what = format!("{} in {}: step {i}", family.name, storage.name());
            assert_close(&g, &c, half_tolerance(storage), &what);
        }
        if let (Some(before), Some(now)) = (to_half, Emulation::kernel_launches("to_half")) {
            // Each product's input is rounded first: four per layer and the head, per step.
            let layers = w.shape.num_layers as u64;
            assert_eq!(now - before, 2 * (4 * layers + 1), "the products ran in half precision");
        }
    }
}

#[test]
fn on_a_gpu_the_real_model_in_half_precision_greedy_decodes_like_the_cpu() {
    if !device_for_tests() {
        return;
    }
    let model = crate::forward::LoadedModel::open(None).expect("the default model");
    let prompt = model.file.tokenizer.encode("The capital of France is").expect("encode");
    let (bs, blocks) = (16, 64);
    let precision = Precision { weights: Storage::F16, kv: KvDtype::F16 };
    let mut gpu =
        CudaBackend::with_precision(&model.weights, bs, blocks, 0, precision).expect("backend");
    eprintln!("float16 weights: largest rounding {:e} of a matrix's largest", gpu.weights.rounding);
    let mut cpu = CpuBackend::with_dtype(model.weights, KvDtype::F16, bs, blocks);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let (mut toks, mut start) = (prompt.clone(), 0);
    for step in 0..6 {
        let batch = [SeqSlice::base(&toks[start..], start, &table, 1)];
        let g = logits(gpu.run(&batch).expect("gpu step"));
        let c = logits(cpu.run(&batch).expect("cpu step"));
        assert_close(&g, &c, half_tolerance(Storage::F16), &format!("float16, step {step}"));
        let (tg, tc) = (ops::argmax(&g[0]), ops::argmax(&c[0]));
        assert_eq!(tg, tc, "step {step}: greedy tokens differ");
        start = toks.len();
        toks.push(tc.expect("non-empty vocabulary") as u32);
    }
}

#[test]
fn on_a_gpu_the_kernels_round_to_half_precision_exactly_as_the_host_does() {
    if !device_for_tests() {
        return;
    }
    let gpu = super::device::Gpu::open(0).expect("device");
    let st = &gpu.stream;
    // Ties, subnormals, the largest finite values and past them, zeros, infinities, NaN, and a
    // sweep of ordinary values.
    let mut values = vec![
        0.0,
        -0.0,
        1.0,
        65504.0,
        65519.0,
        65520.0,
        -65520.0,
        6.0e-8,
        2.98e-8,
        5.96e-8,
        1.0e-40,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        3.0e38,
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
    ];
    values.extend((0..4000).map(|i| (i as f32 - 2000.0).powi(3) * 1.37e-6));
    let x = st.clone_htod(&values).unwrap();
    let mut out = st.alloc_zeros::<u16>(values.len()).unwrap();
    for bf16 in [false, true] {
        gpu.kernels.to_half(st, &mut out, &x, values.len(), bf16).unwrap();
        let got = st.clone_dtoh(&out).unwrap();
        let (want, _) = super::weights::narrow(&values, bf16);
        for ((g, w), v) in got.iter().zip(&want).zip(&values) {
            assert_eq!(g, w, "{v:e} to {}", if bf16 { "bfloat16" } else { "float16" });
        }
    }
    // And back: every float16 and bfloat16 bit pattern widens as the host widens it.
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let bits = st.clone_htod(&all).unwrap();
    let idx = st.clone_htod(&[0u32]).unwrap();
    let mut wide = st.alloc_zeros::<f32>(all.len()).unwrap();
    for bf16 in [false, true] {
        gpu.kernels.gather_rows_half(st, &mut wide, (&bits, bf16), &idx, 1, all.len()).unwrap();
        let got = st.clone_dtoh(&wide).unwrap();
        for (g, h) in got.iter().zip(&all) {
            let want = if bf16 {
                half::bf16::from_bits(*h).to_f32()
            } else {
                half::f16::from_bits(*h).to_f32()
            };
            assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()), "{h:#06x}");
        }
    }
}

/// LoRA adapters on the GPU: sequences with two adapters (ranks 4 and 2, on every projection)
/// and one without, in one batch through a prompt and a decode step, match the CPU backend
/// (whose updates the executor's tests hold to an independent merge); the adapters' rows
/// differ from the base model's; under the emulation, one `lora_add` launch per adapter and
/// update per block ran.
#[test]
fn on_a_gpu_lora_adapters_match_the_cpu_backend() {
    // Gemma 2 norms each block's outputs: its updates go in before the norm.
    for family in [Family::LLAMA, Family::GEMMA2] {
        lora_adapters_match_the_cpu_backend(family);
    }
}

/// [`on_a_gpu_lora_adapters_match_the_cpu_backend`] on a model of `family`.
fn lora_adapters_match_the_cpu_backend(family: Family) {
    use crate::forward::synthetic::synthesize_adapter;
    let Some((w, mut gpu, mut cpu)) = both_backends(family) else { return };
    let (x, y) = (synthesize_adapter(&w.shape, 4, 1), synthesize_adapter(&w.shape, 2, 2));
    let tables = ([9u32, 3], [4u32, 30], [25u32, 7]);
    let with = |tokens, start, table, adapter| SeqSlice {
        adapter,
        ..SeqSlice::base(tokens, start, table, 1)
    };
    let prompt = [1, 5, 9, 13, 17];
    let steps = [
        [
            with(&prompt[..], 0, &tables.0[..], Some(&x)),
            with(&prompt[..], 0, &tables.1[..], None),
            with(&prompt[..], 0, &tables.2[..], Some(&y)),
        ],
        [
            with(&[21][..], 5, &tables.0[..], Some(&x)),
            with(&[21][..], 5, &tables.1[..], None),
            with(&[21][..], 5, &tables.2[..], Some(&y)),
        ],
    ];
    let before = Emulation::kernel_launches("lora_add");
    for (i, batch) in steps.iter().enumerate() {
        gpu.check(batch).expect("valid batch");
        let g = logits(gpu.run(batch).expect("gpu step"));
        let c = logits(cpu.run(batch).expect("cpu step"));
        assert_close(&g, &c, TINY_TOLERANCE, &format!("{}: LoRA step {i}", family.name));
        assert!(g[0] != g[1] && g[2] != g[1] && g[0] != g[2], "step {i}: the adapters count");
    }
    if let (Some(before), Some(after)) = (before, Emulation::kernel_launches("lora_add")) {
        // Seven updates a block (Q, K, V, O, gate, up, down) for each of the two adapters.
        let want = steps.len() as u64 * 2 * 7 * w.shape.num_layers as u64;
        assert_eq!(after - before, want, "{}: lora_add launches", family.name);
    }
}
