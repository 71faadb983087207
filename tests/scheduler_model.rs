//! Model-based property test of the control plane: random interleavings of
//! add / lookup / alloc / step (with preemptions, finishes and aborts) /
//! request-finished / reset, worker reports delivered in order, out of order,
//! late, duplicated, split across workers and for unknown jobs, and clock jumps
//! past the stall timeout, with one and two blocks per chunk.
//!
//! The reference model predicts, from the rules (vLLM 0.33.0's
//! `OffloadingConnectorScheduler` for one full-attention group, and
//! `docs/scheduler.md` for the stall extension), not from the scheduler:
//! every lookup's answer (hits, or defer while the request has a job in
//! flight, a hit is being stored, or a hit is being loaded for another
//! request); every load's job id, keys and blocks; every step's store jobs
//! (which requests store which chunks from which blocks, with which job ids,
//! and which stores the tier refuses for lack of room); every report's
//! acceptance and finished / failed loads; every scan's stalls; each job's
//! life (live -> completed, stalled -> released, or dropped by a reset);
//! which jobs a reset stops tracking; the tracked requests; and the host
//! tier's events. Only the choice of eviction victims is taken from the
//! tier's events (their order is `tests/manager_props.rs`'s subject, against
//! vLLM's LRU and ARC); the model checks that each store evicts exactly what
//! it needs and only idle, unprotected chunks.
//!
//! After every operation the scheduler is also checked against
//! `Scheduler::check_invariants`. At the end everything drains and nothing is
//! left. A failing case is shrunk by proptest and written out as a replayable
//! trace (`kvoffload replay PATH`), whose path the failure prints.

mod common;

use kvoffload::Direction;
use std::collections::{BTreeMap, BTreeSet};
use std::panic::{AssertUnwindSafe, catch_unwind};

use common::driver::{self, BlockPool, Hooks, Req, ReqState};
use common::trace_rec::Rec;
use kvoffload::scheduler::{
    CompletionReport, LookupOutcome, SchedulerError, StepInput, TransferJob,
};
use kvoffload::{ChunkKey, GpuBlockId, JobId, OffloadConfig, RequestId};
use proptest::prelude::*;

const TPB: u64 = 4;
const STALL_MS: u64 = 1_000;

#[derive(Debug, Clone)]
enum Op {
    Add {
        family: u8,
        prompt: u8,
    },
    Step {
        preempt: Option<u8>,
        finish: Option<u8>,
        abort: bool,
    },
    /// Reports for one in-flight job, any job (out of order), `count` reports,
    /// delivered in one call or split into single-worker calls.
    Report {
        pick: u8,
        count: u8,
        fail: bool,
        split: bool,
    },
    /// A report for a job that already completed (duplicate).
    Duplicate {
        pick: u8,
    },
    /// A report for a job id never created.
    Unknown {
        ahead: u8,
    },
    /// A late report for a stalled job.
    Late {
        pick: u8,
    },
    /// Clock moves by `ms` (small).
    Advance {
        ms: u16,
    },
    /// Clock jumps past the stall timeout, then a scan.
    Jump,
    Scan,
    Reset,
    Cancel {
        pick: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 1u8..24).prop_map(|(family, prompt)| Op::Add { family, prompt }),
        6 => (proptest::option::of(any::<u8>()), proptest::option::of(any::<u8>()), any::<bool>())
            .prop_map(|(preempt, finish, abort)| Op::Step { preempt, finish, abort }),
        5 => (any::<u8>(), 1u8..4, proptest::bool::weighted(0.1), any::<bool>())
            .prop_map(|(pick, count, fail, split)| Op::Report { pick, count, fail, split }),
        1 => any::<u8>().prop_map(|pick| Op::Duplicate { pick }),
        1 => (0u8..4).prop_map(|ahead| Op::Unknown { ahead }),
        1 => any::<u8>().prop_map(|pick| Op::Late { pick }),
        1 => (0u16..600).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Jump),
        1 => Just(Op::Scan),
        1 => Just(Op::Reset),
        1 => any::<u8>().prop_map(|pick| Op::Cancel { pick }),
    ]
}

/// A job's life in the reference model.
#[derive(Debug, Clone, Copy, PartialEq)]
enum JSt {
    /// In flight; `left` reports due.
    Live,
    /// Every report arrived.
    Completed,
    /// Handed over as stalled; `left` late reports due.
    Stalled,
    /// Late reports all in, or cancellation confirmed (or, at a reset, a
    /// stalled load that held no host chunk any more: no longer tracked).
    Released,
    /// In flight at a reset; `left` reports still count toward the reset fence.
    Dropped,
}

#[derive(Debug, Clone)]
struct MJob {
    kind: Direction,
    req: RequestId,
    created_ms: u64,
    left: u32,
    failed: bool,
    st: JSt,
    keys: Vec<ChunkKey>,
    /// A stalled load whose chunks a reset turned into held slots.
    load_quarantined: bool,
    /// Times it completed / stalled (each at most once, and not both).
    completions: u32,
    stalls: u32,
}

/// A request: the driver's request (its engine state, `Deref`) and what the
/// model tracks beside it.
struct MReq {
    r: Req,
    /// The block list the scheduler keeps for it (emptied by a lookup,
    /// filled by the steps that schedule it).
    sched_blocks: Vec<GpuBlockId>,
    /// The next chunk to offer for storing.
    next_stored: u64,
    /// `request_finished` called (aborted, computed tokens), and whether a
    /// step has listed it since.
    finish: Option<(bool, u64)>,
    finalized: bool,
}

/// A chunk in the host tier, as the model sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct TChunk {
    /// Its store job is in flight.
    pending: bool,
    /// Loads (live or stalled) that pin it.
    pins: u32,
}

/// A host slot held out of the tier: a stalled store's, or (after a reset)
/// a chunk of stalled loads, held by each of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Hold {
    Store(u64, ChunkKey),
    Load(u64, ChunkKey),
}

/// An event as the tier reports it: (removed, metadata only, keys).
type Ev = (bool, bool, Vec<ChunkKey>);

/// How often the generated cases reached what the model predicts.
#[derive(Debug, Clone, Copy, Default)]
struct Cov {
    hits: u64,
    defers: u64,
    loads: u64,
    stores: u64,
    evicting_stores: u64,
    refused_stores: u64,
    stalled_loads_held_across_reset: u64,
    stalled_loads_untracked_at_reset: u64,
    finished_stores: u64,
}

struct World {
    cov: Cov,
    rec: Rec,
    world: u32,
    bpc: u64,
    capacity: u64,
    prompt_only: bool,
    now_ms: u64,
    reqs: Vec<MReq>,
    jobs: BTreeMap<u64, MJob>,
    next_job: u64,
    /// Job ids below this were created before the last reset.
    threshold: u64,
    tier: BTreeMap<ChunkKey, TChunk>,
    held: BTreeMap<Hold, BTreeSet<u64>>,
    resets: u64,
    /// Events the model expects the tier to report next.
    events: Vec<Ev>,
    blocks: BlockPool,
    stall_count: u64,
}

impl std::ops::Deref for MReq {
    type Target = Req;
    fn deref(&self) -> &Req {
        &self.r
    }
}

impl std::ops::DerefMut for MReq {
    fn deref_mut(&mut self) -> &mut Req {
        &mut self.r
    }
}

impl AsRef<Req> for MReq {
    fn as_ref(&self) -> &Req {
        &self.r
    }
}

impl MReq {
    /// The chunk keys the scheduler knows (full chunks of hashed blocks).
    fn keys(&self, bpc: u64) -> Vec<ChunkKey> {
        let chunks = self.tokens / TPB / bpc;
        (0..chunks)
            .map(|c| ChunkKey(self.hash((c + 1) * bpc - 1).0))
            .collect()
    }
}

/// The engine a run drives: `Setup { world: 2, ..Setup::default() }`.
#[derive(Debug, Clone, Copy)]
struct Setup {
    /// Workers (reports per job).
    world: u32,
    /// Host-tier capacity in chunks.
    chunks: u64,
    /// Offload prompt blocks only.
    prompt_only: bool,
    /// GPU blocks per chunk.
    bpc: u32,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            world: 1,
            chunks: 64,
            prompt_only: false,
            bpc: 1,
        }
    }
}

impl World {
    fn new(setup: Setup) -> Self {
        let Setup {
            world,
            chunks,
            prompt_only,
            bpc,
        } = setup;
        let cfg = OffloadConfig {
            tokens_per_block: TPB as u32,
            blocks_per_chunk: bpc,
            world_size: world,
            offload_prompt_only: prompt_only,
            stall_timeout_ms: STALL_MS,
            stall_scan_interval_ms: 100,
            ..OffloadConfig::with_chunks(chunks)
        };
        Self {
            cov: Cov::default(),
            rec: Rec::new(&cfg),
            world,
            bpc: u64::from(bpc),
            capacity: chunks,
            prompt_only,
            now_ms: 0,
            reqs: Vec::new(),
            jobs: BTreeMap::new(),
            next_job: 0,
            threshold: 0,
            tier: BTreeMap::new(),
            held: BTreeMap::new(),
            resets: 0,
            events: Vec::new(),
            blocks: BlockPool::default(),
            stall_count: 0,
        }
    }

    fn tpc(&self) -> u64 {
        TPB * self.bpc
    }

    fn new_job(&mut self, kind: Direction, req: RequestId, keys: Vec<ChunkKey>) -> u64 {
        let id = self.next_job;
        self.next_job += 1;
        self.jobs.insert(
            id,
            MJob {
                kind,
                req,
                created_ms: self.now_ms,
                left: self.world,
                failed: false,
                st: JSt::Live,
                keys,
                load_quarantined: false,
                completions: 0,
                stalls: 0,
            },
        );
        id
    }

    /// Live jobs of a request.
    fn jobs_of(&self, r: u64) -> usize {
        self.jobs
            .values()
            .filter(|j| j.req.0 == r && j.st == JSt::Live)
            .count()
    }

    /// Keys a live load is reading.
    fn being_loaded(&self, k: ChunkKey) -> bool {
        self.jobs
            .values()
            .any(|j| j.kind == Direction::Load && j.st == JSt::Live && j.keys.contains(&k))
    }

    fn free_slots(&self) -> u64 {
        self.capacity - self.tier.len() as u64 - self.held.len() as u64
    }

    /// The model and the scheduler agree on every job, the tracked requests
    /// and the tier's events; the invariants hold.
    fn check(&mut self) {
        if let Err(e) = self.rec.s.check_invariants() {
            panic!("invariant violated: {e}");
        }
        let got: Vec<Ev> = self
            .rec
            .take_events()
            .into_iter()
            .map(|e| (e.removed, e.metadata_only, e.keys))
            .collect();
        // A metadata-only removal keeps the keys absent from the tier now.
        let want: Vec<Ev> = std::mem::take(&mut self.events)
            .into_iter()
            .filter_map(|(removed, meta, keys)| {
                let keys: Vec<ChunkKey> = if meta {
                    keys.into_iter()
                        .filter(|k| !self.tier.contains_key(k))
                        .collect()
                } else {
                    keys
                };
                (!keys.is_empty()).then_some((removed, meta, keys))
            })
            .collect();
        assert_eq!(got, want, "the tier's events");
        let s = &self.rec.s;
        let (mut live, mut stalled) = (0, 0);
        for (&id, j) in &self.jobs {
            let id = JobId(id);
            assert!(j.completions + j.stalls <= 1, "{id} ended twice: {j:?}");
            assert_eq!(s.is_job_live(id), j.st == JSt::Live, "{id} liveness: {j:?}");
            assert_eq!(
                s.is_job_stalled(id),
                j.st == JSt::Stalled,
                "{id} stalled: {j:?}"
            );
            live += usize::from(j.st == JSt::Live);
            stalled += usize::from(j.st == JSt::Stalled);
        }
        let st = s.state();
        assert_eq!(st.jobs, live, "live jobs");
        assert_eq!(st.stalled_jobs, stalled, "stalled jobs");
        let tracked = self
            .reqs
            .iter()
            .filter(|r| !r.finalized || self.jobs_of(r.id) > 0)
            .count();
        assert_eq!(st.requests, tracked, "tracked requests");
        let pending = self.tier.values().filter(|c| c.pending).count() as u32;
        let pinned = self.tier.values().filter(|c| c.pins > 0).count() as u32;
        assert_eq!(st.manager.pending, pending, "pending chunks");
        assert_eq!(st.manager.pinned, pinned, "pinned chunks");
        assert_eq!(
            st.manager.cached,
            self.tier.len() as u32 - pending,
            "cached chunks"
        );
        assert_eq!(st.manager.free as u64, self.free_slots(), "free slots");
        let m = s.metrics();
        assert_eq!(m.jobs_created, self.next_job, "jobs created");
        assert_eq!(
            m.stalled_stores + m.stalled_loads,
            self.stall_count,
            "stalls"
        );
        let fence: usize = self
            .jobs
            .values()
            .filter(|j| j.st == JSt::Dropped && j.left > 0)
            .count();
        assert_eq!(s.reset_fence_len(), fence, "reset fence");
    }

    fn on_loads(&mut self, finished: &[RequestId], failed: &[RequestId]) {
        driver::on_loads(self.reqs.iter_mut().map(|m| &mut m.r), finished, failed);
    }

    /// A job ends (completed or released): its effect on the tier.
    fn end_job(&mut self, id: u64, success: bool) {
        let j = self.jobs[&id].clone();
        match (j.kind, j.st) {
            (Direction::Store, JSt::Completed) => {
                for k in &j.keys {
                    if success {
                        self.tier.insert(
                            *k,
                            TChunk {
                                pending: false,
                                pins: 0,
                            },
                        );
                    } else {
                        self.tier.remove(k);
                    }
                }
                self.events.push((!success, !success, j.keys.clone()));
            }
            (Direction::Load, JSt::Completed) => {
                for k in &j.keys {
                    self.tier.get_mut(k).expect("a pinned chunk").pins -= 1;
                }
            }
            (Direction::Store, JSt::Released) => {
                self.held
                    .retain(|h, _| !matches!(h, Hold::Store(s, _) if *s == id));
            }
            (Direction::Load, JSt::Released) if j.load_quarantined => {
                for holders in self.held.values_mut() {
                    holders.remove(&id);
                }
                self.held.retain(|_, h| !h.is_empty());
            }
            (Direction::Load, JSt::Released) => {
                for k in &j.keys {
                    self.tier.get_mut(k).expect("a pinned chunk").pins -= 1;
                }
            }
            _ => {}
        }
    }

    /// Delivers `n` reports for `job` (optionally failed) and checks the outcome
    /// against the model.
    fn report(&mut self, job: u64, n: u32, fail: bool) {
        let expect_ok = match self.jobs.get(&job) {
            Some(j) => match j.st {
                JSt::Live | JSt::Stalled => n <= j.left,
                JSt::Dropped => true,
                JSt::Completed | JSt::Released => job < self.threshold,
            },
            None => false,
        };
        let out = self.rec.on_worker_output(&CompletionReport {
            completed: vec![(JobId(job), n)],
            failed: if fail { vec![JobId(job)] } else { vec![] },
        });
        if !expect_ok {
            assert_eq!(out.rejected.len(), 1, "report {job}x{n} must be rejected");
            assert!(out.finished_loads.is_empty() && out.failed_loads.is_empty());
            self.check();
            return;
        }
        assert!(
            out.rejected.is_empty(),
            "report {job}x{n}: {:?}",
            out.rejected
        );
        let mut exp_finished = Vec::new();
        let mut exp_failed = Vec::new();
        let mut ended = None;
        if let Some(j) = self.jobs.get_mut(&job) {
            match j.st {
                JSt::Live => {
                    j.left -= n;
                    j.failed |= fail;
                    if j.left == 0 {
                        j.st = JSt::Completed;
                        j.completions += 1;
                        match (j.kind, j.failed) {
                            (Direction::Load, false) => exp_finished.push(j.req),
                            (Direction::Load, true) => exp_failed.push(j.req),
                            (Direction::Store, _) => {}
                        }
                        ended = Some(!j.failed);
                    }
                }
                JSt::Stalled => {
                    j.left -= n;
                    if j.left == 0 {
                        j.st = JSt::Released;
                        ended = Some(true);
                    }
                }
                JSt::Dropped => {
                    // A load dropped by a reset still ends for the backend: as a
                    // failed load if any worker reported a failure, before or
                    // after the reset.
                    let before = j.left;
                    j.left = j.left.saturating_sub(n);
                    j.failed |= fail;
                    if before > 0 && j.left == 0 && j.kind == Direction::Load {
                        if j.failed {
                            exp_failed.push(j.req);
                        } else {
                            exp_finished.push(j.req);
                        }
                    }
                }
                JSt::Completed | JSt::Released => {}
            }
        }
        if let Some(success) = ended {
            self.end_job(job, success);
        }
        assert_eq!(
            out.finished_loads, exp_finished,
            "finished loads of {job}x{n}"
        );
        assert_eq!(out.failed_loads, exp_failed, "failed loads of {job}x{n}");
        self.check();
        self.on_loads(&out.finished_loads, &out.failed_loads);
    }

    fn scan(&mut self) {
        let out = self.rec.scan();
        let mut exp = Vec::new();
        let mut exp_failed = BTreeSet::new();
        let ids: Vec<u64> = self.jobs.keys().copied().collect();
        for id in ids {
            let j = self.jobs.get_mut(&id).unwrap();
            if j.st == JSt::Live && self.now_ms - j.created_ms > STALL_MS {
                j.st = JSt::Stalled;
                j.stalls += 1;
                self.stall_count += 1;
                exp.push(JobId(id));
                match j.kind {
                    Direction::Load => {
                        exp_failed.insert(j.req);
                    }
                    Direction::Store => {
                        // Its keys leave the tier at once (never announced:
                        // a metadata-only removal); its slots stay held.
                        let keys = j.keys.clone();
                        for k in &keys {
                            self.tier.remove(k);
                            self.held.insert(Hold::Store(id, *k), BTreeSet::from([id]));
                        }
                        self.events.push((true, true, keys));
                    }
                }
            }
        }
        assert_eq!(out.stalled, exp, "scan at {} ms", self.now_ms);
        let exp_failed: Vec<RequestId> = exp_failed.into_iter().collect();
        assert_eq!(out.failed_loads, exp_failed, "failed loads of the scan");
        self.check();
        self.on_loads(&[], &out.failed_loads);
    }

    fn pick(&self, pick: u8, st: JSt) -> Option<u64> {
        let v: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| st == j.st && (st != JSt::Dropped || j.left > 0))
            .map(|(&id, _)| id)
            .collect();
        (!v.is_empty()).then(|| v[pick as usize % v.len()])
    }

    /// The answer the rules give to a lookup of request `i` with nothing
    /// computed (which also restarts it).
    fn predict_lookup(&mut self, i: usize) -> LookupOutcome {
        let tpc = self.tpc();
        let m = &mut self.reqs[i];
        m.sched_blocks.clear();
        m.next_stored = 0;
        if self.jobs_of(self.reqs[i].id) > 0 {
            return LookupOutcome::Defer;
        }
        let m = &self.reqs[i];
        let keys = m.keys(self.bpc);
        let max_hit = m.tokens.min(keys.len() as u64 * tpc);
        if max_hit < tpc {
            return LookupOutcome::Hit(0);
        }
        let mut hits = 0u64;
        let mut pending = false;
        for k in &keys[..(max_hit.div_ceil(tpc) as usize).min(keys.len())] {
            match self.tier.get(k) {
                Some(c) => {
                    hits += 1;
                    pending |= c.pending;
                }
                None => break,
            }
        }
        if pending {
            return LookupOutcome::Defer;
        }
        let hit = (hits * tpc).min(max_hit);
        if hit < tpc {
            return LookupOutcome::Hit(0);
        }
        if keys[..(hit / tpc) as usize]
            .iter()
            .any(|&k| self.being_loaded(k))
        {
            return LookupOutcome::Defer;
        }
        LookupOutcome::Hit(hit)
    }

    /// Predicts the store jobs of a step for `order` (scheduled requests,
    /// then finished ones: `(index, tokens after the step)`), checks the plan's
    /// stores against them, and takes the evictions from the tier's events.
    fn plan_stores(&mut self, order: &[(usize, u64)], plan_stores: &[TransferJob]) {
        let tpc = self.tpc();
        let bpc = self.bpc;
        // Evictions, one event per store that evicted, in planning order.
        let evictions: Vec<Ev> = self
            .rec
            .take_events()
            .into_iter()
            .map(|e| (e.removed, e.metadata_only, e.keys))
            .collect();
        let mut evictions = evictions.into_iter();
        let mut predicted: Vec<(u64, RequestId, Vec<ChunkKey>, Vec<GpuBlockId>)> = Vec::new();
        for &(i, tokens_after) in order {
            let m = &self.reqs[i];
            let mut offloadable = tokens_after.min(m.tokens);
            if self.prompt_only {
                offloadable = offloadable.min(m.prompt);
            }
            let keys = m.keys(bpc);
            let storable = (offloadable / tpc)
                .min(m.sched_blocks.len() as u64 / bpc)
                .min(keys.len() as u64);
            let start = m.next_stored;
            if storable <= start {
                self.reqs[i].next_stored = start.max(storable);
                continue;
            }
            let offered: Vec<ChunkKey> = keys[start as usize..storable as usize].to_vec();
            let to_store: Vec<ChunkKey> = offered
                .iter()
                .copied()
                .filter(|k| !self.tier.contains_key(k))
                .collect();
            let need = (to_store.len() as u64).saturating_sub(self.free_slots());
            if need > 0 {
                let idle = self
                    .tier
                    .iter()
                    .filter(|(k, c)| !c.pending && c.pins == 0 && !offered.contains(k))
                    .count() as u64;
                if idle < need {
                    // Refused: nothing stored, the request offers them again.
                    self.cov.refused_stores += 1;
                    continue;
                }
                self.cov.evicting_stores += 1;
                let (removed, meta, victims) = evictions
                    .next()
                    .unwrap_or_else(|| panic!("a store needing {need} evictions, none reported"));
                assert!(removed && !meta, "an eviction event: {victims:?}");
                assert_eq!(
                    victims.len() as u64,
                    need,
                    "evicted exactly what was needed"
                );
                for v in &victims {
                    let c = self
                        .tier
                        .remove(v)
                        .expect("an evicted chunk was in the tier");
                    assert!(
                        !c.pending && c.pins == 0 && !offered.contains(v),
                        "evicted {v:?} in state {c:?} (offered {offered:?})"
                    );
                }
            }
            if to_store.is_empty() {
                self.reqs[i].next_stored = storable;
                continue;
            }
            let mut blocks = Vec::new();
            for (c, k) in (start..storable).zip(&offered) {
                if to_store.contains(k) {
                    let at = (c * bpc) as usize;
                    blocks.extend_from_slice(&m.sched_blocks[at..at + bpc as usize]);
                }
            }
            for k in &to_store {
                self.tier.insert(
                    *k,
                    TChunk {
                        pending: true,
                        pins: 0,
                    },
                );
            }
            let req = RequestId(m.id);
            let finished = m.finish.is_some();
            let job = self.new_job(Direction::Store, req, to_store.clone());
            self.cov.stores += 1;
            self.cov.finished_stores += u64::from(finished);
            predicted.push((job, req, to_store, blocks));
            self.reqs[i].next_stored = storable;
        }
        assert!(evictions.next().is_none(), "an eviction no store needed");
        let got: Vec<(u64, RequestId, Vec<ChunkKey>, Vec<GpuBlockId>)> = plan_stores
            .iter()
            .map(|s| (s.job.0, s.req, s.keys.to_vec(), s.block_ids.to_vec()))
            .collect();
        assert_eq!(got, predicted, "the step's store jobs");
    }

    fn step(&mut self, preempt: Option<u8>, finish: Option<u8>, abort: bool) {
        let mut input = StepInput::default();
        let mut new_loads = Vec::new();
        for i in 0..self.reqs.len() {
            if self.reqs[i].st != ReqState::Waiting {
                continue;
            }
            let id = RequestId(self.reqs[i].id);
            let want = self.predict_lookup(i);
            let got = Hooks::lookup(&mut self.rec, id, 0);
            assert_eq!(got, want, "lookup of {id}");
            match got {
                LookupOutcome::Defer => self.cov.defers += 1,
                LookupOutcome::Hit(n) if n > 0 => self.cov.hits += 1,
                LookupOutcome::Hit(_) => {}
            }
            let LookupOutcome::Hit(n) = got else {
                continue;
            };
            let job = driver::admit(&mut self.rec, &mut self.reqs[i].r, &mut self.blocks, TPB, n);
            let blocks = self.reqs[i].blocks.clone();
            if n > 0 {
                // The load of the hit chunks, into the first blocks.
                let chunks = n / self.tpc();
                let keys = self.reqs[i].keys(self.bpc)[..chunks as usize].to_vec();
                for k in &keys {
                    self.tier.get_mut(k).expect("a hit is in the tier").pins += 1;
                }
                let j = self.new_job(Direction::Load, id, keys.clone());
                self.cov.loads += 1;
                assert_eq!(job, Some(JobId(j)), "the load of {id}");
                let to = (n / TPB) as usize;
                new_loads.push((j, id, blocks[..to].to_vec(), keys));
                // Loading, computed to the hit (`driver::admit`). Chunks
                // loaded are not offered again (vLLM's chunk-level policy).
                self.reqs[i].next_stored = chunks;
            } else {
                // Running from token 0 (`driver::admit`).
                assert_eq!(job, None, "no load for {id}");
            }
        }
        let running = driver::settled(&self.reqs);
        let mut skip = Vec::new();
        if let Some(i) = driver::pick(&running, preempt) {
            input.preempted.push(RequestId(self.reqs[i].id));
            driver::preempt(&mut self.reqs[i].r, &mut self.blocks);
            skip.push(i);
        }
        let mut finished_now = None;
        if let Some(i) = driver::pick(&running, finish).filter(|i| !skip.contains(i)) {
            let computed = self.reqs[i].computed;
            driver::finish(
                &mut self.rec,
                &mut self.reqs[i].r,
                &mut self.blocks,
                abort,
                &mut input,
            );
            self.reqs[i].finish = Some((abort, computed));
            skip.push(i);
            finished_now = Some(i);
        }
        let mut order = Vec::new();
        for i in 0..self.reqs.len() {
            if self.reqs[i].st != ReqState::Running || skip.contains(&i) {
                continue;
            }
            // Mid-step (after lookups and allocs): checked after the step.
            let entry = driver::schedule(&mut self.rec, &mut self.reqs[i].r, &mut self.blocks, TPB);
            let m = &mut self.reqs[i];
            if entry.full_table {
                m.sched_blocks.clear();
            }
            m.sched_blocks.extend_from_slice(&entry.new_block_ids);
            order.push((i, m.tokens));
            input.scheduled.push(entry);
        }
        if let Some(i) = finished_now {
            let m = &self.reqs[i];
            let after = match m.finish {
                Some((true, computed)) => computed,
                _ => m.prompt.max(m.tokens.saturating_sub(1)),
            };
            order.push((i, after));
        }
        let plan = self.rec.build_step(&input).expect("step");
        let loads: Vec<(u64, RequestId, Vec<GpuBlockId>, Vec<ChunkKey>)> = plan
            .loads
            .iter()
            .map(|l| (l.job.0, l.req, l.block_ids.to_vec(), l.keys.to_vec()))
            .collect();
        assert_eq!(loads, new_loads, "the step's loads");
        self.plan_stores(&order, &plan.stores);
        for &f in &plan.flush {
            assert!(self.jobs.contains_key(&f.0), "flush of unknown job {f}");
        }
        if let Some(i) = finished_now {
            self.reqs[i].finalized = true;
        }
        self.check();
        self.on_loads(&[], &plan.failed_loads);
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Add { family, prompt } => {
                let id = self.reqs.len() as u64;
                let prompt = u64::from(prompt);
                let r = MReq {
                    r: Req::new(id, u64::from(family), prompt, TPB),
                    sched_blocks: vec![],
                    next_stored: 0,
                    finish: None,
                    finalized: false,
                };
                self.rec
                    .add_request(RequestId(id), prompt, &r.prompt_hashes())
                    .expect("add");
                self.reqs.push(r);
                self.check();
            }
            Op::Step {
                preempt,
                finish,
                abort,
            } => self.step(preempt, finish, abort),
            Op::Report {
                pick,
                count,
                fail,
                split,
            } => {
                let Some(job) = self
                    .pick(pick, JSt::Live)
                    .or_else(|| self.pick(pick, JSt::Dropped))
                else {
                    return;
                };
                let n = u32::from(count).min(self.jobs[&job].left).max(1);
                if split {
                    for k in 0..n {
                        self.report(job, 1, fail && k == 0);
                    }
                } else {
                    self.report(job, n, fail);
                }
            }
            Op::Duplicate { pick } => {
                if let Some(job) = self
                    .pick(pick, JSt::Completed)
                    .or_else(|| self.pick(pick, JSt::Released))
                {
                    self.report(job, 1, false);
                }
            }
            Op::Unknown { ahead } => {
                let job = self.next_job + u64::from(ahead);
                self.report(job, 1, false);
            }
            Op::Late { pick } => {
                if let Some(job) = self.pick(pick, JSt::Stalled) {
                    self.report(job, 1, false);
                }
            }
            Op::Advance { ms } => {
                self.rec.advance_ms(u64::from(ms));
                self.now_ms += u64::from(ms);
            }
            Op::Jump => {
                self.rec.advance_ms(STALL_MS + 1);
                self.now_ms += STALL_MS + 1;
                self.scan();
            }
            Op::Scan => self.scan(),
            Op::Reset => self.reset(),
            Op::Cancel { pick } => {
                if let Some(job) = self.pick(pick, JSt::Stalled) {
                    self.rec
                        .confirm_cancelled(JobId(job))
                        .expect("cancel a stalled job");
                    self.jobs.get_mut(&job).unwrap().st = JSt::Released;
                    self.end_job(job, true);
                } else if let Some(job) = self.pick(pick, JSt::Live) {
                    let e = self.rec.confirm_cancelled(JobId(job));
                    assert!(
                        matches!(e, Err(SchedulerError::NotStalled(_))),
                        "cancel of a live job: {e:?}"
                    );
                }
                self.check();
            }
        }
    }

    /// A reset, as `docs/scheduler.md` ("Reset and quarantine") defines it.
    fn reset(&mut self) {
        self.rec.reset().expect("reset");
        self.resets += 1;
        self.threshold = self.next_job;
        // Stalled loads not yet quarantined, oldest first, turn the chunks
        // they pin into held slots: a chunk already held by an older one in
        // this reset is shared; one no longer in the tier is not held. A
        // stalled load left holding nothing is no longer tracked.
        let mut here: BTreeMap<ChunkKey, Hold> = BTreeMap::new();
        let stalled_loads: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| {
                j.st == JSt::Stalled && j.kind == Direction::Load && !j.load_quarantined
            })
            .map(|(&id, _)| id)
            .collect();
        for id in stalled_loads {
            let keys = self.jobs[&id].keys.clone();
            let mut fresh = Vec::new();
            let mut holds = BTreeSet::new();
            for k in keys {
                if let Some(h) = here.get(&k) {
                    holds.insert(*h);
                } else if self.tier.contains_key(&k) && !fresh.contains(&k) {
                    fresh.push(k);
                }
            }
            for k in &fresh {
                self.tier.remove(k);
                let h = Hold::Load(self.resets, *k);
                here.insert(*k, h);
                holds.insert(h);
            }
            if !fresh.is_empty() {
                self.events.push((true, false, fresh));
            }
            for h in &holds {
                self.held.entry(*h).or_default().insert(id);
            }
            let j = self.jobs.get_mut(&id).unwrap();
            j.load_quarantined = true;
            if holds.is_empty() {
                j.st = JSt::Released;
                self.cov.stalled_loads_untracked_at_reset += 1;
            } else {
                self.cov.stalled_loads_held_across_reset += 1;
            }
        }
        // The tier forgets everything else.
        self.tier.clear();
        for j in self.jobs.values_mut() {
            if j.st == JSt::Live {
                j.st = JSt::Dropped;
            }
        }
        for r in &mut self.reqs {
            r.next_stored = 0;
            if r.finish.is_some() {
                r.finalized = true;
            }
            if r.st == ReqState::Running {
                r.full = true;
            }
        }
        self.check();
    }

    /// Every outstanding report arrives, every request finishes: nothing is left.
    fn drain(&mut self) {
        let due: Vec<(u64, u32)> = self
            .jobs
            .iter()
            .filter(|(_, j)| matches!(j.st, JSt::Live | JSt::Stalled | JSt::Dropped) && j.left > 0)
            .map(|(&id, j)| (id, j.left))
            .collect();
        for (job, n) in due {
            self.report(job, n, false);
        }
        let live = driver::unfinished(&self.reqs);
        for &id in &live {
            self.rec
                .request_finished(RequestId(id), &[], true, 0)
                .expect("finish");
        }
        let input = StepInput {
            finished: live.iter().map(|&i| RequestId(i)).collect(),
            ..StepInput::default()
        };
        let plan = self.rec.build_step(&input).expect("final step");
        assert!(plan.stores.is_empty() && plan.loads.is_empty());
        for r in &mut self.reqs {
            r.finalized = true;
            r.st = ReqState::Done;
        }
        self.rec.state_line();
        self.check();
        driver::assert_drained(&self.rec.s);
        for (id, j) in &self.jobs {
            assert!(
                matches!(j.st, JSt::Completed | JSt::Released | JSt::Dropped),
                "job {id} did not end: {j:?}"
            );
            assert_eq!(
                j.completions + j.stalls,
                u32::from(j.st != JSt::Dropped),
                "job {id} ended once: {j:?}"
            );
        }
    }
}

/// Runs `ops`; on failure writes the trace (up to and including the failing
/// call) and fails with its path.
fn run(ops: Vec<Op>, setup: Setup) -> Cov {
    let mut w = World::new(setup);
    let res = catch_unwind(AssertUnwindSafe(|| {
        for op in ops {
            w.apply(op);
        }
        w.drain();
    }));
    if let Err(payload) = res {
        let msg = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        let trace = w.rec.trace();
        let name = format!("fail-{:016x}", fxhash(&trace));
        let path = w.rec.write("scheduler_model", &name);
        panic!(
            "{msg}\nreplayable trace: kvoffload replay {}",
            path.display()
        );
    }
    w.cov
}

fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn control_plane_matches_the_model(
        ops in proptest::collection::vec(op(), 1..100),
        world in 1u32..4,
        chunks in prop_oneof![Just(4u64), Just(16), Just(64)],
        prompt_only in any::<bool>(),
        bpc in 1u32..3,
    ) {
        run(
            ops,
            Setup {
                world,
                chunks,
                prompt_only,
                bpc,
            },
        );
    }
}

/// The generated cases reach what the model predicts (the property test's
/// generator, deterministically seeded): hits, deferred lookups, loads, store
/// jobs (of finished requests too), stores that evict and stores the tier
/// refuses, stalled loads held across a reset and ones a reset stops
/// tracking; with one and two blocks per chunk.
#[test]
fn generated_cases_reach_what_the_model_predicts() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    for bpc in [1u32, 2] {
        let mut runner = TestRunner::deterministic();
        let mut t = Cov::default();
        for case in 0..512u64 {
            let ops = proptest::collection::vec(op(), 1..100)
                .new_tree(&mut runner)
                .unwrap()
                .current();
            let chunks = [4u64, 16, 64][(case % 3) as usize];
            let c = run(
                ops,
                Setup {
                    world: 1 + (case % 3) as u32,
                    chunks,
                    prompt_only: case % 2 == 0,
                    bpc,
                },
            );
            t.hits += c.hits;
            t.defers += c.defers;
            t.loads += c.loads;
            t.stores += c.stores;
            t.evicting_stores += c.evicting_stores;
            t.refused_stores += c.refused_stores;
            t.stalled_loads_held_across_reset += c.stalled_loads_held_across_reset;
            t.stalled_loads_untracked_at_reset += c.stalled_loads_untracked_at_reset;
            t.finished_stores += c.finished_stores;
        }
        println!("blocks per chunk {bpc}: {t:?}");
        assert!(t.hits > 200 && t.defers > 50 && t.loads > 200, "{t:?}");
        assert!(t.stores > 500 && t.finished_stores > 0, "{t:?}");
        assert!(t.evicting_stores > 50 && t.refused_stores > 10, "{t:?}");
        assert!(t.stalled_loads_held_across_reset > 5, "{t:?}");
    }
}

/// The recorded trace of a run replays without a malformed line, one output
/// line per operation, and the replay's last `state` shows the drained engine.
#[test]
fn recorded_trace_replays() {
    use Op::*;
    let ops = vec![
        Add {
            family: 0,
            prompt: 9,
        },
        Step {
            preempt: None,
            finish: None,
            abort: false,
        },
        Report {
            pick: 0,
            count: 1,
            fail: false,
            split: true,
        },
        Add {
            family: 0,
            prompt: 9,
        },
        Step {
            preempt: None,
            finish: None,
            abort: false,
        },
        Jump,
        Late { pick: 0 },
        Duplicate { pick: 0 },
        Unknown { ahead: 2 },
        Reset,
        Report {
            pick: 0,
            count: 3,
            fail: false,
            split: false,
        },
        Step {
            preempt: None,
            finish: Some(0),
            abort: false,
        },
    ];
    let mut w = World::new(Setup {
        world: 2,
        chunks: 16,
        prompt_only: false,
        bpc: 2,
    });
    for op in ops {
        w.apply(op);
    }
    w.drain();
    let trace = w.rec.trace();
    let mut out = Vec::new();
    kvoffload::harness::replay::run(trace.as_bytes(), &mut out).expect("replayable");
    let out = String::from_utf8(out).unwrap();
    assert_eq!(out.lines().count(), w.rec.lines.len() - 1);
    let last: serde_json::Value = out
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .rfind(|v| v["op"] == "state")
        .expect("a state line");
    assert_eq!(last["jobs"], 0);
    assert_eq!(last["stalled_jobs"], 0);
    assert_eq!(last["has_pending_work"], false);
    assert!(
        w.rec.s.metrics().unknown_reports >= 1,
        "the unknown report was rejected"
    );
}
