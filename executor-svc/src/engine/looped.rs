//! A looped (recurrent-depth) model built from a model's layers (`--looped-layers A:B`):
//! layers `[0, A)` run once as the prelude, `[A, B)` up to `--max-loops` times as the recurrent
//! block, `[B, n)` once as the coda, then the output head. The scheduler sends each stage as
//! its own step (the stage work keys); the engine keeps each request's *chain* — the tokens
//! in flight through the stages and their hidden states — between them.
//!
//! KV: each stage with layers has its own plane (the prelude's, one per loop, the coda's); a
//! request's block table holds, for each block of positions, one block per plane
//! (`table[row * planes + plane]`), and a stage reads and writes its plane's blocks in its own
//! layers' part of them.
//!
//! Exit: after loop `l` (below the request's `max_loops`), a token whose exit score — the
//! cosine similarity of its hidden state after the loop to the one before it — reaches the
//! request's `exit_threshold` leaves the loop: its hidden state stays as it is, and its KV in
//! the planes of loops `l + 1 ..= max_loops` becomes a copy of its loop-`l` KV, which is what
//! later tokens attend to in those loops (its slots there are not written again). A chain goes
//! to its coda once every token in it left, or after `max_loops`; a token's loops depend only
//! on its own states and the KV before it, so chunking and preemption do not change them. The
//! `sim` backend computes no hidden state: its score after loop `l` is `l / (l + 1)`.

use std::ops::Range;

use clap::Args;
use ferry_proto::v1;

/// `--looped-layers` and `--max-loops`.
#[derive(Clone, Debug, Default, Args)]
pub struct LoopedArgs {
    /// Serve the model as a looped (recurrent-depth) model: `A:B` runs layers [0, A) once as
    /// the prelude, [A, B) up to --max-loops times as the recurrent block and [B, n) once as
    /// the coda (CPU and sim backends).
    #[arg(long, env = "FERRY_LOOPED_LAYERS", value_name = "A:B")]
    pub looped_layers: Option<String>,
    /// With --looped-layers: the most loops of the recurrent block a request may ask for (its
    /// `max_loops`, whose default this is), 1..=64.
    #[arg(long, env = "FERRY_MAX_LOOPS", default_value_t = 4, requires = "looped_layers")]
    pub max_loops: u8,
}

impl LoopedArgs {
    /// The split, checked against a model of `num_layers` layers; `None` without
    /// --looped-layers.
    ///
    /// # Errors
    ///
    /// What is wrong, naming the flag.
    pub fn shape(&self, num_layers: usize) -> Result<Option<LoopedShape>, String> {
        let Some(spec) = &self.looped_layers else { return Ok(None) };
        let parse = |s: &str| s.trim().parse::<usize>().ok();
        let Some((a, b)) = spec.split_once(':').and_then(|(a, b)| Some((parse(a)?, parse(b)?)))
        else {
            return Err(format!("--looped-layers {spec:?} is not A:B (two layer numbers)"));
        };
        LoopedShape::new(a, b, num_layers, self.max_loops).map(Some)
    }
}

/// Most loops a looped model may run (the scheduler's `MAX_LOOPS`).
pub const MAX_LOOPS: u8 = 64;

/// The stages a looped model's layers are split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoopedShape {
    /// End of the prelude's layers.
    pub prelude_end: usize,
    /// Start of the coda's layers.
    pub coda_start: usize,
    /// The model's layers.
    pub num_layers: usize,
    /// Most loops a request may ask for (its default).
    pub max_loops: u8,
}

/// The stage a step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The prelude (starts a chain).
    Prelude,
    /// Loop `.0` of the recurrent block, from 1.
    Recurrent(u8),
    /// The coda (ends the chain; samples when the chain ends the known tokens).
    Coda,
}

impl Stage {
    /// The stage of work `key` (loop `loop_index` for a recurrent one); `None` for a plain
    /// model's work.
    pub fn of(key: v1::WorkKey, loop_index: u32) -> Option<Stage> {
        use v1::WorkKey as K;
        match key {
            K::PromptPrelude | K::DecodePrelude => Some(Stage::Prelude),
            K::PromptRecurrent | K::DecodeRecurrent => {
                Some(Stage::Recurrent(u8::try_from(loop_index).unwrap_or(u8::MAX)))
            }
            K::PromptCoda | K::DecodeCoda => Some(Stage::Coda),
            K::Unspecified | K::Prompt | K::PromptChunk | K::Decode | K::Verify => None,
        }
    }

    /// The same stage for any loop (a step runs one).
    #[must_use]
    pub fn kind(self) -> Stage {
        match self {
            Stage::Recurrent(_) => Stage::Recurrent(0),
            s => s,
        }
    }
}

impl LoopedShape {
    /// The split `prelude_end:coda_start` of `num_layers` layers, looping up to `max_loops`.
    ///
    /// # Errors
    ///
    /// A recurrent block that is empty or past the layers, or loops out of 1..=64.
    pub fn new(
        prelude_end: usize,
        coda_start: usize,
        num_layers: usize,
        max_loops: u8,
    ) -> Result<Self, String> {
        if prelude_end >= coda_start || coda_start > num_layers {
            return Err(format!(
                "--looped-layers {prelude_end}:{coda_start} must name a non-empty block of the \
                 model's {num_layers} layers (A < B <= {num_layers})"
            ));
        }
        if !(1..=MAX_LOOPS).contains(&max_loops) {
            return Err(format!("--max-loops must be 1..={MAX_LOOPS}, got {max_loops}"));
        }
        Ok(Self { prelude_end, coda_start, num_layers, max_loops })
    }

    /// KV planes of a request of `loops` loops.
    pub fn planes(&self, loops: u8) -> usize {
        usize::from(self.prelude_end > 0) + usize::from(loops) + usize::from(self.has_coda())
    }

    fn has_coda(&self) -> bool {
        self.coda_start < self.num_layers
    }

    /// The plane `stage` reads and writes in a request of `loops` loops (`None`: no layers).
    pub fn plane(&self, stage: Stage, loops: u8) -> Option<usize> {
        let first_loop = usize::from(self.prelude_end > 0);
        match stage {
            Stage::Prelude => (self.prelude_end > 0).then_some(0),
            Stage::Recurrent(l) => Some(first_loop + usize::from(l) - 1),
            Stage::Coda => self.has_coda().then_some(first_loop + usize::from(loops)),
        }
    }

    /// The layers `stage` runs.
    pub fn layers(&self, stage: Stage) -> Range<usize> {
        match stage {
            Stage::Prelude => 0..self.prelude_end,
            Stage::Recurrent(_) => self.prelude_end..self.coda_start,
            Stage::Coda => self.coda_start..self.num_layers,
        }
    }

    /// Plane `plane` of `table` (a request of `loops` loops): its block for each row.
    pub fn plane_table(&self, table: &[u32], loops: u8, plane: usize) -> Vec<u32> {
        table.iter().skip(plane).step_by(self.planes(loops)).copied().collect()
    }

    /// What the handshake states.
    pub fn proto(&self) -> v1::LoopedModel {
        let u32_of = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        v1::LoopedModel {
            prelude_end: u32_of(self.prelude_end),
            coda_start: u32_of(self.coda_start),
            num_layers: u32_of(self.num_layers),
            max_loops: u32::from(self.max_loops),
        }
    }
}

/// What the engine keeps of a looped model's request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LoopState {
    /// The loops its tokens run at most.
    pub(crate) max_loops: u8,
    /// Its exit threshold (`None`: every token runs `max_loops`).
    pub(crate) threshold: Option<f32>,
    /// Its chain in progress, from its prelude to its coda.
    pub(crate) chain: Option<Chain>,
}

/// The tokens in flight through the stages.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Chain {
    /// Position of its first token.
    pub(crate) start: usize,
    /// Its tokens.
    pub(crate) n: usize,
    /// Each token's hidden state after the last stage (tokens × hidden; empty on `sim`).
    pub(crate) hidden: Vec<f32>,
    /// The loop each token left at (0: still looping).
    pub(crate) exited_at: Vec<u8>,
    /// Loops run.
    pub(crate) loops: u8,
}

impl Chain {
    /// Every token left the loop.
    pub(crate) fn all_exited(&self) -> bool {
        self.exited_at.iter().all(|&e| e > 0)
    }
}

/// The exit score of a token after a loop: the cosine similarity of its hidden state `after`
/// the loop to the one `before` it (1 for a state that did not move).
pub fn exit_score(before: &[f32], after: &[f32]) -> f32 {
    let (mut dot, mut nb, mut na) = (0f64, 0f64, 0f64);
    for (&b, &a) in before.iter().zip(after) {
        dot += f64::from(b) * f64::from(a);
        nb += f64::from(b) * f64::from(b);
        na += f64::from(a) * f64::from(a);
    }
    if nb == 0.0 || na == 0.0 {
        return if nb == na { 1.0 } else { 0.0 };
    }
    (dot / (nb.sqrt() * na.sqrt())) as f32
}

/// The `sim` backend's exit score after loop `l`: `l / (l + 1)`.
pub fn sim_exit_score(l: u8) -> f32 {
    f32::from(l) / (f32::from(l) + 1.0)
}
