//! The simulated GPU behind the `sim` backend (`--backend sim`): its tokens and its clock. Its
//! timing model, the roofline, is [`ferry_roofline`]'s (re-exported here), shared with the
//! discrete-event simulator: one timing model for both.
//!
//! Tokens come from [`sim_token`], a hash of (seed, position) like the real sampler's draws, so
//! a simulated request is reproducible across preemption and failover.

pub use ferry_roofline::{
    activation_bytes, kv_capacity_blocks, step_cost, step_duration, SimBatchItem, SimConfigError,
    SimHardware, SimModel, StepCost,
};

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::sampling::position_hash;

/// The model a simulating executor serves, set by each handshake (`--model-profile`: no model
/// file): the scheduler's vocabulary size and end-of-sequence token, which its tokens stay
/// below and avoid.
#[derive(Debug)]
pub struct SimIdentity {
    vocab_size: AtomicU32,
    eos: AtomicU32,
}

impl SimIdentity {
    /// A vocabulary of `vocab_size` (the profile's, until a scheduler names its own) without an
    /// end token.
    pub fn new(vocab_size: u32) -> Self {
        Self { vocab_size: AtomicU32::new(vocab_size), eos: AtomicU32::new(u32::MAX) }
    }

    /// Serves a scheduler's model of `vocab_size` tokens (0: keep the current) ending with
    /// `eos` (none: never ends early).
    pub fn adopt(&self, vocab_size: u32, eos: Option<u32>) {
        if vocab_size > 0 {
            self.vocab_size.store(vocab_size, Ordering::Relaxed);
        }
        self.eos.store(eos.unwrap_or(u32::MAX), Ordering::Relaxed);
    }

    /// The vocabulary size served.
    pub fn vocab_size(&self) -> u32 {
        self.vocab_size.load(Ordering::Relaxed)
    }

    /// The end-of-sequence token, if any.
    pub fn eos(&self) -> Option<u32> {
        Some(self.eos.load(Ordering::Relaxed)).filter(|&e| e != u32::MAX)
    }
}

/// The simulated token at `position` of a request seeded with `seed`: uniform over
/// `0..vocab_size` and a function of (seed, position) only. It may be the model's EOS id, which
/// ends the request early; use [`sim_token_except`] to rule that out. A vocabulary of 0 yields 0.
pub fn sim_token(seed: u64, position: u64, vocab_size: u32) -> u32 {
    // Salted so a simulated request's tokens are not its sampler draws in disguise.
    let hash = position_hash(seed ^ 0x5EED_0F51_u64, position);
    // Multiply-shift maps the hash onto 0..vocab_size without a modulo; the result is < vocab.
    ((u128::from(hash) * u128::from(vocab_size)) >> 64) as u32
}

/// As [`sim_token`], but never `avoid` (typically EOS): uniform over the other ids. When
/// `avoid` is the only id (a vocabulary of 1) or outside the vocabulary, it is [`sim_token`].
pub fn sim_token_except(seed: u64, position: u64, vocab_size: u32, avoid: u32) -> u32 {
    if avoid >= vocab_size || vocab_size < 2 {
        return sim_token(seed, position, vocab_size);
    }
    let token = sim_token(seed, position, vocab_size - 1);
    if token >= avoid {
        token + 1
    } else {
        token
    }
}

/// Where a simulated executor's time goes. Pure: it never reads a clock or sleeps itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimClock {
    /// Steps take wall-clock time: the caller sleeps for what [`SimClock::advance`] returns.
    RealTime,
    /// Steps take no wall-clock time; a virtual clock accumulates their durations.
    Virtual {
        /// Virtual time since the clock started.
        now: Duration,
    },
}

impl SimClock {
    /// A virtual clock at time zero.
    pub fn virtual_at_zero() -> Self {
        Self::Virtual { now: Duration::ZERO }
    }

    /// Accounts for a step of `step`; returns how long the caller must sleep (the step in real
    /// time, zero in virtual time). Virtual time saturates rather than overflows.
    pub fn advance(&mut self, step: Duration) -> Duration {
        match self {
            Self::RealTime => step,
            Self::Virtual { now } => {
                *now = now.saturating_add(step);
                Duration::ZERO
            }
        }
    }

    /// The virtual time, or `None` in real time (where the caller's `Instant` is the clock).
    pub fn now(&self) -> Option<Duration> {
        match self {
            Self::RealTime => None,
            Self::Virtual { now } => Some(*now),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_deterministic_in_range_and_spread() {
        let vocab = 49_152;
        let tokens: Vec<u32> = (0..10_000).map(|p| sim_token(3, p, vocab)).collect();
        assert!(tokens.iter().all(|&t| t < vocab));
        assert_eq!(tokens, (0..10_000).map(|p| sim_token(3, p, vocab)).collect::<Vec<_>>());
        let distinct: std::collections::HashSet<_> = tokens.iter().collect();
        assert!(distinct.len() > 8000, "{}", distinct.len());
        assert_ne!(tokens, (0..10_000).map(|p| sim_token(4, p, vocab)).collect::<Vec<_>>());
        for vocab in [1, 2, 3, 7] {
            assert!((0..1000).all(|p| sim_token(9, p, vocab) < vocab));
        }
        assert_eq!(sim_token(1, 2, 0), 0);
    }

    #[test]
    fn tokens_can_avoid_eos() {
        let (vocab, eos) = (5, 2);
        let mut seen = [0u32; 5];
        for position in 0..5000 {
            seen[sim_token_except(11, position, vocab, eos) as usize] += 1;
        }
        assert_eq!(seen[2], 0);
        assert!(seen.iter().enumerate().all(|(t, &n)| t == 2 || n > 1000), "{seen:?}");
        assert!((0..100).any(|p| sim_token(11, p, vocab) == eos));
        assert_eq!(sim_token_except(1, 1, 1, 0), 0);
        assert_eq!(sim_token_except(1, 1, 10, 99), sim_token(1, 1, 10));
    }

    #[test]
    fn clocks_account_for_steps() {
        let step = Duration::from_millis(7);
        let mut real = SimClock::RealTime;
        assert_eq!(real.advance(step), step);
        assert_eq!(real.now(), None);
        let mut virt = SimClock::virtual_at_zero();
        assert_eq!(virt.advance(step), Duration::ZERO);
        assert_eq!(virt.advance(step), Duration::ZERO);
        assert_eq!(virt.now(), Some(2 * step));
        virt.advance(Duration::MAX);
        assert_eq!(virt.now(), Some(Duration::MAX));
    }
}
