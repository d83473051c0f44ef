//! Pending work of admitted requests: one FIFO queue per [`WorkKey`].
//!
//! Why: the step builder takes work by kind (decodes first, then prompt chunks), and a request's
//! pending work must be found and removed in O(1) when it is preempted, aborted or finished.
//! The queues are intrusive lists keyed by the request's arena entry; the list an element is in
//! is the index "request → pending `WorkKey`".
//!
//! Invariants kept: a request has at most one pending `WorkKey` (it is in at most one queue);
//! the index and the queues agree by construction (see `lists`).

use crate::lists::Lists;

/// The kind of work a step can do for an admitted request.
///
/// A plain model's work is one model call over every layer (`Prompt`, `PromptChunk`, `Decode`,
/// `Verify`). A looped model's (see [`crate::LoopedModel`]) is split at its stages: a chain of
/// tokens (a prompt chunk, or the one token a decode computes) runs its prelude once, its
/// recurrent block one loop per step, and its coda, each a separate step whose [`Operation`] is
/// the stage's; the keys say which stage and whether the chain is prompt or decode work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkKey {
    /// The whole remaining prompt in one step (chunked prefill off).
    Prompt,
    /// A chunk of a chunked prefill (also the recompute of a preempted request).
    PromptChunk,
    /// One new token.
    Decode,
    /// A decode that also verifies draft tokens: the step computes the last token and each
    /// draft token, and the executor returns the tokens it accepted plus the one it sampled
    /// after them.
    Verify,
    /// Looped model: a prompt chunk (or a preempted request's recompute) through the prelude;
    /// it starts a chain and allocates the chain's KV in every plane.
    PromptPrelude,
    /// Looped model: a prompt chain's next loop of the recurrent block.
    PromptRecurrent,
    /// Looped model: a prompt chain through the coda (the last chunk's samples a token).
    PromptCoda,
    /// Looped model: the newest token through the prelude.
    DecodePrelude,
    /// Looped model: a decode chain's next loop of the recurrent block.
    DecodeRecurrent,
    /// Looped model: a decode chain through the coda, which samples the next token.
    DecodeCoda,
}

/// The model call a step makes: a looped model's steps each run one stage over the whole
/// batch; a plain model's run every layer (`Whole`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Operation {
    /// Every layer (a plain model).
    #[default]
    Whole,
    /// A looped model's prelude layers.
    Prelude,
    /// One loop of a looped model's recurrent block.
    Recurrent,
    /// A looped model's coda layers and output head.
    Coda,
}

impl WorkKey {
    /// All keys, in queue-index order.
    pub const ALL: [WorkKey; 10] = [
        WorkKey::Prompt,
        WorkKey::PromptChunk,
        WorkKey::Decode,
        WorkKey::Verify,
        WorkKey::PromptPrelude,
        WorkKey::PromptRecurrent,
        WorkKey::PromptCoda,
        WorkKey::DecodePrelude,
        WorkKey::DecodeRecurrent,
        WorkKey::DecodeCoda,
    ];

    #[inline]
    fn index(self) -> u32 {
        self as u32
    }

    #[inline]
    fn from_index(i: u32) -> WorkKey {
        WorkKey::ALL[i as usize]
    }

    /// True for the prompt kinds (a looped model's prompt stages too).
    #[must_use]
    pub fn is_prompt(self) -> bool {
        matches!(
            self,
            WorkKey::Prompt
                | WorkKey::PromptChunk
                | WorkKey::PromptPrelude
                | WorkKey::PromptRecurrent
                | WorkKey::PromptCoda
        )
    }

    /// The model call this work is part of.
    #[must_use]
    pub fn operation(self) -> Operation {
        match self {
            WorkKey::Prompt | WorkKey::PromptChunk | WorkKey::Decode | WorkKey::Verify => {
                Operation::Whole
            }
            WorkKey::PromptPrelude | WorkKey::DecodePrelude => Operation::Prelude,
            WorkKey::PromptRecurrent | WorkKey::DecodeRecurrent => Operation::Recurrent,
            WorkKey::PromptCoda | WorkKey::DecodeCoda => Operation::Coda,
        }
    }

    /// The stage key of `op` for prompt or decode work (`Whole` has none: `None`).
    #[must_use]
    pub fn stage(op: Operation, prompt: bool) -> Option<WorkKey> {
        Some(match (op, prompt) {
            (Operation::Whole, _) => return None,
            (Operation::Prelude, true) => WorkKey::PromptPrelude,
            (Operation::Prelude, false) => WorkKey::DecodePrelude,
            (Operation::Recurrent, true) => WorkKey::PromptRecurrent,
            (Operation::Recurrent, false) => WorkKey::DecodeRecurrent,
            (Operation::Coda, true) => WorkKey::PromptCoda,
            (Operation::Coda, false) => WorkKey::DecodeCoda,
        })
    }
}

/// One FIFO queue per [`WorkKey`] plus the request → key index, all O(1).
#[derive(Debug, Clone)]
pub(crate) struct WorkQueues {
    lists: Lists,
}

impl WorkQueues {
    pub(crate) fn new() -> Self {
        WorkQueues { lists: Lists::new(WorkKey::ALL.len()) }
    }

    /// Queue `work` for request `slot` at the back. The request must have no pending work.
    pub(crate) fn enqueue(&mut self, key: WorkKey, slot: u32) {
        self.lists.push_back(key.index(), slot);
    }

    /// Remove the request's pending work, if any, and return its key.
    pub(crate) fn remove(&mut self, slot: u32) -> Option<WorkKey> {
        self.lists.remove(slot).map(WorkKey::from_index)
    }

    /// The request's pending work.
    #[inline]
    pub(crate) fn pending(&self, slot: u32) -> Option<WorkKey> {
        self.lists.list_of(slot).map(WorkKey::from_index)
    }

    /// The first request waiting for `key` work.
    #[inline]
    pub(crate) fn front(&self, key: WorkKey) -> Option<u32> {
        self.lists.front(key.index())
    }

    /// Queue length for `key`.
    pub(crate) fn len(&self, key: WorkKey) -> usize {
        self.lists.len(key.index())
    }

    /// Requests pending `key`, front to back.
    pub(crate) fn iter(&self, key: WorkKey) -> impl Iterator<Item = u32> + '_ {
        self.lists.iter(key.index())
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        self.lists.check()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_pending_key_per_request_with_o1_index() {
        let mut q = WorkQueues::new();
        q.enqueue(WorkKey::Decode, 3);
        q.enqueue(WorkKey::PromptChunk, 5);
        q.enqueue(WorkKey::Decode, 1);
        assert_eq!(q.pending(3), Some(WorkKey::Decode));
        assert_eq!(q.pending(5), Some(WorkKey::PromptChunk));
        assert_eq!(q.pending(4), None);
        assert_eq!(q.remove(3), Some(WorkKey::Decode));
        assert_eq!(q.front(WorkKey::Decode), Some(1));
        assert_eq!(q.len(WorkKey::Decode), 1);
        q.enqueue(WorkKey::Verify, 3);
        assert_eq!(q.iter(WorkKey::Verify).collect::<Vec<_>>(), vec![3]);
        q.check().unwrap();
    }

    #[test]
    fn keys_index_their_queues_and_name_their_operation() {
        for (i, key) in WorkKey::ALL.into_iter().enumerate() {
            assert_eq!(WorkKey::from_index(key.index()), key);
            assert_eq!(key.index() as usize, i);
            let op = key.operation();
            if op != Operation::Whole {
                assert_eq!(WorkKey::stage(op, key.is_prompt()), Some(key));
            }
        }
    }
}
