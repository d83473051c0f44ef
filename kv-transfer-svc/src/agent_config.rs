//! The KV agent's configuration: every field a flag and a `FERRY_…` environment variable.

use clap::Args;

/// Everything a KV agent needs to start.
#[derive(Clone, Debug, Args)]
pub struct KvAgentConfig {
    /// Id of the node this agent serves.
    #[arg(long, env = "FERRY_NODE_ID", default_value = "node-0")]
    pub node_id: String,
    /// Host memory for the block store, in MiB.
    #[arg(long, env = "FERRY_KV_STORE_MIB", default_value_t = 1024)]
    pub store_mib: u64,
    /// Directory of local executors' shared-memory staging regions (a tmpfs; the executors'
    /// `--kv-shm-dir` must name the same one).
    #[arg(long, env = "FERRY_KV_SHM_DIR", default_value = ferry_kv_wire::shm::DEFAULT_DIR)]
    pub shm_dir: std::path::PathBuf,
}

impl KvAgentConfig {
    /// Checks what clap's types cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.node_id.trim().is_empty() {
            return Err(ConfigError::NodeId);
        }
        if self.store_mib == 0 {
            return Err(ConfigError::StoreSize);
        }
        Ok(())
    }
}

/// A configuration value out of range.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Empty node id.
    #[error("--node-id must not be empty")]
    NodeId,
    /// No store memory.
    #[error("--store-mib must be at least 1")]
    StoreSize,
}
