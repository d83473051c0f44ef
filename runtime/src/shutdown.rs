//! Stopping: waiting for the signal (SIGTERM, what Kubernetes and `kill` send, or Ctrl-C), and
//! the drain that follows it, bounded by `--drain-timeout`.
//!
//! Every service drains the same way: it reports `NOT_SERVING` at once (so load balancers and
//! probes stop sending work), hands its work over (a leader resigns, an executor or KV agent
//! withdraws its etcd registration, so others move what it had), stops accepting, and waits
//! for the calls still in flight — at most the drain timeout from the signal. What is still
//! running then is cut when the process exits, and whoever sent it moves it (a front to the
//! next leader, a scheduler to another executor).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// What stops a service: a future that resolves when it should drain ([`shutdown_signal`] in a
/// binary, a channel in `ferry serve` and in tests). Boxed rather than generic, so each
/// service's `run` — the whole server stack under it — is compiled once, in its own crate, and
/// not again in every binary and test that starts it (a generic `run` cost each binary 20-50 s
/// of code generation).
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The [`Shutdown`] of a part that stops with others: it resolves once `stop` is set (or its
/// sender is gone), so one `watch` channel fans a stop out to every part holding a receiver.
pub fn when_set(mut stop: tokio::sync::watch::Receiver<bool>) -> Shutdown {
    Box::pin(async move {
        let _ = stop.wait_for(|stop| *stop).await;
    })
}

/// Longest `--drain-timeout`: a day.
pub const MAX_DRAIN_SECS: u64 = 86_400;

/// The drain's time limit, a flag of every service.
#[derive(Clone, Copy, Debug, clap::Args)]
pub struct DrainArgs {
    /// On SIGTERM, how long (seconds) the service may take to drain: report `NOT_SERVING`, hand
    /// its work over, and let calls in flight finish. Past it, what still runs is cut and moved
    /// by whoever sent it. Keep it below Kubernetes' termination grace period.
    #[arg(long = "drain-timeout", env = "FERRY_DRAIN_TIMEOUT", default_value_t = 30)]
    pub drain_timeout: u64,
}

impl DrainArgs {
    /// The limit, checked.
    pub fn timeout(&self) -> Result<Duration, String> {
        if (1..=MAX_DRAIN_SECS).contains(&self.drain_timeout) {
            Ok(Duration::from_secs(self.drain_timeout))
        } else {
            Err(format!(
                "--drain-timeout must be between 1 and {MAX_DRAIN_SECS} seconds, got {}",
                self.drain_timeout
            ))
        }
    }
}

/// Runs `drain` for at most `limit`; says (and logs) when it was cut short.
pub async fn bounded_drain(limit: Duration, drain: impl Future<Output = ()>) -> bool {
    let started = tokio::time::Instant::now();
    if tokio::time::timeout(limit, drain).await.is_ok() {
        tracing::info!(took = ?started.elapsed(), "drained");
        true
    } else {
        tracing::warn!(?limit, "drain timeout: the calls still in flight are cut");
        false
    }
}

/// Resolves when the process is asked to stop (SIGTERM or SIGINT).
///
/// If a signal handler cannot be installed (no such signal on this platform), that source is
/// ignored rather than treated as an immediate stop.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut sig) => {
                sig.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("received Ctrl-C, shutting down"),
        () = terminate => tracing::info!("received SIGTERM, shutting down"),
    }
}
