//! The pieces a draw is made of: the position-keyed uniform number, rank keys for top-k and
//! top-p selection, the inverse CDF, and a vectorisable exponential.

use ferry_model::sampling::SamplingError;

/// A 64-bit hash of (seed, position): the counter-based generator behind every draw. `SplitMix64`'s
/// finaliser applied twice; for a fixed seed, distinct positions give distinct hashes.
pub fn position_hash(seed: u64, position: u64) -> u64 {
    splitmix64(splitmix64(seed) ^ position)
}

/// The uniform number in `[0, 1)` used to draw the token at `position` of a request seeded with
/// `seed`.
pub fn position_uniform(seed: u64, position: u64) -> f64 {
    // The top 53 bits fill an f64 mantissa exactly, so the result is < 1.
    (position_hash(seed, position) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

pub(super) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Lanes of the hand-unrolled reductions, so the compiler can vectorise them.
pub(super) const LANES: usize = 8;

/// Tokens per block of the inverse-CDF walk.
pub(super) const DRAW_BLOCK: usize = 512;

/// A key whose order is the sampling rank: higher value first, then lower id. Unique per id,
/// so "the k best" and "the nucleus" are exact sets whatever the ties.
pub(super) fn rank_key(value: f32, id: u32) -> u64 {
    // Map the float's bits to an unsigned integer with the same order (no NaN reaches here).
    let bits = value.to_bits();
    let ordered = if bits >> 31 == 1 { !bits } else { bits | 0x8000_0000 };
    (u64::from(ordered) << 32) | u64::from(!id)
}

/// The value encoded in a [`rank_key`].
pub(super) fn key_value(key: u64) -> f32 {
    let ordered = (key >> 32) as u32;
    f32::from_bits(if ordered >> 31 == 1 { ordered & 0x7FFF_FFFF } else { !ordered })
}

/// The weight encoded in a [`rank_key`] of a weight.
pub(super) fn key_weight(key: u64) -> f64 {
    f64::from(key_value(key))
}

/// Tokens per block for the top-k prefilter.
pub(super) const MAX_BLOCK: usize = 64;

/// The rank keys of the k best logits (0 < k < len), in no order; the first is the k-th best.
///
/// Selecting over the whole vocabulary costs ~100 us at 49k tokens, so for a small k it first
/// finds a floor: the k-th best of the per-block maxima. Each of those k blocks holds a token
/// at or above the floor, so the k best all are, and only blocks whose maximum reaches the
/// floor (k of them, plus ties) are scanned.
pub(super) fn top_k_keys<'k>(logits: &[f32], k: usize, keys: &'k mut Vec<u64>) -> &'k mut [u64] {
    keys.clear();
    let blocks = logits.len().div_ceil(MAX_BLOCK);
    let floor = if k <= blocks / 2 {
        let maxima = logits.chunks(MAX_BLOCK).enumerate();
        keys.extend(maxima.map(|(b, c)| rank_key(max_logit(c), b as u32)));
        let at = keys.len() - k;
        let floor = key_value(*keys.select_nth_unstable(at).1);
        keys.clear();
        floor
    } else {
        f32::NEG_INFINITY
    };
    for (b, block) in logits.chunks(MAX_BLOCK).enumerate() {
        if max_logit(block) < floor {
            continue;
        }
        let first = (b * MAX_BLOCK) as u32;
        let ids = (first..).zip(block).filter(|(_, &l)| l >= floor);
        keys.extend(ids.map(|(id, &l)| rank_key(l, id)));
    }
    let at = keys.len() - k;
    keys.select_nth_unstable(at);
    &mut keys[at..]
}

/// The rank key of the worst token of the top-p nucleus: the smallest set of best-ranked
/// tokens whose weights sum to at least `top_p` of the total. On return `keys` holds (in no
/// order) the keys of a superset of the nucleus. A weighted quickselect: expected
/// O(n) however large the nucleus, where sorting it would cost O(n log n).
pub(super) fn nucleus_cutoff(weights: &[f32], top_p: f32, keys: &mut Vec<u64>) -> u64 {
    // The mass still to cover within `rest`; always > 0 (the best token weighs 1).
    let mut need = f64::from(top_p) * mass_at_least(weights, 0.0);
    // Only tokens at least as heavy as `floor` can be in the nucleus once the tokens at or
    // above it hold `need`; halving it from 1/2 keeps the selection to the head of a peaked
    // distribution at the price of a few vectorised passes.
    let mut floor = 0.5;
    while floor > 1e-12 && mass_at_least(weights, floor) < need {
        floor *= 0.5;
    }
    if floor <= 1e-12 {
        floor = 0.0;
    }
    keys.clear();
    for (b, block) in weights.chunks(MAX_BLOCK).enumerate() {
        let heaviest = max_logit(block);
        if heaviest < floor || heaviest <= 0.0 {
            continue;
        }
        let first = (b * MAX_BLOCK) as u32;
        let ids = (first..).zip(block).filter(|(_, &w)| w > 0.0 && w >= floor);
        keys.extend(ids.map(|(id, &w)| rank_key(w, id)));
    }
    let mut rest = &mut keys[..];
    while rest.len() > 1 {
        let mid = rest.len() / 2;
        let (worse, pivot, better) = std::mem::take(&mut rest).select_nth_unstable(mid);
        let better_mass: f64 = better.iter().map(|&k| key_weight(k)).sum();
        let pivot = *pivot;
        if better_mass >= need {
            rest = better; // non-empty, as need > 0
        } else if better_mass + key_weight(pivot) >= need {
            return pivot;
        } else {
            need -= better_mass + key_weight(pivot);
            rest = worse;
        }
    }
    // One token left: the nucleus ends there (or rounding fell short: keep everything).
    rest.first().copied().unwrap_or(0)
}

/// Inverse-CDF draw over `weights` in id order: the first token whose cumulative weight
/// exceeds `u` times the total. Walks per-block sums, then within the block; the total is the
/// sum of the same block sums, so the walk always lands in a block, and rounding within it
/// falls back to that block's last drawable token.
pub(super) fn inverse_cdf(weights: &[f32], u: f64) -> u32 {
    let total: f64 = weights.chunks(DRAW_BLOCK).map(block_sum).sum();
    let target = u * total;
    let mut cumulative = 0.0;
    let mut last_block = 0;
    for (b, block) in weights.chunks(DRAW_BLOCK).enumerate() {
        let mass = block_sum(block);
        if mass <= 0.0 {
            continue;
        }
        last_block = b;
        if cumulative + mass > target {
            let mut pick = 0;
            for (i, &w) in block.iter().enumerate().filter(|&(_, &w)| w > 0.0) {
                pick = i;
                cumulative += f64::from(w);
                if cumulative > target {
                    break;
                }
            }
            return (b * DRAW_BLOCK + pick) as u32;
        }
        cumulative += mass;
    }
    // Only when u * total rounds up to total: the last drawable token.
    let block = weights.chunks(DRAW_BLOCK).nth(last_block).unwrap_or_default();
    (last_block * DRAW_BLOCK + block.iter().rposition(|&w| w > 0.0).unwrap_or(0)) as u32
}

/// The total of the weights that are at least `floor`, by blocks of lanes.
pub(super) fn mass_at_least(weights: &[f32], floor: f32) -> f64 {
    weights
        .chunks(DRAW_BLOCK)
        .map(|block| {
            let mut lanes = [0.0f32; LANES];
            let chunks = block.chunks_exact(LANES);
            let tail = chunks.remainder().iter().filter(|&&w| w >= floor);
            let tail: f64 = tail.map(|&w| f64::from(w)).sum();
            for chunk in chunks {
                for (lane, &w) in lanes.iter_mut().zip(chunk) {
                    *lane += if w >= floor { w } else { 0.0 };
                }
            }
            lanes.iter().map(|&l| f64::from(l)).sum::<f64>() + tail
        })
        .sum()
}

/// The sum of a block of weights, in lanes (each lane sums at most `DRAW_BLOCK` / LANES values
/// in f32, so precision is not at risk).
pub(super) fn block_sum(block: &[f32]) -> f64 {
    let mut lanes = [0.0f32; LANES];
    let chunks = block.chunks_exact(LANES);
    let tail: f64 = chunks.remainder().iter().map(|&w| f64::from(w)).sum();
    for chunk in chunks {
        for (lane, &w) in lanes.iter_mut().zip(chunk) {
            *lane += w;
        }
    }
    lanes.iter().map(|&l| f64::from(l)).sum::<f64>() + tail
}

/// The highest logit (NaN-free input), in lanes.
pub(super) fn max_logit(logits: &[f32]) -> f32 {
    let larger = |m: f32, l: f32| if l > m { l } else { m };
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder().iter().copied().fold(f32::NEG_INFINITY, larger);
    for chunk in chunks {
        for (lane, &l) in lanes.iter_mut().zip(chunk) {
            *lane = larger(*lane, l);
        }
    }
    lanes.into_iter().fold(tail, larger)
}

/// The highest logit's id, lowest id on ties.
pub(super) fn argmax(logits: &[f32]) -> Result<u32, SamplingError> {
    let max = max_logit(logits);
    if max == f32::NEG_INFINITY {
        return Err(SamplingError::NoFiniteLogit);
    }
    Ok(logits.iter().position(|&l| l == max).unwrap_or(0) as u32)
}

/// `ln(sum(exp(logits)))`, using `scratch` for the exponentials.
pub(super) fn log_sum_exp(logits: &[f32], scratch: &mut Vec<f32>) -> f64 {
    let max = max_logit(logits);
    if max == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    scratch.clear();
    scratch.extend(logits.iter().map(|&l| exp_nonpositive(l - max)));
    let sum: f64 = scratch.chunks(DRAW_BLOCK).map(block_sum).sum();
    f64::from(max) + sum.ln()
}

/// `e^x` for `x <= 0` (including `-inf`), within 2 ulp, and 0 below -87 (where the true value
/// is under 2^-125, below any weight that matters next to the best token's 1).
///
/// Why not `f32::exp`: it is a libm call per token, which does not vectorise (~5 ns each, a
/// quarter of a millisecond per 49k-token row), and libm results differ between platforms,
/// which would let two executors draw different tokens from the same logits. This uses only
/// IEEE-exact basic operations (no fused multiply-add), so it is fast and bit-reproducible.
/// Range reduction and polynomial are Cephes' `expf`.
pub(super) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4; // 0.693359375 exactly, as f32
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to the nearest integer n (its ulp is 1) and leaves n in the low
    // mantissa bits, so 2^n is built with integer operations (an `as i32` cast would saturate
    // and check for NaN, which stops vectorisation).
    const ROUND: f32 = 12_582_912.0;
    let clamped = if x > -87.0 { x } else { -87.0 };
    let shifted = clamped * LOG2_E + ROUND;
    let n = shifted - ROUND; // in [-126, 0]
    let r = clamped - n * LN2_HI - n * LN2_LO; // |r| <= ln(2) / 2
    let poly = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e_r = poly * r * r + r + 1.0;
    let biased = shifted.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127);
    let two_n = f32::from_bits(biased << 23);
    if x > -87.0 {
        e_r * two_n
    } else {
        0.0
    }
}

/// The `n` highest logits as (id, logit), best first, lower id first on ties.
pub(super) fn top_n(logits: &[f32], n: usize, keys: &mut Vec<u64>, out: &mut Vec<(u32, f32)>) {
    out.clear();
    if n == 0 {
        return;
    }
    let best = if n < logits.len() {
        top_k_keys(logits, n, keys)
    } else {
        keys.clear();
        keys.extend(logits.iter().enumerate().map(|(id, &l)| rank_key(l, id as u32)));
        &mut keys[..]
    };
    best.sort_unstable_by(|a, b| b.cmp(a));
    out.extend(best.iter().map(|&k| (!(k as u32), key_value(k))));
}
