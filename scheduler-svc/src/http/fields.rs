//! Which request fields the OpenAI API serves, which it refuses, and which it has never heard
//! of. A field OpenAI or vLLM define but Ferry does not implement is refused with a 400 naming
//! it whenever it is set to anything that would change the answer: a client that asked for
//! JSON or for tool calls must not get prose with a 200. A field set to its no-op value
//! (`"echo": false`, `"best_of": 1`, an empty `tools` list) is accepted. A field nobody defines
//! is accepted, as vLLM does (clients send many), and logged once per name.

use std::collections::BTreeSet;
use std::sync::Mutex;

use serde_json::{Map, Value};

use super::ApiError;

/// Which endpoint a body is for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// Fields both endpoints serve.
const SERVED: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "n",
    "ignore_eos",
    "min_tokens",
    "include_stop_str_in_output",
    "priority",
    "stream",
    "stream_options",
    "logprobs",
    // Structured outputs (OpenAI's, then vLLM's), parsed and checked in `openai`.
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    // Which engine computes the masks: Ferry has one (llguidance), and any engine gives the
    // same constraint, so the choice changes nothing in the answer.
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "echo",
    "logit_bias",
    "allowed_token_ids",
    "skip_special_tokens",
    "truncate_prompt_tokens",
    "bad_words",
    "prompt_logprobs",
    // A looped model's loops and exit threshold (Ferry's extensions, named as vLLM names its).
    "max_loops",
    "exit_threshold",
    // OpenAI's end-user id, for the provider's abuse monitoring: nothing to compute.
    "user",
];

/// Fields only `/v1/completions` serves (`best_of` is OpenAI's legacy completions' alone).
const SERVED_COMPLETIONS: &[&str] = &["prompt", "best_of"];

/// Fields only `/v1/chat/completions` serves.
const SERVED_CHAT: &[&str] = &[
    "messages",
    "top_logprobs",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];

/// Whether `value` of the defined-but-unimplemented `field` leaves the answer as if the field
/// were absent; `None` when Ferry does not know the field at all.
fn inert(field: &str, value: &Value) -> Option<bool> {
    let empty = || match value {
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    };
    Some(match field {
        // Tool calling, token masks, prompt rendering: set to anything but an empty value,
        // the answer would differ.
        "functions" | "suffix" | "chat_template" => empty(),
        "function_call" => value == "none" || value == "auto",
        // Output shaping.
        "best_of" => value == 1,
        "spaces_between_special_tokens" => value == true,
        _ => return None,
    })
}

/// Why a defined field cannot be served (the 400's message).
fn refusal(field: &str, value: &Value) -> String {
    let what = match field {
        "functions" | "function_call" => "OpenAI's deprecated functions (use tools)",
        "chat_template" => {
            "a request's own chat template (the model's is used; vLLM too refuses one unless \
             started with --trust-request-chat-template)"
        }
        _ => "this field",
    };
    // The value as sent, cut short: a tools list can be long.
    let mut shown = value.to_string();
    if let Some((cut, _)) = shown.char_indices().nth(80) {
        shown.truncate(cut);
        shown.push('…');
    }
    format!("{field} = {shown} is not supported: Ferry does not implement {what} yet")
}

/// Checks a request body's fields: `Err` (a 400 naming the field) for a defined field Ferry
/// cannot serve as asked; unknown fields are logged, once per name per process.
pub fn check(body: &Map<String, Value>, endpoint: Endpoint) -> Result<(), ApiError> {
    for (field, value) in body {
        if value.is_null() || SERVED.contains(&field.as_str()) {
            continue;
        }
        let own = match endpoint {
            Endpoint::Completions => SERVED_COMPLETIONS,
            Endpoint::Chat => SERVED_CHAT,
        };
        if own.contains(&field.as_str()) {
            continue;
        }
        match inert(field, value) {
            Some(true) => {}
            Some(false) => return Err(ApiError::bad_request(refusal(field, value))),
            None => unknown(field),
        }
    }
    if endpoint == Endpoint::Chat {
        check_messages(body.get("messages"))?;
        let top = body.get("top_logprobs").filter(|v| !v.is_null());
        let logprobs = body.get("logprobs").is_some_and(|v| v == true);
        if let Some(top) = top.filter(|_| !logprobs) {
            return Err(ApiError::bad_request(format!(
                "top_logprobs = {top} needs logprobs = true"
            )));
        }
    }
    Ok(())
}

/// Message fields of OpenAI's deprecated function calling, which Ferry does not serve (tool
/// calls and "tool" messages it does).
fn check_messages(messages: Option<&Value>) -> Result<(), ApiError> {
    let Some(messages) = messages.and_then(Value::as_array) else { return Ok(()) };
    for (i, m) in messages.iter().enumerate() {
        let Some(m) = m.as_object() else { continue };
        if m.get("role").and_then(Value::as_str) == Some("function") {
            return Err(ApiError::bad_request(format!(
                "messages[{i}].role = \"function\" is not supported: it is OpenAI's deprecated \
                 function calling; use tools and \"tool\" messages"
            )));
        }
        if m.get("function_call").is_some_and(|v| !v.is_null()) {
            return Err(ApiError::bad_request(format!(
                "messages[{i}].function_call is not supported: it is OpenAI's deprecated \
                 function calling; use tool_calls"
            )));
        }
    }
    Ok(())
}

/// Most distinct unknown field names remembered (and so logged): a client cannot grow the set
/// without bound.
const MAX_UNKNOWN: usize = 256;

/// Logs an unknown field's name the first time it is seen.
fn unknown(field: &str) {
    static SEEN: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    let mut seen = SEEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if seen.len() >= MAX_UNKNOWN || seen.contains(field) {
        return;
    }
    seen.insert(field.to_string());
    let last = seen.len() == MAX_UNKNOWN;
    drop(seen);
    let field: String = field.chars().take(64).collect();
    tracing::info!(
        field,
        "request field unknown to Ferry accepted and ignored (logged once per name{})",
        if last { "; no further names will be logged" } else { "" }
    );
}

#[cfg(test)]
mod tests {
    use super::{check, Endpoint};
    use serde_json::json;

    fn verdict(body: &serde_json::Value, endpoint: Endpoint) -> Result<(), String> {
        check(body.as_object().unwrap(), endpoint).map_err(|e| e.message().to_string())
    }

    #[test]
    fn a_field_that_would_change_the_answer_is_refused_by_name() {
        let chat = Endpoint::Chat;
        let refused = [
            json!({"functions": [{"name": "f"}]}),
            json!({"function_call": {"name": "f"}}),
            json!({"suffix": "end"}),
            json!({"best_of": 2}),
            json!({"chat_template": "{{ messages }}"}),
            json!({"spaces_between_special_tokens": false}),
        ];
        for body in refused {
            let field = body.as_object().unwrap().keys().next().unwrap().clone();
            let err = verdict(&body, chat).expect_err(&body.to_string());
            assert!(err.starts_with(&format!("{field} = ")), "{err}");
        }
        let err = verdict(&json!({"top_logprobs": 3}), chat).unwrap_err();
        assert!(err.contains("top_logprobs = 3 needs logprobs = true"), "{err}");
        for (message, field) in [
            (json!({"role": "function", "content": "42"}), "messages[0].role"),
            (
                json!({"role": "assistant", "function_call": {"name": "f"}}),
                "messages[0].function_call",
            ),
        ] {
            let err = verdict(&json!({"messages": [message]}), chat).unwrap_err();
            assert!(err.starts_with(field), "{err}");
        }
    }

    #[test]
    fn no_op_values_and_unknown_fields_are_accepted() {
        let accepted = json!({
            "tools": [], "tool_choice": "none", "parallel_tool_calls": true,
            "response_format": {"type": "text"}, "logit_bias": {}, "echo": false, "suffix": "",
            "best_of": 1, "skip_special_tokens": true, "continue_final_message": false,
            "guided_json": null, "prompt_logprobs": null, "user": "u-1",
            "stream_options": {"include_usage": true, "continuous_usage_stats": false},
            "logprobs": true, "top_logprobs": 2, "add_generation_prompt": false,
            "messages": [{"role": "user", "content": "hi", "name": ""}],
            "some_future_field": {"x": 1}, "metadata": {"team": "a"},
        });
        assert_eq!(verdict(&accepted, Endpoint::Chat), Ok(()));
        // A chat-only field is unknown to /v1/completions, and so accepted there too.
        assert_eq!(verdict(&json!({"prompt": "x", "messages": 3}), Endpoint::Completions), Ok(()));
    }
}
