//! Ferry's roofline timing model: how long a GPU would take for a step of a given batch
//! ([`step_cost`]), and how many KV blocks it would hold ([`kv_capacity_blocks`]), for a GPU
//! ([`SimHardware`]) and a model ([`SimModel`]) described by data-file profiles ([`Profiles`]).
//!
//! Both the cluster simulator (`ferry-sim`, many executors in virtual time) and the executor's
//! simulated-GPU backend (`ferry-executor --backend sim`, one process behind the real control
//! plane) take their step times and KV capacity from here: one timing model for both, so a
//! simulated GPU behaves the same in either.
//!
//! Why a crate of its own: the executor needs the model and the profiles, not the simulator's
//! event loop, workloads and plotting; and the profiles sit above the descriptions they convert
//! to (`profile` imports `hardware` and `model_shape`, never the other way round).

mod hardware;
mod kv_capacity;
mod model_shape;
mod profile;
mod step_cost;
mod validation;

pub use hardware::SimHardware;
pub use kv_capacity::{activation_bytes, kv_capacity_blocks};
pub use model_shape::SimModel;
pub use profile::{dtype_bytes, HardwareProfile, ModelProfile, ProfileError, Profiles};
pub use step_cost::{stage_cost, step_cost, step_duration, SimBatchItem, StageSpan, StepCost};
pub use validation::SimConfigError;
