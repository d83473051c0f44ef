//! A step's batch: what each scheduled request computes ([`Planned`], built by validation
//! before anything changes), how many rows of logits it needs, and the run of the batch through
//! the backend while the constrained requests' grammar masks are computed beside it.

use std::collections::HashMap;

use super::{Engine, ExecRequest, StepError};
use crate::engine::backend::BatchOutput;
use crate::engine::grammar::{Grammar, MaskJob, TokenMask};
use crate::engine::looped::{LoopedShape, Stage};
use crate::forward::paged::SeqSlice;

/// The prospective state of one scheduled request, computed before anything changes.
pub(super) struct Planned {
    pub(super) id: u64,
    pub(super) start: usize,
    pub(super) n: usize,
    pub(super) total: usize,
    /// A verification's draft tokens (empty for other work): they follow the `total` known
    /// tokens, and the step computes the last known token and each of them.
    pub(super) draft: Vec<u32>,
    /// A looped model's stage work: the stage (its tokens are its chain's).
    pub(super) stage: Option<Stage>,
    /// A looped model's request: the loops it runs at most (its KV planes); 0 otherwise.
    pub(super) loops: u8,
}

impl Planned {
    /// Token `i` of the sequence this work computes: a known token, or a draft token.
    pub(super) fn token(&self, r: &ExecRequest, i: usize) -> u32 {
        if i < self.total {
            r.token(i)
        } else {
            self.draft[i - self.total]
        }
    }
}

/// The block table planned `p` reads and writes in `table`: its stage's plane of it for a
/// looped model's stage (`None` for a stage without layers, which touches no KV), else all.
pub(super) fn stage_table<'t>(
    p: &Planned,
    shape: Option<LoopedShape>,
    table: &'t [u32],
) -> Option<std::borrow::Cow<'t, [u32]>> {
    match (p.stage, shape) {
        (Some(stage), Some(shape)) => {
            let plane = shape.plane(stage, p.loops)?;
            Some(shape.plane_table(table, p.loops, plane).into())
        }
        _ => Some(table.into()),
    }
}

/// Rows of logits planned `p` needs: all of its chunk when it scores prompt tokens in it
/// (`prompt_logprobs`), else its last when it samples.
pub(super) fn logit_rows(p: &Planned, r: &ExecRequest) -> usize {
    if !p.draft.is_empty() {
        return p.n; // a verification samples at each position
    }
    let samples = p.start + p.n == p.total;
    if r.sampling.prompt_logprobs.is_some() && p.start + 1 < r.prompt.len() {
        p.n
    } else {
        usize::from(samples)
    }
}

/// What a step's forward produced: the batch's output, the constrained requests' matchers with
/// their masks, the time the masks took, and how long the step waited for them.
pub(super) struct Forward {
    pub(super) output: BatchOutput,
    pub(super) masks: HashMap<u64, (Grammar, Result<TokenMask, String>)>,
    pub(super) masks_busy: std::time::Duration,
    pub(super) grammar_wait: std::time::Duration,
}

impl Engine {
    /// Runs the batch of `planned` through the backend while the masks of the constrained
    /// requests that sample in it are computed beside it; on error nothing changed.
    pub(super) fn forward(&mut self, planned: &[Planned]) -> Result<Forward, StepError> {
        // Gather the tokens each scheduled request computes.
        self.gathered.resize_with(planned.len(), Vec::new);
        for (buf, p) in self.gathered.iter_mut().zip(planned) {
            let r = &self.requests[&p.id];
            buf.clear();
            buf.extend((p.start..p.start + p.n).map(|i| p.token(r, i)));
        }
        // The masks of the constrained requests that sample, computed beside the forward.
        let mask_job = MaskJob {
            matchers: planned
                .iter()
                .filter(|p| p.start + p.n == p.total)
                .filter_map(|p| {
                    let r = self.requests.get_mut(&p.id)?;
                    r.grammar.take().map(|m| (p.id, m))
                })
                .collect(),
        };
        let batch: Vec<SeqSlice> = planned
            .iter()
            .zip(&self.gathered)
            .map(|(p, toks)| {
                let r = &self.requests[&p.id];
                SeqSlice {
                    tokens: toks,
                    start: p.start,
                    block_table: &r.table,
                    logits: logit_rows(p, r),
                    adapter: r.adapter.as_deref(),
                }
            })
            .collect();
        let backend = &mut self.backend;
        let (output, masks, grammar_wait) = mask_job.beside(|| {
            if batch.is_empty() {
                Ok(BatchOutput::Logits(Vec::new()))
            } else {
                backend.run(&batch)
            }
        });
        let masks_busy = masks.busy;
        let masks: HashMap<u64, _> =
            masks.masks.into_iter().map(|(id, m, mask)| (id, (m, mask))).collect();
        match output {
            Ok(output) => Ok(Forward { output, masks, masks_busy, grammar_wait }),
            Err(e) => {
                // Nothing ran: the matchers go back unchanged.
                for (id, (m, _)) in masks {
                    if let Some(r) = self.requests.get_mut(&id) {
                        r.grammar = Some(m);
                    }
                }
                Err(e.into())
            }
        }
    }
}
