//! Response shaping: the front's `GenerateEvent`s turned into OpenAI's JSON, for both
//! endpoints: a streamed chunk per event, the usage chunk, or the whole answer (one choice per
//! sample; `best_of` keeps the best `n`). Log-probabilities, prompt log-probabilities, `echo`
//! and tool calls are put where each endpoint's clients look for them.

use std::fmt::Write as _;

use ferry_proto::v1;
use serde_json::{json, Value};

use super::tool_calls::ToolReader;

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

/// A looped model's answer: the recurrent loops each of its tokens ran, in `choice` as
/// `recurrent_loops` (a Ferry extension; absent for a plain model).
fn with_loops<'a>(choice: &mut Value, loops: impl IntoIterator<Item = &'a u32>) {
    let loops: Vec<u32> = loops.into_iter().copied().collect();
    if !loops.is_empty() {
        choice["recurrent_loops"] = json!(loops);
    }
}

/// Which endpoint a response is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Completion,
    Chat,
}

/// Builds the per-event JSON for both endpoints.
pub(super) struct Shaper {
    pub(super) kind: Kind,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    /// The base model answering (its tokenizer gives the log-probabilities' token texts).
    pub(super) file: std::sync::Arc<ferry_model::ModelFile>,
    /// The prompt's text, put before the answer (`echo`); empty when not asked.
    pub(super) echo: String,
    /// Reads tool calls out of a chat answer, when its request has tools: how (the first
    /// choice's reader, the others' made like it), and each choice's reader.
    pub(super) tools: Option<ToolReader>,
    pub(super) readers: std::collections::HashMap<u32, ToolReader>,
    /// `best_of`: keep the `n` samples of the highest cumulative log-probability, and show
    /// their log-probabilities only if the client asked for them.
    pub(super) best_of: Option<(usize, bool)>,
    /// Every chunk carries the usage so far (`stream_options.continuous_usage_stats`).
    pub(super) continuous_usage: bool,
    /// Completions with `echo` and `logprobs`: the prompt's first token, whose log-probability
    /// (none) leads the echoed prompt's.
    pub(super) echo_first: Option<u32>,
    /// The start of every plain chunk (`{"id":…,"choices":[{"index":`), made at the first.
    pub(super) chunk_head: String,
}

impl Shaper {
    fn token_text(&self, id: u32) -> String {
        self.file.tokenizer.decode(&[id])
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

    /// One streamed chunk for `ev` (`first`: its choice's first, which carries the role and
    /// the echo).
    pub(super) fn chunk(&mut self, ev: &v1::GenerateEvent, first: bool) -> Value {
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
        with_loops(&mut chunk["choices"][0], &ev.loops);
        if self.continuous_usage {
            chunk["usage"] = usage_json(ev.usage);
        }
        chunk
    }

    /// [`Self::chunk`] as the text sent, appended to `out`. A chunk of text alone (no log-probabilities, tool
    /// calls or usage: the common case, once per streamed token) is written directly, the same
    /// bytes as the `Value` would give, without building it.
    pub(super) fn chunk_into(&mut self, ev: &v1::GenerateEvent, first: bool, out: &mut String) {
        let plain = ev.logprobs.is_empty()
            && ev.prompt_logprobs.is_empty()
            && ev.loops.is_empty()
            && !self.continuous_usage
            && (self.kind == Kind::Completion || self.tools.is_none());
        if !plain {
            let _ = write!(out, "{}", self.chunk(ev, first));
            return;
        }
        if self.chunk_head.is_empty() {
            let object =
                if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
            self.chunk_head = format!(
                r#"{{"id":{},"object":"{object}","created":{},"model":{},"choices":[{{"index":"#,
                Value::from(self.id.as_str()),
                self.created,
                Value::from(self.model.as_str())
            );
        }
        // The text as a JSON string, escaped straight from the event (the echo only in front of
        // a first chunk's).
        let text = if first && !self.echo.is_empty() {
            serde_json::to_string(&format!("{}{}", self.echo, ev.text))
        } else {
            serde_json::to_string(&ev.text)
        }
        .expect("a string serializes");
        out.reserve(self.chunk_head.len() + text.len() + 80);
        out.push_str(&self.chunk_head);
        let _ = write!(out, "{}", ev.index);
        match self.kind {
            Kind::Completion => {
                out.push_str(r#","text":"#);
                out.push_str(&text);
            }
            Kind::Chat => {
                out.push_str(r#","delta":{"content":"#);
                out.push_str(&text);
                if first {
                    out.push_str(r#","role":"assistant""#);
                }
                out.push('}');
            }
        }
        out.push_str(r#","logprobs":null,"finish_reason":"#);
        match finish_reason(ev.finish_reason()) {
            Some(reason) => {
                let _ = write!(out, r#""{reason}""#);
            }
            None => out.push_str("null"),
        }
        out.push_str("}]}");
    }

    /// The streamed answer's closing chunk with the whole request's usage.
    pub(super) fn usage_chunk(&self, usage: Option<v1::Usage>) -> Value {
        let object =
            if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        json!({ "id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [], "usage": usage_json(usage) })
    }

    /// The whole answer: one choice per sample (`best_of`: the best `n`, by cumulative
    /// log-probability), usage counting the prompt once and every sample's tokens.
    pub(super) fn whole(&mut self, events: &[v1::GenerateEvent]) -> Value {
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
        let mut choice = choice;
        with_loops(&mut choice, events.iter().flat_map(|e| &e.loops));
        (choice, prompt_logprobs)
    }
}
