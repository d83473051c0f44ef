//! `ferry-executor bench`: throughput of the CPU forward on the real model — decode tokens/s at
//! several batch sizes, prefill tokens/s for 512-token prompts, and KV memory per cached token.
//! It drives the paged forward directly (greedy, no service around it), so it measures the
//! engine, not the network.

use std::time::Instant;

use crate::model::paged::{forward, ForwardScratch, SeqSlice};
use crate::model::{ops::argmax, LlamaWeights, PagedKvCache};

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
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            batches: vec![1, 8, 16, 32, 64],
            decode_steps: 16,
            prefill_len: 512,
            prefill_reps: 3,
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
    let mut cache = PagedKvCache::new(&w.shape, BS, blocks);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut times = Vec::new();
    for rep in 0..opts.prefill_reps {
        let toks = prompt(rep, len);
        let batch = [SeqSlice { tokens: &toks, start: 0, block_table: &table, wants_logits: true }];
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
        };
        progress(&row);
        rows.push(row);
    }

    // Decode: each sequence has a 128-token context, then steps of one token each.
    let ctx = 128;
    for &b in &opts.batches {
        let per_seq = (ctx + opts.decode_steps + 1).div_ceil(BS);
        let mut cache = PagedKvCache::new(&w.shape, BS, per_seq * b);
        let tables: Vec<Vec<u32>> =
            (0..b).map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect()).collect();
        let mut seqs: Vec<Vec<u32>> = (0..b).map(|s| prompt(s + 17, ctx)).collect();
        let batch: Vec<SeqSlice> = seqs
            .iter()
            .zip(&tables)
            .map(|(t, tb)| SeqSlice { tokens: t, start: 0, block_table: tb, wants_logits: true })
            .collect();
        let logits = forward(w, &mut cache, &batch, &mut scratch).expect("bench batch is valid");
        for (s, l) in seqs.iter_mut().zip(logits) {
            s.push(argmax(&l).unwrap_or(0) as u32);
        }
        let mut times = Vec::new();
        for _ in 0..opts.decode_steps {
            let batch: Vec<SeqSlice> = seqs
                .iter()
                .zip(&tables)
                .map(|(t, tb)| SeqSlice {
                    tokens: &t[t.len() - 1..],
                    start: t.len() - 1,
                    block_table: tb,
                    wants_logits: true,
                })
                .collect();
            let t = Instant::now();
            let logits =
                forward(w, &mut cache, &batch, &mut scratch).expect("bench batch is valid");
            for (s, l) in seqs.iter_mut().zip(&logits) {
                s.push(argmax(l).unwrap_or(0) as u32);
            }
            times.push(t.elapsed().as_secs_f64());
        }
        let total: f64 = times.iter().sum();
        let row = BenchRow {
            scenario: "decode (128-token context)".into(),
            batch: b,
            tokens_per_s: (b * opts.decode_steps) as f64 / total,
            median_step_ms: median(times) * 1e3,
        };
        progress(&row);
        rows.push(row);
    }
    rows
}
