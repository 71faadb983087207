//! Cache reset (vLLM `reset_cache`): every live job fenced, finished
//! requests finalized, stalled jobs' host slots kept out of reuse.

use std::collections::HashMap;

use crate::Direction;
use crate::ids::{ChunkId, JobId, RequestId};
use crate::key::{ChunkKey, KeyBuildHasher};

use super::types::SchedulerError;
use super::types::{JobBlocks, JobSlots};
use super::{FencedReset, Scheduler};

impl Scheduler {
    /// Resets the host tier (vLLM `reset_cache`).
    ///
    /// Every live job goes to the next step's flush set and to the reset fence
    /// (reports for jobs created before the reset are then counted there only;
    /// the manager hears `on_reset_flushed` when it drains). Finished requests
    /// are finalized (the manager's `request_finished` if they had not had it)
    /// and dropped; surviving requests re-offer every chunk and forget their
    /// jobs (with sliding-window groups, every chunk whose blocks they still
    /// know to hold: window blocks behind a store cursor are forgotten).
    ///
    /// Stalled jobs are not added to the reset fence (they may never report),
    /// but they keep their host slots out of reuse until their late reports
    /// arrive or their cancellation is confirmed: a stalled store's quarantined
    /// slots stay held (the manager's reset keeps them), and a stalled load's
    /// pinned chunks are turned into quarantined slots before the manager's
    /// reset would free them. Stalled stores' GPU fences are dropped (a late
    /// store reading a reused GPU block can only land in its own quarantined
    /// slot); stalled loads keep theirs (a late load writes its GPU blocks,
    /// so their reuse must still wait for it).
    pub fn reset(&mut self) -> Result<(), SchedulerError> {
        self.apply_stalls();
        // As vLLM (it asserts both): not between a step's lookups or loads
        // and its build.
        if !self.batch.loads.is_empty() || !self.batch.sync_reserved.is_empty() {
            return Err(SchedulerError::ResetMidStep);
        }
        let mut live: Vec<(JobId, FencedReset)> = Vec::with_capacity(self.jobs.len());
        self.jobs.for_each(|id, e| {
            live.push((
                id,
                FencedReset {
                    remaining: e.latch.pending(),
                    load_req: (e.kind == Direction::Load).then_some(e.req),
                    failed: e.failed,
                },
            ));
        });
        live.sort_unstable_by_key(|(id, _)| *id);
        self.batch.flush.extend(live.iter().map(|(id, _)| *id));
        let mut finished: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| r.finish.is_some())
            .map(|(id, _)| *id)
            .collect();
        finished.sort_unstable();
        for req in finished {
            if let Some(mut rs) = self.requests.remove(&req)
                && !rs.manager_finished
            {
                self.manager.request_finished_with(req, &mut rs.access);
                self.counters.manager_request_finished += 1;
            }
        }
        // Stalled loads keep their host chunks across the reset: pinned chunks
        // become quarantined slots (the reset frees pins, not quarantine).
        let mut stalled_loads: Vec<JobId> = self
            .stalled
            .iter()
            .filter(|(_, s)| s.kind == Direction::Load && !s.load_quarantined)
            .map(|(j, _)| *j)
            .collect();
        stalled_loads.sort_unstable();
        // A chunk pinned by several stalled loads is quarantined once, by the
        // first, and held by each of them: its slot is freed when the last
        // one's late reports arrive (`load_holds` counts the holders).
        let mut quarantined_here: HashMap<ChunkKey, ChunkId, KeyBuildHasher> = HashMap::default();
        for job in stalled_loads {
            let Some(s) = self.stalled.get_mut(&job) else {
                continue;
            };
            let mut fresh: Vec<ChunkKey> = Vec::new();
            let mut held = JobSlots::new();
            for &k in s.keys.iter() {
                if let Some(&c) = quarantined_here.get(&k) {
                    if !held.contains(&c) {
                        held.push(c);
                    }
                } else if self.manager.slot_of(k).is_some() && !fresh.contains(&k) {
                    fresh.push(k);
                }
            }
            match self.manager.quarantine_pinned(&fresh) {
                Ok(slots) => {
                    for (&k, &c) in fresh.iter().zip(&slots) {
                        quarantined_here.insert(k, c);
                        held.push(c);
                    }
                }
                Err(err) => {
                    tracing::error!(%job, error = %err, "stalled load: cannot quarantine its chunks");
                }
            }
            for &c in &held {
                *self.load_holds.entry(c).or_insert(0) += 1;
            }
            s.chunk_ids = held;
            s.load_quarantined = true;
        }
        self.manager.reset();
        self.remote_reset();
        // Sliding-window blocks behind a store cursor may have been freed by
        // their window (the scheduler is not told, and another request may
        // hold them now): their places are emptied before the cursors go
        // back, so that re-offering from chunk 0 never reads them (vLLM reads
        // its manager's reachable blocks instead).
        let windowed: &[bool] = self.groups.as_deref().map_or(&[], |g| &g.windowed);
        let bpc = self.geo.blocks_per_chunk;
        for rs in self.requests.values_mut() {
            for g in (0..windowed.len()).filter(|&g| windowed[g]) {
                if let Some((blocks, next)) = rs.group_mut(g) {
                    let end = (*next * bpc).min(blocks.len());
                    blocks[..end].fill(crate::ids::GpuBlockId(0));
                }
            }
            rs.next_stored_chunk = 0;
            for g in &mut rs.other_groups {
                g.next_stored_chunk = 0;
            }
            rs.jobs.clear();
            rs.partial_tail = None;
            // The tier forgot every access (as its own map is cleared).
            rs.access = Default::default();
        }
        self.stale_threshold = self.next_job;
        self.reset_fence.extend(live);
        self.jobs.clear();
        self.fences.clear();
        self.window_fences.clear();
        self.being_loaded.clear();
        // A stalled job is kept while it holds host slots, or (a load) GPU blocks.
        self.stalled
            .retain(|_, s| !s.chunk_ids.is_empty() || (s.kind == Direction::Load && s.fenced));
        for (&job, s) in self.stalled.iter_mut() {
            if s.kind == Direction::Load {
                if s.fenced {
                    self.fences.add(job, &s.blocks);
                }
            } else {
                s.fenced = false;
                s.blocks = JobBlocks::new();
            }
        }
        self.watch.reset_schedule();
        if self.reset_fence.is_empty() {
            self.manager.on_reset_flushed();
        }
        Ok(())
    }
}
