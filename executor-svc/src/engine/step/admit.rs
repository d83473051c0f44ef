//! Refusing one request instead of the whole step: a fault that names one request takes that
//! request's parts out of the step (its new request, update, work, preemption, KV operations
//! and block copies), and what remains is validated again, until it passes or the fault is the
//! step's own. A refused request is forgotten, and listed as refused for every later step that
//! names it until one lists it in `finished_ids`; its KV operations are reported failed, never
//! started.

use std::borrow::Cow;
use std::collections::HashMap;

use ferry_proto::v1;

use super::batch::Planned;
use super::validate::Prepared;
use super::{Engine, StepError};

/// A step cleared to run: what remains of it once the refused requests are out.
pub(super) struct Admitted<'s> {
    pub(super) step: Cow<'s, v1::Step>,
    pub(super) planned: Vec<Planned>,
    /// Refused in this step, with why.
    pub(super) refused: Vec<(u64, String)>,
    /// Requests refused earlier that this step still names.
    pub(super) named_again: Vec<u64>,
    /// KV operations of refused requests, not started, with why.
    pub(super) dropped_ops: Vec<(v1::KvOperation, String)>,
    /// What validating the new requests prepared for them.
    pub(super) prepared: Prepared,
}

impl Engine {
    /// Forgets the requests refused in this step and remembers why. The result's refusals
    /// (those refused earlier and named again, then these) and its failed KV operations (the
    /// refused requests' operations, never started).
    pub(super) fn forget_refused(
        &mut self,
        named_again: Vec<u64>,
        refused: Vec<(u64, String)>,
        dropped_ops: Vec<(v1::KvOperation, String)>,
    ) -> (Vec<v1::RefusedRequest>, Vec<v1::KvOperationResult>) {
        let failed = dropped_ops
            .into_iter()
            .map(|(op, why)| v1::KvOperationResult {
                transfer_id: op.transfer_id,
                ok: false,
                error: why,
                failure: v1::KvFailure::Executor.into(),
                ..Default::default()
            })
            .collect();
        let mut out: Vec<v1::RefusedRequest> = named_again
            .into_iter()
            .map(|id| v1::RefusedRequest { id, reason: self.refused[&id].clone() })
            .collect();
        for (id, reason) in refused {
            out.push(self.refuse(id, reason));
        }
        (out, failed)
    }

    /// Forgets request `id` and remembers why, until a step lists it as finished.
    pub(super) fn refuse(&mut self, id: u64, reason: String) -> v1::RefusedRequest {
        tracing::warn!(request = id, %reason, "request refused");
        if let Some(t) = self.requests.remove(&id).and_then(|r| r.trace) {
            t.end("refused");
        }
        self.refused.insert(id, reason.clone());
        v1::RefusedRequest { id, reason }
    }

    /// Takes the refused requests out of `step` until what remains passes [`Self::validate`]:
    /// those refused earlier that it still names, then each that a fault names, one at a time
    /// (each takes a part out, so this ends). A fault of the step as a whole is its error.
    /// `unusable` are new requests already refused (their LoRA adapter), with why.
    pub(super) fn admit<'s>(
        &self,
        step: &'s v1::Step,
        unusable: Vec<(u64, String)>,
    ) -> Result<Admitted<'s>, StepError> {
        let mut admitted = Admitted {
            step: Cow::Borrowed(step),
            planned: Vec::new(),
            refused: Vec::new(),
            named_again: Vec::new(),
            dropped_ops: Vec::new(),
            prepared: HashMap::new(),
        };
        if !self.refused.is_empty() {
            let mut earlier: Vec<u64> =
                self.refused.keys().filter(|id| !step.finished_ids.contains(id)).copied().collect();
            earlier.sort_unstable();
            for id in earlier {
                let why = format!("request {id} was refused: {}", self.refused[&id]);
                if admitted.take_out(id, &why) {
                    admitted.named_again.push(id);
                }
            }
        }
        for (id, why) in unusable {
            if admitted.take_out(id, &why) {
                admitted.refused.push((id, why));
            }
        }
        loop {
            let fault = match self.validate(&admitted.step) {
                Ok((planned, prepared)) => {
                    admitted.planned = planned;
                    admitted.prepared = prepared;
                    return Ok(admitted);
                }
                Err(fault) => fault,
            };
            let why = fault.to_string();
            match fault.request() {
                Some(id) if admitted.take_out(id, &why) => admitted.refused.push((id, why)),
                _ => return Err(fault),
            }
        }
    }
}

impl Admitted<'_> {
    /// Takes request `id`'s parts out of the step, its KV operations failed with `why`; false
    /// if the step names no part of it.
    fn take_out(&mut self, id: u64, why: &str) -> bool {
        let Some((rest, ops)) = without(&self.step, id) else { return false };
        self.step = Cow::Owned(rest);
        self.dropped_ops.extend(ops.into_iter().map(|op| (op, why.to_string())));
        true
    }
}

/// `step` without request `id`'s parts (its new request, update, work, preemption and KV
/// operations, which come back beside it), or `None` when it names no part of it. Its
/// `finished_ids` stay: forgetting a request is never a fault.
fn without(step: &v1::Step, id: u64) -> Option<(v1::Step, Vec<v1::KvOperation>)> {
    let ops_of = |op: &v1::KvOperation| crate::engine::kv::request_of_op(op) == Some(id);
    let named = step.new_requests.iter().any(|r| r.id == id)
        || step.cached_requests.iter().any(|r| r.id == id)
        || step.work.iter().any(|w| w.id == id)
        || step.preempted_ids.contains(&id)
        || step.kv_ops.iter().any(ops_of)
        || step.block_copies.iter().any(|c| c.id == id);
    if !named {
        return None;
    }
    let mut rest = step.clone();
    rest.new_requests.retain(|r| r.id != id);
    rest.cached_requests.retain(|r| r.id != id);
    let its_tokens: u32 = rest.work.iter().filter(|w| w.id == id).map(|w| w.num_tokens).sum();
    rest.total_num_tokens = rest.total_num_tokens.wrapping_sub(its_tokens);
    rest.work.retain(|w| w.id != id);
    rest.preempted_ids.retain(|p| *p != id);
    rest.block_copies.retain(|c| c.id != id);
    let (dropped, kept) = std::mem::take(&mut rest.kv_ops).into_iter().partition(ops_of);
    rest.kv_ops = kept;
    Some((rest, dropped))
}
