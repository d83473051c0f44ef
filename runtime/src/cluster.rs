//! Cluster membership through etcd (DESIGN.md §7): a service registers itself under
//! `/ferry/<cluster>/<kind>/<id>` with a lease it keeps alive, and a scheduler watches a kind's
//! prefix to learn who is there.
//!
//! Why these loops never give up: etcd is a dependency that comes and goes (a restart, a dead
//! member behind a round-robin endpoint list). A failed call is retried with backoff; while etcd
//! is unreachable the watcher reports nothing, so the caller keeps the membership it last saw,
//! and the registration re-creates its lease and key as soon as etcd answers again. Nothing
//! here panics or returns on an etcd error, and nothing blocks a caller on etcd.

use std::time::Duration;

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use tokio::sync::{mpsc, watch};

use crate::backoff::Backoff;

/// The flags every clustered service takes. Without `--etcd-endpoints`, services run
/// statically (addresses given by hand) as before.
#[derive(Clone, Debug, clap::Args)]
pub struct ClusterArgs {
    /// etcd endpoints (comma-separated `host:port` or URLs); empty: no etcd, static set-up.
    #[arg(long = "etcd-endpoints", env = "FERRY_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// The cluster's name: keys live under `/ferry/<cluster>/`.
    #[arg(long, env = "FERRY_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// Seconds a registration outlives its owner's last keep-alive.
    #[arg(long = "lease-ttl", env = "FERRY_LEASE_TTL", default_value_t = 5)]
    pub lease_ttl: u64,
    /// The address others reach this service at (default: the address it listens on).
    #[arg(long = "advertise-address", env = "FERRY_ADVERTISE_ADDRESS")]
    pub advertise_address: Option<String>,
    /// TLS to etcd: the CA certificate (PEM) etcd's server certificates are checked against.
    /// With it, endpoints are dialled over TLS (`https://host:port`, or `host:port`).
    #[arg(long = "etcd-cacert", env = "FERRY_ETCD_CACERT")]
    pub etcd_cacert: Option<std::path::PathBuf>,
    /// Mutual TLS to etcd: the client certificate (PEM) this service presents; with
    /// `--etcd-key` and `--etcd-cacert`.
    #[arg(long = "etcd-cert", env = "FERRY_ETCD_CERT")]
    pub etcd_cert: Option<std::path::PathBuf>,
    /// Mutual TLS to etcd: the client certificate's private key (PEM).
    #[arg(long = "etcd-key", env = "FERRY_ETCD_KEY")]
    pub etcd_key: Option<std::path::PathBuf>,
}

/// What a registration's value says about its member.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemberInfo {
    /// Where to reach it (`http://host:port`).
    pub address: String,
}

impl MemberInfo {
    /// The value stored in etcd.
    pub fn to_value(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Parses a stored value.
    pub fn from_value(value: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(value)
    }
}

/// A cluster flag out of range.
#[derive(Debug, thiserror::Error)]
pub enum ClusterArgsError {
    /// TTL too short for keep-alives to work, or absurdly long.
    #[error("--lease-ttl must be between 2 and 3600 seconds, got {0}")]
    LeaseTtl(u64),
    /// Cluster names become key segments.
    #[error(
        "--cluster {0:?} must be non-empty and contain only letters, digits, '-', '_' and '.'"
    )]
    Cluster(String),
    /// An empty endpoint.
    #[error("--etcd-endpoints contains an empty endpoint")]
    Endpoint,
    /// An endpoint or advertised address that is not `host:port` or a URL.
    #[error(transparent)]
    Address(#[from] crate::check::AddressError),
    /// A client certificate without its key, or the other way round.
    #[error("--etcd-cert and --etcd-key go together")]
    CertWithoutKey,
    /// A client certificate without the CA to check etcd with.
    #[error("--etcd-cert needs --etcd-cacert (mutual TLS to etcd)")]
    IdentityWithoutCa,
    /// A plaintext endpoint while TLS is configured.
    #[error("--etcd-endpoints {0:?} is http:// but --etcd-cacert asks for TLS: use https:// or host:port")]
    PlainWithTls(String),
    /// A TLS endpoint without a CA to check it with.
    #[error("--etcd-endpoints {0:?} is https:// and needs --etcd-cacert")]
    TlsWithoutCa(String),
}

/// The kinds of registration, each a key prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemberKind {
    /// `executors/<id>`.
    Executor,
    /// `kv/<node>`.
    KvAgent,
}

impl MemberKind {
    fn segment(self) -> &'static str {
        match self {
            MemberKind::Executor => "executors",
            MemberKind::KvAgent => "kv",
        }
    }
}

impl ClusterArgs {
    /// Whether etcd is configured.
    pub fn enabled(&self) -> bool {
        !self.etcd_endpoints.is_empty()
    }

    /// Checks what clap's types cannot.
    pub fn validate(&self) -> Result<(), ClusterArgsError> {
        if !(2..=3600).contains(&self.lease_ttl) {
            return Err(ClusterArgsError::LeaseTtl(self.lease_ttl));
        }
        let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if self.cluster.is_empty() || !self.cluster.chars().all(ok) {
            return Err(ClusterArgsError::Cluster(self.cluster.clone()));
        }
        if self.etcd_cert.is_some() != self.etcd_key.is_some() {
            return Err(ClusterArgsError::CertWithoutKey);
        }
        if self.etcd_cert.is_some() && self.etcd_cacert.is_none() {
            return Err(ClusterArgsError::IdentityWithoutCa);
        }
        let tls = self.etcd_cacert.is_some();
        for e in self.etcd_endpoints.iter().map(|e| e.trim()) {
            if e.is_empty() {
                return Err(ClusterArgsError::Endpoint);
            }
            crate::check::dial_address("etcd-endpoints", e)?;
            if tls && e.starts_with("http://") {
                return Err(ClusterArgsError::PlainWithTls(e.to_string()));
            }
            if !tls && e.starts_with("https://") {
                return Err(ClusterArgsError::TlsWithoutCa(e.to_string()));
            }
        }
        if let Some(a) = &self.advertise_address {
            crate::check::dial_address("advertise-address", a)?;
        }
        Ok(())
    }

    /// The key prefix of a kind, ending in `/`.
    pub fn prefix(&self, kind: MemberKind) -> String {
        format!("/ferry/{}/{}/", self.cluster, kind.segment())
    }

    /// Where the scheduler elected at `epoch` publishes its leadership token (under its
    /// election lease), for executors to check handshakes against.
    pub fn leadership_key(&self, epoch: u64) -> String {
        format!("/ferry/{}/leadership/{epoch}", self.cluster)
    }

    /// The address to advertise for a service bound to `bound`.
    pub fn advertised(&self, bound: std::net::SocketAddr) -> String {
        match &self.advertise_address {
            Some(a) if a.contains("://") => a.clone(),
            Some(a) => format!("http://{a}"),
            None => format!("http://{bound}"),
        }
    }

    /// Registers `id` of `kind` at this service's advertised address (for a service bound to
    /// `bound`); `None` without etcd.
    pub async fn register(
        &self,
        kind: MemberKind,
        id: &str,
        bound: std::net::SocketAddr,
    ) -> Result<Option<Registration>, etcd_client::Error> {
        if !self.enabled() {
            return Ok(None);
        }
        self.client().await?; // the flags make a client (certificates read, endpoints parsed)
        let key = format!("{}{id}", self.prefix(kind));
        let value = MemberInfo { address: self.advertised(bound) }.to_value();
        Ok(Some(Registration::spawn(self.clone(), key, value)))
    }

    /// The lease TTL.
    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl)
    }

    /// An etcd client over the endpoints. Channels connect lazily, so this succeeds while etcd
    /// is down; calls then fail until it is up.
    ///
    /// With `--etcd-cacert` the certificates are read here, on every call: a client built after
    /// they were renewed uses the new ones.
    pub async fn client(&self) -> Result<Client, etcd_client::Error> {
        self.client_of(&self.etcd_endpoints).await
    }

    /// A client of member `i` alone (of the endpoints, counted round).
    async fn member_client(&self, i: usize) -> Result<Client, etcd_client::Error> {
        let n = self.etcd_endpoints.len().max(1);
        self.client_of(&self.etcd_endpoints[i % n..=i % n]).await
    }

    async fn client_of(&self, endpoints: &[String]) -> Result<Client, etcd_client::Error> {
        let tls = self.etcd_tls()?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        let endpoints: Vec<String> = endpoints
            .iter()
            .map(|e| if e.contains("://") { e.clone() } else { format!("{scheme}://{e}") })
            .collect();
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(3))
            .with_keep_alive(Duration::from_secs(1), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        if let Some(tls) = tls {
            options = options.with_tls(tls);
        }
        Client::connect(endpoints, Some(options)).await
    }

    /// The TLS settings `--etcd-cacert`, `--etcd-cert` and `--etcd-key` give (`None`: plaintext).
    fn etcd_tls(&self) -> Result<Option<etcd_client::TlsOptions>, etcd_client::Error> {
        let Some(ca) = &self.etcd_cacert else { return Ok(None) };
        let read = |flag: &str, path: &std::path::Path| {
            std::fs::read(path).map_err(|e| {
                etcd_client::Error::InvalidArgs(format!("--{flag} {}: {e}", path.display()))
            })
        };
        let mut tls = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(read("etcd-cacert", ca)?));
        if let (Some(cert), Some(key)) = (&self.etcd_cert, &self.etcd_key) {
            tls = tls.identity(etcd_client::Identity::from_pem(
                read("etcd-cert", cert)?,
                read("etcd-key", key)?,
            ));
        }
        Ok(Some(tls))
    }
}

impl ClusterArgs {
    /// [`ClusterArgs::client`], retried every second until it can be built (a bad endpoint
    /// is logged each time rather than ending the caller's loop).
    pub async fn client_patiently(&self) -> Client {
        let mut backoff = etcd_backoff();
        loop {
            match self.client().await {
                Ok(c) => return c,
                Err(e) => {
                    tracing::warn!(error = %e, "etcd client: retrying");
                    backoff.wait().await;
                }
            }
        }
    }
}

/// How calls to etcd are retried: 100 ms doubling to 2 s, for ever.
pub fn etcd_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(100), Duration::from_secs(2))
}

/// Whether etcd's error says a lease does not exist (any more): it expired or was revoked.
/// (etcd-client reports it as an error, on a call or on a keep-alive stream, not as a TTL of 0.)
pub fn lease_gone(e: &etcd_client::Error) -> bool {
    e.to_string().contains("lease not found")
}

/// A client for calls that keep a lease alive, which cannot afford a dead member: it starts
/// balanced over every member and, after each failure ([`Self::failed`]), talks to the next
/// member alone. A balanced client keeps sending some calls to a dead member, and a channel
/// whose members all died can take seconds to connect again once etcd is back — longer than
/// a lease outlives an etcd restart.
#[derive(Clone)]
pub struct LeaseClient {
    cluster: ClusterArgs,
    member: usize,
    /// The client to call now.
    pub client: Client,
}

impl LeaseClient {
    /// Balanced over every member of `cluster`'s etcd (retrying until the flags make one).
    pub async fn new(cluster: ClusterArgs) -> Self {
        let client = cluster.client_patiently().await;
        Self { cluster, member: 0, client }
    }

    /// A call failed: talk to the next member from now on.
    pub async fn failed(&mut self) {
        self.member += 1;
        match self.cluster.member_client(self.member).await {
            Ok(c) => self.client = c,
            Err(e) => tracing::warn!(error = %e, "etcd client"),
        }
    }
}

/// Whether a registration is in etcd now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseState {
    /// Not (yet, or no longer) registered: etcd unreachable or the lease lapsed.
    Lost,
    /// Registered and kept alive.
    Held,
}

/// A key kept in etcd under a lease for as long as this lives; dropping it (or
/// [`Registration::withdraw`]) revokes the lease, which deletes the key at once.
pub struct Registration {
    stop: watch::Sender<bool>,
    state: watch::Receiver<LeaseState>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Registration {
    /// Starts keeping `key = value` in `cluster`'s etcd under a lease of its TTL.
    pub fn spawn(cluster: ClusterArgs, key: String, value: String) -> Self {
        let (stop, stop_rx) = watch::channel(false);
        let (state_tx, state) = watch::channel(LeaseState::Lost);
        let task = tokio::spawn(keep_registered(cluster, key, value, stop_rx, state_tx));
        Registration { stop, state, task: Some(task) }
    }

    /// Whether the key is in etcd now.
    pub fn state(&self) -> LeaseState {
        *self.state.borrow()
    }

    /// Waits until the key is in etcd.
    pub async fn held(&mut self) {
        let _ = self.state.wait_for(|s| *s == LeaseState::Held).await;
    }

    /// Removes the key now (revoking the lease) and stops keeping it.
    pub async fn withdraw(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn keep_registered(
    cluster: ClusterArgs,
    key: String,
    value: String,
    mut stop: watch::Receiver<bool>,
    state: watch::Sender<LeaseState>,
) {
    let ttl = cluster.ttl();
    let mut etcd = LeaseClient::new(cluster).await;
    let mut failed = false;
    let mut backoff = etcd_backoff();
    let ttl_secs = ttl.as_secs().max(1) as i64;
    // The lease held, kept across etcd outages: etcd extends its leases when it restarts or
    // elects a new raft leader, so the same lease (and key) usually survives an outage of any
    // length, and nobody watching sees the member leave and come back.
    let mut lease = None;
    // Refreshes of a lease that may live are retried often enough to beat its expiry.
    let mut retry =
        Backoff::new(Duration::from_millis(100), (ttl / 3).max(Duration::from_millis(100)));
    loop {
        if *stop.borrow() {
            return;
        }
        if std::mem::take(&mut failed) {
            etcd.failed().await;
        }
        let client = &mut etcd.client;
        let id = match lease {
            Some(id) => id,
            None => match client.lease_grant(ttl_secs, None).await {
                Ok(r) => r.id(),
                Err(e) => {
                    tracing::debug!(%key, error = %e, "etcd: lease grant failed; retrying");
                    failed = true;
                    tokio::select! { _ = backoff.wait() => continue, _ = stop.changed() => return }
                }
            },
        };
        lease = Some(id);
        // Put (again, after an outage: idempotent) so the key is there under this lease.
        let put = client.put(key.clone(), value.clone(), Some(PutOptions::new().with_lease(id)));
        if let Err(e) = put.await {
            tracing::debug!(%key, error = %e, "etcd: registration failed; retrying");
            if lease_gone(&e) {
                lease = None;
            } else {
                failed = true;
            }
            // A lease that may live is asked about again soon enough to beat its expiry.
            let wait = if lease.is_some() { &mut retry } else { &mut backoff };
            tokio::select! { _ = wait.wait() => continue, _ = stop.changed() => return }
        }
        let kept = keep_alive(client, id, ttl, &mut stop, &state).await;
        if state.send_replace(LeaseState::Lost) == LeaseState::Held {
            retry.reset();
        }
        match kept {
            KeepAlive::Stopped => {
                let revoke = client.lease_revoke(id);
                let _ = tokio::time::timeout(Duration::from_secs(1), revoke).await;
                return;
            }
            KeepAlive::Expired => {
                tracing::warn!(%key, "etcd says the registration's lease expired; registering again");
                lease = None;
                backoff.reset();
            }
            KeepAlive::Broken(why) => {
                failed = true;
                tracing::warn!(%key, reason = %why, "etcd unreachable; keeping the registration's lease");
                tokio::select! { _ = retry.wait() => {}, _ = stop.changed() => return }
            }
        }
    }
}

enum KeepAlive {
    Stopped,
    /// etcd says the lease is gone.
    Expired,
    /// etcd could not be asked.
    Broken(String),
}

/// Refreshes `lease` every third of its TTL until told to stop, etcd says it expired, or etcd
/// cannot be asked.
async fn keep_alive(
    client: &mut Client,
    lease: i64,
    ttl: Duration,
    stop: &mut watch::Receiver<bool>,
    state: &watch::Sender<LeaseState>,
) -> KeepAlive {
    let (mut keeper, mut responses) = match client.lease_keep_alive(lease).await {
        Ok(k) => k,
        Err(e) if lease_gone(&e) => return KeepAlive::Expired,
        Err(e) => return KeepAlive::Broken(format!("keep-alive stream: {e}")),
    };
    let period = ttl / 3;
    let mut first = true;
    loop {
        if !first {
            tokio::select! {
                _ = stop.changed() => return KeepAlive::Stopped,
                () = tokio::time::sleep(period) => {}
            }
        }
        // Bounded: a send on a stream whose connection died may never return.
        match tokio::time::timeout(period, keeper.keep_alive()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return KeepAlive::Broken(format!("keep-alive: {e}")),
            Err(_) => return KeepAlive::Broken("keep-alive request timed out".into()),
        }
        match tokio::time::timeout(period, responses.message()).await {
            Ok(Ok(Some(r))) if r.ttl() > 0 => {}
            Ok(Ok(Some(_))) => return KeepAlive::Expired,
            Ok(Err(e)) if lease_gone(&e) => return KeepAlive::Expired,
            Ok(Ok(None)) => return KeepAlive::Broken("keep-alive stream closed".into()),
            Ok(Err(e)) => return KeepAlive::Broken(format!("keep-alive: {e}")),
            Err(_) => return KeepAlive::Broken("keep-alive timed out".into()),
        }
        if first {
            // Held once etcd has said the lease lives (after the put).
            state.send_replace(LeaseState::Held);
            first = false;
        }
    }
}

/// A change in the members under a prefix. Keys are given without the prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MembershipEvent {
    /// Everything there is now (after a (re)connection): members not listed are gone.
    Snapshot(Vec<(String, String)>),
    /// A member appeared or changed its value.
    Put(String, String),
    /// A member's key was deleted (it withdrew or its lease lapsed).
    Delete(String),
}

/// Watches the members under `prefix`. The first event is a snapshot; after any etcd failure,
/// once etcd answers again, another snapshot follows. While etcd is unreachable nothing is
/// sent: the caller keeps what it last saw. Ends when the receiver is dropped.
pub fn watch_members(client: Client, prefix: String) -> mpsc::Receiver<MembershipEvent> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(watch_loop(client, prefix, tx));
    rx
}

async fn watch_loop(mut client: Client, prefix: String, tx: mpsc::Sender<MembershipEvent>) {
    let mut backoff = etcd_backoff();
    let strip = |k: &[u8]| String::from_utf8_lossy(&k[prefix.len().min(k.len())..]).into_owned();
    loop {
        if tx.is_closed() {
            return;
        }
        let listed = client.get(prefix.clone(), Some(GetOptions::new().with_prefix())).await;
        let (members, revision) = match listed {
            Ok(r) => {
                let members = r
                    .kvs()
                    .iter()
                    .map(|kv| (strip(kv.key()), String::from_utf8_lossy(kv.value()).into_owned()))
                    .collect::<Vec<_>>();
                (members, r.header().map_or(0, etcd_client::ResponseHeader::revision))
            }
            Err(e) => {
                tracing::debug!(%prefix, error = %e, "etcd: listing members failed; retrying");
                backoff.wait().await;
                continue;
            }
        };
        if tx.send(MembershipEvent::Snapshot(members)).await.is_err() {
            return;
        }
        let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let mut stream = match client.watch(prefix.clone(), Some(options)).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(%prefix, error = %e, "etcd: watch failed; retrying");
                backoff.wait().await;
                continue;
            }
        };
        backoff.reset();
        loop {
            let msg = tokio::select! {
                msg = stream.message() => msg,
                () = tx.closed() => return,
            };
            let resp = match msg {
                Ok(Some(resp)) => resp,
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(%prefix, error = %e, "etcd: watch broke; listing again");
                    break;
                }
            };
            if resp.canceled() || resp.compact_revision() > 0 {
                break;
            }
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                let key = strip(kv.key());
                let event = match ev.event_type() {
                    EventType::Put => {
                        MembershipEvent::Put(key, String::from_utf8_lossy(kv.value()).into_owned())
                    }
                    EventType::Delete => MembershipEvent::Delete(key),
                };
                if tx.send(event).await.is_err() {
                    return;
                }
            }
        }
        backoff.wait().await;
    }
}

/// `ferry_etcd_registered`: whether this service's key is in etcd under a live lease.
struct LeaseMetric(watch::Receiver<LeaseState>);

impl crate::metrics::Render for LeaseMetric {
    fn render(&self, out: &mut crate::metrics::Text) {
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

/// Serves `host` on `ports` until `shutdown`, registered in etcd as `kind`/`id` while it
/// serves when `cluster` configures etcd. On shutdown it drains ([`crate::shutdown`]): health
/// says `NOT_SERVING`, the registration is withdrawn (others stop sending work here and move
/// what they had), then the host stops and waits for its calls in flight — all within
/// `drain`.
pub async fn serve_registered(
    host: crate::GrpcHost,
    ports: impl Into<crate::grpc::Ports>,
    (cluster, kind, id): (Option<&ClusterArgs>, MemberKind, &str),
    shutdown: impl std::future::Future<Output = ()> + Send,
    drain: Duration,
) -> Result<(), RegisteredServeError> {
    let ports = ports.into();
    let bound = ports.grpc.local_addr().map_err(crate::HostError::Io)?;
    let registration = match cluster {
        Some(c) => c.register(kind, id, bound).await?,
        None => None,
    };
    let host = match &registration {
        Some(r) => host.with_metrics(std::sync::Arc::new(LeaseMetric(r.state.clone()))),
        None => host,
    };
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let health = host.health_switch();
    let serving = host.serve(ports, async move {
        let _ = stop_rx.wait_for(|s| *s).await;
    });
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{ClusterArgs, ClusterArgsError};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        cluster: ClusterArgs,
    }

    fn validate(args: &[&str]) -> Result<(), ClusterArgsError> {
        Cli::parse_from(std::iter::once("x").chain(args.iter().copied())).cluster.validate()
    }

    #[test]
    fn tls_flags_go_together_and_match_the_endpoints() {
        let tls = ["--etcd-cacert", "ca.pem", "--etcd-cert", "c.pem", "--etcd-key", "k.pem"];
        let with = |endpoints: &str| {
            let mut args = vec!["--etcd-endpoints", endpoints];
            args.extend(tls);
            validate(&args)
        };
        assert!(with("https://etcd-0.etcd:2379,etcd-1.etcd:2379").is_ok());
        assert!(matches!(with("http://etcd:2379"), Err(ClusterArgsError::PlainWithTls(_))));
        assert!(validate(&["--etcd-endpoints", "etcd:2379", "--etcd-cacert", "ca.pem"]).is_ok());
        assert!(matches!(
            validate(&["--etcd-endpoints", "https://etcd:2379"]),
            Err(ClusterArgsError::TlsWithoutCa(_))
        ));
        assert!(matches!(
            validate(&["--etcd-cacert", "ca.pem", "--etcd-cert", "c.pem"]),
            Err(ClusterArgsError::CertWithoutKey)
        ));
        assert!(matches!(
            validate(&["--etcd-cert", "c.pem", "--etcd-key", "k.pem"]),
            Err(ClusterArgsError::IdentityWithoutCa)
        ));
    }

    #[tokio::test]
    async fn a_missing_certificate_is_named() {
        let cli = Cli::parse_from(["x", "--etcd-endpoints", "etcd:2379", "--etcd-cacert", "/nope"]);
        let err = cli.cluster.client().await.err().expect("no CA file").to_string();
        assert!(err.contains("--etcd-cacert /nope"), "{err}");
    }
}
