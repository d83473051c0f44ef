//! A front in its own process (`ferry-scheduler front`): it sends each request to a pool's
//! leader scheduler (the shard [`super::shards`] chooses), found through etcd's election, and
//! turns the leader's token stream into the same events an in-process executor link gives.
//!
//! Why this is what makes a scheduler failure invisible: the front journals each stream (the
//! prompt and every token delivered), so when the leader dies, the stream breaks here, and the
//! front sends the continuation — prompt plus delivered tokens as `output_token_ids` — to the
//! next leader. The scheduler computes nothing twice that the client saw, and seeded or greedy
//! sampling continues exactly (DESIGN.md §7).

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use ferry_proto::v1::{self, generation_client::GenerationClient};
use ferry_runtime::cluster::ClusterArgs;
use ferry_runtime::tls;
use ferry_sched_core::{FinishReason, FinishStats, StopCause};
use tokio::sync::{mpsc, watch};
use tonic::transport::Channel;

use crate::link::LinkEvent;

/// The pool's current leader, as etcd's election says.
pub struct Leader {
    address: watch::Receiver<Option<String>>,
    channel: Mutex<Option<(String, Channel)>>,
}

impl Leader {
    /// Starts following the leader of `pool`: etcd's election is asked again whenever a
    /// candidate key under the election prefix changes (a watch), and every 2 s in any case;
    /// etcd unreachable keeps the last answer.
    pub fn follow(cluster: ClusterArgs, pool: String) -> Arc<Self> {
        let (tx, address) = watch::channel(None);
        tokio::spawn(follow_loop(cluster, pool, tx));
        Arc::new(Leader { address, channel: Mutex::new(None) })
    }

    /// The leader's address now, if one is known.
    pub fn current(&self) -> Option<String> {
        self.address.borrow().clone()
    }

    /// A channel to the leader at `address` (one, shared, per leader).
    pub(crate) fn channel(&self, address: &str) -> Result<Channel, tonic::Status> {
        let mut cached = self.channel.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((a, ch)) = cached.as_ref() {
            if a == address {
                return Ok(ch.clone());
            }
        }
        let endpoint = tls::endpoint(address)
            .map_err(|e| tonic::Status::unavailable(format!("leader address {address:?}: {e}")))?
            .connect_timeout(Duration::from_secs(1))
            .http2_keep_alive_interval(Duration::from_secs(1))
            .keep_alive_timeout(Duration::from_secs(2));
        let ch = tls::connect_lazy(&endpoint, tls::Role::Scheduler);
        *cached = Some((address.to_string(), ch.clone()));
        Ok(ch)
    }
}

async fn follow_loop(cluster: ClusterArgs, pool: String, tx: watch::Sender<Option<String>>) {
    let name = cluster.election_name(&pool);
    let mut client = cluster.client_patiently().await;
    // Candidates' keys live under `<name>/`; any change there may change the leader.
    let mut changes = ferry_runtime::cluster::watch_members(client.clone(), format!("{name}/"));
    loop {
        match client.leader(name.clone()).await {
            Ok(r) => {
                let addr = r.kv().map(|kv| String::from_utf8_lossy(kv.value()).into_owned());
                tx.send_if_modified(|cur| {
                    let changed = *cur != addr;
                    if changed {
                        tracing::info!(%pool, leader = ?addr, "pool leader");
                        cur.clone_from(&addr);
                    }
                    changed
                });
            }
            // "no leader" is an error in etcd's election API.
            Err(e) if e.to_string().contains("no leader") => {
                tx.send_if_modified(|cur| cur.take().is_some());
            }
            Err(e) => tracing::debug!(error = %e, "etcd: leader lookup failed; keeping the last"),
        }
        let wait = if tx.borrow().is_some() { 2000 } else { 250 };
        tokio::select! {
            changed = changes.recv() => if changed.is_none() {
                tokio::time::sleep(Duration::from_millis(wait)).await;
            },
            () = tokio::time::sleep(Duration::from_millis(wait)) => {}
        }
    }
}

/// A request running on the leader.
#[derive(Clone)]
pub struct Call {
    /// The leader it runs on.
    pub leader: Arc<str>,
    client: GenerationClient<Channel>,
    /// The leader's id for the request, from its first event.
    remote_id: Arc<OnceLock<String>>,
    cancel: Arc<watch::Sender<bool>>,
}

impl Call {
    /// Aborts the request on the leader, whose stream then ends with the request's account
    /// (an abort with its usage). If the leader does not take the abort (it never said the
    /// request's id, or it is unreachable), the call is dropped instead, which aborts it there
    /// too, without an account.
    pub async fn abort(&self) {
        if let Some(id) = self.remote_id.get() {
            let mut client = self.client.clone();
            let abort = client.abort(v1::AbortRequest { request_id: id.clone() });
            if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(1), abort).await {
                if r.into_inner().found {
                    return;
                }
            }
        }
        self.cancel.send_replace(true);
    }
}

/// Why the leader did not take a request.
pub enum SubmitError {
    /// Worth another try (no leader, leader unreachable, leader without executors).
    Retry(tonic::Status),
    /// The leader refused it for good.
    Refused(tonic::Status),
}

/// Sends `req` to the current leader and streams its events.
pub async fn submit(
    leader: &Leader,
    req: v1::GenerateRequest,
    traceparent: &str,
) -> Result<(Call, mpsc::UnboundedReceiver<LinkEvent>), SubmitError> {
    let Some(address) = leader.current() else {
        return Err(SubmitError::Retry(tonic::Status::unavailable("no scheduler leads the pool")));
    };
    let channel = leader.channel(&address).map_err(SubmitError::Retry)?;
    let mut client = GenerationClient::new(channel);
    let caller = client.clone();
    let mut req = tonic::Request::new(req);
    if let Ok(tp) = traceparent.parse() {
        if !traceparent.is_empty() {
            req.metadata_mut().insert("traceparent", tp);
        }
    }
    let stream = match client.generate(req).await {
        Ok(s) => s.into_inner(),
        // A leader that is gone, going (draining cancels new calls) or not yet driving its
        // executors, or a connection broken under the call (tonic reports an HTTP/2 stream
        // reset as INTERNAL "h2 protocol error"): another try will find the next one.
        Err(s)
            if matches!(
                s.code(),
                tonic::Code::Unavailable
                    | tonic::Code::Unknown
                    | tonic::Code::Cancelled
                    | tonic::Code::Aborted
                    | tonic::Code::DeadlineExceeded
            ) || (s.code() == tonic::Code::Internal
                && s.message().starts_with("h2 protocol error")) =>
        {
            return Err(SubmitError::Retry(s))
        }
        Err(s) => return Err(SubmitError::Refused(s)),
    };
    let (cancel, cancelled) = watch::channel(false);
    let (tx, rx) = mpsc::unbounded_channel();
    let remote_id = Arc::new(OnceLock::new());
    tokio::spawn(relay(stream, remote_id.clone(), cancelled, tx));
    let call = Call { leader: address.into(), client: caller, remote_id, cancel: Arc::new(cancel) };
    Ok((call, rx))
}

/// Forwards the leader's stream as link events until it ends, breaks, or is cancelled.
async fn relay(
    mut stream: tonic::Streaming<v1::GenerateEvent>,
    remote_id: Arc<OnceLock<String>>,
    mut cancelled: watch::Receiver<bool>,
    tx: mpsc::UnboundedSender<LinkEvent>,
) {
    loop {
        let msg = tokio::select! {
            msg = stream.message() => msg,
            _ = cancelled.wait_for(|c| *c) => return,
        };
        let Ok(Some(ev)) = msg else {
            let _ = tx.send(LinkEvent::Failed);
            return;
        };
        if remote_id.get().is_none() && !ev.request_id.is_empty() {
            let _ = remote_id.set(ev.request_id.clone());
        }
        if !ev.prompt_logprobs.is_empty() {
            let _ = tx.send(LinkEvent::PromptLogprobs { from: 1, logprobs: ev.prompt_logprobs });
        }
        let mut logprobs = ev.logprobs.into_iter();
        let mut loops = ev.loops.iter().map(|&l| u8::try_from(l).unwrap_or(u8::MAX));
        for &t in &ev.token_ids {
            let _ = tx.send(LinkEvent::Token(t, logprobs.next(), loops.next().unwrap_or(0)));
        }
        let reason = match v1::FinishReason::try_from(ev.finish_reason) {
            Ok(v1::FinishReason::Unspecified) | Err(_) => continue,
            Ok(v1::FinishReason::Stop) => {
                FinishReason::Stop(StopCause::StopToken(ev.stop_reason.parse().unwrap_or(0)))
            }
            Ok(v1::FinishReason::Length) => FinishReason::Length,
            Ok(v1::FinishReason::Abort) => FinishReason::Abort,
            // Refused by an executor: another would refuse it too, so it is not moved. Any
            // other error (its scheduler lost it): moved.
            Ok(v1::FinishReason::Error) => {
                let event = if ev.error.starts_with(crate::link::REFUSED) {
                    LinkEvent::Refused(ev.error)
                } else {
                    LinkEvent::Failed
                };
                let _ = tx.send(event);
                return;
            }
        };
        let usage = ev.usage.unwrap_or_default();
        let stats = FinishStats {
            prompt_tokens: usage.prompt_tokens as usize,
            output_tokens: usage.completion_tokens as usize,
            prefix_hit_tokens: usage.cached_prompt_tokens as usize,
            ..FinishStats::default()
        };
        let _ = tx.send(LinkEvent::Finished { reason, stats });
        return;
    }
}
