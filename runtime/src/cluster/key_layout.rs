//! Where things live in etcd: every key is under `/ferry/<cluster>/`; a member of a kind under
//! its kind's prefix (`executors/<id>`, `kv/<node>`), with a JSON [`MemberInfo`] as its value;
//! the elected scheduler's token under `leadership/<epoch>`; a scheduler pool's election (its
//! candidates' keys) under `scheduler/<pool>/`.

use super::ClusterArgs;

/// What a registration's value says about its member.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemberInfo {
    /// Where to reach it (`http://host:port`).
    pub address: String,
    /// The scheduler pool (shard) it belongs to (`ferry-executor --pool`); none: any, as the
    /// shards' assignment decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
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

/// The pool of schedulers that name none (`--pool`'s default).
pub const DEFAULT_POOL: &str = "default";

/// The pool an election candidate's key names, given without [`ClusterArgs::schedulers_prefix`]
/// (`<pool>/<lease>`).
pub fn candidate_pool(key: &str) -> Option<&str> {
    key.split('/').next().filter(|p| !p.is_empty())
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
    /// The key prefix of a kind, ending in `/`.
    pub fn prefix(&self, kind: MemberKind) -> String {
        format!("/ferry/{}/{}/", self.cluster, kind.segment())
    }

    /// The prefix of every scheduler pool's election, ending in `/`: a candidate's key is
    /// `<prefix><pool>/<lease>`, so the pools that are up are the first segments below it.
    pub fn schedulers_prefix(&self) -> String {
        format!("/ferry/{}/scheduler/", self.cluster)
    }

    /// The election of scheduler pool `pool` (its leader's key is below it).
    pub fn election_name(&self, pool: &str) -> String {
        format!("{}{pool}", self.schedulers_prefix())
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
}
