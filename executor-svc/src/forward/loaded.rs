//! A model ready to run: its file as `ferry-model` read it (name, fingerprint, shape, tokenizer)
//! and its weights, loaded through candle from the same file.

use std::sync::Arc;

use candle_core::quantized::gguf_file;
use ferry_model::ModelFile;

use super::llama::{LlamaWeights, LoadError};

/// A model ready to run.
#[derive(Debug)]
pub struct LoadedModel {
    /// What the file is (shared with a front in the same process).
    pub file: Arc<ModelFile>,
    /// The weights.
    pub weights: LlamaWeights,
}

/// Why a model's weights could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model file could not be opened or its header read.
    #[error(transparent)]
    File(#[from] ferry_model::ModelError),
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// candle could not read the tensor table.
    #[error("{path} is not a readable GGUF file: {source}")]
    Gguf {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: candle_core::Error,
    },
    /// The weights could not be loaded.
    #[error("{path}: {source}")]
    Load {
        /// The file.
        path: std::path::PathBuf,
        /// The cause (boxed: it is large, and rare).
        #[source]
        source: Box<LoadError>,
    },
}

impl LoadedModel {
    /// Loads the weights of `file`.
    pub fn load(file: Arc<ModelFile>) -> Result<Self, ModelError> {
        let path = &file.path;
        let mut reader = std::fs::File::open(path)
            .map_err(|source| ModelError::Io { path: path.clone(), source })?;
        let content = gguf_file::Content::read(&mut reader)
            .map_err(|source| ModelError::Gguf { path: path.clone(), source })?;
        let weights = LlamaWeights::load(file.shape, &content, &mut reader)
            .map_err(|e| ModelError::Load { path: path.clone(), source: Box::new(e) })?;
        Ok(Self { file, weights })
    }

    /// Opens the model at `path` (the default model, fetched when missing, for `None`) and
    /// loads its weights.
    pub fn open(path: Option<&std::path::Path>) -> Result<Self, ModelError> {
        Self::load(Arc::new(ModelFile::open(path)?))
    }
}
