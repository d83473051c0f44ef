//! The step loop against a fake executor, in paused time: tokens stream and requests finish,
//! the pipeline never holds more than two steps, and a lost or misbehaving executor fails every
//! request it held (so the front moves them) instead of hanging them.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1;
use ferry_sched_core::{FinishReason, RequestId, Timestamp};
use tokio::sync::mpsc;

use super::fake::{fake_link, raw_link, TokenFn};
use super::{LinkEvent, LinkHandle, Submission};
use crate::metrics::SchedulerMetrics;
use crate::request::{OutputShape, RequestSpec};

pub(crate) fn spec(prompt: &[u32], max_tokens: usize) -> Arc<RequestSpec> {
    Arc::new(RequestSpec {
        prompt: prompt.into(),
        prior_output: Vec::new(),
        max_tokens,
        min_tokens: 0,
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        output: OutputShape::default(),
        priority: 0,
        sampling: v1::SamplingParams::default(),
        traceparent: String::new(),
        model: 0,
        lora: None,
    })
}

/// Adds a request to `link` and returns its event stream.
pub(crate) async fn submit(
    link: &LinkHandle,
    id: u64,
    spec: Arc<RequestSpec>,
) -> mpsc::UnboundedReceiver<LinkEvent> {
    let (events, rx) = mpsc::unbounded_channel();
    let sub = Submission {
        id: RequestId(id),
        spec,
        output: Vec::new(),
        transfer: None,
        fork: ferry_sched_core::Fork::None,
        events,
    };
    link.add(sub).await.expect("the loop runs").expect("the core takes it");
    rx
}

/// Every event until the stream's end (a finish or a failure).
async fn drain(rx: &mut mpsc::UnboundedReceiver<LinkEvent>) -> Vec<LinkEvent> {
    let mut all = Vec::new();
    while let Some(ev) = rx.recv().await {
        let last = matches!(ev, LinkEvent::Finished { .. } | LinkEvent::Failed);
        all.push(ev);
        if last {
            break;
        }
    }
    all
}

fn by_position() -> TokenFn {
    Arc::new(|_, pos| 1000 + pos as u32)
}

#[tokio::test(start_paused = true)]
async fn tokens_stream_to_each_request_until_it_finishes() {
    let metrics = SchedulerMetrics::new();
    let (link, _exec) = fake_link("e", by_position(), metrics.clone());
    let mut a = submit(&link, 1, spec(&[5, 6, 7], 4)).await;
    let mut b = submit(&link, 2, spec(&[9; 10], 2)).await;
    let tokens = |evs: &[LinkEvent]| -> Vec<u32> {
        evs.iter()
            .filter_map(|e| if let LinkEvent::Token(t, _, _) = e { Some(*t) } else { None })
            .collect()
    };
    let a_events = drain(&mut a).await;
    assert_eq!(tokens(&a_events), [1003, 1004, 1005, 1006], "tokens follow the positions");
    assert!(
        matches!(a_events.last(), Some(LinkEvent::Finished { reason: FinishReason::Length, stats }) if stats.output_tokens == 4),
        "{a_events:?}"
    );
    let b_events = drain(&mut b).await;
    assert_eq!(tokens(&b_events), [1010, 1011]);
    assert_eq!(link.load.load(Ordering::Relaxed), 0, "finished requests leave the load");
    assert!(metrics.step_duration.count() > 0, "steps were timed");
    assert!(link.is_alive());
}

#[tokio::test(start_paused = true)]
async fn at_most_two_steps_are_in_flight() {
    let (link, mut steps, results) = raw_link("e", SchedulerMetrics::new());
    let _events = submit(&link, 1, spec(&[1, 2, 3, 4, 5, 6, 7, 8], 8)).await;
    let first = steps.recv().await.expect("step 1");
    assert_eq!(first.new_requests.len(), 1, "the first step introduces the request");
    assert_eq!(first.new_requests[0].prompt_token_ids, [1, 2, 3, 4, 5, 6, 7, 8]);
    let second = steps.recv().await.expect("step 2 is built before step 1's result");
    assert!(second.step_id > first.step_id);
    // No third step until a result comes back (paused time: the timeout elapses at once if
    // nothing can arrive).
    let third = tokio::time::timeout(Duration::from_mins(1), steps.recv()).await;
    assert!(third.is_err(), "a third step went out with two unanswered: {third:?}");
    let answer = |step: &v1::Step, token: Option<u32>| v1::StepResult {
        step_id: step.step_id,
        outputs: token
            .map(|t| v1::RequestOutput { id: 1, token_ids: vec![t], ..Default::default() })
            .into_iter()
            .collect(),
        ..Default::default()
    };
    results.send(Ok(answer(&first, Some(1000)))).await.unwrap();
    let third = tokio::time::timeout(Duration::from_mins(1), steps.recv()).await;
    assert!(third.is_ok_and(|s| s.is_some()), "a result makes room for the next step");
}

#[tokio::test(start_paused = true)]
async fn a_lost_executor_fails_every_request_it_held() {
    let metrics = SchedulerMetrics::new();
    let (gate_tx, gate) = tokio::sync::watch::channel(1);
    let (link, exec) = super::fake::gated_link("e", by_position(), metrics, gate);
    let mut a = submit(&link, 1, spec(&[5, 6, 7], 50)).await;
    let mut b = submit(&link, 2, spec(&[8, 9], 50)).await;
    // One step answered (a's prefill, one token), then the executor dies.
    assert!(matches!(a.recv().await, Some(LinkEvent::Token(1003, _, _))));
    exec.kill();
    drop(gate_tx);
    for rx in [&mut a, &mut b] {
        let rest = drain(rx).await;
        assert!(matches!(rest.last(), Some(LinkEvent::Failed)), "{rest:?}");
    }
    assert_eq!(link.load.load(Ordering::Relaxed), 0);
    // The loop has stopped: the link is dead for good, and says so.
    let (events, _rx) = mpsc::unbounded_channel();
    let again = Submission {
        id: RequestId(3),
        spec: spec(&[1], 1),
        output: Vec::new(),
        transfer: None,
        fork: ferry_sched_core::Fork::None,
        events,
    };
    assert!(link.add(again).await.is_err());
    assert!(!link.is_alive());
}

#[tokio::test(start_paused = true)]
async fn an_idle_link_notices_its_executor_died() {
    let (link, exec) = fake_link("e", by_position(), SchedulerMetrics::new());
    let mut a = submit(&link, 1, spec(&[5, 6, 7], 2)).await;
    drain(&mut a).await;
    assert!(link.is_alive());
    exec.kill();
    let deadline = tokio::time::Instant::now() + Duration::from_mins(1);
    while link.is_alive() {
        assert!(tokio::time::Instant::now() < deadline, "the dead executor went unnoticed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_result_for_a_step_never_sent_ends_the_session() {
    let (link, mut steps, results) = raw_link("e", SchedulerMetrics::new());
    let mut a = submit(&link, 1, spec(&[1, 2], 4)).await;
    let step = steps.recv().await.unwrap();
    let bogus = v1::StepResult { step_id: step.step_id + 100, ..Default::default() };
    results.send(Ok(bogus)).await.unwrap();
    assert!(matches!(drain(&mut a).await.last(), Some(LinkEvent::Failed)));
}

#[tokio::test(start_paused = true)]
async fn closing_a_link_fails_its_requests_and_aborting_finishes_one() {
    let (gate_tx, gate) = tokio::sync::watch::channel(0);
    let (link, _exec) = super::fake::gated_link("e", by_position(), SchedulerMetrics::new(), gate);
    let mut a = submit(&link, 1, spec(&[1, 2], 4)).await;
    let mut b = submit(&link, 2, spec(&[3, 4], 4)).await;
    link.abort(RequestId(1)).await;
    let aborted = drain(&mut a).await;
    assert!(
        matches!(aborted.last(), Some(LinkEvent::Finished { reason: FinishReason::Abort, .. })),
        "{aborted:?}"
    );
    link.close("the test closes it");
    assert!(matches!(drain(&mut b).await.last(), Some(LinkEvent::Failed)));
    drop(gate_tx);
}

#[test]
fn each_adapter_has_its_own_prefix_cache_salt() {
    let with = |name: &str, path: &str| {
        let mut s = (*spec(&[1, 2, 3], 4)).clone();
        s.lora = Some(v1::LoraAdapterRef { name: name.into(), path: path.into() });
        s
    };
    let salt = |s: &RequestSpec| {
        let req = super::core_request(s, RequestId(7), Vec::new(), &[2], None, Timestamp(0));
        req.cache_salt
    };
    let base = salt(&spec(&[1, 2, 3], 4));
    let (x, y, x2) = (salt(&with("x", "a")), salt(&with("y", "a")), salt(&with("x", "b")));
    assert_eq!(base, 0, "the base model's requests share one cache");
    assert!([x, y, x2].iter().all(|s| *s != 0 && *s >> 63 == 0), "{x} {y} {x2}");
    assert!(x != y && x != x2 && y != x2, "a name or a path apart: caches apart");
    assert_eq!(x, salt(&with("x", "a")), "the same adapter, the same cache");
}
