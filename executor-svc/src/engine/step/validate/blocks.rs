//! The checks of what a step does with KV blocks, against the tables it leaves the requests:
//! its KV operations (an export's or import's request and blocks), its block copies (distinct
//! blocks in the pool, into a block the request gets in this step, from a block a live request
//! holds), and its batch against the KV pool (coverage, ranges, no block written by two
//! requests).

use std::collections::{HashMap, HashSet};

use ferry_proto::v1;

use super::Prospect;
use crate::engine::kv::{request_of, RequestTables};
use crate::engine::step::batch::{stage_table, Planned};
use crate::engine::step::{ExecRequest, StepError};
use crate::forward::paged::SeqSlice;

/// The requests' tables as a step leaves them, for checking its KV operations.
struct StepTables<'a> {
    requests: &'a HashMap<u64, ExecRequest>,
    finished: &'a HashSet<u64>,
    updated: &'a HashMap<u64, Vec<u32>>,
    held: HashSet<u32>,
}

impl RequestTables for StepTables<'_> {
    fn table(&self, id: u64) -> Option<&[u32]> {
        if let Some(t) = self.updated.get(&id) {
            return Some(t);
        }
        let live = !self.finished.contains(&id);
        self.requests.get(&id).filter(|_| live).map(|r| r.table.as_slice())
    }

    fn holds(&self, block: u32) -> bool {
        self.held.contains(&block)
    }
}

/// The step's KV operations pass the agent's rules against the tables the step leaves; a bad
/// export or import is its request's fault.
pub(super) fn kv_operations(prospect: &Prospect, step: &v1::Step) -> Result<(), StepError> {
    if step.kv_ops.is_empty() {
        return Ok(());
    }
    let requests = &prospect.engine.requests;
    let (finished, tables) = (&prospect.finished, &prospect.tables);
    // Only an import asks which blocks live requests hold (it writes only free ones).
    let imports =
        step.kv_ops.iter().any(|op| matches!(op.op, Some(v1::kv_operation::Op::Import(_))));
    let held = if imports {
        requests
            .iter()
            .filter(|(id, _)| !finished.contains(id) && !tables.contains_key(id))
            .flat_map(|(_, r)| r.table.iter().copied())
            .chain(tables.values().flatten().copied())
            .collect()
    } else {
        HashSet::new()
    };
    let view = StepTables { requests, finished, updated: tables, held };
    prospect.engine.kv.validate(&step.kv_ops, prospect.facts.num_blocks, &view).map_err(|e| {
        // A bad export or import is its request's fault.
        match request_of(&e, &step.kv_ops) {
            Some(id) => StepError::Invalid { id, reason: e.to_string() },
            None => e.into(),
        }
    })
}

/// Every block the step's prefix-cache changes name is in the pool (a fault of the step).
pub(super) fn cache_changes(prospect: &Prospect, step: &v1::Step) -> Result<(), StepError> {
    let num_blocks = prospect.facts.num_blocks;
    let named = step.evicted_blocks.iter().chain(step.cached_blocks.iter().map(|c| &c.block_id));
    match named.copied().find(|&b| b as usize >= num_blocks) {
        Some(block) => Err(StepError::CacheBlock { block, num_blocks }),
        None => Ok(()),
    }
}

/// Every block copy of the step can be made ([`copy_fault`]).
pub(super) fn block_copies(prospect: &Prospect, step: &v1::Step) -> Result<(), StepError> {
    let requests = &prospect.engine.requests;
    for c in &step.block_copies {
        copy_fault(c, prospect.facts.num_blocks, &prospect.tables, requests, &prospect.finished)
            .map_err(|reason| StepError::Invalid { id: c.id, reason })?;
    }
    Ok(())
}

/// What is wrong with block copy `c`, if anything: both blocks in the pool and distinct, the
/// block written new to its request's table in this step, the block read held by a live
/// request (after this step's diff: `tables` holds the tables it sets).
fn copy_fault(
    c: &v1::BlockCopy,
    num_blocks: usize,
    tables: &HashMap<u64, Vec<u32>>,
    requests: &HashMap<u64, ExecRequest>,
    finished: &HashSet<u64>,
) -> Result<(), String> {
    if c.src as usize >= num_blocks || c.dst as usize >= num_blocks || c.src == c.dst {
        return Err(format!(
            "block copy {} -> {}: blocks must be distinct and below {num_blocks}",
            c.src, c.dst
        ));
    }
    if !tables.get(&c.id).is_some_and(|t| t.contains(&c.dst)) {
        return Err(format!(
            "block copy into block {}, which this step does not give the request",
            c.dst
        ));
    }
    let held = tables.values().any(|t| t.contains(&c.src))
        || requests.iter().any(|(id, r)| {
            !finished.contains(id) && !tables.contains_key(id) && r.table.contains(&c.src)
        });
    if !held {
        return Err(format!("block copy from block {}, which no live request holds", c.src));
    }
    Ok(())
}

/// The batch of `planned` fits the KV pool and the model: coverage, ranges, no block written by
/// two requests. A fault of one sequence is its request's.
pub(super) fn batch_fits_pool(prospect: &Prospect, planned: &[Planned]) -> Result<(), StepError> {
    let requests = &prospect.engine.requests;
    // Token ids were checked when they arrived, so placeholders stand in for them here.
    let longest = planned.iter().map(|p| p.n).max().unwrap_or(0);
    let zeros = vec![0u32; longest];
    // A looped model's stage reads and writes its plane of each table; a stage without
    // layers touches no KV and is not checked against the pool.
    let shape = prospect.engine.config.looped;
    let checked: Vec<(&Planned, std::borrow::Cow<[u32]>)> = planned
        .iter()
        .filter_map(|p| {
            let table = prospect.tables.get(&p.id).unwrap_or_else(|| &requests[&p.id].table);
            Some((p, stage_table(p, shape, table)?))
        })
        .collect();
    let batch: Vec<SeqSlice> = checked
        .iter()
        .map(|(p, table)| SeqSlice {
            tokens: &zeros[..p.n],
            start: p.start,
            block_table: table,
            logits: 0,
            adapter: None,
        })
        .collect();
    prospect.engine.backend.check(&batch).map_err(|e| match e.sequence() {
        Some(seq) => StepError::Invalid { id: checked[seq].0.id, reason: e.to_string() },
        None => e.into(),
    })
}
