//! The rounds of a data-parallel group: their ids, waves, and which are throttled. One pure
//! rule for the scheduler's groups (`ferry-scheduler`'s `link::dp_group`) and the simulator's.
//!
//! A round starts when a rank has work and ends when every rank answered it. A wave is a run
//! of rounds from a start after a round that left every rank idle; with a throttle interval
//! `n`, the wave's k-th round is an aligned prefill round when `n` divides k and throttled
//! otherwise ([`crate::Scheduler::schedule_throttled`]) — vLLM's DP engine core throttles the
//! steps whose counter, restarted with each wave, is not a multiple of its
//! `prefill_schedule_interval`.

/// A round: its id (from 1; 0 is no round) and whether it is throttled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Round {
    /// Its id.
    pub id: u64,
    /// Not an aligned prefill round of a throttled group.
    pub throttle: bool,
}

/// A group's rounds, as they start and end.
#[derive(Debug, Clone, Copy)]
pub struct RoundClock {
    /// The round running, or the next one.
    next: u64,
    running: bool,
    /// The first round of the current wave, and whether the last round left every rank idle
    /// (the next round to start begins a wave).
    wave_start: u64,
    idle: bool,
    /// Aligned prefill rounds, one in this many; `None`: no throttle.
    interval: Option<u64>,
}

impl RoundClock {
    /// No round yet; with `interval`, rounds between aligned ones are throttled.
    #[must_use]
    pub fn new(interval: Option<u64>) -> Self {
        Self { next: 1, running: false, wave_start: 1, idle: true, interval }
    }

    /// The round running, if one is.
    #[must_use]
    pub fn running(&self) -> Option<Round> {
        self.running.then(|| Round {
            id: self.next,
            throttle: self
                .interval
                .is_some_and(|n| !(self.next - self.wave_start).is_multiple_of(n)),
        })
    }

    /// Starts the next round (a wave's first if the last one left every rank idle); the one
    /// running if one is.
    pub fn start(&mut self) -> Round {
        if !self.running {
            self.running = true;
            if self.idle {
                (self.wave_start, self.idle) = (self.next, false);
            }
        }
        self.running().expect("started")
    }

    /// Ends the running round, if one is; `busy`: some rank had work left (otherwise the next
    /// round begins a wave).
    pub fn end(&mut self, busy: bool) {
        if self.running {
            (self.running, self.next, self.idle) = (false, self.next + 1, !busy);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waves_restart_the_aligned_rounds() {
        let mut clock = RoundClock::new(Some(3));
        assert_eq!(clock.running(), None);
        let mut throttled = Vec::new();
        for busy in [true, true, true, true, false] {
            let round = clock.start();
            assert_eq!(clock.start(), round, "starting a running round changes nothing");
            throttled.push(round.throttle);
            clock.end(busy);
        }
        assert_eq!(throttled, [false, true, true, false, true]);
        // The last round left every rank idle: the next one starts a wave, aligned.
        assert_eq!(clock.start(), Round { id: 6, throttle: false });
        clock.end(true);
        clock.end(true);
        assert_eq!(clock.start().id, 7, "ending twice ends one round");
        assert!(!RoundClock::new(None).start().throttle, "without an interval, nothing is");
    }
}
