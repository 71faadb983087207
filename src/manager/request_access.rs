//! One request's view of the host tier (vLLM 0.33's `_RequestCacheAccess`
//! plus the LRU policy's request rank): the keys it observed, in first-seen
//! order, with their positions, and whether it inserted or reused each.
//!
//! vLLM keeps this on the request's context; finishing the request replays it
//! into the eviction policy (tail first, so the prefix head ends most recent).
//! A record belongs to one cache generation: after a reset the manager treats
//! an older record as empty, exactly as vLLM's generation checks do.

use std::collections::HashMap;

use crate::key::{ChunkKey, KeyBuildHasher};

/// One key a request observed (16 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SeenKey {
    /// The chunk key.
    pub key: ChunkKey,
    /// Its end position in the request in chunks (>= 1), or 0 if unknown.
    position: u32,
    flags: u8,
}

const INSERTED: u8 = 1;
const REUSED: u8 = 2;
const STORE_MISS: u8 = 4;

impl SeenKey {
    /// The request allocated it (a successful `prepare_store`).
    pub fn inserted(&self) -> bool {
        self.flags & INSERTED != 0
    }
    /// The request read it while it was ready, and not as its own insertion.
    pub fn reused(&self) -> bool {
        self.flags & REUSED != 0
    }
    /// A store of it was already shown to the policy as a miss (ARC adapts
    /// once per request and key).
    #[cfg(test)]
    pub fn store_miss(&self) -> bool {
        self.flags & STORE_MISS != 0
    }
}

/// The LRU rank a request holds while it is active, and the anchor of its
/// group in the LRU order (see `lru.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RequestRank {
    /// The rank's major component (a global counter value).
    pub rank: u64,
    /// The LRU node that anchors the request's keys in the order.
    pub anchor: u32,
}

/// What one request observed on the host tier.
///
/// Keys with a position (the scheduler's: chunk `i` ends at position `i + 1`)
/// are found through a dense array indexed by position; keys without one (the
/// manager's public calls) through a hash map.
#[derive(Debug, Default, Clone)]
pub(crate) struct RequestAccess {
    /// Cache generation this record belongs to.
    generation: u64,
    seen: Vec<SeenKey>,
    /// `by_position[p - 1]`: 1 + index in `seen` of the key at position `p` (0: none).
    by_position: Vec<u32>,
    by_key: HashMap<ChunkKey, u32, KeyBuildHasher>,
    /// The LRU request rank, once assigned in this generation.
    pub(crate) rank: Option<RequestRank>,
    /// `request_finished` was applied (later finishes are no-ops).
    pub(crate) finished: bool,
}

/// A position as stored: chunk units, saturated, 0 for none.
#[inline]
fn stored_position(position: Option<u64>) -> u32 {
    position.map_or(0, |p| u32::try_from(p).unwrap_or(u32::MAX).max(1))
}

impl RequestAccess {
    /// Makes the record current: a record of an older generation is emptied
    /// (its LRU anchor went with the reset that changed the generation).
    #[inline]
    pub(crate) fn refresh(&mut self, generation: u64) {
        if self.generation != generation {
            *self = Self {
                generation,
                ..Self::default()
            };
        }
    }

    /// Whether the record belongs to `generation`.
    #[inline]
    pub(crate) fn is_of(&self, generation: u64) -> bool {
        self.generation == generation
    }

    #[inline]
    fn find(&self, key: ChunkKey, position: Option<u64>) -> Option<usize> {
        match stored_position(position) {
            0 => self.by_key.get(&key).map(|&i| i as usize),
            p => match self.by_position.get(p as usize - 1) {
                Some(&i) if i != 0 && self.seen[i as usize - 1].key == key => Some(i as usize - 1),
                _ => None,
            },
        }
    }

    /// The record of `key` (at `position`, if it has one), if seen.
    #[cfg(test)]
    pub(crate) fn get(&self, key: ChunkKey, position: Option<u64>) -> Option<&SeenKey> {
        self.find(key, position).map(|i| &self.seen[i])
    }

    /// Observes `key` at `position`: its index in the record, and whether it
    /// was not seen before (the policy hears of first observations only).
    #[inline]
    pub(crate) fn observe(&mut self, key: ChunkKey, position: Option<u64>) -> (usize, bool) {
        if let Some(i) = self.find(key, position) {
            return (i, false);
        }
        let i = self.seen.len();
        let p = stored_position(position);
        self.seen.push(SeenKey {
            key,
            position: p,
            flags: 0,
        });
        if p == 0 {
            self.by_key.insert(key, i as u32);
        } else {
            let at = p as usize - 1;
            if self.by_position.len() <= at {
                self.by_position.resize(at + 1, 0);
            }
            self.by_position[at] = i as u32 + 1;
        }
        (i, true)
    }

    /// Marks the key at index `i` as shown to the policy as a store miss;
    /// false if it already was (ARC adapts once per request and key).
    #[inline]
    pub(crate) fn note_store_miss_at(&mut self, i: usize) -> bool {
        let s = &mut self.seen[i];
        let new = s.flags & STORE_MISS == 0;
        s.flags |= STORE_MISS;
        new
    }

    /// Marks the key at index `i` as inserted by this request.
    #[inline]
    pub(crate) fn mark_inserted_at(&mut self, i: usize) {
        self.seen[i].flags |= INSERTED;
    }

    /// Marks the key at index `i` as reused, unless this request inserted it
    /// (a re-read of its own insertion is not a second access).
    #[inline]
    pub(crate) fn mark_reused_at(&mut self, i: usize) {
        let s = &mut self.seen[i];
        if s.flags & INSERTED == 0 {
            s.flags |= REUSED;
        }
    }

    /// The observed keys head to tail: by position when every key has one,
    /// else in first-seen order. With `groups` KV groups a position is
    /// `chunk * groups + (groups - 1 - group)` (see
    /// [`super::OffloadManager::set_position_groups`]): head to tail is by
    /// chunk, then group (vLLM's order across groups).
    pub(crate) fn head_to_tail(&self, groups: u32) -> Vec<SeenKey> {
        let mut keys = self.seen.clone();
        if keys.iter().all(|s| s.position != 0) {
            let g = groups.max(1);
            keys.sort_by_key(|s| (s.position / g, g - 1 - s.position % g));
        }
        keys
    }

    /// Number of keys observed.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.seen.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_observation_only_and_reuse_excludes_own_insertions() {
        let mut a = RequestAccess::default();
        let (k1, k2) = (ChunkKey(1), ChunkKey(2));
        let (i1, new) = a.observe(k1, Some(2));
        assert!(new);
        assert_eq!(a.observe(k1, Some(2)), (i1, false), "seen once");
        a.mark_inserted_at(i1);
        a.mark_reused_at(i1);
        assert!(!a.get(k1, Some(2)).unwrap().reused(), "own insertion");
        let (i2, new) = a.observe(k2, Some(1));
        assert!(new);
        a.mark_reused_at(i2);
        assert!(a.get(k2, Some(1)).unwrap().reused());
        let order: Vec<_> = a.head_to_tail(1).iter().map(|s| s.key).collect();
        assert_eq!(order, vec![k2, k1], "sorted by position");
        assert!(
            a.get(ChunkKey(9), Some(1)).is_none(),
            "another key at a known position"
        );
    }

    #[test]
    fn without_positions_the_order_is_first_seen_and_a_new_generation_empties() {
        let mut a = RequestAccess::default();
        let (i5, _) = a.observe(ChunkKey(5), None);
        a.observe(ChunkKey(3), None);
        let order: Vec<_> = a.head_to_tail(1).iter().map(|s| s.key).collect();
        assert_eq!(order, vec![ChunkKey(5), ChunkKey(3)]);
        assert!(a.note_store_miss_at(i5));
        assert!(!a.note_store_miss_at(i5), "once per key");
        assert!(a.get(ChunkKey(5), None).unwrap().store_miss());
        a.refresh(0);
        assert_eq!(a.len(), 2, "same generation: kept");
        a.refresh(1);
        assert_eq!(a.len(), 0);
        assert!(a.get(ChunkKey(5), None).is_none());
    }
}
