//! The arena of live requests: every request record, addressed by a dense `u32` entry index,
//! plus the index from request id to entry.
//!
//! Why an arena: every queue, set and step record in the core names a request by its entry
//! index (the intrusive lists are indexed by it), so a request must keep one index from the
//! moment it is added until it retires, and an index must be cheap to follow in the step loops
//! (one bounds check, no hashing). Entries are reused (last freed, first reused) so the slab
//! stays as large as the peak number of live requests, and its hot part stays warm.
//!
//! Lifetime: an entry is taken when a request is added and freed when it *retires* (finish
//! reported, no in-flight step or KV transfer referencing it), which is also when its id becomes
//! reusable. Nothing else removes a request.
//!
//! Invariants kept (see [`RequestArena::check`]): the id index maps exactly the live entries,
//! each to the entry holding that id; the free list holds exactly the vacant entries, once each.

use std::ops::{Index, IndexMut};

use rustc_hash::FxHashMap;

use crate::prefetch::prefetch;
use crate::request::Request;
use crate::types::RequestId;

/// Live requests by entry index, and the id → entry index.
#[derive(Debug, Default)]
pub(crate) struct RequestArena {
    /// `Option<Request>` is as large as `Request` (a niche in its first line), so a vacant entry
    /// costs no tag and the live check reads a line the step loops read anyway.
    slab: Vec<Option<Request>>,
    /// Vacant entries, reused last-freed first.
    free: Vec<u32>,
    by_id: FxHashMap<RequestId, u32>,
}

impl RequestArena {
    /// Store `request` in a vacant entry (or a new one) and index its id; returns the entry.
    /// The id must not be live (the caller validated it).
    pub(crate) fn insert(&mut self, request: Request) -> u32 {
        debug_assert!(!self.by_id.contains_key(&request.id), "{} added twice", request.id);
        let id = request.id;
        let idx = if let Some(i) = self.free.pop() {
            self.slab[i as usize] = Some(request);
            i
        } else {
            self.slab.push(Some(request));
            u32::try_from(self.slab.len() - 1).expect("fewer than 2^32 live requests")
        };
        self.by_id.insert(id, idx);
        idx
    }

    /// Retire entry `idx`: drop its record, free the entry and make its id reusable.
    pub(crate) fn remove(&mut self, idx: u32) {
        let r = self.slab[idx as usize].take().expect("retiring a live entry");
        self.by_id.remove(&r.id);
        self.free.push(idx);
    }

    /// The entry of live request `id`.
    #[inline]
    pub(crate) fn index_of(&self, id: RequestId) -> Option<u32> {
        self.by_id.get(&id).copied()
    }

    /// True while request `id` is live (not retired).
    #[inline]
    pub(crate) fn contains(&self, id: RequestId) -> bool {
        self.by_id.contains_key(&id)
    }

    /// Number of live requests.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    /// True if no request is live.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The record at `idx`, if that entry is live.
    #[inline]
    pub(crate) fn get(&self, idx: u32) -> Option<&Request> {
        self.slab.get(idx as usize).and_then(Option::as_ref)
    }

    /// Live entries and their records, in entry order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &Request)> + '_ {
        // Entry indices fit in `u32` (checked when the entry was created).
        (0u32..).zip(&self.slab).filter_map(|(i, r)| Some((i, r.as_ref()?)))
    }

    /// Ask for cache lines `lines` of entry `idx`'s record (see [`Request`]'s layout). A hint:
    /// harmless for a vacant or out-of-range entry.
    #[inline]
    pub(crate) fn prefetch_lines(&self, idx: u32, lines: &[usize]) {
        if let Some(entry) = self.slab.get(idx as usize) {
            let r: *const u8 = std::ptr::from_ref(entry).cast();
            for &line in lines {
                prefetch(r.wrapping_add(64 * line));
            }
        }
    }

    /// Verify the arena's own invariants.
    pub(crate) fn check(&self) -> Result<(), String> {
        let live = self.slab.iter().flatten().count();
        if live != self.by_id.len() {
            return Err(format!("{live} live entries, {} ids indexed", self.by_id.len()));
        }
        for (id, &idx) in &self.by_id {
            if self.get(idx).map(|r| r.id) != Some(*id) {
                return Err(format!("{id} maps to entry {idx}, which does not hold it"));
            }
        }
        let mut vacant = vec![false; self.slab.len()];
        for &idx in &self.free {
            match self.slab.get(idx as usize) {
                Some(None) if !vacant[idx as usize] => vacant[idx as usize] = true,
                Some(None) => return Err(format!("entry {idx} is on the free list twice")),
                _ => return Err(format!("entry {idx} is on the free list but not vacant")),
            }
        }
        if live + self.free.len() != self.slab.len() {
            return Err(format!(
                "{live} live + {} free entries != {} entries",
                self.free.len(),
                self.slab.len()
            ));
        }
        Ok(())
    }
}

/// `arena[idx]`: the record of live entry `idx`. Every index the core holds (in a queue, a set,
/// a step record) names a live entry, so a vacant one is a bookkeeping bug.
impl Index<u32> for RequestArena {
    type Output = Request;

    #[inline]
    fn index(&self, idx: u32) -> &Request {
        self.slab[idx as usize]
            .as_ref()
            .expect("entry index held by a queue or record names a live entry")
    }
}

impl IndexMut<u32> for RequestArena {
    #[inline]
    fn index_mut(&mut self, idx: u32) -> &mut Request {
        self.slab[idx as usize]
            .as_mut()
            .expect("entry index held by a queue or record names a live entry")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::NewRequest;
    use crate::types::Timestamp;

    fn record(id: u64) -> Request {
        Request::new(NewRequest::new(RequestId(id), vec![1, 2], 4, Timestamp(0)), id, 16, None)
    }

    #[test]
    fn entries_are_reused_and_ids_follow_them() {
        let mut a = RequestArena::default();
        let (e1, e2) = (a.insert(record(1)), a.insert(record(2)));
        assert_eq!((e1, e2), (0, 1));
        a.remove(e1);
        assert!(!a.contains(RequestId(1)), "a retired id is reusable");
        assert_eq!(a.insert(record(3)), e1, "the freed entry is reused");
        assert_eq!(a.index_of(RequestId(3)), Some(e1));
        assert_eq!(a[e2].id, RequestId(2));
        assert_eq!(a.iter().map(|(i, r)| (i, r.id.0)).collect::<Vec<_>>(), [(0, 3), (1, 2)]);
        assert_eq!(a.len(), 2);
        a.check().unwrap();
    }
}
