//! The token ids of a workload's prompts: each a hash of (who, position), so the same request
//! gets the same tokens in every run, a prefix group's requests (or a conversation's turns)
//! start with the same ones, and no two requests' own tokens collide.

use std::sync::Arc;

use super::rng::mix;

/// The tokens of a prompt of `len` tokens whose first `prefix_len` are group `group`'s shared
/// prefix and the rest request `index`'s own.
pub fn prompt_tokens(
    index: u64,
    len: u32,
    group: Option<u32>,
    prefix_len: u32,
    vocab: u32,
) -> Arc<[u32]> {
    let shared = if group.is_some() { prefix_len.min(len) } else { 0 };
    let g = group.unwrap_or(0);
    (0..len)
        .map(|i| {
            if i < shared {
                shared_token(g, u64::from(i), vocab)
            } else {
                let key = mix((index << 24) ^ u64::from(i) ^ 0xB0B0_0000_0000_0000);
                (key % u64::from(vocab.max(2))) as u32
            }
        })
        .collect()
}

/// Token `position` of group `group`'s shared sequence: a prefix group's system prompt, or a
/// conversation's prompts and answers.
pub fn shared_token(group: u32, position: u64, vocab: u32) -> u32 {
    let key = mix(0xA11CE ^ (u64::from(group) << 32) ^ (position & 0xFFFF_FFFF));
    (key % u64::from(vocab.max(2))) as u32
}
