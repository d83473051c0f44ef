//! The CPU forward pass: the weights as the executor loads them, the paged KV cache and the
//! serving forward over it, and the reference forward the serving path is checked against.
//! What the rest of Ferry knows about a model (header, shape, tokenizer, fetch, fingerprint) is
//! `ferry-model`'s; this folder is only how the executor computes with one.

// Byte views of the cache's f32 / f16 storage for KV transfers.
#[allow(unsafe_code)]
pub mod kv_cache;
pub mod llama;
pub mod loaded;
// One `#[target_feature]` function for the adapters' updates, behind a runtime CPU check.
#[allow(unsafe_code)]
mod lora;
// The attention inner loops in AVX-512 / AVX2 intrinsics behind a runtime feature check (see
// `attend`).
#[allow(unsafe_code)]
pub mod attention;
pub mod batch;
pub mod ops;
// The forward's parts write and read the KV cache at once, each on its own sequences
// (`SharedKv`'s contracts).
#[allow(unsafe_code)]
pub mod paged;
pub mod reference;
pub mod stages;
pub mod synthetic;

pub use ferry_model::{default_model_path, LlamaShape, ModelFile};
pub use kv_cache::{KvDtype, PagedKvCache};
pub use llama::{LlamaWeights, LoadError};
pub use loaded::{LoadedModel, ModelError};
