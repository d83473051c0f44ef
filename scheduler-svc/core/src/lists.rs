//! Intrusive doubly-linked lists over dense `u32` indices, the building block of every queue in
//! the core (work queues, the waiting queue, the import queue, the free-block LRU).
//!
//! Why: the scheduler must enqueue, remove and look up a request's queue in O(1), including
//! removing from the middle (abort, preemption) — a `VecDeque` would need a scan and tombstones.
//! Each element (a request slot or a block) owns one [`Link`]; an element is in at most one list
//! of a [`Lists`] at a time, and its `list` field *is* the index "element → list", so the
//! index and the lists cannot disagree as long as every change goes through this type.
//!
//! Invariants kept: `len` of each list equals the number of elements reachable from its head;
//! `prev`/`next` are mutually consistent; an element with `list == NONE` has no neighbours.
//! [`Lists::check`] verifies all of it (used by `check_invariants`).

/// Marker for "no element" / "no list".
pub(crate) const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
    list: u32,
}

const UNLINKED: Link = Link { prev: NIL, next: NIL, list: NIL };

#[derive(Debug, Clone, Copy)]
struct Head {
    first: u32,
    last: u32,
    len: u32,
}

const EMPTY: Head = Head { first: NIL, last: NIL, len: 0 };

/// A family of lists sharing one link per element.
#[derive(Debug, Clone, Default)]
pub(crate) struct Lists {
    links: Vec<Link>,
    heads: Vec<Head>,
}

impl Lists {
    /// `num_lists` empty lists; elements are added on demand.
    pub(crate) fn new(num_lists: usize) -> Self {
        Lists { links: Vec::new(), heads: vec![EMPTY; num_lists] }
    }

    /// Make room for elements `0..n`.
    pub(crate) fn ensure_elements(&mut self, n: usize) {
        if self.links.len() < n {
            self.links.resize(n, UNLINKED);
        }
    }

    /// Add one more (empty) list and return its index.
    pub(crate) fn add_list(&mut self) -> u32 {
        self.heads.push(EMPTY);
        (self.heads.len() - 1) as u32
    }

    /// The list `elem` is in, if any. O(1).
    #[inline]
    pub(crate) fn list_of(&self, elem: u32) -> Option<u32> {
        match self.links.get(elem as usize) {
            Some(link) if link.list != NIL => Some(link.list),
            _ => None,
        }
    }

    /// Number of elements in `list`.
    #[inline]
    pub(crate) fn len(&self, list: u32) -> usize {
        self.heads[list as usize].len as usize
    }

    /// First element of `list`.
    #[inline]
    pub(crate) fn front(&self, list: u32) -> Option<u32> {
        let first = self.heads[list as usize].first;
        (first != NIL).then_some(first)
    }

    /// The element after `elem` in its list.
    #[inline]
    pub(crate) fn next(&self, elem: u32) -> Option<u32> {
        let next = self.links[elem as usize].next;
        (next != NIL).then_some(next)
    }

    /// Append `elem` to `list`. The element must not be in any list.
    pub(crate) fn push_back(&mut self, list: u32, elem: u32) {
        self.ensure_elements(elem as usize + 1);
        debug_assert_eq!(self.links[elem as usize].list, NIL, "element already listed");
        let head = &mut self.heads[list as usize];
        let old_last = head.last;
        head.last = elem;
        if old_last == NIL {
            head.first = elem;
        }
        head.len += 1;
        self.links[elem as usize] = Link { prev: old_last, next: NIL, list };
        if old_last != NIL {
            self.links[old_last as usize].next = elem;
        }
    }

    /// Prepend `elem` to `list`. The element must not be in any list.
    pub(crate) fn push_front(&mut self, list: u32, elem: u32) {
        self.ensure_elements(elem as usize + 1);
        debug_assert_eq!(self.links[elem as usize].list, NIL, "element already listed");
        let head = &mut self.heads[list as usize];
        let old_first = head.first;
        head.first = elem;
        if old_first == NIL {
            head.last = elem;
        }
        head.len += 1;
        self.links[elem as usize] = Link { prev: NIL, next: old_first, list };
        if old_first != NIL {
            self.links[old_first as usize].prev = elem;
        }
    }

    /// Unlink `elem` from whatever list holds it; returns that list. O(1).
    pub(crate) fn remove(&mut self, elem: u32) -> Option<u32> {
        let link = *self.links.get(elem as usize)?;
        if link.list == NIL {
            return None;
        }
        let head = &mut self.heads[link.list as usize];
        if link.prev == NIL {
            head.first = link.next;
        }
        if link.next == NIL {
            head.last = link.prev;
        }
        head.len -= 1;
        if link.prev != NIL {
            self.links[link.prev as usize].next = link.next;
        }
        if link.next != NIL {
            self.links[link.next as usize].prev = link.prev;
        }
        self.links[elem as usize] = UNLINKED;
        Some(link.list)
    }

    /// Remove and return the first element of `list`.
    pub(crate) fn pop_front(&mut self, list: u32) -> Option<u32> {
        let first = self.front(list)?;
        self.remove(first);
        Some(first)
    }

    /// Iterate over `list` from front to back.
    pub(crate) fn iter(&self, list: u32) -> ListIter<'_> {
        ListIter { lists: self, cur: self.heads[list as usize].first }
    }

    /// Verify the structure; returns a description of the first inconsistency.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut seen = 0usize;
        for (l, head) in self.heads.iter().enumerate() {
            let mut count = 0u32;
            let mut prev = NIL;
            let mut cur = head.first;
            while cur != NIL {
                let link = self.links.get(cur as usize).ok_or("link out of range")?;
                if link.list as usize != l {
                    return Err(format!(
                        "element {cur} reachable from list {l} says list {}",
                        link.list
                    ));
                }
                if link.prev != prev {
                    return Err(format!("element {cur} in list {l}: prev link broken"));
                }
                prev = cur;
                cur = link.next;
                count += 1;
                if count > self.links.len() as u32 {
                    return Err(format!("list {l} has a cycle"));
                }
            }
            if prev != head.last {
                return Err(format!("list {l}: last pointer broken"));
            }
            if count != head.len {
                return Err(format!("list {l}: len {} but {count} reachable", head.len));
            }
            seen += count as usize;
        }
        let listed = self.links.iter().filter(|l| l.list != NIL).count();
        if listed != seen {
            return Err(format!("{listed} elements claim a list but {seen} are reachable"));
        }
        Ok(())
    }
}

/// Front-to-back iterator over one list.
pub(crate) struct ListIter<'a> {
    lists: &'a Lists,
    cur: u32,
}

impl Iterator for ListIter<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.cur == NIL {
            return None;
        }
        let cur = self.cur;
        self.cur = self.lists.links[cur as usize].next;
        Some(cur)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_remove_in_any_position() {
        let mut l = Lists::new(2);
        for e in 0..5 {
            l.push_back(0, e);
        }
        l.push_front(1, 7);
        assert_eq!(l.iter(0).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        assert_eq!(l.remove(2), Some(0));
        assert_eq!(l.remove(0), Some(0));
        assert_eq!(l.remove(4), Some(0));
        assert_eq!(l.remove(4), None);
        assert_eq!(l.iter(0).collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(l.list_of(7), Some(1));
        assert_eq!(l.list_of(2), None);
        l.push_front(0, 2);
        assert_eq!(l.pop_front(0), Some(2));
        assert_eq!(l.len(0), 2);
        l.check().unwrap();
    }
}
