//! The execution engine: what turns a scheduled step into sampled tokens. `step` holds the
//! per-request state and applies each validated `Step`; `backend` runs batches (the real model
//! on the CPU, or the simulator); `cuda` (feature `cuda`) runs the real model on a GPU.
//! `sampling` picks each
//! request's next token from its logits, after `grammar` masks a constrained request's;
//! `simulated_gpu` is the simulated GPU (tokens, clock, the roofline timing model) behind the
//! `sim` backend, so many simulated GPUs can run on one machine (DESIGN.md section 5).

pub mod backend;
// CUDA through cudarc: kernel launches, cuBLAS calls and dynamic library loading are `unsafe`
// by their nature; each call site states the invariant it relies on.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod cuda;
// Test infrastructure: the CPU emulation of CUDA the `cuda` backend's tests run under. Building
// it needs no feature (a test starting `ferry serve --backend cuda` builds it); loading it into
// a process (`unsafe`: dynamic loading) comes with `cuda`.
#[cfg_attr(feature = "cuda", allow(unsafe_code))]
pub mod cuda_emulation;
pub mod grammar;
pub mod kv;
pub mod looped;
pub mod lora;
pub mod sampling;
pub mod simulated_gpu;
pub mod step;

pub use backend::{BackendFacts, BatchOutput, CpuBackend, ModelBackend, SimBackend, StageResult};
#[cfg(feature = "cuda")]
pub use cuda::{CudaBackend, CudaError};
pub use step::{Engine, EngineConfig, StepError};
