//! A step of a scheduler with several KV groups (vLLM's
//! `_update_req_states` and `_build_store_jobs` over every group): block
//! updates with the sliding windows' stale blocks dropped, then one store
//! job per request carrying each group's chunks.

use crate::ids::{GpuBlockId, RequestId};
use crate::scheduler::store::StoreReach;
use crate::scheduler::types::{GroupSpan, JobBlocks, JobKeys, JobSlots, TransferJob, copy_small};
use crate::scheduler::{Scheduler, SchedulerError, StepInput};

use super::store::{StoreRequest, StoreView, store_candidates};
use super::window_index::WindowPlace;

impl Scheduler {
    /// A step's group lists (not empty): one entry per scheduled request,
    /// each with one block list per group past the first (or none when the
    /// request has no new block); a single-group scheduler takes none.
    pub(crate) fn check_group_blocks(&self, input: &StepInput) -> Result<(), SchedulerError> {
        let others = self.num_groups() - 1;
        if others == 0 || input.group_block_ids.len() != input.scheduled.len() {
            return Err(SchedulerError::Groups(format!(
                "{} group block entries for {} scheduled requests and {} KV groups",
                input.group_block_ids.len(),
                input.scheduled.len(),
                others + 1
            )));
        }
        for (s, lists) in input.scheduled.iter().zip(&input.group_block_ids) {
            let n = lists.len();
            if n != others && !(n == 0 && s.new_block_ids.is_empty()) {
                return Err(SchedulerError::Groups(format!(
                    "{}: new blocks of {n} groups past the first, the scheduler has {others}",
                    s.req
                )));
            }
        }
        Ok(())
    }

    /// The step's block updates over every group: the new blocks count as
    /// allocated in this step; a full table replaces the request's lists;
    /// then, in every request's sliding-window groups, a block not stored yet
    /// that was allocated again in this step is dropped (the window freed it
    /// and another request now holds it), before the new blocks are appended.
    pub(crate) fn update_group_blocks(&mut self, input: &StepInput, slots: &[u32]) {
        let Some(groups) = self.groups.as_deref() else {
            return;
        };
        let bpc = self.geo.blocks_per_chunk;
        for s in &input.scheduled {
            self.batch.allocated.extend_non_null(&s.new_block_ids);
        }
        for blocks in input.group_block_ids.iter().flatten() {
            self.batch.allocated.extend_non_null(blocks);
        }
        for (s, &slot) in input.scheduled.iter().zip(slots) {
            if let (true, Some(rs)) = (s.full_table, self.requests.at_mut(slot)) {
                for g in 0..groups.len() {
                    if let Some((blocks, _)) = rs.group_mut(g) {
                        blocks.clear();
                    }
                }
            }
        }
        // The places of this step's blocks in the windows' tables, past the
        // store cursor, are emptied (vLLM: a block allocated again is no
        // longer the request's). Places behind the cursor are kept.
        if groups.windowed.contains(&true) {
            for &b in self.batch.allocated.as_slice() {
                for place in self.window_index.take(b) {
                    let table = self
                        .requests
                        .at_mut(place.slot)
                        .and_then(|rs| rs.group_mut(place.group as usize));
                    let Some((blocks, next)) = table else {
                        continue;
                    };
                    let i = place.index as usize;
                    if blocks.get(i) != Some(&b) {
                        continue;
                    }
                    if i >= *next * bpc {
                        blocks[i] = GpuBlockId(0);
                    } else {
                        self.window_index.put(b, place);
                    }
                }
            }
        }
        // What reading every table would find: no window block past a store
        // cursor was allocated in this step.
        #[cfg(debug_assertions)]
        for rs in self.requests.values_mut() {
            for g in (0..groups.len()).filter(|&g| groups.windowed[g]) {
                let next = rs.group_next_stored(g);
                let blocks = rs.group_blocks(g);
                for &b in &blocks[(next * bpc).min(blocks.len())..] {
                    debug_assert!(
                        !self.batch.allocated.contains(b),
                        "window block {b:?} allocated again left in a table"
                    );
                }
            }
        }
        for (n, (s, &slot)) in input.scheduled.iter().zip(slots).enumerate() {
            let Some(rs) = self.requests.at_mut(slot) else {
                continue;
            };
            let others = input.group_block_ids.get(n).map_or(&[][..], Vec::as_slice);
            let lists = std::iter::once(&s.new_block_ids).chain(others);
            for (g, new) in lists.enumerate() {
                if let Some((blocks, _)) = rs.group_mut(g) {
                    if groups.windowed[g] {
                        for (i, &b) in new.iter().enumerate() {
                            let place = WindowPlace {
                                slot,
                                group: g as u32,
                                index: (blocks.len() + i) as u32,
                            };
                            self.window_index.put(b, place);
                        }
                    }
                    blocks.extend_from_slice(new);
                }
            }
        }
    }

    /// Plans at most one store job for the request in `slot` over every
    /// group (vLLM's `_build_store_jobs`); pushes it to `out`.
    pub(crate) fn plan_store_groups(
        &mut self,
        slot: u32,
        req: RequestId,
        reach: StoreReach,
        out: &mut Vec<TransferJob>,
    ) {
        let g = self.geo;
        let bpc = g.blocks_per_chunk;
        let Some(groups) = self.groups.as_deref() else {
            return;
        };
        let Some(rs) = self.requests.at_mut(slot) else {
            return;
        };
        let limit = rs.offload_limit(g.offload_prompt_only);
        let offloadable = reach.tokens_after(rs).min(rs.num_tokens).min(limit);
        let prompt_offloadable = rs.prompt_tokens.min(rs.num_tokens).min(limit);
        let finished = rs.finish.is_some();
        let request = StoreRequest {
            finished,
            num_prompt_tokens: rs.prompt_tokens,
            shared_prefix_boundary: rs.shared_prefix_boundary,
        };
        let n = groups.len();
        // A draft group's last chunk is volatile while the request decodes
        // (vLLM's `storable_chunks`): a rejected draft may rewrite it.
        let decoding = offloadable > rs.prompt_tokens && !finished;
        let storable_chunks = |rs: &crate::scheduler::request::RequestState, group: usize| {
            let shape = &groups.shapes[group];
            let volatile = usize::from(decoding && shape.is_eagle_draft());
            ((offloadable / shape.tokens_per_chunk()) as usize)
                .saturating_sub(volatile)
                .min(rs.group_blocks(group).len() / bpc)
                .min(rs.num_keys(groups.hashes_per_chunk(group)))
        };
        // A running request whose groups have no chunk past their cursors
        // offers nothing and moves no cursor (`store_candidates` starts at
        // the cursor unless the request finished): most requests of a
        // decode step, which complete a chunk every few steps.
        if !finished
            && (0..n).all(|group| storable_chunks(rs, group) <= rs.group_next_stored(group))
        {
            return;
        }
        // Per group: chunks computed, allocated and keyed; the chunks offered.
        let mut storable = Vec::with_capacity(n);
        let mut offered: Vec<Vec<usize>> = Vec::with_capacity(n);
        let mut keys = Vec::new();
        let mut positions = Vec::new();
        for (group, shape) in groups.shapes.iter().enumerate() {
            let blocks = rs.group_blocks(group);
            let chunks = storable_chunks(rs, group);
            let held: Vec<bool> = blocks.iter().map(|b| b.0 != 0).collect();
            let view = StoreView {
                next_stored_chunk: rs.group_next_stored(group),
                storable_chunks: chunks,
                prompt_chunks: (prompt_offloadable / shape.tokens_per_chunk()) as usize,
                held: &held,
            };
            let chosen = store_candidates(shape, &groups.policy, &request, &view);
            for &c in &chosen {
                keys.push(rs.group_key(group, c, groups.hashes_per_chunk(group)));
                positions.push(groups.position(group, c));
            }
            storable.push(chunks);
            offered.push(chosen);
        }
        let advance = |rs: &mut crate::scheduler::request::RequestState| {
            for (group, &chunks) in storable.iter().enumerate() {
                if let Some((_, next)) = rs.group_mut(group) {
                    *next = (*next).max(chunks);
                }
            }
        };
        if keys.is_empty() {
            advance(rs);
            return;
        }
        let prepared = self
            .manager
            .prepare_store_for_job(&keys, &positions, &mut rs.access)
            .map(|(k, c)| -> (JobKeys, JobSlots) { (copy_small(k), copy_small(c)) });
        let Some((stored, chunk_ids)) = prepared else {
            self.counters.allocation_failures += 1;
            tracing::warn!(%req, chunks = keys.len(), "host tier cannot allocate; store retried next step");
            return;
        };
        if stored.is_empty() {
            advance(rs);
            return;
        }
        // The keys to store are an ordered subset of those offered: walk both,
        // group by group.
        let mut blocks = JobBlocks::new();
        let mut window_blocks = JobBlocks::new();
        let mut deferred = Vec::new();
        let mut partial = Vec::new();
        let mut spans = Vec::with_capacity(n);
        let (mut next_stored, mut next_offered) = (0, 0);
        for (group, chosen) in offered.iter().enumerate() {
            let table = rs.group_blocks(group);
            let mut span = GroupSpan {
                num_keys: 0,
                num_blocks: 0,
                first_block_index: 0,
            };
            let mut first = None;
            // Null blocks inside the job's blocks (a sliding-window block
            // freed behind the window but not needed by any hit): vLLM's
            // spec leaves them out, which puts the blocks after them into
            // the wrong sub-blocks of the chunk. kvoffload's keeps their
            // place as holes (block 0, not copied); leading nulls are the
            // span's start, and a stored chunk's last block is never null.
            let mut holes = 0u32;
            for &chunk in chosen {
                let key = keys[next_offered];
                next_offered += 1;
                if stored.get(next_stored) != Some(&key) {
                    continue;
                }
                next_stored += 1;
                span.num_keys += 1;
                let start = chunk * bpc;
                // What of the chunk this store writes (`hybrid/holes.rs`).
                let written: smallvec::SmallVec<[bool; 8]> = (start..start + bpc)
                    .map(|i| table.get(i).is_some_and(|b| b.0 != 0))
                    .collect();
                partial.push((key, written));
                for (i, &b) in table.iter().enumerate().skip(start).take(bpc) {
                    if b.0 == 0 {
                        holes += u32::from(first.is_some());
                        continue;
                    }
                    first.get_or_insert(i);
                    for _ in 0..holes {
                        blocks.push(crate::ids::GpuBlockId(0));
                    }
                    span.num_blocks += holes;
                    holes = 0;
                    blocks.push(b);
                    span.num_blocks += 1;
                    if groups.windowed[group] {
                        window_blocks.push(b);
                    } else {
                        deferred.push(b);
                    }
                }
            }
            span.first_block_index = first.unwrap_or(0) as u32;
            spans.push(span);
        }
        advance(rs);
        for (key, written) in partial {
            self.note_chunk_written(key, &written);
        }
        let job = self.new_job_id();
        if let Some(rs) = self.requests.at_mut(slot) {
            rs.jobs.push(job);
        }
        let now = self.step_now_ns();
        // vLLM: a sliding-window group's blocks are fenced from the store's
        // creation; the others when its request has finished, flushing the
        // store at once if one of those was allocated again in this step.
        if finished {
            self.fences.add(job, &blocks);
            if deferred.iter().any(|&b| self.batch.allocated.contains(b)) {
                self.batch.flush.push(job);
            }
        } else if !window_blocks.is_empty() {
            self.fences.add(job, &window_blocks);
            self.window_fences.insert(job, window_blocks);
        }
        let transfer = TransferJob {
            job,
            req,
            block_ids: blocks,
            chunk_ids,
            keys: stored,
            groups: spans,
        };
        self.enter_store(transfer, now, finished, out);
    }
}
