//! The KV groups a [`Scheduler`](crate::scheduler::Scheduler) offloads when
//! it has several (vLLM's hybrid manager): their shapes and the store policy
//! they share, checked once at construction.

use super::shape::GroupShape;
use super::store::{Retention, StorePolicy, alignment_tokens};

/// The KV groups of a hybrid model, in vLLM's group order (the order of
/// `KVCacheConfig.kv_cache_groups`), and which window tails are stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroups {
    /// Each group's shape. Every group has the configuration's chunk size
    /// (one block size and `blocks_per_chunk` for all groups).
    pub shapes: Vec<GroupShape>,
    /// Which window tails sliding-window groups store (vLLM's
    /// `prefix_cache_retention_interval`; its default is
    /// [`Retention::BoundariesOnly`]).
    pub retention: Retention,
}

/// Why a set of KV groups cannot be offloaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvGroupsError {
    /// No group at all.
    #[error("no KV group given")]
    Empty,
    /// A group's chunk size is not the configuration's.
    #[error(
        "group {group}: chunks of {tokens} tokens, the configuration's are {expected} (one block size for every group)"
    )]
    ChunkSize {
        /// The group.
        group: usize,
        /// Its chunk size in tokens.
        tokens: u64,
        /// The configuration's.
        expected: u64,
    },
    /// Full-attention groups with different chunk sizes leave no alignment.
    #[error("full-attention groups disagree on their chunk size")]
    NoAlignment,
}

/// What the scheduler keeps of its groups.
#[derive(Debug, Clone)]
pub(crate) struct SchedulerGroups {
    /// Each group's shape.
    pub shapes: Vec<GroupShape>,
    /// The store selection's configuration.
    pub policy: StorePolicy,
    /// Whether group `g` is windowed (a sliding window or chunked-local
    /// attention: vLLM frees its blocks behind the window while a request
    /// runs).
    pub windowed: Vec<bool>,
}

impl SchedulerGroups {
    /// Checks `groups` against the configuration's chunk (`tokens_per_chunk`
    /// tokens, `blocks_per_chunk` blocks).
    pub fn new(
        groups: KvGroups,
        tokens_per_chunk: u64,
        blocks_per_chunk: usize,
    ) -> Result<Self, KvGroupsError> {
        if groups.shapes.is_empty() {
            return Err(KvGroupsError::Empty);
        }
        for (group, shape) in groups.shapes.iter().enumerate() {
            if shape.tokens_per_chunk() != tokens_per_chunk {
                return Err(KvGroupsError::ChunkSize {
                    group,
                    tokens: shape.tokens_per_chunk(),
                    expected: tokens_per_chunk,
                });
            }
        }
        let alignment = alignment_tokens(&groups.shapes).ok_or(KvGroupsError::NoAlignment)?;
        Ok(Self {
            windowed: groups
                .shapes
                .iter()
                .map(|s| !s.is_full_attention())
                .collect(),
            policy: StorePolicy {
                blocks_per_chunk,
                alignment_tokens: Some(alignment),
                retention: groups.retention,
            },
            shapes: groups.shapes,
        })
    }

    /// Groups.
    pub fn len(&self) -> usize {
        self.shapes.len()
    }

    /// The host tier's position of chunk `chunk` of group `group`: chunks in
    /// order, and at one chunk the groups as vLLM's LRU orders them
    /// ([`crate::manager::OffloadManager`]'s position groups).
    pub fn position(&self, group: usize, chunk: usize) -> u64 {
        let n = self.len() as u64;
        (chunk as u64 + 1) * n + (n - 1 - group as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_must_share_the_configured_chunk() {
        let full = GroupShape::full_attention(8).unwrap();
        let w16 = GroupShape::sliding_window(8, 16).unwrap();
        let other = GroupShape::sliding_window(4, 16).unwrap();
        let make = |shapes: Vec<GroupShape>| {
            SchedulerGroups::new(
                KvGroups {
                    shapes,
                    retention: Retention::Dense,
                },
                8,
                2,
            )
        };
        let ok = make(vec![full, w16]).unwrap();
        assert_eq!(ok.len(), 2);
        assert_eq!(ok.windowed, vec![false, true]);
        assert_eq!(ok.policy.alignment_tokens, Some(8));
        assert_eq!(make(vec![]).unwrap_err(), KvGroupsError::Empty);
        assert_eq!(
            make(vec![full, other]).unwrap_err(),
            KvGroupsError::ChunkSize {
                group: 1,
                tokens: 4,
                expected: 8
            }
        );
    }
}
