//! The fence index: GPU blocks of finished requests that are still the source
//! of a pending store. When such a block is allocated again, its jobs are flushed.

use std::collections::HashMap;

use crate::ids::{GpuBlockId, JobId};
use crate::key::KeyBuildHasher;

/// GPU block → the pending stores reading it.
#[derive(Debug, Default, Clone)]
pub(crate) struct FenceIndex {
    map: HashMap<GpuBlockId, Vec<JobId>, KeyBuildHasher>,
}

impl FenceIndex {
    /// Fences `blocks` for `job` (null blocks are skipped).
    pub fn add(&mut self, job: JobId, blocks: &[GpuBlockId]) {
        for &b in blocks {
            if b.0 == 0 {
                continue;
            }
            let jobs = self.map.entry(b).or_default();
            if !jobs.contains(&job) {
                jobs.push(job);
            }
        }
    }

    /// Removes `job` from the fences of `blocks`; a block with no job left is dropped.
    pub fn remove(&mut self, job: JobId, blocks: &[GpuBlockId]) {
        for b in blocks {
            if let Some(jobs) = self.map.get_mut(b) {
                jobs.retain(|&j| j != job);
                if jobs.is_empty() {
                    self.map.remove(b);
                }
            }
        }
    }

    /// The jobs fencing `block`.
    pub fn jobs(&self, block: GpuBlockId) -> &[JobId] {
        self.map.get(&block).map_or(&[], Vec::as_slice)
    }

    /// Whether no block is fenced (cheap check before a per-block scan).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Distinct fenced blocks.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Drops every fence.
    pub fn clear(&mut self) {
        self.map.clear();
    }

    /// Every (block, jobs) pair.
    pub fn iter(&self) -> impl Iterator<Item = (GpuBlockId, &[JobId])> {
        self.map.iter().map(|(b, j)| (*b, j.as_slice()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_remove_and_drop_empty_blocks() {
        let mut f = FenceIndex::default();
        f.add(JobId(1), &[GpuBlockId(0), GpuBlockId(3), GpuBlockId(4)]);
        f.add(JobId(2), &[GpuBlockId(4)]);
        f.add(JobId(2), &[GpuBlockId(4)]);
        assert_eq!(f.len(), 2, "the null block is never fenced");
        assert_eq!(f.jobs(GpuBlockId(4)), &[JobId(1), JobId(2)]);
        f.remove(JobId(1), &[GpuBlockId(3), GpuBlockId(4)]);
        assert_eq!(f.len(), 1, "block 3 has no job left and is dropped");
        assert_eq!(f.jobs(GpuBlockId(4)), &[JobId(2)]);
        f.remove(JobId(2), &[GpuBlockId(4)]);
        assert!(f.is_empty());
        assert!(f.jobs(GpuBlockId(9)).is_empty());
    }
}
