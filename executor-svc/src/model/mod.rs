//! The model: obtaining the default GGUF, reading its shape, weights and tokenizer, the paged
//! KV cache and serving forward, and the reference forward the serving path is checked against.

pub mod fetch;
pub mod kv_cache;
pub mod llama;
pub mod loaded;
pub mod ops;
pub mod paged;
pub mod reference;
pub mod tokenizer;

pub use fetch::{default_model_path, DEFAULT_MODEL_NAME};
pub use kv_cache::PagedKvCache;
pub use llama::{LlamaShape, LlamaWeights, LoadError};
pub use loaded::{load_tokenizer, LoadedModel, ModelError};
pub use tokenizer::{ChatMessage, IncrementalDecoder, Tokenizer};
