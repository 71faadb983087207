//! The reuse filter (`store_threshold >= 2`), as vLLM 0.33's CPU manager
//! keeps it: every offer counts each offered key once (present keys too); a
//! key absent from the tier is stored once its count reaches the threshold.
//! Counts live in an LRU tracker of at most `max_tracker_size` keys; a key
//! counted in the current offer is never dropped for a new one (if the whole
//! tracker was counted by this offer, the new key is simply not tracked).

use std::collections::{BTreeMap, HashMap};

use crate::key::{ChunkKey, KeyBuildHasher};

#[derive(Debug)]
pub(crate) struct ReuseFilter {
    threshold: u32,
    capacity: usize,
    /// Key -> (offer count, age tick in `by_age`).
    counts: HashMap<ChunkKey, (u32, u64), KeyBuildHasher>,
    /// Tracked keys by age, oldest first.
    by_age: BTreeMap<u64, ChunkKey>,
    tick: u64,
}

impl ReuseFilter {
    pub(crate) fn new(threshold: u32, capacity: u64) -> Self {
        Self {
            threshold,
            capacity: usize::try_from(capacity).unwrap_or(usize::MAX),
            counts: HashMap::default(),
            by_age: BTreeMap::new(),
            tick: 0,
        }
    }

    fn bump_age(&mut self, key: ChunkKey, old: u64) -> u64 {
        self.by_age.remove(&old);
        self.tick += 1;
        self.by_age.insert(self.tick, key);
        self.tick
    }

    /// Counts one offer of `offered` (vLLM's `_record_accesses`).
    pub(crate) fn record(&mut self, offered: &[ChunkKey]) {
        let first_tick = self.tick + 1;
        let mut protected = 0usize;
        for &k in offered {
            if let Some(&(count, age)) = self.counts.get(&k) {
                if age < first_tick {
                    protected += 1; // a repeat in this offer is protected once
                }
                let age = self.bump_age(k, age);
                self.counts.insert(k, (count + 1, age));
            }
        }
        let mut unprotected = self.counts.len() - protected;
        for &k in offered {
            if self.counts.contains_key(&k) {
                continue;
            }
            if self.counts.len() >= self.capacity {
                if unprotected == 0 {
                    continue;
                }
                if let Some((&age, &old)) = self.by_age.iter().next() {
                    self.by_age.remove(&age);
                    self.counts.remove(&old);
                }
                unprotected -= 1;
            }
            self.tick += 1;
            self.counts.insert(k, (1, self.tick));
            self.by_age.insert(self.tick, k);
        }
    }

    /// Keeps the candidates (keys absent from the tier, with their positions)
    /// offered at least `threshold` times; returns how many were skipped.
    pub(crate) fn admit(&self, keys: &mut Vec<ChunkKey>, positions: &mut Vec<u64>) -> u64 {
        let before = keys.len();
        let mut i = 0;
        while i < keys.len() {
            let count = self.counts.get(&keys[i]).map_or(0, |c| c.0);
            if count >= self.threshold {
                i += 1;
            } else {
                keys.remove(i);
                positions.remove(i);
            }
        }
        (before - keys.len()) as u64
    }

    #[cfg(test)]
    pub(crate) fn tracked(&self) -> usize {
        self.counts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(v: &[u64]) -> Vec<ChunkKey> {
        v.iter().map(|&k| ChunkKey(k)).collect()
    }

    fn offer(f: &mut ReuseFilter, v: &[u64]) -> Vec<ChunkKey> {
        let mut k = keys(v);
        f.record(&k);
        let mut p = vec![0; k.len()];
        f.admit(&mut k, &mut p);
        k
    }

    #[test]
    fn keys_pass_from_their_threshold_offer_on() {
        let mut f = ReuseFilter::new(2, 10);
        assert!(offer(&mut f, &[1, 2]).is_empty());
        assert_eq!(offer(&mut f, &[2, 3]), keys(&[2]));
        assert_eq!(
            offer(&mut f, &[2]),
            keys(&[2]),
            "counts stay past the threshold"
        );
        assert_eq!(f.tracked(), 3);
    }

    #[test]
    fn a_full_tracker_drops_its_oldest_key_but_never_one_counted_by_this_offer() {
        let mut f = ReuseFilter::new(2, 2);
        offer(&mut f, &[1, 2]);
        // 1 and 2 are counted again by this offer: 3 is not tracked.
        assert_eq!(offer(&mut f, &[1, 2, 3]), keys(&[1, 2]));
        assert_eq!(f.tracked(), 2);
        // 4 replaces the oldest unprotected key (1).
        offer(&mut f, &[2, 4]);
        assert_eq!(offer(&mut f, &[1]), keys(&[]), "1 counts from 1 again");
    }
}
