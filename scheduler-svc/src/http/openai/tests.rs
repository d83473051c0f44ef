//! Unit tests of reading a request: wrong kinds of values, vLLM's value checks, structured
//! outputs and tool choice, each through the path a request takes (parse, then translate); a
//! streamed chunk written directly is the bytes its JSON value gives.

use axum::body::Bytes;
use ferry_proto::v1::{self, structured_output::Kind};
use serde_json::json;

use super::request_body::ChatBody;
use super::tool_calls::{tool_use, ToolUse};
use super::translate::generate_request;
use super::validate::parse;
use crate::http::fields::Endpoint;

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
    let req = generate_request(&parsed.common, None, None).map_err(|e| e.message().to_string())?;
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

/// The plain chunks written directly (`chunk_text`) are byte for byte the serialized `Value`
/// (`chunk`), for both endpoints, the first chunk (role, echo) and the last (finish reason),
/// text that needs escaping; chunks with log-probabilities or usage take the `Value`.
#[test]
fn a_chunk_written_directly_is_the_json_values_bytes() {
    use super::response_body::{Kind as Endpoint, Shaper};
    let set = crate::executors::ExecutorSet::new();
    let front = crate::front::tests::front(&set);
    for kind in [Endpoint::Completion, Endpoint::Chat] {
        for continuous_usage in [false, true] {
            let mut shaper = Shaper {
                kind,
                id: "cmpl-\"odd\"".into(),
                created: 1_765_000_000,
                model: "Smol\u{e9}".into(),
                file: front.models().default_model().file.clone(),
                echo: "Echo: ".into(),
                tools: None,
                readers: std::collections::HashMap::new(),
                best_of: None,
                continuous_usage,
                echo_first: None,
                chunk_head: String::new(),
            };
            let texts = ["Hello", " \"quoted\"\n\ttab \u{1f600} \\ end", ""];
            for (i, text) in texts.iter().enumerate() {
                for finish in [
                    v1::FinishReason::Unspecified,
                    v1::FinishReason::Stop,
                    v1::FinishReason::Length,
                ] {
                    let mut ev = v1::GenerateEvent {
                        index: i as u32,
                        text: (*text).into(),
                        ..Default::default()
                    };
                    ev.set_finish_reason(finish);
                    ev.usage = Some(v1::Usage {
                        prompt_tokens: 3,
                        completion_tokens: 1,
                        ..Default::default()
                    });
                    for first in [true, false] {
                        let want = shaper.chunk(&ev, first).to_string();
                        let mut got = String::new();
                        shaper.chunk_into(&ev, first, &mut got);
                        assert_eq!(got, want, "{kind:?} {text:?}");
                    }
                }
            }
        }
    }
}
