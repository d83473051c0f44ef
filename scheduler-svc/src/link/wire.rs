//! The step protocol's wire forms, both ways: a core's `StepPlan` as the `Step` an executor
//! runs, and an executor's `StepResult` as the outcome the core applies. Conversions only: no
//! state, no decisions.

use ferry_proto::v1;
use ferry_sched_core::{
    self as core, KvOp, KvResult, RequestId, SampledToken, StepOutcome, StepPlan, TransferId,
    WorkKey,
};

use super::TransferPlan;
use crate::request::RequestSpec;

/// What the wire form of a plan needs to know of a request beside the core: its spec, and its
/// part in a KV transfer.
pub type RequestInfo<'a> = (&'a RequestSpec, Option<&'a TransferPlan>);

/// The core's view of an executor's result: the sampled tokens, in order, and the KV
/// transfers that ended (a transfer id this scheduler did not issue is dropped: the core would
/// refuse the whole result for it).
pub fn outcome_of(result: &v1::StepResult) -> StepOutcome {
    let sampled = result
        .outputs
        .iter()
        .flat_map(|o| {
            o.token_ids.iter().map(move |t| SampledToken { id: RequestId(o.id), token: *t })
        })
        .collect();
    let kv_results = result
        .kv_results
        .iter()
        .filter_map(|k| {
            let transfer_id = TransferId(k.transfer_id.parse().ok()?);
            Some(KvResult { transfer_id, ok: k.ok })
        })
        .collect();
    let refused = result.refused.iter().map(|r| RequestId(r.id)).collect();
    let exited = result.exited_ids.iter().map(|&id| RequestId(id)).collect();
    StepOutcome { step_id: core::StepId(result.step_id), sampled, kv_results, refused, exited }
}

fn work_key(k: WorkKey) -> v1::WorkKey {
    match k {
        WorkKey::Prompt => v1::WorkKey::Prompt,
        WorkKey::PromptChunk => v1::WorkKey::PromptChunk,
        WorkKey::Decode => v1::WorkKey::Decode,
        WorkKey::Verify => v1::WorkKey::Verify,
        WorkKey::PromptPrelude => v1::WorkKey::PromptPrelude,
        WorkKey::PromptRecurrent => v1::WorkKey::PromptRecurrent,
        WorkKey::PromptCoda => v1::WorkKey::PromptCoda,
        WorkKey::DecodePrelude => v1::WorkKey::DecodePrelude,
        WorkKey::DecodeRecurrent => v1::WorkKey::DecodeRecurrent,
        WorkKey::DecodeCoda => v1::WorkKey::DecodeCoda,
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
        && step.kv_ops.is_empty()
        && step.block_copies.is_empty()
        && step.evicted_blocks.is_empty()
        && step.cached_blocks.is_empty()
}

/// The wire form of `plan` in session `session_id` under `epoch`; `info_of` gives each
/// request's spec (sampling parameters and trace context) and its transfer plan (an export's
/// destination, a transfer's timeout, counted from `now_unix_ms`).
pub fn to_proto<'a>(
    plan: &StepPlan,
    session_id: u64,
    epoch: u64,
    now_unix_ms: u64,
    info_of: impl Fn(RequestId) -> Option<RequestInfo<'a>>,
) -> v1::Step {
    v1::Step {
        session_id,
        epoch,
        step_id: plan.step_id.0,
        new_requests: plan
            .new_requests
            .iter()
            .map(|n| {
                let spec = info_of(n.id).map(|(s, _)| s);
                v1::NewRequest {
                    id: n.id.0,
                    prompt_token_ids: n.prompt.to_vec(),
                    output_token_ids: n.output.to_vec(),
                    sampling: spec.map(|s| s.sampling.clone()),
                    block_ids: plan.blocks(n.block_ids).iter().map(|b| b.0).collect(),
                    num_computed_tokens: wire_u32(n.num_computed_tokens),
                    traceparent: spec.map(|s| s.traceparent.clone()).unwrap_or_default(),
                    max_loops: u32::from(n.max_loops),
                    lora: spec.and_then(|s| s.lora.clone()),
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
                draft_token_ids: plan.draft_of(w).to_vec(),
                loop_index: u32::from(w.loop_index),
            })
            .collect(),
        finished_ids: plan.finished.iter().map(|id| id.0).collect(),
        preempted_ids: plan.preempted.iter().map(|id| id.0).collect(),
        kv_ops: plan
            .kv_ops
            .iter()
            .map(|op| kv_op(plan, op, session_id, now_unix_ms, &info_of))
            .collect(),
        total_num_tokens: wire_u32(plan.total_tokens),
        block_copies: plan
            .block_copies
            .iter()
            .map(|c| v1::BlockCopy { id: c.id.0, src: c.src.0, dst: c.dst.0 })
            .collect(),
        evicted_blocks: plan.cache.evicted.iter().map(|b| b.0).collect(),
        cached_blocks: plan
            .cache
            .cached
            .iter()
            .map(|&(b, h)| v1::CachedBlock { block_id: b.0, hash: h.0 })
            .collect(),
        dp_round: 0,
    }
}

/// The transfer ids of KV-tier stores start with this (the core's transfer ids are numbers).
const TIER_STORE_PREFIX: &str = "tier-";

/// How long an executor may take to write a step's blocks to its agent.
pub const TIER_STORE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The wire form of one KV operation; the destination and timeout come from the request's
/// transfer plan (an op for a request without one goes out with neither, and the executor
/// refuses it). The deadline is the timeout from now: a transfer's clock starts when its
/// operation is issued, not while its request waited in a queue.
fn kv_op<'a>(
    plan: &StepPlan,
    op: &KvOp,
    session_id: u64,
    now_unix_ms: u64,
    info_of: &impl Fn(RequestId) -> Option<RequestInfo<'a>>,
) -> v1::KvOperation {
    let traceparent =
        |id| info_of(id).map(|(spec, _)| spec.traceparent.clone()).unwrap_or_default();
    let after = |d: std::time::Duration| {
        now_unix_ms.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    };
    let deadline = |id| match info_of(id).and_then(|(_, t)| t) {
        Some(TransferPlan::Export { timeout, .. } | TransferPlan::Import { timeout, .. }) => {
            after(*timeout)
        }
        None => 0,
    };
    match *op {
        KvOp::Export { id, transfer_id, block_ids, block_hashes, .. } => {
            let destination = match info_of(id).and_then(|(_, t)| t) {
                Some(TransferPlan::Export { destination, .. }) => destination.clone(),
                _ => String::new(),
            };
            v1::KvOperation {
                transfer_id: transfer_id.0.to_string(),
                deadline_unix_ms: deadline(id),
                traceparent: traceparent(id),
                op: Some(v1::kv_operation::Op::Export(v1::KvExport {
                    request_id: id.0,
                    block_ids: plan.blocks(block_ids).iter().map(|b| b.0).collect(),
                    block_hashes: plan.hashes(block_hashes).iter().map(|h| h.0).collect(),
                    destination_agent: destination,
                })),
            }
        }
        KvOp::Import { id, transfer_id, block_ids, block_hashes, .. } => v1::KvOperation {
            transfer_id: transfer_id.0.to_string(),
            deadline_unix_ms: deadline(id),
            traceparent: traceparent(id),
            op: Some(v1::kv_operation::Op::Import(v1::KvImport {
                request_id: id.0,
                block_ids: plan.blocks(block_ids).iter().map(|b| b.0).collect(),
                block_hashes: plan.hashes(block_hashes).iter().map(|h| h.0).collect(),
                source_agent: match info_of(id).and_then(|(_, t)| t) {
                    Some(TransferPlan::Import { source: Some(agent), .. }) => agent.clone(),
                    _ => String::new(),
                },
            })),
        },
        KvOp::Store { block_ids, block_hashes } => v1::KvOperation {
            // Not a transfer of the core's: named by the step, which carries one at most.
            transfer_id: format!("{TIER_STORE_PREFIX}{session_id}-{}", plan.step_id.0),
            deadline_unix_ms: after(TIER_STORE_TIMEOUT),
            traceparent: String::new(),
            op: Some(v1::kv_operation::Op::Store(v1::KvStore {
                block_ids: plan.blocks(block_ids).iter().map(|b| b.0).collect(),
                block_hashes: plan.hashes(block_hashes).iter().map(|h| h.0).collect(),
            })),
        },
    }
}

/// An upper bound on the encoded size of any step a core with these limits builds: every
/// request slot carrying a new request with a full-length sequence (5 bytes per token id and
/// block id, the most a varint takes), its work (with a full draft to verify), and a KV
/// operation over all its blocks, each of them evicted from the prefix cache and cached again
/// (the cache changes, at most one of each per block a step allocates or fills); plus
/// a fixed allowance per request for ids, sampling parameters and trace context, and the
/// largest structured-output constraint.
pub fn largest_step_bytes(max_num_seqs: usize, max_model_len: usize, block_size: usize) -> u64 {
    const PER_REQUEST: u64 = 1024;
    // A verification's draft tokens (5 bytes each, and the field's tag and length).
    const DRAFT: u64 = 5 * ferry_sched_core::MAX_SPECULATIVE_TOKENS as u64 + 3;
    // A constraint, and the logit biases (an entry is a tag, a length and the id and float
    // fields: at most 13 bytes) and allowed ids (5 bytes each, packed).
    const GRAMMAR: u64 = ferry_model::structured::MAX_GRAMMAR_BYTES as u64
        + 13 * ferry_model::sampling::MAX_LOGIT_BIAS as u64
        + 5 * ferry_model::sampling::MAX_ALLOWED_TOKEN_IDS as u64
        // Bad words: 5 bytes an id, and a sequence's two tags and lengths (6 bytes) at most
        // once an id.
        + 11 * ferry_model::sampling::MAX_BAD_WORD_TOKENS as u64
        + 8
        + 6;
    // A forked sample's block copy (request id, two block ids, tags and the entry's length).
    const BLOCK_COPY: u64 = 11 + 6 + 6 + 2;
    // A cached block (block id, 64-bit hash, tags and the entry's length) and an evicted id.
    const CACHE_CHANGE: u64 = 6 + 11 + 2 + 5;
    // A LoRA adapter's name and path, with their tags and lengths and the message's.
    const LORA: u64 = (ferry_model::lora::MAX_ADAPTER_NAME_BYTES
        + ferry_model::lora::MAX_ADAPTER_PATH_BYTES) as u64
        + 12;
    let blocks = max_model_len.div_ceil(block_size.max(1)) as u64 + 1;
    // Token ids, block ids, the KV operation's block ids and 64-bit hashes, cache changes.
    let per_request = 5 * max_model_len as u64
        + 5 * blocks
        + 16 * blocks
        + CACHE_CHANGE * blocks
        + PER_REQUEST
        + GRAMMAR
        + DRAFT
        + BLOCK_COPY
        + LORA;
    max_num_seqs as u64 * per_request + PER_REQUEST
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    /// The bound holds for the largest step there can be: every slot a new request of the
    /// full length with ids at their widest, its work, a KV export of all its blocks with
    /// 64-bit hashes, a block copy, every sampling parameter set, a trace context and a
    /// preemption.
    #[test]
    fn the_largest_step_bound_is_an_upper_bound() {
        for (seqs, len, block_size) in [(1, 16, 16), (4, 100, 1), (256, 2048, 16), (8, 8192, 16)] {
            let blocks = len / block_size + 1;
            let request = |id: u64| v1::NewRequest {
                id: u64::MAX - id,
                prompt_token_ids: vec![u32::MAX; len - 1],
                output_token_ids: vec![u32::MAX; 1],
                sampling: Some(v1::SamplingParams {
                    temperature: 1.0,
                    top_p: 0.5,
                    top_k: u32::MAX,
                    min_p: 0.5,
                    seed: Some(u64::MAX),
                    repetition_penalty: 1.5,
                    presence_penalty: 1.5,
                    frequency_penalty: 1.5,
                    logprobs: true,
                    top_logprobs: u32::MAX,
                    structured_output: Some(v1::StructuredOutput {
                        kind: Some(v1::structured_output::Kind::Regex(
                            "a".repeat(ferry_model::structured::MAX_GRAMMAR_BYTES - 4),
                        )),
                    }),
                    logit_bias: (0..ferry_model::sampling::MAX_LOGIT_BIAS as u32)
                        .map(|i| (u32::MAX - i, f32::MAX))
                        .collect(),
                    allowed_token_ids: vec![u32::MAX; ferry_model::sampling::MAX_ALLOWED_TOKEN_IDS],
                    bad_words: vec![
                        v1::TokenSequence { ids: vec![u32::MAX] };
                        ferry_model::sampling::MAX_BAD_WORD_TOKENS
                    ],
                    prompt_logprobs: Some(u32::MAX),
                    exit_threshold: None,
                    max_loops: None,
                }),
                block_ids: vec![u32::MAX; blocks],
                num_computed_tokens: u32::MAX,
                traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
                max_loops: 0,
                lora: Some(v1::LoraAdapterRef {
                    name: "n".repeat(ferry_model::lora::MAX_ADAPTER_NAME_BYTES),
                    path: "p".repeat(ferry_model::lora::MAX_ADAPTER_PATH_BYTES),
                }),
            };
            let export = |id: u64| v1::KvOperation {
                transfer_id: u64::MAX.to_string(),
                deadline_unix_ms: u64::MAX,
                traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
                op: Some(v1::kv_operation::Op::Export(v1::KvExport {
                    request_id: u64::MAX - id,
                    block_ids: vec![u32::MAX; blocks],
                    block_hashes: vec![u64::MAX; blocks],
                    destination_agent: "kv-agent-0.ferry.svc.cluster.local:50052".into(),
                })),
            };
            let ids = 0..seqs as u64;
            let step = v1::Step {
                session_id: u64::MAX,
                epoch: u64::MAX,
                step_id: u64::MAX,
                new_requests: ids.clone().map(request).collect(),
                work: ids
                    .clone()
                    .map(|id| v1::ScheduledWork {
                        id: u64::MAX - id,
                        key: v1::WorkKey::Verify.into(),
                        num_tokens: u32::MAX,
                        draft_token_ids: vec![u32::MAX; ferry_sched_core::MAX_SPECULATIVE_TOKENS],
                        loop_index: 0,
                    })
                    .collect(),
                finished_ids: ids.clone().map(|id| u64::MAX - id).collect(),
                preempted_ids: ids.clone().map(|id| u64::MAX - id).collect(),
                block_copies: ids
                    .clone()
                    .map(|id| v1::BlockCopy { id: u64::MAX - id, src: u32::MAX, dst: u32::MAX })
                    .collect(),
                kv_ops: ids.map(export).collect(),
                total_num_tokens: u32::MAX,
                cached_requests: Vec::new(),
                dp_round: u64::MAX,
                evicted_blocks: vec![u32::MAX; seqs * blocks],
                cached_blocks: vec![
                    v1::CachedBlock { block_id: u32::MAX, hash: u64::MAX };
                    seqs * blocks
                ],
            };
            let bound = largest_step_bytes(seqs, len, block_size);
            let size = step.encoded_len() as u64;
            assert!(size <= bound, "{seqs} × {len}: {size} bytes, bound {bound}");
            let slack = bound - size;
            assert!(slack < size || slack < 4096, "{seqs} × {len}: bound {bound}, {size} bytes");
        }
    }
}
