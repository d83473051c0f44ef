//! LoRA adapters on the GPU, with the CPU forward's plan (`crate::forward::lora`): the base
//! product runs once over the whole batch, then every row whose sequence has an adapter gets
//! that adapter's low-rank updates of the product added to its own columns (`lora_add`, one
//! launch per adapter and update, its rows listed). Each adapter's matrices are copied to the
//! device the first time a batch needs them, keyed by the reading's id
//! ([`LoraAdapter::id`]), and the least recently used copies beyond [`KEPT`] are freed.
//!
//! `unsafe` here is the kernel launch, as in [`super::launch`]: the buffer lengths the kernel
//! relies on are checked before it.
#![allow(unsafe_code)]

use std::collections::HashMap;

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use ferry_model::lora::{LoraAdapter, LoraDelta, Product};

use super::device::Gpu;
use super::kernels::ROW_THREADS;
use super::launch::int;
use super::CudaError;
use crate::forward::paged::SeqSlice;

/// Largest rank the kernel takes (its `LORA_MAX_RANK`).
pub const MAX_RANK: usize = 256;

/// Adapters whose copies stay on the device (the executor's `--max-loras` is usually fewer).
const KEPT: usize = 16;

/// One update of a product, on the device.
struct DeviceDelta {
    a: CudaSlice<f32>,
    bt: CudaSlice<f32>,
    rank: usize,
    in_features: usize,
    out_features: usize,
    col: usize,
    scale: f32,
}

/// An adapter's updates on the device, by block and product.
struct DeviceAdapter {
    layers: Vec<[Vec<DeviceDelta>; 4]>,
    last_used: u64,
}

/// The rows of one batch that run one adapter.
pub struct AdapterRows {
    /// The adapter's id.
    id: u64,
    /// The rows, on the device.
    rows: CudaSlice<u32>,
    /// How many.
    n: usize,
    /// One past the last (the rows `x` and `out` must hold).
    end: usize,
}

/// The adapters copied to the device.
#[derive(Default)]
pub struct DeviceAdapters {
    by_id: HashMap<u64, DeviceAdapter>,
    clock: u64,
}

impl DeviceAdapters {
    /// Copies what `batch`'s adapters need to the device and lists each adapter's rows (rows
    /// are the batch's tokens in batch order); empty when no sequence has an adapter.
    pub fn prepare(
        &mut self,
        gpu: &Gpu,
        batch: &[SeqSlice],
    ) -> Result<Vec<AdapterRows>, CudaError> {
        self.clock += 1;
        let mut rows: Vec<(u64, Vec<u32>)> = Vec::new();
        let mut first = 0u32;
        for s in batch {
            let len = s.tokens.len() as u32;
            if let Some(adapter) = s.adapter {
                self.upload(gpu, adapter)?;
                let at = rows.iter().position(|(id, _)| *id == adapter.id).unwrap_or_else(|| {
                    rows.push((adapter.id, Vec::new()));
                    rows.len() - 1
                });
                rows[at].1.extend(first..first + len);
            }
            first += len;
        }
        self.evict();
        let upload = CudaError::driver("copying a batch's adapter rows to the device");
        rows.into_iter()
            .map(|(id, list)| {
                let (n, end) = (list.len(), list.last().map_or(0, |&r| r as usize + 1));
                let rows = gpu.stream.clone_htod(&list).map_err(upload)?;
                Ok(AdapterRows { id, rows, n, end })
            })
            .collect()
    }

    /// Copies `adapter` to the device unless it is there; marks it used now.
    fn upload(&mut self, gpu: &Gpu, adapter: &LoraAdapter) -> Result<(), CudaError> {
        let clock = self.clock;
        if let Some(held) = self.by_id.get_mut(&adapter.id) {
            held.last_used = clock;
            return Ok(());
        }
        let copy = CudaError::driver("copying a LoRA adapter to the device");
        let delta = |d: &LoraDelta| -> Result<DeviceDelta, CudaError> {
            Ok(DeviceDelta {
                a: gpu.stream.clone_htod(&d.a).map_err(copy)?,
                bt: gpu.stream.clone_htod(&d.bt).map_err(copy)?,
                rank: d.rank(),
                in_features: d.in_features,
                out_features: d.out_features,
                col: d.col,
                scale: d.scale,
            })
        };
        let mut layers = Vec::with_capacity(adapter.layers.len());
        for layer in &adapter.layers {
            let product =
                |p: Product| layer.deltas(p).iter().map(delta).collect::<Result<Vec<_>, _>>();
            layers.push([
                product(Product::Qkv)?,
                product(Product::O)?,
                product(Product::GateUp)?,
                product(Product::Down)?,
            ]);
        }
        self.by_id.insert(adapter.id, DeviceAdapter { layers, last_used: clock });
        Ok(())
    }

    /// Frees the least recently used copies beyond [`KEPT`] (never one this batch uses).
    fn evict(&mut self) {
        while self.by_id.len() > KEPT {
            let oldest = self.by_id.iter().min_by_key(|(_, a)| a.last_used).map(|(id, a)| (*id, a));
            match oldest {
                Some((id, a)) if a.last_used < self.clock => {
                    self.by_id.remove(&id);
                }
                _ => break,
            }
        }
    }

    /// Adds block `l`'s updates of `product` to `out` (rows `out_width` wide), computed from
    /// `x` (the product's input), on each adapter's rows.
    pub fn apply(
        &self,
        gpu: &Gpu,
        batch: &[AdapterRows],
        (l, product): (usize, Product),
        x: &CudaSlice<f32>,
        (out, out_width): (&mut CudaSlice<f32>, usize),
    ) -> Result<(), CudaError> {
        for group in batch {
            let adapter = self.by_id.get(&group.id).expect("prepared for this batch");
            let Some(layer) = adapter.layers.get(l) else { continue };
            for d in &layer[product as usize] {
                add(gpu, d, group, x, (out, out_width))?;
            }
        }
        Ok(())
    }
}

/// One update `d` on `group`'s rows: `out[row, d.col ..] += d.scale · Bᵀ (A x[row])`.
fn add(
    gpu: &Gpu,
    d: &DeviceDelta,
    group: &AdapterRows,
    x: &CudaSlice<f32>,
    (out, out_width): (&mut CudaSlice<f32>, usize),
) -> Result<(), CudaError> {
    assert!(d.rank <= MAX_RANK, "an adapter past the kernel's rank was let through");
    assert!(d.col + d.out_features <= out_width, "an update past its product's columns");
    assert!(
        d.a.len() >= d.rank * d.in_features && d.bt.len() >= d.rank * d.out_features,
        "LoRA matrices too small"
    );
    assert!(
        x.len() >= group.end * d.in_features && out.len() >= group.end * out_width,
        "LoRA buffers too small for the listed rows"
    );
    let (n, rank, in_f) = (int(group.n), int(d.rank), int(d.in_features));
    let (col, out_f, out_w) = (int(d.col), int(d.out_features), int(out_width));
    let mut b = gpu.stream.launch_builder(&gpu.kernels.lora_add);
    b.arg(out).arg(x).arg(&group.rows).arg(&n).arg(&d.a).arg(&d.bt);
    b.arg(&rank).arg(&in_f).arg(&in_f).arg(&col).arg(&out_f).arg(&out_w).arg(&d.scale);
    let config = LaunchConfig {
        grid_dim: (group.n as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature (x rows are the update's input
    // width); `a` and `bt` hold the matrices the ranks and widths describe, the rank is within
    // the kernel's, `x` and `out` hold every listed row (all checked above); blocks have
    // ROW_THREADS threads, a multiple of 32.
    unsafe { b.launch(config) }.map_err(CudaError::driver("launching lora_add"))?;
    Ok(())
}
