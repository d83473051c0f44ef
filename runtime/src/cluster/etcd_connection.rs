//! The etcd client the flags make (endpoints, TLS to etcd), and how calls to etcd are retried:
//! with backoff, for ever, since etcd comes and goes. A client connects lazily, so building one
//! succeeds while etcd is down.

use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use super::ClusterArgs;
use crate::backoff::Backoff;

impl ClusterArgs {
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

    pub(super) async fn client_of(
        &self,
        endpoints: &[String],
    ) -> Result<Client, etcd_client::Error> {
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
