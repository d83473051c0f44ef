//! Structured outputs: the request fields that constrain an answer to a grammar (OpenAI's
//! `response_format`, vLLM's `structured_outputs`, `guided_*` and `guided_whitespace_pattern`),
//! read into the one `StructuredOutput` the front compiles. Invariant: a request carries at most
//! one constraint; two are refused by name, never merged or one silently dropped.

use ferry_proto::v1;
use serde_json::{json, Value};

use super::request_body::Common;
use crate::http::ApiError;

/// The grammar a request's output must follow, from OpenAI's `response_format` or vLLM's
/// `structured_outputs` and `guided_*` fields, at most one of them (vLLM's rule and message);
/// `None` when unconstrained. The grammar itself is compiled (and a bad one refused) when the
/// front prepares the request.
pub(super) fn structured_output(c: &Common) -> Result<Option<v1::StructuredOutput>, ApiError> {
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
