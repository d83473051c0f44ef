//! The models a front serves: one or more base models, each with its own tokenizer, chat
//! template, fingerprint and LoRA adapters. A request's `model` names a base model or an
//! adapter; the first base model is the default (a request that names none gets it).
//!
//! Names are one namespace: an adapter cannot take a base model's name, nor another model's
//! adapter's. Each base model is served by the executors whose handshake states its
//! fingerprint (the link's `info.model_fingerprint`), and only by those: a request is
//! tokenized, placed, detokenized and cached under its own model from end to end.

use std::sync::{Arc, Mutex};

use ferry_model::ModelFile;
use ferry_proto::v1;

use super::adapters::{AdapterEntry, AdapterError, Adapters, LoraModule, LoraSettings};

/// Why a request's model cannot be served here.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ModelRefusal {
    /// The request names a model this front does not serve.
    #[error("model {asked:?} is not served here; available: {served}")]
    Unknown {
        /// Asked for.
        asked: String,
        /// Every name served.
        served: String,
    },
    /// The caller tokenized for another model (its fingerprint differs).
    #[error(
        "the request was tokenized for the model with fingerprint {asked}, but this scheduler \
         serves {served:?} with fingerprint {fingerprint}: give the front and the scheduler the \
         same model file"
    )]
    Other {
        /// The caller's fingerprint.
        asked: String,
        /// The model it named (or the default).
        served: String,
        /// That model's fingerprint.
        fingerprint: String,
    },
}

/// A base model a front serves.
#[derive(Debug, Clone)]
pub struct ServedModel {
    /// The model file: name, fingerprint, tokenizer and chat template.
    pub file: Arc<ModelFile>,
    /// Largest prompt + output accepted: the model's, capped to what the smallest executor's
    /// KV cache holds for one request.
    pub max_model_len: usize,
    /// The LoRA adapters served on it.
    pub adapters: Arc<Adapters>,
}

impl ServedModel {
    /// `file` capped to `max_model_len`, serving no adapter yet (with `lora.enabled`, adapters
    /// up to `lora.max_rank`).
    pub fn new(file: Arc<ModelFile>, max_model_len: usize, lora: &LoraSettings) -> Self {
        let dir = file.path.parent();
        let base = (file.name.as_str(), file.shape, dir);
        let adapters = Adapters::new(lora.enabled, base, lora.max_rank);
        Self { file, max_model_len, adapters: Arc::new(adapters) }
    }

    /// The name clients use.
    pub fn name(&self) -> &str {
        &self.file.name
    }
}

/// A base model's place among a front's models (0: the default).
pub type ModelId = usize;

/// The base models a front serves, in the order given (the first is the default).
#[derive(Debug)]
pub struct Models {
    models: Vec<ServedModel>,
    /// Held while an adapter is registered, so two registrations cannot both take one name.
    registering: Mutex<()>,
}

impl Models {
    /// `files`, each with the longest request it serves, and the adapters of `lora` (each
    /// on the base model its `base` names, or the first).
    ///
    /// # Errors
    ///
    /// No model, two models of one name or one fingerprint (the same file twice), or an
    /// adapter of `--lora-modules` that cannot be served, naming it.
    pub fn new(files: Vec<(Arc<ModelFile>, usize)>, lora: &LoraSettings) -> anyhow::Result<Self> {
        anyhow::ensure!(!files.is_empty(), "no model to serve");
        for (i, (a, _)) in files.iter().enumerate() {
            for (b, _) in &files[..i] {
                anyhow::ensure!(
                    a.name != b.name,
                    "two models are named {:?}: give each its own name (--served-model-name)",
                    a.name
                );
                anyhow::ensure!(
                    a.fingerprint != b.fingerprint,
                    "{:?} and {:?} are the same weights (fingerprint {}): serve it once",
                    b.name,
                    a.name,
                    a.fingerprint
                );
            }
        }
        let models =
            files.into_iter().map(|(file, len)| ServedModel::new(file, len, lora)).collect();
        let models = Self { models, registering: Mutex::new(()) };
        for LoraModule { name, path, base } in &lora.modules {
            models
                .load_adapter(base.as_deref(), name, path)
                .map_err(|e| anyhow::anyhow!("--lora-modules {name}={path}: {e}"))?;
        }
        Ok(models)
    }

    /// One model (tests, and a front of one model).
    ///
    /// # Errors
    ///
    /// As [`Self::new`].
    pub fn one(
        file: Arc<ModelFile>,
        max_model_len: usize,
        lora: &LoraSettings,
    ) -> anyhow::Result<Self> {
        Self::new(vec![(file, max_model_len)], lora)
    }

    /// The default model: the first given.
    pub fn default_model(&self) -> &ServedModel {
        &self.models[0]
    }

    /// The model `id`.
    ///
    /// # Panics
    ///
    /// If `id` is not one of this front's (ids come from [`Self::resolve`]).
    pub fn get(&self, id: ModelId) -> &ServedModel {
        &self.models[id]
    }

    /// Every base model, the default first.
    pub fn iter(&self) -> impl Iterator<Item = &ServedModel> {
        self.models.iter()
    }

    /// The model whose weights have `fingerprint`.
    pub fn by_fingerprint(&self, fingerprint: &str) -> Option<ModelId> {
        self.models.iter().position(|m| m.file.fingerprint == fingerprint)
    }

    /// The base model that `name` names, itself or through one of its adapters; the default
    /// for an empty or unknown name (the request is refused later, naming what is served).
    pub fn base_of(&self, name: &str) -> &ServedModel {
        let found = self.models.iter().find(|m| m.name() == name || m.adapters.contains(name));
        found.unwrap_or(self.default_model())
    }

    /// Every name a request may give, for a refusal: each base model, then its adapters.
    pub fn served_names(&self) -> String {
        let mut names = Vec::new();
        for m in &self.models {
            names.push(m.name().to_string());
            names.extend(m.adapters.list().into_iter().map(|(n, _)| n));
        }
        names.join(", ")
    }

    /// The model and adapter a request's `name` asks for, tokenized (when `fingerprint` is
    /// given) for the model with that fingerprint: an empty name is the model of that
    /// fingerprint, or the default.
    ///
    /// # Errors
    ///
    /// A name not served (`Unknown`), or a fingerprint that is not the named model's or no
    /// model's (`Other`).
    pub fn resolve(
        &self,
        name: &str,
        fingerprint: &str,
    ) -> Result<(ModelId, Option<v1::LoraAdapterRef>), ModelRefusal> {
        let (id, adapter) = if name.is_empty() {
            let id =
                if fingerprint.is_empty() { Some(0) } else { self.by_fingerprint(fingerprint) };
            (id.unwrap_or(0), None)
        } else {
            let found = self.models.iter().enumerate().find_map(|(i, m)| {
                if m.name() == name {
                    Some((i, None))
                } else {
                    m.adapters.get(name).map(|a| (i, Some(a)))
                }
            });
            found.ok_or_else(|| ModelRefusal::Unknown {
                asked: name.to_string(),
                served: self.served_names(),
            })?
        };
        let model = &self.models[id];
        if !fingerprint.is_empty() && fingerprint != model.file.fingerprint {
            return Err(ModelRefusal::Other {
                asked: fingerprint.to_string(),
                served: model.name().to_string(),
                fingerprint: model.file.fingerprint.clone(),
            });
        }
        Ok((id, adapter))
    }

    /// Serves the adapter at `path` as `name` on the base model `base` (the default when
    /// `None`), after checking that it fits that model and that no model or adapter has the
    /// name.
    ///
    /// # Errors
    ///
    /// An unknown base, a name taken, or what [`super::adapters::Adapters::load`] refuses.
    pub fn load_adapter(
        &self,
        base: Option<&str>,
        name: &str,
        path: &str,
    ) -> Result<AdapterEntry, AdapterError> {
        let model = match base {
            None => self.default_model(),
            Some(base) => self.models.iter().find(|m| m.name() == base).ok_or_else(|| {
                let bases: Vec<&str> = self.models.iter().map(ServedModel::name).collect();
                AdapterError::Invalid(format!(
                    "no base model is named {base:?}; served: {}",
                    bases.join(", ")
                ))
            })?,
        };
        let _held = self.registering.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.models.iter().any(|m| m.name() == name) {
            return Err(AdapterError::BadName(name.to_string()));
        }
        if self.models.iter().any(|m| m.adapters.contains(name)) {
            return Err(AdapterError::Exists(name.to_string()));
        }
        model.adapters.load(name, path)
    }

    /// Stops serving the adapter `name`, whichever model it is on.
    ///
    /// # Errors
    ///
    /// LoRA off, or no adapter of that name.
    pub fn unload_adapter(&self, name: &str) -> Result<(), AdapterError> {
        let held = self.models.iter().find(|m| m.adapters.contains(name));
        held.unwrap_or(self.default_model()).adapters.unload(name)
    }
}
