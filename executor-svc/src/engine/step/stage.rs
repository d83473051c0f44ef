//! A looped model's step: one stage over its batch (see [`crate::engine::looped`]). The
//! prelude starts each request's chain with the hidden states it leaves; a loop of the
//! recurrent block moves them on, holds the tokens that left the loop where they were (their
//! later loops' KV made a copy of their exit loop's) and reports the chains whose every token
//! left; the coda turns them into logits and samples as any step does.

use std::collections::HashMap;
use std::time::Instant;

use ferry_proto::v1;

use super::batch::{logit_rows, stage_table, Planned};
use super::{Engine, StepError};
use crate::engine::backend::{BatchOutput, StageResult};
use crate::engine::looped::{exit_score, sim_exit_score, Chain, LoopedShape, Stage};
use crate::forward::paged::SeqSlice;
use crate::forward::stages::{StageOutput, StageRun};

impl Engine {
    /// Runs `stage` over `planned` (validated, its diff applied): the step's result, with the
    /// requests already `refused` and the KV operations that ended.
    pub(super) fn execute_stage(
        &mut self,
        step: &v1::Step,
        stage: Stage,
        planned: &[Planned],
        mut refused: Vec<v1::RefusedRequest>,
        kv_results: Vec<v1::KvOperationResult>,
    ) -> Result<v1::StepResult, StepError> {
        let shape = self.config.looped.expect("validated: stage work runs on a looped model");
        let t0 = Instant::now();
        let step_started = std::time::SystemTime::now();
        let result = self.run_stage(shape, stage, planned)?;
        let forward_us = t0.elapsed().as_micros() as u64;
        let t1 = Instant::now();
        let (mut outputs, mut exited_ids, mut simulated_us) = (Vec::new(), Vec::new(), 0);
        let hidden = match result {
            StageResult::Computed(StageOutput::Hidden(h)) => Some(h),
            StageResult::Computed(StageOutput::Logits(l)) => {
                let (o, failed, _) =
                    self.sample_batch(planned, BatchOutput::Logits(l), HashMap::new());
                outputs = o;
                for (id, reason) in failed {
                    refused.push(self.refuse(id, reason));
                }
                None
            }
            StageResult::Synthetic { duration } => {
                simulated_us = u64::try_from(duration.as_micros()).unwrap_or(u64::MAX);
                if stage == Stage::Coda {
                    let synthetic = BatchOutput::Synthetic { duration };
                    outputs = self.sample_batch(planned, synthetic, HashMap::new()).0;
                }
                None
            }
        };
        let h = self.backend.facts().shape.hidden;
        let mut row = 0;
        for p in planned {
            let rows = hidden.as_ref().map(|all| &all[row * h..(row + p.n) * h]);
            row += p.n;
            // Each request's own stage: a loop step batches chains at different loops.
            match p.stage.unwrap_or(stage) {
                Stage::Prelude => {
                    let chain = Chain {
                        start: p.start,
                        n: p.n,
                        hidden: rows.map(<[f32]>::to_vec).unwrap_or_default(),
                        exited_at: vec![0; p.n],
                        loops: 0,
                    };
                    self.set_chain(p.id, Some(chain));
                }
                Stage::Recurrent(l) => {
                    if self.loop_done(shape, p, l, rows) {
                        exited_ids.push(p.id);
                    }
                }
                Stage::Coda => self.set_chain(p.id, None),
            }
        }
        self.steps_executed += 1;
        self.trace_step(step, planned, step_started, forward_us);
        Ok(v1::StepResult {
            step_id: step.step_id,
            outputs,
            kv_results,
            refused,
            exited_ids,
            timing: Some(v1::StepTiming {
                forward_us,
                sample_us: t1.elapsed().as_micros() as u64,
                simulated_us,
                ..Default::default()
            }),
        })
    }

    /// The stage's forward over `planned`, each request on its plane of its table, from its
    /// chain's hidden states (the prelude: from its tokens).
    fn run_stage(
        &mut self,
        shape: LoopedShape,
        stage: Stage,
        planned: &[Planned],
    ) -> Result<StageResult, StepError> {
        let mut tokens = Vec::with_capacity(planned.len());
        let (mut tables, mut input, mut keep_kv) = (Vec::new(), Vec::new(), Vec::new());
        for p in planned {
            let r = &self.requests[&p.id];
            tokens.push((p.start..p.start + p.n).map(|i| r.token(i)).collect::<Vec<u32>>());
            tables.push(stage_table(p, Some(shape), &r.table).unwrap_or_default().into_owned());
            if let Some(chain) = r.looped.as_ref().and_then(|l| l.chain.as_ref()) {
                if stage != Stage::Prelude {
                    input.extend_from_slice(&chain.hidden);
                }
                if matches!(stage, Stage::Recurrent(_)) {
                    keep_kv.extend(chain.exited_at.iter().map(|&e| e > 0));
                }
            }
        }
        let batch: Vec<SeqSlice> = planned
            .iter()
            .zip(&tokens)
            .zip(&tables)
            .map(|((p, tokens), table)| SeqSlice {
                tokens,
                start: p.start,
                block_table: table,
                logits: if stage == Stage::Coda { logit_rows(p, &self.requests[&p.id]) } else { 0 },
                adapter: self.requests[&p.id].adapter.as_deref(),
            })
            .collect();
        let has_input = stage != Stage::Prelude && self.backend.computes_logits();
        let run = StageRun {
            layers: shape.layers(stage),
            input: has_input.then_some(&input[..]),
            keep_kv: &keep_kv,
            logits: stage == Stage::Coda,
        };
        Ok(self.backend.run_stage(&batch, &run)?)
    }

    /// Loop `l` of `p`'s chain ran, leaving `after` (its tokens' hidden states; `None` on the
    /// simulator): the tokens that left the loop before keep their states (their new rows are
    /// dropped), the others take theirs, and those whose exit score reaches the threshold now
    /// (below the request's last loop) leave, their KV copied into the later loops' planes.
    /// True if every token of the chain has left.
    fn loop_done(&mut self, shape: LoopedShape, p: &Planned, l: u8, after: Option<&[f32]>) -> bool {
        let h = self.backend.facts().shape.hidden;
        let bs = self.backend.facts().block_size;
        let r = self.requests.get_mut(&p.id).expect("planned requests exist");
        let looped = r.looped.as_mut().expect("validated: a looped request");
        let (threshold, max_loops) = (looped.threshold, looped.max_loops);
        let chain = looped.chain.as_mut().expect("validated: a loop has a chain");
        let mut leaving = Vec::new();
        for i in 0..chain.n {
            if chain.exited_at[i] > 0 {
                continue; // it left before: its state stays, its new row is dropped
            }
            let state = i * h..(i + 1) * h;
            let score = match after {
                Some(after) => {
                    let score = exit_score(&chain.hidden[state.clone()], &after[state.clone()]);
                    chain.hidden[state.clone()].copy_from_slice(&after[state]);
                    score
                }
                None => sim_exit_score(l),
            };
            if l < max_loops && threshold.is_some_and(|t| score >= t) {
                chain.exited_at[i] = l;
                leaving.push(chain.start + i);
            }
        }
        chain.loops = l;
        let all = chain.all_exited();
        // Later loops attend to a leaving token's loop-l KV: copy it into their planes.
        let planes = shape.planes(max_loops);
        let layers = shape.layers(Stage::Recurrent(l));
        let from = shape.plane(Stage::Recurrent(l), max_loops).expect("a loop has a plane");
        let mut copies = Vec::new();
        for pos in leaving {
            let row = pos / bs;
            let src = (r.table[row * planes + from] as usize, pos % bs);
            for later in l + 1..=max_loops {
                let to = shape.plane(Stage::Recurrent(later), max_loops).expect("a loop's plane");
                copies.push((src, (r.table[row * planes + to] as usize, pos % bs)));
            }
        }
        for (src, dst) in copies {
            self.backend.copy_kv_position(layers.clone(), src, dst);
        }
        all
    }

    /// Sets (or ends) request `id`'s chain.
    fn set_chain(&mut self, id: u64, chain: Option<Chain>) {
        if let Some(l) = self.requests.get_mut(&id).and_then(|r| r.looped.as_mut()) {
            l.chain = chain;
        }
    }
}
