//! Least-recently-used eviction with vLLM 0.33's request-scoped ranks.
//!
//! vLLM's LRU (`policies/lru.py`) gives every resident chunk a rank
//! `(major, minor)` and evicts the smallest ranks first:
//! - a plain use (a touch, a request's finish, an insert without a position)
//!   takes a fresh rank `(counter + 1, 0)`: most recent;
//! - an active request holds one rank `R`, taken from the same counter when it
//!   first observes a key; the keys it inserts or first observes take
//!   `(R, -position)`, so within a request the tail precedes the head, and the
//!   whole group sits where `R` was taken, behind every later use. A key only
//!   moves into a group whose rank is above its own;
//! - finishing a request gives its keys fresh ranks tail first, so the head of
//!   the prefix ends most recent.
//!
//! Here the ranks are an intrusive doubly linked list kept in rank order. A
//! request's group starts at an *anchor* node (rank `(R, MIN)`), pushed at the
//! back when `R` is taken (then the largest rank); its keys are linked after
//! the anchor in minor order. Keys of one request usually arrive head first,
//! so each lands right after the anchor: every operation is O(1) but for
//! out-of-order positions (a walk through the group). Anchors are skipped by
//! eviction and freed when the request finishes.

use crate::key::ChunkKey;

use super::huge_buffer::HugeBuffer;
use super::policy::{EvictionPolicy, FinishedAccess};
use super::request_access::RequestRank;

const NIL: u32 = u32::MAX;
const UNLINKED: u32 = u32::MAX - 1;
/// `RequestRank::anchor` of a request whose anchor was freed (it finished).
pub(crate) const NO_ANCHOR: u32 = u32::MAX;

/// One list node: links and rank.
#[derive(Debug, Clone, Copy)]
struct Node {
    prev: u32,
    next: u32,
    major: u64,
    minor: i64,
}

const UNLINKED_NODE: Node = Node {
    prev: UNLINKED,
    next: NIL,
    major: 0,
    minor: 0,
};

/// LRU over host slots (nodes `0..capacity`) and request anchors (nodes
/// `capacity..`).
#[derive(Debug)]
pub(crate) struct LruPolicy {
    capacity: u32,
    slots: HugeBuffer<Node>,
    anchors: Vec<Node>,
    free_anchors: Vec<u32>,
    head: u32,
    tail: u32,
    counter: u64,
}

impl LruPolicy {
    pub(crate) fn new(capacity: u32) -> Self {
        Self {
            capacity,
            slots: HugeBuffer::new(capacity as usize, UNLINKED_NODE),
            anchors: Vec::new(),
            free_anchors: Vec::new(),
            head: NIL,
            tail: NIL,
            counter: 0,
        }
    }

    #[inline]
    fn node(&self, id: u32) -> &Node {
        if id < self.capacity {
            &self.slots[id as usize]
        } else {
            &self.anchors[(id - self.capacity) as usize]
        }
    }

    #[inline]
    fn node_mut(&mut self, id: u32) -> &mut Node {
        if id < self.capacity {
            &mut self.slots[id as usize]
        } else {
            &mut self.anchors[(id - self.capacity) as usize]
        }
    }

    #[inline]
    fn rank(&self, id: u32) -> (u64, i64) {
        let n = self.node(id);
        (n.major, n.minor)
    }

    #[inline]
    fn is_linked(&self, id: u32) -> bool {
        self.node(id).prev != UNLINKED
    }

    #[inline]
    fn unlink(&mut self, id: u32) {
        if !self.is_linked(id) {
            return;
        }
        let Node { prev, next, .. } = *self.node(id);
        if prev == NIL {
            self.head = next;
        } else {
            self.node_mut(prev).next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.node_mut(next).prev = prev;
        }
        let n = self.node_mut(id);
        n.prev = UNLINKED;
        n.next = NIL;
    }

    /// Links an unlinked `id` right after `at` (`NIL`: at the front).
    #[inline]
    fn link_after(&mut self, at: u32, id: u32) {
        let next = if at == NIL {
            self.head
        } else {
            self.node(at).next
        };
        {
            let n = self.node_mut(id);
            n.prev = at;
            n.next = next;
        }
        if at == NIL {
            self.head = id;
        } else {
            self.node_mut(at).next = id;
        }
        if next == NIL {
            self.tail = id;
        } else {
            self.node_mut(next).prev = id;
        }
    }

    #[inline]
    fn next_rank(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    /// Gives `slot` a fresh rank: most recent.
    #[inline]
    fn make_most_recent(&mut self, slot: u32) {
        let r = self.next_rank();
        self.unlink(slot);
        let n = self.node_mut(slot);
        n.major = r;
        n.minor = 0;
        let tail = self.tail;
        self.link_after(tail, slot);
    }

    /// Takes a request rank (the next counter value) with its anchor at the back.
    pub(crate) fn new_request_rank(&mut self) -> RequestRank {
        let rank = self.next_rank();
        let anchor = match self.free_anchors.pop() {
            Some(a) => a,
            None => {
                self.anchors.push(UNLINKED_NODE);
                self.capacity + (self.anchors.len() - 1) as u32
            }
        };
        {
            let n = self.node_mut(anchor);
            *n = UNLINKED_NODE;
            n.major = rank;
            n.minor = i64::MIN;
        }
        let tail = self.tail;
        self.link_after(tail, anchor);
        RequestRank { rank, anchor }
    }

    /// Frees a finished request's anchor (its keys stay where they are).
    pub(crate) fn release_anchor(&mut self, r: &mut RequestRank) {
        if r.anchor != NO_ANCHOR && self.anchor_is(r) {
            self.unlink(r.anchor);
            self.free_anchors.push(r.anchor);
        }
        r.anchor = NO_ANCHOR;
    }

    fn anchor_is(&self, r: &RequestRank) -> bool {
        r.anchor >= self.capacity
            && ((r.anchor - self.capacity) as usize) < self.anchors.len()
            && self.is_linked(r.anchor)
            && self.rank(r.anchor) == (r.rank, i64::MIN)
    }

    /// Links `slot` at rank `(r.rank, minor)`.
    fn place(&mut self, slot: u32, r: &RequestRank, minor: i64) {
        self.unlink(slot);
        {
            let n = self.node_mut(slot);
            n.major = r.rank;
            n.minor = minor;
        }
        let at = if r.anchor != NO_ANCHOR && self.anchor_is(r) {
            // Walk the group from its anchor to the first larger minor.
            let mut cur = r.anchor;
            loop {
                let next = self.node(cur).next;
                if next != NIL && self.rank(next) < (r.rank, minor) {
                    cur = next;
                } else {
                    break cur;
                }
            }
        } else {
            // No anchor (the request finished): scan back from the most recent.
            let mut cur = self.tail;
            while cur != NIL && self.rank(cur) > (r.rank, minor) {
                cur = self.node(cur).prev;
            }
            cur
        };
        self.link_after(at, slot);
    }

    /// An insert with a position in a request that holds rank `r`.
    pub(crate) fn insert_ranked(&mut self, slot: u32, r: &RequestRank, position: u64) {
        self.place(slot, r, position_minor(position));
    }

    /// A request holding `r` first observed the resident `slot` at `position`:
    /// the key joins the request's group unless its rank is already higher.
    pub(crate) fn observe_ranked(&mut self, slot: u32, r: &RequestRank, position: u64) {
        let minor = position_minor(position);
        if self.is_linked(slot) && self.rank(slot) >= (r.rank, minor) {
            return;
        }
        self.place(slot, r, minor);
    }
}

/// The rank minor of a key at `position`: later positions rank lower.
#[inline]
fn position_minor(position: u64) -> i64 {
    -i64::try_from(position).unwrap_or(i64::MAX)
}

impl EvictionPolicy for LruPolicy {
    #[inline]
    fn on_insert(&mut self, slot: u32, _key: ChunkKey) {
        self.make_most_recent(slot);
    }

    fn on_remove(&mut self, slot: u32) {
        self.unlink(slot);
    }

    #[inline]
    fn on_store_miss(&mut self, _keys: &[ChunkKey]) {}

    fn on_touch(&mut self, _key: ChunkKey, slot: Option<u32>, _ready: bool) {
        if let Some(slot) = slot {
            self.make_most_recent(slot);
        }
    }

    fn on_request_finished(&mut self, accesses: &[FinishedAccess]) {
        for a in accesses {
            self.make_most_recent(a.slot);
        }
    }

    fn evict(
        &mut self,
        n: usize,
        can_evict: &mut dyn FnMut(u32) -> bool,
        victims: &mut Vec<u32>,
    ) -> bool {
        victims.clear();
        if n == 0 {
            return true;
        }
        // From the lowest rank; usually the first slots are evictable.
        let mut cur = self.head;
        while cur != NIL {
            if cur < self.capacity && can_evict(cur) {
                victims.push(cur);
                if victims.len() == n {
                    break;
                }
            }
            cur = self.node(cur).next;
        }
        if victims.len() < n {
            victims.clear();
            return false;
        }
        for &v in victims.iter() {
            self.unlink(v);
        }
        true
    }

    fn clear(&mut self) {
        self.slots.fill(UNLINKED_NODE);
        self.anchors.clear();
        self.free_anchors.clear();
        self.head = NIL;
        self.tail = NIL;
        self.counter = 0;
    }

    fn lru_view(&self) -> Option<Vec<u32>> {
        let mut out = Vec::new();
        let mut cur = self.head;
        while cur != NIL {
            if cur < self.capacity {
                out.push(cur);
            }
            cur = self.node(cur).next;
        }
        Some(out)
    }

    fn heap_bytes(&self) -> usize {
        self.slots.heap_bytes()
            + self.anchors.capacity() * std::mem::size_of::<Node>()
            + self.free_anchors.capacity() * std::mem::size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(l: &LruPolicy) -> Vec<u32> {
        l.lru_view().unwrap()
    }

    #[test]
    fn a_request_group_sits_where_its_rank_was_taken_tail_first() {
        let mut l = LruPolicy::new(8);
        l.on_insert(0, ChunkKey(0));
        let r = l.new_request_rank();
        l.on_insert(1, ChunkKey(1)); // a later plain use
        // The request inserts its chunks head first (positions 1, 2, 3).
        for (slot, pos) in [(2, 1), (3, 2), (4, 3)] {
            l.insert_ranked(slot, &r, pos);
        }
        assert_eq!(
            order(&l),
            vec![0, 4, 3, 2, 1],
            "tail first, before later uses"
        );
        // Out of order: position 0 goes last in the group.
        l.insert_ranked(5, &r, 0);
        assert_eq!(order(&l), vec![0, 4, 3, 2, 5, 1]);
        // Observing a key with a lower rank pulls it into the group; a
        // higher-ranked one stays.
        l.observe_ranked(0, &r, 2);
        l.observe_ranked(1, &r, 9);
        assert_eq!(order(&l), vec![4, 0, 3, 2, 5, 1]);
    }

    #[test]
    fn finishing_frees_the_anchor_and_later_inserts_still_find_their_place() {
        let mut l = LruPolicy::new(4);
        let mut r = l.new_request_rank();
        l.insert_ranked(0, &r, 1);
        l.on_insert(1, ChunkKey(1));
        l.release_anchor(&mut r);
        assert_eq!(l.anchors.len() - l.free_anchors.len(), 0);
        l.insert_ranked(2, &r, 2);
        assert_eq!(
            order(&l),
            vec![2, 0, 1],
            "placed by rank without the anchor"
        );
        let mut victims = Vec::new();
        assert!(l.evict(2, &mut |_| true, &mut victims));
        assert_eq!(victims, vec![2, 0]);
        assert!(!l.evict(2, &mut |_| true, &mut victims), "atomic");
        assert_eq!(order(&l), vec![1]);
    }
}
