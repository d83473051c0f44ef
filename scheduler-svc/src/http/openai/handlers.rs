//! The endpoints `POST /v1/completions` and `POST /v1/chat/completions`.
//! Each reads its body ([`super::validate`]), builds the front's `GenerateRequest` from it
//! ([`super::translate`] and its own input: a prompt or a chat), and answers through [`run`],
//! which calls the front exactly as a gRPC client would and shapes what comes back, whole or
//! streamed.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use ferry_proto::v1::{self, generation_server::Generation};
use futures_util::stream::StreamExt;
use serde_json::Value;

use super::ids::{rand_id, unix_now};
use super::request_body::{ChatBody, Common, CompletionBody, Content, PromptInput};
use super::response_body::{Kind, Shaper};
use super::sse::sse_response;
use super::tool_calls::{tool_use, ToolReader, ToolUse};
use super::translate::generate_request;
use super::validate::parse;
use crate::front::{GenerationService, MAX_SAMPLES};
use crate::http::fields::Endpoint;
use crate::http::ApiError;

/// Calls the front with `req`, after what only the served model can add (vLLM's
/// `truncate_prompt_tokens: -1`, `bad_words` as token sequences) and with the caller's trace
/// context and key, then answers: the whole answer as one JSON body, or an SSE stream.
async fn run(
    front: GenerationService,
    (kind, echo, tools, echo_first): (Kind, String, Option<ToolReader>, Option<u32>),
    best_of: Option<(usize, bool)>,
    common: &Common,
    req: v1::GenerateRequest,
    headers: &HeaderMap,
) -> Result<Response, ApiError> {
    // The model asked for (a LoRA adapter's name, or a base model's) is the one answering.
    let base = front.models().base_of(&req.model);
    let file = base.file.clone();
    let model = if req.model.is_empty() { base.name().to_string() } else { req.model.clone() };
    let mut req = req;
    if common.truncate_prompt_tokens == Some(-1) {
        let longest = front.limits().max_prompt_tokens.min(base.max_model_len.saturating_sub(1));
        req.truncate_prompt_tokens = u32::try_from(longest).unwrap_or(u32::MAX);
    }
    if let Some(words) = common.bad_words.as_deref().filter(|w| !w.is_empty()) {
        let tok = &base.file.tokenizer;
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
        file,
        echo,
        tools,
        readers: std::collections::HashMap::new(),
        best_of,
        continuous_usage,
        echo_first,
        chunk_head: String::new(),
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
    Ok(sse_response(shaper, stream, include_usage))
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
    // The prompt as text, for `echo`: as given, or its tokens decoded (by the model asked).
    let tok = &front.models().base_of(&req.model).file.tokenizer;
    let echoed = match (&body.prompt, echo) {
        (_, false) => String::new(),
        (PromptInput::Text(t), true) => t.clone(),
        (PromptInput::Texts(v), true) => v.concat(),
        (PromptInput::Tokens(ids), true) => tok.decode(ids),
    };
    // The prompt's first token, which leads the echoed log-probabilities.
    let echo_first = match &body.prompt {
        _ if !echo_logprobs => None,
        PromptInput::Tokens(ids) => ids.first().copied(),
        _ => tok.encode(&echoed).ok().and_then(|ids| ids.first().copied()),
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
