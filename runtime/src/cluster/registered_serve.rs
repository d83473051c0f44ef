//! Serving a service while it is registered in etcd, and its drain: health says `NOT_SERVING`,
//! the registration is withdrawn, then the host stops. The registration's state is exported as
//! `ferry_etcd_registered`.

use std::time::Duration;

use tokio::sync::watch;

use super::key_layout::MemberKind;
use super::registration::LeaseState;
use super::ClusterArgs;

/// `ferry_etcd_registered`: whether this service's key is in etcd under a live lease.
struct LeaseMetric(watch::Receiver<LeaseState>);

impl crate::prometheus::Render for LeaseMetric {
    fn render(&self, out: &mut crate::prometheus::Text) {
        let held = *self.0.borrow() == LeaseState::Held;
        out.gauge(
            "ferry_etcd_registered",
            "1 while this service's registration is in etcd under a live lease.",
            &[],
            f64::from(u8::from(held)),
        );
    }
}

/// Why a registered service stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RegisteredServeError {
    /// Hosting failed.
    #[error(transparent)]
    Host(#[from] crate::HostError),
    /// The etcd client could not be built.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
}

/// Serves `host` on `ports` until `shutdown`, registered in etcd as `kind`/`id` (in scheduler
/// pool `pool`, if given) while it serves when `cluster` configures etcd. On shutdown it drains ([`crate::shutdown`]): health
/// says `NOT_SERVING`, the registration is withdrawn (others stop sending work here and move
/// what they had), then the host stops and waits for its calls in flight — all within
/// `drain`.
pub async fn serve_registered(
    host: crate::GrpcHost,
    ports: impl Into<crate::grpc::Ports>,
    (cluster, kind, id, pool): (Option<&ClusterArgs>, MemberKind, &str, Option<&str>),
    shutdown: impl std::future::Future<Output = ()> + Send,
    drain: Duration,
) -> Result<(), RegisteredServeError> {
    let ports = ports.into();
    let bound = ports.grpc.local_addr().map_err(crate::HostError::Io)?;
    let registration = match cluster {
        Some(c) => c.register(kind, (id, pool), bound).await?,
        None => None,
    };
    let host = match &registration {
        Some(r) => host.with_metrics(std::sync::Arc::new(LeaseMetric(r.state.clone()))),
        None => host,
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let health = host.health_switch();
    let serving = host.serve(ports, crate::when_set(stop_rx));
    tokio::pin!(serving);
    tokio::select! {
        result = &mut serving => return Ok(result?),
        () = shutdown => {}
    }
    let mut served = Ok(());
    crate::bounded_drain(drain, async {
        health.not_serving().await;
        if let Some(r) = registration {
            r.withdraw().await;
        }
        let _ = stop_tx.send(true);
        served = serving.await;
    })
    .await;
    Ok(served?)
}
