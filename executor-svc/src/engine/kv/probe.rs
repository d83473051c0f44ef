//! Whether the node's agent maps this executor's staging region: asked until the agent answers
//! (it may start after the executor, as a sidecar does), on the workspace's one retry policy.
//! Until it says yes, transfers take its socket.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry_kv_wire::data_channel;
use ferry_runtime::Backoff;

/// Asks the agent at `agent` whether it maps staging region `name` until it answers (it may
/// start after the executor, as a sidecar does); sets `ok` when it does.
pub(super) async fn probe_until_answered(agent: String, name: String, ok: Arc<AtomicBool>) {
    // 200 ms doubling to 10 s, and no deadline, as this loop's own timer had; the one policy
    // adds its ±25 % jitter, so executors that lost the same agent do not ask in lockstep.
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    for attempt in 0.. {
        match data_channel::probe(&agent, &name).await {
            Ok(()) => {
                ok.store(true, Ordering::Release);
                tracing::info!(agent, region = name, "KV transfers go through shared memory");
                return;
            }
            Err(s) if s.code() == tonic::Code::Unavailable => {}
            Err(s) => {
                let error = s.message();
                tracing::warn!(
                    agent,
                    error,
                    "the KV agent cannot map the staging region: KV transfers take its socket"
                );
                return;
            }
        }
        if attempt == 0 {
            tracing::info!(
                agent,
                "the KV agent is not reachable yet: transfers take its socket until it is"
            );
        }
        if !backoff.wait().await {
            return; // never: without a deadline the backoff waits on
        }
    }
}
