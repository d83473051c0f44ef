//! LoRA adapters in the serving forward: after each of a block's four products, every row whose
//! sequence has an adapter gets that adapter's low-rank updates of the product added to its own
//! columns (`ferry_model::lora`). The base product runs once over the whole batch, whatever
//! adapters its rows have, and each update is one row's own arithmetic in a fixed order, so a
//! sequence computes the same with any neighbours, as the rest of the forward does.

use ferry_model::lora::{LoraAdapter, Product};
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
    out.par_chunks_mut(out_w)
        .zip(x.par_chunks(in_w))
        .zip(adapters.par_iter())
        .with_min_len(ROWS_PER_TASK)
        .for_each_init(Vec::new, |t, ((o, x), adapter)| {
            let Some(adapter) = adapter else { return };
            for delta in adapter.layers[l].deltas(product) {
                delta.add_to(x, o, t);
            }
        });
}
