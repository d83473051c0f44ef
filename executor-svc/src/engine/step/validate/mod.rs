//! Validation of a step: the whole step checked against the state it would produce, before
//! anything changes. A step that passes runs; the first fault found is the error (and
//! [`super::admit`] decides whether it refuses one request or the step).
//!
//! The checks run in the order a step is applied, and each reads what the earlier ones found
//! ([`Prospect`]: which ids are finished, preempted, new or resumed, and the tables and lengths
//! the step gives them):
//! - [`requests`]: the ids the step names (preempted, new, updated) and each new or updated
//!   request's data — length, token ids, blocks, table size, sampling parameters, grammar;
//! - [`work`]: the scheduled work against each request's known tokens, a verification's draft
//!   tokens, and the step's token sum;
//! - [`blocks`]: the KV operations, the block copies, and the batch against the KV pool.

use std::collections::{HashMap, HashSet};

use ferry_proto::v1;

use super::batch::Planned;
use super::{Engine, StepError};
use crate::engine::backend::BackendFacts;
use crate::engine::grammar::Grammar;
use crate::engine::sampling::{LogitAdjust, SamplingParams};

mod blocks;
mod requests;
mod work;

pub use work::MAX_DRAFT_TOKENS;

/// A new request's sampling parts, read from the wire and checked once, while validating the
/// step: its parameters, its logit adjustments, and its grammar compiled (with its earlier
/// output replayed) when it has a structured output.
pub(super) struct NewParts {
    pub(super) sampling: SamplingParams,
    pub(super) adjust: LogitAdjust,
    pub(super) grammar: Option<Grammar>,
}

/// The parts of a step's new requests, by id.
pub(super) type Prepared = HashMap<u64, NewParts>;

/// What the step would make of the engine's requests, built check by check: each check reads
/// what the earlier ones recorded here.
struct Prospect<'e> {
    /// The engine as it is before the step.
    engine: &'e Engine,
    /// The backend's shape, block size and pool size.
    facts: BackendFacts,
    /// The requests the step finishes.
    finished: HashSet<u64>,
    /// The requests the step preempts.
    preempted: HashSet<u64>,
    /// The requests the step resumes.
    resumed: HashSet<u64>,
    /// The block tables the step sets: its new requests' and its updated requests'.
    tables: HashMap<u64, Vec<u32>>,
    /// Prospective (tokens, computed tokens) of each request the step adds or updates.
    lengths: HashMap<u64, (usize, usize)>,
    /// What checking the new requests prepared for them.
    prepared: Prepared,
}

impl<'e> Prospect<'e> {
    fn new(engine: &'e Engine, step: &v1::Step) -> Self {
        Self {
            engine,
            facts: engine.backend.facts(),
            finished: step.finished_ids.iter().copied().collect(),
            preempted: HashSet::new(),
            resumed: HashSet::new(),
            tables: HashMap::new(),
            lengths: HashMap::new(),
            prepared: HashMap::new(),
        }
    }

    /// Whether `id` is a held request that the step does not finish.
    fn live(&self, id: u64) -> bool {
        self.engine.requests.contains_key(&id) && !self.finished.contains(&id)
    }

    /// The model's maximum length.
    fn max_len(&self) -> usize {
        self.facts.shape.max_model_len
    }

    /// Every block of `blocks` (request `id`'s) is in the pool.
    fn blocks_in_pool(&self, id: u64, blocks: &[u32]) -> Result<(), StepError> {
        let num_blocks = self.facts.num_blocks;
        match blocks.iter().find(|b| **b as usize >= num_blocks) {
            Some(b) => Err(StepError::Invalid {
                id,
                reason: format!("block {b} is out of range (pool has {num_blocks} blocks)"),
            }),
            None => Ok(()),
        }
    }

    /// A block table of `len` blocks (request `id`'s) is no longer than a request can need.
    fn table_fits(&self, id: u64, len: usize) -> Result<(), StepError> {
        let max_len = self.max_len();
        // The longest table a request can need: its blocks for the model's length, and one ahead.
        // A looped model's request holds a block per KV plane for each.
        let planes = self.engine.config.looped.map_or(1, |s| s.planes(s.max_loops));
        let max_table = (max_len.div_ceil(self.facts.block_size.max(1)) + 1) * planes;
        if len > max_table {
            return Err(StepError::Invalid {
                id,
                reason: format!(
                    "a block table of {len} blocks; {max_len} tokens need at most {max_table}"
                ),
            });
        }
        Ok(())
    }
}

impl Engine {
    /// Checks the whole step against the state it would produce; changes nothing. The checks
    /// run in the order a step is applied; each reads the picture of the step the earlier ones
    /// built (which ids are new, resumed, finished). The planned batch and the new requests'
    /// prepared parts, or the first fault.
    pub(super) fn validate(&self, step: &v1::Step) -> Result<(Vec<Planned>, Prepared), StepError> {
        let mut prospect = Prospect::new(self, step);
        prospect.preempted = requests::preempted_ids(&prospect, step)?;
        requests::new_requests(&mut prospect, step)?;
        requests::updated_requests(&mut prospect, step)?;
        let planned = work::scheduled_work(&prospect, step)?;
        work::token_sum(step, &planned)?;
        blocks::kv_operations(&prospect, step)?;
        blocks::block_copies(&prospect, step)?;
        blocks::cache_changes(&prospect, step)?;
        blocks::batch_fits_pool(&prospect, &planned)?;
        Ok((planned, prospect.prepared))
    }
}
