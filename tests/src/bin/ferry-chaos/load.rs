//! The load: the fixed request set every request is drawn from, and a stream's run, recording
//! what it delivered and when each token arrived (the summary compares it with the undisturbed
//! run and measures its stalls).

use std::time::Instant;

use ferry_bench::loadgen::Rng;
use ferry_proto::v1::{self, generation_client::GenerationClient};

/// A request sent: its index in the request set, and its stream's task.
pub(crate) type Running = (usize, tokio::task::JoinHandle<Stream>);

/// What one stream delivered.
#[derive(Default)]
pub(crate) struct Stream {
    pub(crate) tokens: Vec<u32>,
    pub(crate) text: String,
    pub(crate) finish: i32,
    pub(crate) error: String,
    /// When the request was sent, and when each event with tokens arrived.
    pub(crate) sent: Option<Instant>,
    pub(crate) arrived: Vec<Instant>,
}

pub(crate) async fn run_one(url: String, req: v1::GenerateRequest) -> Stream {
    run_watched(url, req, None).await
}

/// [`run_one`], telling `first` when the first token arrives.
pub(crate) async fn run_watched(
    url: String,
    req: v1::GenerateRequest,
    mut first: Option<tokio::sync::oneshot::Sender<()>>,
) -> Stream {
    let mut out = Stream { sent: Some(Instant::now()), ..Stream::default() };
    let stream = async {
        let mut client = GenerationClient::connect(url).await?;
        let mut stream = client.generate(req).await?.into_inner();
        while let Some(ev) = stream.message().await? {
            if !ev.token_ids.is_empty() {
                out.arrived.push(Instant::now());
                if let Some(tx) = first.take() {
                    let _ = tx.send(());
                }
            }
            out.tokens.extend(&ev.token_ids);
            out.text.push_str(&ev.text);
            if ev.finish_reason != 0 {
                out.finish = ev.finish_reason;
                out.error.clone_from(&ev.error);
            }
        }
        anyhow::Ok(())
    };
    if let Err(e) = stream.await {
        out.error = format!("stream broke: {e}");
    }
    out
}

/// The request set: prompts sharing some prefixes, greedy and seeded, 16 to 48 tokens.
pub(crate) fn request_set(n: usize, rng: &mut Rng) -> Vec<v1::GenerateRequest> {
    let towns = ["Amber", "Birch", "Cedar", "Dune", "Elm", "Fern"];
    (0..n)
        .map(|i| {
            let sampling = if i % 2 == 0 {
                v1::SamplingParams { temperature: 0.0, ..Default::default() }
            } else {
                v1::SamplingParams {
                    temperature: 0.8,
                    seed: Some(7000 + i as u64),
                    ..Default::default()
                }
            };
            let max_tokens = 16 + rng.below(33) as u32;
            v1::GenerateRequest {
                input: Some(v1::generate_request::Input::Prompt(format!(
                    "Story {i}: once upon a time, in a town called {}, there lived",
                    towns[i % towns.len()]
                ))),
                sampling: Some(sampling),
                stopping: Some(v1::StoppingCriteria {
                    max_tokens,
                    ignore_eos: true,
                    ..Default::default()
                }),
                ..Default::default()
            }
        })
        .collect()
}
