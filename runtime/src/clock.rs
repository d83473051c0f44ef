//! Wall-clock time as the services exchange it: Unix milliseconds (a KV transfer's deadline
//! crosses processes and machines, so it cannot be an `Instant`).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Now, in Unix milliseconds.
#[must_use]
pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Now, in Unix microseconds (for traces that line up events of several processes).
#[must_use]
pub fn now_unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The wall-clock deadline `after` from now, in Unix milliseconds.
#[must_use]
pub fn unix_deadline(after: Duration) -> u64 {
    now_unix_ms().saturating_add(u64::try_from(after.as_millis()).unwrap_or(u64::MAX))
}

/// The local instant of the wall-clock deadline `unix_ms` (now, if it has passed).
#[must_use]
pub fn instant_of(unix_ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(unix_ms.saturating_sub(now_unix_ms()))
}
