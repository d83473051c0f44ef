//! The one retry policy every Ferry service uses: exponential backoff between a first and a
//! largest delay, optionally until a deadline.
//!
//! Why one: each service retries something that comes and goes (an executor still loading its
//! model, a leader being elected, etcd restarting). One policy keeps their pacing consistent and
//! makes the time they give up explicit. It runs on tokio's clock, so tests with paused time
//! (`tokio::time::pause`) drive it without waiting.
//!
//! Delays carry a ±25 % jitter derived from the process id and the attempt number, so many
//! processes that lost the same peer at the same moment do not retry in lockstep, while a
//! single process stays reproducible.

use std::time::Duration;

use tokio::time::Instant;

/// Retry pacing: `wait` sleeps `initial`, then twice that, …, up to `max`; with a deadline it
/// refuses to wait past it.
#[derive(Clone, Debug)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
    attempt: u32,
    deadline: Option<Instant>,
}

impl Backoff {
    /// Delays from `initial` doubling to `max`, with no deadline.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self { initial, max: max.max(initial), next: initial, attempt: 0, deadline: None }
    }

    /// The same, giving up once `patience` from now has passed (`None`: never).
    #[must_use]
    pub fn with_patience(mut self, patience: Option<Duration>) -> Self {
        self.deadline = patience.map(|p| Instant::now() + p);
        self
    }

    /// Whether the deadline has passed.
    pub fn expired(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Sleeps for the next delay (cut short at the deadline) and returns true, or returns
    /// false at once when the deadline has passed: the caller should stop retrying.
    pub async fn wait(&mut self) -> bool {
        if self.expired() {
            return false;
        }
        let mut delay = jittered(self.next, self.attempt);
        if let Some(deadline) = self.deadline {
            delay = delay.min(deadline.saturating_duration_since(Instant::now()));
        }
        tokio::time::sleep(delay).await;
        self.attempt = self.attempt.wrapping_add(1);
        self.next = (self.next * 2).min(self.max);
        true
    }

    /// Starts again from the first delay (after a success); the deadline stays.
    pub fn reset(&mut self) {
        self.next = self.initial;
        self.attempt = 0;
    }
}

/// `delay` scaled by a factor in [0.75, 1.25) that depends on the process and the attempt.
fn jittered(delay: Duration, attempt: u32) -> Duration {
    let mut x = u64::from(std::process::id()) << 32 | u64::from(attempt);
    // splitmix64's finalizer: a well-spread hash of (pid, attempt).
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    let permille = 750 + (x % 500);
    delay * u32::try_from(permille).expect("below 1250") / 1000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn delays_double_to_the_cap_and_stop_at_the_deadline() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(400))
            .with_patience(Some(Duration::from_secs(1)));
        let start = Instant::now();
        let mut waits = Vec::new();
        let mut last = start;
        while b.wait().await {
            waits.push(last.elapsed());
            last = Instant::now();
        }
        // Nominal 100, 200, 400, 400 … each within ±25 %, and the last cut at the deadline.
        let nominal = [100u64, 200, 400];
        for (w, n) in waits.iter().zip(nominal) {
            let ms = w.as_millis() as u64;
            assert!((n * 3 / 4..=n * 5 / 4).contains(&ms), "waited {ms} ms for nominal {n}");
        }
        assert_eq!(start.elapsed(), Duration::from_secs(1), "gave up exactly at the deadline");
        assert!(!b.wait().await, "no more waiting after the deadline");
    }

    #[tokio::test(start_paused = true)]
    async fn reset_starts_from_the_first_delay_and_no_deadline_never_gives_up() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
        for _ in 0..20 {
            assert!(b.wait().await);
        }
        b.reset();
        let before = Instant::now();
        assert!(b.wait().await);
        assert!(before.elapsed() <= Duration::from_millis(125));
    }
}
