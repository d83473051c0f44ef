//! LoRA adapters in the serving forward: after each of a block's four products, every row whose
//! sequence has an adapter gets that adapter's low-rank updates of the product added to its own
//! columns (`ferry_model::lora`). The base product runs once over the whole batch, whatever
//! adapters its rows have, and each update is one row's own arithmetic in a fixed order, so a
//! sequence computes the same with any neighbours, as the rest of the forward does.

use ferry_model::lora::{LoraAdapter, LoraDelta, Product};
use rayon::prelude::*;

/// Rows per task: an update is a few thousand multiply-adds a row.
const ROWS_PER_TASK: usize = 8;

/// Adds layer `l`'s updates of `product` to `out`, computed from `x`, the product's input: row
/// `r` of each with `adapters[r]`'s (none when `adapters` is empty: no row has one).
pub(super) fn add_updates(
    adapters: &[Option<&LoraAdapter>],
    l: usize,
    product: Product,
    x: &[f32],
    out: &mut [f32],
) {
    let n = adapters.len();
    if n == 0 {
        return;
    }
    let (in_w, out_w) = (x.len() / n, out.len() / n);
    // The widest vectors the CPU has, chosen once for all the rows: the arithmetic (no fused
    // multiply-adds) is the same on every path, so results do not depend on the CPU.
    #[cfg(target_arch = "x86_64")]
    let wide = std::arch::is_x86_feature_detected!("avx2");
    out.par_chunks_mut(out_w)
        .zip(x.par_chunks(in_w))
        .zip(adapters.par_iter())
        .with_min_len(ROWS_PER_TASK)
        .for_each_init(Vec::new, |t, ((o, x), adapter)| {
            let Some(adapter) = adapter else { return };
            let deltas = adapter.layers[l].deltas(product);
            #[cfg(target_arch = "x86_64")]
            if wide {
                // SAFETY: the CPU has AVX2 (checked above).
                unsafe { add_row_avx2(deltas, x, o, t) };
                return;
            }
            add_row(deltas, x, o, t);
        });
}

/// One row's updates. Always inlined: in [`add_row_avx2`] it must compile in that function's
/// AVX2 context.
#[allow(clippy::inline_always)]
#[inline(always)]
fn add_row(deltas: &[LoraDelta], x: &[f32], out: &mut [f32], t: &mut Vec<f32>) {
    for d in deltas {
        d.add_to(x, out, t);
    }
}

/// [`add_row`] compiled for AVX2: `add_to` is inlined here and vectorised 8 lanes wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn add_row_avx2(deltas: &[LoraDelta], x: &[f32], out: &mut [f32], t: &mut Vec<f32>) {
    add_row(deltas, x, out, t);
}
