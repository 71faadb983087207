//! Stores of recurrent states (Mamba groups in vLLM's
//! `mamba_cache_mode="align"`): vLLM 0.33.0's
//! `_build_aligned_boundary_store_jobs`.
//!
//! A recurrent group's block table cannot say which block holds the state
//! at a boundary (vLLM copies states between blocks as a request runs), so
//! its chunks are never stored from the table. vLLM's core hands over, in
//! each step, the blocks holding a request's state at a cached boundary
//! ([`BoundaryState`], its `boundary_state_offloads`); each boundary on one
//! of the group's chunks, within what the request may store, becomes a
//! store job of that one block, fenced from its creation. They are planned
//! before the step's other stores, as vLLM plans them.

use crate::ids::{GpuBlockId, JobId, RequestId};
use crate::key::ChunkKey;
use crate::scheduler::Scheduler;
use crate::scheduler::types::{
    GroupSpan, JobBlocks, JobKeys, JobSlots, StepInput, TransferJob, copy_small,
};

/// A block holding a request's recurrent state after its first `boundary`
/// tokens, handed over by vLLM's core in one step (an entry of its
/// `boundary_state_offloads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoundaryState {
    /// The request.
    pub req: RequestId,
    /// The KV group (of the scheduler's groups).
    pub group: usize,
    /// The block holding the state.
    pub block: GpuBlockId,
    /// The tokens the state has consumed.
    pub boundary: u64,
}

impl Scheduler {
    /// Plans one store job per usable hand-off of `states`, in order, into
    /// `out`. A hand-off is skipped when its request is unknown, its group
    /// is not a recurrent-state group, its block is the null block, its
    /// boundary is not on one of the group's chunks or lies past what the
    /// request may store (its tokens, `max_offload_tokens`, the prompt with
    /// `offload_prompt_only`), its chunk is already stored, or the host
    /// tier cannot allocate (counted as an allocation failure).
    pub(crate) fn plan_boundary_stores(&mut self, input: &StepInput, out: &mut Vec<TransferJob>) {
        self.batch.handoff_flushes.clear();
        let states = &input.boundary_states;
        let g = self.geo;
        let bpc = g.blocks_per_chunk.max(1) as u64;
        for s in states {
            let Some(groups) = self.groups.as_deref() else {
                return;
            };
            let Some(shape) = groups.shapes.get(s.group) else {
                continue;
            };
            let tpc = shape.tokens_per_chunk();
            let per_chunk = groups.hashes_per_chunk(s.group);
            let num_groups = groups.len();
            if !shape.is_recurrent_state()
                || s.block.0 == 0
                || s.boundary == 0
                || !s.boundary.is_multiple_of(tpc)
            {
                continue;
            }
            let chunk = (s.boundary / tpc - 1) as usize;
            let position = groups.position(s.group, chunk);
            let Some(rs) = self.requests.get_mut(&s.req) else {
                continue;
            };
            let limit = rs.offload_limit(g.offload_prompt_only).min(rs.num_tokens);
            if s.boundary > limit || chunk >= rs.num_keys(per_chunk) {
                continue;
            }
            let key = rs.group_key(s.group, chunk, per_chunk);
            let Some((stored, chunk_ids)) = self.prepare_fenced_store(s.req, &[key], &[position])
            else {
                continue;
            };
            let tpb = (tpc / bpc).max(1);
            let empty = GroupSpan {
                num_keys: 0,
                num_blocks: 0,
                first_block_index: 0,
            };
            let mut spans = vec![empty; num_groups];
            spans[s.group] = GroupSpan {
                num_keys: 1,
                num_blocks: 1,
                first_block_index: (s.boundary / tpb - 1) as u32,
            };
            let blocks: JobBlocks = JobBlocks::from_slice(&[s.block]);
            let job = self.enter_fenced_store(s.req, blocks, (stored, chunk_ids), spans, out);
            // A block vLLM allocated in this very step to another request
            // (a Mamba state block the request left behind under
            // speculative decoding: vLLM frees it in the pass that hands it
            // over, and a later request of the pass may get it) is written
            // by its new owner in this step's forward. Flushed, the workers
            // copy it before that forward. (vLLM 0.33.0 checks reallocated
            // blocks before it plans hand-off stores, and stores the new
            // owner's bytes.) The same holds for a block the request itself
            // got back in this step when its state was committed before
            // the step (vLLM retires the request's interior states, then
            // takes the freed block for its next speculative column, which
            // this step's forward writes: seed 72006). A block the request
            // got in this step for a state this step computes is stored
            // after the forward.
            let committed_before = input
                .scheduled
                .iter()
                .find(|e| e.req == s.req)
                .is_none_or(|e| s.boundary <= e.computed_tokens);
            if self.batch.allocated.contains(s.block)
                && (committed_before || !allocated_to(input, s.req, s.block))
            {
                self.batch.flush.push(job);
                self.batch.handoff_flushes.push(job);
                self.counters.handoffs_flushed += 1;
            }
        }
    }

    /// Offers `keys` of request `req` (at `positions`) to the host tier for
    /// a hand-off's store: the keys to store and their slots, or `None`
    /// when the tier holds them all or cannot allocate (counted as an
    /// allocation failure), or the request is unknown.
    pub(super) fn prepare_fenced_store(
        &mut self,
        req: RequestId,
        keys: &[ChunkKey],
        positions: &[u64],
    ) -> Option<(JobKeys, JobSlots)> {
        let rs = self.requests.get_mut(&req)?;
        let prepared = self
            .manager
            .prepare_store_for_job(keys, positions, &mut rs.access)
            .map(|(k, c)| -> (JobKeys, JobSlots) { (copy_small(k), copy_small(c)) });
        let Some((stored, chunk_ids)) = prepared else {
            self.counters.allocation_failures += 1;
            return None;
        };
        (!stored.is_empty()).then_some((stored, chunk_ids))
    }

    /// Creates request `req`'s store job of `blocks` (the keys and slots of
    /// [`Self::prepare_fenced_store`], cut by `spans`) into `out`, its
    /// blocks fenced from its creation, as vLLM fences a hand-off's; returns
    /// the job.
    pub(super) fn enter_fenced_store(
        &mut self,
        req: RequestId,
        blocks: JobBlocks,
        (keys, chunk_ids): (JobKeys, JobSlots),
        spans: Vec<GroupSpan>,
        out: &mut Vec<TransferJob>,
    ) -> JobId {
        let job = self.new_job_id();
        if let Some(rs) = self.requests.get_mut(&req) {
            rs.jobs.push(job);
        }
        self.fences.add(job, &blocks);
        let now = self.step_now_ns();
        let transfer = TransferJob {
            job,
            req,
            block_ids: blocks,
            chunk_ids,
            keys,
            groups: spans,
        };
        self.enter_store(transfer, now, true, out);
        job
    }
}

/// Whether `block` is among the blocks `req` got in this step (any group).
fn allocated_to(input: &StepInput, req: RequestId, block: GpuBlockId) -> bool {
    input.scheduled.iter().enumerate().any(|(i, s)| {
        s.req == req
            && (s.new_block_ids.contains(&block)
                || input
                    .group_block_ids
                    .get(i)
                    .is_some_and(|groups| groups.iter().any(|g| g.contains(&block))))
    })
}
