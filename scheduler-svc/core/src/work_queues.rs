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
}

impl WorkKey {
    /// All keys, in queue-index order.
    pub const ALL: [WorkKey; 4] =
        [WorkKey::Prompt, WorkKey::PromptChunk, WorkKey::Decode, WorkKey::Verify];

    #[inline]
    fn index(self) -> u32 {
        match self {
            WorkKey::Prompt => 0,
            WorkKey::PromptChunk => 1,
            WorkKey::Decode => 2,
            WorkKey::Verify => 3,
        }
    }

    #[inline]
    fn from_index(i: u32) -> WorkKey {
        WorkKey::ALL[i as usize]
    }

    /// True for the prompt kinds.
    #[must_use]
    pub fn is_prompt(self) -> bool {
        matches!(self, WorkKey::Prompt | WorkKey::PromptChunk)
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
}
