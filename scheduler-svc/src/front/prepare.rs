//! Checking a client's request and turning it into what the scheduler needs: tokens, limits,
//! stop rules and sampling parameters. Every refusal says what was wrong and the limit.

use ferry_model::sampling::{LogitAdjust, SamplingParams};
use ferry_proto::v1;

use crate::front::models::{ModelRefusal, Models, ServedModel};
use crate::request::{OutputShape, RequestSpec};

/// Why a request was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PrepareError {
    /// It names a model this front does not serve, or was tokenized for another.
    #[error(transparent)]
    Model(#[from] ModelRefusal),
    /// Anything else the client got wrong.
    #[error("{0}")]
    Invalid(String),
}

/// What one request may ask for (the front's flags; see `FrontArgs`). The lengths are
/// further capped by the model's maximum length ([`ServedModel::max_model_len`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Most prompt tokens.
    pub max_prompt_tokens: usize,
    /// Most tokens generated (`max_tokens`).
    pub max_output_tokens: usize,
    /// Most stop strings.
    pub max_stop_strings: usize,
    /// Longest stop string, in bytes.
    pub max_stop_string_bytes: usize,
    /// Most stop token ids.
    pub max_stop_token_ids: usize,
    /// Most alternatives per position (`top_logprobs`, the completions API's `logprobs`).
    pub max_logprobs: u32,
    /// Largest request body or message, in bytes.
    pub max_request_bytes: usize,
}

impl RequestLimits {
    /// Default `--max-stop-strings`.
    pub const STOP_STRINGS: u32 = 16;
    /// Default `--max-stop-string-bytes`.
    pub const STOP_STRING_BYTES: u32 = 1024;
    /// Default `--max-stop-token-ids`.
    pub const STOP_TOKEN_IDS: u32 = 64;
    /// Default `--max-logprobs`: what executors compute.
    pub const LOGPROBS: u32 = ferry_model::sampling::MAX_TOP_LOGPROBS;
    /// Default `--max-request-bytes`: 4 MiB.
    pub const REQUEST_BYTES: u32 = 4 << 20;
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            max_prompt_tokens: usize::MAX,
            max_output_tokens: usize::MAX,
            max_stop_strings: Self::STOP_STRINGS as usize,
            max_stop_string_bytes: Self::STOP_STRING_BYTES as usize,
            max_stop_token_ids: Self::STOP_TOKEN_IDS as usize,
            max_logprobs: Self::LOGPROBS,
            max_request_bytes: Self::REQUEST_BYTES as usize,
        }
    }
}

/// The prompt's tokens: text tokenized, token ids checked, or a chat rendered and tokenized.
fn prompt_tokens(model: &ServedModel, req: &v1::GenerateRequest) -> Result<Vec<u32>, PrepareError> {
    let invalid = |m: String| PrepareError::Invalid(m);
    let tok = &model.file.tokenizer;
    Ok(match &req.input {
        Some(v1::generate_request::Input::Prompt(text)) => {
            tok.encode(text).map_err(|e| invalid(format!("prompt: {e}")))?
        }
        Some(v1::generate_request::Input::PromptTokenIds(ids)) => {
            if let Some(t) = ids.ids.iter().find(|t| **t as usize >= tok.vocab_size()) {
                return Err(invalid(format!(
                    "prompt token id {t} is outside the vocabulary (size {})",
                    tok.vocab_size()
                )));
            }
            ids.ids.clone()
        }
        Some(v1::generate_request::Input::Chat(chat)) => {
            if chat.messages.is_empty() {
                return Err(invalid("chat has no messages".into()));
            }
            tok.encode(&render_chat(tok, chat)?).map_err(|e| invalid(format!("chat: {e}")))?
        }
        None => return Err(invalid("no input: give a prompt, prompt_token_ids or a chat".into())),
    })
}

/// A chat rendered with the model's template: its messages, tools and template variables
/// read from their JSON and checked.
fn render_chat(tok: &ferry_model::Tokenizer, chat: &v1::Chat) -> Result<String, PrepareError> {
    use ferry_model::chat;
    let invalid = |m: String| PrepareError::Invalid(format!("chat: {m}"));
    let messages = chat
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            chat::message(&m.role, &m.content, &m.name, &m.tool_calls_json, &m.tool_call_id)
                .map_err(|e| invalid(format!("messages[{i}].{e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let tools: Vec<serde_json::Value> = if chat.tools_json.is_empty() {
        Vec::new()
    } else {
        serde_json::from_str(&chat.tools_json)
            .map_err(|e| invalid(format!("tools is not a JSON array: {e}")))?
    };
    chat::check_tools(&tools).map_err(invalid)?;
    let kwargs: Option<serde_json::Map<String, serde_json::Value>> =
        if chat.template_kwargs_json.is_empty() {
            None
        } else {
            Some(
                serde_json::from_str(&chat.template_kwargs_json).map_err(|e| {
                    invalid(format!("chat_template_kwargs is not a JSON object: {e}"))
                })?,
            )
        };
    let options = chat::ChatOptions {
        add_generation_prompt: chat.add_generation_prompt,
        continue_final_message: chat.continue_final_message,
        tools: &tools,
        kwargs: kwargs.as_ref(),
        now: None,
    };
    tok.render_chat(messages, &options).map_err(|e| invalid(e.to_string()))
}

/// Refuses stop rules past `limits`.
fn check_stop_rules(
    limits: &RequestLimits,
    stopping: &v1::StoppingCriteria,
) -> Result<(), PrepareError> {
    if stopping.stop.len() > limits.max_stop_strings {
        return Err(PrepareError::Invalid(format!(
            "{} stop strings given; at most {} (--max-stop-strings)",
            stopping.stop.len(),
            limits.max_stop_strings
        )));
    }
    if let Some(long) = stopping.stop.iter().find(|s| s.len() > limits.max_stop_string_bytes) {
        return Err(PrepareError::Invalid(format!(
            "a stop string of {} bytes; at most {} (--max-stop-string-bytes)",
            long.len(),
            limits.max_stop_string_bytes
        )));
    }
    if stopping.stop_token_ids.len() > limits.max_stop_token_ids {
        return Err(PrepareError::Invalid(format!(
            "{} stop token ids given; at most {} (--max-stop-token-ids)",
            stopping.stop_token_ids.len(),
            limits.max_stop_token_ids
        )));
    }
    Ok(())
}

/// Compiles a structured output's grammar for the model's vocabulary (and replays a
/// continuation's tokens into it), so that a bad grammar is refused here, with llguidance's
/// reason, rather than by the executor after placement.
fn check_grammar(
    model: &ServedModel,
    constraint: &v1::StructuredOutput,
    output: &[u32],
) -> Result<(), PrepareError> {
    let invalid =
        |e: ferry_model::GrammarError| PrepareError::Invalid(format!("structured output: {e}"));
    model.file.grammars().map_err(invalid)?.compile_after(constraint, output).map_err(invalid)?;
    Ok(())
}

/// The prompt's tokens, truncated as asked and checked against the limits and the model's
/// length.
fn checked_prompt(
    model: &ServedModel,
    limits: &RequestLimits,
    req: &v1::GenerateRequest,
) -> Result<Vec<u32>, PrepareError> {
    let invalid = |m: String| PrepareError::Invalid(m);
    let mut prompt = prompt_tokens(model, req)?;
    let keep = req.truncate_prompt_tokens as usize;
    // The longest prompt this server takes: its limit, and the model's length less one token
    // to generate.
    let longest = limits.max_prompt_tokens.min(model.max_model_len.saturating_sub(1));
    if keep > longest {
        return Err(invalid(format!(
            "truncate_prompt_tokens = {keep} is more than the longest prompt this server \
             takes, {longest} tokens"
        )));
    }
    if keep > 0 && prompt.len() > keep {
        // vLLM's truncation: the prompt's last tokens are kept.
        prompt.drain(..prompt.len() - keep);
    }
    if prompt.is_empty() {
        return Err(invalid("the prompt is empty".into()));
    }
    if prompt.len() > limits.max_prompt_tokens {
        return Err(invalid(format!(
            "the prompt has {} tokens; this server accepts at most {} (--max-prompt-tokens)",
            prompt.len(),
            limits.max_prompt_tokens
        )));
    }
    let max_len = model.max_model_len;
    if prompt.len() >= max_len {
        return Err(invalid(format!(
            "the prompt has {} tokens; this model allows at most {} tokens of prompt and output together",
            prompt.len(),
            max_len
        )));
    }
    Ok(prompt)
}

/// Checks `req` against the model it names among `models` and `limits`; the spec comes back
/// without a trace context.
pub fn prepare(
    models: &Models,
    limits: &RequestLimits,
    req: &v1::GenerateRequest,
) -> Result<RequestSpec, PrepareError> {
    let invalid = |m: String| PrepareError::Invalid(m);
    let (model_id, lora) = models.resolve(&req.model, &req.model_fingerprint)?;
    let model = models.get(model_id);
    let tok = &model.file.tokenizer;
    let prompt = checked_prompt(model, limits, req)?;
    let max_len = model.max_model_len;
    let stopping = req.stopping.clone().unwrap_or_default();
    let room = max_len - prompt.len();
    if stopping.max_tokens as usize > limits.max_output_tokens {
        return Err(invalid(format!(
            "max_tokens {} is more than this server generates per request, {} (--max-output-tokens)",
            stopping.max_tokens, limits.max_output_tokens
        )));
    }
    let max_tokens = match stopping.max_tokens {
        0 => room.min(limits.max_output_tokens),
        n => n as usize,
    };
    if max_tokens > room {
        return Err(invalid(format!(
            "max_tokens {max_tokens} + {} prompt tokens exceeds the model's maximum length of {max_len}",
            prompt.len()
        )));
    }
    if stopping.min_tokens as usize > max_tokens {
        return Err(invalid(format!(
            "min_tokens {} exceeds max_tokens {max_tokens}",
            stopping.min_tokens
        )));
    }
    check_stop_rules(limits, &stopping)?;
    let output = req.output_token_ids.clone();
    if let Some(t) = output.iter().find(|t| **t as usize >= tok.vocab_size()) {
        return Err(invalid(format!(
            "output token id {t} is outside the vocabulary (size {})",
            tok.vocab_size()
        )));
    }
    if output.len() >= max_tokens {
        return Err(invalid(format!(
            "{} output_token_ids leave nothing to generate within max_tokens {max_tokens}",
            output.len()
        )));
    }
    let mut sampling = req.sampling.clone().unwrap_or_default();
    // A request without a seed gets one here, once: it travels with the request wherever it
    // moves (another executor, another scheduler), so a moved request's draws, keyed by seed
    // and position, continue exactly as they would have where it started.
    if sampling.seed.is_none() {
        let bytes = ferry_runtime::secret::random();
        sampling.seed = Some(u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")));
    }
    if sampling.top_logprobs > limits.max_logprobs {
        return Err(invalid(format!(
            "{} log-probabilities per position asked for; at most {} (--max-logprobs)",
            sampling.top_logprobs, limits.max_logprobs
        )));
    }
    SamplingParams::from_proto(&sampling, 0).validate().map_err(|e| invalid(e.to_string()))?;
    LogitAdjust::from_proto(&sampling)
        .validate(tok.vocab_size())
        .map_err(|e| invalid(e.to_string()))?;
    if let Some(constraint) = &sampling.structured_output {
        check_grammar(model, constraint, &output)?;
    }
    Ok(RequestSpec {
        prompt: prompt.into(),
        prior_output: output,
        max_tokens,
        min_tokens: stopping.min_tokens as usize,
        stop_token_ids: stopping.stop_token_ids,
        ignore_eos: stopping.ignore_eos,
        output: OutputShape {
            stop: stopping.stop,
            include_stop_str: stopping.include_stop_str_in_output,
            keep_special_tokens: req.keep_special_tokens,
            continuous_usage: req.continuous_usage,
        },
        sampling,
        priority: req.priority,
        traceparent: String::new(),
        model: model_id,
        lora,
    })
}
