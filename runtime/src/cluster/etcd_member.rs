//! `ferry-scheduler etcd-member`: how a bundled etcd member starts, decided before it starts
//! (the chart runs it as the member pod's init container; etcd's own image has no shell to
//! decide with).
//!
//! etcd's `--initial-cluster-state` must be `new` only while the cluster is first formed; a
//! member that joins a running cluster (a scale from 3 to 5 members, or a member whose volume
//! was lost and replaced) must be added through the membership API first and then start with
//! `existing` and the cluster's current members. So: with data in its `--data-dir`, the member
//! restarts as it was (etcd ignores the initial-cluster flags then); without, the helper asks
//! the other members whether a cluster with a leader is up. If none is, the cluster is being
//! formed: `new`, as the flags say. If one is, the member joins it: a member of the same peer
//! URL that has started before (its data is gone) is removed, the member is added (unless it is
//! listed and has never started, as a late member of the first bootstrap is), and it starts
//! with `existing`.
//!
//! The etcd flags are given after `--`, as the member would take them; the helper writes them
//! as etcd's configuration file (`--config-file`: etcd then reads nothing else), with the
//! initial-cluster state and members it decided.

use std::path::PathBuf;
use std::time::Duration;

use super::ClusterArgs;

/// The flags of `etcd-member`.
#[derive(Clone, Debug, clap::Args)]
pub struct EtcdMemberArgs {
    /// Where to write etcd's configuration file (YAML).
    #[arg(long)]
    pub config_out: PathBuf,
    /// How long to look for a running cluster before concluding it is being formed.
    #[arg(long, default_value_t = 10)]
    pub probe_seconds: u64,
    /// How long to keep trying to join a running cluster (etcd refuses a new member while a
    /// member is unhealthy or just started) before giving up.
    #[arg(long, default_value_t = 180)]
    pub join_seconds: u64,
    /// The member's etcd flags (`--name=…`, `--data-dir=…`, `--initial-cluster=…`, …).
    #[arg(last = true, required = true)]
    pub etcd: Vec<String>,
}

impl EtcdMemberArgs {
    /// Checks the etcd flags: the ones the helper needs are there, and each can be written to
    /// etcd's configuration file.
    pub fn validate(&self) -> Result<(), EtcdMemberError> {
        for needed in NEEDED {
            flag(&self.etcd, needed).ok_or(EtcdMemberError::Missing(needed))?;
        }
        config_file(&self.etcd, "new", "").map(drop)
    }
}

/// The etcd flags the helper reads.
const NEEDED: [&str; 4] = ["name", "data-dir", "initial-advertise-peer-urls", "initial-cluster"];

/// A member as the membership API lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The member's id.
    pub id: u64,
    /// Its name: empty until it has started.
    pub name: String,
    /// Its peer URLs.
    pub peer_urls: Vec<String>,
}

/// How the member starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Its data dir holds a member: it restarts as that member.
    Restart,
    /// No cluster is up: it forms one with the others, as its flags say.
    Form,
    /// A cluster is up: it joins it, after removing the member it was (`remove`) and adding
    /// itself (`add`).
    Join {
        /// The id of a member with its peer URL that has started before.
        remove: Option<u64>,
        /// Whether to add it (false: listed and never started).
        add: bool,
    },
}

/// Decides the plan from what is known: whether the data dir holds a member, and the running
/// cluster's members (`None`: no cluster with a leader answered).
pub fn plan(has_data: bool, cluster: Option<&[Member]>, peer_url: &str) -> Plan {
    if has_data {
        return Plan::Restart;
    }
    let Some(members) = cluster else { return Plan::Form };
    let (remove, add) = join_steps(members, peer_url);
    Plan::Join { remove, add }
}

/// What joining `members` takes: the id of a member of this peer URL to remove (it started
/// before, and its data is gone), and whether to add this one (not if listed, never started).
fn join_steps(members: &[Member], peer_url: &str) -> (Option<u64>, bool) {
    match members.iter().find(|m| m.peer_urls.iter().any(|u| u == peer_url)) {
        Some(m) if m.name.is_empty() => (None, false),
        Some(m) => (Some(m.id), true),
        None => (None, true),
    }
}

/// The value of etcd flag `--{name}` in `flags`.
fn flag<'a>(flags: &'a [String], name: &str) -> Option<&'a str> {
    let prefix = format!("--{name}=");
    flags.iter().find_map(|f| f.strip_prefix(prefix.as_str()))
}

/// Why the helper could not decide or write the configuration.
#[derive(Debug, thiserror::Error)]
pub enum EtcdMemberError {
    /// A flag the helper needs is missing.
    #[error("etcd-member: the etcd flags after -- need --{0}=…")]
    Missing(&'static str),
    /// A flag it cannot put in etcd's configuration file.
    #[error("etcd-member: etcd flag {0:?} is not one it can write to a configuration file")]
    Unknown(String),
    /// etcd refused a membership change.
    #[error("etcd-member: {0}: {1}")]
    Etcd(&'static str, etcd_client::Error),
    /// The cluster has members that started before and no leader.
    #[error(
        "etcd-member: the other members have no leader but have run before (quorum lost): not \
         forming a new cluster; this member joins once a quorum is back"
    )]
    NoQuorum,
    /// Writing the file failed.
    #[error("etcd-member: writing {0}: {1}")]
    Write(PathBuf, std::io::Error),
}

/// etcd's configuration file for `flags`, with the initial-cluster state and members set:
/// each `--key=value` becomes `key: value`, the TLS flags go under `client-transport-security`
/// and `peer-transport-security` as etcd's file names them, and a flag without a value is
/// `true`.
pub fn config_file(
    flags: &[String],
    state: &str,
    cluster: &str,
) -> Result<String, EtcdMemberError> {
    const PLAIN: [&str; 12] = [
        "enable-grpc-gateway",
        "name",
        "data-dir",
        "listen-client-urls",
        "advertise-client-urls",
        "listen-peer-urls",
        "initial-advertise-peer-urls",
        "initial-cluster-token",
        "listen-metrics-urls",
        "heartbeat-interval",
        "election-timeout",
        "quota-backend-bytes",
    ];
    const NUMERIC: [&str; 3] = ["heartbeat-interval", "election-timeout", "quota-backend-bytes"];
    const TLS: [&str; 4] = ["cert-file", "key-file", "trusted-ca-file", "client-cert-auth"];
    let quote = |v: &str| format!("{v:?}");
    let (mut top, mut client, mut peer) = (Vec::new(), Vec::new(), Vec::new());
    for f in flags {
        let body = f.strip_prefix("--").ok_or_else(|| EtcdMemberError::Unknown(f.clone()))?;
        let (key, value) = body.split_once('=').unwrap_or((body, "true"));
        let value = if value == "true" || value == "false" || NUMERIC.contains(&key) {
            value.to_string()
        } else {
            quote(value)
        };
        if key == "initial-cluster" || key == "initial-cluster-state" {
            continue; // decided here
        }
        if PLAIN.contains(&key) {
            top.push(format!("{key}: {value}"));
        } else if let Some(k) = key.strip_prefix("peer-").filter(|k| TLS.contains(k)) {
            peer.push(format!("  {k}: {value}"));
        } else if TLS.contains(&key) {
            client.push(format!("  {key}: {value}"));
        } else {
            return Err(EtcdMemberError::Unknown(f.clone()));
        }
    }
    // A flag's default that etcd does not apply when it reads a file (its JSON gateway, which
    // tools such as curl-based probes use, would be off).
    if !flags.iter().any(|f| f.starts_with("--enable-grpc-gateway")) {
        top.push("enable-grpc-gateway: true".into());
    }
    top.push(format!("initial-cluster: {}", quote(cluster)));
    top.push(format!("initial-cluster-state: {}", quote(state)));
    for (section, lines) in
        [("client-transport-security", client), ("peer-transport-security", peer)]
    {
        if !lines.is_empty() {
            top.push(format!("{section}:"));
            top.extend(lines);
        }
    }
    Ok(top.join("\n") + "\n")
}

/// `--initial-cluster` for a member joining `members` (its own entry named `name`; members
/// that have not started yet are named by their peer URL's host's first label, the pod name).
pub fn joining_cluster(members: &[Member], name: &str, peer_url: &str) -> String {
    let mut entries: Vec<String> = Vec::new();
    for m in members {
        for url in &m.peer_urls {
            let who = if url == peer_url {
                name.to_string()
            } else if m.name.is_empty() {
                let host = url.split("://").nth(1).unwrap_or(url);
                host.split(['.', ':']).next().unwrap_or(host).to_string()
            } else {
                m.name.clone()
            };
            entries.push(format!("{who}={url}"));
        }
    }
    if !members.iter().any(|m| m.peer_urls.iter().any(|u| u == peer_url)) {
        entries.push(format!("{name}={peer_url}"));
    }
    entries.join(",")
}

/// Runs the helper: decides, changes the membership when joining, writes the file.
pub async fn run(args: &EtcdMemberArgs, cluster: &ClusterArgs) -> Result<Plan, EtcdMemberError> {
    let flags = &args.etcd;
    let name = flag(flags, "name").ok_or(EtcdMemberError::Missing("name"))?;
    let data_dir = flag(flags, "data-dir").ok_or(EtcdMemberError::Missing("data-dir"))?;
    let peer_url = flag(flags, "initial-advertise-peer-urls")
        .ok_or(EtcdMemberError::Missing("initial-advertise-peer-urls"))?;
    let initial =
        flag(flags, "initial-cluster").ok_or(EtcdMemberError::Missing("initial-cluster"))?;
    let has_data = std::path::Path::new(data_dir).join("member").is_dir();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.join_seconds);
    let (decided, state, initial_cluster) = loop {
        let probe =
            if has_data { Probe::Nothing } else { running_cluster(args, cluster, name).await };
        let result = match probe {
            Probe::Nothing => {
                let decided = plan(has_data, None, peer_url);
                break (decided, "new", initial.to_string());
            }
            Probe::NoQuorum => Err(EtcdMemberError::NoQuorum),
            Probe::Running(mut client) => join(&mut client, peer_url).await,
        };
        match result {
            Ok((decided, members)) => {
                break (decided, "existing", joining_cluster(&members, name, peer_url));
            }
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::warn!(error = %e, "joining the running cluster: retrying");
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Err(e) => return Err(e),
        }
    };
    tracing::info!(plan = ?decided, state, initial_cluster, "etcd member configured");
    let text = config_file(flags, state, &initial_cluster)?;
    std::fs::write(&args.config_out, text)
        .map_err(|e| EtcdMemberError::Write(args.config_out.clone(), e))?;
    Ok(decided)
}

/// The key whose lock serialises joins: a member is added only once every member added before
/// it has started, so the members it is told of are the cluster's (etcd refuses to start a
/// joining member whose `--initial-cluster` differs from the cluster's members).
const JOIN_LOCK: &str = "/ferry-etcd-member/join";
/// How long a join waits for another member that was added to start.
const WAIT_FOR_OTHERS: Duration = Duration::from_mins(2);
/// The lock's lease, in seconds: longer than [`WAIT_FOR_OTHERS`] (nothing keeps it alive
/// meanwhile); revoked when the join ends, it frees the lock by itself if the helper dies.
const LOCK_TTL_SECONDS: i64 = 180;

/// Joins the running cluster under [`JOIN_LOCK`]: waits until no other member is added and
/// unstarted, removes the member this one was if it had started, adds it; returns the plan and
/// the cluster's members (this one included).
async fn join(
    client: &mut etcd_client::Client,
    peer_url: &str,
) -> Result<(Plan, Vec<Member>), EtcdMemberError> {
    let etcd = |what| move |e| EtcdMemberError::Etcd(what, e);
    let lease = client.lease_grant(LOCK_TTL_SECONDS, None).await.map_err(etcd("taking a lease"))?;
    let lease = lease.id();
    let locked = client
        .lock(JOIN_LOCK, Some(etcd_client::LockOptions::new().with_lease(lease)))
        .await
        .map_err(etcd("taking the join lock"));
    let result = match locked {
        Ok(_) => join_locked(client, peer_url).await,
        Err(e) => Err(e),
    };
    // Revoking the lease releases the lock (it also expires with the lease if this fails).
    let _ = client.lease_revoke(lease).await;
    result
}

async fn join_locked(
    client: &mut etcd_client::Client,
    peer_url: &str,
) -> Result<(Plan, Vec<Member>), EtcdMemberError> {
    let etcd = |what| move |e| EtcdMemberError::Etcd(what, e);
    let waiting_since = tokio::time::Instant::now();
    let members = loop {
        let members = list_members(client).await?;
        let other_unstarted = members
            .iter()
            .filter(|m| m.name.is_empty() && !m.peer_urls.iter().any(|u| u == peer_url))
            .count();
        if other_unstarted == 0 || waiting_since.elapsed() > WAIT_FOR_OTHERS {
            if other_unstarted > 0 {
                tracing::warn!(other_unstarted, "members added earlier never started; joining");
            }
            break members;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let (remove, add) = join_steps(&members, peer_url);
    if let Some(id) = remove {
        client.member_remove(id).await.map_err(etcd("removing the lost member"))?;
        tracing::info!(
            id = format!("{id:x}"),
            "removed the member this one was (its data is gone)"
        );
    }
    if add {
        client.member_add([peer_url], None).await.map_err(etcd("adding the member"))?;
        tracing::info!(peer_url, "added this member to the running cluster");
    }
    Ok((Plan::Join { remove, add }, list_members(client).await?))
}

async fn list_members(client: &mut etcd_client::Client) -> Result<Vec<Member>, EtcdMemberError> {
    let list =
        client.member_list().await.map_err(|e| EtcdMemberError::Etcd("listing the members", e))?;
    Ok(list
        .members()
        .iter()
        .map(|m| Member {
            id: m.id(),
            name: m.name().to_string(),
            peer_urls: m.peer_urls().to_vec(),
        })
        .collect())
}

/// What the other members answer.
enum Probe {
    /// A member that reports a leader: a client of it.
    Running(Box<etcd_client::Client>),
    /// No leader, but members that have started before (they have names, which a member gets
    /// only once a quorum has accepted it): a cluster that lost its quorum, not one being
    /// formed. Forming a new one here would be refused by its peers at best.
    NoQuorum,
    /// Nobody, or members that never started: the cluster is being formed.
    Nothing,
}

/// Asks every endpoint but this member's own, for up to `--probe-seconds`, whether a cluster
/// runs (see [`Probe`]).
async fn running_cluster(args: &EtcdMemberArgs, cluster: &ClusterArgs, name: &str) -> Probe {
    let others: Vec<String> =
        cluster.etcd_endpoints.iter().filter(|e| !endpoint_names(e, name)).cloned().collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.probe_seconds);
    let mut formed_before = false;
    while !others.is_empty() && tokio::time::Instant::now() < deadline {
        for endpoint in &others {
            let Ok(mut client) = cluster.client_of(std::slice::from_ref(endpoint)).await else {
                continue;
            };
            let Ok(status) = client.status().await else { continue };
            if status.leader() != 0 {
                return Probe::Running(Box::new(client));
            }
            // Without a leader a member still lists the members it knows, from its own state.
            if let Ok(members) = list_members(&mut client).await {
                formed_before |= members.iter().any(|m| !m.name.is_empty() && m.name != name);
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    if formed_before {
        Probe::NoQuorum
    } else {
        Probe::Nothing
    }
}

/// Whether `endpoint` is member `name`'s own (its host is the pod name, or starts with it and
/// a dot).
fn endpoint_names(endpoint: &str, name: &str) -> bool {
    let host = endpoint.split("://").last().unwrap_or(endpoint);
    let host = host.split(':').next().unwrap_or(host);
    host == name || host.starts_with(&format!("{name}."))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: u64, name: &str, url: &str) -> Member {
        Member { id, name: name.into(), peer_urls: vec![url.into()] }
    }

    const ME: &str = "http://etcd-1.etcd:2380";

    #[test]
    fn a_member_with_data_restarts_and_one_without_forms_or_joins() {
        let running = [member(1, "etcd-0", "http://etcd-0.etcd:2380"), member(2, "etcd-1", ME)];
        assert_eq!(plan(true, Some(&running), ME), Plan::Restart);
        assert_eq!(plan(false, None, ME), Plan::Form);
        // Its volume was lost: the member it was is removed and it is added again.
        assert_eq!(plan(false, Some(&running), ME), Plan::Join { remove: Some(2), add: true });
        // Listed but never started (late in the first bootstrap): joins as listed.
        let late = [member(1, "etcd-0", "http://etcd-0.etcd:2380"), member(2, "", ME)];
        assert_eq!(plan(false, Some(&late), ME), Plan::Join { remove: None, add: false });
        // A new member of a scale-up.
        assert_eq!(plan(false, Some(&running[..1]), ME), Plan::Join { remove: None, add: true });
    }

    #[test]
    fn a_joining_member_lists_the_running_members_and_itself() {
        let members = [
            member(1, "etcd-0", "http://etcd-0.etcd:2380"),
            member(3, "", "http://etcd-2.etcd:2380"),
        ];
        assert_eq!(
            joining_cluster(&members, "etcd-1", ME),
            "etcd-0=http://etcd-0.etcd:2380,etcd-2=http://etcd-2.etcd:2380,etcd-1=http://etcd-1.etcd:2380"
        );
        let with_me = [member(1, "etcd-0", "http://etcd-0.etcd:2380"), member(2, "", ME)];
        assert_eq!(
            joining_cluster(&with_me, "etcd-1", ME),
            "etcd-0=http://etcd-0.etcd:2380,etcd-1=http://etcd-1.etcd:2380"
        );
    }

    #[test]
    fn the_flags_become_etcds_configuration_file_and_unknown_ones_are_refused() {
        let flags: Vec<String> = [
            "--name=etcd-1",
            "--data-dir=/var/run/etcd/data",
            "--initial-cluster=etcd-0=http://a:2380",
            "--initial-cluster-state=new",
            "--cert-file=/tls/tls.crt",
            "--client-cert-auth",
            "--peer-cert-file=/tls/tls.crt",
            "--peer-client-cert-auth",
            "--heartbeat-interval=100",
        ]
        .map(String::from)
        .to_vec();
        let text =
            config_file(&flags, "existing", "etcd-0=http://a:2380,etcd-1=http://b:2380").unwrap();
        assert_eq!(
            text,
            "name: \"etcd-1\"\ndata-dir: \"/var/run/etcd/data\"\nheartbeat-interval: 100\n\
             enable-grpc-gateway: true\ninitial-cluster: \"etcd-0=http://a:2380,etcd-1=http://b:2380\"\n\
             initial-cluster-state: \"existing\"\nclient-transport-security:\n  \
             cert-file: \"/tls/tls.crt\"\n  client-cert-auth: true\npeer-transport-security:\n  \
             cert-file: \"/tls/tls.crt\"\n  client-cert-auth: true\n"
        );
        let err = config_file(&["--snapshot-count=5".into()], "new", "x").unwrap_err();
        assert!(err.to_string().contains("--snapshot-count=5"), "{err}");
    }

    #[test]
    fn a_members_own_endpoint_is_not_asked() {
        assert!(endpoint_names("http://etcd-1.etcd:2379", "etcd-1"));
        assert!(!endpoint_names("http://etcd-10.etcd:2379", "etcd-1"));
        assert!(endpoint_names("etcd-1:2379", "etcd-1"));
    }
}
