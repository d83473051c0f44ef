//! A simulated GPU group: peak rates, how much of them real kernels reach, and the fixed costs
//! of a step and of an all-reduce — the roofline's view of the hardware (a hardware profile
//! converts to one, [`crate::HardwareProfile::to_sim`]).
//!
//! Invariant: [`SimHardware::validate`] names the first unusable field, but the formulas do not
//! depend on it: they take the tensor-parallel degree as at least 1 ([`SimHardware::tp`]), and a
//! zero or NaN rate saturates a step's time instead of dividing by zero.

use crate::validation::{fraction, non_negative, positive, SimConfigError};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// One simulated GPU and its group: peak rates, how much of them real kernels get, and costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimHardware {
    /// Dense bf16 tensor throughput per GPU, in TFLOP/s.
    pub tflops: f64,
    /// Memory bandwidth per GPU, in GB/s.
    pub mem_bandwidth_gbps: f64,
    /// Memory per GPU, in bytes.
    pub mem_bytes: u64,
    /// GPUs a model is sharded over (tensor parallelism); at least 1.
    pub tensor_parallel: u32,
    /// Fraction of `tflops` that matmuls reach, in (0, 1].
    pub compute_efficiency: f64,
    /// Fraction of `mem_bandwidth_gbps` that streaming reads reach, in (0, 1].
    pub bandwidth_efficiency: f64,
    /// Fixed cost of a step (scheduling, launches, sampling), in microseconds.
    pub overhead_us: f64,
    /// GPU-to-GPU bandwidth per direction (`NVLink` or `PCIe`), in GB/s; used when tp > 1.
    pub interconnect_gbps: f64,
    /// Fixed latency of one all-reduce, in microseconds; used when tp > 1.
    pub allreduce_latency_us: f64,
    /// Node-to-node bandwidth per GPU (what a KV transfer between nodes gets), in GB/s.
    pub network_gbps: f64,
}

impl SimHardware {
    /// NVIDIA A100 SXM 80 GB: 312 TFLOP/s, 2039 GB/s, `NVLink` 3 (300 GB/s per direction).
    pub fn a100_80g() -> Self {
        Self {
            tflops: 312.0,
            mem_bandwidth_gbps: 2039.0,
            mem_bytes: 80 * GIB,
            tensor_parallel: 1,
            compute_efficiency: 0.6,
            bandwidth_efficiency: 0.8,
            overhead_us: 200.0,
            interconnect_gbps: 300.0,
            allreduce_latency_us: 10.0,
            network_gbps: 25.0,
        }
    }

    /// NVIDIA H100 SXM 80 GB: 989 TFLOP/s, 3350 GB/s, `NVLink` 4 (450 GB/s per direction).
    pub fn h100_80g() -> Self {
        Self {
            tflops: 989.0,
            mem_bandwidth_gbps: 3350.0,
            mem_bytes: 80 * GIB,
            tensor_parallel: 1,
            compute_efficiency: 0.6,
            bandwidth_efficiency: 0.8,
            overhead_us: 150.0,
            interconnect_gbps: 450.0,
            allreduce_latency_us: 8.0,
            network_gbps: 50.0,
        }
    }

    /// NVIDIA L4 24 GB: 121 TFLOP/s, 300 GB/s, `PCIe` 4 x16 between GPUs (~25 GB/s usable).
    pub fn l4() -> Self {
        Self {
            tflops: 121.0,
            mem_bandwidth_gbps: 300.0,
            mem_bytes: 23_034 * MIB,
            tensor_parallel: 1,
            compute_efficiency: 0.6,
            bandwidth_efficiency: 0.8,
            overhead_us: 200.0,
            interconnect_gbps: 25.0,
            allreduce_latency_us: 20.0,
            network_gbps: 12.5,
        }
    }

    /// The same GPUs, `tensor_parallel` of them per model replica.
    #[must_use]
    pub fn with_tensor_parallel(self, tensor_parallel: u32) -> Self {
        Self { tensor_parallel, ..self }
    }

    /// Checks every field is usable, naming the first that is not.
    pub fn validate(&self) -> Result<(), SimConfigError> {
        positive("tflops", self.tflops)?;
        positive("mem_bandwidth_gbps", self.mem_bandwidth_gbps)?;
        positive("mem_bytes", self.mem_bytes as f64)?;
        positive("tensor_parallel", f64::from(self.tensor_parallel))?;
        fraction("compute_efficiency", self.compute_efficiency)?;
        fraction("bandwidth_efficiency", self.bandwidth_efficiency)?;
        non_negative("overhead_us", self.overhead_us)?;
        non_negative("allreduce_latency_us", self.allreduce_latency_us)?;
        if self.tensor_parallel > 1 {
            positive("interconnect_gbps", self.interconnect_gbps)?;
        }
        positive("network_gbps", self.network_gbps)?;
        Ok(())
    }

    /// GPUs of the group as a number, at least 1 (a degenerate 0 counts as 1).
    pub(crate) fn tp(&self) -> f64 {
        f64::from(self.tensor_parallel.max(1))
    }
}
