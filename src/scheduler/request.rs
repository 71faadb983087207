//! Per-request offload state (vLLM's `RequestOffloadState`).

use crate::ids::{GpuBlockId, JobId};
use crate::key::{BlockHash, ChunkKey};

/// How a finished request ended, as told by `request_finished`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FinishInfo {
    /// Aborted: only the computed tokens are stored.
    pub aborted: bool,
    /// Tokens computed when it was aborted.
    pub computed_tokens: u64,
}

/// Everything the scheduler tracks for one request.
///
/// The field order is the memory order (`repr(C)`), chosen for the step's
/// loop over every scheduled request: the first 64-byte line holds what the
/// check "does a chunk complete?" reads (tokens, store index, block and hash
/// lists), so a request that completes no chunk costs that one line; the
/// second holds the limits and the finish state, read when a chunk may
/// complete; the rest is cold. The 128-byte alignment keeps the two hot lines
/// in one adjacent-line pair.
#[derive(Debug, Clone, Default)]
#[repr(C, align(128))]
pub(crate) struct RequestState {
    /// Prompt plus accepted output tokens.
    pub num_tokens: u64,
    /// First chunk not yet offered for storing.
    pub next_stored_chunk: usize,
    /// The request's block table (group 0).
    pub block_ids: Vec<GpuBlockId>,
    /// Hashes of the full GPU blocks so far (chained).
    pub hashes: Vec<BlockHash>,
    /// Per-request limits (vLLM `kv_transfer_params`).
    pub caps: RequestCaps,
    /// Set by `request_finished`.
    pub finish: Option<FinishInfo>,
    /// Prompt length in tokens.
    pub prompt_tokens: u64,
    /// A step listed it as finished: its last stores are planned.
    pub finished_signaled: bool,
    /// The manager heard `request_finished` for it.
    pub manager_finished: bool,
    /// Jobs in flight: exactly one load, or only stores (inline up to two,
    /// so a decoding request's store needs no heap line of its own).
    pub jobs: smallvec::SmallVec<[JobId; 2]>,
    /// Computed tokens of the latest lookup since the last restart.
    pub lookup_computed: Option<u64>,
    /// Clock time (ns) of the first deferral of a lookup that has not resolved
    /// yet (vLLM `deferred_lookup_start_time`); taken when it resolves.
    pub lookup_deferred_since_ns: Option<u64>,
    /// What it stored or read on the host tier, kept here rather than in the
    /// manager's map (no hash probe per store); handed to the manager when it
    /// finishes, dropped at a reset.
    pub access: crate::manager::RequestAccess,
    /// A scheduler with several KV groups: the block tables and store
    /// cursors of groups 1, 2, ... (group 0's are `block_ids` and
    /// `next_stored_chunk`). Empty with one group.
    pub other_groups: Vec<GroupCursor>,
    /// Where the GPU prefix cache's shared prefix ends (vLLM's
    /// `Request.shared_prefix_boundary`; 0: none): a sliding-window group
    /// stores the window ending there.
    pub shared_prefix_boundary: u64,
    /// With several KV groups: the token spans its last load covers, one
    /// per group that loads (vLLM's `load_key_ranges`, merged per group).
    pub load_cover: Vec<(u64, u64)>,
    /// Every hash of the request, one per vLLM hash unit, where partial
    /// tails are on (`hybrid/partial_tail.rs`); empty otherwise.
    pub hash_units: Vec<BlockHash>,
    /// The partial tail the last lookup's hit ends on (vLLM's
    /// `partial_tail_boundary`), until the allocation that loads it.
    pub partial_tail: Option<u64>,
    /// Whether the request ever loaded from the tier (vLLM's
    /// `loaded_from_offload`, never cleared): with EAGLE draft groups only
    /// such requests store partial tails.
    pub loaded_from_offload: bool,
}

/// One KV group's part of a request (groups past the first).
#[derive(Debug, Clone, Default)]
pub(crate) struct GroupCursor {
    /// The request's blocks in this group.
    pub block_ids: Vec<GpuBlockId>,
    /// First chunk of this group not yet offered for storing.
    pub next_stored_chunk: usize,
}

/// Per-request limits on what is loaded and stored (vLLM's `max_load_tokens`
/// and `max_offload_tokens` transfer parameters, and its `kv_load_tiers`
/// filter as it applies to the remote tier). `None`: no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RequestCaps {
    /// A lookup answers at most this many tokens past the request's computed
    /// tokens, in whole chunks (vLLM 0.33.0: the bound is relative to the
    /// GPU prefix hit, then rounded down to a chunk).
    pub max_load_tokens: Option<u64>,
    /// At most this many leading tokens are stored (0 disables storing).
    pub max_offload_tokens: Option<u64>,
    /// Its lookups never ask the remote tier (a `kv_load_tiers` filter that
    /// leaves the remote tier out); the host tier is always looked up, as
    /// vLLM's filter never applies to its primary tier.
    pub skip_remote_tier: bool,
}

impl RequestState {
    /// A new request with its prompt and the hashes of its full blocks.
    pub fn new(prompt_tokens: u64, hashes: &[BlockHash]) -> Self {
        Self {
            prompt_tokens,
            num_tokens: prompt_tokens,
            hashes: hashes.to_vec(),
            ..Self::default()
        }
    }

    /// Number of full-block hashes known.
    #[inline]
    pub fn num_hashes(&self) -> usize {
        self.hashes.len()
    }

    /// Number of complete chunks that have a key.
    #[inline]
    pub fn num_keys(&self, blocks_per_chunk: usize) -> usize {
        self.hashes.len() / blocks_per_chunk
    }

    /// The key of chunk `i` (hash of its last block, group 0). `i < num_keys`.
    #[inline]
    pub fn key(&self, i: usize, blocks_per_chunk: usize) -> ChunkKey {
        ChunkKey::for_group(self.hashes[(i + 1) * blocks_per_chunk - 1], 0)
    }

    /// The tokens it may store at most: its `max_offload_tokens` limit, and
    /// its prompt when only prompts are stored (`u64::MAX`: no limit).
    #[inline]
    pub fn offload_limit(&self, offload_prompt_only: bool) -> u64 {
        let cap = self.caps.max_offload_tokens.unwrap_or(u64::MAX);
        if offload_prompt_only {
            cap.min(self.prompt_tokens)
        } else {
            cap
        }
    }

    /// Restart: forget the block lists and re-offer every chunk for storing.
    pub fn restart(&mut self) {
        self.partial_tail = None;
        self.block_ids.clear();
        self.next_stored_chunk = 0;
        for g in &mut self.other_groups {
            g.block_ids.clear();
            g.next_stored_chunk = 0;
        }
    }

    /// The block table of group `group` (0: `block_ids`).
    pub fn group_blocks(&self, group: usize) -> &[GpuBlockId] {
        match group {
            0 => &self.block_ids,
            g => self
                .other_groups
                .get(g - 1)
                .map_or(&[], |c| c.block_ids.as_slice()),
        }
    }

    /// The block table and store cursor of group `group`, mutable.
    pub fn group_mut(&mut self, group: usize) -> Option<(&mut Vec<GpuBlockId>, &mut usize)> {
        match group {
            0 => Some((&mut self.block_ids, &mut self.next_stored_chunk)),
            g => self
                .other_groups
                .get_mut(g - 1)
                .map(|c| (&mut c.block_ids, &mut c.next_stored_chunk)),
        }
    }

    /// The first chunk of group `group` not yet offered for storing.
    pub fn group_next_stored(&self, group: usize) -> usize {
        match group {
            0 => self.next_stored_chunk,
            g => self
                .other_groups
                .get(g - 1)
                .map_or(0, |c| c.next_stored_chunk),
        }
    }

    /// The key of chunk `i` in group `group`. `i < num_keys`.
    #[inline]
    pub fn group_key(&self, group: usize, i: usize, blocks_per_chunk: usize) -> ChunkKey {
        ChunkKey::for_group(self.hashes[(i + 1) * blocks_per_chunk - 1], group as u32)
    }
}
