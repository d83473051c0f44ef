//! Prefill/decode disaggregation (DESIGN.md §6): a long prompt is prefilled on a prefill-role
//! executor, its KV moves to a decode executor's node, and the request continues there.
//!
//! The front places the prefill half — a prefill-only request ([`TransferPlan::Export`]) —
//! and keeps a [`Handoff`]: the decode executor it chose, the transfer id, and how many prompt
//! tokens the import covers. The prefill executor samples the first token (the client sees it
//! at once) and starts the export; when its link says so, the stream submits the continuation
//! — prompt plus first token as prior output, [`TransferPlan::Import`] — to the decode
//! executor, whose core reads the blocks from its own node's agent as they arrive and computes
//! the rest. So the export and the decode executor's queueing overlap.
//!
//! Every failure on the way ends in recomputation, never in a lost request: an export that
//! fails (or a prefill executor that dies) cancels the transfer at the decode node's agent, so
//! the import there fails at once and the decode executor prefills the prompt itself; a decode
//! executor that is gone or refuses the continuation sends it to another executor, as any move
//! does; an import past its timeout recomputes too.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1;
use ferry_sched_core::{routing, Fork, TransferId};

use super::placement::{PlaceError, Placed};
use super::router::{self, has_agent, has_room, import_tokens, prefill_only};
use super::{Front, Route};
use crate::link::{LinkHandle, TransferPlan};
use crate::request::RequestSpec;

/// The decode half of a disaggregated request, chosen when its prefill half was placed.
#[derive(Clone)]
pub(crate) struct Handoff {
    /// Where the request continues.
    pub decode: LinkHandle,
    /// The transfer carrying the prompt's KV to the decode node's agent.
    pub transfer_id: TransferId,
    /// The client's id of the request.
    pub request: Arc<str>,
    /// Prompt tokens the import covers (whole blocks, fewer than the prompt).
    pub import_tokens: usize,
    /// How long each side of the transfer may take.
    pub timeout: Duration,
}

impl Handoff {
    /// The decode node's agent.
    pub fn agent(&self) -> &str {
        &self.decode.info.kv_agent_address
    }

    /// The continuation's part: import the prompt's KV.
    pub fn import_plan(&self) -> TransferPlan {
        TransferPlan::Import {
            transfer_id: self.transfer_id,
            request: self.request.clone(),
            tokens: self.import_tokens,
            timeout: self.timeout,
            source: None,
        }
    }
}

/// Transfer ids unique across the front's restarts: the start time in milliseconds, shifted
/// past a counter.
pub(crate) fn transfer_ids() -> AtomicU64 {
    AtomicU64::new(ferry_runtime::clock::now_unix_ms() << 20)
}

impl Front {
    /// Places a new request: disaggregated when a prefill executor and a decode executor are
    /// up and the prompt's uncached part on the decode executor is long enough, else whole.
    pub(crate) async fn place_new(
        &self,
        spec: &Arc<RequestSpec>,
        request_id: &str,
    ) -> Result<(Placed, Option<Handoff>), PlaceError> {
        if let Some((prefill, handoff)) = self.plan_handoff(spec, request_id).await {
            let export = TransferPlan::Export {
                transfer_id: handoff.transfer_id,
                request: handoff.request.clone(),
                destination: handoff.agent().to_string(),
                timeout: handoff.timeout,
            };
            match self.submit(&prefill, spec, &[], Some(export), Fork::None).await {
                Ok(placed) => return Ok((placed, Some(handoff))),
                Err(e) => tracing::debug!(
                    executor = %prefill.name,
                    error = %e,
                    "the prefill executor did not take the request; it runs whole"
                ),
            }
        }
        // A new request does not wait for an executor of this process (none is a 503 now), but
        // a front in its own process waits out a leader's failover, as a moved request does.
        let patience = match self.route {
            Route::Local(_) => Duration::ZERO,
            Route::Remote(_) => self.settings.failover_wait,
        };
        Ok((self.place(spec, request_id, &spec.prior_output, patience).await?, None))
    }

    /// The prefill executor and the handoff for `spec`, if it is worth disaggregating: a
    /// decode executor first (the router's pick: cached prefix less a load term, then load),
    /// then the least-loaded prefill executor whose KV blocks it accepts.
    async fn plan_handoff(
        &self,
        spec: &RequestSpec,
        request_id: &str,
    ) -> Option<(LinkHandle, Handoff)> {
        let min_tokens = self.settings.disaggregation_min_tokens?;
        let Route::Local(set) = &self.route else { return None };
        // A request scoring its prompt (prompt_logprobs) computes it where it decodes.
        if !spec.prior_output.is_empty()
            || spec.prompt.len() < min_tokens
            || spec.sampling.prompt_logprobs.is_some()
        {
            return None;
        }
        let alive = set.serving(&self.models.get(spec.model).file.fingerprint);
        let prefill: Vec<&LinkHandle> =
            alive.iter().filter(|l| prefill_only(l) && has_agent(l, &set.agents)).collect();
        if prefill.is_empty() {
            return None;
        }
        let decoders: Vec<LinkHandle> = alive
            .iter()
            .filter(|l| !prefill_only(l) && has_agent(l, &set.agents))
            .filter(|d| prefill.iter().any(|p| p.info.kv_layout == d.info.kv_layout))
            .filter(|d| has_room(d, spec.prompt.len()))
            .cloned()
            .collect();
        // Not reserved past the choice: the continuation is added after the prefill.
        let load_tokens = self.settings.route_load_tokens;
        let (decode, _) = router::pick(&decoders, &spec.prompt, spec, load_tokens).await?;
        let salt = crate::link::shared_salt(spec);
        let cached = router::cached_prefix(&decode, spec.prompt.clone(), salt).await;
        let bs = decode.info.block_size as usize;
        if !routing::worth_disaggregating(spec.prompt.len(), cached, min_tokens, bs) {
            return None;
        }
        let import_tokens = import_tokens(spec.prompt.len(), bs);
        let prefill = prefill
            .into_iter()
            .filter(|p| p.info.kv_layout == decode.info.kv_layout && p.name != decode.name)
            .min_by_key(|p| p.load.load(Ordering::Relaxed))?
            .clone();
        let transfer_id = TransferId(self.next_transfer.fetch_add(1, Ordering::Relaxed));
        let handoff = Handoff {
            decode,
            transfer_id,
            request: request_id.into(),
            import_tokens,
            timeout: self.settings.kv_transfer_timeout,
        };
        Some((prefill, handoff))
    }
}

/// Cancels transfer `transfer_id` at the agent at `agent` (best effort, in the background): a
/// decode executor waiting for its KV fails the import at once and recomputes.
pub(crate) fn cancel_transfer(agent: &str, transfer_id: TransferId, reason: &str) {
    let (agent, reason) = (agent.to_string(), reason.to_string());
    tokio::spawn(async move {
        let request = v1::CancelTransferRequest { transfer_id: transfer_id.0.to_string(), reason };
        let call = async {
            let mut client = crate::tier::agent_client(&agent).await?;
            client.cancel(request).await.map_err(|s| s.message().to_string())
        };
        match tokio::time::timeout(Duration::from_secs(5), call).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::debug!(%agent, transfer = transfer_id.0, error = %e, "cancel failed");
            }
            Err(_) => tracing::debug!(%agent, transfer = transfer_id.0, "cancel timed out"),
        }
    });
}
