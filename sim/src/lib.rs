//! Ferry's cluster simulator (DESIGN.md section 5): a discrete-event simulation ([`des`]) of the
//! real scheduling core and router over many simulated executors, fed by generated or traced
//! workloads ([`workload`]). A step's time comes from the roofline over its actual batch, and
//! GPUs and models are described by profiles: both are `ferry-roofline`'s, the crate the `sim`
//! executor backend (`ferry-executor --backend sim`) also takes its timing from, so a
//! simulated GPU behaves the same as a process behind the real control plane and inside
//! `ferry-sim`.

pub mod des;
pub mod plot;
pub mod stats;
pub mod workload;
