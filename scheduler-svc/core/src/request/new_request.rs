//! What a caller adds: a validated, tokenized request ([`NewRequest`]) with its stop rules,
//! priority and cache salt, and its part in a KV transfer ([`KvImport`], an export id) or in
//! parallel sampling ([`Fork`]).

use std::sync::Arc;

use crate::types::{RequestId, Timestamp, TokenId, TransferId};

/// A KV import: the first `num_tokens` prompt tokens' KV arrive through transfer `transfer_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvImport {
    /// The transfer, named by the cluster scheduler that created the matching export.
    pub transfer_id: TransferId,
    /// Leading prompt tokens covered by the import (fewer than the prompt: at least one token is
    /// computed locally to produce the next token's logits).
    pub num_tokens: usize,
}

/// A request's part in parallel sampling (`n > 1`): the samples of one request share the KV of
/// its prompt.
///
/// Why in the core: the samples are separate requests for everything the core decides (slots,
/// work, preemption, finishing), but their prompt's KV is computed once. The first sample, the
/// source, computes its prompt but the last token as one piece of work and the last token in a
/// later one; in between, each other sample, at its first admission, takes a reference to each
/// of the source's full blocks of that KV and a copy of the partial block after them (the
/// step's [`crate::StepPlan::block_copies`], done by the executor before the step's forward),
/// and computes the last prompt token itself, sampling its own first token. From there on the
/// samples are independent: preempting one drops only its references.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fork {
    /// A request on its own.
    #[default]
    None,
    /// The first sample of a request with several: the one the others fork from.
    Source,
    /// Another sample of the request this names (a live [`Fork::Source`] with the same prompt
    /// and salt). It waits for the source's prompt KV before its first admission; if the source
    /// finishes or loses that KV first, it computes its prompt itself.
    Of(RequestId),
}

/// A request to add: what the service layer knows after validation and tokenization.
#[derive(Debug, Clone, PartialEq)]
pub struct NewRequest {
    /// Caller-chosen id, unique among live requests.
    pub id: RequestId,
    /// Prompt tokens (non-empty, shorter than the model's maximum length). Shared, not copied:
    /// the core keeps this `Arc` and hands it on to the executor in the step plan
    /// ([`crate::NewRequestData::prompt`]), so a caller that already holds the prompt in an
    /// `Arc` adds a request without copying its tokens.
    pub prompt: Arc<[TokenId]>,
    /// Maximum output tokens (at least one; prompt + `max_tokens` ≤ `max_model_len`).
    pub max_tokens: usize,
    /// Output tokens before EOS or stop tokens may stop the request.
    pub min_tokens: usize,
    /// The model's end-of-sequence tokens.
    pub eos_token_ids: Vec<TokenId>,
    /// Extra tokens that stop the request (even with `ignore_eos`, as in vLLM).
    pub stop_token_ids: Vec<TokenId>,
    /// Do not stop on EOS tokens (stop token ids still stop).
    pub ignore_eos: bool,
    /// Lower is more important (vLLM's convention).
    pub priority: i32,
    /// Separates prefix caches: requests share blocks only with the same salt (model, adapter,
    /// tenant).
    pub cache_salt: u64,
    /// The LoRA adapter it runs with (any id unique to the adapter; 0: none). With
    /// [`crate::SchedulerConfig::max_loras`], a request of an adapter the executor does not
    /// hold waits while the executor holds that many others.
    pub adapter: u64,
    /// When the request arrived.
    pub arrival: Timestamp,
    /// Enter as `Receiving`: part of the prompt's KV is imported instead of computed.
    pub kv_import: Option<KvImport>,
    /// Prefill-only role: after the prompt (and its first token) the KV is exported through
    /// this transfer (named by the cluster scheduler) and the request leaves through
    /// `Transferring`.
    pub kv_export: Option<TransferId>,
    /// Output tokens already generated elsewhere (a request moved here after its executor or
    /// scheduler failed). They count against `max_tokens`, are part of the sequence (their KV is
    /// recomputed) and go to the executor as output, so seeded sampling and penalties continue
    /// exactly where they stopped. At most `max_tokens - 1` of them.
    pub output: Vec<TokenId>,
    /// May decode speculatively when the scheduler's config enables it (the service leaves it
    /// off for requests whose sampling cannot verify several positions at once, such as a
    /// structured output's grammar).
    pub speculate: bool,
    /// Parallel sampling: whether it shares its prompt's KV with sibling samples ([`Fork`]).
    pub fork: Fork,
    /// A looped model's request: the most recurrent loops each of its tokens runs (`None`: the
    /// model's [`crate::LoopedModel::max_loops`]). Refused on a plain model.
    pub max_loops: Option<u8>,
    /// A looped model's request: its tokens leave the loop once their exit score reaches this,
    /// in (0, 1] (the executor applies it; the core refuses it on a plain model).
    pub exit_threshold: Option<f32>,
}

impl NewRequest {
    /// A plain request with default stop rules, priority 0 and no salt. `prompt` is anything
    /// that becomes an `Arc<[TokenId]>`: an `Arc` is shared as is, a `Vec` or a slice is
    /// copied once into a new one.
    pub fn new(
        id: RequestId,
        prompt: impl Into<Arc<[TokenId]>>,
        max_tokens: usize,
        arrival: Timestamp,
    ) -> Self {
        NewRequest {
            id,
            prompt: prompt.into(),
            max_tokens,
            min_tokens: 0,
            eos_token_ids: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            priority: 0,
            cache_salt: 0,
            adapter: 0,
            arrival,
            kv_import: None,
            kv_export: None,
            output: Vec::new(),
            speculate: false,
            fork: Fork::None,
            max_loops: None,
            exit_threshold: None,
        }
    }
}
