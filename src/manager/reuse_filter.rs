//! The reuse filter (`store_threshold >= 2`): a key is stored only once it has
//! been offered `threshold` times. Offer counts live in an LRU tracker capped at
//! `max_tracker_size`; an offer larger than the tracker keeps all of its own
//! keys (the cap is restored at the next offer) so it still makes progress.

use std::collections::{BTreeMap, HashMap};

use crate::key::{ChunkKey, KeyBuildHasher};

#[derive(Debug)]
pub(crate) struct ReuseFilter {
    threshold: u32,
    capacity: usize,
    counts: HashMap<ChunkKey, (u32, u64), KeyBuildHasher>,
    by_age: BTreeMap<u64, ChunkKey>,
    tick: u64,
}

impl ReuseFilter {
    pub(crate) fn new(threshold: u32, capacity: u64) -> Self {
        Self {
            threshold,
            capacity: usize::try_from(capacity).unwrap_or(usize::MAX).max(1),
            counts: HashMap::default(),
            by_age: BTreeMap::new(),
            tick: 0,
        }
    }

    /// Counts one offer of each of `keys` (keys not in the tier); keeps those offered
    /// at least `threshold` times and returns how many were skipped.
    pub(crate) fn admit(&mut self, keys: &mut Vec<ChunkKey>) -> u64 {
        let first_tick = self.tick + 1;
        let mut skipped = 0;
        keys.retain(|&k| {
            self.tick += 1;
            let (count, old) = self.counts.get(&k).copied().unwrap_or((0, 0));
            if old != 0 {
                self.by_age.remove(&old);
            }
            let count = count + 1;
            if count >= self.threshold {
                self.counts.remove(&k);
                true
            } else {
                self.counts.insert(k, (count, self.tick));
                self.by_age.insert(self.tick, k);
                skipped += 1;
                false
            }
        });
        while self.counts.len() > self.capacity {
            let Some((&age, &k)) = self.by_age.iter().next() else {
                break;
            };
            if age >= first_tick {
                break; // never drop a key of the offer being counted
            }
            self.by_age.remove(&age);
            self.counts.remove(&k);
        }
        skipped
    }

    pub(crate) fn clear(&mut self) {
        self.counts.clear();
        self.by_age.clear();
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

    #[test]
    fn keys_pass_on_their_threshold_offer() {
        let mut f = ReuseFilter::new(2, 10);
        let mut a = keys(&[1, 2]);
        assert_eq!(f.admit(&mut a), 2);
        assert!(a.is_empty());
        let mut b = keys(&[2, 3]);
        assert_eq!(f.admit(&mut b), 1);
        assert_eq!(b, keys(&[2]));
        assert_eq!(f.tracked(), 2, "1 and 3 are tracked, 2 passed");
    }

    #[test]
    fn tracker_is_capped_by_age_but_an_oversized_offer_progresses() {
        let mut f = ReuseFilter::new(2, 2);
        let mut a = keys(&[1, 2, 3, 4]);
        f.admit(&mut a);
        assert_eq!(f.tracked(), 4, "the offer keeps its own keys");
        let mut b = keys(&[1, 2, 3, 4]);
        assert_eq!(f.admit(&mut b), 0);
        assert_eq!(b, keys(&[1, 2, 3, 4]));
        let mut c = keys(&[5, 6, 7]);
        f.admit(&mut c);
        let mut d = keys(&[8]);
        f.admit(&mut d);
        assert_eq!(f.tracked(), 2, "oldest dropped once the offer is over");
        let mut e = keys(&[5]);
        assert_eq!(
            f.admit(&mut e),
            1,
            "5 was dropped from the tracker: counts from 1 again"
        );
    }
}
