//! The LoRA adapters a front serves beside its base model: each under the name a request's
//! `model` gives, with the path its executors read it from. An adapter is checked against the
//! base model when it is registered (`--lora-modules` at start, `POST /v1/load_lora_adapter`
//! at run time), so a request never reaches an executor with one that cannot fit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use ferry_model::lora::{self, LoraFormat, Module};
use ferry_model::LlamaShape;
use ferry_proto::v1;

/// How a front serves adapters (its flags).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoraSettings {
    /// `--enable-lora`: requests may name LoRA adapters.
    pub enabled: bool,
    /// `--lora-modules`: the adapters served from the start.
    pub modules: Vec<LoraModule>,
    /// Largest adapter rank the executors take (their `--max-lora-rank`; `ferry serve` sets
    /// it from its executor's).
    pub max_rank: usize,
}

/// An adapter of `--lora-modules`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraModule {
    /// The name requests give as `model`.
    pub name: String,
    /// Where it is read (relative: in its base model's folder).
    pub path: String,
    /// The base model it is for (`None`: the first served).
    pub base: Option<String>,
}

/// One served adapter.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterEntry {
    /// Where executors read it (relative: in their model folder).
    pub path: String,
    /// Its largest rank.
    pub rank: usize,
    /// Its format.
    pub format: LoraFormat,
    /// The projections it updates.
    pub modules: Vec<Module>,
}

/// Why an adapter could not be registered or removed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AdapterError {
    /// LoRA is off.
    #[error("LoRA adapters are not enabled on this server (start it with --enable-lora)")]
    Disabled,
    /// The name is the base model's, or empty.
    #[error("{0:?} cannot name an adapter: it is empty or the base model's name")]
    BadName(String),
    /// An adapter of that name is served already.
    #[error("the LoRA adapter {0:?} has already been loaded")]
    Exists(String),
    /// No adapter of that name is served.
    #[error("no LoRA adapter named {0:?} is loaded")]
    Unknown(String),
    /// The files are not an adapter Ferry runs, or do not fit the base model.
    #[error("{0}")]
    Invalid(String),
}

/// The adapters served, by name.
#[derive(Debug)]
pub struct Adapters {
    enabled: bool,
    shape: LlamaShape,
    base_name: String,
    /// Where relative paths are read from here (the base model's folder).
    base_dir: Option<PathBuf>,
    max_rank: usize,
    by_name: RwLock<BTreeMap<String, AdapterEntry>>,
    /// Requests admitted, by adapter (kept after an adapter is unloaded).
    requests: std::sync::Mutex<BTreeMap<String, u64>>,
}

impl Adapters {
    /// None served yet, for the base model `base_name` of `shape` in `base_dir`; `enabled`:
    /// `--enable-lora`; `max_rank`: the executors' `--max-lora-rank`.
    pub fn new(
        enabled: bool,
        (base_name, shape, base_dir): (&str, LlamaShape, Option<&Path>),
        max_rank: usize,
    ) -> Self {
        Self {
            enabled,
            shape,
            base_name: base_name.to_string(),
            base_dir: base_dir.map(Path::to_path_buf),
            max_rank,
            by_name: RwLock::default(),
            requests: std::sync::Mutex::default(),
        }
    }

    /// Counts a request admitted with adapter `name`.
    pub fn count_request(&self, name: &str) {
        let mut requests = self.requests.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *requests.entry(name.to_string()).or_default() += 1;
    }

    /// Whether adapters may be served.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Reads the adapter at `path`, checks it fits the base model, and serves it as `name`.
    ///
    /// # Errors
    ///
    /// LoRA off, a name taken, or an adapter that cannot be read or does not fit.
    pub fn load(&self, name: &str, path: &str) -> Result<AdapterEntry, AdapterError> {
        if !self.enabled {
            return Err(AdapterError::Disabled);
        }
        if name.is_empty() || name == self.base_name {
            return Err(AdapterError::BadName(name.to_string()));
        }
        for (what, value, limit) in [
            ("name", name, lora::MAX_ADAPTER_NAME_BYTES),
            ("path", path, lora::MAX_ADAPTER_PATH_BYTES),
        ] {
            if value.len() > limit {
                return Err(AdapterError::Invalid(format!(
                    "the adapter's {what} is {} bytes; at most {limit}",
                    value.len()
                )));
            }
        }
        if self.by_name.read().expect("adapters lock").contains_key(name) {
            return Err(AdapterError::Exists(name.to_string()));
        }
        let full = lora::resolve(self.base_dir.as_deref(), path);
        let adapter = lora::load(&full, &self.shape, self.max_rank)
            .map_err(|e| AdapterError::Invalid(e.to_string()))?;
        let entry = AdapterEntry {
            path: path.to_string(),
            rank: adapter.rank(),
            format: adapter.format,
            modules: adapter.modules(),
        };
        let mut by_name = self.by_name.write().expect("adapters lock");
        if by_name.contains_key(name) {
            return Err(AdapterError::Exists(name.to_string()));
        }
        by_name.insert(name.to_string(), entry.clone());
        tracing::info!(adapter = name, path, rank = entry.rank, "LoRA adapter served");
        Ok(entry)
    }

    /// Stops serving `name` (requests already running with it finish with it).
    ///
    /// # Errors
    ///
    /// LoRA off, or no adapter of that name.
    pub fn unload(&self, name: &str) -> Result<(), AdapterError> {
        if !self.enabled {
            return Err(AdapterError::Disabled);
        }
        match self.by_name.write().expect("adapters lock").remove(name) {
            Some(_) => Ok(()),
            None => Err(AdapterError::Unknown(name.to_string())),
        }
    }

    /// Whether an adapter is served as `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.by_name.read().expect("adapters lock").contains_key(name)
    }

    /// The adapter served as `name`, as an executor is told of it.
    pub fn get(&self, name: &str) -> Option<v1::LoraAdapterRef> {
        let by_name = self.by_name.read().expect("adapters lock");
        by_name.get(name).map(|e| v1::LoraAdapterRef { name: name.into(), path: e.path.clone() })
    }

    /// Every adapter served, by name.
    pub fn list(&self) -> Vec<(String, AdapterEntry)> {
        let by_name = self.by_name.read().expect("adapters lock");
        by_name.iter().map(|(n, e)| (n.clone(), e.clone())).collect()
    }
}

/// `/metrics`' part for the adapters of the model `model_name`: requests by adapter, and each
/// adapter served (vLLM's `vllm:lora_requests_info`, whose sets are the executors', is the
/// executor gauges' part: `crate::executors`).
pub struct AdapterMetrics {
    /// The base model's name (every sample's `model_name`).
    pub model_name: String,
    /// The adapters.
    pub adapters: std::sync::Arc<Adapters>,
}

impl ferry_runtime::prometheus::Render for AdapterMetrics {
    fn render(&self, t: &mut ferry_runtime::prometheus::Text) {
        if !self.adapters.enabled() {
            return;
        }
        let m = ("model_name", self.model_name.as_str());
        let name = "ferry_lora_requests";
        t.family(name, "counter", "Requests admitted, by LoRA adapter.");
        let requests = self.adapters.requests.lock();
        let requests = requests.unwrap_or_else(std::sync::PoisonError::into_inner);
        for (adapter, n) in requests.iter() {
            t.sample(name, &[m, ("adapter", adapter)], *n as f64);
        }
        let name = "ferry_lora_adapters_served";
        t.family(name, "gauge", "The LoRA adapters served (1 each), by name and rank.");
        for (adapter, e) in self.adapters.list() {
            let rank = e.rank.to_string();
            t.sample(name, &[m, ("adapter", &adapter), ("rank", &rank)], 1.0);
        }
    }
}

/// Parses a `--lora-modules` value: `name=path` (on the first model served), or vLLM's JSON
/// form `{"name": …, "path": …, "base_model_name": …}` (written without spaces when several
/// are given in `FERRY_LORA_MODULES`, whose values spaces separate).
///
/// # Errors
///
/// What is wrong with it.
pub fn parse_module(value: &str) -> Result<LoraModule, String> {
    if value.trim_start().starts_with('{') {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Json {
            name: String,
            path: String,
            #[serde(default)]
            base_model_name: Option<String>,
        }
        let j: Json = serde_json::from_str(value).map_err(|e| {
            format!("{value:?} is not {{\"name\", \"path\", \"base_model_name\"}}: {e}")
        })?;
        if j.name.is_empty() || j.path.is_empty() {
            return Err(format!("{value:?} needs a name and a path"));
        }
        return Ok(LoraModule { name: j.name, path: j.path, base: j.base_model_name });
    }
    match value.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok(LoraModule { name: name.to_string(), path: path.to_string(), base: None })
        }
        _ => Err(format!("{value:?} is not name=path")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapters(enabled: bool) -> Adapters {
        let file = ferry_model::ModelFile::open(None).expect("the default model");
        Adapters::new(enabled, (&file.name, file.shape, None), 16)
    }

    #[test]
    fn a_registration_is_checked_before_anything_is_served() {
        let off = adapters(false);
        assert_eq!(off.load("x", "/nowhere"), Err(AdapterError::Disabled));
        let on = adapters(true);
        let base = ferry_model::ModelFile::open(None).unwrap().name;
        assert_eq!(on.load(&base, "/nowhere"), Err(AdapterError::BadName(base.clone())));
        assert_eq!(on.load("", "/nowhere"), Err(AdapterError::BadName(String::new())));
        let long = "n".repeat(lora::MAX_ADAPTER_NAME_BYTES + 1);
        assert!(
            matches!(on.load(&long, "p"), Err(AdapterError::Invalid(m)) if m.contains("at most 128"))
        );
        let missing = on.load("x", "/nowhere/adapter").unwrap_err().to_string();
        assert!(missing.contains("/nowhere/adapter"), "{missing}");
        assert_eq!(on.unload("x"), Err(AdapterError::Unknown("x".into())));
        assert!(on.list().is_empty() && on.get("x").is_none(), "nothing was served");
    }

    #[test]
    fn lora_modules_values_are_name_equals_path_or_vllm_json() {
        let module = |name: &str, path: &str, base: Option<&str>| LoraModule {
            name: name.into(),
            path: path.into(),
            base: base.map(Into::into),
        };
        assert_eq!(parse_module("x=/a/b=c"), Ok(module("x", "/a/b=c", None)));
        let json = r#"{"name":"x","path":"/a","base_model_name":"m"}"#;
        assert_eq!(parse_module(json), Ok(module("x", "/a", Some("m"))));
        assert_eq!(parse_module(r#"{"name":"x","path":"/a"}"#), Ok(module("x", "/a", None)));
        for bad in ["x", "=p", "x=", "", r#"{"name":"x"}"#, r#"{"name":"","path":"p"}"#] {
            assert!(parse_module(bad).is_err(), "{bad:?}");
        }
    }
}
