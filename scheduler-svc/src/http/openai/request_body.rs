//! The request bodies of `/v1/completions` and `/v1/chat/completions`, as serde reads them:
//! the typed form of a body whose fields [`crate::http::fields`] has already accepted (unknown
//! fields are ignored here). Only data: what each field means is read in the files that use it.
//!
//! The untagged enums' names (`OneOrMany`, `PromptInput`, `Content`) appear in serde's
//! messages, which [`super::validate`] rewords by name: rename one there too.

use serde::Deserialize;
use serde_json::Value;

/// `stop`: one string or a list of them.
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// `prompt`: a text, a list of texts (one is served), or token ids.
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

/// A message's `content`: a text, or a list of content parts (text parts are served).
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of a message's `content` (`{"type": "text", "text": …}`).
#[derive(Deserialize)]
pub(super) struct ContentPart {
    #[serde(rename = "type")]
    pub(super) kind: String,
    #[serde(default)]
    pub(super) text: String,
}

/// One of a chat's `messages`.
#[derive(Deserialize)]
pub(super) struct ChatMessage {
    pub(super) role: String,
    pub(super) content: Option<Content>,
    pub(super) name: Option<String>,
    pub(super) tool_calls: Option<Vec<Value>>,
    pub(super) tool_call_id: Option<String>,
}

/// `stream_options`: what a streamed answer carries besides its chunks.
#[derive(Deserialize, Default)]
pub(super) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: bool,
    #[serde(default)]
    pub(super) continuous_usage_stats: bool,
}

/// Parameters both endpoints take ([`crate::http::fields`] has already refused what they cannot
/// serve; unknown fields are ignored here).
#[derive(Deserialize, Default)]
pub(super) struct Common {
    pub(super) model: Option<String>,
    pub(super) max_tokens: Option<u32>,
    pub(super) max_completion_tokens: Option<u32>,
    pub(super) temperature: Option<f32>,
    pub(super) top_p: Option<f32>,
    pub(super) top_k: Option<i64>,
    pub(super) min_p: Option<f32>,
    pub(super) seed: Option<u64>,
    pub(super) stop: Option<OneOrMany>,
    pub(super) stop_token_ids: Option<Vec<u32>>,
    pub(super) presence_penalty: Option<f32>,
    pub(super) frequency_penalty: Option<f32>,
    pub(super) repetition_penalty: Option<f32>,
    pub(super) n: Option<u32>,
    pub(super) ignore_eos: Option<bool>,
    pub(super) min_tokens: Option<u32>,
    pub(super) include_stop_str_in_output: Option<bool>,
    pub(super) priority: Option<i32>,
    #[serde(default)]
    pub(super) stream: bool,
    pub(super) stream_options: Option<StreamOptions>,
    pub(super) response_format: Option<Value>,
    pub(super) structured_outputs: Option<Value>,
    pub(super) guided_json: Option<Value>,
    pub(super) guided_regex: Option<String>,
    pub(super) guided_choice: Option<Vec<String>>,
    pub(super) guided_grammar: Option<String>,
    pub(super) guided_whitespace_pattern: Option<String>,
    pub(super) echo: Option<bool>,
    pub(super) logit_bias: Option<serde_json::Map<String, Value>>,
    pub(super) allowed_token_ids: Option<Vec<u32>>,
    pub(super) skip_special_tokens: Option<bool>,
    pub(super) truncate_prompt_tokens: Option<i64>,
    pub(super) bad_words: Option<Vec<String>>,
    pub(super) prompt_logprobs: Option<u32>,
    /// A looped model's most recurrent loops per token (a Ferry extension, as vLLM's).
    pub(super) max_loops: Option<u32>,
    /// A looped model's exit threshold, in (0, 1] (a Ferry extension, as vLLM's).
    pub(super) exit_threshold: Option<f32>,
}

/// A `/v1/completions` body.
#[derive(Deserialize)]
pub(super) struct CompletionBody {
    #[serde(flatten)]
    pub(super) common: Common,
    pub(super) prompt: PromptInput,
    pub(super) logprobs: Option<u32>,
    pub(super) best_of: Option<u32>,
}

/// A `/v1/chat/completions` body.
#[derive(Deserialize)]
pub(super) struct ChatBody {
    #[serde(flatten)]
    pub(super) common: Common,
    pub(super) messages: Vec<ChatMessage>,
    pub(super) logprobs: Option<bool>,
    pub(super) top_logprobs: Option<u32>,
    pub(super) add_generation_prompt: Option<bool>,
    pub(super) continue_final_message: Option<bool>,
    pub(super) chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    pub(super) tools: Option<Vec<Value>>,
    pub(super) tool_choice: Option<Value>,
    pub(super) parallel_tool_calls: Option<bool>,
}
