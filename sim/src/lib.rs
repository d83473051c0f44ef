//! Ferry's cluster simulator (DESIGN.md section 5): GPUs and models described by profiles
//! ([`profile`]), a step's time from a roofline over its actual batch ([`roofline`]), and a
//! discrete-event simulation ([`des`]) of the real scheduling core and router over many
//! simulated executors, fed by generated or traced workloads ([`workload`]).
//!
//! The roofline is also the `sim` executor backend's timing model (`ferry-executor --backend
//! sim`), so a simulated GPU behaves the same as a process behind the real control plane
//! and inside `ferry-sim`.

pub mod des;
pub mod plot;
pub mod profile;
pub mod roofline;
pub mod stats;
pub mod workload;
