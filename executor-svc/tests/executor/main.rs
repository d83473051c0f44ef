//! The executor's tests through its public API, in one test binary (each links the executor
//! with candle and the kernels, optimized: linking one binary instead of four saves minutes of
//! a CI build): the engine's step protocol on the real model (`engine`), the paged forward and
//! the reference forward against an exact one (`paged_forward`, `reference_model`, `exact`),
//! Llama-family files against a forward after Hugging Face's modeling code (`families`), and KV
//! export and import through a real agent (`kv_transfer`), looped models (`looped`), LoRA adapters
//! (`lora`). `generated` writes the files their scripts make once for every test process.

mod engine;
mod exact;
mod families;
// Shared with the real-process tests, which use the files its scripts write.
#[path = "../../../tests/src/generated.rs"]
mod generated;
mod kv_transfer;
mod looped;
mod lora;
mod paged_forward;
mod reference_model;
