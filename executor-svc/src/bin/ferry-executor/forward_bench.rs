//! `ferry-executor bench`: throughput of the CPU forward on the real model — decode tokens/s at
//! several batch sizes, prefill tokens/s for 512-token prompts, and KV memory per cached token,
//! with the machine's CPU features and where each step's time goes (matrix products,
//! attention, the rest of the forward, sampling). It drives the paged forward directly (no
//! service around it; the KV cache where an executor keeps it, in shared memory), so it
//! measures the engine, not the network. `--kernels` times the matrix products alone, per
//! kernel (`kernel_bench`); `--structured` measures what structured outputs cost
//! (`structured_bench`).

use std::time::{Duration, Instant};

use ferry_executor_svc::engine::sampling::{Sampler, PARALLEL_DRAWS};
use ferry_executor_svc::forward::paged::{forward, ForwardScratch, PhaseTimes, SeqSlice};
use ferry_executor_svc::forward::synthetic::synthesize_adapter;
use ferry_executor_svc::forward::{ops::argmax, KvDtype, LlamaWeights, LoadedModel, PagedKvCache};
use ferry_executor_svc::kernels::Kernel;
use ferry_model::lora::LoraAdapter;
use ferry_model::sampling::SamplingParams;

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
}

impl Shares {
    fn of(times: PhaseTimes, sampling: Duration) -> Self {
        let parts = [times.matmul, times.attention, times.other, sampling].map(|d| d.as_secs_f64());
        let total: f64 = parts.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        let [matmul, attention, other, sampling] = parts.map(|p| p / total);
        Shares { matmul, attention, other, sampling }
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
    /// Distinct LoRA adapters in each batch, one measurement of every scenario per entry
    /// (sequence `i` runs adapter `i % n`; 0: the base model); empty: the base model alone.
    pub lora_adapters: Vec<usize>,
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
            lora_adapters: Vec::new(),
        }
    }
}

/// Tokens per KV block.
pub(crate) const BS: usize = 16;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}

/// Rank of the adapters `--lora-adapters` times (a common fine-tune's).
const LORA_RANK: usize = 16;

/// Runs the scenarios, once per entry of `--lora-adapters` (each row's scenario names its
/// adapters), interleaved so every count meets the same machine; `progress` hears about each
/// row as it is measured.
fn run(
    w: &LlamaWeights,
    opts: &BenchOptions,
    mut progress: impl FnMut(&BenchRow),
) -> Vec<BenchRow> {
    if opts.lora_adapters.is_empty() {
        return run_with(w, opts, &[], &mut |r: &mut BenchRow| progress(r));
    }
    let most = opts.lora_adapters.iter().copied().max().unwrap_or(0);
    let adapters: Vec<LoraAdapter> =
        (0..most).map(|i| synthesize_adapter(&w.shape, LORA_RANK, i as u64 + 1)).collect();
    let mut rows = Vec::new();
    for &n in &opts.lora_adapters {
        let mut named = |r: &mut BenchRow| {
            r.scenario = format!("{}, {n} adapters", r.scenario);
            progress(r);
        };
        rows.extend(run_with(w, opts, &adapters[..n], &mut named));
    }
    rows
}

/// The scenarios, sequence `i` of a batch running `adapters[i % n]` (none when empty).
fn run_with(
    w: &LlamaWeights,
    opts: &BenchOptions,
    adapters: &[LoraAdapter],
    progress: &mut impl FnMut(&mut BenchRow),
) -> Vec<BenchRow> {
    let mut rows = Vec::new();
    let mut scratch = ForwardScratch::default();
    let vocab = w.shape.vocab_size as u32;
    // Deterministic, varied prompt tokens, away from the vocabulary's first and last ids (its
    // special tokens) where it is big enough (a tiny test vocabulary takes any id).
    let (base, span) = if vocab > 1500 { (500, vocab - 1000) } else { (0, vocab) };
    let prompt = |seed: usize, len: usize| -> Vec<u32> {
        (0..len).map(|i| ((seed * 7919 + i * 104_729) as u32 % span) + base).collect()
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
        let batch = [seq(adapters, 0, &toks, 0, &table, 1)];
        let t = Instant::now();
        forward(w, &mut cache, &batch, &mut scratch).expect("bench batch is valid");
        times.push(t.elapsed().as_secs_f64());
    }
    if !times.is_empty() {
        let med = median(times);
        let mut row = BenchRow {
            scenario: format!("prefill {len}-token prompt"),
            batch: 1,
            tokens_per_s: len as f64 / med,
            median_step_ms: med * 1e3,
            shares: Shares::of(scratch.times.take(), Duration::ZERO),
        };
        progress(&mut row);
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
            .enumerate()
            .map(|(s, (t, tb))| seq(adapters, s, t, 0, tb, 1))
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
                .enumerate()
                .map(|(s, (t, tb))| seq(adapters, s, &t[t.len() - 1..], t.len() - 1, tb, 1))
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
        let mut row = BenchRow {
            scenario: format!("decode ({ctx}-token context)"),
            batch: b,
            tokens_per_s: (b * opts.decode_steps) as f64 / total,
            median_step_ms: median(times) * 1e3,
            shares: Shares::of(scratch.times.take(), sampling),
        };
        progress(&mut row);
        rows.push(row);
    }
    rows
}

/// Sequence `s` of a batch: `tokens` from `start`, running `adapters[s % n]` (none when empty).
fn seq<'a>(
    adapters: &'a [LoraAdapter],
    s: usize,
    tokens: &'a [u32],
    start: usize,
    block_table: &'a [u32],
    logits: usize,
) -> SeqSlice<'a> {
    let adapter = (!adapters.is_empty()).then(|| &adapters[s % adapters.len()]);
    SeqSlice { tokens, start, block_table, logits, adapter }
}

/// A KV cache of `blocks` blocks where a serving executor keeps it: in a region of the shared
/// memory directory (page-aligned, like the pool an executor shares with its KV agent), or, where
/// none can be made, in private memory.
fn bench_cache(w: &LlamaWeights, dtype: KvDtype, blocks: usize) -> PagedKvCache {
    use ferry_kv_wire::shm::{Staging, DEFAULT_DIR};
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
        ferry_executor_svc::forward::paged::in_pool(|| {
            seqs.par_iter_mut()
                .zip(logits.par_iter_mut())
                .for_each_init(Sampler::new, |sampler, (s, l)| draw(sampler, s, l));
        });
    }
}

/// Runs the bench on `model` (the default model when `None`) and prints its rows: a table, or
/// JSON with `json`.
pub(crate) fn report(
    model: Option<&std::path::Path>,
    opts: &BenchOptions,
    json: bool,
) -> anyhow::Result<()> {
    let model = LoadedModel::open(model)?;
    let kv_bytes = PagedKvCache::bytes_per_token(&model.weights.shape, opts.kv_dtype);
    let cpu = cpu_summary();
    if !json {
        println!("{cpu}");
        println!(
            "model {} ({}); KV cache {} {kv_bytes} bytes per cached token",
            model.file.name,
            model.file.path.display(),
            opts.kv_dtype.name()
        );
        println!(
            "{:<40} {:>6} {:>10} {:>9} | share of step time: {:>6} {:>6} {:>6} {:>6}",
            "scenario", "batch", "tokens/s", "step ms", "matmul", "attn", "other", "sample"
        );
    }
    let rows = run(&model.weights, opts, |r| {
        if !json {
            let pct = |f: f64| format!("{:.1}%", 100.0 * f);
            let s = &r.shares;
            println!(
                "{:<40} {:>6} {:>10.1} {:>9.2} |                     {:>6} {:>6} {:>6} {:>6}",
                r.scenario,
                r.batch,
                r.tokens_per_s,
                r.median_step_ms,
                pct(s.matmul),
                pct(s.attention),
                pct(s.other),
                pct(s.sampling)
            );
        }
    });
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({ "cpu": cpu, "kv_bytes_per_token": kv_bytes, "rows": rows })
            )?
        );
    }
    Ok(())
}
