//! Admission slots: the set of requests that own execution resources, at most `max_num_seqs`.
//!
//! Why separate from status: a request that finished logically (EOS applied from step N) may
//! still be referenced by step N+1 already sent to the executor; it keeps its slot until that
//! step's result is applied and its finish was reported, so the executor never holds more than
//! `max_num_seqs` requests. The set itself is the `has_slot` flag on each request; this type
//! owns the count and the bound, and `check_invariants` verifies count = flags.

/// Counter of held admission slots with its bound.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdmissionSlots {
    held: usize,
    max: usize,
}

impl AdmissionSlots {
    pub(crate) fn new(max: usize) -> Self {
        AdmissionSlots { held: 0, max }
    }

    /// Slots in use.
    #[inline]
    pub(crate) fn held(&self) -> usize {
        self.held
    }

    /// The bound (`max_num_seqs`).
    #[inline]
    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// True if one more request can be admitted.
    #[inline]
    pub(crate) fn has_free(&self) -> bool {
        self.held < self.max
    }

    /// Take a slot; false if none is free.
    pub(crate) fn acquire(&mut self) -> bool {
        if self.held < self.max {
            self.held += 1;
            true
        } else {
            false
        }
    }

    /// Give a slot back.
    pub(crate) fn release(&mut self) {
        debug_assert!(self.held > 0, "slot released twice");
        self.held = self.held.saturating_sub(1);
    }
}
