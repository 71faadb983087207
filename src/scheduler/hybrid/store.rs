//! Which of a request's chunks a store offers the host tier, group by group:
//! the candidate selection of vLLM 0.33.0's `_build_store_jobs`, with its
//! sliding-window `reachable_block_mask` (an EAGLE draft window's too).
//! A recurrent-state (Mamba) group offers nothing here: vLLM stores its
//! chunks only from the boundary states its core hands over
//! (`Scheduler::plan_boundary_stores`).
//!
//! A full-attention group offers every chunk from its next unstored one to
//! its last storable one. A sliding-window group offers only chunks a later
//! lookup can use: those holding the window that ends on a boundary where
//! a hit may end (per vLLM's retention interval), and never a chunk with a
//! block that vLLM already freed behind the window. A chunked-local
//! attention group offers, as vLLM's (its manager keeps the default mask),
//! every chunk whose blocks it still holds.

use super::shape::GroupShape;

/// Which window tails of a sliding-window group are kept and stored (vLLM's
/// `prefix_cache_retention_interval`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// A tail at every aligned boundary (vLLM's `None`), and a finished
    /// request's final tail.
    Dense,
    /// Only the tails ending at the replay boundary (the prompt's last
    /// token) and at the shared-prefix junction (vLLM's `0`, its default).
    BoundariesOnly,
    /// A tail once per this many tokens, and the boundaries' tails.
    Every(u64),
}

impl Retention {
    /// From vLLM's `prefix_cache_retention_interval`.
    pub fn from_vllm(interval: Option<u64>) -> Self {
        match interval {
            None => Self::Dense,
            Some(0) => Self::BoundariesOnly,
            Some(n) => Self::Every(n),
        }
    }
}

/// The configuration a store's selection depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StorePolicy {
    /// GPU blocks a host chunk.
    pub blocks_per_chunk: usize,
    /// Where hits may end ([`alignment_tokens`]).
    pub alignment_tokens: Option<u64>,
    /// Which window tails are stored.
    pub retention: Retention,
}

/// vLLM's hit alignment: the full-attention groups' chunk size when they
/// agree; with no full-attention group, the largest chunk; `None` when full
/// attention groups disagree.
pub fn alignment_tokens(groups: &[GroupShape]) -> Option<u64> {
    let mut full = groups
        .iter()
        .filter(|g| g.is_full_attention())
        .map(GroupShape::tokens_per_chunk);
    match full.next() {
        Some(first) => full.all(|t| t == first).then_some(first),
        None => groups.iter().map(GroupShape::tokens_per_chunk).max(),
    }
}

/// A request as a store sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreRequest {
    /// The request has finished (its last stores).
    pub finished: bool,
    /// Its prompt's tokens.
    pub num_prompt_tokens: u64,
    /// Where the GPU prefix cache found its shared prefix to end (0: none).
    pub shared_prefix_boundary: u64,
}

/// One group of a request as a store sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreView<'a> {
    /// The first chunk not offered yet.
    pub next_stored_chunk: usize,
    /// Chunks computed, allocated and keyed (vLLM's `storable_chunks`).
    pub storable_chunks: usize,
    /// Chunks of the prompt (of its offloadable tokens).
    pub prompt_chunks: usize,
    /// Per block of the request, whether it is held (`false`: the null
    /// block, freed behind the window or re-allocated since); blocks past
    /// the slice count as not held.
    pub held: &'a [bool],
}

/// The chunks of one group a store offers the tier, in order.
pub fn store_candidates(
    shape: &GroupShape,
    policy: &StorePolicy,
    req: &StoreRequest,
    view: &StoreView<'_>,
) -> Vec<usize> {
    if shape.is_recurrent_state() {
        return Vec::new();
    }
    let bpc = policy.blocks_per_chunk.max(1);
    let tpb = (shape.tokens_per_chunk() / bpc as u64).max(1);
    let num_chunks = view.storable_chunks;
    let next = view.next_stored_chunk;
    let dense = policy.retention == Retention::Dense;
    let eagle = shape.is_eagle_draft();
    let final_alignment_blocks = match (shape.window_tokens(), policy.alignment_tokens) {
        (Some(_), Some(a)) if !eagle && a.is_multiple_of(tpb) => Some(a / tpb),
        _ => None,
    };
    let reconsider = req.finished
        && num_chunks != view.prompt_chunks
        && dense
        && final_alignment_blocks.is_some_and(|b| b > 0);
    let store_horizon = if !dense || eagle {
        None
    } else if req.finished {
        Some(num_chunks)
    } else if num_chunks <= view.prompt_chunks {
        Some(view.prompt_chunks)
    } else {
        None
    };
    let mut start = next;
    if let (true, Some(align)) = (reconsider, final_alignment_blocks) {
        let horizon = (num_chunks * bpc) as u64;
        start = start.min(((horizon - horizon % align) / bpc as u64) as usize);
    }
    if num_chunks <= start {
        return Vec::new();
    }
    let mut boundaries = Vec::new();
    if !dense {
        boundaries.push(req.num_prompt_tokens.saturating_sub(1));
        if req.shared_prefix_boundary > 0 {
            boundaries.push(req.shared_prefix_boundary);
        }
    }
    let blocks = (start * bpc, num_chunks * bpc);
    let mask = reachable_mask(
        shape,
        tpb,
        blocks,
        policy,
        &boundaries,
        store_horizon.map(|c| c * bpc),
    );
    let prompt_mask = reconsider
        .then(|| {
            reachable_mask(
                shape,
                tpb,
                blocks,
                policy,
                &boundaries,
                Some(view.prompt_chunks * bpc),
            )
        })
        .flatten();
    let held = |block: usize| view.held.get(block).copied().unwrap_or(false);
    let any_in = |m: &[bool], k: usize| (0..bpc).any(|b| m[k * bpc + b]);
    let mut out = Vec::new();
    for chunk in start..num_chunks {
        let k = chunk - start;
        if !held(chunk * bpc + bpc - 1) {
            continue;
        }
        if reconsider && chunk < next && prompt_mask.as_deref().is_none_or(|m| any_in(m, k)) {
            // Stored before, and still reachable at the prompt's horizon.
            continue;
        }
        if let Some(m) = &mask
            && !any_in(m, k)
        {
            continue;
        }
        // A reachable null block would leave part of the chunk unwritten.
        let hole = (0..bpc)
            .any(|b| !held(chunk * bpc + b) && mask.as_ref().is_none_or(|m| m[k * bpc + b]));
        if !hole {
            out.push(chunk);
        }
    }
    out
}

/// vLLM's `SlidingWindowManager.reachable_block_mask` for blocks
/// `start..end` of a group (no DCP): `None` keeps every block (full
/// attention, no alignment, or a window covering whole segments). An EAGLE
/// draft group needs one block more, ending one block later.
fn reachable_mask(
    shape: &GroupShape,
    tpb: u64,
    (start, end): (usize, usize),
    policy: &StorePolicy,
    boundaries: &[u64],
    final_segment_end: Option<usize>,
) -> Option<Vec<bool>> {
    // vLLM widens the window by the tokens it retains behind it.
    let window = shape.window_tokens()? + shape.extra_retained_tokens();
    let alignment = policy.alignment_tokens?;
    if !alignment.is_multiple_of(tpb) {
        return None;
    }
    // Blocks a hit needs before its end (a draft group's one more, past it).
    let shift = usize::from(shape.is_eagle_draft());
    let need = ((window - 1).div_ceil(tpb)) as usize + shift;
    let mut mask = vec![false; end.saturating_sub(start)];
    let segment = match policy.retention {
        Retention::Dense => Some(alignment),
        Retention::BoundariesOnly => None,
        Retention::Every(n) => Some(n),
    };
    if let Some(segment) = segment {
        let per_segment = (segment / tpb) as usize;
        if need >= per_segment {
            return None;
        }
        for i in start..end {
            if i >= shift && (i - shift) % per_segment >= per_segment - need {
                mask[i - start] = true;
            }
        }
        if let (Some(final_end), 0) = (final_segment_end, shift) {
            let size = final_end % per_segment;
            if size != 0 {
                let tail_start = (final_end - size).max(final_end.saturating_sub(need));
                for i in start.max(tail_start)..end.min(final_end) {
                    mask[i - start] = true;
                }
            }
        }
    }
    if policy.retention != Retention::Dense {
        for &boundary in boundaries {
            let aligned_end = (boundary / alignment * alignment / tpb) as usize + shift;
            for j in start.max(aligned_end.saturating_sub(need))..end.min(aligned_end) {
                mask[j - start] = true;
            }
        }
    }
    Some(mask)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(bpc: usize, alignment: u64, retention: Retention) -> StorePolicy {
        StorePolicy {
            blocks_per_chunk: bpc,
            alignment_tokens: Some(alignment),
            retention,
        }
    }

    fn running(prompt: u64) -> StoreRequest {
        StoreRequest {
            finished: false,
            num_prompt_tokens: prompt,
            shared_prefix_boundary: 0,
        }
    }

    fn view(next: usize, storable: usize, prompt: usize, held: &[bool]) -> StoreView<'_> {
        StoreView {
            next_stored_chunk: next,
            storable_chunks: storable,
            prompt_chunks: prompt,
            held,
        }
    }

    #[test]
    fn alignment_follows_the_full_attention_groups() {
        let f4 = GroupShape::full_attention(4).unwrap();
        let f8 = GroupShape::full_attention(8).unwrap();
        let w16 = GroupShape::sliding_window(16, 8).unwrap();
        assert_eq!(alignment_tokens(&[f4, w16]), Some(4));
        assert_eq!(alignment_tokens(&[f4, f8]), None);
        assert_eq!(
            alignment_tokens(&[w16, GroupShape::sliding_window(4, 8).unwrap()]),
            Some(16)
        );
        assert_eq!(Retention::from_vllm(None), Retention::Dense);
        assert_eq!(Retention::from_vllm(Some(0)), Retention::BoundariesOnly);
        assert_eq!(Retention::from_vllm(Some(16)), Retention::Every(16));
    }

    #[test]
    fn full_attention_offers_every_held_chunk_from_the_next_one() {
        let full = GroupShape::full_attention(4).unwrap();
        let p = policy(1, 4, Retention::BoundariesOnly);
        let held = [true; 8];
        assert_eq!(
            store_candidates(&full, &p, &running(33), &view(2, 6, 8, &held)),
            vec![2, 3, 4, 5]
        );
        assert!(store_candidates(&full, &p, &running(33), &view(6, 6, 8, &held)).is_empty());
    }

    #[test]
    fn by_default_a_window_stores_the_tail_before_the_replay_boundary() {
        // Window 8 over 4-token blocks (2 blocks); prompt of 34 tokens: the
        // replay boundary 33 aligns to 32, the tail is blocks 6 and 7.
        let w8 = GroupShape::sliding_window(4, 8).unwrap();
        let p = policy(1, 4, Retention::BoundariesOnly);
        let held = [true; 9];
        assert_eq!(
            store_candidates(&w8, &p, &running(34), &view(0, 8, 8, &held)),
            vec![6, 7]
        );
        // A shared prefix ending at 16 keeps its tail too.
        let req = StoreRequest {
            shared_prefix_boundary: 16,
            ..running(34)
        };
        assert_eq!(
            store_candidates(&w8, &p, &req, &view(0, 8, 8, &held)),
            vec![2, 3, 6, 7]
        );
        // A freed block is never stored.
        let mut freed = held;
        freed[6] = false;
        assert_eq!(
            store_candidates(&w8, &p, &running(34), &view(0, 8, 8, &freed)),
            vec![7]
        );
    }

    #[test]
    fn dense_retention_keeps_each_segments_tail() {
        // Chunks of 4 blocks, window of 2 blocks: the last 2 blocks of each
        // chunk are reachable, so every chunk whose blocks there are held.
        let w8 = GroupShape::sliding_window(16, 8).unwrap();
        let p = policy(4, 16, Retention::Dense);
        let mut held = [true; 12];
        held[0] = false;
        held[1] = false;
        assert_eq!(
            store_candidates(&w8, &p, &running(48), &view(0, 3, 3, &held)),
            vec![0, 1, 2]
        );
        // A hole in a chunk's reachable blocks drops it.
        held[6] = false;
        assert_eq!(
            store_candidates(&w8, &p, &running(48), &view(0, 3, 3, &held)),
            vec![0, 2]
        );
    }

    #[test]
    fn a_finished_requests_final_tail_is_stored_once_under_dense_retention() {
        // A window of 2 blocks in a group of 4-token blocks, hits aligned to
        // 16 tokens (a full-attention group's chunk): segments of 4 blocks.
        // The request finished with 6 blocks stored before (its prompt: 5).
        // The final segment (blocks 4 and 5) is reconsidered: block 4 was
        // the prompt's tail and stays, block 5 is the final tail: offered.
        // (vLLM's recorded runs never reach this: their groups' blocks
        // divide the alignment into whole chunks.)
        let w8 = GroupShape::sliding_window(4, 8).unwrap();
        let p = policy(1, 16, Retention::Dense);
        let req = StoreRequest {
            finished: true,
            ..running(21)
        };
        let held = [true; 6];
        assert_eq!(
            store_candidates(&w8, &p, &req, &view(6, 6, 5, &held)),
            vec![5]
        );
        // Running, nothing is reconsidered.
        assert!(store_candidates(&w8, &p, &running(21), &view(6, 6, 5, &held)).is_empty());
    }

    proptest::proptest! {
        /// Any view: no panic, and only chunks in the range offered, in
        /// order, each with every block held where the window reaches it
        /// (its last block always).
        #[test]
        fn offers_are_held_chunks_in_range(
            window in proptest::option::of(1u64..40),
            tpb in 1u64..9,
            bpc in 1usize..5,
            alignment_chunks in proptest::option::of(1u64..4),
            retention in proptest::option::of(0u64..4),
            finished in proptest::bool::ANY,
            prompt in 0u64..200,
            shared in 0u64..200,
            next in 0usize..12,
            storable in 0usize..12,
            prompt_chunks in 0usize..12,
            held in proptest::collection::vec(proptest::bool::weighted(0.8), 0..48),
        ) {
            let tpc = tpb * bpc as u64;
            let shape = GroupShape::new(tpc, window).unwrap();
            let policy = StorePolicy {
                blocks_per_chunk: bpc,
                alignment_tokens: alignment_chunks.map(|c| c * tpc),
                retention: Retention::from_vllm(retention.map(|r| r * tpc)),
            };
            let req = StoreRequest { finished, num_prompt_tokens: prompt, shared_prefix_boundary: shared };
            let v = view(next, storable, prompt_chunks, &held);
            let got = store_candidates(&shape, &policy, &req, &v);
            proptest::prop_assert!(got.windows(2).all(|w| w[0] < w[1]));
            for &c in &got {
                proptest::prop_assert!(c < storable);
                proptest::prop_assert!(held[c * bpc + bpc - 1]);
                if window.is_none() {
                    proptest::prop_assert!(c >= next);
                    proptest::prop_assert!((0..bpc).all(|b| held[c * bpc + b]));
                }
            }
        }
    }
}
