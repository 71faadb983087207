//! Chunks the host tier holds in part, and the hits that must not load them.
//!
//! vLLM's connector stores a sliding-window group's chunk with a hole where
//! the storing request's block is the null block (the window has passed it)
//! and vLLM's `reachable_block_mask` says no hit needs it. That mask assumes
//! hits end where vLLM's own prefix-cache hits can end; a hit cut by a
//! request's `max_load_tokens` (or by another group) can end elsewhere, and
//! then vLLM 0.33.0 loads the hole: a block the model reads holds whatever
//! the host slot held before (found by `scripts/widen-hybrid-remote.py
//! --heads`, seed 50088, and shown with vLLM's own connector on that
//! schedule; `docs/vllm-connector.md`, item 8 under "What the differential
//! test found"). kvoffload records the sub-blocks each such
//! store wrote and cuts a hit before the first chunk whose unwritten
//! sub-block a block of the request would receive: a smaller hit than
//! vLLM's where vLLM's would load bytes nobody wrote, the same everywhere
//! else.

use crate::key::ChunkKey;
use crate::scheduler::Scheduler;
use crate::scheduler::request::RequestState;

use super::SchedulerGroups;
use super::lookup::load_chunks;
use super::shape::{Attention, GroupShape};

/// The first token of a group with `shape` that a request reading its KV up
/// to `end` tokens still holds (vLLM frees the blocks before it: the null
/// block); `None` for a recurrent state (stored whole, never with holes).
pub(crate) fn first_needed_token(shape: &GroupShape, end: u64) -> Option<u64> {
    match shape.attention() {
        Attention::Full => Some(0),
        Attention::SlidingWindow { window_tokens } => {
            Some(end.saturating_sub(window_tokens - 1 + shape.extra_retained_tokens()))
        }
        Attention::ChunkedLocal { chunk_tokens } => Some(end / chunk_tokens * chunk_tokens),
        Attention::State => None,
    }
}

/// Whether a load of a hit from `computed` to `end` tokens copies chunk
/// `chunk` of a group with `shape` (`bpc` blocks a chunk) into a block the
/// request holds where `written` says its store left the sub-block
/// unwritten.
pub(crate) fn reads_a_hole(
    shape: &GroupShape,
    bpc: usize,
    computed: u64,
    end: u64,
    chunk: usize,
    written: &[bool],
) -> bool {
    let Some(first) = first_needed_token(shape, end) else {
        return false;
    };
    let tpb = shape.tokens_per_chunk() / bpc as u64;
    written.iter().enumerate().any(|(b, &w)| {
        let start = (chunk * bpc + b) as u64 * tpb;
        !w && start >= computed && start < end && start + tpb > first
    })
}

impl Scheduler {
    /// Records what the store of `key` writes of its chunk: `written[b]`
    /// for sub-block `b` (a store of the whole chunk forgets any earlier
    /// record).
    pub(crate) fn note_chunk_written(&mut self, key: ChunkKey, written: &[bool]) {
        if written.iter().all(|&w| w) {
            if !self.partial_chunks.is_empty() {
                self.partial_chunks.remove(&key);
            }
            return;
        }
        // Records of chunks the tier no longer holds go once they outnumber
        // the tier's chunks.
        if self.partial_chunks.len() >= self.manager.capacity().max(64) as usize {
            let manager = &self.manager;
            self.partial_chunks
                .retain(|k, _| manager.lookup(*k) != crate::manager::LookupResult::Miss);
        }
        self.partial_chunks.insert(key, written.into());
    }

    /// Hits cut before a chunk stored in part (where vLLM's would have
    /// loaded an unwritten sub-block), since the scheduler was built.
    pub fn hits_cut_at_partial_chunks(&self) -> u64 {
        self.hits_cut_at_partial_chunks
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Chunks the host tier may hold in part that the scheduler keeps a
    /// record of (at most about the tier's chunks).
    pub fn partial_chunk_records(&self) -> usize {
        self.partial_chunks.len()
    }

    /// Forgets the records of `keys` (fetched whole from the remote tier).
    pub(crate) fn forget_partial_chunks(&mut self, keys: &[ChunkKey]) {
        if !self.partial_chunks.is_empty() {
            for k in keys {
                self.partial_chunks.remove(k);
            }
        }
    }

    /// Where a hit of `request` from `computed` to `end` tokens must stop
    /// so that no load copies an unwritten sub-block into a block the
    /// request reads: the start (in tokens) of the first such chunk, over
    /// every group; `None` when the hit reads none.
    pub(crate) fn hole_limit(
        &self,
        groups: &SchedulerGroups,
        request: &RequestState,
        computed: u64,
        end: u64,
    ) -> Option<u64> {
        if self.partial_chunks.is_empty() {
            return None;
        }
        let bpc = self.geo.blocks_per_chunk;
        let mut limit: Option<u64> = None;
        for (g, shape) in groups.shapes.iter().enumerate() {
            // Only windowed groups hold null blocks: the others' chunks
            // are always written whole.
            if !groups.windowed[g] {
                continue;
            }
            let hpc = groups.hashes_per_chunk(g);
            for chunk in load_chunks(shape, computed, end, request.num_keys(hpc)) {
                let key = request.group_key(g, chunk, hpc);
                let Some(written) = self.partial_chunks.get(&key) else {
                    continue;
                };
                if reads_a_hole(shape, bpc, computed, end, chunk, written) {
                    let at = chunk as u64 * shape.tokens_per_chunk();
                    limit = Some(limit.map_or(at, |l| l.min(at)));
                    break;
                }
            }
        }
        limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::hybrid::shape::fixtures::full;

    #[test]
    fn a_window_needs_the_blocks_its_last_tokens_read() {
        // A 13-token window read up to token 8 needs tokens 0 on; up to 20,
        // tokens 8 on; a full group everything; a local chunk its own.
        let w = GroupShape::sliding_window(8, 13).unwrap();
        assert_eq!(first_needed_token(&w, 8), Some(0));
        assert_eq!(first_needed_token(&w, 20), Some(8));
        assert_eq!(first_needed_token(&full(), 20), Some(0));
        let local = GroupShape::chunked_local(8, 12).unwrap();
        assert_eq!(first_needed_token(&local, 20), Some(12));
        assert_eq!(
            first_needed_token(&GroupShape::recurrent_state(8).unwrap(), 8),
            None
        );
    }

    #[test]
    fn a_hole_matters_only_where_the_request_holds_the_block() {
        // Chunks of two 4-token blocks; chunk 0 stored without its first
        // block (the storing request's window had passed it).
        let w = GroupShape::sliding_window(8, 13).unwrap();
        let hole = [false, true];
        // A hit to token 8 reads tokens 0.. : the hole is loaded.
        assert!(reads_a_hole(&w, 2, 0, 8, 0, &hole));
        // Read up to token 24 the window starts at 12: block 0 is not held.
        assert!(!reads_a_hole(&w, 2, 0, 24, 0, &hole));
        // The GPU's own hit covers block 0: the load starts after it.
        assert!(!reads_a_hole(&w, 2, 4, 8, 0, &hole));
        // A whole chunk has no hole; a window of 4 tokens read to 8 needs
        // only block 1.
        assert!(!reads_a_hole(&w, 2, 0, 8, 0, &[true, true]));
        let small = GroupShape::sliding_window(8, 4).unwrap();
        assert!(!reads_a_hole(&small, 2, 0, 8, 0, &hole));
    }
}
