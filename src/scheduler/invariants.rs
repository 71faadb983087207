//! Consistency checks of the scheduler's state (the invariants listed in
//! `docs/scheduler.md`, "Invariants", and nothing leaked). For tests; cost is linear in the state.

use std::collections::{HashMap, HashSet};

use crate::ids::{ChunkId, JobId};
use crate::key::ChunkKey;

use super::Scheduler;
use crate::Direction;

impl Scheduler {
    /// Checks every invariant; returns a description of the first violation.
    ///
    /// - the manager's own invariants;
    /// - every live job: id after the last reset, 1..=world_size reports due,
    ///   tracked by its request; a finished request's stores fence their blocks
    ///   (a running request's stores their sliding-window blocks);
    /// - every request: one load xor only stores; a finished-and-signaled
    ///   request still has jobs (else it should be gone);
    /// - the being-loaded set is exactly the keys of live loads;
    /// - every fence entry names a live or stalled store over that block, or a
    ///   stalled load into it; every stalled load's blocks are fenced;
    /// - stalled jobs still owe reports; their host chunks are held (stores:
    ///   quarantined, loads: pinned) and account for every quarantined slot;
    /// - the manager's pending chunks are those of live stores, its pinned
    ///   chunks those of live and stalled loads;
    /// - the reset fence only holds pre-reset jobs that still owe reports.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.manager
            .check_invariants()
            .map_err(|e| format!("manager: {e}"))?;
        if let Some(req) = self.requests.finish_tag_mismatch() {
            return Err(format!(
                "{req}: the request table's finished tag disagrees with its state"
            ));
        }
        let ws = self.geo.world_size;
        struct Live {
            id: JobId,
            kind: Direction,
            req: crate::ids::RequestId,
            fenced: bool,
            sync: bool,
            blocks: Vec<crate::ids::GpuBlockId>,
            keys: Vec<ChunkKey>,
            pending: u32,
        }
        let mut jobs: Vec<Live> = Vec::new();
        self.jobs.for_each(|id, e| {
            jobs.push(Live {
                id,
                kind: e.kind,
                req: e.req,
                fenced: e.fenced,
                sync: e.sync,
                blocks: e.blocks().to_vec(),
                keys: e.keys.to_vec(),
                pending: e.latch.pending(),
            });
        });
        let mut loading: HashMap<ChunkKey, u32> = HashMap::new();
        let mut pending_keys = 0usize;
        let mut pinned: HashSet<ChunkKey> = HashSet::new();
        for Live {
            id,
            kind,
            req,
            fenced,
            sync,
            blocks,
            keys,
            pending,
        } in &jobs
        {
            if id.0 < self.stale_threshold || id.0 >= self.next_job {
                return Err(format!(
                    "live {id} outside [{}, {})",
                    self.stale_threshold, self.next_job
                ));
            }
            if *pending == 0 || *pending > ws {
                return Err(format!("{id} owes {pending} reports (world size {ws})"));
            }
            if self.stalled.contains_key(id) {
                return Err(format!("{id} is both live and stalled"));
            }
            let Some(rs) = self.requests.get(req) else {
                return Err(format!("live {id} of untracked request {req}"));
            };
            if !rs.jobs.contains(id) {
                return Err(format!("live {id} not in the job set of {req}"));
            }
            match kind {
                Direction::Load => {
                    for k in keys {
                        // A synchronous load's keys are not marked as being loaded.
                        if !*sync {
                            *loading.entry(*k).or_default() += 1;
                        }
                        pinned.insert(*k);
                    }
                }
                Direction::Store => {
                    pending_keys += keys.len();
                    if rs.finish.is_some() && !fenced {
                        return Err(format!("store {id} of finished {req} is not fenced"));
                    }
                    if *fenced {
                        for b in blocks.iter().filter(|b| b.0 != 0) {
                            if !self.fences.jobs(*b).contains(id) {
                                return Err(format!("store {id}: block {} not fenced", b.0));
                            }
                        }
                    }
                }
            }
        }
        for (req, rs) in self.requests.iter() {
            let mut seen = HashSet::new();
            let mut loads = 0;
            for j in &rs.jobs {
                if !seen.insert(*j) {
                    return Err(format!("{req} lists {j} twice"));
                }
                match self.jobs.get(*j).map(|e| (e.kind, e.sync)) {
                    None => return Err(format!("{req} lists {j}, which is not live")),
                    // Stores may be planned beside a synchronous load (its
                    // request runs in the step).
                    Some((Direction::Load, true)) => {}
                    Some((Direction::Load, false)) => loads += 1,
                    Some((Direction::Store, _)) => {}
                }
            }
            if loads > 0 && rs.jobs.len() != 1 {
                return Err(format!("{req} has a load and other jobs: {:?}", rs.jobs));
            }
            if rs.finished_signaled && rs.jobs.is_empty() {
                return Err(format!("finished {req} with no job is still tracked"));
            }
        }
        let mut bl: HashMap<ChunkKey, u32> = HashMap::new();
        for (k, n) in &self.being_loaded {
            bl.insert(*k, *n);
        }
        if bl != loading {
            return Err(format!(
                "being-loaded set {bl:?} but live loads hold {loading:?}"
            ));
        }
        for (j, window) in &self.window_fences {
            match self.jobs.get(*j) {
                Some(e) if e.kind == Direction::Store && !e.fenced => {}
                _ => return Err(format!("window fence of {j}, not a live unfenced store")),
            }
            if let Some(b) = window.iter().find(|b| !self.fences.jobs(**b).contains(j)) {
                return Err(format!("store {j}: window block {} not fenced", b.0));
            }
        }
        for (b, fjobs) in self.fences.iter() {
            if fjobs.is_empty() {
                return Err(format!("block {} has an empty fence", b.0));
            }
            for j in fjobs {
                let window = self.window_fences.get(j).is_some_and(|w| w.contains(&b));
                let ok = if let Some(e) = self.jobs.get(*j) {
                    e.kind == Direction::Store && (e.fenced || window) && e.blocks().contains(&b)
                } else if let Some(s) = self.stalled.get(j) {
                    s.fenced && s.blocks.contains(&b)
                } else {
                    false
                };
                if !ok {
                    return Err(format!(
                        "block {} fenced by {j}, which is not a store over it nor a stalled load into it",
                        b.0
                    ));
                }
            }
        }
        let quarantined: HashSet<_> = self.manager.quarantined_chunks().into_iter().collect();
        let mut held = 0usize;
        // Slot -> stalled loads holding it (a slot may be shared by several).
        let mut load_holders: HashMap<ChunkId, u32> = HashMap::new();
        for (j, s) in &self.stalled {
            if s.remaining == 0 {
                return Err(format!("stalled {j} owes no report"));
            }
            match s.kind {
                Direction::Store => {
                    for c in s.chunk_ids.iter() {
                        if !quarantined.contains(c) {
                            return Err(format!("stalled store {j}: {c} not quarantined"));
                        }
                    }
                    held += s.chunk_ids.len();
                }
                Direction::Load if s.load_quarantined => {
                    for c in s.chunk_ids.iter() {
                        if !quarantined.contains(c) {
                            return Err(format!("stalled load {j}: {c} not quarantined"));
                        }
                        *load_holders.entry(*c).or_default() += 1;
                    }
                }
                Direction::Load => {
                    for k in s.keys.iter() {
                        pinned.insert(*k);
                    }
                }
            }
            if s.kind == Direction::Load {
                if !s.fenced {
                    return Err(format!("stalled load {j}: its GPU blocks are not fenced"));
                }
                for b in s.blocks.iter().filter(|b| b.0 != 0) {
                    if !self.fences.jobs(*b).contains(j) {
                        return Err(format!("stalled load {j}: block {} not fenced", b.0));
                    }
                }
            }
        }
        let recorded: HashMap<ChunkId, u32> =
            self.load_holds.iter().map(|(c, n)| (*c, *n)).collect();
        if load_holders != recorded {
            return Err(format!(
                "stalled loads hold {load_holders:?}, the hold counts say {recorded:?}"
            ));
        }
        held += load_holders.len();
        if load_holders.keys().any(|c| {
            self.stalled
                .values()
                .any(|s| s.kind == Direction::Store && s.chunk_ids.contains(c))
        }) {
            return Err("a slot is held by both a stalled store and a stalled load".into());
        }
        if held != quarantined.len() {
            return Err(format!(
                "{} slots quarantined but stalled jobs hold {held}",
                quarantined.len()
            ));
        }
        let st = self.manager.stats();
        if st.pending as usize != pending_keys {
            return Err(format!(
                "manager has {} pending chunks, live stores {pending_keys}",
                st.pending
            ));
        }
        if st.pinned as usize != pinned.len() {
            return Err(format!(
                "manager has {} pinned chunks, loads hold {}",
                st.pinned,
                pinned.len()
            ));
        }
        for (j, f) in &self.reset_fence {
            if j.0 >= self.stale_threshold || f.remaining == 0 {
                return Err(format!(
                    "reset fence entry {j} ({} due) is invalid",
                    f.remaining
                ));
            }
        }
        if !self.batch.loads.is_empty() || !self.batch.allocated.is_empty() {
            return Err("per-step state left after the step".into());
        }
        Ok(())
    }
}
