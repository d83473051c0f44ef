//! KV transfers: a disaggregated request's KV from its prefill executor to its decode
//! executor, and KV-tier reads from a node agent's store into an executor. A transfer's bytes
//! take `bytes / (bandwidth x GPUs of the group)` plus a fixed latency from the step that
//! carries its export or import; each side reports its end in the first step result after the
//! bytes have arrived.
//!
//! Invariant: a transfer's record exists from the moment its request is placed, so the bytes'
//! arrival wakes the decode executor even if its import goes out before the export does.

use ferry_sched_core::{
    BlockHash, KvImport, KvOp, KvResult, NewRequest, RequestId, Timestamp, TransferId,
};

use super::{ns, Event, Sim};

/// A KV transfer: from a prefill executor to a decode executor, or a KV-tier read from the
/// agent of `source`'s node into `destination`.
pub(super) struct Transfer {
    source: usize,
    destination: usize,
    /// When its bytes have all arrived (once its export or read went out).
    arrived: Option<u64>,
    /// For a KV-tier read: the hashes of the blocks it reads.
    tier: Option<Vec<BlockHash>>,
    /// Whether it moved its blocks (a tier read whose blocks were evicted fails).
    ok: bool,
}

impl Sim<'_> {
    /// A new transfer's id and record, from `source` to `destination` (a KV-tier read names
    /// the blocks it reads).
    pub(super) fn new_transfer(
        &mut self,
        source: usize,
        destination: usize,
        tier: Option<Vec<BlockHash>>,
    ) -> TransferId {
        self.next_transfer += 1;
        let t = Transfer { source, destination, arrived: None, tier, ok: true };
        self.transfers.insert(self.next_transfer, t);
        TransferId(self.next_transfer)
    }

    /// The KV transfers executor `e` has carried out whose bytes have arrived by now, as
    /// results for its next step result.
    pub(super) fn due_kv_results(&mut self, e: usize) {
        let (now, transfers) = (self.now, &self.transfers);
        let x = &mut self.execs[e];
        x.transfers.retain(|tid| {
            let t = transfers.get(&tid.0);
            let arrived = t.and_then(|t| t.arrived).is_some_and(|t| t <= now);
            if arrived {
                let ok = t.is_some_and(|t| t.ok);
                x.outcome.kv_results.push(KvResult { transfer_id: *tid, ok });
            }
            !arrived
        });
    }

    /// A transfer's bytes have arrived: both sides report it at their next step's end (an
    /// idle side steps now).
    pub(super) fn transfer_done(&mut self, tid: u64) -> Result<(), String> {
        let Some(t) = self.transfers.get_mut(&tid) else { return Ok(()) };
        t.arrived = Some(self.now);
        let (source, destination) = (t.source, t.destination);
        self.wake(source)?;
        self.wake(destination)
    }

    /// A prefill-only request's export went out: its continuation goes to its decode executor
    /// (the prompt, the first token as prior output, an import of the prompt's whole blocks).
    pub(super) fn hand_on(&mut self, id: u64) -> Result<(), String> {
        let Some(mut track) = self.tracks.remove(&id) else { return Ok(()) };
        let Some((h, first_token)) =
            track.handoff.take().and_then(|h| h.first_token.map(|t| (h, t)))
        else {
            return Err(format!("request {id} started an export without a handoff or a token"));
        };
        self.disaggregated += 1;
        self.next_continuation += 1;
        let cont = self.next_continuation;
        let mut req = NewRequest::new(RequestId(cont), h.prompt, h.output_len, Timestamp(self.now));
        req.ignore_eos = true;
        req.output = vec![first_token];
        req.kv_import = Some(KvImport { transfer_id: h.transfer, num_tokens: h.import_tokens });
        let d = h.decode;
        if let Err(err) = self.execs[d].core.add_request(req) {
            return Err(format!("executor {d} refused a continuation: {err}"));
        }
        self.admit(d, cont, track)
    }

    /// The KV operations of executor `e`'s new step: an export starts its transfer (its bytes
    /// arrive after the network's time for them); both sides await its end.
    pub(super) fn start_transfers(&mut self, e: usize) {
        let spec = self.spec;
        for i in 0..self.kv_ops.len() {
            match self.kv_ops[i] {
                KvOp::Export { transfer_id, num_tokens, .. } => {
                    // Its record was made when the request arrived (see `arrive`).
                    let bytes = num_tokens as u64 * spec.model.kv_bytes_per_token();
                    self.execs[e].transfers.push(transfer_id);
                    self.send(transfer_id, bytes, spec.hardware.network_gbps);
                }
                KvOp::Import { transfer_id, block_ids, .. } => {
                    self.execs[e].transfers.push(transfer_id);
                    self.start_tier_read(e, transfer_id, block_ids.len as usize);
                }
                KvOp::Store { .. } => {}
            }
        }
    }

    /// A KV-tier read's import went out on executor `e` for `blocks` blocks: they arrive after
    /// the host link's time (its own node's agent) or the network's (another's); it fails if
    /// the agent has dropped any of them since the read was planned.
    fn start_tier_read(&mut self, e: usize, tid: TransferId, blocks: usize) {
        let spec = self.spec;
        let Some(tier) = spec.kv_tier else { return };
        let Some(t) = self.transfers.get_mut(&tid.0) else { return };
        let Some(hashes) = &t.tier else { return };
        t.ok = self.agents[t.source].holds_all(hashes);
        if !t.ok {
            self.tier_read_failures += 1;
        }
        let gbps = if t.source == e { tier.host_gbps } else { spec.hardware.network_gbps };
        let bytes = (blocks * spec.scheduler.block_size) as u64 * spec.model.kv_bytes_per_token();
        self.send(tid, bytes, gbps);
    }

    /// Transfer `tid` moves `bytes` at `gbps` per GPU of the group (each GPU its shard) after
    /// the fixed latency; its `TransferDone` is posted.
    fn send(&mut self, tid: TransferId, bytes: u64, gbps: f64) {
        let spec = self.spec;
        let group = f64::from(spec.hardware.tensor_parallel.max(1));
        let secs = spec.transfer_latency + bytes as f64 / (gbps * 1e9 * group);
        self.transfer_bytes += bytes;
        self.transfer_secs += secs;
        self.transfers_done += 1;
        self.post(self.now + ns(secs).max(1), Event::TransferDone(tid.0));
    }
}
