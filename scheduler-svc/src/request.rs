//! One request as the front accepted it: checked, tokenized, with its limits, stop rules and
//! sampling parameters. It is built once (`front::prepare`) and then shared, never copied: the
//! front's stream holds it to move the request after a failure, the executor link holds it to
//! send sampling parameters with the request's first step, and the scheduling core gets its
//! prompt as the same `Arc`.
//!
//! What changes while a request streams — the tokens delivered so far — is not here: it lives
//! in the front's stream ([`crate::front::stream`]), and travels with each (re)placement.

use std::sync::Arc;

use ferry_proto::v1;

/// What a client asked for, checked.
#[derive(Debug, Clone, Default)]
pub struct RequestSpec {
    /// Prompt tokens (non-empty, shorter than the served model length).
    pub prompt: Arc<[u32]>,
    /// Tokens generated before this request reached the front (a continuation from another
    /// front or a client); they count toward `max_tokens`.
    pub prior_output: Vec<u32>,
    /// Most tokens to generate, `prior_output` included.
    pub max_tokens: usize,
    /// Fewest tokens before EOS or a stop token may end it.
    pub min_tokens: usize,
    /// Token ids that end it (besides the model's EOS, unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Keep going past EOS.
    pub ignore_eos: bool,
    /// What the front does with its text and events.
    pub output: OutputShape,
    /// Lower runs first.
    pub priority: i32,
    /// How the executor samples.
    pub sampling: v1::SamplingParams,
    /// The W3C trace context of its `request` span, for the executors' spans (empty when
    /// untraced).
    pub traceparent: String,
    /// The base model it is for: its place among the front's models
    /// ([`crate::front::models::Models`]; 0, the default, when it named none).
    pub model: usize,
    /// The LoRA adapter it runs with (its `model` named one); `None`: the base model.
    pub lora: Option<v1::LoraAdapterRef>,
}

/// How the front turns a request's tokens into what its client sees.
#[derive(Debug, Clone, Default)]
pub struct OutputShape {
    /// Strings that end it; the front matches them in the detokenized text.
    pub stop: Vec<String>,
    /// Return the matched stop string at the end of the text.
    pub include_stop_str: bool,
    /// Put control tokens' text in the output (all but the one that ends it, unless
    /// `include_stop_str`).
    pub keep_special_tokens: bool,
    /// Send the usage so far with every event.
    pub continuous_usage: bool,
}

impl RequestSpec {
    /// The request for another scheduler (a front in its own process sends its requests to the
    /// leader this way), with `delivered` the tokens already generated, tokenized for the model
    /// with `fingerprint` (the scheduler refuses it if it serves another) and naming its
    /// adapter, if any (which the scheduler must serve under the same name). Stop strings stay
    /// with the front, which applies them.
    pub fn to_remote(&self, delivered: &[u32], fingerprint: &str) -> v1::GenerateRequest {
        v1::GenerateRequest {
            input: Some(v1::generate_request::Input::PromptTokenIds(v1::TokenIds {
                ids: self.prompt.to_vec(),
            })),
            output_token_ids: delivered.to_vec(),
            sampling: Some(self.sampling.clone()),
            stopping: Some(v1::StoppingCriteria {
                max_tokens: u32::try_from(self.max_tokens).unwrap_or(u32::MAX),
                min_tokens: u32::try_from(self.min_tokens).unwrap_or(u32::MAX),
                stop_token_ids: self.stop_token_ids.clone(),
                ignore_eos: self.ignore_eos,
                ..Default::default()
            }),
            priority: self.priority,
            model: self.lora.as_ref().map(|a| a.name.clone()).unwrap_or_default(),
            model_fingerprint: fingerprint.to_string(),
            ..Default::default()
        }
    }
}
