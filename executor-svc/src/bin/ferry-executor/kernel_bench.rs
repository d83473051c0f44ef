//! `ferry-executor bench --kernels`: the matrix products alone — each kernel this CPU runs, on
//! the first layer's matrices and the output head, for chosen activation row counts: where the
//! memory-bound (fused) path gives way to the panel path, and what each instruction set gives.

use std::time::Instant;

use ferry_executor_svc::forward::{LlamaWeights, LoadedModel};
use ferry_executor_svc::kernels::{matmul_with, Kernel, QWeight};

/// One product's speed: a weight matrix of the model against `rows` activation rows.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KernelRow {
    /// Which matrix (`[outputs, inputs]`).
    pub weight: String,
    /// Activation rows.
    pub rows: usize,
    /// Kernel.
    pub kernel: &'static str,
    /// Multiply-adds ×2 per second, billions.
    pub gflops: f64,
    /// Weight bytes read per second (once per product), GB.
    pub weight_gbs: f64,
}

/// Times each kernel this CPU runs on the first layer's products and the output head, for
/// each row count in `rows`: where the memory-bound (fused) path gives way to the panel path,
/// and what each instruction set gives.
fn run_kernels(
    w: &LlamaWeights,
    rows: &[usize],
    mut progress: impl FnMut(&KernelRow) + Send,
) -> Vec<KernelRow> {
    let l0 = &w.layers[0];
    // A stack of parts of different formats is one product per part: its first is timed.
    let mats: [(&str, &QWeight); 4] = [
        ("qkv", &l0.wqkv.parts()[0]),
        ("gate_up", &l0.w_gate_up.parts()[0]),
        ("down", &l0.w_down),
        ("lm_head", &w.lm_head),
    ];
    let mut out_rows = Vec::new();
    ferry_executor_svc::forward::paged::in_pool(|| {
        for (name, m) in mats {
            for &n in rows {
                let x: Vec<f32> =
                    (0..n * m.cols).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
                let mut out = vec![0f32; n * m.rows];
                for kernel in Kernel::available().into_iter().filter(|k| *k != Kernel::Portable) {
                    matmul_with(&x, n, m, &mut out, kernel);
                    let (mut reps, start) = (0u32, Instant::now());
                    while start.elapsed().as_secs_f64() < 0.2 {
                        matmul_with(&x, n, m, &mut out, kernel);
                        reps += 1;
                    }
                    let secs = start.elapsed().as_secs_f64() / f64::from(reps);
                    let row = KernelRow {
                        weight: format!("{name} [{}, {}]", m.rows, m.cols),
                        rows: n,
                        kernel: kernel.name(),
                        gflops: 2.0 * (n * m.rows * m.cols) as f64 / secs / 1e9,
                        weight_gbs: m.bytes() as f64 / secs / 1e9,
                    };
                    progress(&row);
                    out_rows.push(row);
                }
            }
        }
    });
    out_rows
}

/// Times the products on `model` (the default model when `None`) for each row count in `rows`
/// and prints a row per weight, row count and kernel.
pub(crate) fn report(model: Option<&std::path::Path>, rows: &[usize]) -> anyhow::Result<()> {
    let model = LoadedModel::open(model)?;
    let weights = &model.weights;
    println!(
        "{:<24} {:>5} {:>8} {:>9} {:>11}",
        "weight", "rows", "kernel", "GFLOP/s", "weight GB/s"
    );
    run_kernels(weights, rows, |r| {
        println!(
            "{:<24} {:>5} {:>8} {:>9.1} {:>11.1}",
            r.weight, r.rows, r.kernel, r.gflops, r.weight_gbs
        );
    });
    Ok(())
}
