//! Software prefetch: a hint that a cache line will be needed soon.
//!
//! Why: past a few thousand running requests a step's working set no longer fits in L2, and the
//! step loops touch each request's memory in an order the hardware prefetcher cannot guess (an
//! `output` buffer is its own heap allocation). The loops know which request comes a few
//! iterations later, so they ask for its lines early and the misses overlap instead of queueing
//! one after the other. A prefetch never faults and changes nothing observable; on targets
//! without one this is a no-op.

/// Ask for the cache line holding `p` (any address, even dangling: it is only a hint).
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetcht0` only hints the cache; it does not dereference `p` architecturally,
    // never faults, and SSE is part of the x86_64 baseline. (`unsafe` is needed before Rust 1.87.)
    #[allow(unused_unsafe)]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
