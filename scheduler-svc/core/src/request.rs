//! A request as the core sees it: its lifecycle status, its token progress, and its stop rules.
//!
//! Why here: the fields that move together (computed tokens, output placeholders, block table,
//! block hashes) live in one record so the step builder and the result path update them with
//! the same helpers; the record is split in a hot part and a cold one by how often a decode
//! step touches a field (see [`Request`]). Status is lifecycle only; pending work lives in `work_queues`, admission in
//! the slot counter — the three are separate on purpose (a finished request may still hold its
//! slot while an in-flight step references it).
//!
//! Token accounting (vLLM v1): `num_computed` counts tokens whose KV is computed *or scheduled*
//! in a built step; `placeholders` counts tokens a built step will sample whose value has not
//! come back yet. So the next work is `num_tokens() + placeholders - num_computed` tokens, and a
//! request never has more computed tokens than its block table can hold.

use std::sync::Arc;

use crate::block_hash::{hash_block, hash_block_iter, BlockHash};
use crate::types::{BlockId, RequestId, StepId, Timestamp, TokenId, TransferId};

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// A stop condition on the last sampled token.
    Stop(StopCause),
    /// `max_tokens` reached, or prompt + output reached the model's maximum length.
    Length,
    /// Aborted by the caller.
    Abort,
    /// Gave up: a KV export failed.
    Error,
    /// Prefill-only request whose KV was exported; it continues on another executor.
    Transferred,
}

/// The token that stopped a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopCause {
    /// One of the model's end-of-sequence tokens.
    Eos(TokenId),
    /// One of the request's stop token ids.
    StopToken(TokenId),
}

/// Lifecycle of a request (not its pending work, not its slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestStatus {
    /// In the waiting queue, no slot; may hold KV blocks (yielded, or imported without a slot).
    Waiting,
    /// Its KV arrives from elsewhere: queued for a fetch, or holding blocks being filled.
    Receiving,
    /// Holds an admission slot; has at most one pending work item.
    Active,
    /// Its KV is being exported (prefill-only role); holds slot and blocks until reported.
    Transferring,
    /// Terminal. It may still hold its slot until no in-flight step references it.
    Finished(FinishReason),
}

impl RequestStatus {
    /// True once finished.
    pub fn is_finished(self) -> bool {
        matches!(self, RequestStatus::Finished(_))
    }
}

/// A KV import: the first `num_tokens` prompt tokens' KV arrive through transfer `transfer_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvImport {
    /// The transfer, named by the cluster scheduler that created the matching export.
    pub transfer_id: TransferId,
    /// Leading prompt tokens covered by the import (fewer than the prompt: at least one token is
    /// computed locally to produce the next token's logits).
    pub num_tokens: usize,
}

/// A request to add: what the service layer knows after validation and tokenization.
#[derive(Debug, Clone, PartialEq)]
pub struct NewRequest {
    /// Caller-chosen id, unique among live requests.
    pub id: RequestId,
    /// Prompt tokens (non-empty, shorter than the model's maximum length).
    pub prompt: Vec<TokenId>,
    /// Maximum output tokens (at least one; prompt + max_tokens ≤ max_model_len).
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
}

impl NewRequest {
    /// A plain request with default stop rules, priority 0 and no salt.
    pub fn new(id: RequestId, prompt: Vec<TokenId>, max_tokens: usize, arrival: Timestamp) -> Self {
        NewRequest {
            id,
            prompt,
            max_tokens,
            min_tokens: 0,
            eos_token_ids: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            priority: 0,
            cache_salt: 0,
            arrival,
            kv_import: None,
            kv_export: None,
            output: Vec::new(),
        }
    }
}

/// The last thing the scheduler decided about a request (for the admin listing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// Added to the waiting queue.
    Queued,
    /// Waiting for a KV fetch slot or for blocks to import into.
    ImportQueued,
    /// Blocks allocated, import in progress.
    Importing,
    /// Admitted into a slot this step.
    Admitted,
    /// Got work in the last step.
    Scheduled,
    /// Not scheduled: the step's token budget ran out.
    NoBudget,
    /// Not admitted / scheduled: not enough free blocks.
    NoBlocks,
    /// Not admitted: all slots taken.
    NoSlot,
    /// Not admitted: a step still in flight references it.
    InFlight,
    /// Not scheduled: the blocks it needs are fenced by an in-flight step; next step.
    FenceWait,
    /// Preempted (recompute).
    Preempted,
    /// Yielded its slot, kept its KV.
    Yielded,
    /// Some or all of its KV was reclaimed while it waited.
    Reclaimed,
    /// Its KV export is in progress.
    Exporting,
    /// Finished.
    Finished,
}

/// Per-request timestamps (for queue time, TTFT, end-to-end latency).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestTimes {
    /// When it arrived.
    pub arrival: Timestamp,
    /// First time it was scheduled.
    pub first_scheduled: Option<Timestamp>,
    /// When its first output token was applied.
    pub first_token: Option<Timestamp>,
    /// Each preemption.
    pub preemptions: Vec<Timestamp>,
    /// When it finished.
    pub finished: Option<Timestamp>,
}

/// What the executor knows about a request (the step protocol sends diffs against this).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ExecutorView {
    /// The executor has been sent this request.
    pub(crate) known: bool,
    /// Blocks of its table the executor has been sent (`u32`: a table never holds more blocks
    /// than the pool, whose ids are `u32`; keeps the hot part of [`Request`] in four lines).
    pub(crate) sent_blocks: u32,
    /// Preempted since last scheduled: send the whole state again.
    pub(crate) needs_resume: bool,
}

/// A step or none, in 8 bytes instead of `Option<StepId>`'s 16 (steps are numbered from 1, so
/// 0 is free to mean none); it keeps the hot part of [`Request`] in four lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct StepMark(u64);

impl StepMark {
    /// No step.
    pub(crate) const NONE: StepMark = StepMark(0);

    /// Mark `step`.
    #[inline]
    pub(crate) fn of(step: StepId) -> Self {
        debug_assert_ne!(step.0, 0, "steps are numbered from 1");
        StepMark(step.0)
    }

    /// The step marked, if any.
    #[inline]
    pub(crate) fn get(self) -> Option<StepId> {
        (self.0 != 0).then_some(StepId(self.0))
    }
}

/// State of a KV transfer attached to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TransferState {
    /// Prefill-only request: its export id is reserved until the prompt is done.
    ExportPlanned,
    /// Waiting for a fetch slot and blocks.
    ImportQueued,
    /// Import op issued; blocks held until reported.
    Importing,
    /// Prompt done; export op to be issued in the next step.
    ExportQueued,
    /// Export op issued; blocks held until reported.
    Exporting,
}

/// Output tokens reserved at admission at most (16 KiB); longer outputs grow past it as usual.
pub(crate) const OUTPUT_RESERVE_CAP: usize = 4096;

/// A small set of token ids, inline up to four (EOS and stop ids are checked for every sampled
/// token: keeping them inline avoids a pointer chase per token).
#[derive(Debug, Clone)]
pub(crate) enum TokenSet {
    Inline { len: u8, ids: [TokenId; 4] },
    Heap(Box<[TokenId]>),
}

impl TokenSet {
    pub(crate) fn new(ids: Vec<TokenId>) -> Self {
        if ids.len() <= 4 {
            let mut inline = [0; 4];
            inline[..ids.len()].copy_from_slice(&ids);
            TokenSet::Inline { len: ids.len() as u8, ids: inline }
        } else {
            TokenSet::Heap(ids.into())
        }
    }

    #[inline]
    pub(crate) fn contains(&self, token: TokenId) -> bool {
        match self {
            TokenSet::Inline { len, ids } => ids[..*len as usize].contains(&token),
            TokenSet::Heap(ids) => ids.contains(&token),
        }
    }
}

/// The core's record of one request: the state a decode step reads or writes for every running
/// request, in four cache lines.
///
/// Why this shape: a step visits every running request twice (schedule, apply), so at 16 k
/// running requests the per-step cost is the number of cache lines each visit touches. The
/// fields every decode step uses are packed first (`repr(C)`, 64-byte aligned, so they are
/// exactly lines 0–3); everything else — admission and preemption bookkeeping, transfers,
/// timestamps, block hashes (touched once per filled block) — is in [`RequestCold`] behind a
/// pointer. With no cold field left inline, the niche `Option<Request>` stores its tag in is in
/// a hot line too, so the slab's "live" check costs no extra line (before the split it read a
/// timestamp's tag five lines in).
#[derive(Debug, Clone)]
#[repr(C, align(64))]
pub(crate) struct Request {
    // --- line 0: token buffers ---
    pub(crate) output: Vec<TokenId>,
    pub(crate) block_table: Vec<BlockId>,
    pub(crate) prompt: Arc<[TokenId]>,
    // --- line 1: token progress and step membership ---
    pub(crate) num_computed: usize,
    pub(crate) placeholders: usize,
    pub(crate) max_tokens: usize,
    /// Step during whose build it was last looked at (guards against double scheduling).
    pub(crate) visited_step: u64,
    /// Last built step that referenced it (its blocks are fenced until that step is applied).
    /// While a step is being built, `last_step == Some(that step)` means "scheduled in it".
    pub(crate) last_step: StepMark,
    /// `last_step` before the step being built (restored if its work there is rolled back).
    pub(crate) prev_last_step: StepMark,
    /// Victim rank inputs (read for every running request when a victim is picked).
    pub(crate) admit_seq: u64,
    pub(crate) arrival_seq: u64,
    // --- line 2: step record, executor diff, lifecycle ---
    pub(crate) id: RequestId,
    pub(crate) min_tokens: usize,
    /// Blocks appended to its table during the step being built (valid only while scheduled
    /// in it).
    pub(crate) new_blocks_this_step: usize,
    /// Leading blocks of the table registered in the prefix cache.
    pub(crate) num_registered: usize,
    pub(crate) exec: ExecutorView,
    /// Index of its entry in the step being built (valid only while scheduled in it).
    pub(crate) sched_index: u32,
    /// Built steps not yet applied that reference this request.
    pub(crate) inflight_refs: u32,
    pub(crate) status: RequestStatus,
    pub(crate) num_preemptions: u32,
    pub(crate) priority: i32,
    // --- line 3: stop rules, flags ---
    pub(crate) eos_token_ids: TokenSet,
    pub(crate) stop_token_ids: TokenSet,
    pub(crate) decision: Decision,
    pub(crate) ignore_eos: bool,
    pub(crate) prefill_only: bool,
    pub(crate) has_slot: bool,
    pub(crate) finish_reported: bool,
    pub(crate) cold: Box<RequestCold>,
}

/// The part of a request a decode step does not touch (see [`Request`]).
#[derive(Debug, Clone)]
pub(crate) struct RequestCold {
    /// Hashes of the full blocks of `prompt ++ output` (only with prefix caching).
    pub(crate) block_hashes: Vec<BlockHash>,
    pub(crate) salt: u64,
    /// Position in the active set while it holds a slot and is `Active`.
    pub(crate) active_pos: u32,
    /// Position in the set of waiting requests holding blocks.
    pub(crate) holder_pos: u32,
    /// Validation epoch mark used while checking a step outcome out of plan order.
    pub(crate) outcome_mark: u64,
    pub(crate) transfer: Option<(TransferId, TransferState)>,
    pub(crate) import_tokens: usize,
    pub(crate) times: RequestTimes,
    pub(crate) prefix_hit_tokens: usize,
}

impl Request {
    pub(crate) fn new(req: NewRequest, arrival_seq: u64, block_size: usize) -> Self {
        // Sized for the whole request up front so growing never reallocates inside a step.
        let max_blocks = (req.prompt.len() + req.max_tokens).div_ceil(block_size);
        Request {
            id: req.id,
            prompt: req.prompt.into(),
            output: req.output,
            max_tokens: req.max_tokens,
            min_tokens: req.min_tokens,
            eos_token_ids: TokenSet::new(req.eos_token_ids),
            stop_token_ids: TokenSet::new(req.stop_token_ids),
            ignore_eos: req.ignore_eos,
            prefill_only: req.kv_export.is_some(),
            status: RequestStatus::Waiting,
            num_computed: 0,
            placeholders: 0,
            block_table: Vec::with_capacity(max_blocks),
            num_registered: 0,
            has_slot: false,
            inflight_refs: 0,
            last_step: StepMark::NONE,
            visited_step: 0,
            prev_last_step: StepMark::NONE,
            admit_seq: 0,
            arrival_seq,
            num_preemptions: 0,
            priority: req.priority,
            sched_index: 0,
            new_blocks_this_step: 0,
            exec: ExecutorView::default(),
            finish_reported: false,
            decision: Decision::Queued,
            cold: Box::new(RequestCold {
                block_hashes: Vec::new(),
                salt: req.cache_salt,
                active_pos: u32::MAX,
                holder_pos: u32::MAX,
                outcome_mark: 0,
                transfer: None,
                import_tokens: 0,
                times: RequestTimes { arrival: req.arrival, ..RequestTimes::default() },
                prefix_hit_tokens: 0,
            }),
        }
    }

    /// Size `output` for the rest of the request (up to [`OUTPUT_RESERVE_CAP`] tokens) so the
    /// per-step append never reallocates: a reallocation copies the whole buffer inside a step
    /// and, since running requests advance in lockstep, tends to hit all of them in one step.
    /// Done at admission, not at arrival, so a long waiting queue holds no output buffers.
    pub(crate) fn reserve_output(&mut self) {
        let want = self.max_tokens.min(OUTPUT_RESERVE_CAP);
        if self.output.capacity() < want {
            self.output.reserve_exact(want - self.output.len());
        }
    }

    /// Prompt plus output tokens whose values are known.
    #[inline]
    pub(crate) fn num_tokens(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    /// Tokens still to compute before the request is caught up (including scheduled-but-not-
    /// returned samples).
    #[inline]
    pub(crate) fn remaining(&self) -> usize {
        (self.num_tokens() + self.placeholders).saturating_sub(self.num_computed)
    }

    /// Token `i` of `prompt ++ output`.
    #[inline]
    pub(crate) fn token(&self, i: usize) -> TokenId {
        if i < self.prompt.len() {
            self.prompt[i]
        } else {
            self.output[i - self.prompt.len()]
        }
    }

    /// The request may not schedule more tokens yet: its pending samples already reach
    /// `max_tokens`, the model length, or (prefill-only) the first token.
    pub(crate) fn output_capped(&self, max_model_len: usize) -> bool {
        let produced = self.output.len() + self.placeholders;
        produced >= self.max_tokens
            || self.num_tokens() + self.placeholders >= max_model_len
            || (self.prefill_only && produced >= 1)
    }

    /// Extend `block_hashes` over the full blocks of the known tokens.
    pub(crate) fn update_block_hashes(&mut self, block_size: usize) {
        let full = self.num_tokens() / block_size;
        let salt = self.cold.salt;
        while self.cold.block_hashes.len() < full {
            let i = self.cold.block_hashes.len();
            let parent = i.checked_sub(1).map(|p| self.cold.block_hashes[p]);
            let start = i * block_size;
            let end = start + block_size;
            let p = self.prompt.len();
            let h = if end <= p {
                hash_block(parent, &self.prompt[start..end], salt)
            } else if start >= p {
                hash_block(parent, &self.output[start - p..end - p], salt)
            } else {
                hash_block_iter(parent, (start..end).map(|t| self.token(t)), salt)
            };
            self.cold.block_hashes.push(h);
        }
    }

    /// The stop rule after appending the last output token (vLLM v1 `check_stop` order: length
    /// first, then `min_tokens`, then EOS unless ignored, then stop token ids).
    pub(crate) fn check_stop(&self, max_model_len: usize) -> Option<FinishReason> {
        if self.num_tokens() >= max_model_len || self.output.len() >= self.max_tokens {
            return Some(FinishReason::Length);
        }
        if self.output.len() < self.min_tokens {
            return None;
        }
        let last = *self.output.last()?;
        if !self.ignore_eos && self.eos_token_ids.contains(last) {
            return Some(FinishReason::Stop(StopCause::Eos(last)));
        }
        if self.stop_token_ids.contains(last) {
            return Some(FinishReason::Stop(StopCause::StopToken(last)));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_hash::extend_block_hashes;

    fn req(max_tokens: usize) -> Request {
        let mut n = NewRequest::new(RequestId(1), vec![1, 2, 3], max_tokens, Timestamp(0));
        n.eos_token_ids = vec![9];
        n.stop_token_ids = vec![7, 1, 2, 4, 5];
        Request::new(n, 0, 4)
    }

    #[test]
    fn stop_rules_follow_vllm_order() {
        let mut r = req(3);
        r.output.push(9);
        assert_eq!(r.check_stop(100), Some(FinishReason::Stop(StopCause::Eos(9))));
        r.ignore_eos = true;
        assert_eq!(r.check_stop(100), None, "ignore_eos ignores only EOS");
        r.output.push(7);
        assert_eq!(r.check_stop(100), Some(FinishReason::Stop(StopCause::StopToken(7))));
        r.min_tokens = 3;
        assert_eq!(r.check_stop(100), None, "min_tokens holds back stop tokens");
        r.output.push(9);
        assert_eq!(r.check_stop(100), Some(FinishReason::Length), "length wins");
        let mut r = req(10);
        r.output.push(1);
        assert_eq!(r.check_stop(4), Some(FinishReason::Length), "model length");
    }

    #[test]
    fn hot_part_is_four_cache_lines() {
        use std::mem::{align_of, size_of};
        assert_eq!(align_of::<Request>(), 64);
        assert_eq!(size_of::<Request>(), 256, "a decode step should touch 4 lines per request");
        assert_eq!(size_of::<Option<Request>>(), size_of::<Request>(), "the slab uses a niche");
    }

    #[test]
    fn block_hashes_cover_output_tokens() {
        let mut r = req(10);
        r.update_block_hashes(2);
        assert_eq!(r.cold.block_hashes.len(), 1);
        r.output.extend([4, 5]);
        r.update_block_hashes(2);
        assert_eq!(r.cold.block_hashes.len(), 2);
        let mut all = Vec::new();
        extend_block_hashes(&mut all, &[1, 2, 3, 4, 5], 2, 0);
        assert_eq!(r.cold.block_hashes, all);
    }
}
