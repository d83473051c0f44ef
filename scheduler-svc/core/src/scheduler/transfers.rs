//! KV transfers: the transfer ids this core knows, the imports waiting for a fetch slot, the
//! exports waiting to be issued, and the counts the limits and gauges read.
//!
//! Why apart from the requests: a transfer is named by the cluster scheduler, and a report
//! about it (in a step result, or from the service layer on a deadline) arrives by transfer id,
//! so the core needs transfer id → request; and an import may start only while fewer than
//! `max_kv_fetches` are in progress, in arrival order, which takes a queue of its own.
//!
//! Lifetime: a transfer id is reserved when its request is added (an import, or the export of a
//! prefill-only request) and released when the transfer is reported, or when the request
//! finishes before the transfer started. A transfer in progress outlives an abort of its
//! request: the executor still touches its blocks until it reports.
//!
//! Invariants kept (see [`KvTransfers::check`]): the import queue is a well-formed list; an
//! export is pending at most once, for a request with a reserved transfer; imports in progress
//! never exceed `max_kv_fetches`. (That each request's transfer state agrees with the id map,
//! the queue and the counters is checked with the requests by `check_invariants`.)

use rustc_hash::{FxHashMap, FxHashSet};

use crate::lists::Lists;
use crate::types::TransferId;

/// The one list of the import queue's [`Lists`].
const IMPORT_QUEUE: u32 = 0;

/// Transfer ids, queued imports, pending exports and in-progress counts of one core.
#[derive(Debug)]
pub(crate) struct KvTransfers {
    /// Reserved transfer ids → arena entry of their request.
    by_id: FxHashMap<TransferId, u32>,
    /// Requests whose import waits for a fetch slot and blocks, in arrival order.
    import_queue: Lists,
    /// Imports whose blocks are allocated and whose op was issued.
    importing: usize,
    /// Requests in `Transferring` (their prompt is done and their KV is leaving).
    transferring: usize,
    /// `Transferring` requests whose export op goes out with the next step.
    exports_pending: Vec<u32>,
}

impl Default for KvTransfers {
    fn default() -> Self {
        KvTransfers {
            by_id: FxHashMap::default(),
            import_queue: Lists::new(1),
            importing: 0,
            transferring: 0,
            exports_pending: Vec::new(),
        }
    }
}

impl KvTransfers {
    /// True if `tid` is reserved by a live request or a transfer in progress.
    pub(crate) fn contains(&self, tid: TransferId) -> bool {
        self.by_id.contains_key(&tid)
    }

    /// The request that reserved `tid`.
    pub(crate) fn request_of(&self, tid: TransferId) -> Option<u32> {
        self.by_id.get(&tid).copied()
    }

    /// Number of reserved transfer ids.
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Reserve `tid` for the prefill-only request `idx` (its export starts once its prompt is
    /// done).
    pub(crate) fn reserve_export(&mut self, tid: TransferId, idx: u32) {
        self.by_id.insert(tid, idx);
    }

    /// Reserve `tid` for request `idx` and queue its import.
    pub(crate) fn queue_import(&mut self, tid: TransferId, idx: u32) {
        self.by_id.insert(tid, idx);
        self.import_queue.push_back(IMPORT_QUEUE, idx);
    }

    /// The request whose import is next in line.
    #[inline]
    pub(crate) fn next_import(&self) -> Option<u32> {
        self.import_queue.front(IMPORT_QUEUE)
    }

    /// Imports queued and not started.
    pub(crate) fn queued_imports(&self) -> usize {
        self.import_queue.len(IMPORT_QUEUE)
    }

    /// True if request `idx` is in the import queue.
    pub(crate) fn is_import_queued(&self, idx: u32) -> bool {
        self.import_queue.list_of(idx) == Some(IMPORT_QUEUE)
    }

    /// Imports in progress.
    #[inline]
    pub(crate) fn importing(&self) -> usize {
        self.importing
    }

    /// The queued import of `idx` starts: it leaves the queue and counts as in progress.
    pub(crate) fn start_import(&mut self, idx: u32) {
        self.import_queue.remove(idx);
        self.importing += 1;
    }

    /// Requests in `Transferring`.
    pub(crate) fn transferring(&self) -> usize {
        self.transferring
    }

    /// Request `idx` became `Transferring`: its export op goes out with the next step.
    pub(crate) fn queue_export(&mut self, idx: u32) {
        debug_assert!(!self.exports_pending.contains(&idx), "export queued twice");
        self.exports_pending.push(idx);
        self.transferring += 1;
    }

    /// Requests whose export op is due in the step being built.
    #[inline]
    pub(crate) fn exports_pending(&self) -> &[u32] {
        &self.exports_pending
    }

    /// The pending exports were issued.
    pub(crate) fn clear_exports_pending(&mut self) {
        self.exports_pending.clear();
    }

    /// A `Transferring` request finished (its export may still be in progress).
    pub(crate) fn left_transferring(&mut self) {
        debug_assert!(self.transferring > 0, "more requests left Transferring than entered");
        self.transferring -= 1;
    }

    /// Request `idx` finished before its transfer `tid` started (queued import, planned or
    /// queued export): release the id and drop it from the queues.
    pub(crate) fn cancel(&mut self, tid: TransferId, idx: u32) {
        self.by_id.remove(&tid);
        self.import_queue.remove(idx);
        self.exports_pending.retain(|&i| i != idx);
    }

    /// Transfer `tid` in progress was reported: release its id; returns its request.
    pub(crate) fn release(&mut self, tid: TransferId) -> Option<u32> {
        self.by_id.remove(&tid)
    }

    /// An import in progress ended (reported, either way): its fetch slot is free.
    pub(crate) fn import_ended(&mut self) {
        debug_assert!(self.importing > 0, "more imports ended than started");
        self.importing -= 1;
    }

    /// Verify the transfers' own invariants.
    pub(crate) fn check(&self, max_kv_fetches: usize) -> Result<(), String> {
        self.import_queue.check()?;
        if self.importing > max_kv_fetches {
            return Err(format!(
                "{} imports in progress, max_kv_fetches {max_kv_fetches}",
                self.importing
            ));
        }
        if self.exports_pending.len() > self.transferring {
            return Err(format!(
                "{} exports pending but {} requests Transferring",
                self.exports_pending.len(),
                self.transferring
            ));
        }
        let reserved: FxHashSet<u32> = self.by_id.values().copied().collect();
        for (i, &idx) in self.exports_pending.iter().enumerate() {
            if self.exports_pending[..i].contains(&idx) {
                return Err(format!("entry {idx}'s export is pending twice"));
            }
            if !reserved.contains(&idx) {
                return Err(format!("entry {idx}'s export is pending without a transfer id"));
            }
        }
        for idx in self.import_queue.iter(IMPORT_QUEUE) {
            if !reserved.contains(&idx) {
                return Err(format!("entry {idx}'s import is queued without a transfer id"));
            }
        }
        if self.importing + self.queued_imports() + self.exports_pending.len() > self.by_id.len() {
            return Err("more transfers queued or in progress than reserved ids".into());
        }
        Ok(())
    }
}
