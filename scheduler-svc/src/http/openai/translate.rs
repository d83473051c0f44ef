//! The translation of the fields both endpoints share into the front's own `GenerateRequest`
//! (sampling, stopping, priority): the values checked ([`check_values`], `n`, `max_tokens`),
//! OpenAI's defaults filled in where the client gives none, the structured output and the
//! logit bias read. Each endpoint then adds its input (a prompt or a chat) to the request built
//! here; what needs the served model (its tokenizer, its length) is added by the handler.

use ferry_proto::v1;

use super::request_body::{Common, OneOrMany};
use super::structured_output::structured_output;
use super::validate::{check_values, logit_bias};
use crate::front::MAX_SAMPLES;
use crate::http::ApiError;

/// The shared part of a `GenerateRequest`; `default_max` applies when the client gives none.
pub(super) fn generate_request(
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
            max_loops: c.max_loops,
            exit_threshold: c.exit_threshold,
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
