//! What Ferry's services know about a model, without its weights: the GGUF header, the
//! architecture's shape, the tokenizer and chat template, the sampling parameters a request may
//! ask for, the default model's fetch, and a fingerprint that tells one model from another.
//!
//! Why a crate of its own: the front (tokenize, render chats, check limits) and the executor
//! (run the weights) must agree on all of this, and the front must not link the executor's
//! kernels to get it. This crate has no candle, no rayon, no kernels: reading a model's header
//! costs milliseconds and a few megabytes.
//!
//! The fingerprint is what a handshake compares: a front that tokenizes for one model and an
//! executor that runs another refuse to work together, instead of producing text from the
//! wrong vocabulary.

mod byte_bpe;
pub mod chat;
pub mod family;
pub mod fetch;
pub mod gguf;
pub mod lora;
pub mod pre_tokenizer;
pub mod sampling;
pub mod shape;
mod spm;
pub mod structured;
mod template_helpers;
pub mod tokenizer;
mod vocab;

use std::path::{Path, PathBuf};

pub use chat::{ChatOptions, ToolCallParser, ToolPiece};
pub use family::{Activation, Family, RopeStyle};
pub use fetch::{default_model_path, model_dir, FetchError, DEFAULT_MODEL_NAME};
pub use gguf::{GgufError, GgufHeader};
pub use shape::{LlamaShape, ShapeError};
pub use structured::{GrammarError, Grammars};
pub use tokenizer::{ChatMessage, IncrementalDecoder, Tokenizer, TokenizerError};

/// A model file as the services know it: where it is, what to call it, its fingerprint, its
/// shape and its tokenizer.
#[derive(Debug)]
pub struct ModelFile {
    /// The name clients use.
    pub name: String,
    /// Where it was read from.
    pub path: PathBuf,
    /// Identifies the weights: equal fingerprints mean the same tokens and the same KV.
    pub fingerprint: String,
    /// The architecture's dimensions.
    pub shape: LlamaShape,
    /// The tokenizer and chat template.
    pub tokenizer: Tokenizer,
    /// Its matrices' GGUF types, most tensors first (`Q4_1`, `Q8_0`).
    pub weight_types: Vec<String>,
    /// The structured-output compiler for this vocabulary, built on first use.
    grammars: std::sync::OnceLock<Result<Grammars, GrammarError>>,
}

/// Why a model could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The default model could not be obtained.
    #[error(transparent)]
    Fetch(#[from] FetchError),
    /// The file is not a readable GGUF model.
    #[error("{path}: {source}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: GgufError,
    },
    /// The architecture's metadata is missing or inconsistent.
    #[error("{path}: {source}")]
    Shape {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: ShapeError,
    },
    /// A matrix is of a type Ferry does not compute in.
    #[error(
        "{path}: tensor {tensor} is of type {ty}, which Ferry does not serve (matrices of \
         {served} are served)",
        served = gguf::SERVED_WEIGHT_TYPES.join(", ")
    )]
    WeightType {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its type's name.
        ty: String,
    },
    /// The tokenizer could not be built.
    #[error("{path}: {source}")]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: TokenizerError,
    },
}

impl ModelFile {
    /// Reads the model at `path`, or the default model (fetched when missing) when `None`.
    /// Blocking: it reads the header and, for the default model, may download it.
    pub fn open(path: Option<&Path>) -> Result<Self, ModelError> {
        let (path, name) = match path {
            Some(p) => {
                let name = p
                    .file_stem()
                    .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
                (p.to_path_buf(), name)
            }
            None => (default_model_path()?, DEFAULT_MODEL_NAME.to_string()),
        };
        let header = GgufHeader::open(&path)
            .map_err(|source| ModelError::Gguf { path: path.clone(), source })?;
        let shape = LlamaShape::from_gguf(&header)
            .map_err(|source| ModelError::Shape { path: path.clone(), source })?;
        if let Some((t, ty)) = header.unserved_matrix() {
            return Err(ModelError::WeightType { path, tensor: t.name.clone(), ty });
        }
        let tokenizer = Tokenizer::from_gguf(&header)
            .map_err(|source| ModelError::Tokenizer { path: path.clone(), source })?;
        let fingerprint = fingerprint(&header);
        let weight_types = header.weight_types();
        let grammars = std::sync::OnceLock::new();
        Ok(Self { name, path, fingerprint, shape, tokenizer, weight_types, grammars })
    }

    /// The structured-output compiler for this model's vocabulary (built on the first call,
    /// which takes about 100 ms; later calls return the same one).
    pub fn grammars(&self) -> Result<&Grammars, GrammarError> {
        self.grammars.get_or_init(|| Grammars::new(&self.tokenizer)).as_ref().map_err(Clone::clone)
    }
}

/// A 64-bit FNV-1a over the model's `general.name`, the file's length and its tensor table
/// (names and offsets, sorted by name), as 16 hex digits. Cheap (no pass over the weights) and
/// different for any re-quantization, re-export or other model: those change the file's length
/// or its layout.
pub fn fingerprint(header: &GgufHeader) -> String {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    let general = header.get("general.name").and_then(gguf::Value::as_str).unwrap_or_default();
    feed(general.as_bytes());
    feed(&header.file_len.to_le_bytes());
    let mut tensors: Vec<_> = header.tensors.iter().collect();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    for t in tensors {
        feed(t.name.as_bytes());
        feed(&t.offset.to_le_bytes());
    }
    format!("{h:016x}")
}
