//! The engine on the real model, driven by hand-built `Step`s the way the scheduler drives it:
//! seeded sampling is reproducible whatever else is batched, across a preempt-and-recompute and
//! across a restart on a fresh executor; bad steps are refused whole and change nothing.

use std::sync::{Arc, OnceLock};

use ferry_executor_svc::engine::{CpuBackend, Engine, EngineConfig};
use ferry_executor_svc::model::LoadedModel;
use ferry_model::{ChatMessage, ModelFile, Tokenizer};
use ferry_proto::v1;

const BS: u32 = 8;
const BLOCKS: u32 = 256;

fn shared() -> &'static Arc<ModelFile> {
    static S: OnceLock<Arc<ModelFile>> = OnceLock::new();
    S.get_or_init(|| Arc::new(ModelFile::open(None).expect("the default model")))
}

fn tokenizer() -> &'static Tokenizer {
    &shared().tokenizer
}

fn engine() -> Engine {
    let model = LoadedModel::load(shared().clone()).expect("the default model's weights");
    Engine::new(
        Box::new(CpuBackend::new(model.weights, BS as usize, BLOCKS as usize)),
        EngineConfig { eos_token_id: tokenizer().eos_token_id },
    )
}

/// A minimal driver: one step at a time, blocks handed out in order, prefill in chunks.
struct Driver {
    engine: Engine,
    next_block: u32,
    step_id: u64,
}

struct Req {
    id: u64,
    prompt_len: usize,
    tokens: Vec<u32>,
    computed: usize,
    table: Vec<u32>,
    sent: bool,
    sampling: v1::SamplingParams,
}

impl Driver {
    fn new(engine: Engine, first_block: u32) -> Self {
        Self { engine, next_block: first_block, step_id: 0 }
    }

    /// Runs until every request has `out` generated tokens; prefill chunk `chunk`.
    fn run(&mut self, reqs: &mut [Req], out: usize, chunk: usize) {
        loop {
            let mut step = v1::Step { step_id: self.step_id, ..Default::default() };
            self.step_id += 1;
            for r in reqs.iter_mut() {
                if r.tokens.len() - r.prompt_len >= out {
                    continue;
                }
                let n = if r.computed < r.prompt_len {
                    (r.tokens.len() - r.computed).min(chunk)
                } else {
                    1
                };
                let mut new_blocks = Vec::new();
                while (r.table.len() as u32) * BS < (r.computed + n) as u32 {
                    new_blocks.push(self.next_block);
                    r.table.push(self.next_block);
                    self.next_block += 1;
                }
                if !r.sent {
                    step.new_requests.push(v1::NewRequest {
                        id: r.id,
                        prompt_token_ids: r.tokens[..r.prompt_len].to_vec(),
                        output_token_ids: r.tokens[r.prompt_len..].to_vec(),
                        sampling: Some(r.sampling),
                        block_ids: r.table.clone(),
                        num_computed_tokens: r.computed as u32,
                        traceparent: String::new(),
                    });
                    r.sent = true;
                } else if !new_blocks.is_empty() {
                    step.cached_requests.push(v1::CachedRequestUpdate {
                        id: r.id,
                        new_block_ids: new_blocks,
                        resumed: false,
                        num_computed_tokens: 0,
                    });
                }
                let key = if r.computed >= r.prompt_len {
                    v1::WorkKey::Decode
                } else {
                    v1::WorkKey::PromptChunk
                };
                step.work.push(v1::ScheduledWork {
                    id: r.id,
                    key: key.into(),
                    num_tokens: n as u32,
                    draft_token_ids: vec![],
                });
                step.total_num_tokens += n as u32;
                r.computed += n;
            }
            if step.work.is_empty() {
                return;
            }
            let result = self.engine.execute(&step).unwrap();
            for o in result.outputs {
                let r = reqs.iter_mut().find(|r| r.id == o.id).unwrap();
                r.tokens.extend(o.token_ids);
            }
        }
    }
}

fn req(id: u64, text: &str, sampling: v1::SamplingParams) -> Req {
    let toks = tokenizer().encode(text).unwrap();
    Req {
        id,
        prompt_len: toks.len(),
        tokens: toks,
        computed: 0,
        table: vec![],
        sent: false,
        sampling,
    }
}

fn seeded() -> v1::SamplingParams {
    v1::SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(42), ..Default::default() }
}

fn generated(r: &Req) -> Vec<u32> {
    r.tokens[r.prompt_len..].to_vec()
}

#[test]
fn greedy_chat_through_the_engine_answers_paris() {
    let tok = tokenizer();
    let messages = vec![
        ChatMessage { role: "system".into(), content: "You are a helpful assistant.".into() },
        ChatMessage { role: "user".into(), content: "What is the capital of France?".into() },
    ];
    let prompt = tok.apply_chat_template(&messages, true).unwrap();
    let mut r = [req(1, &prompt, v1::SamplingParams::default())];
    Driver::new(engine(), 0).run(&mut r, 8, 16);
    let text = tok.decode(&generated(&r[0]));
    assert!(text.starts_with("The capital of France is Paris."), "{text:?}");
}

#[test]
fn seeded_sampling_is_the_same_alone_batched_preempted_and_restarted() {
    let n = 10;
    // Alone.
    let mut alone = [req(7, "Write a short poem about the sea:", seeded())];
    Driver::new(engine(), 0).run(&mut alone, n, 64);
    let want = generated(&alone[0]);

    // Batched with others, different chunking.
    let mut batch = [
        req(
            1,
            "The quick brown fox",
            v1::SamplingParams { temperature: 1.0, seed: Some(1), ..Default::default() },
        ),
        req(7, "Write a short poem about the sea:", seeded()),
        req(3, "List three colours:", v1::SamplingParams::default()),
    ];
    Driver::new(engine(), 0).run(&mut batch, n, 5);
    assert_eq!(generated(&batch[1]), want, "batching changed a seeded request");

    // Preempted after 4 tokens (recompute): new blocks, computed back to 0.
    let mut d = Driver::new(engine(), 0);
    let mut r = [req(7, "Write a short poem about the sea:", seeded())];
    d.run(&mut r, 4, 64);
    let pre = v1::Step { step_id: 100, preempted_ids: vec![7], ..Default::default() };
    d.engine.execute(&pre).unwrap();
    let r0 = &mut r[0];
    let mut table = Vec::new();
    while (table.len() as u32) * BS < r0.tokens.len() as u32 {
        table.push(200 + table.len() as u32);
    }
    let len = r0.tokens.len() as u32;
    // Resume: recompute everything but the last sampled token, which the next decode computes.
    let resume = v1::Step {
        step_id: 101,
        cached_requests: vec![v1::CachedRequestUpdate {
            id: 7,
            new_block_ids: table.clone(),
            resumed: true,
            num_computed_tokens: 0,
        }],
        work: vec![v1::ScheduledWork {
            id: 7,
            key: v1::WorkKey::PromptChunk.into(),
            num_tokens: len - 1,
            draft_token_ids: vec![],
        }],
        total_num_tokens: len - 1,
        ..Default::default()
    };
    let res = d.engine.execute(&resume).unwrap();
    assert!(res.outputs.is_empty(), "recomputing known tokens samples nothing");
    r0.table = table;
    r0.computed = (len - 1) as usize;
    d.run(&mut r, n, 64);
    assert_eq!(generated(&r[0]), want, "preempt-and-recompute changed a seeded request");

    // Restarted on a fresh executor from prompt + the first 6 generated tokens.
    let mut fresh = [req(7, "Write a short poem about the sea:", seeded())];
    fresh[0].tokens.extend_from_slice(&want[..6]);
    Driver::new(engine(), 10).run(&mut fresh, n, 64);
    assert_eq!(generated(&fresh[0]), want, "a restart elsewhere changed a seeded request");
}

#[test]
fn bad_steps_are_refused_and_change_nothing() {
    let mut d = Driver::new(engine(), 0);
    let mut r = [req(1, "Hello there", v1::SamplingParams::default())];
    d.run(&mut r, 2, 64);
    let len = r[0].tokens.len() as u32;
    let decode = |id: u64, n: u32| v1::ScheduledWork {
        id,
        key: v1::WorkKey::Decode.into(),
        num_tokens: n,
        draft_token_ids: vec![],
    };
    let new = |id: u64, blocks: Vec<u32>, temperature: f32| v1::NewRequest {
        id,
        prompt_token_ids: vec![1, 2, 3],
        block_ids: blocks,
        sampling: Some(v1::SamplingParams { temperature, ..Default::default() }),
        ..Default::default()
    };
    let cases: Vec<(v1::Step, &str)> = vec![
        (
            v1::Step { work: vec![decode(99, 1)], total_num_tokens: 1, ..Default::default() },
            "unknown",
        ),
        (
            v1::Step { work: vec![decode(1, 1)], total_num_tokens: 2, ..Default::default() },
            "adds up to 1",
        ),
        (
            v1::Step { work: vec![decode(1, 2)], total_num_tokens: 2, ..Default::default() },
            "run past",
        ),
        (
            v1::Step {
                work: vec![decode(1, 1), decode(1, 1)],
                total_num_tokens: 2,
                ..Default::default()
            },
            "scheduled twice",
        ),
        (
            v1::Step { new_requests: vec![new(1, vec![9], 0.0)], ..Default::default() },
            "already a live request",
        ),
        (
            v1::Step { new_requests: vec![new(2, vec![BLOCKS + 5], 0.0)], ..Default::default() },
            "out of range",
        ),
        (
            v1::Step { new_requests: vec![new(2, vec![9], -1.0)], ..Default::default() },
            "temperature",
        ),
        (
            v1::Step {
                preempted_ids: vec![1],
                work: vec![decode(1, 1)],
                total_num_tokens: 1,
                ..Default::default()
            },
            "preempted",
        ),
        (
            v1::Step {
                new_requests: vec![new(2, vec![r[0].table[0]], 0.0)],
                work: vec![
                    decode(1, 1),
                    v1::ScheduledWork {
                        id: 2,
                        key: v1::WorkKey::Prompt.into(),
                        num_tokens: 3,
                        draft_token_ids: vec![],
                    },
                ],
                total_num_tokens: 4,
                ..Default::default()
            },
            "written by sequence",
        ),
        (
            v1::Step { kv_ops: vec![v1::KvOperation::default()], ..Default::default() },
            "KV operations",
        ),
    ];
    for (step, needle) in cases {
        let err = d.engine.execute(&step).unwrap_err().to_string();
        assert!(err.contains(needle), "{err:?} should mention {needle:?}");
    }
    assert_eq!(d.engine.num_requests(), 1);
    // The request goes on exactly as an undisturbed one.
    d.run(&mut r, 6, 64);
    let mut clean = [req(1, "Hello there", v1::SamplingParams::default())];
    Driver::new(engine(), 0).run(&mut clean, 6, 64);
    assert_eq!(generated(&r[0]), generated(&clean[0]));
    assert!(len > 0);
}

#[test]
fn the_simulator_runs_the_same_protocol_with_deterministic_tokens_and_virtual_time() {
    use ferry_executor_svc::engine::sim::{SimClock, SimHardware, SimModel};
    use ferry_executor_svc::engine::SimBackend;
    let shape = ferry_executor_svc::model::LlamaShape {
        num_layers: 32,
        hidden: 4096,
        intermediate: 11008,
        num_heads: 32,
        num_kv_heads: 32,
        head_dim: 128,
        vocab_size: 32000,
        rope_theta: 10000.0,
        rms_eps: 1e-5,
        max_model_len: 4096,
    };
    let model = SimModel::llama(32, 4096, 11008, 32, 32, 32000, 2.0);
    let sim = || {
        let backend = SimBackend::new(
            shape,
            model,
            SimHardware::h100_80g(),
            BS as usize,
            BLOCKS as usize,
            SimClock::virtual_at_zero(),
        );
        Engine::new(Box::new(backend), EngineConfig { eos_token_id: 2 })
    };
    let prompt = |id| Req {
        id,
        prompt_len: 40,
        tokens: (100..140).collect(),
        computed: 0,
        table: vec![],
        sent: false,
        sampling: seeded(),
    };
    let mut a = [prompt(1), prompt(2)];
    Driver::new(sim(), 0).run(&mut a, 20, 16);
    let mut b = [prompt(1)];
    Driver::new(sim(), 0).run(&mut b, 20, 40);
    assert_eq!(
        generated(&a[0]),
        generated(&b[0]),
        "simulated tokens depend only on seed and position"
    );
    assert!(generated(&a[0]).iter().all(|t| *t != 2 && *t < 32000));
    // The simulator validates like the real executor.
    let mut d = Driver::new(sim(), 0);
    let bad = v1::Step {
        work: vec![v1::ScheduledWork {
            id: 5,
            key: v1::WorkKey::Decode.into(),
            num_tokens: 1,
            draft_token_ids: vec![],
        }],
        total_num_tokens: 1,
        ..Default::default()
    };
    assert!(d.engine.execute(&bad).unwrap_err().to_string().contains("unknown"));
}
