//! Software prefetch: a hint that a cache line will be needed soon.
//!
//! Why: past a few thousand running requests a step's working set no longer fits in L2, and the
//! step loops touch each request's memory in an order the hardware prefetcher cannot guess (an
//! `output` buffer is its own heap allocation). The loops know which request comes a few
//! iterations later, so they ask for its lines early and the misses overlap instead of queueing
//! one after the other. A prefetch never faults and changes nothing observable; on targets
//! without one this is a no-op.
//!
//! Why this module may hold `unsafe` (every other module of the crate forbids it, see `lib.rs`):
//! stable Rust issues a prefetch only through the `_mm_prefetch` intrinsic, which is an
//! `unsafe fn` on the oldest Rust the workspace supports (`rust-version = 1.85`; from 1.87 it
//! is safe to call, hence `allow(unused_unsafe)`). The one `unsafe` block below is sound for
//! every pointer value, so [`prefetch`] is a safe function and its callers need no `unsafe`:
//! `prefetcht0` does not dereference its operand architecturally, never faults (not on a
//! null, dangling or unmapped address either), and SSE is part of the `x86_64` baseline, so
//! there is no target feature to check. Callers form addresses with `wrapping_add`, which is
//! defined for any pointer, and never read through them.
//!
//! The measurement that keeps it: with the hints compiled out, the core's bench (`ferry-bench
//! core`, median step time, ten runs alternating with the hinted build on a 2-core VM) ran a
//! decode step about 5 % slower at 1024 and 4096 running requests and 14 % slower at 16 384
//! (768 → 897 µs; p99 962 → 1379 µs); below 1024 the two are within noise.

/// Ask for the cache line holding `p` (any address, even dangling: it is only a hint). Always
/// inlined: it is one instruction, and a call would cost more than the hint saves.
#[allow(clippy::inline_always)]
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
