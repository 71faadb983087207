//! Who copies a store into a host pool several workers share
//! (`docs/dataplane.md`, "Replicated KV by turns").
//!
//! Where every tensor-parallel rank holds the same KV (MLA) and the ranks
//! map one host pool, one copy of a chunk is enough. vLLM has rank 0 write
//! every store (every byte over one GPU's link), or, with its
//! `canonical_layout`, every rank (the same bytes `tp` times). Taking turns
//! by host chunk spreads one copy's traffic over every rank's link: the
//! worker of turn `i` of `n` copies the chunks whose id is `i` modulo `n`,
//! and the rest of a store's chunks become holes it skips. The chunk's
//! writer is fixed by its host slot, so the same rank always writes a slot,
//! puts it to a remote tier and fetches it back.

use thiserror::Error;

use crate::ids::ChunkId;
use crate::scheduler::GroupSpan;

use super::layout::TransferSpec;

/// Which stores (and remote fetches) a worker copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreWriters {
    /// Every store: a pool of the worker's own, or every worker of a shared
    /// pool writing the same bytes (vLLM's `canonical_layout` writers).
    Every,
    /// None: another worker fills the shared pool (vLLM's rank > 0 of a
    /// replicated layout); this one acknowledges stores without copying.
    Reader,
    /// Turns by host chunk: this worker copies the chunks whose id is
    /// `index` modulo `count`.
    Turn {
        /// This worker's turn, `0..count`.
        index: u32,
        /// Workers taking turns.
        count: u32,
    },
}

/// A turn out of range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("store turn {index} of {count} is out of range: allowed 0..{count} with count >= 1")]
pub struct TurnError {
    /// The turn asked for.
    pub index: u32,
    /// The workers asked for.
    pub count: u32,
}

impl StoreWriters {
    /// Turn `index` of `count` workers; one worker alone writes every store.
    pub fn turn(index: u32, count: u32) -> Result<Self, TurnError> {
        if count == 0 || index >= count {
            return Err(TurnError { index, count });
        }
        Ok(if count == 1 {
            Self::Every
        } else {
            Self::Turn { index, count }
        })
    }

    /// Whether this worker copies host chunk `chunk` of a store or fetch.
    pub fn writes(&self, chunk: ChunkId) -> bool {
        match *self {
            Self::Every => true,
            Self::Reader => false,
            Self::Turn { index, count } => chunk.0 % count == index,
        }
    }

    /// Whether this worker copies any store at all.
    pub fn writes_any(&self) -> bool {
        !matches!(self, Self::Reader)
    }
}

/// What of a transfer one worker copies ([`keep_chunks`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeptChunks {
    /// Every chunk: the spec as it is.
    All,
    /// No chunk: nothing to copy.
    Nothing,
    /// Some chunks: the spec with the others' GPU blocks as holes (group
    /// spans; a spec of one group gets one span).
    Some(TransferSpec),
}

/// `spec` with the GPU blocks of every chunk `keep` refuses turned into
/// holes, so that a backend copies the kept chunks alone and leaves the
/// rest of the host pool as it is. Chunks and block positions are
/// unchanged (holes keep the blocks after them in place). Blocks are
/// mapped to chunks as [`TransferSpec::whole_chunks`] maps them; a span
/// whose blocks and keys disagree keeps every block (the backend refuses
/// the spec as it would have).
pub fn keep_chunks(
    spec: &TransferSpec,
    blocks_per_chunk: u32,
    keep: impl Fn(ChunkId) -> bool,
) -> KeptChunks {
    let kept = spec.chunks.iter().filter(|&&c| keep(c)).count();
    if kept == spec.chunks.len() {
        return KeptChunks::All;
    }
    if kept == 0 {
        return KeptChunks::Nothing;
    }
    let bpc = blocks_per_chunk.max(1) as usize;
    let mut masked = spec.clone();
    if masked.groups.is_empty() {
        let (Ok(num_keys), Ok(num_blocks)) = (
            u32::try_from(spec.chunks.len()),
            u32::try_from(spec.gpu_blocks.len()),
        ) else {
            return KeptChunks::All;
        };
        masked.groups.push(GroupSpan {
            num_keys,
            num_blocks,
            first_block_index: spec.first_block_index,
        });
    }
    let (mut block_at, mut key_at) = (0usize, 0usize);
    for span in &masked.groups {
        let (nb, nk) = (span.num_blocks as usize, span.num_keys as usize);
        let lead = span.first_block_index as usize % bpc;
        let keys = spec.chunks.get(key_at..key_at + nk).unwrap_or(&[]);
        for k in 0..nb {
            let refused = keys.get((lead + k) / bpc).is_some_and(|&c| !keep(c));
            if refused && let Some(b) = masked.gpu_blocks.get_mut(block_at + k) {
                b.0 = 0;
            }
        }
        block_at += nb;
        key_at += nk;
    }
    KeptChunks::Some(masked)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(spec: &TransferSpec) -> Vec<u32> {
        spec.gpu_blocks.iter().map(|b| b.0).collect()
    }

    #[test]
    fn turns_split_chunks_by_id() {
        let w = [
            StoreWriters::turn(0, 2).unwrap(),
            StoreWriters::turn(1, 2).unwrap(),
        ];
        for c in 0..8 {
            let writers: Vec<bool> = w.iter().map(|t| t.writes(ChunkId(c))).collect();
            assert_eq!(writers.iter().filter(|&&x| x).count(), 1, "chunk {c}");
        }
        assert_eq!(StoreWriters::turn(0, 1), Ok(StoreWriters::Every));
        assert_eq!(
            StoreWriters::turn(2, 2),
            Err(TurnError { index: 2, count: 2 })
        );
        assert!(StoreWriters::turn(0, 0).is_err());
        assert!(!StoreWriters::Reader.writes(ChunkId(0)));
        assert!(!StoreWriters::Reader.writes_any());
    }

    #[test]
    fn one_group_gets_one_span_with_the_other_turn_s_blocks_as_holes() {
        // Blocks 10..16 from logical index 1, two blocks a chunk: chunk 5
        // holds index 1 alone (index 0 before the store), chunk 6 indices
        // 2-3, chunk 7 indices 4-5, chunk 8 index 6.
        let spec = TransferSpec::new(&[10, 11, 12, 13, 14, 15], 1, &[5, 6, 7, 8]);
        let odd = |c: ChunkId| c.0 % 2 == 1;
        let KeptChunks::Some(m) = keep_chunks(&spec, 2, odd) else {
            panic!("some chunks kept")
        };
        assert_eq!(ids(&m), vec![10, 0, 0, 13, 14, 0]);
        assert_eq!(m.chunks, spec.chunks);
        assert_eq!(m.groups.len(), 1);
        assert_eq!(m.groups[0].num_keys, 4);
        assert_eq!(m.groups[0].num_blocks, 6);
        assert_eq!(m.groups[0].first_block_index, 1);
        // The kept chunks are as whole as before; the others are not written.
        assert_eq!(m.whole_chunks(2), vec![false, false, true, false]);
        assert_eq!(spec.whole_chunks(2), vec![false, true, true, false]);
        assert_eq!(keep_chunks(&spec, 2, |_| true), KeptChunks::All);
        assert_eq!(keep_chunks(&spec, 2, |_| false), KeptChunks::Nothing);
    }

    #[test]
    fn each_span_maps_its_own_blocks_and_keeps_its_holes() {
        let mut spec = TransferSpec::new(&[1, 2, 3, 0, 4], 0, &[0, 1, 2, 3]);
        spec.groups = vec![
            GroupSpan {
                num_keys: 2,
                num_blocks: 3,
                first_block_index: 0,
            },
            GroupSpan {
                num_keys: 2,
                num_blocks: 2,
                first_block_index: 3,
            },
        ];
        // Two blocks a chunk: group 0's chunks 0 (blocks 1, 2) and 1
        // (block 3); group 1 from index 3: chunk 2 (the hole), chunk 3
        // (block 4).
        let KeptChunks::Some(m) = keep_chunks(&spec, 2, |c| c.0 % 2 == 0) else {
            panic!("some chunks kept")
        };
        assert_eq!(ids(&m), vec![1, 2, 0, 0, 0]);
        assert_eq!(m.groups, spec.groups);
        let KeptChunks::Some(m) = keep_chunks(&spec, 2, |c| c.0 % 2 == 1) else {
            panic!("some chunks kept")
        };
        assert_eq!(ids(&m), vec![0, 0, 3, 0, 4]);
    }

    proptest::proptest! {
        /// Over any spans, holes and chunk ids, each block the spec moves
        /// is kept by exactly one of `n` turns (the one whose chunk it is)
        /// and is a hole for the others; holes stay holes; chunks, spans
        /// and the kept chunks' wholeness do not change.
        #[test]
        #[cfg_attr(miri, ignore)] // proptest persistence needs the file system
        fn each_moved_block_is_kept_by_exactly_its_chunk_s_turn(
            spans in proptest::collection::vec((0u32..9, 1usize..12), 0..4),
            holes in proptest::collection::vec(proptest::bool::weighted(0.2), 48),
            bpc in 1u32..5,
            n in 1u32..5,
            salt in 0u32..1000,
        ) {
            let one_group = spans.is_empty();
            let spans = if one_group { vec![(salt % 7, 1 + salt as usize % 9)] } else { spans };
            let mut blocks = Vec::new();
            let mut chunks = Vec::new();
            let mut groups = Vec::new();
            for &(first, nb) in &spans {
                let probe = TransferSpec::new(&vec![1; nb], first, &[]);
                let nk = probe.chunks_needed(bpc);
                for _ in 0..nb {
                    let at = blocks.len();
                    let hole = !one_group && holes[at % holes.len()];
                    blocks.push(if hole { 0 } else { 1 + at as u32 });
                }
                for _ in 0..nk {
                    chunks.push((salt + 13 * chunks.len() as u32) % 4096);
                }
                groups.push(GroupSpan {
                    num_keys: nk as u32,
                    num_blocks: nb as u32,
                    first_block_index: first,
                });
            }
            let mut spec = TransferSpec::new(&blocks, spans[0].0, &chunks);
            if !one_group {
                spec.groups = groups.clone();
            }
            let whole = spec.whole_chunks(bpc);
            let mut kept_by = vec![0u32; blocks.len()];
            for index in 0..n {
                let turn = StoreWriters::turn(index, n).unwrap();
                let masked = match keep_chunks(&spec, bpc, |c| turn.writes(c)) {
                    KeptChunks::All => spec.clone(),
                    KeptChunks::Nothing => continue,
                    KeptChunks::Some(m) => m,
                };
                proptest::prop_assert_eq!(&masked.chunks, &spec.chunks);
                // A one-group spec kept whole has no span; any other has the spans.
                if !masked.groups.is_empty() {
                    proptest::prop_assert_eq!(&masked.groups, &groups);
                }
                for (i, (b, orig)) in masked.gpu_blocks.iter().zip(&spec.gpu_blocks).enumerate() {
                    proptest::prop_assert!(b.0 == orig.0 || b.0 == 0);
                    kept_by[i] += u32::from(b.0 != 0);
                }
                let masked_whole = masked.whole_chunks(bpc);
                for (i, c) in spec.chunks.iter().enumerate() {
                    if turn.writes(*c) {
                        proptest::prop_assert_eq!(masked_whole[i], whole[i]);
                    } else {
                        proptest::prop_assert!(!masked_whole[i]);
                    }
                }
            }
            for (i, b) in spec.gpu_blocks.iter().enumerate() {
                proptest::prop_assert_eq!(kept_by[i], u32::from(b.0 != 0), "block {}", i);
            }
        }
    }

    #[test]
    fn the_turns_together_copy_every_block_once() {
        for first in 0..4u32 {
            for n in 1..12u32 {
                let blocks: Vec<u32> = (1..=n).collect();
                let probe = TransferSpec::new(&blocks, first, &[]);
                let chunks: Vec<u32> = (0..probe.chunks_needed(3) as u32).map(|c| c + 7).collect();
                let spec = TransferSpec::new(&blocks, first, &chunks);
                let mut copied = vec![0u32; n as usize];
                for index in 0..3 {
                    let turn = StoreWriters::turn(index, 3).unwrap();
                    let masked = match keep_chunks(&spec, 3, |c| turn.writes(c)) {
                        KeptChunks::All => spec.clone(),
                        KeptChunks::Nothing => continue,
                        KeptChunks::Some(m) => m,
                    };
                    for (i, b) in masked.gpu_blocks.iter().enumerate() {
                        copied[i] += u32::from(b.0 != 0);
                    }
                }
                assert!(copied.iter().all(|&c| c == 1), "{first} {n}: {copied:?}");
            }
        }
    }
}
