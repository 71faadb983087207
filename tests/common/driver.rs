//! The tests' serving-backend driver: what a serving engine does around the
//! [`Scheduler`]'s hooks, shared by the model test (`scheduler_model.rs`), the
//! property test (`scheduler_prop.rs`) and the soak simulation
//! (`soak_sim/mod.rs`). It keeps each request's state and GPU blocks, admits
//! waiting requests (lookup, then allocation with the hit), builds the step's
//! entry of a running request (one decoded token, new blocks, the whole block
//! table after a reset, preemption or load), applies finished and failed
//! loads, and checks that a drained scheduler holds nothing.
//!
//! The scheduler is reached through [`Hooks`], so a test may call it directly
//! or record the calls (`trace_rec::Rec`). Binaries that do not use
//! `common/mod.rs` include this file alone (`#[path = "common/driver.rs"]`).
#![allow(dead_code)]

use kvoffload::scheduler::{LookupOutcome, ScheduledRequest, Scheduler, StepInput};
use kvoffload::{BlockHash, GpuBlockId, JobId, ManualClock, OffloadConfig, RequestId};

/// A scheduler for `cfg` (validated) on a manual clock.
pub fn scheduler_on_manual_clock(cfg: &OffloadConfig) -> (Scheduler, ManualClock) {
    cfg.validate().expect("valid test config");
    let clock = ManualClock::new();
    let s = Scheduler::new(cfg, clock.shared()).expect("scheduler");
    (s, clock)
}

/// The scheduler hooks the driver calls (each panics on an error).
pub trait Hooks {
    fn lookup(&mut self, req: RequestId, computed: u64) -> LookupOutcome;
    fn on_alloc(&mut self, req: RequestId, blocks: &[GpuBlockId], external: u64) -> Option<JobId>;
    fn update_request(&mut self, req: RequestId, tokens: u64, hashes: &[BlockHash]);
    /// `request_finished` for `r`, with its blocks and computed tokens.
    fn request_finished(&mut self, r: &Req, aborted: bool);
}

impl Hooks for Scheduler {
    fn lookup(&mut self, req: RequestId, computed: u64) -> LookupOutcome {
        Scheduler::lookup(self, req, computed).expect("lookup")
    }

    fn on_alloc(&mut self, req: RequestId, blocks: &[GpuBlockId], external: u64) -> Option<JobId> {
        Scheduler::on_alloc(self, req, blocks, external).expect("alloc")
    }

    fn update_request(&mut self, req: RequestId, tokens: u64, hashes: &[BlockHash]) {
        Scheduler::update_request(self, req, tokens, hashes).expect("update");
    }

    fn request_finished(&mut self, r: &Req, aborted: bool) {
        Scheduler::request_finished(self, r.rid(), &r.blocks, aborted, r.computed)
            .expect("request_finished");
    }
}

/// Where a request is in the serving engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReqState {
    /// Not admitted (new, or preempted): looked up at every step.
    Waiting,
    /// Admitted with a load in flight.
    Loading,
    /// Scheduled at every step.
    Running,
    /// Finished or aborted.
    Done,
}

/// A request as the serving engine sees it.
#[derive(Debug, Clone)]
pub struct Req {
    pub id: u64,
    /// Prefix family: requests of one family share their prompt's blocks.
    pub family: u64,
    pub prompt: u64,
    pub prompt_blocks: u64,
    /// Tokens as the scheduler knows them (prompt + generated).
    pub tokens: u64,
    pub computed: u64,
    pub st: ReqState,
    /// The scheduler's block list is empty: the next step carries the whole table.
    pub full: bool,
    /// GPU blocks the engine holds for it.
    pub blocks: Vec<GpuBlockId>,
}

impl Req {
    /// A waiting request of `prompt` tokens (`tpb` tokens per block).
    pub fn new(id: u64, family: u64, prompt: u64, tpb: u64) -> Self {
        Self {
            id,
            family,
            prompt,
            prompt_blocks: prompt / tpb,
            tokens: prompt,
            computed: 0,
            st: ReqState::Waiting,
            full: true,
            blocks: Vec::new(),
        }
    }

    pub fn rid(&self) -> RequestId {
        RequestId(self.id)
    }

    /// Hash of block `i`: prompt block i of family f is f*1000 + i + 1 (shared
    /// by the family); generated blocks are the request's own.
    pub fn hash(&self, i: u64) -> BlockHash {
        if i < self.prompt_blocks {
            BlockHash(self.family * 1000 + i + 1)
        } else {
            BlockHash((self.id + 1) * 1_000_000 + i)
        }
    }

    /// Hashes of the prompt's full blocks (what `add_request` is given).
    pub fn prompt_hashes(&self) -> Vec<BlockHash> {
        (0..self.prompt_blocks).map(|i| self.hash(i)).collect()
    }
}

impl AsRef<Req> for Req {
    fn as_ref(&self) -> &Req {
        self
    }
}

impl AsMut<Req> for Req {
    fn as_mut(&mut self) -> &mut Req {
        self
    }
}

/// The running requests past their first step (those a step may preempt or
/// finish), by index.
pub fn settled<R: AsRef<Req>>(reqs: &[R]) -> Vec<usize> {
    (0..reqs.len())
        .filter(|&i| {
            let r = reqs[i].as_ref();
            r.st == ReqState::Running && !r.full
        })
        .collect()
}

/// The index `pick` selects among `candidates` (modulo their number), if
/// there are any and a pick.
pub fn pick(candidates: &[usize], pick: Option<u8>) -> Option<usize> {
    pick.filter(|_| !candidates.is_empty())
        .map(|p| candidates[p as usize % candidates.len()])
}

/// The requests not finished, by id.
pub fn unfinished<R: AsRef<Req>>(reqs: &[R]) -> Vec<u64> {
    reqs.iter()
        .map(AsRef::as_ref)
        .filter(|r| r.st != ReqState::Done)
        .map(|r| r.id)
        .collect()
}

/// The GPU's block allocator: freed blocks are reused first (last freed,
/// first), then new ids from 1 up.
#[derive(Debug, Default)]
pub struct BlockPool {
    free: Vec<GpuBlockId>,
    next: u32,
    track_reuse: bool,
    reused: Vec<GpuBlockId>,
}

impl BlockPool {
    /// A pool that also lists the freed blocks it hands out again
    /// ([`BlockPool::take_reused`]).
    pub fn tracking_reuse() -> Self {
        Self {
            track_reuse: true,
            ..Self::default()
        }
    }

    pub fn take(&mut self) -> GpuBlockId {
        if let Some(b) = self.free.pop() {
            if self.track_reuse {
                self.reused.push(b);
            }
            return b;
        }
        self.next += 1;
        GpuBlockId(self.next)
    }

    pub fn take_n(&mut self, n: u64) -> Vec<GpuBlockId> {
        (0..n).map(|_| self.take()).collect()
    }

    pub fn release(&mut self, blocks: impl IntoIterator<Item = GpuBlockId>) {
        self.free.extend(blocks);
    }

    /// The freed blocks handed out again since the last call.
    pub fn take_reused(&mut self) -> Vec<GpuBlockId> {
        std::mem::take(&mut self.reused)
    }

    /// The highest block id handed out.
    pub fn highest(&self) -> u32 {
        self.next
    }
}

/// Admits `r` after its lookup hit `n` tokens: blocks for all its tokens
/// (and the next), `on_alloc` with the hit; `r` is loading if a load job
/// came back (computed: the hit), running otherwise (computed: 0). Returns
/// the load job.
pub fn admit(
    h: &mut impl Hooks,
    r: &mut Req,
    pool: &mut BlockPool,
    tpb: u64,
    n: u64,
) -> Option<JobId> {
    let blocks = pool.take_n(r.tokens / tpb + 1);
    let job = h.on_alloc(r.rid(), &blocks, n);
    r.blocks = blocks;
    r.full = true;
    if job.is_some() {
        r.st = ReqState::Loading;
        r.computed = n;
    } else {
        r.st = ReqState::Running;
        r.computed = 0;
    }
    job
}

/// The step's entry of running request `r`: what is left of its prefill, or
/// one decoded token (hashing a block it fills), with the blocks it needs
/// (its whole table if the scheduler's list is empty). Afterwards `r` is
/// computed to its tokens.
pub fn schedule(
    h: &mut impl Hooks,
    r: &mut Req,
    pool: &mut BlockPool,
    tpb: u64,
) -> ScheduledRequest {
    let (computed, full) = (r.computed, r.full);
    if computed >= r.tokens {
        r.tokens += 1;
        let hashes: Vec<BlockHash> = if r.tokens.is_multiple_of(tpb) {
            vec![r.hash(r.tokens / tpb - 1)]
        } else {
            vec![]
        };
        h.update_request(r.rid(), r.tokens, &hashes);
    }
    let mut new_blocks = Vec::new();
    while (r.blocks.len() as u64) * tpb <= r.tokens {
        let b = pool.take();
        r.blocks.push(b);
        new_blocks.push(b);
    }
    let entry = ScheduledRequest {
        req: r.rid(),
        new_block_ids: if full { r.blocks.clone() } else { new_blocks },
        computed_tokens: computed,
        scheduled_tokens: r.tokens - computed,
        full_table: full,
    };
    r.computed = r.tokens;
    r.full = false;
    entry
}

/// `r` finishes in this step (`aborted` or not): `request_finished` with its
/// blocks and computed tokens, listed in `input.finished`, done, its blocks
/// freed.
pub fn finish(
    h: &mut impl Hooks,
    r: &mut Req,
    pool: &mut BlockPool,
    aborted: bool,
    input: &mut StepInput,
) {
    h.request_finished(r, aborted);
    input.finished.push(r.rid());
    r.st = ReqState::Done;
    pool.release(std::mem::take(&mut r.blocks));
}

/// `r` is preempted: back to waiting, nothing computed, its blocks freed.
pub fn preempt(r: &mut Req, pool: &mut BlockPool) {
    r.st = ReqState::Waiting;
    r.computed = 0;
    pool.release(std::mem::take(&mut r.blocks));
}

/// Loads ended: a loading request runs (a failed one recomputes from 0); both
/// send their whole table at the next step.
pub fn on_loads<'a>(
    reqs: impl IntoIterator<Item = &'a mut Req>,
    finished: &[RequestId],
    failed: &[RequestId],
) {
    for r in reqs {
        if r.st != ReqState::Loading {
            continue;
        }
        if failed.contains(&r.rid()) {
            r.st = ReqState::Running;
            r.computed = 0;
            r.full = true;
        } else if finished.contains(&r.rid()) {
            r.st = ReqState::Running;
            r.full = true;
        }
    }
}

/// After a drain (every report in, every request finished, an empty step):
/// no job, request, load, fence, stall, quarantine, pending or pinned chunk,
/// reset fence or pending work is left.
pub fn assert_drained(s: &Scheduler) {
    let st = s.state();
    assert_eq!(
        (
            st.jobs,
            st.requests,
            st.chunks_being_loaded,
            st.fenced_blocks,
            st.stalled_jobs,
            st.quarantined_chunks
        ),
        (0, 0, 0, 0, 0, 0),
        "leak after drain: {st:?}"
    );
    assert_eq!(
        st.manager.pending + st.manager.pinned + st.manager.quarantined,
        0,
        "leak: {st:?}"
    );
    assert_eq!(s.reset_fence_len(), 0, "reset fence left");
    assert!(!s.has_pending_work(), "pending work left");
}
