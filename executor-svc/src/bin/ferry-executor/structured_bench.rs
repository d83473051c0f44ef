//! `ferry-executor bench --structured`: what structured outputs cost — sampled decode through
//! the engine (its mask thread included) with and without a JSON schema, the masks' time per
//! token and how long steps waited for them.

use std::time::Instant;

use ferry_executor_svc::forward::{KvDtype, LoadedModel};

use crate::forward_bench::BS;

/// One structured-output round: `batch` sampled requests decoding through the engine, each
/// constrained by a JSON schema or not.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GrammarRow {
    /// Requests per step.
    pub batch: usize,
    /// Whether the requests had a grammar.
    pub constrained: bool,
    /// Decode tokens per second (all requests together).
    pub tokens_per_s: f64,
    /// Mask computation per constrained token, microseconds (on the thread beside the forward).
    pub mask_us_per_token: f64,
    /// Time a step waited for its masks after the forward, per step, microseconds.
    pub wait_us_per_step: f64,
}

/// The schema of the structured-output rounds: an array of people with no bound on its length,
/// so every step is inside the grammar (a bounded one would end in a few dozen tokens and then
/// allow EOS alone, which costs nothing).
const PEOPLE_SCHEMA: &str = r#"{"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": false}}"#;

/// The cost of structured outputs: for each batch size, rounds without and with a grammar in
/// the order A B B A (so a drift in the machine's speed hits both alike), each `steps` decode
/// steps of sampled requests through the engine (its mask thread included).
fn run_structured(
    model: ferry_executor_svc::forward::LoadedModel,
    batches: &[usize],
    steps: usize,
    mut progress: impl FnMut(&GrammarRow),
) -> anyhow::Result<Vec<GrammarRow>> {
    use ferry_executor_svc::engine::{CpuBackend, Engine, EngineConfig};
    use ferry_proto::v1;
    let ferry_executor_svc::forward::LoadedModel { file, weights } = model;
    let tok = &file.tokenizer;
    let messages = [ferry_model::ChatMessage {
        role: "user".into(),
        content: "List ten people as JSON.".into(),
    }];
    let prompt = tok.encode(&tok.apply_chat_template(&messages, true)?)?;
    let per_seq = (prompt.len() + steps + 2).div_ceil(BS);
    let most = batches.iter().copied().max().unwrap_or(1);
    let backend = CpuBackend::with_dtype(weights, KvDtype::default(), BS, per_seq * most);
    let mut engine = Engine::new(Box::new(backend), EngineConfig::new(tok.eos_token_id))
        .with_grammars(Some(file.clone()));
    let mut rows = Vec::new();
    for &b in batches {
        for constrained in [false, true, true, false] {
            engine.reset();
            let structured_output = constrained.then(|| v1::StructuredOutput {
                kind: Some(v1::structured_output::Kind::JsonSchema(PEOPLE_SCHEMA.into())),
            });
            let work = |id: u64, key: v1::WorkKey, n: usize| v1::ScheduledWork {
                id,
                key: key.into(),
                num_tokens: n as u32,
                draft_token_ids: vec![],
                loop_index: 0,
            };
            let ids = 0..b as u64;
            let prefill = v1::Step {
                step_id: 0,
                new_requests: ids
                    .clone()
                    .map(|id| v1::NewRequest {
                        id,
                        prompt_token_ids: prompt.clone(),
                        sampling: Some(v1::SamplingParams {
                            temperature: 1.0,
                            seed: Some(id),
                            structured_output: structured_output.clone(),
                            ..Default::default()
                        }),
                        block_ids: ((id as usize * per_seq) as u32..).take(per_seq).collect(),
                        ..Default::default()
                    })
                    .collect(),
                work: ids.clone().map(|id| work(id, v1::WorkKey::Prompt, prompt.len())).collect(),
                total_num_tokens: (b * prompt.len()) as u32,
                ..Default::default()
            };
            engine.execute(&prefill)?;
            let (mut mask_us, mut wait_us) = (0u64, 0u64);
            let t = Instant::now();
            for step_id in 1..=steps as u64 {
                let decode = v1::Step {
                    step_id,
                    work: ids.clone().map(|id| work(id, v1::WorkKey::Decode, 1)).collect(),
                    total_num_tokens: b as u32,
                    ..Default::default()
                };
                let result = engine.execute(&decode)?;
                anyhow::ensure!(result.refused.is_empty(), "refused: {:?}", result.refused);
                let timing = result.timing.unwrap_or_default();
                mask_us += timing.grammar_us;
                wait_us += timing.grammar_wait_us;
            }
            let elapsed = t.elapsed().as_secs_f64();
            let tokens = (b * steps) as f64;
            let row = GrammarRow {
                batch: b,
                constrained,
                tokens_per_s: tokens / elapsed,
                mask_us_per_token: if constrained { mask_us as f64 / tokens } else { 0.0 },
                wait_us_per_step: wait_us as f64 / steps as f64,
            };
            progress(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Runs the structured-output rounds on `model` (the default model when `None`) and prints
/// their rows: a table, or JSON with `json`.
pub(crate) fn report(
    model: Option<&std::path::Path>,
    batches: &[usize],
    steps: usize,
    json: bool,
) -> anyhow::Result<()> {
    let model = LoadedModel::open(model)?;
    if !json {
        println!("model {}; sampled decode, {steps} steps per round", model.file.name);
        println!(
            "{:>6} {:>12} {:>12} {:>18} {:>18}",
            "batch", "grammar", "tokens/s", "mask us/token", "wait us/step"
        );
    }
    let rows = run_structured(model, batches, steps, |r| {
        if !json {
            println!(
                "{:>6} {:>12} {:>12.1} {:>18.1} {:>18.1}",
                r.batch,
                if r.constrained { "json_schema" } else { "none" },
                r.tokens_per_s,
                r.mask_us_per_token,
                r.wait_us_per_step
            );
        }
    })?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    }
    Ok(())
}
