//! Cluster membership through etcd (DESIGN.md §7): a service registers itself under
//! `/ferry/<cluster>/<kind>/<id>` with a lease it keeps alive, and a scheduler watches a kind's
//! prefix to learn who is there.
//!
//! Why these loops never give up: etcd is a dependency that comes and goes (a restart, a dead
//! member behind a round-robin endpoint list). A failed call is retried with backoff; while etcd
//! is unreachable the watcher reports nothing, so the caller keeps the membership it last saw,
//! and the registration re-creates its lease and key as soon as etcd answers again. Nothing
//! here panics or returns on an etcd error, and nothing blocks a caller on etcd.
//!
//! The parts: the flags and their checks (here), the key layout (`key_layout`), the etcd
//! client and how calls to it are retried (`etcd_connection`), a registration and the task that
//! keeps its lease alive (`registration`), the watch of a kind's members (`membership_watch`),
//! and serving while registered, with the drain that withdraws first (`registered_serve`).

use std::time::Duration;

mod etcd_connection;
pub mod etcd_member;
mod key_layout;
mod membership_watch;
mod registered_serve;
mod registration;

pub use etcd_connection::{etcd_backoff, lease_gone, LeaseClient};
pub use key_layout::{candidate_pool, MemberInfo, MemberKind, DEFAULT_POOL};
pub use membership_watch::{watch_members, MembershipEvent};
pub use registered_serve::{serve_registered, RegisteredServeError};
pub use registration::{LeaseState, Registration};

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
    Address(#[from] crate::address::AddressError),
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
            crate::address::dial_address("etcd-endpoints", e)?;
            if tls && e.starts_with("http://") {
                return Err(ClusterArgsError::PlainWithTls(e.to_string()));
            }
            if !tls && e.starts_with("https://") {
                return Err(ClusterArgsError::TlsWithoutCa(e.to_string()));
            }
        }
        if let Some(a) = &self.advertise_address {
            crate::address::dial_address("advertise-address", a)?;
        }
        Ok(())
    }

    /// The lease TTL.
    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl)
    }
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
