//! The token ids that may stop a request, kept so that checking a sampled token is cheap: a
//! one-word filter by id mod 32 (see the record's `stop_filter`) and small id sets, inline up
//! to four, read only when the filter says the token may be one of them.

use crate::types::TokenId;

/// A small set of token ids, inline up to four (a stop-filter hit reads it: keeping the ids
/// inline saves a second pointer chase after the one to the cold part).
#[derive(Debug, Clone)]
pub(crate) enum TokenSet {
    Inline { len: u8, ids: [TokenId; 4] },
    Heap(Box<[TokenId]>),
}

/// The bit a token sets in a request's stop filter (see `Request::stop_filter`).
#[inline]
pub(super) fn filter_bit(token: TokenId) -> u32 {
    1 << (token % 32)
}

impl TokenSet {
    pub(crate) fn new(ids: Vec<TokenId>) -> Self {
        if ids.len() <= 4 {
            let mut inline = [0; 4];
            inline[..ids.len()].copy_from_slice(&ids);
            TokenSet::Inline { len: ids.len() as u8, ids: inline }
        } else {
            TokenSet::Heap(ids.into())
        }
    }

    #[inline]
    pub(crate) fn contains(&self, token: TokenId) -> bool {
        match self {
            TokenSet::Inline { len, ids } => ids[..*len as usize].contains(&token),
            TokenSet::Heap(ids) => ids.contains(&token),
        }
    }
}
