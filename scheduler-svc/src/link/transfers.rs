//! A link's record of its side of each KV transfer, for the admin view (`ListTransfers`): the
//! transfers its requests plan, the operations it issued and what the executor reported. The
//! transfers in progress, and the last [`RECENT`] that ended, with their outcome.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use ferry_proto::v1;

use super::TransferPlan;

/// Ended transfers kept for the admin view, per link.
pub const RECENT: usize = 64;

/// Where one side of a transfer is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Planned with its request; its operation is not issued yet (the prompt is computing, or
    /// the import waits for a fetch slot or blocks).
    Planned,
    /// Its operation is with the executor.
    InProgress,
    /// The executor reported it done.
    Done,
    /// The executor reported it failed, for this reason.
    Failed(String),
    /// Its request ended (finished, aborted, moved) before the operation was issued.
    Abandoned,
}

/// One side (export or import) of a transfer, on this link's executor.
#[derive(Clone, Debug)]
pub struct TransferSide {
    /// The transfer.
    pub transfer_id: u64,
    /// The client's id of its request.
    pub request: Arc<str>,
    /// True for the export (source) side.
    pub export: bool,
    /// The destination node's agent (the export side only).
    pub destination_agent: String,
    /// Blocks in the operation (0 until issued).
    pub blocks: u32,
    /// Bytes moved (reported), or expected while in progress.
    pub bytes: u64,
    /// Where it is.
    pub phase: Phase,
    /// The error, when it failed.
    pub error: String,
    /// When it was planned.
    pub since: Instant,
    /// When its operation was issued.
    pub issued: Option<Instant>,
    /// When it ended.
    pub ended: Option<Instant>,
}

/// The link's transfer sides.
#[derive(Default)]
pub struct Transfers {
    live: HashMap<u64, TransferSide>,
    recent: VecDeque<TransferSide>,
}

impl Transfers {
    /// A request with `plan` joined the link.
    pub fn planned(&mut self, plan: &TransferPlan) {
        let (transfer_id, request, destination_agent, export) = match plan {
            TransferPlan::Export { transfer_id, request, destination, .. } => {
                (transfer_id.0, request.clone(), destination.clone(), true)
            }
            TransferPlan::Import { transfer_id, request, .. } => {
                (transfer_id.0, request.clone(), String::new(), false)
            }
        };
        self.live.insert(
            transfer_id,
            TransferSide {
                transfer_id,
                request,
                export,
                destination_agent,
                blocks: 0,
                bytes: 0,
                phase: Phase::Planned,
                error: String::new(),
                since: Instant::now(),
                issued: None,
                ended: None,
            },
        );
    }

    /// A step issued `ops` to an executor whose blocks are `block_bytes` long.
    pub fn issued(&mut self, ops: &[v1::KvOperation], block_bytes: u64) {
        for op in ops {
            let Some(side) = op.transfer_id.parse().ok().and_then(|t| self.live.get_mut(&t)) else {
                continue;
            };
            let blocks = match &op.op {
                Some(v1::kv_operation::Op::Export(e)) => e.block_hashes.len(),
                Some(v1::kv_operation::Op::Import(i)) => i.block_ids.len(),
                Some(v1::kv_operation::Op::Store(_)) | None => 0,
            };
            side.blocks = u32::try_from(blocks).unwrap_or(u32::MAX);
            side.bytes = blocks as u64 * block_bytes;
            side.phase = Phase::InProgress;
            side.issued = Some(Instant::now());
        }
    }

    /// The executor reported `result`.
    pub fn reported(&mut self, result: &v1::KvOperationResult) {
        let Some(mut side) = result.transfer_id.parse().ok().and_then(|t| self.live.remove(&t))
        else {
            return;
        };
        side.ended = Some(Instant::now());
        if result.ok {
            side.phase = Phase::Done;
            side.bytes = result.bytes;
        } else {
            let reason = crate::metrics::kv_failure(result.failure).1;
            side.phase = Phase::Failed(reason.to_string());
            side.error.clone_from(&result.error);
        }
        self.keep(side);
    }

    /// The request of `plan` left the link; its side ends unless its operation is in progress
    /// (the executor still reports that one).
    pub fn left(&mut self, plan: &TransferPlan) {
        let tid = match plan {
            TransferPlan::Export { transfer_id, .. } | TransferPlan::Import { transfer_id, .. } => {
                transfer_id.0
            }
        };
        if self.live.get(&tid).is_some_and(|s| s.phase == Phase::Planned) {
            let mut side = self.live.remove(&tid).expect("just seen");
            side.phase = Phase::Abandoned;
            side.ended = Some(Instant::now());
            self.keep(side);
        }
    }

    fn keep(&mut self, side: TransferSide) {
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(side);
    }

    /// Every side in progress and the recent ended ones.
    pub fn views(&self) -> Vec<TransferSide> {
        self.live.values().chain(&self.recent).cloned().collect()
    }
}
