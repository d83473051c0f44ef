//! What a link knows of its executor's LoRA adapters: which it holds resident (mirrored from
//! the requests added, for the router's preference), each adapter's name by the core's id for
//! it, and the core's held and waiting adapters as of its last step (for vLLM's
//! `vllm:lora_requests_info`).

use std::collections::HashMap;

/// A link's view of its executor's adapters.
#[derive(Debug, Default)]
pub struct LoraView {
    /// Resident, as the requests added here make the executor read them: its `--max-loras`
    /// least-recently-used set, mirrored (most recent last).
    resident: Vec<String>,
    /// Names by the core's adapter id.
    names: HashMap<u64, String>,
    /// The core's adapters held for the requests the executor knows, and those of requests
    /// waiting for their first admission (ids), as of its last step.
    core: (Vec<u64>, Vec<u64>),
}

impl LoraView {
    /// Notes that a request with adapter `name` (the core's id `id`) was added to an executor
    /// of `max_loras`: it reads it (or uses it again), and drops its least recently used one
    /// past the limit.
    pub(super) fn note(&mut self, id: u64, name: String, max_loras: usize) {
        self.names.entry(id).or_insert_with(|| name.clone());
        self.resident.retain(|a| *a != name);
        self.resident.push(name);
        let over = self.resident.len().saturating_sub(max_loras);
        self.resident.drain(..over);
    }

    /// Whether adapter `name` is resident (as far as the requests added tell).
    pub(super) fn holds(&self, name: &str) -> bool {
        self.resident.iter().any(|a| a == name)
    }

    /// The core's held and waiting adapters, from its last step.
    pub(super) fn publish(&mut self, core: (Vec<u64>, Vec<u64>)) {
        self.core = core;
    }

    /// The adapters the executor holds for its requests (vLLM's running adapters) and those
    /// of requests waiting for their first admission, by name.
    pub fn requests_info(&self) -> (Vec<String>, Vec<String>) {
        let named = |ids: &[u64]| {
            let mut names: Vec<String> =
                ids.iter().filter_map(|id| self.names.get(id).cloned()).collect();
            names.sort();
            names
        };
        (named(&self.core.0), named(&self.core.1))
    }
}
