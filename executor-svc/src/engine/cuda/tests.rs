//! Tests of the CUDA backend: the GPU forward against the CPU backend on the same batches, under
//! the CPU emulation of CUDA ([`crate::engine::cuda_emulation`]; CI sets `FERRY_CUDA_TESTS=emulated`, so they
//! cannot skip there) or on a real GPU (`FERRY_CUDA_TESTS=gpu`, `scripts/gpu-check`); and, in a
//! process without either, the clear refusal of a machine with no driver.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use ferry_model::Family;

use super::probe::{try_load, CudaLibrary};
use super::{kernels, CudaBackend, CudaError};
use crate::engine::backend::{BatchOutput, CpuBackend, ModelBackend};
use crate::engine::cuda_emulation::{device_for_tests, Emulation, Stats};
use crate::forward::llama::LayerWeights;
use crate::forward::paged::SeqSlice;
use crate::forward::{ops, LlamaShape, LlamaWeights};
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
    if !device_available() {
        return;
    }
    if let Err(e) = kernels::compile() {
        panic!("{e}");
    }
}

/// Whether a CUDA device can be used here (see [`device_for_tests`]).
fn device_available() -> bool {
    device_for_tests()
}

/// The CUDA backend on device 0, or `None` where [`device_available`] says so.
fn gpu_backend(w: &LlamaWeights, block_size: usize, num_blocks: usize) -> Option<CudaBackend> {
    if !device_available() {
        return None;
    }
    match CudaBackend::new(w, block_size, num_blocks, 0) {
        Ok(b) => Some(b),
        Err(e) => panic!("the CUDA backend failed to start: {e}"),
    }
}

/// The emulation's counters now, or `None` on a real GPU.
fn emulation_stats() -> Option<Stats> {
    Emulation::stats()
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

/// [`on_a_gpu_mixed_batches_match_the_cpu_backend`] on a model of `family`.
fn mixed_batches_match_the_cpu_backend(family: Family) {
    let w = tiny_model_of(family);
    let (bs, blocks) = (4, 32);
    let Some(mut gpu) = gpu_backend(&w, bs, blocks) else { return };
    let mut cpu = CpuBackend::new(tiny_model_of(family), bs, blocks);
    // Scattered tables; A and B share no block.
    let (table_a, table_b, table_c) = ([9u32, 3, 17], [4u32, 30, 1, 12], [25u32]);
    let steps: Vec<Vec<SeqSlice>> = vec![
        vec![
            // A: a whole 5-token prompt; B: the first chunk of its prompt (no logits).
            SeqSlice { tokens: &[1, 5, 9, 13, 17], start: 0, block_table: &table_a, logits: 1 },
            SeqSlice { tokens: &[2, 4, 6], start: 0, block_table: &table_b, logits: 0 },
        ],
        vec![
            // B's second chunk crosses a block boundary; A decodes; C is a 1-token prompt.
            SeqSlice {
                tokens: &[8, 10, 12, 14, 16, 18],
                start: 3,
                block_table: &table_b,
                logits: 1,
            },
            SeqSlice { tokens: &[21], start: 5, block_table: &table_a, logits: 1 },
            SeqSlice { tokens: &[33], start: 0, block_table: &table_c, logits: 1 },
        ],
        vec![
            SeqSlice { tokens: &[40], start: 6, block_table: &table_a, logits: 1 },
            SeqSlice { tokens: &[41], start: 9, block_table: &table_b, logits: 1 },
        ],
    ];
    let before = (emulation_stats(), Emulation::kernel_launches("paged_attention"));
    for (i, batch) in steps.iter().enumerate() {
        gpu.check(batch).expect("valid batch");
        let g = logits(gpu.run(batch).expect("gpu step"));
        let c = logits(cpu.run(batch).expect("cpu step"));
        assert_close(&g, &c, TINY_TOLERANCE, &format!("{}: step {i}", family.name));
    }
    // Under the emulation, its own counts show the device did the work: per step, four
    // products per layer and the LM head (every step here samples), one attention per layer.
    if let ((Some(before), Some(attn_before)), Some(after)) = (before, emulation_stats()) {
        let (steps, layers) = (steps.len() as u64, w.shape.num_layers as u64);
        assert_eq!(after.gemms - before.gemms, steps * (4 * layers + 1), "{}", family.name);
        let attn = Emulation::kernel_launches("paged_attention").unwrap() - attn_before;
        assert_eq!(attn, steps * layers, "{}: attention launches", family.name);
        assert!(after.launches - before.launches > steps * layers * 6, "{}", family.name);
        assert!(after.fiber_switches > before.fiber_switches, "barriers were met");
    }
}

#[test]
fn on_a_gpu_bad_batches_are_refused_like_on_the_cpu() {
    let w = tiny_model();
    let Some(mut gpu) = gpu_backend(&w, 4, 8) else { return };
    let out_of_range = [SeqSlice { tokens: &[1], start: 0, block_table: &[8], logits: 1 }];
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
        let batch = [SeqSlice { tokens: &toks[start..], start, block_table: &table, logits: 1 }];
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
        vec![SeqSlice { tokens: &[3, 1, 4, 1, 5], start: 0, block_table: &table, logits: 1 }],
        // The sampled token and three drafts: four logit rows.
        vec![SeqSlice { tokens: &[9, 2, 6, 5], start: 5, block_table: &table, logits: 4 }],
        // Two drafts accepted: the next step rewrites positions 8 and on.
        vec![SeqSlice { tokens: &[3, 5], start: 8, block_table: &table, logits: 2 }],
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
    let shared = [SeqSlice { tokens: &prompt, start: 0, block_table: &[2, 6], logits: 1 }];
    logits(gpu.run(&shared).expect("prompt"));
    logits(cpu.run(&shared).expect("prompt"));
    gpu.copy_block(6, 9);
    cpu.copy_block(6, 9);
    let (mut original, mut copy) = (vec![0u8; block_bytes(&w, bs)], vec![0u8; block_bytes(&w, bs)]);
    gpu.read_block(6, &mut original).unwrap();
    gpu.read_block(9, &mut copy).unwrap();
    assert!(original == copy, "the copy holds every byte of the block");
    // Two samples decode on: one in the original block, one in the copy.
    let batch = [
        SeqSlice { tokens: &[12], start: 6, block_table: &[2, 6], logits: 1 },
        SeqSlice { tokens: &[12], start: 6, block_table: &[2, 9], logits: 1 },
    ];
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
    run(&[SeqSlice { tokens: &tokens[..5], start: 0, block_table: &[1, 2], logits: 1 }]);
    run(&[SeqSlice { tokens: &tokens[5..6], start: 5, block_table: &[1, 2], logits: 1 }]);
    let before =
        run(&[SeqSlice { tokens: &tokens[6..], start: 6, block_table: &[1, 2], logits: 1 }]);
    // Preempted: another request takes (and overwrites) blocks 1 and 2.
    run(&[SeqSlice {
        tokens: &[40, 41, 42, 43, 44, 45],
        start: 0,
        block_table: &[2, 1],
        logits: 1,
    }]);
    // Resumed elsewhere: everything recomputed in one chunk.
    let after = run(&[SeqSlice { tokens: &tokens, start: 0, block_table: &[7, 3], logits: 1 }]);
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
    exporter
        .run(&[SeqSlice { tokens: &prompt, start: 0, block_table: &[3, 5], logits: 1 }])
        .expect("prompt");
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
    let next = |table: &'static [u32]| {
        [SeqSlice { tokens: &[9], start: 8, block_table: table, logits: 1 }]
    };
    let there = logits(exporter.run(&next(&[3, 5, 7])).expect("exporter decodes"));
    let here = logits(importer.run(&next(&[10, 0, 2])).expect("importer decodes"));
    assert_eq!(here, there, "decoding from moved blocks is decoding from computed ones");
}
