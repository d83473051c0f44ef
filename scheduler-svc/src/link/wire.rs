//! The step protocol's wire forms, both ways: a core's `StepPlan` as the `Step` an executor
//! runs, and an executor's `StepResult` as the outcome the core applies. Conversions only: no
//! state, no decisions.

use ferry_proto::v1;
use ferry_sched_core::{self as core, RequestId, SampledToken, StepOutcome, StepPlan, WorkKey};

use crate::request::RequestSpec;

/// The core's view of an executor's result: the sampled tokens, in order.
pub fn outcome_of(result: &v1::StepResult) -> StepOutcome {
    let sampled = result
        .outputs
        .iter()
        .flat_map(|o| {
            o.token_ids.iter().map(move |t| SampledToken { id: RequestId(o.id), token: *t })
        })
        .collect();
    StepOutcome { step_id: core::StepId(result.step_id), sampled, kv_results: Vec::new() }
}

fn work_key(k: WorkKey) -> v1::WorkKey {
    match k {
        WorkKey::Prompt => v1::WorkKey::Prompt,
        WorkKey::PromptChunk => v1::WorkKey::PromptChunk,
        WorkKey::Decode => v1::WorkKey::Decode,
        WorkKey::Verify => v1::WorkKey::Verify,
    }
}

/// Counts that the core keeps within 32 bits (its configuration refuses a model length past
/// them), as wire `uint32`s.
fn wire_u32(n: usize) -> u32 {
    u32::try_from(n).expect("the core keeps token and block counts within 32 bits")
}

/// Whether a step carries nothing for the executor to do or learn.
pub fn is_empty(step: &v1::Step) -> bool {
    step.work.is_empty()
        && step.new_requests.is_empty()
        && step.cached_requests.is_empty()
        && step.finished_ids.is_empty()
        && step.preempted_ids.is_empty()
}

/// The wire form of `plan` in session `session_id` under `epoch`; `spec_of` gives each new
/// request's spec (sampling parameters and trace context).
pub fn to_proto<'a>(
    plan: &StepPlan,
    session_id: u64,
    epoch: u64,
    spec_of: impl Fn(RequestId) -> Option<&'a RequestSpec>,
) -> v1::Step {
    v1::Step {
        session_id,
        epoch,
        step_id: plan.step_id.0,
        new_requests: plan
            .new_requests
            .iter()
            .map(|n| {
                let spec = spec_of(n.id);
                v1::NewRequest {
                    id: n.id.0,
                    prompt_token_ids: n.prompt.to_vec(),
                    output_token_ids: n.output.to_vec(),
                    sampling: spec.map(|s| s.sampling),
                    block_ids: plan.blocks(n.block_ids).iter().map(|b| b.0).collect(),
                    num_computed_tokens: wire_u32(n.num_computed_tokens),
                    traceparent: spec.map(|s| s.traceparent.clone()).unwrap_or_default(),
                }
            })
            .collect(),
        cached_requests: plan
            .cached_requests
            .iter()
            .map(|c| v1::CachedRequestUpdate {
                id: c.id.0,
                new_block_ids: plan.blocks(c.block_ids).iter().map(|b| b.0).collect(),
                resumed: c.resumed,
                num_computed_tokens: wire_u32(c.num_computed_tokens),
            })
            .collect(),
        work: plan
            .scheduled
            .iter()
            .map(|w| v1::ScheduledWork {
                id: w.id.0,
                key: work_key(w.work).into(),
                num_tokens: wire_u32(w.num_tokens),
                draft_token_ids: Vec::new(),
            })
            .collect(),
        finished_ids: plan.finished.iter().map(|id| id.0).collect(),
        preempted_ids: plan.preempted.iter().map(|id| id.0).collect(),
        kv_ops: Vec::new(),
        total_num_tokens: wire_u32(plan.total_tokens),
    }
}
