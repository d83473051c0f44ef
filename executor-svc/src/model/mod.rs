//! The model: obtaining the default GGUF, reading its shape, weights and tokenizer, and the
//! reference forward that the serving path is checked against.

pub mod fetch;
pub mod llama;
pub mod ops;
pub mod reference;
pub mod tokenizer;

pub use fetch::{default_model_path, DEFAULT_MODEL_NAME};
pub use llama::{LlamaShape, LlamaWeights, LoadError};
pub use tokenizer::{ChatMessage, IncrementalDecoder, Tokenizer};
