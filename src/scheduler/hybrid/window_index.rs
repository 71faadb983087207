//! Where each GPU block sits in the sliding-window groups' block tables, so
//! that a step drops a window block allocated again (the window freed it and
//! another request now holds it) by looking up the step's new blocks, not by
//! reading every request's tables (a cache miss per request and group each
//! step: most of a hybrid step's time with a thousand requests).
//!
//! The index may hold more than is true (a place emptied since, a request
//! gone, a table cleared): every place is checked against the table before
//! it is acted on. It holds every true place: blocks enter the windows'
//! tables only through a step's block updates, which add them here, and a
//! place behind the store cursor is kept (should a cursor ever move back
//! over it; a reset empties such places instead).
//! A block's places are looked up, and the false ones dropped, each time
//! the block is allocated again: the index holds, per block, the places put
//! since its last allocation and those still behind a store cursor.

use std::collections::HashMap;

use crate::ids::GpuBlockId;
use crate::key::KeyBuildHasher;

/// One place a block was put: the request's slot, the group, the index in
/// the group's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WindowPlace {
    /// The request's slot in the request table.
    pub slot: u32,
    /// The sliding-window group.
    pub group: u32,
    /// The block's index in that group's table.
    pub index: u32,
}

/// The places of the blocks in the sliding-window groups' tables.
#[derive(Debug, Default)]
pub(crate) struct WindowIndex {
    places: HashMap<GpuBlockId, Vec<WindowPlace>, KeyBuildHasher>,
}

impl WindowIndex {
    /// Block `block` was put at `place` (null blocks are not indexed).
    pub(crate) fn put(&mut self, block: GpuBlockId, place: WindowPlace) {
        if block.0 != 0 {
            self.places.entry(block).or_default().push(place);
        }
    }

    /// The places recorded for `block`, taken out of the index (the caller
    /// puts back those it keeps).
    pub(crate) fn take(&mut self, block: GpuBlockId) -> Vec<WindowPlace> {
        self.places.remove(&block).unwrap_or_default()
    }

    /// Places recorded.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.places.values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_taken_once_and_null_blocks_never_indexed() {
        let mut w = WindowIndex::default();
        let at = |slot, index| WindowPlace {
            slot,
            group: 1,
            index,
        };
        w.put(GpuBlockId(7), at(0, 3));
        w.put(GpuBlockId(7), at(2, 0));
        w.put(GpuBlockId(0), at(1, 1));
        assert_eq!(w.len(), 2);
        assert_eq!(w.take(GpuBlockId(7)), vec![at(0, 3), at(2, 0)]);
        assert!(w.take(GpuBlockId(7)).is_empty());
        assert!(w.take(GpuBlockId(0)).is_empty());
        assert_eq!(w.len(), 0);
    }
}
