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
//! Here that order is kept without a heap, in O(1) per operation but for the
//! group bookkeeping below:
//! - chunks with a plain rank form one list in rank order: a fresh plain rank
//!   is always the largest, so they are only ever appended;
//! - each request's group is its own circular list through an *anchor* node
//!   (the group's sentinel), in minor order; a request's keys usually arrive
//!   head first, so each lands right after the anchor;
//! - the non-empty groups are kept in a `BTreeMap` by rank (at most one per
//!   active request), and eviction merges the plain list with the groups in
//!   rank order. A group leaves the map when its last chunk leaves, so the
//!   groups of requests whose chunks were all evicted cost nothing;
//! - a chunk being stored (pending) under a request rank keeps its rank but
//!   stays out of the lists until its store completes
//!   ([`LruPolicy::on_ready`]): a request's newest chunk ranks first in its
//!   group, and an eviction would otherwise walk past every store in flight
//!   (vLLM's heap holds evictable chunks only). A pending chunk with a plain
//!   rank is linked at once, at the most recent end, where evictions rarely
//!   look.
//!
//! An anchor lives while its request is active or its group is not empty.

use std::collections::{BTreeMap, HashMap};

use crate::key::{ChunkKey, KeyBuildHasher};

use super::traits::{EvictionPolicy, FinishedAccess};
use crate::manager::huge_buffer::HugeBuffer;
use crate::manager::request_access::RequestRank;

const UNLINKED: u32 = u32::MAX - 1;
/// `prev`/`next` of a pending slot: ranked, not linked.
const PENDING: u32 = u32::MAX - 2;
/// `RequestRank::anchor` of a request whose anchor was given up (it finished).
pub(crate) const NO_ANCHOR: u32 = u32::MAX;
/// The major rank of a free anchor node (ranks start at 1).
const FREE_ANCHOR: u64 = 0;

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
    next: UNLINKED,
    major: 0,
    minor: 0,
};

/// LRU over host slots (nodes `0..capacity`), the plain list's sentinel (node
/// `capacity`) and request anchors (nodes above).
#[derive(Debug)]
pub(crate) struct LruPolicy {
    capacity: u32,
    slots: HugeBuffer<Node>,
    /// Node `capacity + i`: index 0 is the plain list's sentinel, the others anchors.
    extra: Vec<Node>,
    /// Anchors whose request finished: freed when their group empties.
    orphan: Vec<bool>,
    free_anchors: Vec<u32>,
    /// Non-empty request groups by rank.
    groups: BTreeMap<u64, u32>,
    /// Every live anchor by rank (for pending chunks completing later).
    live: HashMap<u64, u32, KeyBuildHasher>,
    counter: u64,
}

impl LruPolicy {
    pub(crate) fn new(capacity: u32) -> Self {
        let mut l = Self {
            capacity,
            slots: HugeBuffer::new(capacity as usize, UNLINKED_NODE),
            extra: Vec::new(),
            orphan: Vec::new(),
            free_anchors: Vec::new(),
            groups: BTreeMap::new(),
            live: HashMap::default(),
            counter: 0,
        };
        l.reset_sentinel();
        l
    }

    /// The plain list's sentinel node.
    #[inline]
    fn plain(&self) -> u32 {
        self.capacity
    }

    fn reset_sentinel(&mut self) {
        let s = self.capacity;
        self.extra.clear();
        self.orphan.clear();
        self.extra.push(Node {
            prev: s,
            next: s,
            major: 0,
            minor: i64::MIN,
        });
        self.orphan.push(false);
    }

    #[inline]
    fn node(&self, id: u32) -> &Node {
        if id < self.capacity {
            &self.slots[id as usize]
        } else {
            &self.extra[(id - self.capacity) as usize]
        }
    }

    #[inline]
    fn node_mut(&mut self, id: u32) -> &mut Node {
        if id < self.capacity {
            &mut self.slots[id as usize]
        } else {
            &mut self.extra[(id - self.capacity) as usize]
        }
    }

    #[inline]
    fn rank(&self, id: u32) -> (u64, i64) {
        let n = self.node(id);
        (n.major, n.minor)
    }

    /// Linked in the plain list or a group.
    #[inline]
    fn is_linked(&self, id: u32) -> bool {
        let p = self.node(id).prev;
        p != UNLINKED && p != PENDING
    }

    #[inline]
    fn is_pending(&self, id: u32) -> bool {
        self.node(id).prev == PENDING
    }

    /// Resident: linked, or pending with a rank.
    #[inline]
    fn is_resident(&self, id: u32) -> bool {
        self.node(id).prev != UNLINKED
    }

    /// Unlinks a slot from its list (a pending slot just forgets its rank); a
    /// group it empties leaves the map (and its anchor is freed if its
    /// request finished).
    #[inline]
    fn unlink(&mut self, id: u32) {
        if !self.is_linked(id) {
            let n = self.node_mut(id);
            n.prev = UNLINKED;
            n.next = UNLINKED;
            return;
        }
        let Node { prev, next, .. } = *self.node(id);
        self.node_mut(prev).next = next;
        self.node_mut(next).prev = prev;
        let n = self.node_mut(id);
        n.prev = UNLINKED;
        n.next = UNLINKED;
        if prev == next && prev > self.capacity {
            // `prev` is an anchor whose group is now empty.
            let rank = self.node(prev).major;
            self.groups.remove(&rank);
            if self.orphan[(prev - self.capacity) as usize] {
                self.free_anchor(prev);
            }
        }
    }

    /// Links an unlinked `id` right after `at`.
    #[inline]
    fn link_after(&mut self, at: u32, id: u32) {
        let next = self.node(at).next;
        {
            let n = self.node_mut(id);
            n.prev = at;
            n.next = next;
        }
        self.node_mut(at).next = id;
        self.node_mut(next).prev = id;
    }

    #[inline]
    fn next_rank(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    /// Gives `slot` a fresh rank: most recent (a pending slot stays pending).
    #[inline]
    fn make_most_recent(&mut self, slot: u32) {
        let r = self.next_rank();
        let pending = self.is_pending(slot);
        self.unlink(slot);
        let n = self.node_mut(slot);
        n.major = r;
        n.minor = 0;
        if pending {
            n.prev = PENDING;
            n.next = PENDING;
        } else {
            let last = self.node(self.plain()).prev;
            self.link_after(last, slot);
        }
    }

    /// A new chunk (being stored) takes `slot`: a fresh rank, linked at once
    /// at the most recent end (where evictions rarely look); or the rank of
    /// the request holding `ranked` at its position, held out of the order
    /// until its store completes (at the front of its group, it would sit in
    /// every eviction's way).
    pub(crate) fn insert_pending(&mut self, slot: u32, ranked: Option<(&RequestRank, u64)>) {
        let Some((r, pos)) = ranked else {
            self.make_most_recent(slot);
            return;
        };
        self.unlink(slot);
        // A pending slot keeps its group's anchor in `next` (a hint for
        // `on_ready`, checked there).
        *self.node_mut(slot) = Node {
            prev: PENDING,
            next: r.anchor,
            major: r.rank,
            minor: position_minor(pos),
        };
    }

    /// The store of `slot` completed: it joins the order at its rank.
    pub(crate) fn on_ready(&mut self, slot: u32) {
        if !self.is_pending(slot) {
            return;
        }
        let Node {
            major, minor, next, ..
        } = *self.node(slot);
        {
            let n = self.node_mut(slot);
            n.prev = UNLINKED;
            n.next = UNLINKED;
        }
        if minor < 0 {
            // A request's group (positions are >= 1): its anchor, or a new
            // one if the request finished meanwhile.
            let hint = RequestRank {
                rank: major,
                anchor: next,
            };
            let anchor = if self.anchor_is(&hint) {
                next
            } else {
                match self.live.get(&major) {
                    Some(&a) => a,
                    None => self.alloc_anchor(major, true),
                }
            };
            self.link_in_group(slot, anchor, minor);
        } else {
            // A plain rank: usually recent, so found from the most recent end.
            let s = self.plain();
            let mut at = self.node(s).prev;
            while at != s && self.node(at).major > major {
                at = self.node(at).prev;
            }
            self.link_after(at, slot);
        }
    }

    fn alloc_anchor(&mut self, rank: u64, orphan: bool) -> u32 {
        let id = match self.free_anchors.pop() {
            Some(a) => a,
            None => {
                self.extra.push(UNLINKED_NODE);
                self.orphan.push(false);
                self.capacity + (self.extra.len() - 1) as u32
            }
        };
        *self.node_mut(id) = Node {
            prev: id,
            next: id,
            major: rank,
            minor: i64::MIN,
        };
        self.orphan[(id - self.capacity) as usize] = orphan;
        self.live.insert(rank, id);
        id
    }

    fn free_anchor(&mut self, id: u32) {
        let rank = self.node(id).major;
        self.live.remove(&rank);
        *self.node_mut(id) = Node {
            major: FREE_ANCHOR,
            ..UNLINKED_NODE
        };
        self.orphan[(id - self.capacity) as usize] = false;
        self.free_anchors.push(id);
    }

    /// Takes a request rank (the next counter value) with an empty group.
    pub(crate) fn new_request_rank(&mut self) -> RequestRank {
        let rank = self.next_rank();
        let anchor = self.alloc_anchor(rank, false);
        RequestRank { rank, anchor }
    }

    /// The request holding `r` finished: its group stays in place until its
    /// chunks leave, then the anchor is freed.
    pub(crate) fn release_anchor(&mut self, r: &mut RequestRank) {
        if self.anchor_is(r) {
            let a = r.anchor;
            if self.node(a).next == a {
                self.free_anchor(a);
            } else {
                self.orphan[(a - self.capacity) as usize] = true;
            }
        }
        r.anchor = NO_ANCHOR;
    }

    /// Whether `r.anchor` is the live anchor of rank `r.rank`.
    fn anchor_is(&self, r: &RequestRank) -> bool {
        r.anchor != NO_ANCHOR
            && r.anchor > self.capacity
            && ((r.anchor - self.capacity) as usize) < self.extra.len()
            && self.node(r.anchor).major == r.rank
    }

    /// Gives `slot` the rank `(r.rank, minor)`, in its request's group (a
    /// pending slot keeps the rank until its store completes).
    fn place(&mut self, slot: u32, r: &RequestRank, minor: i64) {
        if self.is_pending(slot) {
            let n = self.node_mut(slot);
            n.major = r.rank;
            n.minor = minor;
            n.next = r.anchor;
            return;
        }
        self.unlink(slot);
        let anchor = if self.anchor_is(r) {
            r.anchor
        } else {
            // The request finished and gave its anchor up: its group, if
            // still there, or a new one at the same rank.
            match self.live.get(&r.rank) {
                Some(&a) => a,
                None => self.alloc_anchor(r.rank, true),
            }
        };
        {
            let n = self.node_mut(slot);
            n.major = r.rank;
            n.minor = minor;
        }
        self.link_in_group(slot, anchor, minor);
    }

    /// Links `slot` (ranked in `anchor`'s group) in minor order.
    fn link_in_group(&mut self, slot: u32, anchor: u32, minor: i64) {
        let first = self.node(anchor).next;
        if first == anchor {
            let rank = self.node(anchor).major;
            self.groups.insert(rank, anchor);
            self.link_after(anchor, slot);
            return;
        }
        // A request's keys usually arrive head first: the newest goes first.
        if minor <= self.node(first).minor {
            self.link_after(anchor, slot);
            return;
        }
        let last = self.node(anchor).prev;
        if minor >= self.node(last).minor {
            self.link_after(last, slot);
            return;
        }
        let mut at = first;
        loop {
            let next = self.node(at).next;
            if next != anchor && self.node(next).minor < minor {
                at = next;
            } else {
                break;
            }
        }
        self.link_after(at, slot);
    }

    /// A completed insert with a position in a request that holds rank `r`.
    #[cfg(test)]
    fn insert_ranked(&mut self, slot: u32, r: &RequestRank, position: u64) {
        self.insert_pending(slot, Some((r, position)));
        self.on_ready(slot);
    }

    /// A request holding `r` first observed the resident `slot` at `position`:
    /// the key joins the request's group unless its rank is already higher.
    pub(crate) fn observe_ranked(&mut self, slot: u32, r: &RequestRank, position: u64) {
        let minor = position_minor(position);
        if self.is_resident(slot) && self.rank(slot) >= (r.rank, minor) {
            return;
        }
        self.place(slot, r, minor);
    }

    /// Visits the slots in rank order (plain list and groups merged) until
    /// `visit` returns false.
    #[inline]
    fn walk(&self, mut visit: impl FnMut(u32) -> bool) {
        let s = self.plain();
        let mut p = self.node(s).next;
        if self.groups.is_empty() {
            // Plain ranks only (no request is ranking keys): the list alone.
            while p != s {
                if !visit(p) {
                    return;
                }
                p = self.node(p).next;
            }
            return;
        }
        let mut groups = self.groups.values();
        let mut group = groups.next().copied();
        let mut g = group.map_or(s, |a| self.node(a).next);
        loop {
            let from_group = match group {
                Some(a) => p == s || self.node(p).major > self.node(a).major,
                None => false,
            };
            let id = if from_group {
                let id = g;
                g = self.node(g).next;
                if Some(g) == group {
                    group = groups.next().copied();
                    g = group.map_or(s, |a| self.node(a).next);
                }
                id
            } else if p != s {
                let id = p;
                p = self.node(p).next;
                id
            } else {
                return;
            };
            if !visit(id) {
                return;
            }
        }
    }
}

/// The rank minor of a key at `position`: later positions rank lower.
#[inline]
fn position_minor(position: u64) -> i64 {
    -i64::try_from(position).unwrap_or(i64::MAX)
}

impl EvictionPolicy for LruPolicy {
    #[inline]
    fn on_ready(&mut self, slot: u32) {
        LruPolicy::on_ready(self, slot);
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
        self.walk(|id| {
            if can_evict(id) {
                victims.push(id);
            }
            victims.len() < n
        });
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
        self.reset_sentinel();
        self.free_anchors.clear();
        self.groups.clear();
        self.live.clear();
        self.counter = 0;
    }

    fn lru_view(&self) -> Option<Vec<u32>> {
        // Every resident slot, pending ones included, in rank order.
        let mut out: Vec<u32> = (0..self.capacity)
            .filter(|&i| self.is_resident(i))
            .collect();
        out.sort_by_key(|&i| self.rank(i));
        Some(out)
    }

    fn heap_bytes(&self) -> usize {
        self.slots.heap_bytes()
            + self.extra.capacity() * std::mem::size_of::<Node>()
            + self.orphan.capacity()
            + self.free_anchors.capacity() * std::mem::size_of::<u32>()
            + self.groups.len() * 2 * std::mem::size_of::<(u64, u32)>()
            + self.live.capacity() * 2 * std::mem::size_of::<(u64, u32)>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(l: &LruPolicy) -> Vec<u32> {
        l.lru_view().unwrap()
    }

    /// A plain insert whose store completed.
    fn ins(l: &mut LruPolicy, slot: u32, _key: ChunkKey) {
        l.insert_pending(slot, None);
        l.on_ready(slot);
    }

    #[test]
    fn a_pending_chunk_keeps_its_rank_out_of_the_way_of_evictions() {
        let mut l = LruPolicy::new(4);
        let r = l.new_request_rank();
        l.insert_pending(0, Some((&r, 1)));
        ins(&mut l, 1, ChunkKey(1));
        let mut victims = Vec::new();
        assert!(
            !l.evict(2, &mut |_| true, &mut victims),
            "a pending chunk is never a candidate"
        );
        assert_eq!(order(&l), vec![0, 1], "but it keeps its rank");
        l.on_ready(0);
        assert!(l.evict(1, &mut |_| true, &mut victims));
        assert_eq!(victims, vec![0]);
    }

    #[test]
    fn a_request_group_sits_where_its_rank_was_taken_tail_first() {
        let mut l = LruPolicy::new(8);
        ins(&mut l, 0, ChunkKey(0));
        let r = l.new_request_rank();
        ins(&mut l, 1, ChunkKey(1)); // a later plain use
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
        ins(&mut l, 1, ChunkKey(1));
        l.release_anchor(&mut r);
        assert_eq!(
            l.orphan.iter().filter(|&&o| o).count(),
            1,
            "kept while its group is not empty"
        );
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

    #[test]
    fn an_emptied_group_leaves_the_map_and_comes_back_in_rank_order() {
        let mut l = LruPolicy::new(6);
        let r = l.new_request_rank();
        l.insert_ranked(0, &r, 1);
        ins(&mut l, 1, ChunkKey(1));
        let mut victims = Vec::new();
        assert!(l.evict(1, &mut |_| true, &mut victims));
        assert_eq!(victims, vec![0]);
        assert!(l.groups.is_empty(), "the empty group left the map");
        assert!(l.evict(1, &mut |_| true, &mut victims));
        assert_eq!(victims, vec![1]);
        // A later request and a plain use rank above r; r's next key still
        // goes in front of them.
        let r2 = l.new_request_rank();
        l.insert_ranked(2, &r2, 1);
        ins(&mut l, 3, ChunkKey(3));
        l.insert_ranked(4, &r, 2);
        assert_eq!(order(&l), vec![4, 2, 3]);
        l.insert_ranked(5, &r, 3);
        assert_eq!(order(&l), vec![5, 4, 2, 3], "tail first inside the group");
        // Anchors: a finished request's anchor lives until its group empties.
        let mut r = r;
        l.release_anchor(&mut r);
        let free_before = l.free_anchors.len();
        l.on_touch(ChunkKey(5), Some(5), true);
        l.on_touch(ChunkKey(4), Some(4), true);
        assert_eq!(
            l.free_anchors.len(),
            free_before + 1,
            "freed with its last chunk"
        );
        assert_eq!(order(&l), vec![2, 3, 5, 4]);
    }
}
