//! Store planning (vLLM `_build_store_jobs`, one full-attention group;
//! several groups: `hybrid/on_step.rs`).

use crate::ids::{GpuBlockId, RequestId};

use super::Scheduler;
use super::allocated::AllocatedBlocks;
use super::jobs::JobEntry;
use super::request::RequestState;
use super::types::{JobBlocks, JobKeys, JobSlots, TransferJob, copy_small};

/// How far a request's stores may reach in this step.
#[derive(Debug, Clone, Copy)]
pub(crate) enum StoreReach {
    /// Running: computed + scheduled tokens.
    Running { computed: u64, scheduled: u64 },
    /// Listed as finished in this step.
    Finished,
}

impl StoreReach {
    /// The tokens `rs` has computed once this step ran: computed plus
    /// scheduled while it runs; once finished, its computed tokens if
    /// aborted, else its tokens but the last one, never below its prompt.
    #[inline(always)]
    pub(crate) fn tokens_after(self, rs: &RequestState) -> u64 {
        match self {
            StoreReach::Running {
                computed,
                scheduled,
            } => computed.saturating_add(scheduled),
            StoreReach::Finished => match rs.finish {
                Some(f) if f.aborted => f.computed_tokens,
                _ => rs.prompt_tokens.max(rs.num_tokens.saturating_sub(1)),
            },
        }
    }
}

impl Scheduler {
    /// Plans at most one store job for `req`; pushes it to `out`. With
    /// `update`, first applies the step's block update (new block ids, whether
    /// they are the full table) in the same map lookup.
    pub(crate) fn plan_store(
        &mut self,
        req: RequestId,
        reach: StoreReach,
        update: Option<(&[GpuBlockId], bool)>,
        out: &mut Vec<TransferJob>,
    ) {
        let Some(slot) = self.requests.slot_of(&req) else {
            return;
        };
        if self.groups.is_some() {
            self.plan_store_groups(slot, req, reach, out);
        } else {
            self.plan_store_at(slot, req, reach, update, out);
        }
    }

    /// [`Self::plan_store`] for the request in table slot `slot` (which holds
    /// `req`): the block update and the cheap test whether a chunk completes,
    /// inlined into the step's loop; the planning itself is out of line.
    #[inline(always)]
    pub(crate) fn plan_store_at(
        &mut self,
        slot: u32,
        req: RequestId,
        reach: StoreReach,
        update: Option<(&[GpuBlockId], bool)>,
        out: &mut Vec<TransferJob>,
    ) {
        let g = self.geo;
        let Some(rs) = self.requests.at_mut(slot) else {
            return;
        };
        if let Some((new_blocks, full_table)) = update {
            if full_table {
                rs.block_ids.clear();
            }
            if !new_blocks.is_empty() {
                append_blocks(&mut rs.block_ids, &mut self.batch.allocated, new_blocks);
            }
        }
        let mut offloadable = reach.tokens_after(rs).min(rs.num_tokens);
        let bpc = g.blocks_per_chunk;
        let start = rs.next_stored_chunk;
        // Fast exit without divisions (most requests complete no chunk in a
        // step): chunk `start` is complete only if the tokens, the blocks and
        // the hashes all reach its end. These are all in the state's first
        // cache line; the limits below (second line) can only lower
        // `offloadable`, so they are read only when the chunk may complete.
        let end_blocks = (start + 1) * bpc;
        let chunk_end = (start as u64 + 1) * g.tokens_per_chunk;
        if offloadable < chunk_end
            || rs.block_ids.len() < end_blocks
            || rs.num_hashes() < end_blocks
        {
            return;
        }
        offloadable = offloadable.min(rs.offload_limit(g.offload_prompt_only));
        if offloadable < chunk_end {
            return;
        }
        self.plan_chunks(slot, req, offloadable, out);
    }

    /// Plans the store of the request in `slot` whose chunks up to
    /// `offloadable` tokens are complete (at least one is).
    #[inline(never)]
    fn plan_chunks(
        &mut self,
        slot: u32,
        req: RequestId,
        offloadable: u64,
        out: &mut Vec<TransferJob>,
    ) {
        let g = self.geo;
        let Some(rs) = self.requests.at_mut(slot) else {
            return;
        };
        let bpc = g.blocks_per_chunk;
        let start = rs.next_stored_chunk;
        let num_chunks = ((offloadable / g.tokens_per_chunk) as usize)
            .min(rs.block_ids.len() / bpc)
            .min(rs.num_keys(bpc));
        debug_assert!(start < num_chunks);
        // Candidates: chunks whose last block is not the null block (scratch
        // buffers are reused across calls).
        let mut cand_idx = std::mem::take(&mut self.scratch_idx);
        let mut cand = std::mem::take(&mut self.scratch_keys);
        cand_idx.clear();
        cand.clear();
        for i in start..num_chunks {
            if rs.block_ids[(i + 1) * bpc - 1].0 != 0 {
                cand_idx.push(i);
                cand.push(rs.key(i, bpc));
            }
        }
        if cand.is_empty() {
            rs.next_stored_chunk = num_chunks;
            self.scratch_idx = cand_idx;
            self.scratch_keys = cand;
            return;
        }
        // Positions: chunk i ends at (i + 1) chunks (vLLM's token positions
        // in chunk units: the same order).
        let mut pos = std::mem::take(&mut self.scratch_pos);
        pos.clear();
        pos.extend(cand_idx.iter().map(|&i| i as u64 + 1));
        let ps = self
            .manager
            .prepare_store_for_job(&cand, &pos, &mut rs.access)
            .map(|(k, c)| -> (JobKeys, JobSlots) { (copy_small(k), copy_small(c)) });
        self.scratch_pos = pos;
        let (Some((keys, chunk_ids)), Some(rs)) = (ps, self.requests.at_mut(slot)) else {
            self.counters.allocation_failures += 1;
            tracing::warn!(%req, chunks = cand.len(), "host tier cannot allocate; store retried next step");
            self.scratch_idx = cand_idx;
            self.scratch_keys = cand;
            return;
        };
        rs.next_stored_chunk = rs.next_stored_chunk.max(num_chunks);
        if keys.is_empty() {
            self.scratch_idx = cand_idx;
            self.scratch_keys = cand;
            return;
        }
        // The keys to store are an ordered subset of the candidates: walk both.
        let mut blocks = JobBlocks::new();
        let mut c = 0;
        for k in &keys {
            while c < cand.len() && cand[c] != *k {
                c += 1;
            }
            if c == cand.len() {
                break;
            }
            let i = cand_idx[c];
            for &b in &rs.block_ids[i * bpc..(i + 1) * bpc] {
                if b.0 != 0 {
                    blocks.push(b);
                }
            }
            c += 1;
        }
        let finished = rs.finish.is_some();
        self.scratch_idx = cand_idx;
        self.scratch_keys = cand;
        let job = self.new_job_id();
        let now = self.step_now_ns();
        let flush = finished && blocks.iter().any(|&b| self.batch.allocated.contains(b));
        if finished {
            self.fences.add(job, &blocks);
        }
        if flush {
            self.batch.flush.push(job);
        }
        if let Some(rs) = self.requests.at_mut(slot) {
            rs.jobs.push(job);
        }
        let transfer = TransferJob {
            job,
            req,
            block_ids: blocks,
            chunk_ids,
            keys,
            groups: Vec::new(),
        };
        self.enter_store(transfer, now, finished, out);
    }

    /// Enters a planned store (one group or several) in the job table
    /// (`fenced`: its blocks are fenced already), adds it to `out`, and
    /// queues its deadline for the watchdog.
    #[inline(always)]
    pub(crate) fn enter_store(
        &mut self,
        transfer: TransferJob,
        now: u64,
        fenced: bool,
        out: &mut Vec<TransferJob>,
    ) {
        let job = transfer.job;
        let deadline = self.jobs.deadline_for(now);
        let latch = super::latch::JobLatch::new(self.geo.world_size);
        let keys = copy_small(&transfer.keys);
        let entry = JobEntry::store(transfer.req, now, latch, keys, &transfer.block_ids, fenced);
        self.jobs.insert(job, entry);
        out.push(transfer);
        // Published after the insert (at the end of the step): the watchdog
        // drops deadline entries of absent jobs.
        self.batch.deadlines.push((job, deadline));
    }
}

/// Appends a step's new blocks to a request's table and to the step's
/// allocated blocks. Out of line: a decoding request gets a new block only
/// once per block of tokens, so the step's loop stays small.
#[inline(never)]
fn append_blocks(table: &mut Vec<GpuBlockId>, allocated: &mut AllocatedBlocks, new: &[GpuBlockId]) {
    table.extend_from_slice(new);
    allocated.extend_non_null(new);
}
