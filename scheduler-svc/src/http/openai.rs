//! OpenAI request and response bodies, and their translation to and from the front's
//! `Generate`. Field names, defaults and value checks follow OpenAI's API and vLLM's extensions
//! (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
//! structured outputs); fields Ferry does not implement are refused by name
//! ([`super::fields`]).

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use ferry_proto::v1::{self, generation_server::Generation};
use futures_util::stream::{self, Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};

use super::fields::{self, Endpoint};
use super::ApiError;
use crate::front::{GenerationService, MAX_SAMPLES};

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: String,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    content: Option<Content>,
    name: Option<String>,
    tool_calls: Option<Vec<Value>>,
    tool_call_id: Option<String>,
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
    #[serde(default)]
    continuous_usage_stats: bool,
}

/// Parameters both endpoints take ([`super::fields`] has already refused what they cannot
/// serve; unknown fields are ignored here).
#[derive(Deserialize, Default)]
struct Common {
    model: Option<String>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<OneOrMany>,
    stop_token_ids: Option<Vec<u32>>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    n: Option<u32>,
    ignore_eos: Option<bool>,
    min_tokens: Option<u32>,
    include_stop_str_in_output: Option<bool>,
    priority: Option<i32>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    response_format: Option<Value>,
    structured_outputs: Option<Value>,
    guided_json: Option<Value>,
    guided_regex: Option<String>,
    guided_choice: Option<Vec<String>>,
    guided_grammar: Option<String>,
    guided_whitespace_pattern: Option<String>,
    echo: Option<bool>,
    logit_bias: Option<serde_json::Map<String, Value>>,
    allowed_token_ids: Option<Vec<u32>>,
    skip_special_tokens: Option<bool>,
    truncate_prompt_tokens: Option<i64>,
    bad_words: Option<Vec<String>>,
    prompt_logprobs: Option<u32>,
}

#[derive(Deserialize)]
struct CompletionBody {
    #[serde(flatten)]
    common: Common,
    prompt: PromptInput,
    logprobs: Option<u32>,
    best_of: Option<u32>,
}

#[derive(Deserialize)]
struct ChatBody {
    #[serde(flatten)]
    common: Common,
    messages: Vec<ChatMessage>,
    logprobs: Option<bool>,
    top_logprobs: Option<u32>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
}

/// How a chat request uses its tools.
#[derive(Clone, Debug, PartialEq, Eq)]
enum ToolUse {
    /// The model may answer with calls (`tool_choice: "auto"`, the default with tools).
    Auto,
    /// The model must call at least one tool (`"required"`).
    Required,
    /// The model must call this function.
    Named(String),
}

/// What `tools` and `tool_choice` ask for: `None` when no calls are read (no tools, or
/// `tool_choice: "none"`, where the tools are still shown to the model, as vLLM does).
fn tool_use(body: &ChatBody) -> Result<Option<ToolUse>, ApiError> {
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

/// Parses a request body: a JSON object whose fields [`fields::check`] accepts, then its
/// typed form.
fn parse<T: serde::de::DeserializeOwned>(body: &Bytes, endpoint: Endpoint) -> Result<T, ApiError> {
    let invalid =
        |e: serde_json::Error| ApiError::bad_request(format!("invalid request body: {e}"));
    let value: Value = serde_json::from_slice(body).map_err(invalid)?;
    let Value::Object(fields) = &value else {
        return Err(ApiError::bad_request("invalid request body: expected a JSON object"));
    };
    fields::check(fields, endpoint)?;
    serde_path_to_error::deserialize(&value).map_err(|e| {
        let at = e.path().to_string();
        let at = if at == "." { common_field(&value) } else { Some(at) };
        let why = plain_types(&e.into_inner().to_string());
        ApiError::bad_request(match at {
            Some(at) => format!("invalid request body: {at}: {why}"),
            None => format!("invalid request body: {why}"),
        })
    })
}

/// Where in `body` the sampling fields every endpoint shares ([`Common`], flattened into each
/// body, which loses the deserializer's path) are wrong: read alone, they have their path.
fn common_field(body: &Value) -> Option<String> {
    let wrong = serde_path_to_error::deserialize::<_, Common>(body).err()?;
    let at = wrong.path().to_string();
    (at != ".").then_some(at)
}

/// A deserializer's message in the API's words: the kind of value expected, not its Rust type
/// ("invalid value: integer `-3`, expected u32" says "expected a non-negative integer").
fn plain_types(message: &str) -> String {
    const KINDS: [(&str, &str); 10] = [
        ("u8", "a non-negative integer"),
        ("u16", "a non-negative integer"),
        ("u32", "a non-negative integer"),
        ("u64", "a non-negative integer"),
        ("usize", "a non-negative integer"),
        ("i32", "an integer"),
        ("i64", "an integer"),
        ("isize", "an integer"),
        ("f32", "a number"),
        ("f64", "a number"),
    ];
    const UNTAGGED: [(&str, &str); 3] = [
        ("OneOrMany", "expected a string or a list of strings"),
        ("PromptInput", "expected a string, a list of strings or a list of token ids"),
        ("Content", "expected a string or a list of content parts"),
    ];
    for (name, api) in UNTAGGED {
        if message == format!("data did not match any variant of untagged enum {name}") {
            return api.to_string();
        }
    }
    let mut out = message.to_string();
    for (rust, api) in KINDS {
        let (from, to) = (format!("expected {rust}"), format!("expected {api}"));
        if let Some(at) = out.find(&from) {
            let end = at + from.len();
            let whole = !out[end..].starts_with(|c: char| c.is_ascii_alphanumeric());
            if whole {
                out.replace_range(at..end, &to);
            }
        }
    }
    out
}

/// vLLM's checks of the sampling values (the same messages), which OpenAI clients rely on.
fn check_values(c: &Common) -> Result<(), ApiError> {
    let bad = |m: String| Err(ApiError::bad_request(m));
    if let Some(t) = c.temperature.filter(|t| !(t.is_finite() && *t >= 0.0)) {
        return bad(format!("temperature must be non-negative, got {t}"));
    }
    if let Some(p) = c.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        return bad(format!("top_p must be in (0, 1], got {p}"));
    }
    if let Some(k) = c.top_k.filter(|k| *k < -1) {
        return bad(format!("top_k must be 0 or -1 (disable), or at least 1, got {k}"));
    }
    if let Some(p) = c.min_p.filter(|p| !(0.0..=1.0).contains(p)) {
        return bad(format!("min_p must be in [0, 1], got {p}"));
    }
    if let Some(r) = c.repetition_penalty.filter(|r| !(r.is_finite() && *r > 0.0)) {
        return bad(format!("repetition_penalty must be greater than zero, got {r}"));
    }
    let empty_stop = match &c.stop {
        Some(OneOrMany::One(s)) => s.is_empty(),
        Some(OneOrMany::Many(v)) => v.iter().any(String::is_empty),
        None => false,
    };
    if empty_stop {
        return bad("stop cannot contain an empty string".into());
    }
    if let Some(t) = c.truncate_prompt_tokens.filter(|t| *t == 0 || *t < -1) {
        return bad(format!("truncate_prompt_tokens must be an integer >= 1 or -1, got {t}"));
    }
    Ok(())
}

/// The grammar a request's output must follow, from OpenAI's `response_format` or vLLM's
/// `structured_outputs` and `guided_*` fields, at most one of them (vLLM's rule and message);
/// `None` when unconstrained. The grammar itself is compiled (and a bad one refused) when the
/// front prepares the request.
fn structured_output(c: &Common) -> Result<Option<v1::StructuredOutput>, ApiError> {
    use v1::structured_output::Kind;
    let bad = |m: String| ApiError::bad_request(m);
    // A JSON schema given as an object or as its text.
    let schema_text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        v => v.to_string(),
    };
    let mut kinds: Vec<(&str, Kind)> = Vec::new();
    if let Some(rf) = c.response_format.as_ref().filter(|v| !v.is_null()) {
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => kinds.push(("response_format", Kind::JsonObject(true))),
            Some("json_schema") => {
                let schema = rf
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .filter(|s| !s.is_null())
                    .ok_or_else(|| {
                        bad("response_format of type json_schema needs json_schema.schema".into())
                    })?;
                kinds.push(("response_format", Kind::JsonSchema(schema_text(schema))));
            }
            Some(other) => {
                return Err(bad(format!(
                    "response_format type {other:?} is not supported: use text, json_object or \
                     json_schema"
                )))
            }
            None => {
                return Err(bad(
                    "response_format needs a type: text, json_object or json_schema".into()
                ))
            }
        }
    }
    if let Some(v) = c.guided_json.as_ref().filter(|v| !v.is_null()) {
        kinds.push(("guided_json", Kind::JsonSchema(schema_text(v))));
    }
    if let Some(rx) = &c.guided_regex {
        kinds.push(("guided_regex", Kind::Regex(rx.clone())));
    }
    if let Some(choices) = &c.guided_choice {
        kinds.push(("guided_choice", Kind::Choice(v1::Choices { choices: choices.clone() })));
    }
    if let Some(g) = &c.guided_grammar {
        kinds.push(("guided_grammar", Kind::Lark(g.clone())));
    }
    if let Some(so) = c.structured_outputs.as_ref().filter(|v| !v.is_null()) {
        let Some(so) = so.as_object() else {
            return Err(bad("structured_outputs must be an object".into()));
        };
        let must = |key: &str, what: &str| bad(format!("structured_outputs.{key} must be {what}"));
        for (key, v) in so.iter().filter(|(_, v)| !v.is_null()) {
            let kind = match key.as_str() {
                "json" => Kind::JsonSchema(schema_text(v)),
                "json_object" if v == true => Kind::JsonObject(true),
                "regex" => Kind::Regex(v.as_str().ok_or_else(|| must(key, "a string"))?.into()),
                "grammar" => Kind::Lark(v.as_str().ok_or_else(|| must(key, "a string"))?.into()),
                "choice" => Kind::Choice(v1::Choices {
                    choices: serde_json::from_value(v.clone())
                        .map_err(|_| must(key, "a list of strings"))?,
                }),
                // Options that leave the constraint as given: JSON is already written without
                // free whitespace, and there is one engine (no fallback to disable).
                "json_object" | "disable_any_whitespace" | "disable_fallback" => continue,
                "disable_additional_properties" if v == false => continue,
                other => {
                    return Err(bad(format!(
                        "structured_outputs.{other} = {v} is not supported: Ferry implements \
                     json, json_object, regex, choice and grammar (Lark)"
                    )))
                }
            };
            kinds.push(("structured_outputs", kind));
        }
    }
    match kinds.len() {
        0 => Ok(None),
        1 => {
            let (_, kind) = kinds.pop().expect("one kind");
            let kind = match &c.guided_whitespace_pattern {
                Some(pattern) => with_whitespace(kind, pattern)?,
                None => kind,
            };
            Ok(Some(v1::StructuredOutput { kind: Some(kind) }))
        }
        _ => {
            let names: Vec<&str> = kinds.iter().map(|(name, _)| *name).collect();
            Err(bad(format!(
                "You can only use one kind of structured outputs constraint but multiple are \
                     specified: {}",
                names.join(", ")
            )))
        }
    }
}

/// A JSON constraint whose whitespace between tokens follows `pattern` (vLLM's
/// `guided_whitespace_pattern`, a regular expression) instead of none; separators are then
/// bare `,` and `:`. A schema's own `x-guidance` options win.
fn with_whitespace(
    kind: v1::structured_output::Kind,
    pattern: &str,
) -> Result<v1::structured_output::Kind, ApiError> {
    use v1::structured_output::Kind;
    let mut schema: Value = match kind {
        Kind::JsonSchema(text) => serde_json::from_str(&text).map_err(|e| {
            ApiError::bad_request(format!("the JSON schema is not valid JSON: {e}"))
        })?,
        Kind::JsonObject(_) => json!({"type": "object"}),
        _ => {
            return Err(ApiError::bad_request(
                "guided_whitespace_pattern applies to JSON constraints (json_schema, \
                 json_object, guided_json) only",
            ))
        }
    };
    let Value::Object(object) = &mut schema else {
        return Err(ApiError::bad_request(
            "guided_whitespace_pattern needs a JSON schema that is an object",
        ));
    };
    ferry_model::structured::with_whitespace_pattern(object, pattern);
    Ok(Kind::JsonSchema(schema.to_string()))
}

/// OpenAI's `logit_bias`: token ids (as JSON object keys) to a bias; the range is checked when
/// the front prepares the request.
fn logit_bias(c: &Common) -> Result<std::collections::HashMap<u32, f32>, ApiError> {
    let Some(map) = &c.logit_bias else { return Ok(std::collections::HashMap::new()) };
    map.iter()
        .map(|(k, v)| {
            let id = k.parse::<u32>().map_err(|_| {
                ApiError::bad_request(format!("logit_bias key {k:?} is not a token id"))
            })?;
            let bias = v.as_f64().ok_or_else(|| {
                ApiError::bad_request(format!("logit_bias for token {id} is {v}, not a number"))
            })?;
            Ok((id, bias as f32))
        })
        .collect()
}

/// The shared part of a `GenerateRequest`; `default_max` applies when the client gives none.
fn generate_request(
    c: &Common,
    default_max: Option<u32>,
    logprobs: Option<u32>,
) -> Result<v1::GenerateRequest, ApiError> {
    check_values(c)?;
    let n = c.n.unwrap_or(1);
    if n == 0 || n > MAX_SAMPLES {
        return Err(ApiError::bad_request(format!(
            "n must be at least 1 and at most {MAX_SAMPLES}, got {n}"
        )));
    }
    // On the wire 0 means "up to the model's length"; OpenAI clients mean a bad value.
    if c.max_tokens == Some(0) || c.max_completion_tokens == Some(0) {
        return Err(ApiError::bad_request("max_tokens must be at least 1"));
    }
    let stop = match &c.stop {
        None => Vec::new(),
        Some(OneOrMany::One(s)) => vec![s.clone()],
        Some(OneOrMany::Many(v)) => v.clone(),
    };
    Ok(v1::GenerateRequest {
        request_id: String::new(),
        model: c.model.clone().unwrap_or_default(),
        input: None,
        output_token_ids: Vec::new(),
        model_fingerprint: String::new(),
        sampling: Some(v1::SamplingParams {
            // OpenAI's default temperature is 1.
            temperature: c.temperature.unwrap_or(1.0),
            top_p: c.top_p.unwrap_or(1.0),
            top_k: c.top_k.filter(|k| *k > 0).map_or(0, |k| k.min(i64::from(u32::MAX)) as u32),
            min_p: c.min_p.unwrap_or(0.0),
            seed: c.seed,
            repetition_penalty: c.repetition_penalty.unwrap_or(1.0),
            presence_penalty: c.presence_penalty.unwrap_or(0.0),
            frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
            logprobs: logprobs.is_some(),
            top_logprobs: logprobs.unwrap_or(0),
            structured_output: structured_output(c)?,
            logit_bias: logit_bias(c)?,
            allowed_token_ids: c.allowed_token_ids.clone().unwrap_or_default(),
            // Tokenized by `run`, which has the tokenizer.
            bad_words: Vec::new(),
            prompt_logprobs: c.prompt_logprobs,
        }),
        stopping: Some(v1::StoppingCriteria {
            max_tokens: c.max_completion_tokens.or(c.max_tokens).or(default_max).unwrap_or(0),
            min_tokens: c.min_tokens.unwrap_or(0),
            stop,
            stop_token_ids: c.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: c.ignore_eos.unwrap_or(false),
            include_stop_str_in_output: c.include_stop_str_in_output.unwrap_or(false),
        }),
        priority: c.priority.unwrap_or(0),
        keep_special_tokens: !c.skip_special_tokens.unwrap_or(true),
        // -1 (vLLM's "as many as the model takes") is set by `run`, which knows the limit.
        truncate_prompt_tokens: c
            .truncate_prompt_tokens
            .filter(|t| *t > 0)
            .map_or(0, |t| u32::try_from(t).unwrap_or(u32::MAX)),
        continuous_usage: c
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage && o.continuous_usage_stats),
        n: c.n.unwrap_or(1),
    })
}

fn finish_reason(r: v1::FinishReason) -> Option<&'static str> {
    match r {
        v1::FinishReason::Unspecified => None,
        v1::FinishReason::Stop => Some("stop"),
        v1::FinishReason::Length => Some("length"),
        v1::FinishReason::Abort => Some("abort"),
        v1::FinishReason::Error => Some("error"),
    }
}

fn usage_json(u: Option<v1::Usage>) -> Value {
    let u = u.unwrap_or_default();
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_prompt_tokens },
    })
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Which endpoint a response is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// Builds the per-event JSON for both endpoints.
struct Shaper {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    front: GenerationService,
    /// The prompt's text, put before the answer (`echo`); empty when not asked.
    echo: String,
    /// Reads tool calls out of a chat answer, when its request has tools: how (the first
    /// choice's reader, the others' made like it), and each choice's reader.
    tools: Option<ToolReader>,
    readers: std::collections::HashMap<u32, ToolReader>,
    /// `best_of`: keep the `n` samples of the highest cumulative log-probability, and show
    /// their log-probabilities only if the client asked for them.
    best_of: Option<(usize, bool)>,
    /// Every chunk carries the usage so far (`stream_options.continuous_usage_stats`).
    continuous_usage: bool,
    /// Completions with `echo` and `logprobs`: the prompt's first token, whose log-probability
    /// (none) leads the echoed prompt's.
    echo_first: Option<u32>,
}

/// A chat answer's tool calls, read as the text arrives.
#[derive(Clone)]
struct ToolReader {
    parser: ferry_model::ToolCallParser,
    /// A named `tool_choice`: the answer finishes with "stop", as OpenAI's does.
    named: bool,
    /// Calls given out so far (their stream index).
    given: usize,
}

impl ToolReader {
    /// Content and calls (OpenAI's `tool_calls` items, with their stream index) in `text`,
    /// and the rest of the answer when `last`.
    fn read(&mut self, text: &str, last: bool) -> (String, Vec<Value>) {
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
    fn finish_reason(&self, reason: Option<&'static str>) -> Option<&'static str> {
        match reason {
            Some("stop") if self.given > 0 && !self.named => Some("tool_calls"),
            r => r,
        }
    }
}

impl Shaper {
    fn token_text(&self, id: u32) -> String {
        self.front.model().file.tokenizer.decode(&[id])
    }

    /// vLLM's `prompt_logprobs`: `null` for the first prompt token, then for each next one
    /// its own and the most likely tokens by id, with log-probability, rank (1 for the most
    /// likely; the prompt token's only when it is among them) and text.
    fn prompt_logprobs(&self, entries: &[v1::PositionLogprobs]) -> Value {
        let entry = |p: &v1::PositionLogprobs| {
            let mut map = serde_json::Map::new();
            for (rank, t) in p.top.iter().enumerate() {
                let v = json!({"logprob": t.logprob, "rank": rank + 1, "decoded_token": self.token_text(t.token_id)});
                map.insert(t.token_id.to_string(), v);
            }
            if let Some(s) = p.sampled {
                map.entry(s.token_id.to_string()).or_insert_with(|| {
                    json!({"logprob": s.logprob, "rank": null, "decoded_token": self.token_text(s.token_id)})
                });
            }
            Value::Object(map)
        };
        Value::Array(std::iter::once(Value::Null).chain(entries.iter().map(entry)).collect())
    }

    /// Logprobs of one event, in the endpoint's shape; on completions with `echo`, the
    /// prompt's first (the first event's prompt log-probabilities then lead).
    fn logprobs(&self, ev: &v1::GenerateEvent) -> Value {
        if let (Kind::Completion, Some(first), false) =
            (self.kind, self.echo_first, ev.prompt_logprobs.is_empty())
        {
            let all: Vec<v1::PositionLogprobs> =
                ev.prompt_logprobs.iter().chain(&ev.logprobs).cloned().collect();
            let mut v = self.logprobs(&v1::GenerateEvent { logprobs: all, ..Default::default() });
            // The prompt's first token has no log-probability.
            if let Some(tokens) = v["tokens"].as_array_mut() {
                tokens.insert(0, self.token_text(first).into());
            }
            for key in ["token_logprobs", "top_logprobs"] {
                if let Some(list) = v[key].as_array_mut() {
                    list.insert(0, Value::Null);
                }
            }
            return v;
        }
        if ev.logprobs.is_empty() {
            return Value::Null;
        }
        match self.kind {
            Kind::Chat => json!({ "content": ev.logprobs.iter().map(|p| {
                let s = p.sampled.unwrap_or_default();
                json!({
                    "token": self.token_text(s.token_id),
                    "logprob": s.logprob,
                    "top_logprobs": p.top.iter().map(|t| json!({"token": self.token_text(t.token_id), "logprob": t.logprob})).collect::<Vec<_>>(),
                })
            }).collect::<Vec<_>>() }),
            Kind::Completion => json!({
                "tokens": ev.logprobs.iter().map(|p| self.token_text(p.sampled.unwrap_or_default().token_id)).collect::<Vec<_>>(),
                "token_logprobs": ev.logprobs.iter().map(|p| p.sampled.unwrap_or_default().logprob).collect::<Vec<_>>(),
                "top_logprobs": ev.logprobs.iter().map(|p| p.top.iter().map(|t| (self.token_text(t.token_id), json!(t.logprob))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
            }),
        }
    }

    /// The tool-call reader of choice `index` (each choice reads its own answer).
    fn reader(&mut self, index: u32) -> Option<&mut ToolReader> {
        let template = self.tools.as_ref()?;
        Some(self.readers.entry(index).or_insert_with(|| template.clone()))
    }

    fn chunk(&mut self, ev: &v1::GenerateEvent, first: bool) -> Value {
        let mut finish = finish_reason(ev.finish_reason());
        let index = ev.index;
        let text = if first { format!("{}{}", self.echo, ev.text) } else { ev.text.clone() };
        let mut chunk = match self.kind {
            Kind::Completion => {
                let mut choice = json!({ "index": index, "text": text, "logprobs": self.logprobs(ev), "finish_reason": finish });
                if !ev.prompt_logprobs.is_empty() {
                    choice["prompt_logprobs"] = self.prompt_logprobs(&ev.prompt_logprobs);
                }
                json!({
                    "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": [choice],
                })
            }
            Kind::Chat => {
                let mut delta = json!({ "content": text });
                if let Some(reader) = self.reader(index) {
                    let (content, calls) = reader.read(&text, finish.is_some());
                    finish = reader.finish_reason(finish);
                    delta = json!({ "content": content });
                    if !calls.is_empty() {
                        delta["tool_calls"] = Value::Array(calls);
                    }
                }
                if first {
                    delta["role"] = json!("assistant");
                }
                json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [{ "index": index, "delta": delta, "logprobs": self.logprobs(ev), "finish_reason": finish }],
                })
            }
        };
        if self.kind == Kind::Chat && !ev.prompt_logprobs.is_empty() {
            chunk["prompt_logprobs"] = self.prompt_logprobs(&ev.prompt_logprobs);
        }
        if self.continuous_usage {
            chunk["usage"] = usage_json(ev.usage);
        }
        chunk
    }

    fn usage_chunk(&self, usage: Option<v1::Usage>) -> Value {
        let object =
            if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        json!({ "id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [], "usage": usage_json(usage) })
    }

    /// The whole answer: one choice per sample (`best_of`: the best `n`, by cumulative
    /// log-probability), usage counting the prompt once and every sample's tokens.
    fn whole(&mut self, events: &[v1::GenerateEvent]) -> Value {
        let mut by_index: std::collections::BTreeMap<u32, Vec<v1::GenerateEvent>> =
            std::collections::BTreeMap::new();
        for ev in events {
            by_index.entry(ev.index).or_default().push(ev.clone());
        }
        let mut samples: Vec<(u32, Vec<v1::GenerateEvent>)> = by_index.into_iter().collect();
        if let Some((n, show_logprobs)) = self.best_of {
            let score = |evs: &[v1::GenerateEvent]| -> f64 {
                evs.iter()
                    .flat_map(|e| &e.logprobs)
                    .map(|p| f64::from(p.sampled.unwrap_or_default().logprob))
                    .sum()
            };
            samples.sort_by(|a, b| score(&b.1).total_cmp(&score(&a.1)).then(a.0.cmp(&b.0)));
            samples.truncate(n);
            for (_, evs) in &mut samples {
                for e in evs.iter_mut().filter(|_| !show_logprobs) {
                    e.logprobs.clear();
                }
            }
        }
        let mut prompt_logprobs = None;
        let mut choices = Vec::with_capacity(samples.len());
        for (index, (sample, evs)) in samples.iter().enumerate() {
            let (choice, prompt) =
                self.choice(u32::try_from(index).unwrap_or(u32::MAX), *sample, evs);
            prompt_logprobs = prompt_logprobs.or(prompt);
            choices.push(choice);
        }
        let object = if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
        // The last event carries the usage of every sample (the front counts them together).
        let usage = events.iter().rev().find_map(|e| e.usage);
        let mut whole = json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": choices, "usage": usage_json(usage),
        });
        if let (Kind::Chat, Some(p)) = (self.kind, prompt_logprobs) {
            whole["prompt_logprobs"] = p;
        }
        whole
    }

    /// One sample's choice at `index` (`sample`: its index in the stream) from its events,
    /// and its prompt log-probabilities when asked for.
    fn choice(
        &mut self,
        index: u32,
        sample: u32,
        events: &[v1::GenerateEvent],
    ) -> (Value, Option<Value>) {
        let text: String = std::iter::once(self.echo.as_str())
            .chain(events.iter().map(|e| e.text.as_str()))
            .collect();
        let last = events.last();
        let mut finish = last.and_then(|e| finish_reason(e.finish_reason()));
        let merged = v1::GenerateEvent {
            logprobs: events.iter().flat_map(|e| e.logprobs.clone()).collect(),
            prompt_logprobs: events.iter().flat_map(|e| e.prompt_logprobs.clone()).collect(),
            ..Default::default()
        };
        let prompt_logprobs = (!merged.prompt_logprobs.is_empty())
            .then(|| self.prompt_logprobs(&merged.prompt_logprobs));
        let choice = match self.kind {
            Kind::Completion => {
                let mut choice = json!({ "index": index, "text": text, "logprobs": self.logprobs(&merged), "finish_reason": finish });
                if let Some(p) = &prompt_logprobs {
                    choice["prompt_logprobs"] = p.clone();
                }
                choice
            }
            Kind::Chat => {
                let mut message = json!({ "role": "assistant", "content": text });
                if let Some(reader) = self.reader(sample) {
                    let (content, calls) = reader.read(&text, true);
                    finish = reader.finish_reason(finish);
                    let content = Some(content).filter(|c| !c.is_empty());
                    let calls: Vec<Value> = calls
                        .into_iter()
                        .map(|mut c| {
                            c.as_object_mut().map(|o| o.remove("index"));
                            c
                        })
                        .collect();
                    message =
                        json!({ "role": "assistant", "content": content, "tool_calls": calls });
                }
                json!({
                    "index": index, "message": message,
                    "logprobs": self.logprobs(&merged), "finish_reason": finish,
                })
            }
        };
        (choice, prompt_logprobs)
    }
}

async fn run(
    front: GenerationService,
    (kind, echo, tools, echo_first): (Kind, String, Option<ToolReader>, Option<u32>),
    best_of: Option<(usize, bool)>,
    common: &Common,
    req: v1::GenerateRequest,
    headers: &HeaderMap,
) -> Result<Response, ApiError> {
    let model = front.model().name().to_string();
    let mut req = req;
    if common.truncate_prompt_tokens == Some(-1) {
        let longest =
            front.limits().max_prompt_tokens.min(front.model().max_model_len.saturating_sub(1));
        req.truncate_prompt_tokens = u32::try_from(longest).unwrap_or(u32::MAX);
    }
    if let Some(words) = common.bad_words.as_deref().filter(|w| !w.is_empty()) {
        let tok = &front.model().file.tokenizer;
        let sequences = ferry_model::sampling::LogitAdjust::bad_word_sequences(tok, words)
            .map_err(|e| ApiError::bad_request(format!("bad_words: {e}")))?;
        req.sampling.get_or_insert_with(Default::default).bad_words = sequences;
    }
    let continuous_usage = req.continuous_usage;
    let mut call = tonic::Request::new(req);
    // W3C trace context: the caller's `traceparent` (and `tracestate`) become the parent of
    // this request's spans, as on the gRPC API.
    // The caller's API key goes on with it (the front identifies it again, and charges it).
    for key in ["traceparent", "tracestate", "authorization"] {
        if let Some(v) = headers.get(key).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok())
        {
            call.metadata_mut().insert(key, v);
        }
    }
    let stream = front.generate(call).await?.into_inner();
    let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
    let mut shaper = Shaper {
        kind,
        id: format!("{prefix}-{:016x}", rand_id()),
        created: unix_now(),
        model,
        front: front.clone(),
        echo,
        tools,
        readers: std::collections::HashMap::new(),
        best_of,
        continuous_usage,
        echo_first,
    };
    if !common.stream {
        let mut events = Vec::new();
        let mut stream = stream;
        while let Some(ev) = stream.next().await {
            events.push(ev?);
        }
        if let Some(err) = events.iter().find(|e| e.finish_reason() == v1::FinishReason::Error) {
            return Err(tonic::Status::unavailable(err.error.clone()).into());
        }
        return Ok(([("content-type", "application/json")], shaper.whole(&events).to_string())
            .into_response());
    }
    let include_usage = common.stream_options.as_ref().is_some_and(|o| o.include_usage);
    Ok(Sse::new(sse_events(shaper, stream, include_usage)).into_response())
}

/// Where the SSE body is.
enum Phase {
    Events,
    Usage,
    Done,
    End,
}

/// The SSE body: one chunk per event, then (if asked) a usage chunk, then `[DONE]`. Chunks are
/// sent as events arrive; dropping the body (client gone) drops the front's stream, which
/// aborts the request.
fn sse_events(
    shaper: Shaper,
    events: impl Stream<Item = Result<v1::GenerateEvent, tonic::Status>> + Send + Unpin + 'static,
    include_usage: bool,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    struct State<S> {
        shaper: Shaper,
        events: S,
        /// Choices that have had their first chunk.
        started: std::collections::HashSet<u32>,
        usage: Option<v1::Usage>,
        phase: Phase,
    }
    let started = std::collections::HashSet::new();
    let init = State { shaper, events, started, usage: None, phase: Phase::Events };
    stream::unfold(init, move |mut st| async move {
        loop {
            match st.phase {
                Phase::Events => match st.events.next().await {
                    Some(Ok(ev)) => {
                        if ev.usage.is_some() {
                            st.usage = ev.usage;
                        }
                        let first = st.started.insert(ev.index);
                        let data = st.shaper.chunk(&ev, first);
                        return Some((Ok(Event::default().data(data.to_string())), st));
                    }
                    Some(Err(status)) => {
                        st.phase = Phase::Done;
                        let data = json!({ "error": { "message": status.message(), "code": super::http_status(status.code()).as_u16() } });
                        return Some((Ok(Event::default().data(data.to_string())), st));
                    }
                    None => st.phase = if include_usage { Phase::Usage } else { Phase::Done },
                },
                Phase::Usage => {
                    st.phase = Phase::Done;
                    let data = st.shaper.usage_chunk(st.usage);
                    return Some((Ok(Event::default().data(data.to_string())), st));
                }
                Phase::Done => {
                    st.phase = Phase::End;
                    return Some((Ok(Event::default().data("[DONE]")), st));
                }
                Phase::End => return None,
            }
        }
    })
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(unix_now());
    h.finish()
}

/// OpenAI's `best_of` (completions only): generate `best_of` samples and return the `n` of the
/// highest cumulative log-probability, so each sample's log-probabilities are computed
/// (shown only if asked for). Not streamed: the best are known only when all have finished.
/// `None` when it is not asked for (absent, or equal to `n`).
fn best_of(
    body: &CompletionBody,
    req: &mut v1::GenerateRequest,
) -> Result<Option<(usize, bool)>, ApiError> {
    let n = req.n;
    let Some(best_of) = body.best_of.filter(|&b| b != n) else { return Ok(None) };
    if best_of < n || best_of > MAX_SAMPLES {
        return Err(ApiError::bad_request(format!(
            "best_of must be at least n and at most {MAX_SAMPLES}, got n = {n} and best_of = \
             {best_of}"
        )));
    }
    if body.common.stream {
        return Err(ApiError::bad_request(format!(
            "best_of = {best_of} with n = {n} cannot be streamed: the best {n} are known only \
             when all {best_of} have finished"
        )));
    }
    req.n = best_of;
    req.sampling.get_or_insert_with(Default::default).logprobs = true;
    Ok(Some((n as usize, body.logprobs.is_some())))
}

/// `POST /v1/completions`.
pub async fn completions(
    State(front): State<GenerationService>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body: CompletionBody = parse(&body, Endpoint::Completions)?;
    // OpenAI's legacy default is 16 tokens (at most --max-output-tokens).
    let default_max = u32::try_from(front.limits().max_output_tokens).unwrap_or(u32::MAX).min(16);
    let mut req = generate_request(&body.common, Some(default_max), body.logprobs)?;
    let best_of = best_of(&body, &mut req)?;
    let echo = body.common.echo.unwrap_or(false);
    // With echo, logprobs cover the prompt too (as vLLM: its prompt_logprobs, as many).
    let echo_logprobs = echo && body.logprobs.is_some();
    if echo_logprobs {
        let sampling = req.sampling.get_or_insert_with(Default::default);
        sampling.prompt_logprobs = sampling.prompt_logprobs.max(body.logprobs);
    }
    // The prompt as text, for `echo`: as given, or its tokens decoded.
    let echoed = match (&body.prompt, echo) {
        (_, false) => String::new(),
        (PromptInput::Text(t), true) => t.clone(),
        (PromptInput::Texts(v), true) => v.concat(),
        (PromptInput::Tokens(ids), true) => front.model().file.tokenizer.decode(ids),
    };
    // The prompt's first token, which leads the echoed log-probabilities.
    let echo_first = match &body.prompt {
        _ if !echo_logprobs => None,
        PromptInput::Tokens(ids) => ids.first().copied(),
        _ => front.model().file.tokenizer.encode(&echoed).ok().and_then(|ids| ids.first().copied()),
    };
    req.input = Some(match body.prompt {
        PromptInput::Text(t) => v1::generate_request::Input::Prompt(t),
        PromptInput::Tokens(ids) => {
            v1::generate_request::Input::PromptTokenIds(v1::TokenIds { ids })
        }
        PromptInput::Texts(mut v) if v.len() == 1 => {
            v1::generate_request::Input::Prompt(v.remove(0))
        }
        PromptInput::Texts(v) => {
            return Err(ApiError::bad_request(format!(
                "{} prompts given; only one prompt per request is supported",
                v.len()
            )))
        }
    });
    run(front, (Kind::Completion, echoed, None, echo_first), best_of, &body.common, req, &headers)
        .await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(front): State<GenerationService>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body: ChatBody = parse(&body, Endpoint::Chat)?;
    let logprobs = body.logprobs.unwrap_or(false).then_some(body.top_logprobs.unwrap_or(0));
    let mut req = generate_request(&body.common, None, logprobs)?;
    let tool_use = tool_use(&body)?;
    let tools = body.tools.unwrap_or_default();
    let parallel = body.parallel_tool_calls.unwrap_or(true);
    let forced = match &tool_use {
        Some(ToolUse::Required) => Some(ferry_model::chat::ForcedCall::Required),
        Some(ToolUse::Named(name)) => Some(ferry_model::chat::ForcedCall::Named(name)),
        _ => None,
    };
    if let Some(forced) = forced {
        let sampling = req.sampling.get_or_insert_with(Default::default);
        if sampling.structured_output.is_some() {
            return Err(ApiError::bad_request(
                "a required or named tool_choice cannot be combined with a structured output \
                 (response_format, structured_outputs or guided_*): the call's grammar is the \
                 constraint",
            ));
        }
        let grammar = ferry_model::chat::tool_call_grammar(&tools, forced, parallel)
            .expect("tool_use checked the named function");
        sampling.structured_output =
            Some(v1::StructuredOutput { kind: Some(v1::structured_output::Kind::Lark(grammar)) });
    }
    let reader = tool_use.as_ref().map(|u| ToolReader {
        parser: ferry_model::ToolCallParser::new(!parallel),
        named: matches!(u, ToolUse::Named(_)),
        given: 0,
    });
    let messages = body
        .messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => {
                    if let Some(p) = parts.iter().find(|p| p.kind != "text") {
                        return Err(ApiError::bad_request(format!(
                            "content part type {:?} is not supported; only text",
                            p.kind
                        )));
                    }
                    parts.into_iter().map(|p| p.text).collect()
                }
            };
            let tool_calls_json = match m.tool_calls.filter(|c| !c.is_empty()) {
                None => String::new(),
                Some(calls) if m.role == "assistant" => Value::Array(calls).to_string(),
                Some(_) => {
                    return Err(ApiError::bad_request(format!(
                        "messages[{i}].tool_calls is only for assistant messages"
                    )))
                }
            };
            Ok(v1::ChatMessage {
                role: m.role,
                content,
                name: m.name.unwrap_or_default(),
                tool_calls_json,
                tool_call_id: m.tool_call_id.unwrap_or_default(),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let add_generation_prompt = body.add_generation_prompt.unwrap_or(true);
    let continue_final_message = body.continue_final_message.unwrap_or(false);
    if add_generation_prompt && continue_final_message {
        // vLLM's message (its add_generation_prompt also defaults to true).
        return Err(ApiError::bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ));
    }
    let template_kwargs_json = body
        .chat_template_kwargs
        .filter(|k| !k.is_empty())
        .map(|k| Value::Object(k).to_string())
        .unwrap_or_default();
    let tools_json = if tools.is_empty() { String::new() } else { Value::Array(tools).to_string() };
    // vLLM's chat echo: the answer starts with the last message's text when that message is
    // the assistant's (a reply being continued).
    let echoed = match (body.common.echo, messages.last()) {
        (Some(true), Some(last)) if last.role == "assistant" => last.content.clone(),
        _ => String::new(),
    };
    let input = v1::Chat {
        messages,
        add_generation_prompt,
        tools_json,
        continue_final_message,
        template_kwargs_json,
    };
    req.input = Some(v1::generate_request::Input::Chat(input));
    run(front, (Kind::Chat, echoed, reader, None), None, &body.common, req, &headers).await
}

/// `GET /v1/models`.
pub async fn models(State(front): State<GenerationService>) -> Response {
    let m = front.model();
    let body = json!({
        "object": "list",
        "data": [{ "id": m.name(), "object": "model", "created": 0, "owned_by": "ferry", "max_model_len": m.max_model_len }],
    });
    ([("content-type", "application/json")], body.to_string()).into_response()
}

#[cfg(test)]
mod tests {
    use super::{generate_request, parse, tool_use, ChatBody, Endpoint, ToolUse};
    use axum::body::Bytes;
    use ferry_proto::v1::{self, structured_output::Kind};
    use serde_json::json;

    /// A chat body with `extra`'s fields, parsed, or the 400's message.
    fn chat_body(extra: &serde_json::Value) -> Result<ChatBody, String> {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        parse(&Bytes::from(body.to_string()), Endpoint::Chat).map_err(|e| e.message().to_string())
    }

    fn chat(extra: &serde_json::Value) -> Result<(), String> {
        let parsed = chat_body(extra)?;
        generate_request(&parsed.common, None, None).map_err(|e| e.message().to_string())?;
        Ok(())
    }

    #[test]
    fn a_value_of_the_wrong_kind_names_its_field_and_the_kind_expected() {
        for (extra, want) in [
            (
                json!({"max_tokens": -3}),
                "max_tokens: invalid value: integer `-3`, expected a non-negative integer",
            ),
            (json!({"top_p": "high"}), "top_p: invalid type: string \"high\", expected a number"),
            (
                json!({"seed": 1.5}),
                "seed: invalid type: floating point `1.5`, expected a non-negative integer",
            ),
            (json!({"stop": [1]}), "stop: expected a string or a list of strings"),
            (json!({"stream": "yes"}), "stream: invalid type: string \"yes\", expected a boolean"),
            // Two wrong: the first in the body is named.
            (json!({"top_p": "high", "max_tokens": -3}), "invalid request body: top_p: "),
        ] {
            let err = chat_body(&extra).err().unwrap_or_else(|| panic!("{extra} parsed"));
            assert!(err.contains(want), "{extra}: {err}");
        }
        let bad_content = json!({"messages": [{"role": "user", "content": 5}]});
        let err =
            parse::<ChatBody>(&Bytes::from(bad_content.to_string()), Endpoint::Chat).err().unwrap();
        assert_eq!(
            err.message(),
            "invalid request body: messages[0].content: expected a string or a list of content parts"
        );
    }

    #[test]
    fn sampling_values_are_checked_as_vllm_checks_them() {
        for (extra, needle) in [
            (json!({"temperature": -0.5}), "temperature must be non-negative"),
            (json!({"top_p": 0}), "top_p must be in (0, 1], got 0"),
            (json!({"top_p": 1.5}), "top_p must be in (0, 1]"),
            (json!({"top_k": -2}), "top_k must be 0 or -1 (disable), or at least 1, got -2"),
            (json!({"min_p": 1.5}), "min_p must be in [0, 1]"),
            (json!({"repetition_penalty": 0}), "repetition_penalty must be greater than zero"),
            (json!({"stop": ""}), "stop cannot contain an empty string"),
            (json!({"stop": ["x", ""]}), "stop cannot contain an empty string"),
        ] {
            let err = chat(&extra).expect_err(&extra.to_string());
            assert!(err.contains(needle), "{extra}: {err}");
        }
        for extra in [
            json!({"top_k": -1}),
            json!({"top_k": 0}),
            json!({"top_k": 40, "top_p": 1, "min_p": 0, "repetition_penalty": 1.1}),
            json!({"temperature": 0, "stop": ["\n"]}),
        ] {
            assert_eq!(chat(&extra), Ok(()), "{extra}");
        }
        let err = chat(&json!({"functions": [{"name": "f"}]})).unwrap_err();
        assert!(err.starts_with("functions = "), "{err}");
        let bytes = Bytes::from_static(b"[1, 2]");
        let err = parse::<ChatBody>(&bytes, Endpoint::Chat).err().unwrap();
        assert!(err.message().contains("expected a JSON object"), "{}", err.message());
    }

    /// The constraint a chat body asks for, or the 400's message.
    fn constraint(extra: &serde_json::Value) -> Result<Option<Kind>, String> {
        let parsed = chat_body(extra)?;
        let req =
            generate_request(&parsed.common, None, None).map_err(|e| e.message().to_string())?;
        Ok(req.sampling.unwrap().structured_output.and_then(|s| s.kind))
    }

    #[test]
    fn every_structured_output_field_becomes_one_constraint() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let schema_text = schema.to_string();
        let choices = |c: &[&str]| {
            Kind::Choice(v1::Choices { choices: c.iter().map(|s| (*s).to_string()).collect() })
        };
        for (extra, want) in [
            (json!({"response_format": {"type": "text"}}), None),
            (json!({"response_format": {"type": "json_object"}}), Some(Kind::JsonObject(true))),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": true}}}),
                Some(Kind::JsonSchema(schema_text.clone())),
            ),
            (json!({"guided_json": schema}), Some(Kind::JsonSchema(schema_text.clone()))),
            (json!({"guided_json": schema_text}), Some(Kind::JsonSchema(schema_text.clone()))),
            (json!({"guided_regex": "a+"}), Some(Kind::Regex("a+".into()))),
            (json!({"guided_choice": ["x", "y"]}), Some(choices(&["x", "y"]))),
            (json!({"guided_grammar": "start: \"a\""}), Some(Kind::Lark("start: \"a\"".into()))),
            (
                json!({"structured_outputs": {"json": schema}}),
                Some(Kind::JsonSchema(schema_text.clone())),
            ),
            (json!({"structured_outputs": {"regex": "b"}}), Some(Kind::Regex("b".into()))),
            (json!({"structured_outputs": {"choice": ["z"]}}), Some(choices(&["z"]))),
            (json!({"structured_outputs": {"grammar": "g"}}), Some(Kind::Lark("g".into()))),
            (
                json!({"structured_outputs": {"json_object": true, "disable_any_whitespace": true}}),
                Some(Kind::JsonObject(true)),
            ),
            (
                json!({"guided_decoding_backend": "xgrammar", "guided_regex": "c"}),
                Some(Kind::Regex("c".into())),
            ),
            (json!({"structured_outputs": {}}), None),
            (
                json!({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " ?"}),
                Some(Kind::JsonSchema(
                    json!({"type": "object", "x-guidance": {"whitespace_pattern": " ?", "item_separator": ",", "key_separator": ":"}}).to_string(),
                )),
            ),
        ] {
            assert_eq!(constraint(&extra), Ok(want), "{extra}");
        }
        for (extra, needle) in [
            (json!({"guided_regex": "a", "guided_choice": ["a"]}), "You can only use one kind of structured outputs constraint but multiple are specified: guided_regex, guided_choice"),
            (json!({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}), "multiple are specified: response_format, structured_outputs"),
            (json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}), "multiple are specified"),
            (json!({"response_format": {"type": "json_schema"}}), "json_schema needs json_schema.schema"),
            (json!({"response_format": {"type": "structural_tag"}}), "response_format type \"structural_tag\" is not supported"),
            (json!({"response_format": {}}), "response_format needs a type"),
            (json!({"structured_outputs": {"structural_tag": "{}"}}), "structured_outputs.structural_tag = "),
            (json!({"structured_outputs": {"choice": "a"}}), "structured_outputs.choice must be a list of strings"),
            (json!({"structured_outputs": {"regex": 3}}), "structured_outputs.regex must be a string"),
            (json!({"structured_outputs": 3}), "structured_outputs must be an object"),
            (json!({"guided_whitespace_pattern": " *", "guided_regex": "a"}), "applies to JSON constraints"),
        ] {
            let err = constraint(&extra).expect_err(&extra.to_string());
            assert!(err.contains(needle), "{extra}: {err}");
        }
    }

    /// What a chat body's `tools` and `tool_choice` ask for, or the 400's message.
    fn tools(extra: &serde_json::Value) -> Result<Option<ToolUse>, String> {
        let parsed = chat_body(extra)?;
        tool_use(&parsed).map_err(|e| e.message().to_string())
    }

    #[test]
    fn tool_choice_is_read_and_checked_as_openai_and_vllm_do() {
        let f = json!([{"type": "function", "function": {"name": "f"}}]);
        let named = json!({"type": "function", "function": {"name": "f"}});
        for (extra, want) in [
            (json!({}), None),
            (json!({"tool_choice": "auto"}), None),
            (json!({"tool_choice": "none"}), None),
            (json!({"tools": []}), None),
            (json!({"tools": f}), Some(ToolUse::Auto)),
            (json!({"tools": f, "tool_choice": "auto"}), Some(ToolUse::Auto)),
            (json!({"tools": f, "tool_choice": "none"}), None),
            (json!({"tools": f, "tool_choice": "required"}), Some(ToolUse::Required)),
            (json!({"tools": f, "tool_choice": named}), Some(ToolUse::Named("f".into()))),
        ] {
            assert_eq!(tools(&extra), Ok(want), "{extra}");
        }
        for (extra, needle) in [
            (json!({"tool_choice": "required"}), "When using `tool_choice`, `tools` must be set."),
            (json!({"tool_choice": named}), "`tools` must be set"),
            (json!({"tools": f, "tool_choice": "always"}), "tool_choice = \"always\" is not valid"),
            (json!({"tools": f, "tool_choice": {"type": "function"}}), "is not valid"),
            (
                json!({"tools": f, "tool_choice": {"type": "function", "function": {"name": "g"}}}),
                "tool_choice names the function \"g\", which is not in tools",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f g"}}]}),
                "tools[0].function.name \"f g\" must be",
            ),
        ] {
            let err = tools(&extra).expect_err(&extra.to_string());
            assert!(err.contains(needle), "{extra}: {err}");
        }
    }
}
