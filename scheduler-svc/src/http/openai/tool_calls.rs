//! Tool calling on `/v1/chat/completions`: what a request's `tools` and `tool_choice` ask for
//! ([`ToolUse`], checked as OpenAI and vLLM check them), and the calls read out of the answer
//! as its text arrives ([`ToolReader`], one per choice), with the finish reason OpenAI gives an
//! answer that made calls.

use serde_json::{json, Value};

use super::ids::rand_id;
use super::request_body::ChatBody;
use crate::http::ApiError;

/// How a chat request uses its tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum ToolUse {
    /// The model may answer with calls (`tool_choice: "auto"`, the default with tools).
    Auto,
    /// The model must call at least one tool (`"required"`).
    Required,
    /// The model must call this function.
    Named(String),
}

/// What `tools` and `tool_choice` ask for: `None` when no calls are read (no tools, or
/// `tool_choice: "none"`, where the tools are still shown to the model, as vLLM does).
pub(super) fn tool_use(body: &ChatBody) -> Result<Option<ToolUse>, ApiError> {
    let tools = body.tools.as_deref().unwrap_or_default();
    ferry_model::chat::check_tools(tools).map_err(ApiError::bad_request)?;
    let choice = match body.tool_choice.as_ref().filter(|v| !v.is_null()) {
        None if tools.is_empty() => return Ok(None),
        None => ToolUse::Auto,
        Some(Value::String(s)) if s == "none" => return Ok(None),
        Some(Value::String(s)) if s == "auto" => ToolUse::Auto,
        Some(Value::String(s)) if s == "required" => ToolUse::Required,
        Some(v) => {
            let named = (v.get("type").and_then(Value::as_str) == Some("function"))
                .then(|| v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str))
                .flatten();
            match named {
                Some(name) => ToolUse::Named(name.to_string()),
                None => {
                    return Err(ApiError::bad_request(format!(
                        "tool_choice = {v} is not valid: use \"none\", \"auto\", \"required\" or \
                         {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"
                    )))
                }
            }
        }
    };
    if tools.is_empty() {
        if choice == ToolUse::Auto {
            return Ok(None);
        }
        return Err(ApiError::bad_request("When using `tool_choice`, `tools` must be set."));
    }
    if let ToolUse::Named(name) = &choice {
        if !tools.iter().any(|t| t["function"]["name"] == name.as_str()) {
            return Err(ApiError::bad_request(format!(
                "tool_choice names the function {name:?}, which is not in tools"
            )));
        }
    }
    Ok(Some(choice))
}

/// A chat answer's tool calls, read as the text arrives.
#[derive(Clone)]
pub(super) struct ToolReader {
    pub(super) parser: ferry_model::ToolCallParser,
    /// A named `tool_choice`: the answer finishes with "stop", as OpenAI's does.
    pub(super) named: bool,
    /// Calls given out so far (their stream index).
    pub(super) given: usize,
}

impl ToolReader {
    /// Content and calls (OpenAI's `tool_calls` items, with their stream index) in `text`,
    /// and the rest of the answer when `last`.
    pub(super) fn read(&mut self, text: &str, last: bool) -> (String, Vec<Value>) {
        let mut pieces = self.parser.push(text);
        if last {
            pieces.extend(self.parser.finish());
        }
        let mut content = String::new();
        let mut calls = Vec::new();
        for piece in pieces {
            match piece {
                ferry_model::ToolPiece::Content(c) => content.push_str(&c),
                ferry_model::ToolPiece::Call { name, arguments } => {
                    calls.push(json!({
                        "index": self.given,
                        "id": format!("chatcmpl-tool-{:016x}", rand_id()),
                        "type": "function",
                        "function": { "name": name, "arguments": arguments },
                    }));
                    self.given += 1;
                }
            }
        }
        (content, calls)
    }

    /// OpenAI's finish reason for an answer that ended with `reason`.
    pub(super) fn finish_reason(&self, reason: Option<&'static str>) -> Option<&'static str> {
        match reason {
            Some("stop") if self.given > 0 && !self.named => Some("tool_calls"),
            r => r,
        }
    }
}
