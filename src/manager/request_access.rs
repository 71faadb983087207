//! What each live request stored or read on the host tier, in prefix order,
//! so that finishing the request orders its chunks head-most-recent.

use std::collections::HashMap;

use crate::key::{ChunkKey, KeyBuildHasher};

/// The chunks one request touched, deduplicated, in first-seen (prefix) order.
#[derive(Debug, Default)]
pub(crate) struct RequestAccess {
    order: Vec<(ChunkKey, bool)>,
    position: HashMap<ChunkKey, u32, KeyBuildHasher>,
}

impl RequestAccess {
    /// Records an access; `reused` is true for a read of an existing chunk.
    pub(crate) fn record(&mut self, key: ChunkKey, reused: bool) {
        match self.position.get(&key) {
            Some(&i) => self.order[i as usize].1 |= reused,
            None => {
                self.position.insert(key, self.order.len() as u32);
                self.order.push((key, reused));
            }
        }
    }

    /// The accesses, tail first (reverse prefix order).
    pub(crate) fn tail_first(&self) -> impl Iterator<Item = (ChunkKey, bool)> + '_ {
        self.order.iter().rev().copied()
    }
}
