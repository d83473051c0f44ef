//! Conversations beyond a template's basics: tools, tool calls and their answers, participant
//! names, template variables, continuing the last message; and reading tool calls back out of
//! the model's text.
//!
//! Why it exists: OpenAI clients send tools and tool-call history, and expect calls back as
//! structured `tool_calls`. A model's chat template may know tools (Qwen's, Hermes', Llama
//! 3.1's) or not (SmolLM2's). When it does, the tools and calls go to it as vLLM passes them;
//! when it does not, they are written into the conversation in the Hermes format, which most
//! open models are trained on, so that the model still sees them:
//! - the tools as a block appended to the system message (or as one), listing each tool's JSON
//!   inside `<tools></tools>` and asking for calls as
//!   `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`;
//! - an assistant's calls as those same blocks after its text;
//! - "tool" messages as a user turn of `<tool_response>\n…\n</tool_response>` blocks
//!   (consecutive answers in one turn).
//!
//! Output is read in the same format ([`ToolCallParser`]), and [`tool_call_grammar`] writes
//! the Lark grammar that forces it when a call is required, so the call always parses.
//!
//! What it guarantees: every message sent to a template has a string `content`; tool-call
//! arguments reach templates as JSON values (as vLLM gives them), not as text; the parser
//! yields the same calls and content whether the text arrives whole or in pieces.

use std::fmt::Write;

use serde_json::{json, Map, Value};

/// Most tools a request may carry (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// Template variables the renderer sets, which `chat_template_kwargs` may not replace.
pub const RESERVED_TEMPLATE_VARIABLES: &[&str] = &[
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "bos_token",
    "eos_token",
];

/// How to render a conversation.
#[derive(Clone, Copy, Debug, Default)]
pub struct ChatOptions<'a> {
    /// Append the assistant's prefix so that the model answers.
    pub add_generation_prompt: bool,
    /// Leave the last message open so that the model continues it.
    pub continue_final_message: bool,
    /// OpenAI tools (`{"type": "function", "function": {…}}`), checked by [`check_tools`].
    pub tools: &'a [Value],
    /// Extra template variables (none of [`RESERVED_TEMPLATE_VARIABLES`]).
    pub kwargs: Option<&'a Map<String, Value>>,
    /// The time the template's `strftime_now` gives (now when `None`; tests fix it).
    pub now: Option<std::time::SystemTime>,
}

/// A tool's function name: OpenAI's rule, `^[a-zA-Z0-9_-]{1,64}$`.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Checks OpenAI's `tools`: at most [`MAX_TOOLS`], each a function with a valid, distinct
/// name and, if any, an object of parameters. The error names the bad tool.
pub fn check_tools(tools: &[Value]) -> Result<(), String> {
    if tools.len() > MAX_TOOLS {
        return Err(format!("{} tools given; at most {MAX_TOOLS}", tools.len()));
    }
    let mut names = std::collections::HashSet::new();
    for (i, tool) in tools.iter().enumerate() {
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(format!("tools[{i}].type must be \"function\""));
        }
        let Some(function) = tool.get("function").and_then(Value::as_object) else {
            return Err(format!("tools[{i}].function must be an object"));
        };
        let Some(name) = function.get("name").and_then(Value::as_str) else {
            return Err(format!("tools[{i}].function.name must be a string"));
        };
        if !valid_name(name) {
            return Err(format!(
                "tools[{i}].function.name {name:?} must be 1 to 64 letters, digits, '_' or '-'"
            ));
        }
        if !names.insert(name) {
            return Err(format!("tools[{i}].function.name {name:?} is given twice"));
        }
        if let Some(p) = function.get("parameters").filter(|p| !p.is_null()) {
            if !p.is_object() {
                return Err(format!("tools[{i}].function.parameters must be a JSON schema object"));
            }
        }
    }
    Ok(())
}

/// A tool's name (after [`check_tools`]).
fn tool_name(tool: &Value) -> &str {
    tool["function"]["name"].as_str().unwrap_or_default()
}

/// One chat message for a template, from its wire parts: `tool_calls_json` is OpenAI's
/// `tool_calls` array (each `function.arguments` a JSON text, given to the template as its
/// value); empty strings mean "absent".
pub fn message(
    role: &str,
    content: &str,
    name: &str,
    tool_calls_json: &str,
    tool_call_id: &str,
) -> Result<Value, String> {
    let mut m = Map::new();
    m.insert("role".into(), role.into());
    m.insert("content".into(), content.into());
    if !name.is_empty() {
        m.insert("name".into(), name.into());
    }
    if !tool_call_id.is_empty() {
        m.insert("tool_call_id".into(), tool_call_id.into());
    }
    if !tool_calls_json.is_empty() {
        let mut calls: Vec<Value> = serde_json::from_str(tool_calls_json)
            .map_err(|e| format!("tool_calls is not a JSON array: {e}"))?;
        for (j, call) in calls.iter_mut().enumerate() {
            let function = call
                .get_mut("function")
                .and_then(Value::as_object_mut)
                .ok_or_else(|| format!("tool_calls[{j}].function must be an object"))?;
            if !function.get("name").is_some_and(Value::is_string) {
                return Err(format!("tool_calls[{j}].function.name must be a string"));
            }
            let arguments = match function.get("arguments") {
                Some(Value::String(text)) => serde_json::from_str(text)
                    .map_err(|e| format!("tool_calls[{j}].function.arguments is not JSON: {e}"))?,
                Some(v @ Value::Object(_)) => v.clone(),
                None | Some(Value::Null) => json!({}),
                Some(_) => {
                    return Err(format!("tool_calls[{j}].function.arguments must be a JSON text"))
                }
            };
            function.insert("arguments".into(), arguments);
        }
        if !calls.is_empty() {
            m.insert("tool_calls".into(), Value::Array(calls));
        }
    }
    Ok(Value::Object(m))
}

/// JSON with `", "` and `": "` separators and no other whitespace: how Hermes-format models
/// write calls, and how the grammar of a required call writes them.
pub fn spaced_json(v: &Value) -> String {
    fn write(out: &mut String, v: &Value) {
        match v {
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write(out, item);
                }
                out.push(']');
            }
            Value::Object(map) => {
                out.push('{');
                for (i, (k, item)) in map.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    let _ = write!(out, "{}: ", Value::String(k.clone()));
                    write(out, item);
                }
                out.push('}');
            }
            scalar => {
                let _ = write!(out, "{scalar}");
            }
        }
    }
    let mut out = String::new();
    write(&mut out, v);
    out
}

/// The system block that lists the tools, in the Hermes format.
fn tools_block(tools: &[Value]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are \
         provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for tool in tools {
        s.push('\n');
        s.push_str(&spaced_json(tool));
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": \
         <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// One call as the model writes it.
fn call_block(name: &str, arguments: &Value) -> String {
    format!(
        "<tool_call>\n{}\n</tool_call>",
        spaced_json(&json!({"name": name, "arguments": arguments}))
    )
}

fn content_of(m: &Value) -> &str {
    m.get("content").and_then(Value::as_str).unwrap_or_default()
}

/// `messages` with tools, calls and answers written in the Hermes format, for a template
/// that knows none of them.
pub(crate) fn hermes(messages: Vec<Value>, tools: &[Value]) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::with_capacity(messages.len() + 1);
    // Whether the last message out is a user turn made of tool answers.
    let mut answers_open = false;
    for mut m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default().to_string();
        if role == "tool" {
            let block = format!("<tool_response>\n{}\n</tool_response>", content_of(&m));
            match out.last_mut().filter(|_| answers_open) {
                Some(turn) => {
                    let joined = format!("{}\n{block}", content_of(turn));
                    turn["content"] = joined.into();
                }
                None => out.push(json!({"role": "user", "content": block})),
            }
            answers_open = true;
            continue;
        }
        answers_open = false;
        if let Some(Value::Array(calls)) = m.as_object_mut().and_then(|o| o.remove("tool_calls")) {
            let mut parts: Vec<String> =
                Some(content_of(&m).to_string()).filter(|c| !c.is_empty()).into_iter().collect();
            for call in &calls {
                let f = &call["function"];
                parts.push(call_block(f["name"].as_str().unwrap_or_default(), &f["arguments"]));
            }
            m["content"] = parts.join("\n").into();
        }
        out.push(m);
    }
    if !tools.is_empty() {
        let block = tools_block(tools);
        match out.first_mut().filter(|m| m["role"] == "system") {
            Some(system) => {
                let joined = format!("{}\n\n{block}", content_of(system));
                system["content"] = joined.into();
            }
            None => out.insert(0, json!({"role": "system", "content": block})),
        }
    }
    out
}

/// Whether `m` names a participant (`"name": "ann"` on a user, system or assistant message; a
/// tool result's `name` is its function's, which templates render or not as they choose).
pub(crate) fn names_participant(m: &Value) -> bool {
    m.get("name").is_some() && m.get("role").and_then(Value::as_str) != Some("tool")
}

/// `messages` with each participant's name written before its text (`"ann: hello"`), for a
/// template that does not render names.
pub(crate) fn names_in_content(messages: &mut [Value]) {
    for m in messages {
        if !names_participant(m) {
            continue;
        }
        let Some(name) = m.as_object_mut().and_then(|o| o.remove("name")) else { continue };
        let text = format!("{}: {}", name.as_str().unwrap_or_default(), content_of(m));
        m["content"] = text.into();
    }
}

/// Which call a request forces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForcedCall<'a> {
    /// At least one call, to any of the tools (`tool_choice: "required"`).
    Required,
    /// One call to this function.
    Named(&'a str),
}

/// The Lark grammar (llguidance's dialect) of the model's answer when `forced`: one or (if
/// `parallel`) more `<tool_call>` blocks in the Hermes format, each a JSON object whose `name`
/// is a tool's and whose `arguments` follow that tool's parameters. `None` when `Named` names
/// no tool.
pub fn tool_call_grammar(
    tools: &[Value],
    forced: ForcedCall<'_>,
    parallel: bool,
) -> Option<String> {
    let chosen: Vec<&Value> = match forced {
        ForcedCall::Required => tools.iter().collect(),
        ForcedCall::Named(name) => tools.iter().filter(|t| tool_name(t) == name).collect(),
    };
    if chosen.is_empty() {
        return None;
    }
    let alternatives: Vec<Value> = chosen
        .iter()
        .map(|t| {
            let parameters = t["function"]
                .get("parameters")
                .filter(|p| p.is_object())
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            json!({
                "type": "object",
                "properties": {"name": {"const": tool_name(t)}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    let schema = json!({"anyOf": alternatives, "x-guidance": crate::structured::json_defaults()});
    let repeat = if parallel && forced == ForcedCall::Required { " (\"\\n\" call)*" } else { "" };
    Some(format!(
        "start: call{repeat}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {schema}\n"
    ))
}

/// One piece of a model's answer when tools are on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolPiece {
    /// Text for the message's `content`.
    Content(String),
    /// A call, with its arguments as a JSON text.
    Call {
        /// The function's name.
        name: String,
        /// Its arguments, a JSON object's text.
        arguments: String,
    },
}

/// `pieces` with adjacent content joined, as a client joins streamed deltas.
pub fn merged(pieces: Vec<ToolPiece>) -> Vec<ToolPiece> {
    let mut out: Vec<ToolPiece> = Vec::with_capacity(pieces.len());
    for piece in pieces {
        match (out.last_mut(), piece) {
            (Some(ToolPiece::Content(a)), ToolPiece::Content(b)) => a.push_str(&b),
            (_, piece) => out.push(piece),
        }
    }
    out
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Reads Hermes-format calls out of text that arrives in pieces. Text outside the blocks is
/// content, except whitespace that only separates calls or ends the answer; a block that does
/// not parse as a call stays content, as written. Pieces come out as soon as they are certain:
/// content is held back only while it could be the start of `<tool_call>`.
#[derive(Debug, Default, Clone)]
pub struct ToolCallParser {
    /// Text not yet given out.
    buf: String,
    /// Whether `buf` is inside a `<tool_call>` block.
    in_call: bool,
    /// Whitespace content held until text follows it.
    blank: String,
    /// Calls given out so far.
    calls: usize,
    /// Give out at most one call (later ones are dropped).
    single: bool,
}

impl ToolCallParser {
    /// A parser; with `single`, calls after the first are dropped (`parallel_tool_calls`
    /// false).
    pub fn new(single: bool) -> Self {
        Self { single, ..Self::default() }
    }

    /// Calls given out so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    fn content(&mut self, text: &str, out: &mut Vec<ToolPiece>) {
        if text.is_empty() {
            return;
        }
        // Trailing whitespace waits for what follows it, whether the text came whole or not.
        let body = text.trim_end();
        if body.is_empty() {
            self.blank.push_str(text);
            return;
        }
        let mut s = std::mem::take(&mut self.blank);
        s.push_str(body);
        self.blank.push_str(&text[body.len()..]);
        match out.last_mut() {
            Some(ToolPiece::Content(c)) => c.push_str(&s),
            _ => out.push(ToolPiece::Content(s)),
        }
    }

    fn call(&mut self, body: &str, out: &mut Vec<ToolPiece>) -> bool {
        let Some((name, arguments)) = parse_call(body) else { return false };
        self.blank.clear();
        if !(self.single && self.calls > 0) {
            out.push(ToolPiece::Call { name, arguments });
        }
        self.calls += 1;
        true
    }

    /// Takes the next piece of text.
    pub fn push(&mut self, text: &str) -> Vec<ToolPiece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let Some(end) = self.buf.find(CLOSE) else { break };
                let block: String = self.buf.drain(..end + CLOSE.len()).collect();
                self.in_call = false;
                let body = &block[..end];
                if !self.call(body, &mut out) {
                    self.content(&format!("{OPEN}{block}"), &mut out);
                }
            } else if let Some(start) = self.buf.find(OPEN) {
                let before: String = self.buf.drain(..start + OPEN.len()).collect();
                self.content(&before[..start], &mut out);
                self.blank.clear();
                self.in_call = true;
            } else {
                // Keep back the longest end of the text that could begin `<tool_call>`.
                let keep = (1..OPEN.len())
                    .rev()
                    .find(|k| {
                        self.buf.len() >= *k
                            && self.buf.is_char_boundary(self.buf.len() - k)
                            && OPEN.starts_with(&self.buf[self.buf.len() - k..])
                    })
                    .unwrap_or(0);
                let ready: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.content(&ready, &mut out);
                break;
            }
        }
        out
    }

    /// The end of the text: what was held back. An open block (the model stopped before
    /// `</tool_call>`) is a call if its text is one, else content.
    pub fn finish(&mut self) -> Vec<ToolPiece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        if self.in_call {
            self.in_call = false;
            if !self.call(&rest, &mut out) {
                self.content(&format!("{OPEN}{rest}"), &mut out);
            }
        } else {
            self.content(&rest, &mut out);
        }
        self.blank.clear();
        out
    }
}

/// A call's name and arguments (a JSON object's text) from a block's body:
/// `{"name": …, "arguments": {…}}` (`parameters` is taken for `arguments`, and arguments given
/// as a JSON text are read).
fn parse_call(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(text)) => serde_json::from_str(text).ok()?,
        Some(a) => a.clone(),
    };
    arguments.is_object().then(|| (name, arguments.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(text: &str) -> Vec<ToolPiece> {
        let mut p = ToolCallParser::new(false);
        let mut out = p.push(text);
        out.extend(p.finish());
        merged(out)
    }

    /// The pieces of `text` fed one char at a time, merged as a client would.
    fn by_chars(text: &str) -> Vec<ToolPiece> {
        let mut p = ToolCallParser::new(false);
        let mut pieces = Vec::new();
        for c in text.chars() {
            pieces.extend(p.push(&c.to_string()));
        }
        pieces.extend(p.finish());
        merged(pieces)
    }

    fn call(name: &str, arguments: &str) -> ToolPiece {
        ToolPiece::Call { name: name.into(), arguments: arguments.into() }
    }

    #[test]
    fn calls_and_content_come_out_the_same_whole_or_in_pieces() {
        let cases = [
            (
                "Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>\n",
                vec![
                    ToolPiece::Content("Let me look.".into()),
                    call("weather", "{\"city\":\"Paris\"}"),
                    call("time", "{}"),
                ],
            ),
            ("Plain answer, a < b.", vec![ToolPiece::Content("Plain answer, a < b.".into())]),
            // Not a call: kept as written.
            (
                "<tool_call>oops</tool_call> done",
                vec![ToolPiece::Content("<tool_call>oops</tool_call> done".into())],
            ),
            // Stopped before the close: still a call when its body is one.
            (
                "<tool_call>\n{\"name\": \"f\", \"parameters\": {\"x\": 1}}",
                vec![call("f", "{\"x\":1}")],
            ),
            // Cut short: content.
            ("<tool_call>\n{\"name\": \"f\", \"argu", vec![ToolPiece::Content("<tool_call>\n{\"name\": \"f\", \"argu".into())]),
            ("ends with <tool_c", vec![ToolPiece::Content("ends with <tool_c".into())]),
            ("é<tool_call>{\"name\": \"g\", \"arguments\": \"{\\\"a\\\": [1]}\"}</tool_call>", vec![ToolPiece::Content("é".into()), call("g", "{\"a\":[1]}")]),
        ];
        for (text, want) in cases {
            assert_eq!(whole(text), want, "{text:?}");
            assert_eq!(by_chars(text), want, "{text:?} by chars");
        }
    }

    #[test]
    fn a_single_call_parser_drops_later_calls() {
        let mut p = ToolCallParser::new(true);
        let text = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>";
        let out = p.push(text);
        assert_eq!(out, vec![call("a", "{}")]);
        assert_eq!(p.calls(), 2);
    }

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "time"}}),
        ]
    }

    #[test]
    fn tools_are_checked_with_the_bad_one_named() {
        assert_eq!(check_tools(&tools()), Ok(()));
        for (tool, needle) in [
            (json!({"type": "retrieval"}), "tools[0].type must be \"function\""),
            (json!({"type": "function"}), "tools[0].function must be an object"),
            (json!({"type": "function", "function": {"name": "a b"}}), "must be 1 to 64 letters"),
            (json!({"type": "function", "function": {"name": ""}}), "must be 1 to 64 letters"),
            (
                json!({"type": "function", "function": {"name": "f", "parameters": 3}}),
                "parameters must be a JSON schema object",
            ),
        ] {
            let err = check_tools(&[tool]).unwrap_err();
            assert!(err.contains(needle), "{err}");
        }
        let twice = [tools()[1].clone(), tools()[1].clone()];
        assert!(check_tools(&twice).unwrap_err().contains("given twice"));
        let many = vec![tools()[1].clone(); MAX_TOOLS + 1];
        assert!(check_tools(&many).unwrap_err().contains("at most 128"));
    }

    #[test]
    fn hermes_writes_tools_calls_and_answers_into_the_conversation() {
        let calls = json!([{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]).to_string();
        let messages = vec![
            message("user", "Weather in Paris?", "", "", "").unwrap(),
            message("assistant", "", "", &calls, "").unwrap(),
            message("tool", "18 C", "", "", "c1").unwrap(),
            message("tool", "sunny", "", "", "c1").unwrap(),
        ];
        let out = hermes(messages, &tools());
        assert_eq!(out.len(), 4, "{out:#?}");
        assert_eq!(out[0]["role"], "system");
        let system = out[0]["content"].as_str().unwrap();
        assert!(
            system
                .contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"weather\""),
            "{system}"
        );
        assert_eq!(
            out[2]["content"],
            "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
        );
        assert_eq!(out[3]["role"], "user");
        assert_eq!(
            out[3]["content"],
            "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
        );
        // The call as written back parses as the call it was.
        let mut p = ToolCallParser::new(false);
        let mut pieces = p.push(out[2]["content"].as_str().unwrap());
        pieces.extend(p.finish());
        assert_eq!(pieces, vec![call("weather", "{\"city\":\"Paris\"}")]);
        let err = message(
            "assistant",
            "",
            "",
            "[{\"function\": {\"name\": \"f\", \"arguments\": \"{\"}}]",
            "",
        )
        .unwrap_err();
        assert!(err.contains("tool_calls[0].function.arguments is not JSON"), "{err}");
    }

    #[test]
    fn the_forced_call_grammar_names_only_the_chosen_tools() {
        let g = tool_call_grammar(&tools(), ForcedCall::Named("time"), true).unwrap();
        assert!(g.contains("\"const\":\"time\"") && !g.contains("weather"), "{g}");
        assert!(!g.contains(")*"), "a named call is one call: {g}");
        let g = tool_call_grammar(&tools(), ForcedCall::Required, true).unwrap();
        assert!(g.contains("weather") && g.contains("(\"\\n\" call)*"), "{g}");
        assert!(tool_call_grammar(&tools(), ForcedCall::Named("nope"), false).is_none());
    }
}
