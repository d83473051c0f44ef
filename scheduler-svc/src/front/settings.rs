//! The front's settings, checked: how many requests it holds, how long a lost request waits
//! for another executor, when it disaggregates or reads the KV tier, how it weighs load in
//! routing, the API keys, and what one request may ask for. `config` builds them from the
//! flags; the front only reads them.

use std::sync::Arc;
use std::time::Duration;

use super::adapters::LoraSettings;
use super::keys::ApiKeys;
use super::prepare::RequestLimits;

/// The front's settings, checked.
#[derive(Clone, Debug)]
pub struct FrontSettings {
    /// Most requests held at once.
    pub max_live: usize,
    /// How long a request whose executor or scheduler was lost waits for another.
    pub failover_wait: Duration,
    /// Least uncached prompt tokens for prefill/decode disaggregation; `None`: off.
    pub disaggregation_min_tokens: Option<usize>,
    /// How long a KV transfer may take.
    pub kv_transfer_timeout: Duration,
    /// Least prompt tokens a KV-tier read must save; `None`: no KV-tier reads.
    pub kv_tier_min_tokens: Option<usize>,
    /// Tokens of cached prefix one more live request outweighs in routing
    /// ([`ferry_sched_core::routing::pick`]).
    pub route_load_tokens: usize,
    /// The API keys callers must present; `None`: the client APIs are open.
    pub keys: Option<Arc<ApiKeys>>,
    /// What one request may ask for.
    pub limits: RequestLimits,
    /// `--max-model-len`, if given.
    pub max_model_len: Option<usize>,
    /// Whether requests may set a priority: the scheduler that serves them orders by it. A
    /// front in its own process forwards it and its leader decides.
    pub accepts_priority: bool,
    /// The LoRA adapters: whether served, which from the start, their largest rank.
    pub lora: LoraSettings,
}
