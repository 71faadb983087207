//! What each live request stored or read on the host tier, in prefix order,
//! so that finishing the request orders its chunks head-most-recent.
//!
//! Recording is one push per offered key (the hot path); duplicates from
//! re-offers are folded once, when the request finishes.

use std::collections::HashMap;

use crate::key::{ChunkKey, KeyBuildHasher};

/// The chunks one request touched, in offer (prefix) order, possibly repeated.
#[derive(Debug, Default, Clone)]
pub(crate) struct RequestAccess {
    order: Vec<(ChunkKey, bool)>,
}

impl RequestAccess {
    /// Records an access; `reused` is true for a read of an existing chunk.
    #[inline]
    pub(crate) fn record(&mut self, key: ChunkKey, reused: bool) {
        self.order.push((key, reused));
    }

    /// Records reads of `keys` (a load).
    pub(crate) fn record_reads(&mut self, keys: &[ChunkKey]) {
        self.order.extend(keys.iter().map(|&k| (k, true)));
    }

    /// Appends the accesses of `later` after this record's.
    pub(crate) fn append(&mut self, mut later: RequestAccess) {
        self.order.append(&mut later.order);
    }

    /// The distinct keys, tail first (reverse order of first access), each with
    /// `reused` true if any of its accesses was a read.
    pub(crate) fn tail_first(&self) -> Vec<(ChunkKey, bool)> {
        let mut first: HashMap<ChunkKey, usize, KeyBuildHasher> = HashMap::default();
        let mut distinct: Vec<(ChunkKey, bool)> = Vec::with_capacity(self.order.len());
        for &(k, reused) in &self.order {
            match first.get(&k) {
                Some(&i) => distinct[i].1 |= reused,
                None => {
                    first.insert(k, distinct.len());
                    distinct.push((k, reused));
                }
            }
        }
        distinct.reverse();
        distinct
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_accesses_fold_into_first_position_and_any_read() {
        let mut a = RequestAccess::default();
        for (k, r) in [(1, false), (2, false), (1, true), (3, false), (2, false)] {
            a.record(ChunkKey(k), r);
        }
        assert_eq!(
            a.tail_first(),
            vec![
                (ChunkKey(3), false),
                (ChunkKey(2), false),
                (ChunkKey(1), true)
            ]
        );
    }
}
