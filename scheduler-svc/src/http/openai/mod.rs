//! OpenAI request and response bodies, and their translation to and from the front's
//! `Generate`. Field names, defaults and value checks follow OpenAI's API and vLLM's extensions
//! (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
//! structured outputs); fields Ferry does not implement are refused by name
//! ([`super::fields`]).
//!
//! One concern per file, and imports run one way (each file names only those listed after it):
//! - [`adapters`]: the served models and the LoRA adapters' load and unload endpoints;
//! - [`handlers`]: the endpoints: read a body, build the request, call the front, answer;
//! - [`sse`]: the streamed answer's event body;
//! - [`response_body`]: front events → OpenAI's JSON (chunks, whole answers, usage);
//! - [`translate`]: a body's sampling and stopping fields → the front's `GenerateRequest`;
//! - [`tool_calls`]: what `tools`/`tool_choice` ask for, and the calls read out of an answer;
//! - [`structured_output`]: `response_format`, `structured_outputs`, `guided_*` → one grammar;
//! - [`validate`]: a body read as JSON, its fields checked, typed, and its values checked;
//! - [`ids`]: response and tool-call ids, and the `created` time;
//! - [`request_body`]: the request bodies as serde reads them.

mod adapters;
mod handlers;
mod ids;
mod request_body;
mod response_body;
mod sse;
mod structured_output;
mod tool_calls;
mod translate;
mod validate;

#[cfg(test)]
mod tests;

pub(super) use adapters::{load_lora_adapter, models, unload_lora_adapter};
pub(super) use handlers::{chat_completions, completions};
