//! Matrices the forward multiplies by: a packed matrix ([`QWeight`]) or several stacked by rows
//! ([`Stacked`]), behind one trait ([`Matrix`]) that the forwards and the CUDA upload take.

use super::{matmul, matmul_columns, Kernel, QWeight};

/// Matrices with the same inputs stacked by rows (Q, K and V; gate and up), computed by one
/// call: parts of one format are one packed matrix (one product), parts of different formats
/// (a `Q4_K_M` file's `Q6_K` values beside `Q4_K` queries and keys) one product each, their
/// outputs side by side as the stacked matrix's would be.
#[derive(Clone, Debug)]
pub struct Stacked {
    /// Output features, all parts together.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Runs of parts of one format, each packed into one matrix, in order.
    parts: Vec<QWeight>,
}

impl Stacked {
    /// Stacks `parts` (same inputs; `None` when they differ or there is none).
    pub fn new(parts: &[&QWeight]) -> Option<Self> {
        let cols = parts.first()?.cols;
        if parts.iter().any(|p| p.cols != cols) {
            return None;
        }
        let mut runs: Vec<QWeight> = Vec::new();
        let mut i = 0;
        while i < parts.len() {
            let same = parts[i..].iter().take_while(|p| p.format == parts[i].format).count();
            runs.push(QWeight::concat(&parts[i..i + same])?);
            i += same;
        }
        Some(Self { rows: runs.iter().map(|p| p.rows).sum(), cols, parts: runs })
    }

    /// The packed matrices, in order (one when every part has one format).
    pub fn parts(&self) -> &[QWeight] {
        &self.parts
    }

    /// The dequantized weight row `r`.
    pub fn dequantize_row(&self, mut r: usize, out: &mut [f32]) {
        for p in &self.parts {
            if r < p.rows {
                return p.dequantize_row(r, out);
            }
            r -= p.rows;
        }
        panic!("row {r} past the stacked matrix's {} rows", self.rows);
    }

    /// Bytes of weight data.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(QWeight::bytes).sum()
    }
}

/// `out[r, o] = Σ_k x[r, k] · w[o, k]` for a stacked matrix (as [`matmul`]): each part's
/// product writes its own columns of `out`.
pub fn matmul_stacked(x: &[f32], rows: usize, w: &Stacked, out: &mut [f32]) {
    assert_eq!(out.len(), rows * w.rows, "output buffer must be rows × outputs");
    let mut col0 = 0;
    for p in &w.parts {
        matmul_columns(x, rows, p, (&mut *out, w.rows, col0), Kernel::best());
        col0 += p.rows;
    }
}

/// A weight matrix the forward multiplies by: one packed matrix or a stack.
pub trait Matrix: Sync {
    /// Output features.
    fn out_features(&self) -> usize;
    /// Input features.
    fn in_features(&self) -> usize;
    /// `out = x · wᵀ` for `rows` rows (as [`matmul`]).
    fn product(&self, x: &[f32], rows: usize, out: &mut [f32]);
    /// The dequantized weight row `r`.
    fn row(&self, r: usize, out: &mut [f32]);
}

impl Matrix for QWeight {
    fn out_features(&self) -> usize {
        self.rows
    }
    fn in_features(&self) -> usize {
        self.cols
    }
    fn product(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        matmul(x, rows, self, out);
    }
    fn row(&self, r: usize, out: &mut [f32]) {
        self.dequantize_row(r, out);
    }
}

impl Matrix for Stacked {
    fn out_features(&self) -> usize {
        self.rows
    }
    fn in_features(&self) -> usize {
        self.cols
    }
    fn product(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        matmul_stacked(x, rows, self, out);
    }
    fn row(&self, r: usize, out: &mut [f32]) {
        self.dequantize_row(r, out);
    }
}
