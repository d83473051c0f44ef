//! Looped (recurrent-depth) models: the stage each step runs and each request's chain.
//!
//! A looped model runs a prelude block once, a recurrent block up to `max_loops` times (a
//! request may leave the loop early, once the executor's exit criterion passes its threshold)
//! and a coda block that produces logits. The core schedules the stages as separate work
//! ([`WorkKey`]'s stage keys): a *chain* of tokens — a prompt chunk, or the one token a decode
//! computes — runs `Prelude`, then `Recurrent` loops 1, 2, …, then `Coda`, one stage per step,
//! each stage only after the previous one's result (the result of a loop says whether the
//! chain exited). Every step runs one [`Operation`] over its whole batch.
//!
//! KV per stage: each stage with layers has its own KV *plane* (the prelude's, one per loop,
//! the coda's), and a request's block table holds, for each block-sized row of positions, one
//! block per plane (`table[row * planes + plane]`). A chain's rows are allocated in every
//! plane when its prelude is scheduled, so recurrent and coda steps never allocate, and so
//! never preempt; a request needs `planes` times a plain request's blocks. A token whose chain
//! exited at loop `e` has no KV of its own in later loops: the executor fills its rows of the
//! planes after `e` with its loop-`e` KV, which is what later tokens attend to there.
//!
//! Selection: which operation a step runs is [`StageSelection`]'s rule; Ferry's is
//! deepest-first (coda, then recurrent, then prelude and admission), which finishes the chains
//! in progress before it starts new ones. `docs/ARCHITECTURE.md` argues why it cannot
//! livelock; the prelude-first rule exists so a test can show that the other order does.

use crate::work_queues::{Operation, WorkKey};

/// Most recurrent loops a looped model may run per token (KV planes are counted in a `u8`).
pub const MAX_LOOPS: u8 = 64;

/// How prompt and decode work of the same operation share a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum StagePolicy {
    /// One work key per step: decode work of the operation if there is any, else its prompt
    /// work.
    #[default]
    Separate,
    /// Decode and prompt work of the same operation in one step (decodes first).
    Mixed,
}

/// Which operation a step runs when several have work: the first in this order that can
/// schedule something.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum StageSelection {
    /// Coda, recurrent, prelude (Ferry's rule: chains in progress finish first).
    #[default]
    DeepestFirst,
    /// For tests only: the prelude whenever a request has prelude work or waits to be admitted,
    /// the recurrent block when none does, the coda last — chosen by which queues hold
    /// candidates, without falling through when the chosen stage schedules nothing (the shape
    /// of the seed's historical selection). It livelocks once every slot holds a chain and a
    /// request waits: each step picks the prelude, which can admit nobody, and no chain moves.
    /// The seed's livelock regression test shows it.
    PreludeFirst,
}

/// The shape of a looped model, as its executor states it, and how the core schedules it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LoopedModel {
    /// The prelude has layers (and so a KV plane); an embedding-only prelude has none.
    pub prelude_kv: bool,
    /// The coda has layers (and so a KV plane); a head-only coda has none.
    pub coda_kv: bool,
    /// Most loops a request may ask for (its default too), 1..=[`MAX_LOOPS`].
    pub max_loops: u8,
    /// How prompt and decode work share a step.
    pub policy: StagePolicy,
    /// Which operation runs first.
    pub selection: StageSelection,
}

impl LoopedModel {
    /// A model of `max_loops` loops with prelude and coda layers, default policies.
    #[must_use]
    pub fn new(max_loops: u8) -> Self {
        LoopedModel {
            prelude_kv: true,
            coda_kv: true,
            max_loops,
            policy: StagePolicy::default(),
            selection: StageSelection::default(),
        }
    }

    /// KV planes of a request that runs at most `loops` loops.
    #[must_use]
    pub fn planes(&self, loops: u8) -> u8 {
        u8::from(self.prelude_kv) + loops + u8::from(self.coda_kv)
    }

    /// The plane of `op` (for `Recurrent`, of loop `loop_index`, from 1) in a request of
    /// `loops` loops; `None` for a stage without layers.
    #[must_use]
    pub fn plane(&self, op: Operation, loop_index: u8, loops: u8) -> Option<u8> {
        let first_loop = u8::from(self.prelude_kv);
        match op {
            Operation::Prelude => self.prelude_kv.then_some(0),
            Operation::Recurrent => Some(first_loop + loop_index - 1),
            Operation::Coda => self.coda_kv.then_some(first_loop + loops),
            Operation::Whole => None,
        }
    }

    /// The keys a step running `op` takes work from, in order: its decode key, then its
    /// prompt key unless prompts are deferred (a data-parallel throttle). Under
    /// [`StagePolicy::Separate`] the caller stops after the first key that scheduled work.
    pub(crate) fn keys(op: Operation, defer_prompts: bool) -> [Option<WorkKey>; 2] {
        [WorkKey::stage(op, false), WorkKey::stage(op, true).filter(|_| !defer_prompts)]
    }
}

/// A looped request's chain (in its cold part): the tokens in flight through the stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Chain {
    /// Loops the request may run (its `max_loops`, or the model's).
    pub(crate) max_loops: u8,
    /// Tokens of the chain in progress (their prelude is scheduled, their rows allocated in
    /// every plane), 0 when none is.
    pub(crate) tokens: u32,
    /// Recurrent loops scheduled in the chain.
    pub(crate) loops: u8,
    /// The chain's last loop reported that every token in it exited.
    pub(crate) exited: bool,
    /// The chain's coda is scheduled.
    pub(crate) coda: bool,
    /// The step its last stage was scheduled in and that stage's operation, until that step's
    /// result is applied: no stage is scheduled before the previous one's result.
    pub(crate) in_flight: Option<(u64, Operation)>,
    /// Loops the last completed chain ran (the loops of the token it sampled).
    pub(crate) last_loops: u8,
}

impl Chain {
    /// The stage the chain runs next, if it is in progress and not waiting for a result.
    pub(crate) fn next_op(&self) -> Option<Operation> {
        if self.tokens == 0 || self.in_flight.is_some() || self.coda {
            None
        } else if self.loops < self.max_loops && !self.exited {
            Some(Operation::Recurrent)
        } else {
            Some(Operation::Coda)
        }
    }

    /// Note `op` scheduled in step `step` for `tokens` tokens (the prelude's start a chain).
    pub(crate) fn schedule(&mut self, op: Operation, step: u64, tokens: u32) {
        match op {
            Operation::Prelude => {
                self.tokens = tokens;
                self.loops = 0;
                self.exited = false;
                self.coda = false;
            }
            Operation::Recurrent => self.loops += 1,
            Operation::Coda => self.coda = true,
            Operation::Whole => {}
        }
        self.in_flight = Some((step, op));
    }

    /// Undo [`Chain::schedule`] of `op` in the step being built (a preemption rolled it back).
    pub(crate) fn unschedule(&mut self, op: Operation) {
        match op {
            Operation::Prelude => self.tokens = 0,
            Operation::Recurrent => self.loops -= 1,
            Operation::Coda => self.coda = false,
            Operation::Whole => {}
        }
        self.in_flight = None;
    }

    /// The result of step `step` arrived (`exited`: its loop reported the chain's exit). True
    /// if it completed the chain (its coda's result).
    pub(crate) fn applied(&mut self, step: u64, exited: bool) -> bool {
        let Some((s, op)) = self.in_flight else { return false };
        if s != step {
            return false;
        }
        self.in_flight = None;
        match op {
            Operation::Recurrent => self.exited |= exited,
            Operation::Coda => {
                self.last_loops = self.loops;
                self.tokens = 0;
                self.loops = 0;
                self.coda = false;
                self.exited = false;
                return true;
            }
            Operation::Prelude | Operation::Whole => {}
        }
        false
    }

    /// Forget the chain (preemption: its rows are recomputed from the prelude).
    pub(crate) fn drop_chain(&mut self) {
        let max_loops = self.max_loops;
        // A coda in flight still samples its token, which reports the chain's loops.
        let last_loops = if self.coda { self.loops } else { self.last_loops };
        *self = Chain { max_loops, last_loops, ..Chain::default() };
    }
}
