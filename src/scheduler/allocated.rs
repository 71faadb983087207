//! The GPU blocks allocated in the step being built, for the fence checks.
//!
//! Most steps only append (one push per new block) and clear; membership is
//! asked only when a finished request plans a store, so the list is sorted
//! on the first such query instead of hashing every allocation.

use crate::ids::GpuBlockId;

/// Non-null blocks allocated in this step (possibly repeated).
#[derive(Debug, Default)]
pub(crate) struct AllocatedBlocks {
    blocks: Vec<GpuBlockId>,
    /// `blocks` is sorted and deduplicated.
    sorted: bool,
}

impl AllocatedBlocks {
    /// Adds the non-null blocks of `blocks`.
    #[inline]
    pub(crate) fn extend_non_null(&mut self, blocks: &[GpuBlockId]) {
        for &b in blocks {
            if b.0 != 0 {
                self.blocks.push(b);
                self.sorted = false;
            }
        }
    }

    /// Whether `b` was allocated in this step.
    pub(crate) fn contains(&mut self, b: GpuBlockId) -> bool {
        if !self.sorted {
            self.blocks.sort_unstable();
            self.blocks.dedup();
            self.sorted = true;
        }
        self.blocks.binary_search(&b).is_ok()
    }

    /// The allocated blocks (unordered, possibly repeated).
    pub(crate) fn as_slice(&self) -> &[GpuBlockId] {
        &self.blocks
    }

    /// No block was allocated.
    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Forgets the step's blocks (keeps the buffer).
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
        self.sorted = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_blocks_are_skipped_and_membership_survives_interleaved_pushes() {
        let mut a = AllocatedBlocks::default();
        a.extend_non_null(&[GpuBlockId(5), GpuBlockId(0), GpuBlockId(2)]);
        assert!(a.contains(GpuBlockId(5)));
        assert!(!a.contains(GpuBlockId(0)));
        a.extend_non_null(&[GpuBlockId(1), GpuBlockId(5)]);
        assert!(a.contains(GpuBlockId(1)));
        assert!(a.contains(GpuBlockId(2)));
        assert!(!a.contains(GpuBlockId(3)));
        assert_eq!(a.as_slice().len(), 3);
        a.clear();
        assert!(a.is_empty());
        assert!(!a.contains(GpuBlockId(1)));
    }
}
