//! Reading a request body and checking its values, before anything is built from it: the body
//! must be a JSON object whose fields [`fields::check`] accepts, then it is typed (a wrong
//! value's message names its field and the kind of value expected, in the API's words, not
//! Rust's), then its sampling values are checked as vLLM checks them (the same messages, which
//! OpenAI clients rely on). Every failure is a 400.

use axum::body::Bytes;
use serde_json::Value;

use super::request_body::{Common, OneOrMany};
use crate::http::fields::{self, Endpoint};
use crate::http::ApiError;

/// Parses a request body: a JSON object whose fields [`fields::check`] accepts, then its
/// typed form.
pub(super) fn parse<T: serde::de::DeserializeOwned>(
    body: &Bytes,
    endpoint: Endpoint,
) -> Result<T, ApiError> {
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
pub(super) fn check_values(c: &Common) -> Result<(), ApiError> {
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
    if c.max_loops == Some(0) {
        return bad("max_loops must be at least 1".into());
    }
    if let Some(t) = c.exit_threshold.filter(|t| !(*t > 0.0 && *t <= 1.0)) {
        return bad(format!("exit_threshold must be in (0, 1], got {t}"));
    }
    if let Some(t) = c.truncate_prompt_tokens.filter(|t| *t == 0 || *t < -1) {
        return bad(format!("truncate_prompt_tokens must be an integer >= 1 or -1, got {t}"));
    }
    Ok(())
}

/// OpenAI's `logit_bias`: token ids (as JSON object keys) to a bias; the range is checked when
/// the front prepares the request.
pub(super) fn logit_bias(c: &Common) -> Result<std::collections::HashMap<u32, f32>, ApiError> {
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
