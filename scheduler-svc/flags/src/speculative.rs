//! `--speculative-config`: vLLM's JSON spelling of speculative decoding, read into the core's
//! [`SpeculativeConfig`](ferry_sched_core::SpeculativeConfig) with vLLM's defaults, and refused
//! with the reason when the core would not run it.

use ferry_sched_core as core;

use crate::FlagError;

/// `--speculative-config`'s JSON, as vLLM's `SpeculativeConfig` spells it.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SpeculativeJson {
    method: Option<String>,
    num_speculative_tokens: Option<usize>,
    prompt_lookup_max: Option<usize>,
    prompt_lookup_min: Option<usize>,
    disable_by_batch_size: Option<usize>,
}

/// Parses `--speculative-config` into the core's settings, checked.
pub fn parse_speculative_config(json: &str) -> Result<core::SpeculativeConfig, FlagError> {
    let bad = |why: String| FlagError::Speculative { why };
    let spec: SpeculativeJson = serde_json::from_str(json).map_err(|e| bad(e.to_string()))?;
    match spec.method.as_deref() {
        Some("ngram") => {}
        None => return Err(bad("\"method\" is required; the method served is \"ngram\"".into())),
        Some(other) => {
            return Err(bad(format!(
                "method {other:?} is not served: only \"ngram\" (prompt lookup); a draft \
                 model's proposals are not implemented yet"
            )))
        }
    }
    let k = spec
        .num_speculative_tokens
        .ok_or_else(|| bad("\"num_speculative_tokens\" is required".into()))?;
    // vLLM's defaults: both 5 when neither is given, else the one given for both.
    let (min, max) = match (spec.prompt_lookup_min, spec.prompt_lookup_max) {
        (None, None) => (5, 5),
        (Some(n), None) | (None, Some(n)) => (n, n),
        (Some(min), Some(max)) => (min, max),
    };
    let config = core::SpeculativeConfig {
        num_speculative_tokens: k,
        prompt_lookup_max: max,
        prompt_lookup_min: min,
        disable_by_batch_size: spec.disable_by_batch_size,
    };
    config.validate().map_err(|e| match e {
        core::ConfigError::Speculative(why) => bad(why),
        other => bad(other.to_string()),
    })?;
    Ok(config)
}
