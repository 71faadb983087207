//! The KV groups a [`Scheduler`](crate::scheduler::Scheduler) offloads when
//! it has several (vLLM's hybrid manager): their shapes and the store policy
//! they share, checked once at construction.

use super::shape::GroupShape;
use super::store::{Retention, StorePolicy, alignment_tokens};

/// The KV groups of a hybrid model, in vLLM's group order (the order of
/// `KVCacheConfig.kv_cache_groups`), and which window tails are stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroups {
    /// Each group's shape. Every group's chunk is `blocks_per_chunk` of its
    /// own blocks; a group's block is a whole number of the configuration's
    /// blocks (vLLM gives a group of smaller pages larger blocks, so that
    /// every group has one page size).
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
    /// A group's chunk is not `blocks_per_chunk` whole configuration blocks.
    #[error(
        "group {group}: chunks of {tokens} tokens are not {blocks_per_chunk} blocks of a whole number of the configuration's {tokens_per_block}-token blocks"
    )]
    ChunkSize {
        /// The group.
        group: usize,
        /// Its chunk size in tokens.
        tokens: u64,
        /// The configuration's blocks in a chunk.
        blocks_per_chunk: usize,
        /// The configuration's block (the finest group block).
        tokens_per_block: u64,
    },
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
    /// Per group, the request's block hashes (one per configuration block)
    /// in one of its chunks: a chunk's key is the last of them.
    pub hashes_per_chunk: Vec<usize>,
    /// Per group, the configuration's chunks in one of its chunks.
    pub chunk_factor: Vec<usize>,
    /// The configuration's chunk in tokens (positions are in tokens).
    pub unit_tokens: u64,
}

impl SchedulerGroups {
    /// Checks `groups` against the configuration's block
    /// (`tokens_per_block` tokens) and `blocks_per_chunk`.
    pub fn new(
        groups: KvGroups,
        tokens_per_block: u64,
        blocks_per_chunk: usize,
    ) -> Result<Self, KvGroupsError> {
        if groups.shapes.is_empty() {
            return Err(KvGroupsError::Empty);
        }
        let unit = tokens_per_block.max(1) * blocks_per_chunk.max(1) as u64;
        let mut chunk_factor = Vec::with_capacity(groups.shapes.len());
        for (group, shape) in groups.shapes.iter().enumerate() {
            let tokens = shape.tokens_per_chunk();
            if !tokens.is_multiple_of(unit) {
                return Err(KvGroupsError::ChunkSize {
                    group,
                    tokens,
                    blocks_per_chunk,
                    tokens_per_block,
                });
            }
            chunk_factor.push((tokens / unit) as usize);
        }
        Ok(Self {
            windowed: groups
                .shapes
                .iter()
                .map(|s| !s.is_full_attention())
                .collect(),
            policy: StorePolicy {
                blocks_per_chunk,
                // None where full-attention groups disagree on their chunk
                // (vLLM's connector then aligns nothing).
                alignment_tokens: alignment_tokens(&groups.shapes),
                retention: groups.retention,
            },
            hashes_per_chunk: chunk_factor
                .iter()
                .map(|f| f * blocks_per_chunk.max(1))
                .collect(),
            chunk_factor,
            unit_tokens: unit,
            shapes: groups.shapes,
        })
    }

    /// Groups.
    pub fn len(&self) -> usize {
        self.shapes.len()
    }

    /// The hashes in one chunk of group `group`.
    pub fn hashes_per_chunk(&self, group: usize) -> usize {
        self.hashes_per_chunk.get(group).copied().unwrap_or(1)
    }

    /// Group `group`'s chunks `chunks` as the configuration's chunks (a
    /// range of tokens in one unit for every group).
    pub fn unit_chunks(
        &self,
        group: usize,
        chunks: std::ops::Range<usize>,
    ) -> std::ops::Range<usize> {
        let f = self.chunk_factor.get(group).copied().unwrap_or(1);
        chunks.start * f..chunks.end * f
    }

    /// The host tier's position of chunk `chunk` of group `group`: by the
    /// token the chunk ends at (in the configuration's chunks; vLLM's key
    /// position), and at one end the groups as vLLM's LRU orders them
    /// ([`crate::manager::OffloadManager`]'s position groups).
    pub fn position(&self, group: usize, chunk: usize) -> u64 {
        let end = self.unit_chunks(group, chunk..chunk + 1).end as u64;
        self.token_position(group, end * self.unit_tokens)
    }

    /// The position of a key of group `group` ending at token `end` (a
    /// partial tail's boundary; a chunk's end for [`Self::position`]).
    pub fn token_position(&self, group: usize, end: u64) -> u64 {
        let n = self.len() as u64;
        end * n + (n - 1 - group as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_chunks_are_whole_configuration_chunks() {
        let full = GroupShape::full_attention(8).unwrap();
        let w16 = GroupShape::sliding_window(8, 16).unwrap();
        let other = GroupShape::sliding_window(4, 16).unwrap();
        let larger = GroupShape::sliding_window(16, 16).unwrap();
        let make = |shapes: Vec<GroupShape>| {
            SchedulerGroups::new(
                KvGroups {
                    shapes,
                    retention: Retention::Dense,
                },
                4,
                2,
            )
        };
        let ok = make(vec![full, w16]).unwrap();
        assert_eq!(ok.len(), 2);
        assert_eq!(ok.windowed, vec![false, true]);
        assert_eq!(ok.policy.alignment_tokens, Some(8));
        assert_eq!(ok.hashes_per_chunk, vec![2, 2]);
        // A group of twice the blocks: twice the hashes a chunk.
        let mixed = make(vec![full, larger]).unwrap();
        assert_eq!(mixed.hashes_per_chunk, vec![2, 4]);
        assert_eq!(mixed.unit_chunks(1, 1..3), 2..6);
        // Ordered by the token a chunk ends at, then by group: chunk 0 of
        // group 1 ends with chunk 1 of group 0.
        assert_eq!(mixed.position(0, 1), 16 * 2 + 1);
        assert_eq!(mixed.position(1, 0), 16 * 2);
        assert_eq!(mixed.token_position(1, 12), 12 * 2);
        assert!(mixed.position(0, 0) < mixed.position(1, 0));
        assert_eq!(mixed.policy.alignment_tokens, Some(8));
        assert_eq!(make(vec![]).unwrap_err(), KvGroupsError::Empty);
        assert_eq!(
            make(vec![full, other]).unwrap_err(),
            KvGroupsError::ChunkSize {
                group: 1,
                tokens: 4,
                blocks_per_chunk: 2,
                tokens_per_block: 4,
            }
        );
    }
}
