//! LoRA adapters on the real model. `lora_adapters.py` writes SmolLM2 dequantized to F32, two
//! random adapters (x: rank 8 on all seven projections, as PEFT and as llama.cpp's LoRA GGUF;
//! y: rank 4, rsLoRA, Q and V only) and, for each, the model with it merged into its weights by
//! an independent merge (numpy, in float64). A request through an adapter computes what the
//! merged model computes, up to the rounding a merge does differently (`TOLERANCE`); the two
//! formats of one adapter compute the same bits; adapters and the base model share a batch,
//! each row computing exactly what it computes alone; the engine reads adapters on first use,
//! keeps `--max-loras` of them, drops the least recently used free one, and refuses a request
//! whose adapter does not fit, naming why.

use std::path::PathBuf;
use std::sync::OnceLock;

use ferry_executor_svc::engine::lora::{Adapters, LoraArgs};
use ferry_executor_svc::engine::{CpuBackend, Engine, EngineConfig};
use ferry_executor_svc::forward::paged::{forward, ForwardScratch, SeqSlice};
use ferry_executor_svc::forward::{ops::argmax, LoadedModel, PagedKvCache};
use ferry_model::lora::{self, LoraAdapter, LoraFormat};
use ferry_proto::v1;

use crate::generated::generated;

/// Largest difference in a logit between an adapter's path and the merged model. Logits are
/// O(10); the merge rounds `W + s·BA` to f32 once, where the adapter path adds `s·B(Ax)` to
/// `Wx` in f32, and the difference grows through 30 layers (measured: 3e-5 to 6e-5).
const TOLERANCE: f32 = 5e-4;

const BS: usize = 16;

struct Files {
    dir: PathBuf,
    base: LoadedModel,
    merged_x: LoadedModel,
    merged_y: LoadedModel,
    x: LoraAdapter,
    x_gguf: LoraAdapter,
    y: LoraAdapter,
}

fn files() -> &'static Files {
    static FILES: OnceLock<Files> = OnceLock::new();
    FILES.get_or_init(|| {
        let dir = generated("lora", "lora_adapters.py", &[]);
        let open = |name: &str| LoadedModel::open(Some(&dir.join(name))).expect(name);
        let base = open("base.gguf");
        let shape = base.weights.shape;
        let adapter = |name: &str| lora::load(&dir.join(name), &shape, 16).expect(name);
        Files {
            x: adapter("x"),
            x_gguf: adapter("x.gguf"),
            y: adapter("y"),
            merged_x: open("merged-x.gguf"),
            merged_y: open("merged-y.gguf"),
            base,
            dir,
        }
    })
}

fn prompt() -> Vec<u32> {
    (0..37).map(|i| (i * 7919 + 13) % 40_000 + 10).collect()
}

/// One sequence's logits over its prompt (every row), then over `decode` greedy tokens.
fn run(model: &LoadedModel, adapter: Option<&LoraAdapter>, decode: usize) -> Vec<Vec<f32>> {
    let runs = batch_run(model, &[adapter], decode);
    runs.into_iter().next().expect("one sequence")
}

/// Each sequence (one per entry of `adapters`, the same prompt) in one batch per step: its
/// prompt's logits, then `decode` greedy tokens' logits.
fn batch_run(
    model: &LoadedModel,
    adapters: &[Option<&LoraAdapter>],
    decode: usize,
) -> Vec<Vec<Vec<f32>>> {
    let p = prompt();
    let per_seq = (p.len() + decode).div_ceil(BS);
    let mut cache = PagedKvCache::new(&model.weights.shape, BS, per_seq * adapters.len());
    let tables: Vec<Vec<u32>> = (0..adapters.len())
        .map(|s| (0..per_seq).map(|b| (b * adapters.len() + s) as u32).collect())
        .collect();
    let mut scratch = ForwardScratch::default();
    let mut out: Vec<Vec<Vec<f32>>> = vec![Vec::new(); adapters.len()];
    let mut tokens: Vec<Vec<u32>> = vec![p.clone(); adapters.len()];
    let mut start = 0;
    for step in 0..=decode {
        let batch: Vec<SeqSlice> = tokens
            .iter()
            .zip(&tables)
            .zip(adapters)
            .map(|((t, table), &adapter)| SeqSlice {
                tokens: &t[start..],
                start,
                block_table: table,
                logits: t.len() - start,
                adapter,
            })
            .collect();
        let logits = forward(&model.weights, &mut cache, &batch, &mut scratch).expect("forward");
        let mut rows = logits.into_iter();
        let width = if step == 0 { p.len() } else { 1 };
        start = tokens[0].len();
        for (s, seq) in out.iter_mut().enumerate() {
            seq.extend(rows.by_ref().take(width));
            let next = argmax(seq.last().expect("a row")).expect("logits") as u32;
            tokens[s].push(next);
        }
    }
    out
}

/// Largest difference between two runs' logits.
fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

/// Positions whose top token differs between two runs, where `b`'s top two are further apart
/// than the tolerance (closer, rounding may pick either).
fn top_token_mismatches(a: &[Vec<f32>], b: &[Vec<f32>]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| {
            let mut sorted = (*y).clone();
            sorted.sort_by(|p, q| q.total_cmp(p));
            sorted[0] - sorted[1] > 2.0 * TOLERANCE && argmax(x) != argmax(y)
        })
        .count()
}

#[test]
fn an_adapter_computes_what_the_model_with_it_merged_computes() {
    let f = files();
    let base = run(&f.base, None, 0);
    for (name, adapter, merged) in
        [("x", &f.x, &f.merged_x), ("x.gguf", &f.x_gguf, &f.merged_x), ("y", &f.y, &f.merged_y)]
    {
        let through = run(&f.base, Some(adapter), 6);
        let want = run(merged, None, 6);
        let diff = max_diff(&through, &want);
        eprintln!("{name}: largest logit difference to the merged model {diff:e}");
        assert!(diff < TOLERANCE, "{name}: {diff} from the merged model");
        assert_eq!(top_token_mismatches(&through, &want), 0, "{name}: greedy tokens differ");
        let moved = max_diff(&through[..base.len()], &base);
        assert!(moved > 100.0 * TOLERANCE, "{name} barely changes the model ({moved})");
    }
    assert_eq!((f.x.format, f.x_gguf.format), (LoraFormat::Peft, LoraFormat::Gguf));
}

#[test]
fn the_peft_and_gguf_forms_of_an_adapter_compute_the_same_bits() {
    let f = files();
    assert_eq!(f.x.layers, f.x_gguf.layers, "the same matrices, Q and K rows in the same order");
    assert_eq!(run(&f.base, Some(&f.x), 3), run(&f.base, Some(&f.x_gguf), 3));
}

#[test]
fn adapters_and_the_base_share_a_batch_each_row_computing_its_own() {
    let f = files();
    let mix = [None, Some(&f.x), Some(&f.y), None, Some(&f.y)];
    let batched = batch_run(&f.base, &mix, 4);
    for (i, adapter) in mix.iter().enumerate() {
        assert_eq!(batched[i], run(&f.base, *adapter, 4), "sequence {i} alone");
    }
}

/// An engine over the F32 base model holding up to `max_loras` adapters of rank up to
/// `max_rank`, relative paths in the test's folder.
fn engine(max_loras: u32, max_rank: u32) -> Engine {
    let f = files();
    let model = LoadedModel::open(Some(&f.dir.join("base.gguf"))).expect("base");
    let shape = model.weights.shape;
    let backend = CpuBackend::new(model.weights, BS, 64);
    let args = LoraArgs { max_loras, max_lora_rank: max_rank };
    Engine::new(Box::new(backend), EngineConfig::new(2)).with_adapters(Adapters::new(
        args,
        shape,
        Some(f.dir.clone()),
    ))
}

/// A step adding request `id` (blocks `2·id`, `2·id + 1`) with adapter `name` at `path`,
/// computing its whole prompt.
fn add(step_id: u64, id: u64, adapter: Option<(&str, &str)>) -> v1::Step {
    let p = prompt();
    v1::Step {
        step_id,
        new_requests: vec![v1::NewRequest {
            id,
            prompt_token_ids: p.clone(),
            sampling: Some(v1::SamplingParams { temperature: 0.0, ..Default::default() }),
            block_ids: vec![2 * id as u32, 2 * id as u32 + 1, 2 * id as u32 + 40],
            lora: adapter
                .map(|(name, path)| v1::LoraAdapterRef { name: name.into(), path: path.into() }),
            ..Default::default()
        }],
        work: vec![v1::ScheduledWork {
            id,
            key: v1::WorkKey::PromptChunk.into(),
            num_tokens: p.len() as u32,
            ..Default::default()
        }],
        total_num_tokens: p.len() as u32,
        ..Default::default()
    }
}

#[test]
fn the_engine_reads_adapters_on_first_use_and_drops_the_least_recently_used_free_one() {
    let f = files();
    let mut e = engine(2, 16);
    let first = |r: &v1::StepResult| r.outputs.first().map(|o| o.token_ids[0]);
    let want = |a: Option<&LoraAdapter>| argmax(run(&f.base, a, 0).last().unwrap()).unwrap() as u32;
    // x and y resident, each used by a live request; each request samples its adapter's token.
    let r = e.execute(&add(1, 1, Some(("x", "x")))).unwrap();
    assert_eq!(first(&r), Some(want(Some(&f.x))));
    let r = e.execute(&add(2, 2, Some(("y", "y")))).unwrap();
    assert_eq!(first(&r), Some(want(Some(&f.y))));
    let r = e.execute(&add(3, 3, None)).unwrap();
    assert_eq!(first(&r), Some(want(None)));
    // A third adapter while both are in use: refused alone, naming the limit.
    let r = e.execute(&add(4, 4, Some(("x-gguf", "x.gguf")))).unwrap();
    assert_eq!(r.refused.len(), 1, "{r:?}");
    assert!(r.refused[0].reason.contains("--max-loras 2"), "{}", r.refused[0].reason);
    // Request 1 finishes: x is free, and the least recently used free adapter goes.
    let done = v1::Step { step_id: 5, finished_ids: vec![1, 4], ..Default::default() };
    e.execute(&done).unwrap();
    let r = e.execute(&add(6, 5, Some(("x-gguf", "x.gguf")))).unwrap();
    assert!(r.refused.is_empty(), "{r:?}");
    assert_eq!(first(&r), Some(want(Some(&f.x))), "the GGUF form computes x");
    let a = e.adapters().unwrap();
    assert_eq!(a.resident(), ["x-gguf", "y"]);
    assert_eq!((a.loads, a.evictions), (3, 1));
}

#[test]
fn an_adapter_that_does_not_fit_is_refused_naming_why() {
    let mut e = engine(4, 4);
    for (i, (path, why)) in [
        ("x", "rank 8 is above --max-lora-rank 4"),
        ("missing", "No such file"),
        ("base.gguf", "not a LoRA GGUF"),
    ]
    .into_iter()
    .enumerate()
    {
        let id = i as u64 + 1;
        let r = e.execute(&add(id, id, Some((path, path)))).unwrap();
        assert_eq!(r.refused.len(), 1, "{path}: {r:?}");
        assert!(r.refused[0].reason.contains(why), "{path}: {}", r.refused[0].reason);
    }
    // y (rank 4) fits, and a request without an adapter was never in question.
    let r = e.execute(&add(9, 9, Some(("y", "y")))).unwrap();
    assert!(r.refused.is_empty(), "{r:?}");
    assert_eq!(e.num_requests(), 1);
}
