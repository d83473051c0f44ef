//! Data-parallel groups in the simulation, as `ferry-scheduler` runs them (`link/dp_group.rs`):
//! consecutive executors of `size` form a group whose ranks step in rounds. A round starts when
//! a rank has work; every rank builds its step then (an idle one none: its dummy step costs
//! nothing of its own), and the round ends for all at once — when its slowest rank's step
//! ends, plus the expert-parallel all-to-all that every rank joins: per layer a dispatch and a
//! combine that move each of the busiest rank's tokens' hidden state (2 bytes an element) to
//! its `experts_per_token` experts, of which `(size - 1) / size` live on other ranks, over the
//! GPUs' interconnect, each with the hardware's collective latency. Round ids, waves and which
//! rounds are throttled are the core's [`ferry_sched_core::dp_rounds`], as in the scheduler.

use ferry_roofline::{SimHardware, SimModel};
use ferry_sched_core::dp_rounds::RoundClock;

/// Data-parallel groups of the cluster.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DataParallel {
    /// Ranks in a group (consecutive executors; the last group may be smaller).
    pub size: usize,
    /// Aligned prefill rounds, one in this many (`--throttle-prefills`); `None`: no throttle.
    pub throttle: Option<u64>,
}

/// One group's rounds.
#[derive(Debug)]
pub(super) struct Group {
    pub clock: RoundClock,
    /// Its ranks' steps of a round are being planned; a rank was woken meanwhile.
    pub planning: bool,
    pub rewake: bool,
}

impl DataParallel {
    /// The group of executor `e`.
    pub(super) fn group_of(&self, e: usize) -> usize {
        e / self.size
    }

    /// The executors of group `g` among `executors`.
    pub(super) fn members(&self, g: usize, executors: usize) -> std::ops::Range<usize> {
        g * self.size..((g + 1) * self.size).min(executors)
    }

    /// A group before its first round.
    pub(super) fn group(&self) -> Group {
        Group { clock: RoundClock::new(self.throttle), planning: false, rewake: false }
    }

    /// The all-to-all of a round whose busiest rank computes `tokens` tokens, seconds.
    pub(super) fn all_to_all_secs(&self, hw: &SimHardware, model: &SimModel, tokens: u32) -> f64 {
        if self.size < 2 {
            return 0.0;
        }
        let k = f64::from(model.experts_per_token.max(1));
        let remote = (self.size - 1) as f64 / self.size as f64;
        let bytes = f64::from(tokens) * f64::from(model.hidden) * 2.0 * k * remote;
        let one = bytes / (hw.interconnect_gbps * 1e9) + hw.allreduce_latency_us * 1e-6;
        f64::from(model.num_layers) * 2.0 * one
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_runs_of_consecutive_executors() {
        let dp = DataParallel { size: 2, throttle: Some(3) };
        assert_eq!((dp.group_of(3), dp.members(1, 3)), (1, 2..3));
    }
}
