//! The engine on the real model, driven by hand-built `Step`s the way the scheduler drives it:
//! seeded sampling is reproducible whatever else is batched, across a preempt-and-recompute and
//! across a restart on a fresh executor; a bad request is refused alone and the others run on
//! exactly; a step bad as a whole is refused whole and changes nothing; the blocks cached by
//! the steps' cache changes outlive a reset.

use std::sync::{Arc, OnceLock};

use ferry_executor_svc::engine::{CpuBackend, Engine, EngineConfig};
use ferry_executor_svc::forward::{KvDtype, LoadedModel};
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
        EngineConfig::new(tokenizer().eos_token_id),
    )
}

/// Draft tokens for a decode-ready request (its id, tokens so far, prompt length); empty for
/// a plain decode.
type Drafter = Box<dyn FnMut(u64, &[u32], usize) -> Vec<u32>>;

/// A minimal driver: one step at a time, blocks handed out in order, prefill in chunks, and
/// verifications of `drafter`'s draft tokens when it has one.
struct Driver {
    engine: Engine,
    next_block: u32,
    step_id: u64,
    drafter: Option<Drafter>,
    /// Verifications run and the draft tokens they accepted.
    verified: (usize, usize),
}

struct Req {
    id: u64,
    prompt_len: usize,
    tokens: Vec<u32>,
    computed: usize,
    table: Vec<u32>,
    sent: bool,
    sampling: v1::SamplingParams,
    /// (prompt position, its log-probabilities) as the results reported them.
    prompt_logprobs: Vec<(usize, v1::PositionLogprobs)>,
    /// The generated tokens' log-probabilities, when asked for.
    logprobs: Vec<v1::PositionLogprobs>,
}

impl Driver {
    fn new(engine: Engine, first_block: u32) -> Self {
        Self { engine, next_block: first_block, step_id: 0, drafter: None, verified: (0, 0) }
    }

    /// Runs until every request has `out` generated tokens; prefill chunk `chunk`.
    fn run(&mut self, reqs: &mut [Req], out: usize, chunk: usize) {
        self.run_tampered(reqs, out, chunk, |_| None);
    }

    /// As [`Self::run`], with `tamper` adding to each step parts of other requests (the id the
    /// executor must refuse alone, and what its reason must say; or `None` when it adds none
    /// to refuse).
    fn run_tampered(
        &mut self,
        reqs: &mut [Req],
        out: usize,
        chunk: usize,
        mut tamper: impl FnMut(&mut v1::Step) -> Option<(u64, &'static str)>,
    ) {
        loop {
            let mut step = v1::Step { step_id: self.step_id, ..Default::default() };
            self.step_id += 1;
            for r in reqs.iter_mut() {
                if r.tokens.len() - r.prompt_len >= out {
                    continue;
                }
                let draft = match self.drafter.as_mut() {
                    Some(f) if r.computed >= r.prompt_len => f(r.id, &r.tokens, r.prompt_len),
                    _ => Vec::new(),
                };
                let n = if r.computed < r.prompt_len {
                    (r.tokens.len() - r.computed).min(chunk)
                } else {
                    1 + draft.len()
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
                        sampling: Some(r.sampling.clone()),
                        block_ids: r.table.clone(),
                        num_computed_tokens: r.computed as u32,
                        ..Default::default()
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
                let key = if !draft.is_empty() {
                    v1::WorkKey::Verify
                } else if r.computed >= r.prompt_len {
                    v1::WorkKey::Decode
                } else {
                    v1::WorkKey::PromptChunk
                };
                step.work.push(v1::ScheduledWork {
                    id: r.id,
                    key: key.into(),
                    num_tokens: n as u32,
                    draft_token_ids: draft,
                    ..Default::default()
                });
                step.total_num_tokens += n as u32;
                r.computed += n;
            }
            if step.work.is_empty() {
                return;
            }
            let expected = tamper(&mut step);
            let result = self.engine.execute(&step).unwrap();
            let refused: Vec<(u64, &str)> =
                result.refused.iter().map(|r| (r.id, r.reason.as_str())).collect();
            match expected {
                Some((id, needle)) => assert!(
                    refused.len() == 1 && refused[0].0 == id && refused[0].1.contains(needle),
                    "step {}: expected request {id} refused for {needle:?}, got {refused:?}",
                    step.step_id
                ),
                None => assert!(refused.is_empty(), "nothing to refuse, got {refused:?}"),
            }
            assert!(result.outputs.iter().all(|o| reqs.iter().any(|r| r.id == o.id)));
            for o in result.outputs {
                let r = reqs.iter_mut().find(|r| r.id == o.id).unwrap();
                let work = step.work.iter().find(|w| w.id == o.id).unwrap();
                if work.key == v1::WorkKey::Verify as i32 {
                    let k = work.draft_token_ids.len();
                    assert!(
                        (1..=k + 1).contains(&o.token_ids.len()),
                        "{} tokens",
                        o.token_ids.len()
                    );
                    assert_eq!(
                        o.token_ids[..o.token_ids.len() - 1],
                        work.draft_token_ids[..o.token_ids.len() - 1]
                    );
                    self.verified.0 += 1;
                    self.verified.1 += o.token_ids.len() - 1;
                    // The rejected drafts' KV is stale: the next step starts at the last token.
                    r.computed = r.tokens.len() + o.token_ids.len() - 1;
                }
                r.tokens.extend(o.token_ids);
                r.logprobs.extend(o.logprobs);
                let from = o.prompt_logprobs_from as usize;
                r.prompt_logprobs.extend(
                    o.prompt_logprobs.into_iter().enumerate().map(|(i, lp)| (from + i, lp)),
                );
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
        prompt_logprobs: Vec::new(),
        logprobs: Vec::new(),
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
            loop_index: 0,
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

/// Speculative verification on the real model: each request's draft is its plain output's
/// next tokens with one of them changed at some positions (so drafts are accepted whole, in
/// part and not at all), and the outputs, greedy and seeded alike, are the plain ones token
/// for token.
#[test]
fn verified_drafts_change_no_token_greedy_or_seeded() {
    let n = 24;
    let make = || {
        [
            req(1, "Count from one: one, two, three,", v1::SamplingParams::default()),
            req(2, "Write a short poem about the sea:", seeded()),
            req(
                3,
                "List three colours:",
                v1::SamplingParams { temperature: 0.8, seed: Some(5), ..Default::default() },
            ),
            req(
                4,
                "The quick brown fox",
                v1::SamplingParams { repetition_penalty: 1.3, ..Default::default() },
            ),
        ]
    };
    let mut plain = make();
    Driver::new(engine(), 0).run(&mut plain, n + 8, 16);
    let want: Vec<(u64, usize, Vec<u32>)> =
        plain.iter().map(|r| (r.id, r.prompt_len, r.tokens.clone())).collect();
    let mut spec = make();
    let mut d = Driver::new(engine(), 0);
    d.drafter = Some(Box::new(move |id, tokens: &[u32], _| {
        let (_, _, full) = want.iter().find(|w| w.0 == id).unwrap();
        let at = tokens.len();
        let mut draft: Vec<u32> = full.get(at..(at + 4).min(full.len())).unwrap_or(&[]).to_vec();
        // Every third position changes a draft token (id 4: every draft is wrong).
        let wrong = if id == 4 { Some(0) } else { at.is_multiple_of(3).then_some(at % 4) };
        if let Some(i) = wrong.filter(|&i| i < draft.len()) {
            draft[i] = (draft[i] + 1) % 1000;
        }
        draft
    }));
    d.run(&mut spec, n, 16);
    for (p, s) in plain.iter().zip(&spec) {
        assert_eq!(generated(s)[..n], generated(p)[..n], "request {}", s.id);
    }
    let (verifications, accepted) = d.verified;
    assert!(
        verifications > 0 && accepted > 0,
        "{verifications} verifications, {accepted} accepted"
    );
    assert!(accepted < verifications * 4, "some drafts must be rejected");
}

#[test]
fn a_malformed_or_constrained_verification_is_refused_alone() {
    let verify = |id: u64, num_tokens: u32, draft: Vec<u32>| v1::ScheduledWork {
        id,
        key: v1::WorkKey::Verify.into(),
        num_tokens,
        draft_token_ids: draft,
        loop_index: 0,
    };
    let cases = [
        (verify(1, 3, vec![5]), "computes 2 tokens (its last token and each draft token), not 3"),
        (verify(1, 1, vec![]), "a verify carries no draft tokens"),
        (verify(1, 18, vec![5; 17]), "17 draft tokens, at most 16"),
        (verify(1, 2, vec![u32::MAX]), "draft token id 4294967295 is outside the vocabulary"),
    ];
    for (i, (work, why)) in cases.into_iter().enumerate() {
        let mut e = Driver::new(grammar_engine(), 0);
        let mut r = [req(1, "Hello", v1::SamplingParams::default())];
        e.run(&mut r, 1, 64);
        let blocks: Vec<u32> = (100..103).collect();
        let step = v1::Step {
            step_id: e.step_id + i as u64,
            cached_requests: vec![v1::CachedRequestUpdate {
                id: 1,
                new_block_ids: blocks,
                resumed: false,
                num_computed_tokens: 0,
            }],
            total_num_tokens: work.num_tokens,
            work: vec![work],
            ..Default::default()
        };
        let result = e.engine.execute(&step).unwrap();
        assert_eq!(result.refused.len(), 1, "{why}");
        assert!(result.refused[0].reason.contains(why), "{:?} lacks {why:?}", result.refused[0]);
    }
    // A structured output verifies nothing.
    let mut d = Driver::new(grammar_engine(), 0);
    let kind = v1::structured_output::Kind::Regex("[a-z]+".into());
    let mut c = [req(2, "Give me a word:", constrained(kind, 0.0, 1))];
    d.run(&mut c, 1, 64);
    let step = v1::Step {
        step_id: d.step_id,
        work: vec![verify(2, 2, vec![5])],
        total_num_tokens: 2,
        cached_requests: vec![v1::CachedRequestUpdate {
            id: 2,
            new_block_ids: vec![150, 151, 152, 153],
            resumed: false,
            num_computed_tokens: 0,
        }],
        ..Default::default()
    };
    let result = d.engine.execute(&step).unwrap();
    assert_eq!(result.refused.len(), 1);
    assert!(result.refused[0].reason.contains("a structured output cannot verify"), "{result:?}");
}

/// The executor keeps which block holds which content hash as the steps' cache changes say,
/// across a reset (a new session, whose scheduler adopts them): evictions are forgotten before
/// the step runs, registrations recorded once it ran — not when a request of it was refused —
/// and a change naming a block past the pool refuses the step whole, changing nothing.
#[test]
fn cached_blocks_follow_the_steps_and_survive_a_reset() {
    let mut d = Driver::new(engine(), 0);
    let cached =
        |e: &Engine| e.cached_blocks().iter().map(|c| (c.block_id, c.hash)).collect::<Vec<_>>();
    let block = |block_id: u32, hash: u64| v1::CachedBlock { block_id, hash };
    let changes = |step_id: u64, evicted_blocks: Vec<u32>, cached_blocks| v1::Step {
        step_id,
        evicted_blocks,
        cached_blocks,
        ..Default::default()
    };
    d.engine.execute(&changes(1, vec![], vec![block(0, 10), block(1, 11)])).unwrap();
    assert_eq!(cached(&d.engine), [(0, 10), (1, 11)]);
    assert_eq!(d.engine.reset(), 0);
    assert_eq!(cached(&d.engine), [(0, 10), (1, 11)], "a new session keeps them");
    // Evicted and cached again in one step (under another hash), evicted alone.
    d.engine.execute(&changes(2, vec![1, 0], vec![block(1, 12)])).unwrap();
    assert_eq!(cached(&d.engine), [(1, 12)]);
    let err = d.engine.execute(&changes(3, vec![1], vec![block(BLOCKS, 1)])).unwrap_err();
    assert!(err.to_string().contains("past the pool's 256 blocks"), "{err}");
    assert_eq!(cached(&d.engine), [(1, 12)], "a refused step changes nothing");
    // A step with a refused request records no registration (its blocks may not have been
    // computed), but its evictions hold.
    let mut bad = changes(4, vec![1], vec![block(7, 70)]);
    let prompt = tokenizer().encode("Hello").unwrap();
    bad.new_requests.push(v1::NewRequest {
        id: 9,
        prompt_token_ids: prompt.clone(),
        sampling: Some(v1::SamplingParams { temperature: -1.0, ..Default::default() }),
        block_ids: vec![7],
        ..Default::default()
    });
    bad.work.push(v1::ScheduledWork {
        id: 9,
        key: v1::WorkKey::Prompt.into(),
        num_tokens: prompt.len() as u32,
        draft_token_ids: vec![],
        loop_index: 0,
    });
    bad.total_num_tokens = prompt.len() as u32;
    let result = d.engine.execute(&bad).unwrap();
    assert_eq!(result.refused.len(), 1, "{result:?}");
    assert_eq!(cached(&d.engine), []);
}

#[test]
fn bad_steps_are_refused_and_change_nothing() {
    let mut d = Driver::new(engine(), 0);
    let mut r = [req(1, "Hello there", v1::SamplingParams::default())];
    d.run(&mut r, 2, 64);
    let decode = v1::ScheduledWork {
        id: 1,
        key: v1::WorkKey::Decode.into(),
        num_tokens: 1,
        draft_token_ids: vec![],
        loop_index: 0,
    };
    // Faults of the step as a whole: nothing runs, nothing changes.
    let export = v1::KvOperation {
        transfer_id: "7".into(),
        op: Some(v1::kv_operation::Op::Export(v1::KvExport {
            request_id: 1,
            ..Default::default()
        })),
        ..Default::default()
    };
    let cases: Vec<(v1::Step, &str)> = vec![
        (
            v1::Step { work: vec![decode.clone()], total_num_tokens: 2, ..Default::default() },
            "adds up to 1",
        ),
        (v1::Step { kv_ops: vec![export], ..Default::default() }, "KV operations"),
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
}

/// Adds a bad part to a step; the request its refusal names and what the reason says.
type Tamper = dyn Fn(&mut v1::Step) -> (u64, &'static str);

/// The survivor's prompt fills more than one block, so its first block is full and no longer
/// written (a victim that shares it is the only writer).
const SURVIVOR: &str = "The quick brown fox jumps over the lazy dog, and then it tells a story";

/// Each fault that names one request refuses that request alone: the step runs without it,
/// the other requests' tokens are exactly those of an undisturbed run, and the refused one is
/// named again by every later step that mentions it until the scheduler lists it finished.
#[test]
fn a_refused_request_fails_alone_and_the_others_run_on_exactly() {
    let mut d = Driver::new(engine(), 0);
    let mut r = [req(1, SURVIVOR, v1::SamplingParams::default()), req(2, "Hi", seeded())];
    d.run(&mut r, 2, 64);
    assert!(r[0].table.len() > 1 && r[0].computed > BS as usize, "survivor spans two blocks");
    let shared_block = r[0].table[0];
    let free = 200u32; // blocks the driver never hands out in this test
    let prompt_work = |id: u64, n: u32| v1::ScheduledWork {
        id,
        key: v1::WorkKey::Prompt.into(),
        num_tokens: n,
        draft_token_ids: vec![],
        loop_index: 0,
    };
    let new = |id: u64, prompt: Vec<u32>, blocks: Vec<u32>| v1::NewRequest {
        id,
        prompt_token_ids: prompt,
        block_ids: blocks,
        ..Default::default()
    };
    let with_work = move |step: &mut v1::Step, nr: v1::NewRequest, n: u32| {
        step.work.push(prompt_work(nr.id, n));
        step.total_num_tokens += n;
        step.new_requests.push(nr);
    };
    let cases: Vec<Box<Tamper>> = vec![
        Box::new(move |s| {
            s.work.push(prompt_work(100, 1));
            s.total_num_tokens += 1;
            (100, "unknown")
        }),
        Box::new(move |s| {
            with_work(s, new(101, vec![1, 2, 999_999], vec![free]), 3);
            (101, "outside the vocabulary")
        }),
        Box::new(move |s| {
            with_work(s, new(102, vec![1, 2, 3], vec![BLOCKS + 5]), 3);
            (102, "out of range")
        }),
        Box::new(move |s| {
            let mut nr = new(103, vec![1, 2, 3], vec![free]);
            nr.sampling = Some(v1::SamplingParams { temperature: -1.0, ..Default::default() });
            with_work(s, nr, 3);
            (103, "temperature")
        }),
        Box::new(move |s| {
            with_work(s, new(104, vec![1, 2, 3], vec![shared_block]), 3);
            (104, "written by sequence")
        }),
        Box::new(move |s| {
            s.new_requests.push(new(105, vec![1; 8193], vec![free]));
            (105, "maximum length")
        }),
        Box::new(move |s| {
            let mut nr = new(106, vec![1, 2, 3], vec![free]);
            nr.num_computed_tokens = 9;
            s.new_requests.push(nr);
            (106, "exceeds its 3 tokens")
        }),
        Box::new(move |s| {
            s.new_requests.push(new(107, vec![1, 2, 3], vec![free]));
            s.new_requests.push(new(107, vec![4, 5, 6], vec![free + 1]));
            (107, "already a live request")
        }),
        Box::new(move |s| {
            with_work(s, new(108, vec![1, 2, 3], vec![free]), 4);
            (108, "run past")
        }),
        Box::new(move |s| {
            s.cached_requests.push(v1::CachedRequestUpdate {
                id: 108,
                new_block_ids: vec![free],
                ..Default::default()
            });
            (108, "run past") // refused above; named again with its first reason
        }),
        Box::new(move |s| {
            s.finished_ids.push(108); // the scheduler heard: forgotten for good
            s.work.push(prompt_work(108, 1));
            s.total_num_tokens += 1;
            (108, "unknown") // a step naming it after that is a new fault
        }),
    ];
    let mut cases = cases.into_iter();
    d.run_tampered(&mut r, 16, 64, |step| cases.next().map(|tamper| tamper(step)));
    assert_eq!(cases.count(), 0, "every case ran during the decode");
    assert_eq!(d.engine.num_requests(), 2, "only the two requests are held");
    let mut clean = [req(1, SURVIVOR, v1::SamplingParams::default()), req(2, "Hi", seeded())];
    Driver::new(engine(), 0).run(&mut clean, 16, 64);
    assert_eq!(generated(&r[0]), generated(&clean[0]));
    assert_eq!(generated(&r[1]), generated(&clean[1]));
}

/// New requests past `--max-live-requests` are refused, each alone; finished ones make room.
#[test]
fn new_requests_past_the_live_limit_are_refused_alone() {
    let model = LoadedModel::load(shared().clone()).expect("the default model's weights");
    let config = EngineConfig { max_live_requests: 2, ..EngineConfig::new(2) };
    let mut engine = Engine::new(Box::new(CpuBackend::new(model.weights, 8, 64)), config);
    let new = |id: u64, block: u32| v1::NewRequest {
        id,
        prompt_token_ids: vec![1, 2, 3],
        block_ids: vec![block],
        ..Default::default()
    };
    let step = v1::Step {
        step_id: 1,
        new_requests: vec![new(1, 0), new(2, 1), new(3, 2), new(4, 3)],
        ..Default::default()
    };
    let result = engine.execute(&step).unwrap();
    let refused: Vec<u64> = result.refused.iter().map(|r| r.id).collect();
    assert_eq!(refused, vec![3, 4]);
    assert!(result.refused[0].reason.contains("--max-live-requests"), "{:?}", result.refused);
    assert_eq!(engine.num_requests(), 2);
    let step = v1::Step {
        step_id: 2,
        finished_ids: vec![1, 3, 4],
        new_requests: vec![new(5, 2)],
        ..Default::default()
    };
    let result = engine.execute(&step).unwrap();
    assert!(result.refused.is_empty(), "{:?}", result.refused);
    assert_eq!(engine.num_requests(), 2);
}

#[test]
fn the_simulator_runs_the_same_protocol_with_deterministic_tokens_and_virtual_time() {
    use ferry_executor_svc::engine::simulated_gpu::{SimClock, SimHardware, SimModel};
    use ferry_executor_svc::engine::SimBackend;
    let shape = ferry_executor_svc::forward::LlamaShape {
        family: ferry_model::Family::LLAMA,
        num_layers: 32,
        hidden: 4096,
        intermediate: 11008,
        num_heads: 32,
        num_kv_heads: 32,
        head_dim: 128,
        vocab_size: 32000,
        rope_theta: 10000.0,
        rope_scale: 1.0,
        rope_dims: 128,
        rope_mscale: 1.0,
        rope_long: false,
        rms_eps: 1e-5,
        max_model_len: 4096,
        sliding_window: None,
        query_scale: 1.0 / 128f32.sqrt(),
        attn_softcap: None,
        final_softcap: None,
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
        Engine::new(Box::new(backend), EngineConfig::new(2))
    };
    let prompt = |id| Req {
        id,
        prompt_len: 40,
        tokens: (100..140).collect(),
        computed: 0,
        table: vec![],
        sent: false,
        sampling: seeded(),
        prompt_logprobs: Vec::new(),
        logprobs: Vec::new(),
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
            loop_index: 0,
        }],
        total_num_tokens: 1,
        ..Default::default()
    };
    let refused = d.engine.execute(&bad).unwrap().refused;
    assert!(refused.len() == 1 && refused[0].reason.contains("unknown"), "{refused:?}");
    let bad_sum = v1::Step { step_id: 1, total_num_tokens: 1, ..Default::default() };
    assert!(d.engine.execute(&bad_sum).unwrap_err().to_string().contains("adds up to 0"));
    // It computes no logits, so it cannot score a prompt: refused alone, with why.
    let mut d = Driver::new(sim(), 0);
    let step = v1::Step {
        step_id: 0,
        new_requests: vec![v1::NewRequest {
            id: 9,
            prompt_token_ids: (100..140).collect(),
            sampling: Some(v1::SamplingParams { prompt_logprobs: Some(1), ..Default::default() }),
            block_ids: (0..5).collect(),
            ..Default::default()
        }],
        work: vec![v1::ScheduledWork {
            id: 9,
            key: v1::WorkKey::Prompt.into(),
            num_tokens: 40,
            draft_token_ids: vec![],
            loop_index: 0,
        }],
        total_num_tokens: 40,
        ..Default::default()
    };
    let refused = d.engine.execute(&step).unwrap().refused;
    assert!(
        refused.len() == 1 && refused[0].reason.contains("prompt_logprobs need the model's logits"),
        "{refused:?}"
    );
}

/// An engine that compiles structured outputs for the default model's vocabulary.
fn grammar_engine() -> Engine {
    engine().with_grammars(Some(shared().clone()))
}

fn constrained(
    kind: v1::structured_output::Kind,
    temperature: f32,
    seed: u64,
) -> v1::SamplingParams {
    v1::SamplingParams {
        temperature,
        seed: Some(seed),
        structured_output: Some(v1::StructuredOutput { kind: Some(kind) }),
        ..Default::default()
    }
}

/// The generated text before the end-of-sequence token, which must have come.
fn until_eos(r: &Req) -> String {
    let out = generated(r);
    let eos = tokenizer().eos_token_id;
    let end = out.iter().position(|t| *t == eos);
    let end = end.unwrap_or_else(|| panic!("no end of sequence in {:?}", tokenizer().decode(&out)));
    // Once the grammar is complete only the end of sequence is allowed.
    assert!(out[end..].iter().all(|t| *t == eos), "{out:?}");
    tokenizer().decode(&out[..end])
}

fn chat(user: &str) -> String {
    let messages = vec![ChatMessage { role: "user".into(), content: user.into() }];
    tokenizer().apply_chat_template(&messages, true).unwrap()
}

const PERSON: &str = r#"{"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": false}"#;

#[test]
fn a_json_schema_output_parses_batched_and_continues_exactly_after_a_restart() {
    use v1::structured_output::Kind;
    let prompt = chat("Describe a person as JSON.");
    let mut neighbour = [req(2, "The quick brown fox", seeded())];
    Driver::new(engine(), 0).run(&mut neighbour, 12, 16);
    for seed in 0..3 {
        let sampling = constrained(Kind::JsonSchema(PERSON.into()), 1.0, seed);
        let mut r = [req(1, &prompt, sampling.clone()), req(2, "The quick brown fox", seeded())];
        Driver::new(grammar_engine(), 0).run(&mut r, 48, 16);
        let text = until_eos(&r[0]);
        let v: serde_json::Value = serde_json::from_str(&text).expect(&text);
        let o = v.as_object().expect(&text);
        assert_eq!(o.len(), 2, "{text}");
        assert!(o["name"].as_str().is_some_and(|s| s.chars().count() <= 12), "{text}");
        assert!(o["age"].as_u64().is_some_and(|a| a <= 120), "{text}");
        assert_eq!(
            generated(&r[1])[..12],
            generated(&neighbour[0])[..],
            "a constrained request changed its unconstrained neighbour"
        );
        // On a fresh executor from the prompt and its first 5 tokens (a move): the grammar is
        // replayed and the draws continue exactly.
        let mut moved = [req(1, &prompt, sampling)];
        moved[0].tokens.extend_from_slice(&generated(&r[0])[..5]);
        Driver::new(grammar_engine(), 0).run(&mut moved, 48, 16);
        assert_eq!(generated(&moved[0]), generated(&r[0]), "seed {seed}");
    }
}

#[test]
fn a_choice_and_a_regex_hold_whatever_the_model_prefers() {
    use v1::structured_output::Kind;
    let cities = Kind::Choice(v1::Choices { choices: vec!["London".into(), "Paris".into()] });
    let mut r = [req(1, &chat("What is the capital of France?"), constrained(cities, 0.0, 0))];
    Driver::new(grammar_engine(), 0).run(&mut r, 6, 64);
    let city = until_eos(&r[0]);
    assert!(city == "London" || city == "Paris", "{city:?}");
    // Unconstrained, the model answers with a sentence, not a phone number.
    let phone = Kind::Regex("[0-9]{3}-[0-9]{4}".into());
    for seed in 0..3 {
        let mut r = [req(1, &chat("Tell me a story."), constrained(phone.clone(), 1.0, seed))];
        Driver::new(grammar_engine(), 0).run(&mut r, 12, 64);
        let text = until_eos(&r[0]);
        let b = text.as_bytes();
        assert!(
            b.len() == 8
                && b[3] == b'-'
                && b.iter().enumerate().all(|(i, c)| i == 3 || c.is_ascii_digit()),
            "{text:?}"
        );
    }
}

#[test]
fn a_grammar_that_cannot_hold_is_refused_alone_with_why() {
    use v1::structured_output::Kind;
    let tok = tokenizer();
    let prompt = tok.encode("Hello").unwrap();
    let new = |id: u64, sampling: v1::SamplingParams, output: Vec<u32>| v1::NewRequest {
        id,
        prompt_token_ids: prompt.clone(),
        output_token_ids: output,
        sampling: Some(sampling),
        block_ids: vec![id as u32],
        num_computed_tokens: 0,
        traceparent: String::new(),
        max_loops: 0,
        lora: None,
    };
    let work = |id: u64| v1::ScheduledWork {
        id,
        key: v1::WorkKey::PromptChunk.into(),
        num_tokens: prompt.len() as u32,
        draft_token_ids: vec![],
        loop_index: 0,
    };
    let step = v1::Step {
        new_requests: vec![
            new(1, constrained(Kind::Regex("(".into()), 0.0, 0), vec![]),
            // Its earlier output ("Hello") is not a number.
            new(2, constrained(Kind::Regex("[0-9]+".into()), 0.0, 0), prompt.clone()),
            new(3, v1::SamplingParams::default(), vec![]),
        ],
        work: vec![work(1), work(2), work(3)],
        total_num_tokens: 3 * prompt.len() as u32,
        ..Default::default()
    };
    // Request 2's table must hold prompt and output.
    let mut step = step;
    step.new_requests[1].block_ids = vec![2, 4];
    let result = grammar_engine().execute(&step).unwrap();
    let refused: Vec<(u64, &str)> =
        result.refused.iter().map(|r| (r.id, r.reason.as_str())).collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(refused[0].0 == 1 && refused[0].1.contains("structured output"), "{refused:?}");
    assert!(refused[1].0 == 2 && refused[1].1.contains("break the grammar"), "{refused:?}");
    assert_eq!(result.outputs.iter().map(|o| o.id).collect::<Vec<_>>(), vec![3]);
}

#[test]
fn prompt_logprobs_score_every_prompt_token_once_however_the_prompt_is_chunked() {
    let text = "The capital of France is Paris, and the capital of Italy is Rome.";
    let scoring = v1::SamplingParams { prompt_logprobs: Some(3), ..Default::default() };
    let run = |chunk: usize| {
        let mut d = Driver::new(engine(), 0);
        let mut reqs = [req(1, text, scoring.clone()), req(2, "Hello there", seeded())];
        d.run(&mut reqs, 2, chunk);
        let [scored, other] = reqs;
        assert!(other.prompt_logprobs.is_empty(), "asked only by request 1");
        scored
    };
    let whole = run(1000);
    let n = whole.prompt_len;
    let positions: Vec<usize> = whole.prompt_logprobs.iter().map(|(p, _)| *p).collect();
    assert_eq!(positions, (1..n).collect::<Vec<_>>(), "each prompt token after the first, once");
    for (pos, lp) in &whole.prompt_logprobs {
        let own = lp.sampled.unwrap();
        assert_eq!(own.token_id, whole.tokens[*pos]);
        assert!(own.logprob <= 0.0 && lp.top.len() == 3, "{lp:?}");
        // The most likely first, and the prompt token no likelier than the best.
        assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        assert!(own.logprob <= lp.top[0].logprob + 1e-6);
    }
    for chunk in [1, 4, 7] {
        let chunked = run(chunk);
        assert_eq!(chunked.tokens, whole.tokens, "chunk {chunk}: same greedy answer");
        for ((p, a), (q, b)) in chunked.prompt_logprobs.iter().zip(&whole.prompt_logprobs) {
            assert_eq!(p, q);
            let (a, b) = (a.sampled.unwrap(), b.sampled.unwrap());
            assert!((a.logprob - b.logprob).abs() < 1e-4, "chunk {chunk} at {p}: {a:?} {b:?}");
        }
        assert_eq!(chunked.prompt_logprobs.len(), n - 1, "chunk {chunk}");
    }
}

/// A sample of several (`n` > 1) starts from its source's prompt KV: references to the
/// source's full blocks and a copy of its partial one (`Step.block_copies`, done before the
/// forward), then computes the last prompt token itself. Its tokens are the ones a request
/// of its own with its seed computes; a bad copy refuses its request alone.
#[test]
fn a_forked_sample_continues_exactly_from_a_copied_block_and_a_bad_copy_is_refused_alone() {
    let text = "The old ferryman carried the whole village across the river, one boat at a time.";
    let sampling = |seed| v1::SamplingParams { temperature: 1.0, seed: Some(seed), ..seeded() };
    let mut d = Driver::new(engine(), 0);
    let source = req(1, text, sampling(7));
    let len = source.prompt_len;
    let point = len - 1;
    assert!(!point.is_multiple_of(BS as usize), "the prompt ends its forked KV in a partial block");
    let shared = point / BS as usize;
    // The source computes its prompt but the last token.
    let table: Vec<u32> = (0..=shared as u32).collect();
    let step = v1::Step {
        step_id: 0,
        new_requests: vec![v1::NewRequest {
            id: 1,
            prompt_token_ids: source.tokens.clone(),
            sampling: Some(source.sampling.clone()),
            block_ids: table.clone(),
            ..Default::default()
        }],
        work: vec![v1::ScheduledWork {
            id: 1,
            key: v1::WorkKey::PromptChunk.into(),
            num_tokens: point as u32,
            draft_token_ids: Vec::new(),
            loop_index: 0,
        }],
        total_num_tokens: point as u32,
        ..Default::default()
    };
    let result = d.engine.execute(&step).unwrap();
    assert!(result.refused.is_empty() && result.outputs.iter().all(|o| o.token_ids.is_empty()));

    // The sample: the shared full blocks, block 50 for the rest, copied from the source's.
    let sample_table: Vec<u32> = table[..shared].iter().copied().chain([50]).collect();
    let fork = |step_id: u64, copies: Vec<v1::BlockCopy>| v1::Step {
        step_id,
        new_requests: vec![v1::NewRequest {
            id: 2,
            prompt_token_ids: source.tokens.clone(),
            sampling: Some(sampling(8)),
            block_ids: sample_table.clone(),
            num_computed_tokens: point as u32,
            ..Default::default()
        }],
        work: vec![v1::ScheduledWork {
            id: 2,
            key: v1::WorkKey::PromptChunk.into(),
            num_tokens: 1,
            draft_token_ids: Vec::new(),
            loop_index: 0,
        }],
        total_num_tokens: 1,
        block_copies: copies,
        ..Default::default()
    };
    let copy = |src: u32, dst: u32| v1::BlockCopy { id: 2, src, dst };
    for (i, (copies, why)) in [
        (vec![copy(shared as u32, 51)], "which this step does not give the request"),
        (vec![copy(50, 50)], "blocks must be distinct and below 256"),
        (vec![copy(300, 50)], "blocks must be distinct and below 256"),
        (vec![copy(200, 50)], "which no live request holds"),
    ]
    .into_iter()
    .enumerate()
    {
        let result = d.engine.execute(&fork(1 + 2 * i as u64, copies)).unwrap();
        assert_eq!(result.refused.len(), 1, "{why}");
        assert_eq!(result.refused[0].id, 2);
        assert!(result.refused[0].reason.contains(why), "{:?} lacks {why:?}", result.refused[0]);
        // Forgotten, so the next attempt is new again.
        let forget =
            v1::Step { step_id: 2 + 2 * i as u64, finished_ids: vec![2], ..Default::default() };
        d.engine.execute(&forget).unwrap();
    }
    let result = d.engine.execute(&fork(20, vec![copy(shared as u32, 50)])).unwrap();
    assert!(result.refused.is_empty(), "{result:?}");
    let first = result.outputs[0].token_ids.clone();
    assert_eq!(first.len(), 1);

    // Decode the sample on; then the same seed as a request of its own, prompt computed.
    d.step_id = 21;
    d.next_block = 60;
    let mut sample = req(2, text, sampling(8));
    sample.tokens.extend(first);
    sample.computed = len;
    sample.table = sample_table.clone();
    sample.sent = true;
    let mut forked = [sample];
    d.run(&mut forked, 16, 64);
    let mut alone = [req(3, text, sampling(8))];
    d.run(&mut alone, 16, 64);
    assert_eq!(generated(&forked[0]), generated(&alone[0]), "the fork's KV is the prompt's");
}

/// The model's numbers are the true model's: on three chats, the engine's greedy answer (its
/// batched, paged forward on the production kernels) is token for token that of an exact
/// forward of the GGUF (`exact`: weights dequantized by candle, f64 sums, no Ferry kernel), and
/// its first-step log-probabilities of the five likeliest tokens are within 2e-3 of the exact
/// ones with an f32 KV cache; with the default f16 one (keys and values rounded to f16) the
/// answers are the same and the log-probabilities within 1e-2 (the test prints how far each
/// moves them).
#[test]
fn greedy_answers_and_first_logprobs_are_the_exact_forwards() {
    let exact = crate::exact::Model::load(&shared().path, shared().shape);
    let questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "How many legs does a spider have?",
    ];
    let wanted: Vec<_> =
        questions.iter().map(|q| exact.greedy(&tokenizer().encode(&chat(q)).unwrap(), 8)).collect();
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let mut worst = 0f64;
        for (i, (question, (want, first))) in questions.iter().zip(&wanted).enumerate() {
            let model = LoadedModel::load(shared().clone()).expect("the default model's weights");
            let backend =
                CpuBackend::with_dtype(model.weights, dtype, BS as usize, BLOCKS as usize);
            let engine =
                Engine::new(Box::new(backend), EngineConfig::new(tokenizer().eos_token_id));
            let sampling =
                v1::SamplingParams { logprobs: true, top_logprobs: 5, ..Default::default() };
            let mut r = [req(i as u64 + 1, &chat(question), sampling)];
            Driver::new(engine, 0).run(&mut r, 8, 16);
            assert_eq!(
                &generated(&r[0]),
                want,
                "{question:?}, {dtype:?} KV: the engine's answer is not the exact one"
            );
            let step = &r[0].logprobs[0];
            assert_eq!(step.top.len(), 5);
            for t in &step.top {
                let diff = (f64::from(t.logprob) - first[t.token_id as usize]).abs();
                worst = worst.max(diff);
                // f16 keys and values (rounded to 11 bits) move the log-probabilities more
                // than the products' f32 rounding does: measured 3.5e-3 at worst here.
                let bound = if dtype == KvDtype::F32 { 2e-3 } else { 1e-2 };
                assert!(
                    diff < bound,
                    "{question:?}, {dtype:?} KV: token {}: {} vs {}",
                    t.token_id,
                    t.logprob,
                    first[t.token_id as usize]
                );
            }
        }
        eprintln!(
            "{dtype:?} KV cache: first-step log-probabilities within {worst:.1e} of the exact \
             forward's"
        );
    }
}
