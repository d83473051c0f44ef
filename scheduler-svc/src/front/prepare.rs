//! Checking a client's request and turning it into what the scheduler needs: tokens, limits,
//! stop rules and sampling parameters. Every refusal says what was wrong and the limit.

use std::sync::Arc;

use ferry_model::sampling::SamplingParams;
use ferry_model::{ChatMessage, ModelFile};
use ferry_proto::v1;

use crate::request::RequestSpec;

/// Why a request was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PrepareError {
    /// The request names a model this front does not serve.
    #[error("model {asked:?} is not served here; available: {served:?}")]
    UnknownModel {
        /// Asked for.
        asked: String,
        /// Served.
        served: String,
    },
    /// The caller tokenized for another model (its fingerprint differs).
    #[error(
        "the request was tokenized for the model with fingerprint {asked}, but this scheduler \
         serves {served:?} with fingerprint {fingerprint}: give the front and the scheduler the \
         same model file"
    )]
    OtherModel {
        /// The caller's fingerprint.
        asked: String,
        /// The served model's name.
        served: String,
        /// Its fingerprint.
        fingerprint: String,
    },
    /// Anything else the client got wrong.
    #[error("{0}")]
    Invalid(String),
}

/// The model a front serves.
#[derive(Debug, Clone)]
pub struct ServedModel {
    /// The model file: name, fingerprint, tokenizer and chat template.
    pub file: Arc<ModelFile>,
    /// Largest prompt + output accepted: the model's, capped to what the smallest executor's
    /// KV cache holds for one request.
    pub max_model_len: usize,
}

impl ServedModel {
    /// The name clients use.
    pub fn name(&self) -> &str {
        &self.file.name
    }
}

/// Most stop strings per request (as vLLM's OpenAI server has no limit, this one is generous).
pub const MAX_STOP_STRINGS: usize = 16;

/// Refuses a request for another model than `model`, by name or by fingerprint.
fn check_model(model: &ServedModel, req: &v1::GenerateRequest) -> Result<(), PrepareError> {
    if !req.model.is_empty() && req.model != model.name() {
        return Err(PrepareError::UnknownModel {
            asked: req.model.clone(),
            served: model.name().to_string(),
        });
    }
    if !req.model_fingerprint.is_empty() && req.model_fingerprint != model.file.fingerprint {
        return Err(PrepareError::OtherModel {
            asked: req.model_fingerprint.clone(),
            served: model.name().to_string(),
            fingerprint: model.file.fingerprint.clone(),
        });
    }
    Ok(())
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
            let messages: Vec<ChatMessage> = chat
                .messages
                .iter()
                .map(|m| ChatMessage { role: m.role.clone(), content: m.content.clone() })
                .collect();
            let text = tok
                .apply_chat_template(&messages, chat.add_generation_prompt)
                .map_err(|e| invalid(format!("chat: {e}")))?;
            tok.encode(&text).map_err(|e| invalid(format!("chat: {e}")))?
        }
        None => return Err(invalid("no input: give a prompt, prompt_token_ids or a chat".into())),
    })
}

/// Checks `req` against `model`; the spec comes back without a trace context.
pub fn prepare(
    model: &ServedModel,
    req: &v1::GenerateRequest,
) -> Result<RequestSpec, PrepareError> {
    let invalid = |m: String| PrepareError::Invalid(m);
    check_model(model, req)?;
    let tok = &model.file.tokenizer;
    let prompt = prompt_tokens(model, req)?;
    if prompt.is_empty() {
        return Err(invalid("the prompt is empty".into()));
    }
    let max_len = model.max_model_len;
    if prompt.len() >= max_len {
        return Err(invalid(format!(
            "the prompt has {} tokens; this model allows at most {} tokens of prompt and output together",
            prompt.len(),
            max_len
        )));
    }
    let stopping = req.stopping.clone().unwrap_or_default();
    let room = max_len - prompt.len();
    let max_tokens = if stopping.max_tokens == 0 { room } else { stopping.max_tokens as usize };
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
    if stopping.stop.len() > MAX_STOP_STRINGS {
        return Err(invalid(format!(
            "{} stop strings given; at most {MAX_STOP_STRINGS}",
            stopping.stop.len()
        )));
    }
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
    let sampling = req.sampling.unwrap_or_default();
    SamplingParams::from_proto(&sampling, 0).validate().map_err(|e| invalid(e.to_string()))?;
    Ok(RequestSpec {
        prompt: prompt.into(),
        prior_output: output,
        max_tokens,
        min_tokens: stopping.min_tokens as usize,
        stop: stopping.stop,
        stop_token_ids: stopping.stop_token_ids,
        ignore_eos: stopping.ignore_eos,
        include_stop_str: stopping.include_stop_str_in_output,
        sampling,
        priority: req.priority,
        traceparent: String::new(),
    })
}
