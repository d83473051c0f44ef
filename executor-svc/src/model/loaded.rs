//! Loading a whole model from a GGUF path (or the default model, fetched when missing):
//! weights, tokenizer, name and a fingerprint that tells different weights apart.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;

use super::fetch::{default_model_path, FetchError, DEFAULT_MODEL_NAME};
use super::llama::{LlamaWeights, LoadError};
use super::tokenizer::{Tokenizer, TokenizerError};

/// A model ready to run.
#[derive(Debug)]
pub struct LoadedModel {
    /// Name clients use.
    pub name: String,
    /// Where it was loaded from.
    pub path: PathBuf,
    /// Identifies the weights (KV of different fingerprints never mixes).
    pub fingerprint: String,
    /// The weights.
    pub weights: LlamaWeights,
    /// The tokenizer and chat template.
    pub tokenizer: Tokenizer,
}

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The default model could not be obtained.
    #[error(transparent)]
    Fetch(#[from] FetchError),
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Not a GGUF file.
    #[error("{path} is not a readable GGUF file: {source}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: candle_core::Error,
    },
    /// The weights could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The tokenizer could not be built.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// The file to load (the default model's, fetched when missing, for `None`) and the name
/// clients will use for it.
fn resolve(path: Option<&Path>) -> Result<(PathBuf, String), ModelError> {
    Ok(match path {
        Some(p) => {
            let name =
                p.file_stem().map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
            (p.to_path_buf(), name)
        }
        None => (default_model_path()?, DEFAULT_MODEL_NAME.to_string()),
    })
}

impl LoadedModel {
    /// Loads `path`, or the default model when `None`.
    pub fn load(path: Option<&Path>) -> Result<Self, ModelError> {
        let (path, name) = resolve(path)?;
        let io = |source| ModelError::Io { path: path.clone(), source };
        let mut file = std::fs::File::open(&path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let content = gguf_file::Content::read(&mut file)
            .map_err(|source| ModelError::Gguf { path: path.clone(), source })?;
        let tokenizer = Tokenizer::from_gguf(&content)?;
        let weights = LlamaWeights::load(&content, &mut file)?;
        let general = content
            .metadata
            .get("general.name")
            .and_then(|v| v.to_string().ok().cloned())
            .unwrap_or_default();
        // Name, size and tensor layout identify the weights well enough to keep KV apart.
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let mut feed = |bytes: &[u8]| {
            for b in bytes {
                h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
            }
        };
        feed(general.as_bytes());
        feed(&len.to_le_bytes());
        let mut names: Vec<_> = content.tensor_infos.iter().collect();
        names.sort_by(|a, b| a.0.cmp(b.0));
        for (n, info) in names {
            feed(n.as_bytes());
            feed(&info.offset.to_le_bytes());
        }
        Ok(Self { name, path, fingerprint: format!("{h:016x}"), weights, tokenizer })
    }
}

/// Loads only the tokenizer (and the model's name and maximum length) from `path`, or from the
/// default model when `None`: what a front needs, without the weights.
pub fn load_tokenizer(path: Option<&Path>) -> Result<(String, Tokenizer, usize), ModelError> {
    let (path, name) = resolve(path)?;
    let mut file = std::fs::File::open(&path)
        .map_err(|source| ModelError::Io { path: path.clone(), source })?;
    let content = gguf_file::Content::read(&mut file)
        .map_err(|source| ModelError::Gguf { path: path.clone(), source })?;
    let shape = super::llama::LlamaShape::from_gguf(&content)?;
    Ok((name, Tokenizer::from_gguf(&content)?, shape.max_model_len))
}
