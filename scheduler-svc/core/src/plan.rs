//! The step plan: what one step tells the executor, as a diff against the executor's state.
//!
//! Why this shape: it is what the scheduler→executor protocol carries (DESIGN §4), so the
//! service layer only translates it. Variable-length parts (block ids, tokens, hashes) live in
//! three flat buffers addressed by [`Span`]s, so a plan is rebuilt every step into the same
//! allocations; only the prompt of a new request is shared (`Arc`) rather than copied.
//!
//! Invariants kept: `total_tokens` equals the sum of `scheduled[*].num_tokens`, never exceeds
//! the configured budget (checked by `check_invariants`); every scheduled request appears
//! either in `new_requests` (first time) or is known to the executor; a request appears at
//! most once in `scheduled`.

use std::sync::Arc;

use crate::block_hash::BlockHash;
pub use crate::block_pool::CacheChanges;
use crate::types::{BlockId, RequestId, StepId, TokenId, TransferId};
use crate::work_queues::{Operation, WorkKey};

/// A range in one of the plan's flat buffers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Span {
    /// First index.
    pub start: u32,
    /// Number of elements.
    pub len: u32,
}

impl Span {
    fn range(self) -> std::ops::Range<usize> {
        self.start as usize..(self.start + self.len) as usize
    }
}

/// A request the executor sees for the first time.
#[derive(Debug, Clone, PartialEq)]
pub struct NewRequestData {
    /// The request.
    pub id: RequestId,
    /// Its prompt tokens.
    pub prompt: Arc<[TokenId]>,
    /// Output tokens it arrived with (generated before it moved here); usually empty.
    pub output: Arc<[TokenId]>,
    /// Its whole block table (in [`StepPlan::block_ids`]).
    pub block_ids: Span,
    /// Tokens whose KV is already there (prefix-cache hit or import).
    pub num_computed_tokens: usize,
    /// A looped model's request: the most recurrent loops each of its tokens runs, which sets
    /// its KV planes (its table holds `planes` blocks per row); 0 for a plain model's.
    pub max_loops: u8,
}

/// An update for a request the executor already knows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CachedRequestData {
    /// The request.
    pub id: RequestId,
    /// It was preempted since the executor last ran it: `block_ids` is the whole table (replace
    /// it), `tokens` all its tokens so far.
    pub resumed: bool,
    /// New blocks appended to its table, or the whole table if `resumed`.
    pub block_ids: Span,
    /// If `resumed`: prompt + output tokens (in [`StepPlan::tokens`]); else empty.
    pub tokens: Span,
    /// Tokens whose KV is computed before this step's work.
    pub num_computed_tokens: usize,
}

/// Work scheduled for one request in this step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScheduledWork {
    /// The request.
    pub id: RequestId,
    /// Kind of work.
    pub work: WorkKey,
    /// Tokens to compute.
    pub num_tokens: usize,
    /// The executor must return a sampled token for it (decode, verify, or the last prompt
    /// chunk): one, or for a verify one plus each draft token it accepted.
    pub samples_token: bool,
    /// `Verify` only: the draft tokens (in [`StepPlan::tokens`]), `num_tokens - 1` of them,
    /// which follow the request's last token. Empty for other work.
    pub draft: Span,
    /// A looped model's recurrent work: the loop it runs (from 1); 0 for other work.
    pub loop_index: u8,
}

/// A KV transfer operation the executor performs with its local KV agent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvOp {
    /// Fill `block_ids` with the KV arriving through `transfer_id`.
    Import {
        /// Receiving request.
        id: RequestId,
        /// The transfer.
        transfer_id: TransferId,
        /// Blocks to fill, in token order.
        block_ids: Span,
        /// Hashes of the full ones among them (the last block may be partial).
        block_hashes: Span,
        /// Prompt tokens the import covers.
        num_tokens: usize,
    },
    /// Send `block_ids` (the request's KV for `num_tokens` tokens) through `transfer_id`.
    Export {
        /// Transferring request.
        id: RequestId,
        /// The transfer (issued by this core).
        transfer_id: TransferId,
        /// Blocks to read, in token order.
        block_ids: Span,
        /// Hashes of the full ones among them.
        block_hashes: Span,
        /// Tokens whose KV is exported.
        num_tokens: usize,
    },
    /// Copy `block_ids` (full blocks, named by `block_hashes`) to the node's agent, the KV
    /// tier. Not a transfer: no request waits on it and its result does not come back.
    Store {
        /// Blocks to copy.
        block_ids: Span,
        /// Their hashes.
        block_hashes: Span,
    },
}

/// Copy one KV block's contents into another, in every layer: a sample of several starts
/// its own copy of the partial block its prompt's KV ends in ([`crate::Fork`]). The executor
/// does every copy of a step before the step's forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    /// The forked sample, whose table gains `dst` in this step.
    pub id: RequestId,
    /// Block read (held by the source sample).
    pub src: BlockId,
    /// Block written (new to the forked sample).
    pub dst: BlockId,
}

/// One step for the executor. Returned by reference from [`crate::Scheduler::schedule`] and
/// rebuilt in place by the next call.
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    /// The step's id; its result must carry it.
    pub step_id: StepId,
    /// Requests the executor sees for the first time.
    pub new_requests: Vec<NewRequestData>,
    /// Updates for known requests (new blocks, or resume after preemption).
    pub cached_requests: Vec<CachedRequestData>,
    /// The model call: a looped model's steps run one stage over the whole batch; a plain
    /// model's steps are `Whole`.
    pub operation: Operation,
    /// The batch: work per request.
    pub scheduled: Vec<ScheduledWork>,
    /// Requests the executor must forget (finished or aborted since the previous step).
    pub finished: Vec<RequestId>,
    /// Requests preempted in this step (drop them from the running batch).
    pub preempted: Vec<RequestId>,
    /// KV transfer operations.
    pub kv_ops: Vec<KvOp>,
    /// Blocks to copy before the forward (samples forking from a shared prompt).
    pub block_copies: Vec<BlockCopy>,
    /// Sum of `scheduled[*].num_tokens`.
    pub total_tokens: usize,
    /// Flat buffer of block ids addressed by spans.
    pub block_ids: Vec<BlockId>,
    /// Flat buffer of tokens addressed by spans.
    pub tokens: Vec<TokenId>,
    /// Flat buffer of block hashes addressed by spans.
    pub block_hashes: Vec<BlockHash>,
    /// The prefix cache's changes since the previous step, for the executor's copy of it.
    pub cache: CacheChanges,
}

impl StepPlan {
    /// Block ids of a span.
    #[must_use]
    pub fn blocks(&self, span: Span) -> &[BlockId] {
        &self.block_ids[span.range()]
    }

    /// Tokens of a span.
    #[must_use]
    pub fn tokens_of(&self, span: Span) -> &[TokenId] {
        &self.tokens[span.range()]
    }

    /// The draft tokens of scheduled work (empty unless it is a `Verify`).
    #[must_use]
    pub fn draft_of(&self, work: &ScheduledWork) -> &[TokenId] {
        self.tokens_of(work.draft)
    }

    /// Block hashes of a span.
    #[must_use]
    pub fn hashes(&self, span: Span) -> &[BlockHash] {
        &self.block_hashes[span.range()]
    }

    /// True if the step carries no work and no KV operation (it may still report finished ids).
    #[must_use]
    pub fn is_idle(&self) -> bool {
        self.scheduled.is_empty() && self.kv_ops.is_empty() && self.block_copies.is_empty()
    }

    pub(crate) fn clear(&mut self, step_id: StepId) {
        self.step_id = step_id;
        self.operation = Operation::Whole;
        self.new_requests.clear();
        self.cached_requests.clear();
        self.scheduled.clear();
        self.finished.clear();
        self.preempted.clear();
        self.kv_ops.clear();
        self.block_copies.clear();
        self.total_tokens = 0;
        self.block_ids.clear();
        self.tokens.clear();
        self.block_hashes.clear();
    }

    pub(crate) fn push_blocks(&mut self, blocks: &[BlockId]) -> Span {
        let start = self.block_ids.len() as u32;
        self.block_ids.extend_from_slice(blocks);
        Span { start, len: blocks.len() as u32 }
    }

    pub(crate) fn push_hashes(&mut self, hashes: &[BlockHash]) -> Span {
        let start = self.block_hashes.len() as u32;
        self.block_hashes.extend_from_slice(hashes);
        Span { start, len: hashes.len() as u32 }
    }

    pub(crate) fn push_tokens(&mut self, parts: &[&[TokenId]]) -> Span {
        let start = self.tokens.len() as u32;
        for part in parts {
            self.tokens.extend_from_slice(part);
        }
        Span { start, len: self.tokens.len() as u32 - start }
    }
}
