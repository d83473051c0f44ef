//! `ferry-executor bench`: throughput of the CPU forward on the real model — decode tokens/s at
//! several batch sizes, prefill tokens/s for 512-token prompts, and KV memory per cached token,
//! with the machine's CPU features and where each step's time goes (matrix products,
//! attention, the rest of the forward, sampling, and the scheduling core's step for that many
//! requests). It drives the paged forward directly (no service around it; the KV cache where an
//! executor keeps it, in shared memory), so it measures the engine, not the network;
//! `--kernels` times the matrix products alone, per kernel. `--structured` instead measures what
//! structured outputs cost: sampled decode through the engine with and without a JSON schema
//! ([`run_structured`]).

use std::time::{Duration, Instant};

use ferry_model::sampling::SamplingParams;

use crate::engine::sampling::{Sampler, PARALLEL_DRAWS};
use crate::kernels::{matmul_with, Kernel, QWeight};
use crate::model::paged::{forward, ForwardScratch, PhaseTimes, SeqSlice};
use crate::model::{ops::argmax, KvDtype, LlamaWeights, PagedKvCache};

/// One measured figure.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchRow {
    /// What was measured.
    pub scenario: String,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per second.
    pub tokens_per_s: f64,
    /// Median step time, milliseconds.
    pub median_step_ms: f64,
    /// Shares of the step's time (they sum to 1).
    pub shares: Shares,
}

/// Where a step's time goes, as fractions of the whole.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Shares {
    /// Matrix products.
    pub matmul: f64,
    /// Attention (with the rotary embedding and cache writes).
    pub attention: f64,
    /// The rest of the forward.
    pub other: f64,
    /// Sampling the next tokens (temperature 0.8, top-p 0.95, seeded).
    pub sampling: f64,
    /// The scheduling core's step (`schedule` + `apply_result`) for as many requests.
    pub scheduling: f64,
}

impl Shares {
    fn of(times: PhaseTimes, sampling: Duration, scheduling: Duration) -> Self {
        let parts = [times.matmul, times.attention, times.other, sampling, scheduling]
            .map(|d| d.as_secs_f64());
        let total: f64 = parts.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        let [matmul, attention, other, sampling, scheduling] = parts.map(|p| p / total);
        Shares { matmul, attention, other, sampling, scheduling }
    }
}

/// The CPU as the bench sees it: model name, threads, the SIMD features the kernels care
/// about, and the product kernel in use.
pub fn cpu_summary() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    #[allow(unused_mut)]
    let mut features: Vec<&str> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! probe {
            ($($f:tt),*) => {
                $(if is_x86_feature_detected!($f) { features.push($f); })*
            };
        }
        probe!("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni", "avx512bf16", "avxvnni");
    }
    format!(
        "cpu: {model}, {} threads; features: {}; product kernel: {}",
        rayon::current_num_threads(),
        if features.is_empty() { "none of interest".to_string() } else { features.join(" ") },
        Kernel::best().name()
    )
}

/// Options of the bench.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Decode batch sizes.
    pub batches: Vec<usize>,
    /// Decode steps timed per batch size.
    pub decode_steps: usize,
    /// Prompt length for the prefill figure.
    pub prefill_len: usize,
    /// Prefill repetitions.
    pub prefill_reps: usize,
    /// Tokens each decode sequence holds before the timed steps.
    pub context: usize,
    /// The KV cache's element type.
    pub kv_dtype: KvDtype,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            batches: vec![1, 8, 16, 32, 64],
            decode_steps: 16,
            prefill_len: 512,
            prefill_reps: 3,
            context: 128,
            kv_dtype: KvDtype::default(),
        }
    }
}

const BS: usize = 16;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}

/// Runs the scenarios; `progress` hears about each row as it is measured.
pub fn run(
    w: &LlamaWeights,
    opts: &BenchOptions,
    mut progress: impl FnMut(&BenchRow),
) -> Vec<BenchRow> {
    let mut rows = Vec::new();
    let mut scratch = ForwardScratch::default();
    let vocab = w.shape.vocab_size as u32;
    // Deterministic, varied prompt tokens.
    let prompt = |seed: usize, len: usize| -> Vec<u32> {
        (0..len).map(|i| ((seed * 7919 + i * 104_729) as u32 % (vocab - 1000)) + 500).collect()
    };

    // Prefill.
    let len = opts.prefill_len;
    let blocks = len.div_ceil(BS);
    let mut cache = bench_cache(w, opts.kv_dtype, blocks);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut times = Vec::new();
    scratch.times = PhaseTimes::default();
    let reps = if len == 0 { 0 } else { opts.prefill_reps };
    for rep in 0..reps {
        let toks = prompt(rep, len);
        let batch = [SeqSlice { tokens: &toks, start: 0, block_table: &table, logits: 1 }];
        let t = Instant::now();
        forward(w, &mut cache, &batch, &mut scratch).expect("bench batch is valid");
        times.push(t.elapsed().as_secs_f64());
    }
    if !times.is_empty() {
        let med = median(times);
        let row = BenchRow {
            scenario: format!("prefill {len}-token prompt"),
            batch: 1,
            tokens_per_s: len as f64 / med,
            median_step_ms: med * 1e3,
            shares: Shares::of(scratch.times.take(), Duration::ZERO, Duration::ZERO),
        };
        progress(&row);
        rows.push(row);
    }

    // Decode: each sequence has a context of `opts.context` tokens, then steps of one each.
    let ctx = opts.context.max(1);
    for &b in &opts.batches {
        let per_seq = (ctx + opts.decode_steps + 1).div_ceil(BS);
        let mut cache = bench_cache(w, opts.kv_dtype, per_seq * b);
        let tables: Vec<Vec<u32>> =
            (0..b).map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect()).collect();
        let mut seqs: Vec<Vec<u32>> = (0..b).map(|s| prompt(s + 17, ctx)).collect();
        let batch: Vec<SeqSlice> = seqs
            .iter()
            .zip(&tables)
            .map(|(t, tb)| SeqSlice { tokens: t, start: 0, block_table: tb, logits: 1 })
            .collect();
        let logits = forward(w, &mut cache, &batch, &mut scratch).expect("bench batch is valid");
        for (s, l) in seqs.iter_mut().zip(logits) {
            s.push(argmax(&l).unwrap_or(0) as u32);
        }
        let params =
            SamplingParams { temperature: 0.8, top_p: 0.95, seed: 7, ..Default::default() };
        let mut sampler = Sampler::new();
        let (mut times, mut sampling) = (Vec::new(), Duration::ZERO);
        scratch.times = PhaseTimes::default();
        for _ in 0..opts.decode_steps {
            let batch: Vec<SeqSlice> = seqs
                .iter()
                .zip(&tables)
                .map(|(t, tb)| SeqSlice {
                    tokens: &t[t.len() - 1..],
                    start: t.len() - 1,
                    block_table: tb,
                    logits: 1,
                })
                .collect();
            let t = Instant::now();
            let mut logits =
                forward(w, &mut cache, &batch, &mut scratch).expect("bench batch is valid");
            let s0 = Instant::now();
            draw_all(&mut sampler, &mut seqs, &mut logits, ctx, &params);
            sampling += s0.elapsed();
            times.push(t.elapsed().as_secs_f64());
        }
        let total: f64 = times.iter().sum();
        let steps = opts.decode_steps.max(1);
        let scheduling = Duration::from_secs_f64(
            ferry_sched_core::bench::decode_step_us(b, 50) * 1e-6 * steps as f64,
        );
        let row = BenchRow {
            scenario: format!("decode ({ctx}-token context)"),
            batch: b,
            tokens_per_s: (b * opts.decode_steps) as f64 / total,
            median_step_ms: median(times) * 1e3,
            shares: Shares::of(scratch.times.take(), sampling, scheduling),
        };
        progress(&row);
        rows.push(row);
    }
    rows
}

/// A KV cache of `blocks` blocks where a serving executor keeps it: in a region of the shared
/// memory directory (page-aligned, like the pool an executor shares with its KV agent), or, where
/// none can be made, in private memory.
fn bench_cache(w: &LlamaWeights, dtype: KvDtype, blocks: usize) -> PagedKvCache {
    use ferry_kv_transfer_svc::shm::{Staging, DEFAULT_DIR};
    let block_bytes = PagedKvCache::bytes_per_token(&w.shape, dtype) * BS;
    let shared = u32::try_from(blocks).ok().and_then(|n| {
        Staging::create_with_pool(std::path::Path::new(DEFAULT_DIR), block_bytes, n, 1).ok()
    });
    if let Some((_region, pool)) = shared {
        if let Ok(cache) = PagedKvCache::in_pool(&w.shape, dtype, BS, blocks, pool) {
            return cache;
        }
    }
    PagedKvCache::with_dtype(&w.shape, dtype, BS, blocks)
}

/// Samples each sequence's next token from its logits and appends it, as the engine draws a
/// step's rows: in parallel on the forward's threads from `PARALLEL_DRAWS` rows.
fn draw_all(
    sampler: &mut Sampler,
    seqs: &mut [Vec<u32>],
    logits: &mut [Vec<f32>],
    ctx: usize,
    params: &SamplingParams,
) {
    use rayon::prelude::*;
    let draw = |sampler: &mut Sampler, s: &mut Vec<u32>, l: &mut Vec<f32>| {
        let (prompt, output) = s.split_at(ctx);
        let next = sampler
            .sample(l, params, prompt, output, s.len() as u64)
            .expect("bench sampling parameters are valid");
        s.push(next.token);
    };
    if seqs.len() < PARALLEL_DRAWS {
        seqs.iter_mut().zip(logits).for_each(|(s, l)| draw(sampler, s, l));
    } else {
        crate::model::paged::in_pool(|| {
            seqs.par_iter_mut()
                .zip(logits.par_iter_mut())
                .for_each_init(Sampler::new, |sampler, (s, l)| draw(sampler, s, l));
        });
    }
}

/// One structured-output round: `batch` sampled requests decoding through the engine, each
/// constrained by a JSON schema or not.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GrammarRow {
    /// Requests per step.
    pub batch: usize,
    /// Whether the requests had a grammar.
    pub constrained: bool,
    /// Decode tokens per second (all requests together).
    pub tokens_per_s: f64,
    /// Mask computation per constrained token, microseconds (on the thread beside the forward).
    pub mask_us_per_token: f64,
    /// Time a step waited for its masks after the forward, per step, microseconds.
    pub wait_us_per_step: f64,
}

/// The schema of the structured-output rounds: an array of people with no bound on its length,
/// so every step is inside the grammar (a bounded one would end in a few dozen tokens and then
/// allow EOS alone, which costs nothing).
const PEOPLE_SCHEMA: &str = r#"{"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": false}}"#;

/// The cost of structured outputs: for each batch size, rounds without and with a grammar in
/// the order A B B A (so a drift in the machine's speed hits both alike), each `steps` decode
/// steps of sampled requests through the engine (its mask thread included).
pub fn run_structured(
    model: crate::model::LoadedModel,
    batches: &[usize],
    steps: usize,
    mut progress: impl FnMut(&GrammarRow),
) -> anyhow::Result<Vec<GrammarRow>> {
    use crate::engine::{CpuBackend, Engine, EngineConfig};
    use ferry_proto::v1;
    let crate::model::LoadedModel { file, weights } = model;
    let tok = &file.tokenizer;
    let messages = [ferry_model::ChatMessage {
        role: "user".into(),
        content: "List ten people as JSON.".into(),
    }];
    let prompt = tok.encode(&tok.apply_chat_template(&messages, true)?)?;
    let per_seq = (prompt.len() + steps + 2).div_ceil(BS);
    let most = batches.iter().copied().max().unwrap_or(1);
    let backend = CpuBackend::with_dtype(weights, KvDtype::default(), BS, per_seq * most);
    let mut engine = Engine::new(Box::new(backend), EngineConfig::new(tok.eos_token_id))
        .with_grammars(Some(file.clone()));
    let mut rows = Vec::new();
    for &b in batches {
        for constrained in [false, true, true, false] {
            engine.reset();
            let structured_output = constrained.then(|| v1::StructuredOutput {
                kind: Some(v1::structured_output::Kind::JsonSchema(PEOPLE_SCHEMA.into())),
            });
            let work = |id: u64, key: v1::WorkKey, n: usize| v1::ScheduledWork {
                id,
                key: key.into(),
                num_tokens: n as u32,
                draft_token_ids: vec![],
            };
            let ids = 0..b as u64;
            let prefill = v1::Step {
                step_id: 0,
                new_requests: ids
                    .clone()
                    .map(|id| v1::NewRequest {
                        id,
                        prompt_token_ids: prompt.clone(),
                        sampling: Some(v1::SamplingParams {
                            temperature: 1.0,
                            seed: Some(id),
                            structured_output: structured_output.clone(),
                            ..Default::default()
                        }),
                        block_ids: ((id as usize * per_seq) as u32..).take(per_seq).collect(),
                        ..Default::default()
                    })
                    .collect(),
                work: ids.clone().map(|id| work(id, v1::WorkKey::Prompt, prompt.len())).collect(),
                total_num_tokens: (b * prompt.len()) as u32,
                ..Default::default()
            };
            engine.execute(&prefill)?;
            let (mut mask_us, mut wait_us) = (0u64, 0u64);
            let t = Instant::now();
            for step_id in 1..=steps as u64 {
                let decode = v1::Step {
                    step_id,
                    work: ids.clone().map(|id| work(id, v1::WorkKey::Decode, 1)).collect(),
                    total_num_tokens: b as u32,
                    ..Default::default()
                };
                let result = engine.execute(&decode)?;
                anyhow::ensure!(result.refused.is_empty(), "refused: {:?}", result.refused);
                let timing = result.timing.unwrap_or_default();
                mask_us += timing.grammar_us;
                wait_us += timing.grammar_wait_us;
            }
            let elapsed = t.elapsed().as_secs_f64();
            let tokens = (b * steps) as f64;
            let row = GrammarRow {
                batch: b,
                constrained,
                tokens_per_s: tokens / elapsed,
                mask_us_per_token: if constrained { mask_us as f64 / tokens } else { 0.0 },
                wait_us_per_step: wait_us as f64 / steps as f64,
            };
            progress(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// One product's speed: a weight matrix of the model against `rows` activation rows.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KernelRow {
    /// Which matrix (`[outputs, inputs]`).
    pub weight: String,
    /// Activation rows.
    pub rows: usize,
    /// Kernel.
    pub kernel: &'static str,
    /// Multiply-adds ×2 per second, billions.
    pub gflops: f64,
    /// Weight bytes read per second (once per product), GB.
    pub weight_gbs: f64,
}

/// Times each kernel this CPU runs on the first layer's products and the output head, for
/// each row count in `rows`: where the memory-bound (fused) path gives way to the panel path,
/// and what each instruction set gives.
pub fn run_kernels(
    w: &LlamaWeights,
    rows: &[usize],
    mut progress: impl FnMut(&KernelRow) + Send,
) -> Vec<KernelRow> {
    let l0 = &w.layers[0];
    let mats: [(&str, &QWeight); 4] = [
        ("qkv", &l0.wqkv),
        ("gate_up", &l0.w_gate_up),
        ("down", &l0.w_down),
        ("lm_head", &w.lm_head),
    ];
    let mut out_rows = Vec::new();
    crate::model::paged::in_pool(|| {
        for (name, m) in mats {
            for &n in rows {
                let x: Vec<f32> =
                    (0..n * m.cols).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
                let mut out = vec![0f32; n * m.rows];
                for kernel in Kernel::available().into_iter().filter(|k| *k != Kernel::Portable) {
                    matmul_with(&x, n, m, &mut out, kernel);
                    let (mut reps, start) = (0u32, Instant::now());
                    while start.elapsed().as_secs_f64() < 0.2 {
                        matmul_with(&x, n, m, &mut out, kernel);
                        reps += 1;
                    }
                    let secs = start.elapsed().as_secs_f64() / f64::from(reps);
                    let row = KernelRow {
                        weight: format!("{name} [{}, {}]", m.rows, m.cols),
                        rows: n,
                        kernel: kernel.name(),
                        gflops: 2.0 * (n * m.rows * m.cols) as f64 / secs / 1e9,
                        weight_gbs: m.bytes() as f64 / secs / 1e9,
                    };
                    progress(&row);
                    out_rows.push(row);
                }
            }
        }
    });
    out_rows
}
