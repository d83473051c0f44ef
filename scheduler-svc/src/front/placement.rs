//! Where a request runs, and how the front puts it there: on an executor link of this process
//! (the one [`super::router`] picks, with a KV-tier read when another node's agent holds more
//! of its prompt), or on the pool's leader scheduler for a front in its own process.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1;
use ferry_runtime::Backoff;
use ferry_sched_core::{Fork, RequestId, TransferId};
use tokio::sync::mpsc;
use tonic::Status;

use super::{remote, router, shards};
use super::{Front, Route};
use crate::link::{AddRefused, LinkError, LinkEvent, LinkHandle, Submission, TransferPlan};
use crate::request::RequestSpec;

/// Where a live request runs.
#[derive(Clone)]
pub(crate) enum Placement {
    /// On an executor link of this process, under a core id.
    Link {
        /// The link.
        link: LinkHandle,
        /// The request's id in that link's core.
        id: RequestId,
    },
    /// On the leader scheduler.
    Remote(remote::Call),
}

impl Placement {
    /// Aborts the request where it runs (a no-op if it already ended). Its final account
    /// (a `Finished` event) still reaches the stream.
    pub(crate) async fn abort(&self) {
        match self {
            Placement::Link { link, id } => link.abort(*id).await,
            Placement::Remote(call) => call.abort().await,
        }
    }

    /// The executor's or the leader's name.
    pub(crate) fn name(&self) -> &str {
        match self {
            Placement::Link { link, .. } => &link.name,
            Placement::Remote(call) => &call.leader,
        }
    }
}

/// Why a request could not be placed.
pub(crate) enum PlaceError {
    /// No executor running the request's model (named) is up.
    NoExecutor(String),
    /// Every executor up holds its limit of requests (the last one's limit).
    Full(usize),
    /// The executor refused it (bad for that executor: too long for its cache, …).
    Refused(String),
    /// The leader scheduler refused it, or none answered in time.
    Remote(Status),
}

impl From<PlaceError> for Status {
    fn from(e: PlaceError) -> Status {
        match e {
            PlaceError::NoExecutor(model) => {
                Status::unavailable(format!("no executor serving model {model:?} is connected"))
            }
            PlaceError::Full(limit) => Status::resource_exhausted(format!(
                "every executor holds its limit of requests ({limit} on the last one tried, \
                 --max-live-requests); retry later"
            )),
            PlaceError::Refused(why) => Status::invalid_argument(why),
            PlaceError::Remote(status) => status,
        }
    }
}

impl std::fmt::Display for PlaceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlaceError::NoExecutor(model) => {
                write!(f, "no other executor serving model {model:?} is up")
            }
            PlaceError::Full(limit) => {
                write!(f, "every executor is full (at its limit of {limit} requests)")
            }
            PlaceError::Refused(why) => write!(f, "no other executor took it: {why}"),
            PlaceError::Remote(s) => write!(f, "no scheduler took it: {}", s.message()),
        }
    }
}

/// A placement and the channel its events arrive on.
pub(crate) type Placed = (Placement, mpsc::UnboundedReceiver<LinkEvent>);

impl Front {
    /// Places `spec` with `delivered` tokens already generated on an executor up now, or one
    /// that comes up within `patience`; an executor that turns out to be gone is skipped.
    pub(crate) async fn place(
        &self,
        spec: &Arc<RequestSpec>,
        request_id: &str,
        delivered: &[u32],
        patience: Duration,
    ) -> Result<Placed, PlaceError> {
        let model = self.models.get(spec.model);
        let fingerprint = model.file.fingerprint.as_str();
        let executors = match &self.route {
            Route::Local(set) => set,
            Route::Remote(shards) => {
                let routing = (fingerprint, self.settings.route_load_tokens);
                return place_remote(shards, spec, delivered, routing, patience).await;
            }
        };
        let none = || PlaceError::NoExecutor(model.name().to_string());
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let alive = executors.wait_serving(Some(fingerprint), left).await;
            let mut sequence = spec.prompt.to_vec();
            sequence.extend_from_slice(delivered);
            let roomy: Vec<LinkHandle> = alive.iter().filter(|l| l.has_room()).cloned().collect();
            if roomy.is_empty() {
                if let Some(full) = alive.first() {
                    return Err(PlaceError::Full(full.info.max_live_requests as usize));
                }
            }
            let load_tokens = self.settings.route_load_tokens;
            let picked = router::pick(&roomy, &sequence, spec, load_tokens).await;
            let Some((link, _reserved)) = picked else {
                return Err(none());
            };
            let tier_read = self.tier_read(&link, spec, request_id).await;
            match self.submit(&link, spec, delivered, tier_read, Fork::None).await {
                Err(PlaceError::NoExecutor(_)) => {
                    // It died between the pick and the add: try the others.
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    if left.is_zero() && executors.serving(fingerprint).is_empty() {
                        return Err(none());
                    }
                }
                placed => return placed,
            }
        }
    }

    /// Where a prompt would run on this process's executors (`Generation/Locate`): the
    /// router's pick among those with room, its cached prefix and load. A front in its own
    /// process runs nothing and says so.
    pub(crate) async fn locate(
        &self,
        ask: &v1::LocateRequest,
    ) -> Result<v1::LocateResponse, Status> {
        let Route::Local(set) = &self.route else {
            return Err(Status::unimplemented(
                "a front in its own process locates nothing: ask a scheduler that leads a pool",
            ));
        };
        let model = match ask.model_fingerprint.as_str() {
            "" => Some(self.models.default_model()),
            asked => self.models.by_fingerprint(asked).map(|id| self.models.get(id)),
        };
        let Some(model) = model else {
            return Err(Status::failed_precondition(format!(
                "the prompt was tokenized for the model with fingerprint {}, which this \
                 scheduler does not serve (it serves {})",
                ask.model_fingerprint,
                self.models.served_names()
            )));
        };
        let limit = model.max_model_len;
        if ask.token_ids.len() > limit {
            return Err(Status::invalid_argument(format!(
                "{} token ids to locate: past the model's length of {limit}",
                ask.token_ids.len()
            )));
        }
        let mut roomy = set.serving(&model.file.fingerprint);
        roomy.retain(LinkHandle::has_room);
        let (executors, best) =
            router::locate(&roomy, &ask.token_ids, self.settings.route_load_tokens).await;
        let best = best.unwrap_or_default();
        Ok(v1::LocateResponse {
            executors: u32::try_from(executors).unwrap_or(u32::MAX),
            prefix_hit_tokens: u32::try_from(best.prefix_hit_tokens).unwrap_or(u32::MAX),
            load: u32::try_from(best.load).unwrap_or(u32::MAX),
        })
    }

    /// A KV-tier read for `spec` on `link`: when a KV agent's store (any node's, by the tier's
    /// index) holds a prefix of the prompt at least `--kv-tier-min-tokens` longer than what
    /// `link`'s cache holds, the plan to import it from there instead of computing it. The
    /// executor reads the blocks straight from that agent; if they are gone, the import fails
    /// and the prompt is computed (nothing waits: a tier read finds its blocks or fails now).
    async fn tier_read(
        &self,
        link: &LinkHandle,
        spec: &RequestSpec,
        request_id: &str,
    ) -> Option<TransferPlan> {
        let min = self.settings.kv_tier_min_tokens?;
        let Route::Local(set) = &self.route else { return None };
        let own_agent = &link.info.kv_agent_address;
        let bs = link.info.block_size as usize;
        let covered = router::import_tokens(spec.prompt.len(), bs);
        if own_agent.is_empty() || covered < min || !set.agents.is_live(own_agent) {
            return None;
        }
        // The salt its blocks are cached under (another salt's blocks hold other KV); none
        // for a request that computes its prompt to score it.
        let salt = crate::link::shared_salt(spec)?;
        let mut hashes = Vec::new();
        ferry_sched_core::extend_block_hashes(&mut hashes, &spec.prompt[..covered], bs, salt);
        let hashes: Vec<u64> = hashes.iter().map(|h| h.0).collect();
        let layout = crate::tier::layout_key(link.info.kv_layout.as_ref());
        let live = |a: &str| set.agents.is_live(a);
        let (agent, blocks) = set.tier.longest_prefix(&hashes, layout, own_agent, live)?;
        let tokens = blocks * bs;
        let cached = link.prefix_hit(spec.prompt.clone(), salt).await;
        if tokens < cached + min {
            return None;
        }
        set.metrics.tier_hits.add(1);
        Some(TransferPlan::Import {
            transfer_id: TransferId(self.next_transfer.fetch_add(1, Ordering::Relaxed)),
            request: request_id.into(),
            tokens,
            timeout: self.settings.kv_transfer_timeout,
            source: Some(agent),
        })
    }

    /// Adds `spec` (with `delivered` tokens, its part in a KV transfer and in parallel
    /// sampling) to `link`'s core; `NoExecutor` if the link turned out to be gone (it is closed
    /// then).
    pub(crate) async fn submit(
        &self,
        link: &LinkHandle,
        spec: &Arc<RequestSpec>,
        delivered: &[u32],
        transfer: Option<TransferPlan>,
        fork: Fork,
    ) -> Result<Placed, PlaceError> {
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let submission = Submission {
            id,
            spec: spec.clone(),
            output: delivered.to_vec(),
            transfer,
            fork,
            events: events_tx,
        };
        match link.add(submission).await {
            Ok(Ok(())) => Ok((Placement::Link { link: link.clone(), id }, events_rx)),
            Ok(Err(AddRefused::Full { limit })) => Err(PlaceError::Full(limit)),
            Ok(Err(e @ AddRefused::Core(_))) => Err(PlaceError::Refused(e.to_string())),
            Err(LinkError::Gone | LinkError::Connect { .. } | LinkError::Refused { .. }) => {
                link.close("its loop stopped");
                Err(PlaceError::NoExecutor(self.models.get(spec.model).name().to_string()))
            }
        }
    }
}

impl Front {
    /// Places the samples of one request (`specs[i]` for sample i, `ids[i]` its stream's id):
    /// on this process's executors, all on the executor the first would get, the others
    /// forking from its prompt's KV; a sample that executor does not take (full), and every
    /// sample of a front in its own process, is placed on its own. On an error the samples
    /// placed so far are aborted.
    pub(crate) async fn place_samples(
        &self,
        specs: &[Arc<RequestSpec>],
        ids: &[String],
        patience: Duration,
    ) -> Result<Vec<Placed>, PlaceError> {
        let mut placed: Vec<Placed> = Vec::with_capacity(specs.len());
        // A request scoring its prompt computes it in a cache of its own: it cannot share.
        let shares = crate::link::shared_salt(&specs[0]).is_some();
        if let (Route::Local(set), true) = (&self.route, shares) {
            let mut roomy = set.serving(&self.models.get(specs[0].model).file.fingerprint);
            roomy.retain(LinkHandle::has_room);
            let load_tokens = self.settings.route_load_tokens;
            if let Some((link, _reserved)) =
                router::pick(&roomy, &specs[0].prompt, &specs[0], load_tokens).await
            {
                if let Ok(first) = self.submit(&link, &specs[0], &[], None, Fork::Source).await {
                    let Placement::Link { id: source, .. } = &first.0 else {
                        unreachable!("submit places on a link")
                    };
                    let fork = Fork::Of(*source);
                    placed.push(first);
                    for spec in &specs[1..] {
                        if let Ok(p) = self.submit(&link, spec, &[], None, fork).await {
                            placed.push(p);
                        } else {
                            break;
                        }
                    }
                }
            }
        }
        for (spec, id) in specs.iter().zip(ids).skip(placed.len()) {
            match self.place(spec, id, &[], patience).await {
                Ok(p) => placed.push(p),
                Err(e) => {
                    for (p, _) in &placed {
                        p.abort().await;
                    }
                    return Err(e);
                }
            }
        }
        Ok(placed)
    }
}

/// Sends `spec` (with `delivered` tokens, tokenized for the model with `fingerprint`) to the
/// leader scheduler of the shard [`shards::Shards::choose`] picks (weighing load by
/// `load_tokens`), retrying (no leader, leader unreachable or without executors) until
/// `patience` runs out.
async fn place_remote(
    shards: &shards::Shards,
    spec: &RequestSpec,
    delivered: &[u32],
    (fingerprint, load_tokens): (&str, usize),
    patience: Duration,
) -> Result<Placed, PlaceError> {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_millis(500))
        .with_patience(Some(patience));
    loop {
        let Some(placing) =
            shards.choose((&spec.prompt, delivered), fingerprint, load_tokens).await
        else {
            if !backoff.wait().await {
                let none = Status::unavailable("no scheduler leads any pool");
                return Err(PlaceError::Remote(none));
            }
            continue;
        };
        let request = spec.to_remote(delivered, fingerprint);
        let submitted = remote::submit(placing.leader(), request, &spec.traceparent).await;
        drop(placing);
        match submitted {
            Ok((call, rx)) => return Ok((Placement::Remote(call), rx)),
            Err(remote::SubmitError::Refused(status)) => return Err(PlaceError::Remote(status)),
            Err(remote::SubmitError::Retry(status)) => {
                if !backoff.wait().await {
                    return Err(PlaceError::Remote(status));
                }
            }
        }
    }
}
