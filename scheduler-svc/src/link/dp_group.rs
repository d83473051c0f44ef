//! Data-parallel groups: executors whose steps must run together (data-parallel attention with
//! expert parallelism — each rank's step joins an all-to-all with every other rank), stepped in
//! rounds. Every rank of a group gets one step per round, an empty one when it has nothing to
//! do, and round r + 1 goes to no rank before every rank answered round r (vLLM's DP engine
//! cores step in lockstep and run a dummy batch when idle). The rounds a group's ranks run are
//! its links' business: each link's loop asks its [`Member`] whether it may step.
//!
//! Invariants: a rank sends at most one step per round; a round completes only once every
//! member answered it (a member that leaves — its link ended — no longer counts); a round
//! starts only when a member has work, so an idle group sends nothing. Round ids, waves and
//! which rounds are throttled (`--throttle-prefills`) are the core's
//! [`ferry_sched_core::dp_rounds`], which the simulator runs too.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use ferry_proto::v1;
use ferry_sched_core::dp_rounds::{Round, RoundClock};
use tokio::sync::watch;

/// The groups of one scheduler, by name.
#[derive(Debug, Default)]
pub struct DpGroups {
    groups: Mutex<HashMap<String, Arc<DpGroup>>>,
    /// Aligned prefill rounds, one in this many (`--throttle-prefills`); `None`: no throttle.
    throttle: Option<u64>,
}

impl DpGroups {
    /// Groups whose prefills are throttled to one aligned round in `throttle`, when given.
    #[must_use]
    pub fn new(throttle: Option<u64>) -> Self {
        Self { groups: Mutex::default(), throttle }
    }

    /// Makes the executor stating `rank` a member of its group (formed by its first member,
    /// and again by the first after every rank left).
    ///
    /// # Errors
    ///
    /// Its size differs from the group's, or its rank already has a live session.
    pub fn join(&self, rank: &v1::DataParallelRank) -> Result<Member, String> {
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        let group = match groups.get(&rank.group) {
            Some(g) if !g.lock().members.is_empty() => g.clone(),
            _ => {
                let g = Arc::new(DpGroup::new(rank.size, self.throttle));
                groups.insert(rank.group.clone(), g.clone());
                g
            }
        };
        drop(groups);
        if group.size != rank.size {
            return Err(format!(
                "data-parallel group {:?} has {} ranks, and this executor says {}",
                rank.group, group.size, rank.size
            ));
        }
        if !group.lock().members.insert(rank.rank) {
            return Err(format!(
                "rank {} of data-parallel group {:?} already has a live session",
                rank.rank, rank.group
            ));
        }
        group.changed.send_modify(|v| *v += 1);
        Ok(Member { group, rank: rank.rank })
    }
}

/// One group's rounds.
#[derive(Debug)]
struct DpGroup {
    size: u32,
    state: Mutex<Rounds>,
    /// Bumped on every change a member may wait for (a round started or completed, a member
    /// left or joined).
    changed: watch::Sender<u64>,
}

#[derive(Debug)]
struct Rounds {
    /// Ranks with a live session.
    members: BTreeSet<u32>,
    clock: RoundClock,
    /// Members that sent their step of the running round, and those whose result came back.
    stepped: BTreeSet<u32>,
    answered: BTreeSet<u32>,
    /// Some member answered the running round with work left.
    busy: bool,
}

impl DpGroup {
    fn new(size: u32, throttle: Option<u64>) -> Self {
        let state = Rounds {
            members: BTreeSet::new(),
            clock: RoundClock::new(throttle),
            stepped: BTreeSet::new(),
            answered: BTreeSet::new(),
            busy: false,
        };
        Self { size, state: Mutex::new(state), changed: watch::channel(0).0 }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Rounds> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ends the running round if every member answered it; true if it did.
    fn complete(s: &mut Rounds) -> bool {
        if s.clock.running().is_none() || s.members.iter().any(|m| !s.answered.contains(m)) {
            return false;
        }
        s.clock.end(s.busy);
        s.stepped.clear();
        s.answered.clear();
        s.busy = false;
        true
    }
}

/// A link's membership of its executor's group; leaving the group when dropped (the link ended).
#[derive(Debug)]
pub struct Member {
    group: Arc<DpGroup>,
    rank: u32,
}

impl Member {
    /// A receiver that wakes when the group changes (a round started or ended, a member came
    /// or went): a member told to wait asks again then.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.group.changed.subscribe()
    }

    /// Whether this rank sends a step now, and for which round: the running round if it has
    /// not stepped in it (a rank without work sends an empty one), or a new round that this
    /// call starts when the rank `has_work` and none runs. `None`: wait for a change.
    pub fn may_step(&self, has_work: bool) -> Option<Round> {
        let mut s = self.group.lock();
        if s.clock.running().is_none() {
            if !has_work {
                return None;
            }
            s.clock.start();
            self.group.changed.send_modify(|v| *v += 1);
        }
        if !s.stepped.insert(self.rank) {
            return None;
        }
        s.clock.running()
    }

    /// This rank's result of `round` arrived; `busy`: it has work left.
    pub fn answered(&self, round: u64, busy: bool) {
        let mut s = self.group.lock();
        if s.clock.running().is_some_and(|r| r.id == round) && s.stepped.contains(&self.rank) {
            s.answered.insert(self.rank);
            s.busy |= busy;
            if DpGroup::complete(&mut s) {
                self.group.changed.send_modify(|v| *v += 1);
            }
        }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let mut s = self.group.lock();
        s.members.remove(&self.rank);
        s.stepped.remove(&self.rank);
        s.answered.remove(&self.rank);
        // The others finish the round without it (a group left empty forms again on a join).
        DpGroup::complete(&mut s);
        self.group.changed.send_modify(|v| *v += 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(r: u32, size: u32) -> v1::DataParallelRank {
        v1::DataParallelRank { group: "g".into(), rank: r, size }
    }

    #[test]
    fn a_round_waits_for_every_rank_and_an_idle_rank_steps_empty() {
        let groups = DpGroups::new(None);
        let (a, b) = (groups.join(&rank(0, 2)).unwrap(), groups.join(&rank(1, 2)).unwrap());
        assert_eq!(b.may_step(false), None, "nobody has work: no round");
        let first = a.may_step(true).unwrap();
        assert_eq!(first, Round { id: 1, throttle: false });
        assert_eq!(a.may_step(true), None, "one step a round");
        assert_eq!(b.may_step(false).unwrap().id, 1, "the idle rank steps (empty) too");
        a.answered(1, true);
        assert_eq!(a.may_step(true), None, "round 2 waits for rank 1's answer");
        b.answered(1, false);
        assert_eq!(a.may_step(true).unwrap().id, 2);
        // A rank that leaves mid-round no longer holds it.
        drop(b);
        a.answered(2, false);
        assert_eq!(a.may_step(true).unwrap().id, 3);
        assert!(groups.join(&rank(0, 2)).is_err(), "rank 0 is live");
        assert!(groups.join(&rank(1, 3)).is_err(), "the group has 2 ranks");
    }

    #[test]
    fn rounds_carry_the_clocks_throttle() {
        let groups = DpGroups::new(Some(2));
        let a = groups.join(&rank(0, 1)).unwrap();
        let mut throttled = Vec::new();
        for _ in 0..3 {
            let round = a.may_step(true).unwrap();
            throttled.push(round.throttle);
            a.answered(round.id, true);
        }
        assert_eq!(throttled, [false, true, false]);
    }
}
