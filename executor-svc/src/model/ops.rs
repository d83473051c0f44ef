//! The small numeric kernels both forwards share, on row-major `f32` slices: RMS norm, the
//! rotary embedding (adjacent-pair convention of GGUF Llama), SiLU gating, and a matrix
//! product against an `[out, in]` weight through candle.

use candle_core::{Device, Tensor};

/// `x[rows × w.in] · wᵀ` → `rows × w.out`, row-major.
pub fn linear(x: &[f32], rows: usize, w: &Tensor) -> candle_core::Result<Vec<f32>> {
    let (_out, inp) = w.dims2()?;
    let x = Tensor::from_slice(x, (rows, inp), &Device::Cpu)?;
    x.matmul(&w.t()?)?.flatten_all()?.to_vec1::<f32>()
}

/// RMS-normalises each row of `x` (width `weight.len()`) and scales it by `weight`, in place.
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let width = weight.len();
    for row in x.chunks_exact_mut(width) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
        let scale = 1.0 / (mean_sq + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v *= scale * w;
        }
    }
}

/// Rotates one head vector for position `pos`: pairs (x[2i], x[2i+1]) turn by
/// `pos · theta^(-2i/d)`.
pub fn rope(head: &mut [f32], pos: usize, theta: f32) {
    let d = head.len();
    for i in 0..d / 2 {
        let freq = theta.powf(-(2.0 * i as f32) / d as f32);
        let (sin, cos) = (pos as f32 * freq).sin_cos();
        let (a, b) = (head[2 * i], head[2 * i + 1]);
        head[2 * i] = a * cos - b * sin;
        head[2 * i + 1] = a * sin + b * cos;
    }
}

/// `gate ← silu(gate) · up`, element-wise.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
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
