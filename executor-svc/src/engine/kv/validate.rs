//! A step's KV operations checked whole against the requests (after the step's diff) and the
//! transfers in progress: a bad one refuses the step, and nothing changes.

use ferry_kv_wire::frames;
use ferry_proto::v1::{self, kv_operation::Op as KvOp};

use super::{KvOpError, KvOps, RequestTables};

impl KvOps {
    /// Checks a step's KV operations against `tables` (the requests after the step's diff) and
    /// the transfers in progress; changes nothing.
    pub fn validate(
        &self,
        ops: &[v1::KvOperation],
        num_blocks: usize,
        tables: &dyn RequestTables,
    ) -> Result<(), KvOpError> {
        if ops.is_empty() {
            return Ok(());
        }
        if self.port.is_none() {
            return Err(KvOpError::NoAgent(ops.len()));
        }
        let mut ids = std::collections::HashSet::new();
        let mut importing: std::collections::HashSet<u32> =
            self.running.values().flat_map(|t| t.blocks.iter().copied()).collect();
        for op in ops {
            let tid = &op.transfer_id;
            let bad = |reason: String| KvOpError::Invalid { transfer_id: tid.clone(), reason };
            if tid.is_empty() || tid.len() > frames::MAX_TRANSFER_ID {
                return Err(bad(format!(
                    "transfer_id must be 1 to {} bytes",
                    frames::MAX_TRANSFER_ID
                )));
            }
            if op.deadline_unix_ms == 0 {
                return Err(bad(
                    "no deadline: every KV operation needs deadline_unix_ms (Unix ms)".into(),
                ));
            }
            if self.running.contains_key(tid) || !ids.insert(tid.clone()) {
                return Err(bad("the transfer is already in progress".into()));
            }
            let in_range = |blocks: &[u32]| match blocks.iter().find(|b| **b as usize >= num_blocks)
            {
                Some(b) => {
                    Err(bad(format!("block {b} is out of range (pool has {num_blocks} blocks)")))
                }
                None => Ok(()),
            };
            // Imports and stores name each block they move, every one full.
            let full_blocks = |ids: &[u32], hashes: &[u64], what: &str| {
                in_range(ids)?;
                if ids.is_empty() || hashes.len() != ids.len() {
                    return Err(bad(format!(
                        "{} block hashes for {} blocks: {what} full blocks, each named",
                        hashes.len(),
                        ids.len()
                    )));
                }
                Ok(())
            };
            match &op.op {
                Some(KvOp::Export(e)) => {
                    let table = tables
                        .table(e.request_id)
                        .ok_or_else(|| bad(format!("request {} is not live", e.request_id)))?;
                    in_range(&e.block_ids)?;
                    if e.block_hashes.is_empty() || e.block_hashes.len() > e.block_ids.len() {
                        return Err(bad(format!(
                            "{} block hashes for {} blocks: an export names each full block it sends",
                            e.block_hashes.len(),
                            e.block_ids.len()
                        )));
                    }
                    if let Some(b) =
                        e.block_ids[..e.block_hashes.len()].iter().find(|b| !table.contains(b))
                    {
                        return Err(bad(format!("block {b} is not request {}'s", e.request_id)));
                    }
                    if e.destination_agent.is_empty() {
                        return Err(bad("an export needs a destination agent".into()));
                    }
                }
                Some(KvOp::Import(i)) => {
                    full_blocks(&i.block_ids, &i.block_hashes, "an import fills")?;
                    for b in &i.block_ids {
                        if tables.holds(*b) || !importing.insert(*b) {
                            return Err(bad(format!(
                                "block {b} is in use: an import writes only free blocks"
                            )));
                        }
                    }
                }
                Some(KvOp::Store(st)) => {
                    full_blocks(&st.block_ids, &st.block_hashes, "a store writes")?;
                    if let Some(b) = st.block_ids.iter().find(|b| importing.contains(b)) {
                        return Err(bad(format!(
                            "block {b} is being imported: a store copies only settled blocks"
                        )));
                    }
                }
                None => return Err(bad("no operation".into())),
            }
        }
        Ok(())
    }
}
