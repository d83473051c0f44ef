//! The core's record of one request ([`Request`], with its cold part [`RequestCold`]): its
//! tokens and progress, block table, stop rules, step marks and the executor's view of it,
//! laid out by how often a step touches each field; and the helpers the step builder and the
//! result path both update it with.

use std::sync::Arc;

use crate::block_hash::{hash_block, hash_block_iter, BlockHash};
use crate::looped::Chain;
use crate::types::{BlockId, RequestId, StepId, TokenId, TransferId};

use super::new_request::{Fork, NewRequest};
use super::status::{Decision, FinishReason, RequestStatus, RequestTimes, StopCause};
use super::stop_tokens::{filter_bit, TokenSet};

/// What the executor knows about a request (the step protocol sends diffs against this).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ExecutorView {
    /// Blocks of its table the executor has been sent (`u32`: a table never holds more blocks
    /// than the pool, whose ids are `u32`; keeps [`Request`] in three lines).
    pub(crate) sent_blocks: u32,
    /// The executor has been sent this request.
    pub(crate) known: bool,
    /// Preempted since last scheduled: send the whole state again.
    pub(crate) needs_resume: bool,
}

/// A step or none, in 8 bytes instead of `Option<StepId>`'s 16 (steps are numbered from 1, so
/// 0 is free to mean none); it helps keep [`Request`] in three lines.
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

/// The core's record of one request: the state a decode step reads or writes for every running
/// request, in three cache lines.
///
/// Why this shape: a step visits every running request twice (schedule, apply), so at 16 k
/// running requests, where the records no longer fit in L2, the per-step cost is the number of
/// cache lines each visit touches. The fields are grouped by pass (`repr(C)`, 64-byte aligned,
/// so they are exactly lines 0–2):
/// - line 0 is read by both passes (token buffers and progress, flags);
/// - line 1 by both too (stop rules and lifecycle for applying a token; block table and executor
///   diff for scheduling one);
/// - line 2 only by the step builder and the victim scan (id, step marks, ranks).
///
/// So applying a result touches two lines per request and building a step three. What a
/// decode step writes is in lines 0 and 2; line 1 changes only when a block is added or
/// registered, so it mostly stays clean and is not written back. Everything else — the EOS and
/// stop ids (read only when the one-word stop filter says the token may be one), admission and
/// transfer bookkeeping, timestamps, block hashes (touched once per filled block) — is in
/// [`RequestCold`] behind a pointer. The niche `Option<Request>` stores its tag in
/// is in line 0, so the slab's "live" check costs no extra line.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
pub(crate) struct Request {
    // --- line 0: token buffers and progress (both passes) ---
    pub(crate) output: Vec<TokenId>,
    pub(crate) prompt: Arc<[TokenId]>,
    pub(crate) num_computed: usize,
    /// Samples a built step will return whose value has not come back (`u32`: a handful at
    /// most; keeps line 0 room for the KV layout below).
    pub(crate) placeholders: u32,
    /// Built steps not yet applied that reference this request (at most two per step in
    /// flight, and at most [`crate::MAX_STEPS_IN_FLIGHT`] steps are).
    pub(crate) inflight_refs: u16,
    pub(crate) decision: Decision,
    pub(crate) ignore_eos: bool,
    pub(crate) prefill_only: bool,
    pub(crate) has_slot: bool,
    pub(crate) finish_reported: bool,
    /// May propose draft tokens ([`NewRequest::speculate`]).
    pub(crate) speculate: bool,
    /// KV planes per row of its block table: 1 for a plain model's request, a looped model's
    /// stages with layers for a looped one's (see `looped`); blocks come in whole rows.
    pub(crate) planes: u8,
    /// A looped model's request: its work runs stage by stage (its chain is in the cold part).
    pub(crate) looped: bool,
    // --- line 1: lifecycle and stop rules (apply); block table and executor diff (schedule) ---
    pub(crate) block_table: Vec<BlockId>,
    pub(crate) status: RequestStatus,
    /// One bit per EOS or stop token id, by id mod 32: a sampled token whose bit is clear stops
    /// nothing, so the id sets in the cold part are read only for the few tokens that may.
    pub(crate) stop_filter: u32,
    /// `u32`: at most `max_model_len`, which the config keeps within 32 bits.
    pub(crate) max_tokens: u32,
    pub(crate) min_tokens: u32,
    /// Leading blocks of the table registered in the prefix cache.
    pub(crate) num_registered: u32,
    pub(crate) exec: ExecutorView,
    pub(crate) num_preemptions: u32,
    pub(crate) priority: i32,
    // --- line 2: step marks and ranks (schedule, victim scan) ---
    pub(crate) id: RequestId,
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
    pub(crate) cold: Box<RequestCold>,
    /// Index of its entry in the step being built (valid only while scheduled in it).
    pub(crate) sched_index: u32,
    /// Blocks appended to its table during the step being built (valid only while scheduled
    /// in it).
    pub(crate) new_blocks_this_step: u32,
}

/// The part of a request a decode step does not touch (see [`Request`]). Its first line holds
/// what hashing a filled block reads (the hash chain and the salt).
#[derive(Debug, Clone)]
#[repr(C)]
pub(crate) struct RequestCold {
    /// Hashes of the full blocks of `prompt ++ output` (only with prefix caching).
    pub(crate) block_hashes: Vec<BlockHash>,
    pub(crate) salt: u64,
    /// Its LoRA adapter (0: none).
    pub(crate) adapter: u64,
    pub(crate) eos_token_ids: TokenSet,
    pub(crate) stop_token_ids: TokenSet,
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
    /// Draft tokens of its pending `Verify` work (empty otherwise).
    pub(crate) draft: Vec<TokenId>,
    /// Verifications in a row that accepted fewer than half their draft tokens (at most
    /// [`SPEC_MAX_MISSES`]).
    pub(crate) spec_misses: u8,
    /// Proposals still to skip after those misses.
    pub(crate) spec_skip: u8,
    /// Most draft tokens its next proposal may have (0: the configured number): halved by a
    /// miss, doubled by a verification that accepted its whole draft.
    pub(crate) spec_len: u8,
    /// Parallel sampling: it is the source the sibling samples fork from ([`Fork::Source`]).
    pub(crate) fork_source: bool,
    /// Parallel sampling: the source it forks from ([`Fork::Of`]); cleared once it forked.
    pub(crate) fork_of: Option<RequestId>,
    /// A looped model's request: its chain through the stages (default for a plain one).
    pub(crate) chain: Chain,
}

/// A request whose drafts keep failing proposes again after 1, 3, 7, … decodes, at most
/// `2^SPEC_MAX_MISSES - 1`, and with half the draft tokens each time: a rejected draft costs
/// its positions' compute.
pub(crate) const SPEC_MAX_MISSES: u8 = 6;

impl RequestCold {
    /// Most draft tokens its next proposal may have, `configured` at most.
    pub(crate) fn draft_len(&self, configured: usize) -> usize {
        match self.spec_len {
            0 => configured,
            n => usize::from(n).min(configured),
        }
    }

    /// A verification of `drafts` draft tokens accepted `accepted` (`most`: the configured
    /// draft length). Fewer than half accepted is a miss (it paid for more than it got): the
    /// next proposal waits longer and is half as long. A draft accepted whole lets the next
    /// be twice as long.
    pub(crate) fn verified(&mut self, accepted: usize, drafts: usize, most: usize) {
        let len = self.draft_len(most);
        let as_len = |n: usize| u8::try_from(n).expect("at most MAX_SPECULATIVE_TOKENS");
        if accepted * 2 < drafts {
            self.spec_misses = (self.spec_misses + 1).min(SPEC_MAX_MISSES);
            self.spec_skip = (1 << self.spec_misses) - 1;
            self.spec_len = as_len((len / 2).max(1));
        } else {
            self.spec_misses = 0;
            self.spec_skip = 0;
            if accepted == drafts {
                self.spec_len = as_len((len * 2).min(most));
            }
        }
    }
}

impl Request {
    /// A record for a validated request (`max_tokens` within `max_model_len`, which the config
    /// keeps within 32 bits).
    /// `looped`: the request's loops and KV planes on a looped model.
    pub(crate) fn new(
        req: NewRequest,
        arrival_seq: u64,
        block_size: usize,
        looped: Option<(u8, u8)>,
    ) -> Self {
        let (max_loops, planes) = looped.unwrap_or((0, 1));
        // Sized for the whole request up front so growing never reallocates inside a step.
        let max_blocks =
            (req.prompt.len() + req.max_tokens).div_ceil(block_size) * usize::from(planes);
        let stop_filter =
            req.eos_token_ids.iter().chain(&req.stop_token_ids).fold(0, |f, &t| f | filter_bit(t));
        let to_u32 = |n: usize| u32::try_from(n).expect("validated: within max_model_len");
        Request {
            id: req.id,
            prompt: req.prompt,
            output: req.output,
            max_tokens: to_u32(req.max_tokens),
            min_tokens: to_u32(req.min_tokens),
            stop_filter,
            ignore_eos: req.ignore_eos,
            prefill_only: req.kv_export.is_some(),
            speculate: req.speculate && req.kv_export.is_none(),
            status: RequestStatus::Waiting,
            planes,
            looped: looped.is_some(),
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
                eos_token_ids: TokenSet::new(req.eos_token_ids),
                stop_token_ids: TokenSet::new(req.stop_token_ids),
                salt: req.cache_salt,
                adapter: req.adapter,
                active_pos: u32::MAX,
                holder_pos: u32::MAX,
                outcome_mark: 0,
                transfer: None,
                import_tokens: 0,
                times: RequestTimes { arrival: req.arrival, ..RequestTimes::default() },
                prefix_hit_tokens: 0,
                draft: Vec::new(),
                spec_misses: 0,
                spec_skip: 0,
                spec_len: 0,
                fork_source: req.fork == Fork::Source,
                fork_of: match req.fork {
                    Fork::Of(source) => Some(source),
                    Fork::None | Fork::Source => None,
                },
                chain: Chain { max_loops, ..Chain::default() },
            }),
        }
    }

    /// Size `output` for the rest of the request (up to [`OUTPUT_RESERVE_CAP`] tokens) so the
    /// per-step append never reallocates: a reallocation copies the whole buffer inside a step
    /// and, since running requests advance in lockstep, tends to hit all of them in one step.
    /// Done at admission, not at arrival, so a long waiting queue holds no output buffers.
    pub(crate) fn reserve_output(&mut self) {
        let want = (self.max_tokens as usize).min(OUTPUT_RESERVE_CAP);
        if self.output.capacity() < want {
            self.output.reserve_exact(want - self.output.len());
        }
    }

    /// Leading blocks of the table registered in the prefix cache.
    #[inline]
    pub(crate) fn registered(&self) -> usize {
        self.num_registered as usize
    }

    /// Set the number of registered leading blocks (at most the table's length).
    #[inline]
    pub(crate) fn set_registered(&mut self, blocks: usize) {
        self.num_registered = u32::try_from(blocks).expect("a table holds at most num_blocks");
    }

    /// Rows of positions its block table covers (blocks per row: `planes`).
    #[inline]
    pub(crate) fn table_rows(&self) -> usize {
        self.block_table.len() / usize::from(self.planes)
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
        (self.num_tokens() + self.placeholders as usize).saturating_sub(self.num_computed)
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

    /// Tokens its next prompt work may compute at most with `computed` tokens computed: a fork
    /// source stops once before its last prompt token (the point its samples fork from), then
    /// goes on.
    #[inline]
    pub(crate) fn fork_cap(&self, computed: usize) -> usize {
        let point = self.prompt.len() - 1;
        if computed < point && self.cold.fork_source {
            point - computed
        } else {
            usize::MAX
        }
    }

    /// The request may not schedule more tokens yet: its pending samples already reach
    /// `max_tokens`, the model length, or (prefill-only) the first token.
    pub(crate) fn output_capped(&self, max_model_len: usize) -> bool {
        let produced = self.output.len() + self.placeholders as usize;
        produced >= self.max_tokens as usize
            || self.num_tokens() + self.placeholders as usize >= max_model_len
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
        if self.num_tokens() >= max_model_len || self.output.len() >= self.max_tokens as usize {
            return Some(FinishReason::Length);
        }
        if self.output.len() < self.min_tokens as usize {
            return None;
        }
        let last = *self.output.last()?;
        if self.stop_filter & filter_bit(last) == 0 {
            return None;
        }
        if !self.ignore_eos && self.cold.eos_token_ids.contains(last) {
            return Some(FinishReason::Stop(StopCause::Eos(last)));
        }
        if self.cold.stop_token_ids.contains(last) {
            return Some(FinishReason::Stop(StopCause::StopToken(last)));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_hash::extend_block_hashes;
    use crate::types::Timestamp;

    fn req(max_tokens: usize) -> Request {
        let mut n = NewRequest::new(RequestId(1), vec![1, 2, 3], max_tokens, Timestamp(0));
        n.eos_token_ids = vec![9];
        n.stop_token_ids = vec![7, 1, 2, 4, 5];
        Request::new(n, 0, 4, None)
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
    fn record_is_three_cache_lines() {
        use std::mem::{align_of, offset_of, size_of};
        assert_eq!(align_of::<Request>(), 64);
        assert_eq!(size_of::<Request>(), 192, "a step should touch at most 3 lines per request");
        // What applying a token reads is in lines 0 and 1; line 2 starts with the id.
        assert_eq!(offset_of!(Request, block_table), 64);
        assert!(offset_of!(Request, exec) < 128);
        assert_eq!(offset_of!(Request, id), 128);
        assert_eq!(size_of::<Option<Request>>(), size_of::<Request>(), "the slab uses a niche");
    }

    #[test]
    fn stop_filter_only_skips_tokens_that_cannot_stop() {
        // 41 shares 9's filter bit (41 mod 32 = 9) but is not an EOS id; 37 shares 5's.
        let mut r = req(10);
        assert_eq!(r.stop_filter, [9, 7, 1, 2, 4, 5].iter().fold(0, |f, &t| f | filter_bit(t)));
        for (token, want) in [
            (41, None),
            (37, None),
            (5, Some(FinishReason::Stop(StopCause::StopToken(5)))),
            (9, Some(FinishReason::Stop(StopCause::Eos(9)))),
        ] {
            r.output.clear();
            r.output.push(token);
            assert_eq!(r.check_stop(100), want, "token {token}");
        }
        let plain =
            Request::new(NewRequest::new(RequestId(2), vec![1], 4, Timestamp(0)), 0, 4, None);
        assert_eq!(plain.stop_filter, 0, "no stop ids: every token skips the id sets");
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
