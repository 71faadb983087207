//! [`Scheduler::on_alloc_groups`]: the blocks vLLM allocated in every KV
//! group, and the load they receive (its `update_state_after_alloc` over
//! several groups).

use crate::ids::{GpuBlockId, JobId, RequestId};
use crate::scheduler::types::{GroupSpan, JobBlocks};
use crate::scheduler::{Scheduler, SchedulerError};

use super::load::{GpuBlock, plan_load};

/// A request's blocks in one KV group, as the serving backend allocated
/// them for a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupAlloc<'a> {
    /// The request's whole block table in this group (the null block, 0,
    /// where a sliding window holds nothing).
    pub block_ids: &'a [GpuBlockId],
    /// Per block, whether it holds cached KV (vLLM: the block has a block
    /// hash); co-indexed with `block_ids`.
    pub cached: &'a [bool],
}

impl Scheduler {
    /// [`Self::on_alloc`] for a scheduler with several KV groups: `groups`
    /// holds the request's blocks in each group, in group order. With
    /// external tokens, one load job carries every group's part
    /// ([`crate::scheduler::TransferJob::groups`]): a full-attention group loads every block
    /// past the GPU's hit, a sliding-window group only its window's.
    ///
    /// On a single-group scheduler, one group is [`Self::on_alloc`] with its
    /// blocks.
    pub fn on_alloc_groups(
        &mut self,
        req: RequestId,
        groups: &[GroupAlloc<'_>],
        external_tokens: u64,
    ) -> Result<Option<JobId>, SchedulerError> {
        // Shared, not copied: the groups never change after construction.
        let Some(hybrid) = self.groups.clone() else {
            return match groups {
                [one] => self.on_alloc(req, one.block_ids, external_tokens),
                _ => Err(SchedulerError::Groups(format!(
                    "{} block lists for a single-group scheduler",
                    groups.len()
                ))),
            };
        };
        let shapes = &hybrid.shapes;
        self.apply_stalls();
        if groups.len() != shapes.len() {
            return Err(SchedulerError::Groups(format!(
                "{} block lists for {} KV groups",
                groups.len(),
                shapes.len()
            )));
        }
        if let Some((g, a)) = groups
            .iter()
            .enumerate()
            .find(|(_, a)| a.cached.len() != a.block_ids.len())
        {
            return Err(SchedulerError::Groups(format!(
                "group {g}: {} cached flags for {} blocks",
                a.cached.len(),
                a.block_ids.len()
            )));
        }
        let bpc = self.geo.blocks_per_chunk;
        let rs = self
            .requests
            .get(&req)
            .ok_or(SchedulerError::UnknownRequest(req))?;
        // Validate everything before changing anything.
        let plan = if external_tokens == 0 {
            None
        } else {
            let computed = rs.lookup_computed.ok_or(SchedulerError::NoLookup(req))?;
            if !rs.jobs.is_empty() {
                return Err(SchedulerError::JobsInFlight(req));
            }
            let states: Vec<Vec<GpuBlock>> = groups
                .iter()
                .map(|a| {
                    a.block_ids
                        .iter()
                        .zip(a.cached)
                        .map(|(b, &cached)| match (b.0, cached) {
                            (0, _) => GpuBlock::Null,
                            (_, true) => GpuBlock::Cached,
                            (_, false) => GpuBlock::Fresh,
                        })
                        .collect()
                })
                .collect();
            let views: Vec<&[GpuBlock]> = states.iter().map(Vec::as_slice).collect();
            let sync = self.batch.sync_reserved.contains(&req);
            let loads =
                plan_load(shapes, bpc, computed, external_tokens, sync, &views).map_err(|e| {
                    SchedulerError::LoadOutOfRange {
                        req,
                        what: e.to_string(),
                    }
                })?;
            let cached_end = computed.saturating_add(external_tokens);
            // A hit ending on a partial tail reads its last chunk from
            // the partial key (vLLM asserts the hit is the lookup's).
            let partial = match (rs.partial_tail, self.partial_tails) {
                (Some(boundary), Some(pt)) => {
                    if boundary != cached_end {
                        return Err(SchedulerError::LoadOutOfRange {
                            req,
                            what: format!(
                                "the lookup's hit ends on a partial tail at {boundary} tokens, the load at {cached_end}"
                            ),
                        });
                    }
                    Some((boundary, pt.tokens_per_hash))
                }
                _ => None,
            };
            let mut cover = Vec::with_capacity(loads.len());
            let mut keys = Vec::new();
            let mut positions = Vec::new();
            let mut blocks = JobBlocks::new();
            let mut spans = Vec::with_capacity(loads.len());
            for (g, (load, alloc)) in loads.iter().zip(groups).enumerate() {
                let per_chunk = hybrid.hashes_per_chunk(g);
                let num_keys = rs.num_keys(per_chunk);
                let tpc = shapes[g].tokens_per_chunk();
                let tpb = tpc / bpc.max(1) as u64;
                // The partial tail's chunk has no complete key.
                let tail_chunk = partial.and(load.chunks.end.checked_sub(1));
                let keyed_end = tail_chunk.unwrap_or(load.chunks.end);
                if keyed_end > num_keys {
                    return Err(SchedulerError::LoadOutOfRange {
                        req,
                        what: format!(
                            "group {g} needs {} chunk keys, the request has {num_keys}",
                            load.chunks.end
                        ),
                    });
                }
                let first = load.first_block;
                blocks.extend_from_slice(&alloc.block_ids[first..first + load.num_blocks]);
                for i in load.chunks.start..keyed_end.max(load.chunks.start) {
                    keys.push(rs.group_key(g, i, per_chunk));
                    positions.push(hybrid.position(g, i));
                }
                if let (Some(_), Some((boundary, _))) = (tail_chunk, partial)
                    && !load.chunks.is_empty()
                {
                    let key = self.tail_key(rs, g, boundary).ok_or_else(|| {
                            SchedulerError::LoadOutOfRange {
                                req,
                                what: format!(
                                    "group {g}: no hash of the request at its partial tail ({boundary} tokens)"
                                ),
                            }
                        })?;
                    keys.push(key);
                    positions.push(hybrid.token_position(g, self.tail_key_tokens(g, boundary)));
                }
                if !load.chunks.is_empty() {
                    // vLLM's key ranges of this group, merged: from its
                    // first loaded block (or chunk) to the hit's end; a
                    // recurrent state covers the whole prefix it
                    // stands for, from the GPU's hit.
                    let lo = if shapes[g].is_recurrent_state() {
                        computed
                    } else {
                        (first as u64 * tpb).max(load.chunks.start as u64 * tpc)
                    };
                    let hi = cached_end.min(load.chunks.end as u64 * tpc);
                    cover.push((lo, hi));
                }
                spans.push(GroupSpan {
                    num_keys: load.chunks.len() as u32,
                    num_blocks: load.num_blocks as u32,
                    first_block_index: first as u32,
                });
            }
            // vLLM marks every group's chunks up to the hit's end as offered.
            let end_chunk: Vec<usize> = shapes
                .iter()
                .map(|shape| cached_end.div_ceil(shape.tokens_per_chunk()) as usize)
                .collect();
            Some((keys, positions, blocks, spans, end_chunk, sync, cover))
        };
        let plan = match plan {
            None => None,
            Some((keys, positions, blocks, spans, end_chunk, sync, cover)) => {
                let chunk_ids = match self.requests.get_mut(&req) {
                    Some(rs) => self
                        .manager
                        .prepare_load_at(&keys, &positions, &mut rs.access)?,
                    None => self.manager.prepare_load(&keys, Some(req))?,
                };
                Some((keys, chunk_ids, blocks, spans, end_chunk, sync, cover))
            }
        };
        for a in groups {
            self.batch.allocated.extend_non_null(a.block_ids);
        }
        let Some((keys, chunk_ids, blocks, spans, end_chunk, sync, cover)) = plan else {
            return Ok(None);
        };
        let job = self.create_load(req, keys, chunk_ids, blocks, spans, sync);
        if let Some(rs) = self.requests.get_mut(&req) {
            rs.jobs.push(job);
            rs.partial_tail = None;
            rs.loaded_from_offload = true;
            rs.load_cover = cover;
            for (g, &end) in end_chunk.iter().enumerate() {
                if let Some((_, next)) = rs.group_mut(g) {
                    *next = end;
                }
            }
        }
        Ok(Some(job))
    }
}
