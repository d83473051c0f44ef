//! A looped model on the real model (SmolLM2, 30 layers, looped as `10:20`), driven through the
//! engine by hand-built stage steps the way the scheduler drives it: with one loop it computes
//! the plain model exactly; with `k` loops and no exit, exactly what a file whose layers
//! 10..20 are repeated `k` times (written by `repeat_layers.py`) computes; with an exit
//! threshold, tokens leave the loop at different loops, and a prompt run as one chain or as a
//! chain per token (each later token attending to the earlier ones' exit-loop KV) gives the same
//! answer; a request preempted mid-chain and recomputed continues exactly.

use std::sync::{Arc, OnceLock};

use ferry_executor_svc::engine::looped::LoopedShape;
use ferry_executor_svc::engine::{CpuBackend, Engine, EngineConfig};
use ferry_executor_svc::forward::LoadedModel;
use ferry_model::ModelFile;
use ferry_proto::v1;

use crate::generated::generated;
use ferry_proto::v1::WorkKey as K;

const BS: usize = 4;
const BLOCKS: usize = 1024;
/// The recurrent block: layers 10..20 of the model's 30.
const SPLIT: (usize, usize) = (10, 20);

fn default_file() -> &'static Arc<ModelFile> {
    static S: OnceLock<Arc<ModelFile>> = OnceLock::new();
    S.get_or_init(|| Arc::new(ModelFile::open(None).expect("the default model")))
}

/// An engine on `file`, looped as [`SPLIT`] up to `max_loops` when given.
fn engine(file: &Arc<ModelFile>, max_loops: Option<u8>) -> Engine {
    let model = LoadedModel::load(file.clone()).expect("the model's weights");
    let n = model.weights.shape.num_layers;
    let looped = max_loops.map(|l| LoopedShape::new(SPLIT.0, SPLIT.1, n, l).expect("a split"));
    let config = EngineConfig { looped, ..EngineConfig::new(file.tokenizer.eos_token_id) };
    Engine::new(Box::new(CpuBackend::new(model.weights, BS, BLOCKS)), config)
}

/// The default model with layers [`SPLIT`] repeated `k` times, written by the test's script.
fn repeated_file(k: usize) -> Arc<ModelFile> {
    let (a, b) = (SPLIT.0.to_string(), SPLIT.1.to_string());
    let dir = generated("looped", "repeat_layers.py", &[&a, &b, &k.to_string()]);
    Arc::new(ModelFile::open(Some(&dir.join("repeated.gguf"))).expect("the repeated file opens"))
}

/// What a run produced: each sampled token with its log-probabilities (top 5), and the loops
/// each chain that sampled ran.
#[derive(Debug, PartialEq)]
struct Run {
    tokens: Vec<u32>,
    logprobs: Vec<v1::PositionLogprobs>,
    loops: Vec<u8>,
    /// Chains whose every token left the loop before the request's last loop.
    early_exits: usize,
    /// It was preempted mid-chain (and recomputed).
    preempted: bool,
}

/// Drives one request through `engine` as the scheduler would: chains of `chunk` prompt
/// tokens (then one per decode) through prelude, loops until the engine reports the chain's
/// exit or `max_loops` (0: a plain model, one step per chunk), and coda; `preempt_at`: after
/// that many steps the request is preempted mid-chain and recomputed into new blocks.
struct Driver {
    engine: Engine,
    step_id: u64,
    next_block: u32,
    /// The request's id.
    id: u64,
}

impl Driver {
    fn new(engine: Engine) -> Self {
        Self { engine, step_id: 0, next_block: 0, id: 1 }
    }

    /// Runs another request (id 2, `prompt`) through the blocks the next run will use, then
    /// finishes it: the next run's blocks hold stale KV, as a real pool's reused blocks do.
    fn dirty(&mut self, prompt: &[u32], max_loops: u8) {
        self.id = 2;
        let spec = RunSpec { max_loops, out: 3, chunk: 4, preempt_at: None };
        self.run(prompt, &greedy(None), spec);
        self.step(v1::Step { finished_ids: vec![2], ..Default::default() });
        (self.id, self.next_block) = (1, 0);
    }

    fn step(&mut self, mut step: v1::Step) -> v1::StepResult {
        self.step_id += 1;
        step.step_id = self.step_id;
        step.total_num_tokens = step.work.iter().map(|w| w.num_tokens).sum();
        let result = self.engine.execute(&step).expect("a valid step");
        assert!(result.refused.is_empty(), "refused: {:?}", result.refused);
        result
    }

    fn blocks(&mut self, n: usize) -> Vec<u32> {
        let b: Vec<u32> = (self.next_block..self.next_block + n as u32).collect();
        self.next_block += n as u32;
        b
    }

    #[allow(clippy::too_many_lines)]
    fn run(&mut self, prompt: &[u32], sampling: &v1::SamplingParams, spec: RunSpec) -> Run {
        let RunSpec { max_loops, out, chunk, preempt_at } = spec;
        let id = self.id;
        let planes = if max_loops == 0 { 1 } else { 2 + usize::from(max_loops) };
        let mut run = Run {
            tokens: vec![],
            logprobs: vec![],
            loops: vec![],
            early_exits: 0,
            preempted: false,
        };
        let (mut computed, mut table, mut sent) = (0usize, Vec::<u32>::new(), false);
        let mut steps = 0;
        while run.tokens.len() < out {
            let total = prompt.len() + run.tokens.len();
            let n = if computed >= prompt.len() { 1 } else { chunk.min(total - computed) };
            let rows = (computed + n).div_ceil(BS);
            let new_blocks = self.blocks(rows * planes - table.len().min(rows * planes));
            table.extend_from_slice(&new_blocks);
            let mut step = v1::Step::default();
            if sent {
                if !new_blocks.is_empty() {
                    step.cached_requests.push(v1::CachedRequestUpdate {
                        id,
                        new_block_ids: new_blocks,
                        ..Default::default()
                    });
                }
            } else {
                step.new_requests.push(v1::NewRequest {
                    id,
                    prompt_token_ids: prompt.to_vec(),
                    sampling: Some(sampling.clone()),
                    block_ids: table.clone(),
                    max_loops: u32::from(max_loops),
                    ..Default::default()
                });
                sent = true;
            }
            let decode = computed >= prompt.len();
            let key = |prompt_key, decode_key| if decode { decode_key } else { prompt_key };

            let work = |key: K, loop_index: u32| v1::ScheduledWork {
                id,
                key: key.into(),
                num_tokens: n as u32,
                loop_index,
                ..Default::default()
            };
            if max_loops == 0 {
                step.work.push(work(key(K::PromptChunk, K::Decode), 0));
                let r = self.step(step);
                run.collect(&r);
                computed += n;
                continue;
            }
            step.work.push(work(key(K::PromptPrelude, K::DecodePrelude), 0));
            self.step(step);
            steps += 1;
            let mut loops = 0;
            let mut restarted = false;
            for l in 1..=max_loops {
                let r = self.step(v1::Step {
                    work: vec![work(key(K::PromptRecurrent, K::DecodeRecurrent), u32::from(l))],
                    ..Default::default()
                });
                loops = l;
                steps += 1;
                if preempt_at.is_some_and(|at| steps >= at) && !run.preempted {
                    // Preempted mid-chain, then resumed into new blocks, recomputed from 0.
                    run.preempted = true;
                    self.step(v1::Step { preempted_ids: vec![id], ..Default::default() });
                    table = self.blocks(total.div_ceil(BS) * planes);
                    let resumed = v1::CachedRequestUpdate {
                        id,
                        new_block_ids: table.clone(),
                        resumed: true,
                        num_computed_tokens: 0,
                    };
                    self.step(v1::Step { cached_requests: vec![resumed], ..Default::default() });
                    computed = 0;
                    restarted = true;
                    break;
                }
                if r.exited_ids.contains(&id) {
                    run.early_exits += usize::from(l < max_loops);
                    break;
                }
            }
            if restarted {
                // The resumed request recomputes everything known, in chunks, from its prelude.
                let recompute =
                    RunSpec { max_loops, out: run.tokens.len(), chunk, preempt_at: None };
                let known: Vec<u32> = prompt.iter().chain(&run.tokens).copied().collect();
                computed = self.recompute(&known, recompute);
                continue;
            }
            let r = self.step(v1::Step {
                work: vec![work(key(K::PromptCoda, K::DecodeCoda), 0)],
                ..Default::default()
            });
            steps += 1;
            if run.collect(&r) {
                run.loops.push(loops);
            }
            computed += n;
        }
        run
    }

    /// Recomputes the KV of `known` tokens after a resume (chains of `spec.chunk` through every
    /// stage; nothing samples): the computed count after it, every token but the last.
    fn recompute(&mut self, known: &[u32], spec: RunSpec) -> usize {
        let mut computed = 0;
        let id = self.id;

        while computed + 1 < known.len() {
            let n = spec.chunk.min(known.len() - 1 - computed);
            let work = |key: K, l: u8| v1::ScheduledWork {
                id,
                key: key.into(),
                num_tokens: n as u32,
                loop_index: u32::from(l),
                ..Default::default()
            };
            self.step(v1::Step { work: vec![work(K::PromptPrelude, 0)], ..Default::default() });
            for l in 1..=spec.max_loops {
                let r = self.step(v1::Step {
                    work: vec![work(K::PromptRecurrent, l)],
                    ..Default::default()
                });
                if r.exited_ids.contains(&id) {
                    break;
                }
            }
            self.step(v1::Step { work: vec![work(K::PromptCoda, 0)], ..Default::default() });
            computed += n;
        }
        computed
    }
}

/// What to run.
#[derive(Clone, Copy)]
struct RunSpec {
    max_loops: u8,
    out: usize,
    chunk: usize,
    preempt_at: Option<usize>,
}

impl Run {
    /// Takes the request's sampled token from a result; true if there was one.
    fn collect(&mut self, r: &v1::StepResult) -> bool {
        let Some(o) = r.outputs.iter().find(|o| !o.token_ids.is_empty()) else {
            return false;
        };
        self.tokens.extend(&o.token_ids);
        self.logprobs.extend(o.logprobs.iter().cloned());
        true
    }
}

fn greedy(threshold: Option<f32>) -> v1::SamplingParams {
    v1::SamplingParams {
        temperature: 0.0,
        logprobs: true,
        top_logprobs: 5,
        exit_threshold: threshold,
        ..Default::default()
    }
}

fn prompt() -> Vec<u32> {
    default_file()
        .tokenizer
        .encode("The capital of France is Paris, and the capital of Italy is")
        .unwrap()
}

const OUT: usize = 6;

#[test]
fn a_looped_model_with_one_loop_computes_the_plain_model_exactly() {
    let (prompt, sampling) = (prompt(), greedy(None));
    let spec = |max_loops| RunSpec { max_loops, out: OUT, chunk: 5, preempt_at: None };
    let plain = Driver::new(engine(default_file(), None)).run(&prompt, &sampling, spec(0));
    let looped = Driver::new(engine(default_file(), Some(1))).run(&prompt, &sampling, spec(1));
    assert_eq!(looped.tokens, plain.tokens);
    assert_eq!(looped.logprobs, plain.logprobs, "the log-probabilities, bit for bit");
    assert_eq!(looped.loops, vec![1; OUT]);
}

#[test]
fn k_loops_compute_exactly_what_a_file_repeating_the_recurrent_layers_k_times_computes() {
    let (prompt, sampling) = (prompt(), greedy(None));
    for k in [2u8, 3] {
        let file = repeated_file(usize::from(k));
        let spec = |max_loops| RunSpec { max_loops, out: OUT, chunk: 7, preempt_at: None };
        let repeated = Driver::new(engine(&file, None)).run(&prompt, &sampling, spec(0));
        let looped = Driver::new(engine(default_file(), Some(k))).run(&prompt, &sampling, spec(k));
        assert_eq!(looped.tokens, repeated.tokens, "{k} loops");
        assert_eq!(looped.logprobs, repeated.logprobs, "{k} loops, bit for bit");
        assert_eq!(looped.loops, vec![k; OUT]);
        let plain = Driver::new(engine(default_file(), None)).run(&prompt, &sampling, spec(0));
        assert_ne!(looped.logprobs, plain.logprobs, "{k} loops compute something else");
    }
}

/// With an exit threshold, chains leave the loop early (at different loops), and what a token
/// computes depends only on its own states and the KV before it: the prompt as one chain of 13
/// tokens, as chains of 3, and as a chain per token (where later tokens attend to the earlier
/// ones' exit-loop KV copied into the later loops' planes) give the same answer, bit for bit,
/// each in blocks that held another request's KV before.
#[test]
fn tokens_leave_the_loop_at_the_threshold_and_chunking_changes_no_result() {
    let (prompt, sampling) = (prompt(), greedy(Some(0.96)));
    let tok = &default_file().tokenizer;
    let runs: Vec<Run> =
        [(prompt.len(), "Hello there"), (3, "Lorem ipsum dolor sit"), (1, "1 2 3")]
            .into_iter()
            .map(|(chunk, other)| {
                let spec = RunSpec { max_loops: 4, out: OUT, chunk, preempt_at: None };
                let mut d = Driver::new(engine(default_file(), Some(4)));
                // Each run's blocks hold another prompt's stale KV: a loop that read a slot its
                // token never filled would read something else in each run.
                d.dirty(&tok.encode(other).unwrap(), 4);
                d.run(&prompt, &sampling, spec)
            })
            .collect();
    for run in &runs[1..] {
        assert_eq!(run.tokens, runs[0].tokens);
        assert_eq!(run.logprobs, runs[0].logprobs, "bit for bit, whatever the chains");
    }
    let decoded = &runs[2];
    assert!(decoded.early_exits > 0, "some chains left early: {:?}", decoded.loops);
    assert!(decoded.loops.iter().any(|&l| l > 1), "not every token left at once");
    let all_loops = Driver::new(engine(default_file(), Some(4))).run(
        &prompt,
        &greedy(None),
        RunSpec { max_loops: 4, out: OUT, chunk: 3, preempt_at: None },
    );
    assert_ne!(all_loops.logprobs, decoded.logprobs, "the exits changed what was computed");
}

#[test]
fn a_request_preempted_mid_chain_and_recomputed_continues_exactly() {
    let (prompt, sampling) = (prompt(), greedy(Some(0.96)));
    let spec = |preempt_at| RunSpec { max_loops: 3, out: OUT, chunk: 4, preempt_at };
    let whole = Driver::new(engine(default_file(), Some(3))).run(&prompt, &sampling, spec(None));
    for at in [2, 9, 20] {
        let mut d = Driver::new(engine(default_file(), Some(3)));
        let preempted = d.run(&prompt, &sampling, spec(Some(at)));
        assert!(preempted.preempted, "preempted at step {at} or after");
        assert_eq!(preempted.tokens, whole.tokens, "preempted after step {at}");
        assert_eq!(preempted.logprobs, whole.logprobs, "preempted after step {at}");
    }
}

#[test]
fn stage_work_that_breaks_the_chain_rules_is_refused_alone() {
    let mut e = engine(default_file(), Some(2));
    let prompt = prompt();
    let new = |id: u64, loops: u32| v1::NewRequest {
        id,
        prompt_token_ids: prompt.clone(),
        sampling: Some(greedy(None)),
        block_ids: (id as u32 * 64..id as u32 * 64 + 16).collect(),
        max_loops: loops,
        ..Default::default()
    };
    let work = |id: u64, key: v1::WorkKey, n: usize, l: u32| v1::ScheduledWork {
        id,
        key: key.into(),
        num_tokens: n as u32,
        loop_index: l,
        ..Default::default()
    };
    let n = prompt.len();
    // A loop before any prelude, and a request asking for more loops than the model runs.
    let step = v1::Step {
        step_id: 1,
        new_requests: vec![new(1, 2), new(2, 3)],
        work: vec![
            work(1, v1::WorkKey::PromptRecurrent, n, 1),
            work(2, v1::WorkKey::PromptPrelude, n, 0),
        ],
        total_num_tokens: 2 * n as u32,
        ..Default::default()
    };
    let result = e.execute(&step).expect("the step runs without them");
    let reasons: Vec<String> =
        result.refused.iter().map(|r| format!("{}: {}", r.id, r.reason)).collect();
    assert!(
        reasons.iter().any(|r| r.starts_with("1:") && r.contains("prelude comes first")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.starts_with("2:") && r.contains("max_loops must be 1..=2")),
        "{reasons:?}"
    );
    // A plain step on a looped model, and stages of two kinds in one step.
    let step = v1::Step {
        step_id: 2,
        new_requests: vec![new(3, 2), new(4, 2)],
        work: vec![
            work(3, v1::WorkKey::PromptPrelude, n, 0),
            work(4, v1::WorkKey::PromptChunk, n, 0),
        ],
        total_num_tokens: 2 * n as u32,
        ..Default::default()
    };
    let result = e.execute(&step).expect("the step runs without it");
    assert_eq!(result.refused.len(), 1, "{:?}", result.refused);
    assert!(result.refused[0].reason.contains("runs one stage"), "{:?}", result.refused);
    // Request 3's loop 2 before loop 1.
    let step = v1::Step {
        step_id: 3,
        work: vec![work(3, v1::WorkKey::PromptRecurrent, n, 2)],
        total_num_tokens: n as u32,
        ..Default::default()
    };
    let result = e.execute(&step).expect("a step refusing its only request");
    assert!(result.refused[0].reason.contains("loop 2 after 0"), "{:?}", result.refused);
}

/// Two chains at different loops in one step (the scheduler batches every chain whose next
/// stage is a loop): each computes what it computes alone.
#[test]
fn chains_at_different_loops_share_a_step_and_each_computes_what_it_does_alone() {
    let tok = &default_file().tokenizer;
    let prompts = [prompt(), tok.encode("Lorem ipsum dolor sit amet").unwrap()];
    let sampling = greedy(None);
    let alone: Vec<Run> = prompts
        .iter()
        .map(|p| {
            let spec = RunSpec { max_loops: 3, out: 1, chunk: p.len(), preempt_at: None };
            Driver::new(engine(default_file(), Some(3))).run(p, &sampling, spec)
        })
        .collect();
    let mut e = engine(default_file(), Some(3));
    let planes = 5;
    let new = |id: u64, p: &[u32]| v1::NewRequest {
        id,
        prompt_token_ids: p.to_vec(),
        sampling: Some(sampling.clone()),
        block_ids: (0..(p.len().div_ceil(BS) * planes) as u32)
            .map(|b| b + id as u32 * 100)
            .collect(),
        max_loops: 3,
        ..Default::default()
    };
    let work = |id: u64, key: K, l: u32| v1::ScheduledWork {
        id,
        key: key.into(),
        num_tokens: prompts[id as usize - 1].len() as u32,
        loop_index: l,
        ..Default::default()
    };
    let steps: Vec<(Vec<v1::NewRequest>, Vec<v1::ScheduledWork>)> = vec![
        (vec![new(1, &prompts[0])], vec![work(1, K::PromptPrelude, 0)]),
        (vec![], vec![work(1, K::PromptRecurrent, 1)]),
        (vec![new(2, &prompts[1])], vec![work(2, K::PromptPrelude, 0)]),
        (vec![], vec![work(1, K::PromptRecurrent, 2), work(2, K::PromptRecurrent, 1)]),
        (vec![], vec![work(2, K::PromptRecurrent, 2), work(1, K::PromptRecurrent, 3)]),
        (vec![], vec![work(2, K::PromptRecurrent, 3)]),
        (vec![], vec![work(1, K::PromptCoda, 0), work(2, K::PromptCoda, 0)]),
    ];
    let mut last = None;
    for (i, (new_requests, work)) in steps.into_iter().enumerate() {
        let step = v1::Step {
            step_id: i as u64 + 1,
            total_num_tokens: work.iter().map(|w| w.num_tokens).sum(),
            new_requests,
            work,
            ..Default::default()
        };
        let result = e.execute(&step).expect("a valid step");
        assert!(result.refused.is_empty(), "step {}: {:?}", i + 1, result.refused);
        last = Some(result);
    }
    let outputs = last.unwrap().outputs;
    for (id, want) in [1u64, 2].into_iter().zip(&alone) {
        let got = outputs.iter().find(|o| o.id == id).expect("each samples");
        assert_eq!(got.token_ids, want.tokens, "request {id}");
        assert_eq!(got.logprobs, want.logprobs, "request {id}, bit for bit");
    }
}
