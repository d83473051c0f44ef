//! The small numeric kernels both forwards share, on row-major `f32` slices: RMS norm, the
//! rotary embedding (either pairing of `RopeStyle`), biases, `SiLU` and GELU gating, and the
//! product against a quantized `[out, in]` weight.

use ferry_model::{Activation, RopeStyle};

use crate::kernels::Matrix;

/// `x · wᵀ` for the rows of `x` (`w`'s inputs wide) → `rows × w`'s outputs, row-major.
pub fn linear(x: &[f32], w: &impl Matrix) -> Vec<f32> {
    let mut out = Vec::new();
    linear_into(x, w, &mut out);
    out
}

/// `x · wᵀ` into `out` (resized to `rows × outputs`; its allocation is reused).
pub fn linear_into(x: &[f32], w: &impl Matrix, out: &mut Vec<f32>) {
    let rows = x.len() / w.in_features();
    out.resize(rows * w.out_features(), 0.0);
    w.product(x, rows, out);
}

/// Rows per task of the row-wise operations below (each row is a few hundred floats; a long
/// prefill's thousands of rows split between the threads, a decode step's few stay on one).
const ROWS_PER_TASK: usize = 32;

/// RMS-normalises each row of `x` (width `weight.len()`) and scales it by `weight`, in place,
/// rows in parallel.
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    use rayon::prelude::*;
    x.par_chunks_mut(ROWS_PER_TASK * weight.len()).for_each(|rows| {
        for row in rows.chunks_exact_mut(weight.len()) {
            rms_norm_row(row, weight, eps);
        }
    });
}

/// One row of [`rms_norm`]: the mean square summed in order, then `v · (scale · w)`.
pub(crate) fn rms_norm_row(row: &mut [f32], weight: &[f32], eps: f32) {
    let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / weight.len() as f32;
    let scale = 1.0 / (mean_sq + eps).sqrt();
    for (v, w) in row.iter_mut().zip(weight) {
        *v *= scale * w;
    }
}

/// The residual stream's step between sub-layers: `x += add` (when given), then `out` = `x`
/// through [`rms_norm`] — the same operations as the add, the copy and the norm one after the
/// other (so the same bits), in one pass over each row, rows in parallel.
pub fn add_rms_norm(
    x: &mut [f32],
    add: Option<&[f32]>,
    weight: &[f32],
    eps: f32,
    out: &mut Vec<f32>,
) {
    use rayon::prelude::*;
    let width = weight.len();
    out.resize(x.len(), 0.0);
    let step = ROWS_PER_TASK * width;
    let tasks = x.par_chunks_mut(step).zip(out.par_chunks_mut(step)).enumerate();
    tasks.for_each(|(t, (xs, outs))| {
        if let Some(add) = add {
            xs.iter_mut().zip(&add[t * step..]).for_each(|(a, b)| *a += b);
        }
        outs.copy_from_slice(xs);
        for row in outs.chunks_exact_mut(width) {
            rms_norm_row(row, weight, eps);
        }
    });
}

/// The rotary frequencies `scale · theta^(-2i/d)` for `i < d/2`, computed once per model
/// (`scale`: linear rotary scaling, 1 without).
pub fn rope_frequencies(head_dim: usize, theta: f32, scale: f32) -> Vec<f32> {
    (0..head_dim / 2).map(|i| scale * theta.powf(-(2.0 * i as f32) / head_dim as f32)).collect()
}

/// The rotary embedding's sines and cosines for position `pos`, one per frequency (pair `i`
/// turns by `pos · freqs[i]`), each times `mscale` (`LongRoPE`'s attention factor; 1: the
/// plain rotation, exactly): the same for every head and layer, so a forward computes them
/// once per token.
pub fn rope_angles(pos: usize, freqs: &[f32], mscale: f32, out: &mut [(f32, f32)]) {
    for (sc, freq) in out.iter_mut().zip(freqs) {
        let (sin, cos) = (pos as f32 * freq).sin_cos();
        *sc = (sin * mscale, cos * mscale);
    }
}

/// Rotates one head vector by [`rope_angles`]: pair `i` turns by angle `i`, the pair being
/// (x[2i], x[2i+1]) or (x[i], x[i + d/2]) as `style` says.
pub fn rope_rotate(head: &mut [f32], angles: &[(f32, f32)], style: RopeStyle) {
    // Where pair `i`'s two values are: `step · i` and `step · i + offset`.
    let (step, offset) = match style {
        RopeStyle::Adjacent => (2, 1),
        RopeStyle::Halves => (1, angles.len()),
    };
    for (i, &(sin, cos)) in angles.iter().enumerate() {
        let (ia, ib) = (step * i, step * i + offset);
        let (a, b) = (head[ia], head[ib]);
        head[ia] = a * cos - b * sin;
        head[ib] = a * sin + b * cos;
    }
}

/// A row's projections plus their bias, where the model has one (Qwen 2's Q, K and V).
pub fn add_bias(row: &mut [f32], bias: Option<&[f32]>) {
    if let Some(bias) = bias {
        for (x, b) in row.iter_mut().zip(bias) {
            *x += b;
        }
    }
}

/// From rows of `[gate | up]` (each `width` wide), `act(gate) · up` per row.
pub fn gate_mul(act: Activation, fused: &[f32], width: usize) -> Vec<f32> {
    let mut out = Vec::new();
    gate_mul_into(act, fused, width, &mut out);
    out
}

/// [`gate_mul`] into `out` (its allocation reused), rows in parallel.
pub fn gate_mul_into(act: Activation, fused: &[f32], width: usize, out: &mut Vec<f32>) {
    use rayon::prelude::*;
    out.resize(fused.len() / 2, 0.0);
    out.par_chunks_mut(width).zip(fused.par_chunks(2 * width)).for_each(|(dst, row)| {
        let (gate, up) = row.split_at(width);
        match act {
            Activation::Silu => super::attention::silu_mul_row(gate, up, dst),
            Activation::GeluTanh => gelu_mul_row(gate, up, dst),
        }
    });
}

/// `gelu(g) · u` for each element of one row, GELU in its tanh form as PyTorch's
/// `gelu(approximate="tanh")` computes it: `g/2 · (1 + tanh(√(2/π) · (g + 0.044715 g³)))`.
pub fn gelu_mul_row(gate: &[f32], up: &[f32], dst: &mut [f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const KAPPA: f32 = 0.044_715;
    for ((d, &g), &u) in dst.iter_mut().zip(gate).zip(up) {
        let inner = SQRT_2_OVER_PI * (g + KAPPA * g * g * g);
        *d = 0.5 * g * (1.0 + inner.tanh()) * u;
    }
}

/// Splits rows of `[q | k | v]` into three row-major matrices of widths `q_width` and `kv_width`.
pub fn split_qkv(fused: &[f32], q_width: usize, kv_width: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = fused.len() / (q_width + 2 * kv_width);
    let (mut q, mut k, mut v) = (
        Vec::with_capacity(rows * q_width),
        Vec::with_capacity(rows * kv_width),
        Vec::with_capacity(rows * kv_width),
    );
    for row in fused.chunks_exact(q_width + 2 * kv_width) {
        q.extend_from_slice(&row[..q_width]);
        k.extend_from_slice(&row[q_width..q_width + kv_width]);
        v.extend_from_slice(&row[q_width + kv_width..]);
    }
    (q, k, v)
}

/// Index of the largest value (the first on ties); `None` for an empty slice.
pub fn argmax(xs: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in xs.iter().enumerate() {
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}
