//! An intrusive doubly linked list over dense `u32` indices.
//!
//! Links live in two arrays indexed by the element, so a list of host slots
//! costs 8 bytes per slot and every operation is O(1) without allocation.
//! The front is the least recently used end, the back the most recent.

use crate::manager::huge_buffer::HugeBuffer;

const NIL: u32 = u32::MAX;
const UNLINKED: u32 = u32::MAX - 1;

/// A list of distinct indices in `0..capacity`.
#[derive(Debug)]
pub(crate) struct IndexList {
    prev: HugeBuffer<u32>,
    next: HugeBuffer<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

impl IndexList {
    /// An empty list that can hold indices `0..capacity`.
    pub(crate) fn new(capacity: u32) -> Self {
        Self {
            prev: HugeBuffer::new(capacity as usize, UNLINKED),
            next: HugeBuffer::new(capacity as usize, NIL),
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn contains(&self, i: u32) -> bool {
        self.prev[i as usize] != UNLINKED
    }

    /// Appends `i` at the back (most recent). `i` must not be linked.
    #[inline]
    pub(crate) fn push_back(&mut self, i: u32) {
        debug_assert!(!self.contains(i));
        self.prev[i as usize] = self.tail;
        self.next[i as usize] = NIL;
        if self.tail == NIL {
            self.head = i;
        } else {
            self.next[self.tail as usize] = i;
        }
        self.tail = i;
        self.len += 1;
    }

    /// Unlinks `i`; returns false if it was not in the list.
    #[inline]
    pub(crate) fn remove(&mut self, i: u32) -> bool {
        if !self.contains(i) {
            return false;
        }
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i as usize] = UNLINKED;
        self.next[i as usize] = NIL;
        self.len -= 1;
        true
    }

    /// Moves `i` to the back, linking it if it was not in the list.
    #[inline]
    pub(crate) fn move_to_back(&mut self, i: u32) {
        if self.tail == i {
            return;
        }
        self.remove(i);
        self.push_back(i);
    }

    /// The front (least recent) element.
    #[inline]
    pub(crate) fn front(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    /// The element after `i` (towards the back), if any.
    #[inline]
    pub(crate) fn next_of(&self, i: u32) -> Option<u32> {
        let n = self.next[i as usize];
        (n != NIL).then_some(n)
    }

    /// Iterates from the front (least recent) to the back.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let i = cur;
            cur = self.next[i as usize];
            Some(i)
        })
    }

    /// Empties the list.
    pub(crate) fn clear(&mut self) {
        self.prev.fill(UNLINKED);
        self.next.fill(NIL);
        self.head = NIL;
        self.tail = NIL;
        self.len = 0;
    }

    /// Heap bytes used by the links.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.prev.heap_bytes() + self.next.heap_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_remove_move_keep_order_and_len() {
        let mut l = IndexList::new(8);
        for i in [3, 1, 4, 0] {
            l.push_back(i);
        }
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![3, 1, 4, 0]);
        l.move_to_back(3);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![1, 4, 0, 3]);
        assert!(l.remove(4));
        assert!(!l.remove(4));
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![1, 0, 3]);
        assert_eq!(l.front(), Some(1));
        assert_eq!(l.len(), 3);
        l.move_to_back(7);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![1, 0, 3, 7]);
        l.clear();
        assert_eq!(l.len(), 0);
        assert_eq!(l.front(), None);
        assert!(!l.contains(1));
    }
}
