//! The waiting queue: requests without an admission slot, in the order admission considers them.
//!
//! Why a structure of its own: admission scans it from the front (at most `lookahead` entries),
//! preemption puts victims back at the *front*, and abort removes from anywhere — all O(1)
//! (plus O(log P) for P distinct priority levels under the priority policy).
//!
//! Order: under FCFS and least-work-done there is one bucket; under the priority policy one
//! bucket per priority value, lower value first. Within a bucket new arrivals go to the back and
//! preempted requests to the front, so a preempted request is considered before everything that
//! was waiting when it was preempted (vLLM's `prepend_request`).
//!
//! Invariants kept: each bucket in the map is non-empty; every listed element belongs to a
//! bucket in the map; `len()` is the sum of bucket lengths.

use std::collections::BTreeMap;
use std::ops::Bound::{Excluded, Unbounded};

use crate::lists::Lists;

/// Requests waiting for admission, by priority bucket then queue position.
#[derive(Debug, Clone)]
pub(crate) struct WaitingQueue {
    by_priority: bool,
    lists: Lists,
    buckets: BTreeMap<i32, u32>,
    bucket_priority: Vec<i32>,
    free_lists: Vec<u32>,
    len: usize,
}

impl WaitingQueue {
    /// A queue ordered by priority buckets when `by_priority`, else one FIFO.
    pub(crate) fn new(by_priority: bool) -> Self {
        WaitingQueue {
            by_priority,
            lists: Lists::new(0),
            buckets: BTreeMap::new(),
            bucket_priority: Vec::new(),
            free_lists: Vec::new(),
            len: 0,
        }
    }

    fn bucket(&mut self, priority: i32) -> u32 {
        let key = if self.by_priority { priority } else { 0 };
        if let Some(&list) = self.buckets.get(&key) {
            return list;
        }
        let list = if let Some(list) = self.free_lists.pop() {
            list
        } else {
            self.bucket_priority.push(key);
            self.lists.add_list()
        };
        self.bucket_priority[list as usize] = key;
        self.buckets.insert(key, list);
        list
    }

    /// A new arrival: back of its bucket.
    pub(crate) fn push_back(&mut self, slot: u32, priority: i32) {
        let list = self.bucket(priority);
        self.lists.push_back(list, slot);
        self.len += 1;
    }

    /// A preempted or returning request: front of its bucket.
    pub(crate) fn push_front(&mut self, slot: u32, priority: i32) {
        let list = self.bucket(priority);
        self.lists.push_front(list, slot);
        self.len += 1;
    }

    /// Remove `slot` if it is waiting; true if it was.
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        let Some(list) = self.lists.remove(slot) else {
            return false;
        };
        self.len -= 1;
        if self.lists.len(list) == 0 {
            let key = self.bucket_priority[list as usize];
            self.buckets.remove(&key);
            self.free_lists.push(list);
        }
        true
    }

    /// True if `slot` is in the queue.
    #[inline]
    pub(crate) fn contains(&self, slot: u32) -> bool {
        self.lists.list_of(slot).is_some()
    }

    /// Number of waiting requests.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The request admission would consider first.
    pub(crate) fn first(&self) -> Option<u32> {
        let (_, &list) = self.buckets.iter().next()?;
        self.lists.front(list)
    }

    /// The request after `slot` in admission order (`slot` must be waiting).
    pub(crate) fn next_after(&self, slot: u32) -> Option<u32> {
        if let Some(next) = self.lists.next(slot) {
            return Some(next);
        }
        let list = self.lists.list_of(slot)?;
        let key = self.bucket_priority[list as usize];
        let (_, &next_list) = self.buckets.range((Excluded(key), Unbounded)).next()?;
        self.lists.front(next_list)
    }

    /// All waiting requests in admission order (O(n); tests).
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.buckets.values().flat_map(move |&list| self.lists.iter(list))
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        self.lists.check()?;
        let mut total = 0;
        for (&key, &list) in &self.buckets {
            let n = self.lists.len(list);
            if n == 0 {
                return Err(format!("waiting bucket {key} is empty but still mapped"));
            }
            if self.bucket_priority[list as usize] != key {
                return Err(format!("waiting bucket {key} maps to a list of another key"));
            }
            total += n;
        }
        if total != self.len {
            return Err(format!("waiting len {} but buckets hold {total}", self.len));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priority_buckets_then_front_for_preempted() {
        let mut w = WaitingQueue::new(true);
        w.push_back(1, 5);
        w.push_back(2, 0);
        w.push_back(3, 5);
        w.push_front(4, 5);
        assert_eq!(w.iter().collect::<Vec<_>>(), vec![2, 4, 1, 3]);
        assert_eq!(w.first(), Some(2));
        assert_eq!(w.next_after(2), Some(4));
        assert!(w.remove(2));
        assert!(!w.remove(2));
        assert_eq!(w.first(), Some(4));
        assert_eq!(w.len(), 3);
        w.check().unwrap();
    }

    #[test]
    fn fcfs_ignores_priority() {
        let mut w = WaitingQueue::new(false);
        w.push_back(1, 5);
        w.push_back(2, 0);
        w.push_front(3, 9);
        assert_eq!(w.iter().collect::<Vec<_>>(), vec![3, 1, 2]);
        w.check().unwrap();
    }
}
