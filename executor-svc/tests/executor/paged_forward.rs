//! The paged, batched forward against the plain reference forward, on the real model: same
//! greedy tokens and bit-identical logits with other requests in the batch, chunked prefill at
//! several chunk sizes, scattered block layouts, a preempt-and-recompute, and a prefix-cache hit.

use std::sync::OnceLock;

use ferry_executor_svc::forward::paged::{forward, BatchError, ForwardScratch, SeqSlice};
use ferry_executor_svc::forward::reference::{self, ContiguousCache};
use ferry_executor_svc::forward::{ops::argmax, KvDtype, LlamaWeights, LoadedModel, PagedKvCache};
use ferry_model::Tokenizer;

const BS: usize = 4;

struct Model {
    tok: Tokenizer,
    w: LlamaWeights,
}

fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let model = LoadedModel::open(None).expect("the default model");
        let file = std::sync::Arc::try_unwrap(model.file).expect("the only reference");
        Model { tok: file.tokenizer, w: model.weights }
    })
}

/// Greedy tokens and the logits that chose each, by the reference forward.
fn reference_run(prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    reference_run_with(prompt, steps, ContiguousCache::default())
}

/// [`reference_run`] on a given (empty) cache: f32, or rounding to f16.
fn reference_run_with(
    prompt: &[u32],
    steps: usize,
    mut cache: ContiguousCache,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let w = &model().w;
    let mut logits = reference::forward(w, prompt, &mut cache).unwrap();
    let (mut toks, mut all) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let t = argmax(&logits).unwrap() as u32;
        toks.push(t);
        all.push(logits);
        logits = reference::forward(w, &[t], &mut cache).unwrap();
    }
    (toks, all)
}

/// A sequence driven through the paged forward by a tiny scheduler.
struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    computed: usize,
    table: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

/// Hands out blocks in a scattered order.
struct Blocks(Vec<u32>);

impl Blocks {
    fn scattered(n: u32) -> Self {
        // A fixed permutation: multiply by a number coprime with n.
        Self((0..n).map(|i| (i * 37 + 11) % n).collect())
    }
    fn take(&mut self) -> u32 {
        self.0.pop().expect("enough blocks for the test")
    }
}

/// Runs every sequence to `steps` generated tokens, prefilling in chunks of `chunk`, all
/// sequences batched together each step.
fn run_paged(
    seqs: &mut [Seq],
    chunk: usize,
    steps: usize,
    cache: &mut PagedKvCache,
    blocks: &mut Blocks,
) {
    let m = model();
    let mut scratch = ForwardScratch::default();
    loop {
        let mut plan = Vec::new();
        for (i, s) in seqs.iter_mut().enumerate() {
            if s.tokens.len() - s.prompt_len >= steps && s.computed == s.tokens.len() - 1 {
                continue;
            }
            let remaining = s.tokens.len() - s.computed;
            let n = if s.computed < s.prompt_len { remaining.min(chunk) } else { remaining };
            while s.table.len() * BS < s.computed + n {
                s.table.push(blocks.take());
            }
            plan.push((i, n));
        }
        if plan.is_empty() {
            return;
        }
        let batch: Vec<SeqSlice> = plan
            .iter()
            .map(|&(i, n)| {
                let s = &seqs[i];
                SeqSlice::base(
                    &s.tokens[s.computed..s.computed + n],
                    s.computed,
                    &s.table,
                    usize::from(s.computed + n == s.tokens.len()),
                )
            })
            .collect();
        let wants: Vec<bool> = batch.iter().map(|b| b.logits > 0).collect();
        let mut out = forward(&m.w, cache, &batch, &mut scratch).unwrap().into_iter();
        for (&(i, n), want) in plan.iter().zip(wants) {
            let s = &mut seqs[i];
            s.computed += n;
            if want {
                let logits = out.next().unwrap();
                if s.tokens.len() - s.prompt_len < steps {
                    s.tokens.push(argmax(&logits).unwrap() as u32);
                    s.logits.push(logits);
                }
            }
        }
    }
}

fn new_seq(prompt: &[u32]) -> Seq {
    Seq {
        tokens: prompt.to_vec(),
        prompt_len: prompt.len(),
        computed: 0,
        table: vec![],
        logits: vec![],
    }
}

fn assert_same(seq: &Seq, want_toks: &[u32], want_logits: &[Vec<f32>], what: &str) {
    assert_eq!(&seq.tokens[seq.prompt_len..], want_toks, "{what}: tokens differ");
    for (i, (a, b)) in seq.logits.iter().zip(want_logits).enumerate() {
        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        let max_diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(same, "{what}: logits of token {i} differ (max |diff| {max_diff})");
    }
}

fn prompts() -> Vec<Vec<u32>> {
    let tok = &model().tok;
    ["The capital of France is", "Once upon a time, in a small village by the sea,", "1, 2, 3, 4,"]
        .iter()
        .map(|p| tok.encode(p).unwrap())
        .collect()
}

#[test]
fn batched_chunked_scattered_equals_reference() {
    let steps = 6;
    let prompts = prompts();
    let refs: Vec<_> = prompts.iter().map(|p| reference_run(p, steps)).collect();
    for chunk in [1, 3, 5, 64] {
        let mut cache = PagedKvCache::new(&model().w.shape, BS, 64);
        let mut blocks = Blocks::scattered(64);
        let mut seqs: Vec<Seq> = prompts.iter().map(|p| new_seq(p)).collect();
        run_paged(&mut seqs, chunk, steps, &mut cache, &mut blocks);
        for (s, (toks, logits)) in seqs.iter().zip(&refs) {
            assert_same(s, toks, logits, &format!("chunk {chunk}"));
        }
    }
}

/// An f16 cache (the executor's default) stores each key and value rounded to f16 and reads
/// it back exactly: the paged forward over it, batched, chunked and scattered, is the reference
/// forward with f16-rounded keys and values, bit for bit.
#[test]
fn an_f16_cache_equals_the_reference_rounding_keys_and_values_to_f16() {
    let steps = 6;
    let prompts = prompts();
    let refs: Vec<_> =
        prompts.iter().map(|p| reference_run_with(p, steps, ContiguousCache::f16())).collect();
    for chunk in [3, 64] {
        let mut cache = PagedKvCache::with_dtype(&model().w.shape, KvDtype::F16, BS, 64);
        let mut blocks = Blocks::scattered(64);
        let mut seqs: Vec<Seq> = prompts.iter().map(|p| new_seq(p)).collect();
        run_paged(&mut seqs, chunk, steps, &mut cache, &mut blocks);
        for (s, (toks, logits)) in seqs.iter().zip(&refs) {
            assert_same(s, toks, logits, &format!("f16, chunk {chunk}"));
        }
    }
    // And it is not the f32 forward: the rounding shows in the logits.
    let f32_logits = &reference_run(&prompts[0], 1).1[0];
    assert_ne!(f32_logits, &refs[0].1[0], "f16 keys and values change the logits' bits");
}

/// A decode step of many sequences (split into one part per thread, each with tiles enough for
/// its thread) gives each attention task a sequence's KV heads together rather than one: still
/// the reference forward's tokens and bits, over f32 and f16 caches.
#[test]
fn many_sequences_decoding_together_equal_the_reference() {
    let steps = 4;
    // Past the forward's threshold of four tiles per thread in every part.
    let n = 4 * rayon::current_num_threads() + 1;
    let tok = &model().tok;
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| tok.encode(&format!("{i} apples and {} pears are", 3 * i)).unwrap())
        .collect();
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let contiguous = || match dtype {
            KvDtype::F32 => ContiguousCache::default(),
            KvDtype::F16 => ContiguousCache::f16(),
        };
        let refs: Vec<_> =
            prompts.iter().map(|p| reference_run_with(p, steps, contiguous())).collect();
        let blocks = 6 * n + 1;
        let mut cache = PagedKvCache::with_dtype(&model().w.shape, dtype, BS, blocks);
        let mut seqs: Vec<Seq> = prompts.iter().map(|p| new_seq(p)).collect();
        let mut table = Blocks::scattered(u32::try_from(blocks).unwrap());
        run_paged(&mut seqs, 64, steps, &mut cache, &mut table);
        for (s, (toks, logits)) in seqs.iter().zip(&refs) {
            assert_same(s, toks, logits, &format!("{n} sequences, {dtype:?}"));
        }
    }
}

#[test]
fn recompute_after_preemption_and_prefix_hit_continue_exactly() {
    let steps = 6;
    let prompts = prompts();
    let (want, want_logits) = reference_run(&prompts[1], steps);
    let mut cache = PagedKvCache::new(&model().w.shape, BS, 64);
    let mut blocks = Blocks::scattered(64);
    // Generate 3 tokens, then "preempt": forget the cache and recompute prompt + generated
    // tokens into fresh blocks, then generate the rest.
    let mut seq = new_seq(&prompts[1]);
    run_paged(std::slice::from_mut(&mut seq), 4, 3, &mut cache, &mut blocks);
    seq.computed = 0;
    seq.table.clear();
    seq.prompt_len = prompts[1].len();
    run_paged(std::slice::from_mut(&mut seq), 7, steps, &mut cache, &mut blocks);
    assert_same(&seq, &want, &want_logits, "recompute");

    // A second request with the same prompt reuses the first one's full prompt blocks
    // (a prefix-cache hit) and computes only the rest.
    let full = prompts[1].len() / BS;
    let mut hit = new_seq(&prompts[1]);
    hit.table = seq.table[..full].to_vec();
    hit.computed = full * BS;
    run_paged(std::slice::from_mut(&mut hit), 64, steps, &mut cache, &mut blocks);
    assert_same(&hit, &want, &want_logits, "prefix hit");
}

#[test]
fn bad_batches_are_refused_before_anything_is_written() {
    let m = model();
    let mut cache = PagedKvCache::new(&m.w.shape, BS, 8);
    let mut scratch = ForwardScratch::default();
    let toks = [1u32, 2, 3, 4, 5];
    let slice = |tokens, start, table| SeqSlice::base(tokens, start, table, 1);
    let cases: Vec<(Vec<SeqSlice>, &str)> = vec![
        (vec![slice(&toks[..], 0, &[0u32][..])], "need 2 blocks"),
        (vec![slice(&toks[..2], 0, &[9u32][..])], "out of range"),
        (vec![slice(&[60_000u32][..], 0, &[0u32][..])], "outside the vocabulary"),
        (vec![slice(&toks[..0], 0, &[0u32][..])], "no tokens"),
        (
            vec![slice(&toks[..2], 0, &[1u32][..]), slice(&toks[..2], 0, &[1u32][..])],
            "written by sequence",
        ),
    ];
    let before: Vec<u8> = cache.block(1).to_vec();
    for (batch, needle) in cases {
        let err: BatchError = forward(&m.w, &mut cache, &batch, &mut scratch).unwrap_err();
        assert!(err.to_string().contains(needle), "{err} should mention {needle:?}");
    }
    assert_eq!(cache.block(1), &before[..], "a refused batch must not write the cache");
}
