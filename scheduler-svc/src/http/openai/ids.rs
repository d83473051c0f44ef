//! The ids a response carries (`cmpl-…`, `chatcmpl-…`, `chatcmpl-tool-…`) and its `created`
//! time. The ids are random per call (a fresh `RandomState`), not secret: they only tell
//! responses and calls apart.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch (0 if the clock is before it): a response's `created`.
pub(super) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A random 64-bit id (hex in responses and tool calls).
pub(super) fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(unix_now());
    h.finish()
}
