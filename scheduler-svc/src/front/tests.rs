//! The front over fake executors, in paused time: a stream whose executor is lost moves to
//! another with the tokens it delivered and goes on exactly; a stop string split across tokens
//! is held back until it matches, and the stop reports the request's cached prompt tokens.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ferry_model::ModelFile;
use ferry_proto::v1::{self, generation_server::Generation};
use tokio_stream::StreamExt;
use tonic::Request;

use super::models::Models;
use super::FrontSettings;
use super::{GenerationService, Route};
use crate::executors::ExecutorSet;
use crate::link::fake::{fake_link, gated_link, FakeExecutor, TokenFn};
use crate::link::LinkHandle;

fn model() -> Arc<ModelFile> {
    static MODEL: OnceLock<Arc<ModelFile>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let mut model = ModelFile::open(None).expect("the default model");
            // The fake executors run it.
            model.fingerprint = crate::link::fake::FAKE_FINGERPRINT.into();
            Arc::new(model)
        })
        .clone()
}

pub(crate) fn front(set: &Arc<ExecutorSet>) -> GenerationService {
    let settings = FrontSettings {
        max_live: 16,
        failover_wait: Duration::from_secs(5),
        disaggregation_min_tokens: None,
        kv_transfer_timeout: Duration::from_secs(5),
        kv_tier_min_tokens: None,
        route_load_tokens: ferry_sched_core::routing::LOAD_TOKENS,
        keys: None,
        limits: super::RequestLimits::default(),
        max_model_len: None,
        accepts_priority: false,
        lora: super::LoraSettings { max_rank: 16, ..Default::default() },
    };
    let served = Models::one(model(), 512, &settings.lora).expect("no adapters");
    GenerationService::new(served, Route::Local(set.clone()), settings)
}

fn request(prompt: &[u32], max_tokens: u32, stop: &[&str]) -> v1::GenerateRequest {
    v1::GenerateRequest {
        input: Some(v1::generate_request::Input::PromptTokenIds(v1::TokenIds {
            ids: prompt.to_vec(),
        })),
        stopping: Some(v1::StoppingCriteria {
            max_tokens,
            ignore_eos: true,
            stop: stop.iter().map(|s| (*s).to_string()).collect(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Every event of a stream until it ends.
async fn events(svc: &GenerationService, req: v1::GenerateRequest) -> Vec<v1::GenerateEvent> {
    let mut stream = svc.generate(Request::new(req)).await.expect("admitted").into_inner();
    let mut all = Vec::new();
    while let Some(ev) = stream.next().await {
        all.push(ev.expect("no error status"));
    }
    all
}

fn links(
    set: &Arc<ExecutorSet>,
    names: &[&str],
    token: &TokenFn,
) -> Vec<(LinkHandle, FakeExecutor)> {
    names
        .iter()
        .map(|n| {
            let (link, exec) = fake_link(n, token.clone(), set.metrics.clone());
            set.insert(link.clone());
            (link, exec)
        })
        .collect()
}

/// Executor A (placed first), which answers `steps` steps and then waits on `gate_tx`, and a
/// healthy B, both answering 100 + position, behind a front.
struct TwoExecutors {
    set: Arc<ExecutorSet>,
    a_exec: FakeExecutor,
    b_exec: FakeExecutor,
    gate_tx: tokio::sync::watch::Sender<u64>,
    svc: GenerationService,
}

fn a_then_b(steps: u64) -> TwoExecutors {
    let set = ExecutorSet::new();
    let by_position: TokenFn = Arc::new(|_, pos| 100 + pos as u32);
    let (gate_tx, gate) = tokio::sync::watch::channel(steps);
    let (a, a_exec) = gated_link("a", by_position.clone(), set.metrics.clone(), gate);
    set.insert(a);
    let (_, b_exec) = links(&set, &["b"], &by_position).pop().expect("one link");
    let svc = front(&set);
    TwoExecutors { set, a_exec, b_exec, gate_tx, svc }
}

#[tokio::test(start_paused = true)]
async fn a_stream_whose_executor_is_lost_moves_with_its_tokens_and_goes_on_exactly() {
    // Executor A answers three steps and then dies; B is healthy.
    let TwoExecutors { set, a_exec, b_exec: _b, gate_tx, svc } = a_then_b(3);
    let mut stream =
        svc.generate(Request::new(request(&[10, 11, 12, 13], 10, &[]))).await.unwrap().into_inner();
    let mut tokens = Vec::new();
    while tokens.len() < 3 {
        let ev = stream.next().await.unwrap().unwrap();
        tokens.extend(ev.token_ids);
    }
    assert_eq!(tokens, [104, 105, 106], "A ran the first three");
    a_exec.kill();
    drop(gate_tx);
    let mut last = None;
    while let Some(ev) = stream.next().await {
        let ev = ev.unwrap();
        tokens.extend(&ev.token_ids);
        last = Some(ev);
    }
    let expected: Vec<u32> = (104..114).collect();
    assert_eq!(tokens, expected, "each token once, in order, as an undisturbed run");
    let last = last.unwrap();
    assert_eq!(last.finish_reason(), v1::FinishReason::Length, "{last:?}");
    let usage = last.usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (4, 10));
    assert_eq!(set.metrics.requests_moved.get(), 1, "the stream moved once");
}

#[tokio::test(start_paused = true)]
async fn a_request_without_a_seed_gets_one_that_moves_with_it() {
    // The executors' draws are keyed by (seed, position): a moved request continues exactly
    // only if it arrives at the next executor with the seed it had at the first.
    let TwoExecutors { set, a_exec, b_exec, gate_tx, svc } = a_then_b(2);
    let mut req = request(&[10, 11, 12, 13], 6, &[]);
    req.sampling = Some(v1::SamplingParams { temperature: 0.8, top_p: 1.0, ..Default::default() });
    let mut stream = svc.generate(Request::new(req)).await.unwrap().into_inner();
    let mut tokens = Vec::new();
    while tokens.len() < 2 {
        tokens.extend(stream.next().await.unwrap().unwrap().token_ids);
    }
    a_exec.kill();
    drop(gate_tx);
    while let Some(ev) = stream.next().await {
        tokens.extend(ev.unwrap().token_ids);
    }
    assert_eq!(tokens.len(), 6);
    assert_eq!(set.metrics.requests_moved.get(), 1, "the stream moved once");
    let (first, then) = (a_exec.seeds(), b_exec.seeds());
    assert!(matches!(first[..], [Some(_)]), "A was given the request with a seed: {first:?}");
    assert_eq!(then, first, "B was given it with the same seed");
}

#[tokio::test(start_paused = true)]
async fn a_request_the_executor_refuses_fails_alone_and_is_not_moved() {
    let set = ExecutorSet::new();
    let by_position: TokenFn = Arc::new(|_, pos| 100 + pos as u32);
    let _links = links(&set, &["a", "b"], &by_position);
    let svc = front(&set);
    let refused = request(&[10, crate::link::fake::FAKE_REFUSED_TOKEN, 12], 10, &[]);
    let (bad, good) =
        tokio::join!(events(&svc, refused), events(&svc, request(&[10, 11, 12, 13], 10, &[])));
    let last = bad.last().unwrap();
    assert_eq!(last.finish_reason(), v1::FinishReason::Error, "{last:?}");
    assert!(
        last.error.contains("the executor refused this request")
            && last.error.contains("is refused here"),
        "{}",
        last.error
    );
    assert!(bad.iter().all(|e| e.token_ids.is_empty()), "it generated nothing");
    let tokens: Vec<u32> = good.iter().flat_map(|e| e.token_ids.clone()).collect();
    assert_eq!(tokens, (104..114).collect::<Vec<u32>>(), "the other ran as if alone");
    assert_eq!(good.last().unwrap().finish_reason(), v1::FinishReason::Length);
    assert_eq!(set.metrics.requests_refused.get(), 1);
    assert_eq!(set.metrics.requests_moved.get(), 0, "a refused request is not moved");
    assert_eq!(set.metrics.sessions_opened.get(), 0, "no session was reopened");
    for link in set.alive() {
        assert_eq!(link.load.load(std::sync::atomic::Ordering::Relaxed), 0);
    }
    assert_eq!(set.alive().len(), 2, "both sessions live on");
}

#[tokio::test(start_paused = true)]
async fn a_stop_string_split_across_tokens_is_held_back_and_reports_cached_tokens() {
    let tok = &model().tokenizer;
    let hello = tok.encode(" Hello").unwrap();
    let world = tok.encode(" world").unwrap();
    assert_eq!((hello.len(), world.len()), (1, 1), "each is one token");
    let prompt: Vec<u32> = (300..316).collect();
    let (p, h, w) = (prompt.len(), hello[0], world[0]);
    // The output spells " Hello world world …".
    let script: TokenFn = Arc::new(move |_, pos| if pos == p { h } else { w });
    let set = ExecutorSet::new();
    let _links = links(&set, &["e"], &script);
    let svc = front(&set);
    // A first request fills the prefix cache with the prompt's blocks.
    let first = events(&svc, request(&prompt, 2, &[])).await;
    assert_eq!(first.last().unwrap().finish_reason(), v1::FinishReason::Length);
    // "o w" spans the two tokens: after " Hello" only " Hel" may be sent.
    let evs = events(&svc, request(&prompt, 20, &["o w"])).await;
    let texts: Vec<&str> = evs.iter().map(|e| e.text.as_str()).collect();
    assert_eq!(texts, [" Hel", "l"], "the text that could begin the stop string was held back");
    let last = evs.last().unwrap();
    assert_eq!(last.finish_reason(), v1::FinishReason::Stop);
    assert_eq!(last.stop_reason, "o w");
    let usage = last.usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (16, 2));
    assert_eq!(usage.cached_prompt_tokens, 12, "the scheduler's account of the cached prefix");
    // The stop aborted the request where it ran: nothing is left on the executor.
    for link in set.alive() {
        assert_eq!(link.load.load(std::sync::atomic::Ordering::Relaxed), 0);
    }
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_aborts_its_request_and_is_counted() {
    let set = ExecutorSet::new();
    let (gate_tx, gate) = tokio::sync::watch::channel(1);
    let (link, _exec) = gated_link("e", Arc::new(|_, p| 100 + p as u32), set.metrics.clone(), gate);
    set.insert(link.clone());
    let svc = front(&set);
    let mut stream =
        svc.generate(Request::new(request(&[1, 2, 3, 4], 50, &[]))).await.unwrap().into_inner();
    assert_eq!(stream.next().await.unwrap().unwrap().token_ids, [104]);
    drop(stream);
    let deadline = tokio::time::Instant::now() + Duration::from_mins(1);
    while link.load.load(std::sync::atomic::Ordering::Relaxed) > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the request was never aborted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(set.metrics.finished_count(crate::metrics::FinishLabel::Abort), 1);
    drop(gate_tx);
}

#[tokio::test(start_paused = true)]
async fn token_ids_from_a_front_of_another_model_are_refused() {
    let set = ExecutorSet::new();
    let token: TokenFn = Arc::new(|_, p| 100 + p as u32);
    let _links = links(&set, &["e"], &token);
    let svc = front(&set);
    let mut other = request(&[1, 2, 3], 2, &[]);
    other.model_fingerprint = "0123456789abcdef".into();
    let refused = svc.generate(Request::new(other)).await.expect_err("refused");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(refused.message().contains("0123456789abcdef"), "{}", refused.message());
    let mut same = request(&[1, 2, 3], 2, &[]);
    same.model_fingerprint = model().fingerprint.clone();
    let evs = events(&svc, same).await;
    assert_eq!(evs.last().unwrap().finish_reason(), v1::FinishReason::Length);
}
