//! The content hash that names a full KV block: `hash(parent hash, block tokens, salt)`.
//!
//! Why: the prefix cache shares a block between requests whose token prefix (and salt: model,
//! adapter, tenant) is identical, and the KV transfer service names blocks across nodes by the
//! same value. So the hash must be *deterministic across processes and builds*: it is defined
//! here (a folded-multiply mix in the style of wyhash) rather than taken from `std`, whose
//! hasher may change between Rust releases. A test pins known values so it cannot drift.
//!
//! It is a 64-bit non-cryptographic hash: fine against accidental collisions, not against an
//! adversary crafting prompts to collide with another tenant's blocks. The per-request salt
//! keeps tenants/models apart; swapping in a cryptographic hash later only changes this file.

/// The content hash of one full block (and, through the chain, of everything before it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

const P0: u64 = 0xa076_1d64_78bd_642f;
const P1: u64 = 0xe703_7ed1_a0b4_28db;
const P2: u64 = 0x8ebc_6af0_9c88_c6e3;
const ROOT: u64 = 0x243f_6a88_85a3_08d3;

#[inline]
fn fold_mul(a: u64, b: u64) -> u64 {
    let m = u128::from(a).wrapping_mul(u128::from(b));
    (m as u64) ^ ((m >> 64) as u64)
}

/// Hash of the block holding `tokens` whose predecessor block has hash `parent` (`None` for the
/// first block), under `salt`.
#[must_use]
pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32], salt: u64) -> BlockHash {
    // The same fold as `hash_block_iter`, over the slice's token pairs directly (this runs once
    // per filled block of every running request, so it is on the step path).
    let mut h = fold_mul(parent.map_or(ROOT, |p| p.0) ^ P0, salt ^ P1);
    let mut pairs = tokens.chunks_exact(2);
    for pair in &mut pairs {
        let w = u64::from(pair[0]) | (u64::from(pair[1]) << 32);
        h = fold_mul(h ^ P0, w ^ P2);
    }
    if let [a] = pairs.remainder() {
        h = fold_mul(h ^ P1, u64::from(*a) ^ P2);
    }
    BlockHash(fold_mul(h ^ tokens.len() as u64, P1))
}

/// [`hash_block`] over tokens given by an iterator (no copy when a block spans two buffers).
#[must_use]
pub fn hash_block_iter(
    parent: Option<BlockHash>,
    tokens: impl IntoIterator<Item = u32>,
    salt: u64,
) -> BlockHash {
    let mut h = fold_mul(parent.map_or(ROOT, |p| p.0) ^ P0, salt ^ P1);
    let mut tokens = tokens.into_iter();
    let mut len = 0u64;
    loop {
        match (tokens.next(), tokens.next()) {
            (Some(a), Some(b)) => {
                let w = u64::from(a) | (u64::from(b) << 32);
                h = fold_mul(h ^ P0, w ^ P2);
                len += 2;
            }
            (Some(a), None) => {
                h = fold_mul(h ^ P1, u64::from(a) ^ P2);
                len += 1;
                break;
            }
            _ => break,
        }
    }
    BlockHash(fold_mul(h ^ len, P1))
}

/// Append to `out` the hashes of the full blocks of `tokens` from block index `out.len()` on,
/// extending the chain already in `out`.
pub fn extend_block_hashes(out: &mut Vec<BlockHash>, tokens: &[u32], block_size: usize, salt: u64) {
    let full = tokens.len() / block_size;
    for i in out.len()..full {
        let parent = i.checked_sub(1).map(|p| out[p]);
        let h = hash_block(parent, &tokens[i * block_size..(i + 1) * block_size], salt);
        out.push(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_values_do_not_drift() {
        // If this fails the hash changed: every node of a cluster must agree on it, so change it
        // only together with a protocol version bump.
        let a = hash_block(None, &[1, 2, 3, 4], 0);
        let b = hash_block(Some(a), &[5, 6, 7, 8], 0);
        assert_eq!(a, hash_block(None, &[1, 2, 3, 4], 0));
        assert_eq!((a.0, b.0), (PINNED_A, PINNED_B));
    }

    const PINNED_A: u64 = 0xa400_fab7_4045_9684;
    const PINNED_B: u64 = 0x502d_e49a_a7bb_55ea;

    #[test]
    fn salt_parent_and_tokens_all_matter() {
        let a = hash_block(None, &[1, 2, 3, 4], 0);
        assert_ne!(a, hash_block(None, &[1, 2, 3, 4], 1));
        assert_ne!(a, hash_block(None, &[1, 2, 4, 3], 0));
        assert_ne!(a, hash_block(Some(a), &[1, 2, 3, 4], 0));
        assert_ne!(hash_block(None, &[0], 0), hash_block(None, &[0, 0], 0));
    }

    #[test]
    fn slice_and_iterator_forms_agree() {
        let tokens: Vec<u32> = (0..17u32).map(|t| t.wrapping_mul(2_654_435_761)).collect();
        for n in 0..tokens.len() {
            let p = Some(BlockHash(n as u64));
            let iter = hash_block_iter(p, tokens[..n].iter().copied(), 3);
            assert_eq!(hash_block(p, &tokens[..n], 3), iter, "{n} tokens");
        }
    }

    #[test]
    fn extend_only_hashes_full_blocks() {
        let mut out = Vec::new();
        extend_block_hashes(&mut out, &[1, 2, 3, 4, 5], 2, 7);
        assert_eq!(out.len(), 2);
        extend_block_hashes(&mut out, &[1, 2, 3, 4, 5, 6], 2, 7);
        assert_eq!(out.len(), 3);
        assert_eq!(out[1], hash_block(Some(out[0]), &[3, 4], 7));
    }
}
