//! Which of a request's GPU blocks a hybrid load fills, group by group:
//! vLLM 0.33.0's `update_state_after_alloc` (its `OffloadingConnectorScheduler`).
//! A hit ending inside a block (a partial tail, `partial_tail.rs`) fills
//! that block too: its chunk is the last of the load's.
//!
//! A full-attention group loads every block past the GPU's hit up to the
//! hit's end. A sliding-window group holds null blocks behind its window:
//! its load starts at its first block past the GPU's hit that is neither null
//! nor already cached (a synchronous load's blocks are hashed when they are
//! allocated, so there the first non-null block starts it), which leaves
//! only the window's blocks.

use std::ops::Range;

use thiserror::Error;

use super::shape::GroupShape;

/// One of a request's GPU blocks in one group, as a load sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuBlock {
    /// The null block: behind a sliding window, nothing is held there.
    Null,
    /// A block holding cached KV (it has a block hash).
    Cached,
    /// A block allocated for this request, not filled yet.
    Fresh,
}

/// What one group's part of a load covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupLoad {
    /// Index in the request's blocks of the first block loaded.
    pub first_block: usize,
    /// Blocks loaded, from `first_block` on.
    pub num_blocks: usize,
    /// The request's chunks whose keys the load reads (empty when the
    /// group loads nothing).
    pub chunks: Range<usize>,
}

/// A load that cannot be planned: vLLM asserts these never happen, so each
/// means the caller's view of the request disagrees with the scheduler's.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LoadPlanError {
    /// One block list per group is needed.
    #[error("{blocks} block lists for {groups} KV groups")]
    GroupCount {
        /// Groups configured.
        groups: usize,
        /// Block lists given.
        blocks: usize,
    },
    /// A chunk is a whole number of blocks.
    #[error(
        "group {group}: {tokens_per_chunk} tokens a chunk is not {blocks_per_chunk} whole blocks"
    )]
    ChunkNotBlocks {
        /// The group.
        group: usize,
        /// Its chunk size.
        tokens_per_chunk: u64,
        /// Blocks a chunk.
        blocks_per_chunk: usize,
    },
    /// The GPU's hit ends inside a block.
    #[error(
        "group {group}: the GPU's hit of {computed} tokens ends inside a block of {tokens_per_block}"
    )]
    UnalignedHit {
        /// The group.
        group: usize,
        /// The GPU's hit.
        computed: u64,
        /// Its block size.
        tokens_per_block: u64,
    },
    /// The request holds fewer blocks than the hit covers.
    #[error("group {group}: {have} blocks allocated, the hit needs {need}")]
    TooFewBlocks {
        /// The group.
        group: usize,
        /// Blocks the request holds.
        have: usize,
        /// Blocks up to the hit's end.
        need: usize,
    },
    /// A sliding-window group would load more than its window.
    #[error("group {group}: {blocks} blocks to load, more than its window allows ({limit})")]
    PastTheWindow {
        /// The group.
        group: usize,
        /// Blocks it would load.
        blocks: usize,
        /// Its window in blocks, plus one.
        limit: usize,
    },
}

/// Plans a load of `external` tokens past the GPU's hit of `computed`:
/// per group (`blocks[g]`, the request's blocks in group `g`), the blocks
/// filled and the chunks read. `sync`: the load finishes inside the step.
pub fn plan_load(
    groups: &[GroupShape],
    blocks_per_chunk: usize,
    computed: u64,
    external: u64,
    sync: bool,
    blocks: &[&[GpuBlock]],
) -> Result<Vec<GroupLoad>, LoadPlanError> {
    if blocks.len() != groups.len() {
        return Err(LoadPlanError::GroupCount {
            groups: groups.len(),
            blocks: blocks.len(),
        });
    }
    let end = computed + external;
    let mut out = Vec::with_capacity(groups.len());
    for (group, (shape, held)) in groups.iter().zip(blocks).enumerate() {
        let tpc = shape.tokens_per_chunk();
        let bpc = blocks_per_chunk.max(1);
        if !tpc.is_multiple_of(bpc as u64) {
            return Err(LoadPlanError::ChunkNotBlocks {
                group,
                tokens_per_chunk: tpc,
                blocks_per_chunk,
            });
        }
        let tpb = tpc / bpc as u64;
        if !computed.is_multiple_of(tpb) {
            return Err(LoadPlanError::UnalignedHit {
                group,
                computed,
                tokens_per_block: tpb,
            });
        }
        let need = end.div_ceil(tpb) as usize;
        if held.len() < need {
            return Err(LoadPlanError::TooFewBlocks {
                group,
                have: held.len(),
                need,
            });
        }
        let first_fresh = (computed / tpb) as usize;
        let first_block = (first_fresh..need)
            .find(|&i| match held[i] {
                GpuBlock::Null => false,
                GpuBlock::Cached => sync,
                GpuBlock::Fresh => true,
            })
            .unwrap_or(need);
        let num_blocks = need - first_block;
        if let Some(window) = shape.window_chunks() {
            let limit = window as usize * bpc + 1;
            if num_blocks > limit {
                return Err(LoadPlanError::PastTheWindow {
                    group,
                    blocks: num_blocks,
                    limit,
                });
            }
        }
        let first_chunk = first_block / bpc;
        let chunks = if num_blocks == 0 {
            first_chunk..first_chunk
        } else {
            first_chunk..end.div_ceil(tpc) as usize
        };
        out.push(GroupLoad {
            first_block,
            num_blocks,
            chunks,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::GpuBlock::{Cached as H, Fresh as N, Null as O};
    use super::*;
    use crate::scheduler::hybrid::shape::fixtures::{full, window};

    #[test]
    fn a_window_loads_its_blocks_and_full_attention_everything_past_the_hit() {
        // 4 tokens on the GPU, 12 to load: full attention loads blocks
        // 1..4; the window (nulls behind it) blocks 2..4.
        let got = plan_load(
            &[full(), window(8)],
            1,
            4,
            12,
            false,
            &[&[H, N, N, N], &[H, O, N, N]],
        )
        .unwrap();
        assert_eq!(
            got,
            vec![
                GroupLoad {
                    first_block: 1,
                    num_blocks: 3,
                    chunks: 1..4
                },
                GroupLoad {
                    first_block: 2,
                    num_blocks: 2,
                    chunks: 2..4
                },
            ]
        );
    }

    #[test]
    fn a_sync_load_starts_at_the_first_block_held_even_if_hashed() {
        let blocks: [&[GpuBlock]; 2] = [&[H, H, H, N], &[O, O, H, N]];
        let got = plan_load(&[full(), window(8)], 1, 0, 15, true, &blocks).unwrap();
        assert_eq!((got[0].first_block, got[0].num_blocks), (0, 4));
        assert_eq!((got[1].first_block, got[1].num_blocks), (2, 2));
        // Asynchronous, the cached blocks are not loaded again.
        let got = plan_load(&[full(), window(8)], 1, 0, 15, false, &blocks).unwrap();
        assert_eq!((got[0].first_block, got[0].num_blocks), (3, 1));
        assert_eq!(got[1].chunks, 3..4);
    }

    #[test]
    fn chunks_of_two_blocks_read_the_chunk_of_the_first_block() {
        let shapes = [
            GroupShape::full_attention(8).unwrap(),
            GroupShape::sliding_window(8, 8).unwrap(),
        ];
        let got = plan_load(&shapes, 2, 0, 20, false, &[&[N; 5], &[O, O, O, N, N]]).unwrap();
        assert_eq!(got[0].chunks, 0..3);
        assert_eq!((got[1].first_block, got[1].chunks.clone()), (3, 1..3));
    }

    #[test]
    fn impossible_views_are_errors_not_panics() {
        let two: [&[GpuBlock]; 2] = [&[N, N], &[N, N]];
        assert_eq!(
            plan_load(&[full()], 1, 0, 8, false, &two),
            Err(LoadPlanError::GroupCount {
                groups: 1,
                blocks: 2
            })
        );
        assert!(matches!(
            plan_load(&[full()], 1, 2, 4, false, &[&[N, N]]),
            Err(LoadPlanError::UnalignedHit { .. })
        ));
        assert!(matches!(
            plan_load(&[full()], 1, 0, 12, false, &[&[N, N]]),
            Err(LoadPlanError::TooFewBlocks { need: 3, .. })
        ));
        assert!(matches!(
            plan_load(&[full()], 3, 0, 4, false, &[&[N]]),
            Err(LoadPlanError::ChunkNotBlocks { .. })
        ));
        assert!(matches!(
            plan_load(&[window(4)], 1, 0, 16, false, &[&[N; 4]]),
            Err(LoadPlanError::PastTheWindow { limit: 2, .. })
        ));
    }

    proptest::proptest! {
        /// Any view: a plan or a typed error, never a panic; a plan ends
        /// every group's load at the hit's end, inside what is held.
        #[test]
        fn plans_end_at_the_hit_or_name_the_problem(
            windows in proptest::collection::vec(proptest::option::of(1u64..24), 1..4),
            tpb in 1u64..9,
            bpc in 1usize..4,
            computed_blocks in 0u64..6,
            external in 0u64..64,
            sync in proptest::bool::ANY,
            blocks in proptest::collection::vec(
                proptest::collection::vec(proptest::sample::select(vec![O, H, N]), 0..24),
                4,
            ),
        ) {
            let tpc = tpb * bpc as u64;
            let groups: Vec<GroupShape> = windows.iter().map(|w| GroupShape::new(tpc, *w).unwrap()).collect();
            let views: Vec<&[GpuBlock]> = blocks[..groups.len()].iter().map(Vec::as_slice).collect();
            let computed = computed_blocks * tpb;
            if let Ok(plan) = plan_load(&groups, bpc, computed, external, sync, &views) {
                let need = (computed + external).div_ceil(tpb) as usize;
                for (g, p) in plan.iter().enumerate() {
                    proptest::prop_assert_eq!(p.first_block + p.num_blocks, need);
                    proptest::prop_assert!(p.first_block >= computed_blocks as usize);
                    proptest::prop_assert!(need <= views[g].len());
                    proptest::prop_assert!(p.chunks.start <= p.chunks.end);
                }
            }
        }
    }
}
