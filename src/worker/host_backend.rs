//! The host backend: real memcpy gather/scatter between host buffers standing in
//! for the GPU cache and the host pool, one copy thread per direction.
//!
//! Jobs go to the direction's thread over a channel; the thread copies the
//! descriptor table and publishes the completion with one atomic store into the
//! job (like a CUDA event). `poll` reads those flags from the head of each
//! direction's queue only, so results come out FIFO per direction. Threads spin
//! briefly before blocking so back-to-back jobs do not pay a wake-up each.
//!
//! A job is claimed (one atomic compare-exchange) by whoever copies it: its copy
//! thread, or `wait` itself when the job is not claimed yet (the flush path then
//! skips the hand-off; [`HostBackendOptions::help_in_wait`]). Either way the jobs
//! of one direction are copied one at a time, in submission order.
//!
//! Where the host pool was placed on a NUMA node
//! ([`HostBackendOptions::home`]), the copy threads run on that node's CPUs:
//! the pool's side of every copy is then local memory.
//!
//! It is the default backend where no GPU is present and the reference every
//! GPU result is checked against. It has no fault injection of its own: wrap it
//! in a [`FaultInjector`](super::FaultInjector) to delay, stall or fail jobs.

use crate::Direction;
use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

use crate::ids::{ChunkId, JobId};
use crate::profiling::{self, InFlightRange, JobPhase};

use super::backend::{HostShare, TransferBackend, TransferResult};
use super::descriptors::{CopyDesc, DescriptorTable, plan};
use super::error::{BackendError, LayoutError};
use super::host_buffer::HostBuffer;
use super::layout::{TransferSpec, WorkerLayout};
use super::numa::{NodeBoundThread, NodeCpus};

/// Completion checks `wait` makes (spinning, yielding every 64) before it parks.
const WAIT_SPINS: u32 = 1 << 14;

const PENDING: u8 = 0;
const DONE: u8 = 1;
/// Claimed by a copy thread or by a waiter, copy under way.
const RUNNING: u8 = 2;

fn finished(state: u8) -> bool {
    state == DONE
}

/// Tuning of the host backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostBackendOptions {
    /// Empty-queue checks a copy thread makes before it blocks (0: block at once).
    pub spin_checks: u32,
    /// `wait` copies the jobs it waits for itself when their copy thread has not
    /// claimed them yet (in FIFO order, never past a job that is being copied):
    /// the flush path then does not pay a thread hand-off.
    pub help_in_wait: bool,
    /// The NUMA node the host pool was placed on, with its CPUs
    /// ([`PoolPlacement::home`](super::numa::PoolPlacement::home)): the copy
    /// threads run there. `None`: wherever the scheduler runs them.
    pub home: Option<NodeCpus>,
}

impl Default for HostBackendOptions {
    fn default() -> Self {
        Self {
            spin_checks: 4096,
            help_in_wait: true,
            home: None,
        }
    }
}

/// What a copy thread tells the backend when it starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CopyThreadStart {
    /// Its kernel thread id.
    tid: i32,
    /// The home node's CPUs it runs on (0: not bound to the node).
    pinned_cpus: usize,
}

/// One submitted job, shared with its copy thread.
#[derive(Debug)]
struct HostJob {
    id: JobId,
    descs: Vec<CopyDesc>,
    bytes: u64,
    state: AtomicU8,
    nanos: AtomicU64,
}

/// A job waiting in its direction's FIFO.
#[derive(Debug)]
struct Pending {
    job: Arc<HostJob>,
    range: InFlightRange,
}

/// Lets a copy thread wake the thread blocked in `wait`.
#[derive(Debug, Default)]
struct WakeHook {
    armed: AtomicBool,
    waiter: Mutex<Option<Thread>>,
}

impl WakeHook {
    fn notify(&self) {
        if self.armed.load(Ordering::SeqCst)
            && let Ok(w) = self.waiter.lock()
            && let Some(t) = w.as_ref()
        {
            t.unpark();
        }
    }
}

/// The host memcpy backend. See the module docs.
#[derive(Debug)]
pub struct HostBackend {
    layout: WorkerLayout,
    _memory: Vec<Arc<HostBuffer>>,
    senders: [Option<Sender<Arc<HostJob>>>; 2],
    threads: [Option<JoinHandle<()>>; 2],
    started: [Option<CopyThreadStart>; 2],
    queues: [VecDeque<Pending>; 2],
    ids: HashSet<JobId>,
    table: DescriptorTable,
    wake: Arc<WakeHook>,
    help_in_wait: bool,
}

impl HostBackend {
    /// A backend over `layout`, whose GPU regions and host pool must lie inside
    /// `memory` (checked); the buffers are kept alive by the backend.
    pub fn new(
        layout: WorkerLayout,
        memory: Vec<Arc<HostBuffer>>,
        options: HostBackendOptions,
    ) -> Result<Self, LayoutError> {
        let inside = |what: String, (start, end): (u64, u64)| {
            if memory.iter().any(|b| b.contains(start, end)) {
                Ok(())
            } else {
                Err(LayoutError::OutsideBuffers { what, start, end })
            }
        };
        for i in 0..layout.gpu().regions().len() {
            let range = layout
                .gpu()
                .region_range(i)
                .ok_or(LayoutError::Overflow("GPU region end"))?;
            inside(format!("GPU region {i}"), range)?;
        }
        let pool = layout.host_range();
        inside("host pool".to_string(), pool)?;
        for i in 0..layout.gpu().regions().len() {
            if let Some((start, end)) = layout.gpu().region_range(i)
                && start < pool.1
                && pool.0 < end
            {
                return Err(LayoutError::PoolOverlapsGpu { region: i });
            }
        }
        // SAFETY: every address the layout can produce lies inside `memory`
        // (checked above), which the backend keeps alive until its threads end.
        Ok(unsafe { Self::build(layout, memory, options) })
    }

    /// A backend over memory owned elsewhere (for example a simulation's arena).
    ///
    /// # Safety
    /// Every GPU region and the host pool of `layout` must be valid for reads and
    /// writes for the lifetime of the backend, and nothing else may access bytes
    /// of an in-flight job.
    pub unsafe fn from_raw(layout: WorkerLayout, options: HostBackendOptions) -> Self {
        // SAFETY: forwarded caller contract.
        unsafe { Self::build(layout, Vec::new(), options) }
    }

    /// # Safety
    /// As [`HostBackend::from_raw`].
    unsafe fn build(
        layout: WorkerLayout,
        memory: Vec<Arc<HostBuffer>>,
        options: HostBackendOptions,
    ) -> Self {
        let wake = Arc::new(WakeHook::default());
        let mut senders = [None, None];
        let mut threads = [None, None];
        let mut started = [None, None];
        for dir in Direction::ALL {
            let (tx, rx) = mpsc::channel();
            let (start_tx, start_rx) = mpsc::channel();
            let hook = wake.clone();
            let spin = options.spin_checks;
            let home = options.home.clone();
            let handle = thread::Builder::new()
                .name(format!("kvoffload-host-{dir}"))
                .spawn(move || {
                    let bound = home.as_ref().and_then(|h| bind_copy_thread(dir, h));
                    let _ = start_tx.send(CopyThreadStart {
                        // SAFETY: gettid has no preconditions.
                        tid: unsafe { libc::gettid() },
                        pinned_cpus: bound.as_ref().map_or(0, NodeBoundThread::pinned_cpus),
                    });
                    copy_thread(rx, hook, spin);
                    drop(bound);
                });
            match handle {
                Ok(h) => {
                    senders[dir.index()] = Some(tx);
                    threads[dir.index()] = Some(h);
                    started[dir.index()] = start_rx.recv().ok();
                }
                Err(e) => tracing::error!(%dir, error = %e, "cannot spawn a host copy thread"),
            }
        }
        if let Some(home) = &options.home {
            let pinned = started
                .iter()
                .flatten()
                .filter(|s| s.pinned_cpus > 0)
                .count();
            tracing::debug!(node = %home.node, pinned, "host copy threads on the pool's node");
        }
        Self {
            layout,
            _memory: memory,
            senders,
            threads,
            started,
            queues: [VecDeque::new(), VecDeque::new()],
            ids: HashSet::new(),
            table: DescriptorTable::default(),
            wake,
            help_in_wait: options.help_in_wait,
        }
    }

    /// The layout this backend copies with.
    pub fn layout(&self) -> &WorkerLayout {
        &self.layout
    }

    /// Copy threads running on the home node's CPUs
    /// ([`HostBackendOptions::home`]): 2 where the pool was placed and the
    /// threads could be bound there, 0 otherwise.
    pub fn copy_threads_on_home_node(&self) -> usize {
        self.started
            .iter()
            .flatten()
            .filter(|s| s.pinned_cpus > 0)
            .count()
    }

    fn send(&self, dir: Direction, job: Arc<HostJob>) -> Result<(), BackendError> {
        self.senders[dir.index()]
            .as_ref()
            .ok_or(BackendError::WorkerGone(dir))?
            .send(job)
            .map_err(|_| BackendError::WorkerGone(dir))
    }

    fn submit(
        &mut self,
        dir: Direction,
        job: JobId,
        spec: &TransferSpec,
    ) -> Result<(), BackendError> {
        if self.ids.contains(&job) {
            return Err(BackendError::DuplicateJob(job));
        }
        {
            let _plan = profiling::phase(JobPhase::Plan, dir, job, 0);
            plan(&self.layout, dir, spec, &mut self.table)?;
        }
        let bytes = self.table.bytes;
        let _submit = profiling::phase(JobPhase::Submit, dir, job, bytes);
        let descs = std::mem::take(&mut self.table.descs);
        let host_job = Arc::new(HostJob {
            id: job,
            descs,
            bytes,
            state: AtomicU8::new(PENDING),
            nanos: AtomicU64::new(0),
        });
        let range = profiling::in_flight(dir, job, bytes);
        self.send(dir, host_job.clone())?;
        self.ids.insert(job);
        self.queues[dir.index()].push_back(Pending {
            job: host_job,
            range,
        });
        Ok(())
    }

    /// Copies, on the calling thread, the not-yet-claimed jobs of each direction
    /// up to the last of `jobs`, in FIFO order, stopping at a job being copied.
    fn help(&self, jobs: &[JobId]) {
        for queue in &self.queues {
            let Some(last) = queue.iter().rposition(|p| jobs.contains(&p.job.id)) else {
                continue;
            };
            for p in queue.iter().take(last + 1) {
                let state = p.job.state.load(Ordering::Acquire);
                if finished(state) {
                    continue;
                }
                if state == RUNNING || !claim(&p.job) {
                    break;
                }
                run_claimed(&p.job);
            }
        }
    }

    fn find(&self, job: JobId) -> Option<&Arc<HostJob>> {
        self.queues
            .iter()
            .flat_map(|q| q.iter())
            .map(|p| &p.job)
            .find(|j| j.id == job)
    }
}

impl TransferBackend for HostBackend {
    fn submit_store(&mut self, job: JobId, spec: &TransferSpec) -> Result<(), BackendError> {
        self.submit(Direction::Store, job, spec)
    }

    fn submit_load(&mut self, job: JobId, spec: &TransferSpec) -> Result<(), BackendError> {
        self.submit(Direction::Load, job, spec)
    }

    fn poll(&mut self, out: &mut Vec<TransferResult>) {
        for dir in Direction::ALL {
            let queue = &mut self.queues[dir.index()];
            while let Some(front) = queue.front() {
                if !finished(front.job.state.load(Ordering::Acquire)) {
                    break;
                }
                let Some(p) = queue.pop_front() else { break };
                let _complete = profiling::phase(JobPhase::Complete, dir, p.job.id, p.job.bytes);
                p.range.end();
                self.ids.remove(&p.job.id);
                out.push(TransferResult {
                    job: p.job.id,
                    direction: dir,
                    success: true,
                    bytes: p.job.bytes,
                    duration: Duration::from_nanos(p.job.nanos.load(Ordering::Relaxed)),
                });
            }
        }
    }

    fn wait(&mut self, jobs: &[JobId], timeout: Option<Duration>) -> Result<(), BackendError> {
        let targets: Vec<Arc<HostJob>> =
            jobs.iter().filter_map(|&j| self.find(j).cloned()).collect();
        let deadline = timeout.map(|t| Instant::now() + t);
        let done = |t: &[Arc<HostJob>]| t.iter().all(|j| finished(j.state.load(Ordering::SeqCst)));
        if let Ok(mut w) = self.wake.waiter.lock() {
            *w = Some(thread::current());
        }
        let mut spins = 0u32;
        let result = loop {
            if done(&targets) {
                break Ok(());
            }
            if self.help_in_wait {
                self.help(jobs);
                if done(&targets) {
                    break Ok(());
                }
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                break Err(BackendError::WaitTimedOut {
                    pending: targets
                        .iter()
                        .filter(|j| !finished(j.state.load(Ordering::SeqCst)))
                        .map(|j| j.id)
                        .collect(),
                });
            }
            // Spin, then yield (cheap while the copy runs on another core), then park.
            if spins < WAIT_SPINS {
                spins += 1;
                if spins.is_multiple_of(64) {
                    thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            self.wake.armed.store(true, Ordering::SeqCst);
            if done(&targets) {
                break Ok(());
            }
            let nap = Duration::from_millis(1);
            let nap = deadline.map_or(nap, |d| nap.min(d.saturating_duration_since(now)));
            thread::park_timeout(nap);
        };
        self.wake.armed.store(false, Ordering::SeqCst);
        result
    }

    fn in_flight(&self) -> usize {
        self.ids.len()
    }

    fn check_spec(&self, spec: &TransferSpec) -> Result<(), BackendError> {
        Ok(self.layout.validate(spec)?)
    }

    fn host_share(&self, chunk: ChunkId) -> Option<HostShare> {
        self.layout.host_share(chunk)
    }

    fn blocks_per_chunk(&self) -> Option<u32> {
        Some(self.layout.row().blocks_per_chunk())
    }
}

impl Drop for HostBackend {
    fn drop(&mut self) {
        for s in &mut self.senders {
            s.take();
        }
        for t in &mut self.threads {
            if let Some(h) = t.take()
                && h.join().is_err()
            {
                tracing::error!("a host copy thread panicked");
            }
        }
    }
}

/// Binds the calling copy thread to the pool's node; `None` (logged) where
/// the system refuses.
fn bind_copy_thread(dir: Direction, home: &NodeCpus) -> Option<NodeBoundThread> {
    match NodeBoundThread::enter(home.node, &home.cpus) {
        Ok(b) => Some(b),
        Err(e) => {
            tracing::warn!(%dir, node = %home.node, error = %e,
                "cannot run a host copy thread on the pool's node: it runs anywhere");
            None
        }
    }
}

/// Receives the next job, spinning `spin` checks before blocking; None when the
/// backend is gone.
fn next_job(rx: &Receiver<Arc<HostJob>>, spin: u32) -> Option<Arc<HostJob>> {
    for i in 0..spin {
        match rx.try_recv() {
            Ok(j) => return Some(j),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) => {
                if i % 64 == 63 {
                    thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }
    rx.recv().ok()
}

/// Claims a pending job for the calling thread; false if someone else has it.
fn claim(job: &HostJob) -> bool {
    job.state
        .compare_exchange(PENDING, RUNNING, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
}

/// Copies a job claimed by the calling thread and publishes its completion.
fn run_claimed(job: &HostJob) {
    let start = Instant::now();
    for d in &job.descs {
        // SAFETY: the descriptors were built from a validated spec over a
        // layout whose memory is valid for the backend's lifetime (checked in
        // `HostBackend::new`, promised in `from_raw`); nothing else touches an
        // in-flight job's bytes, and the claim makes this thread the only one
        // copying this job. Source (GPU stand-in or pool) and destination (the
        // other one) never overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(d.src as *const u8, d.dst as *mut u8, d.bytes as usize)
        };
    }
    let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    job.nanos.store(nanos, Ordering::Relaxed);
    job.state.store(DONE, Ordering::SeqCst);
}

fn copy_thread(rx: Receiver<Arc<HostJob>>, wake: Arc<WakeHook>, spin: u32) {
    let mut prev: Option<Arc<HostJob>> = None;
    while let Some(job) = next_job(&rx, spin) {
        // Copies of one direction never overlap in time and run in submission
        // order: if a waiter claimed the previous job, let it finish first.
        if let Some(p) = prev.take() {
            wait_finished(&p);
        }
        // A waiter may have claimed this one too (`help_in_wait`).
        if claim(&job) {
            run_claimed(&job);
            wake.notify();
        }
        prev = Some(job);
    }
}

/// Spins (yielding) until a job claimed by another thread is finished; that
/// thread is copying it right now, so this is short.
fn wait_finished(job: &HostJob) {
    let mut i = 0u32;
    while !finished(job.state.load(Ordering::Acquire)) {
        i = i.wrapping_add(1);
        if i.is_multiple_of(64) {
            thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::numa::{NumaNode, SysfsTopology};
    use crate::worker::{GpuLayout, HostRowLayout};

    const PAGE: u64 = 64;

    fn backend(home: Option<NodeCpus>) -> (HostBackend, Arc<HostBuffer>, Arc<HostBuffer>) {
        let gpu = Arc::new(HostBuffer::new(16 * PAGE as usize).unwrap());
        let row = HostRowLayout::uniform(1, 1, &[PAGE]).unwrap();
        let pool = Arc::new(HostBuffer::new(row.pool_bytes(8).unwrap() as usize).unwrap());
        let layout = WorkerLayout::new(
            GpuLayout::cross_layer(gpu.addr(), 16, PAGE, PAGE).unwrap(),
            row,
            0,
            pool.addr(),
            8,
        )
        .unwrap();
        let options = HostBackendOptions {
            home,
            ..HostBackendOptions::default()
        };
        let b = HostBackend::new(layout, vec![gpu.clone(), pool.clone()], options).unwrap();
        (b, gpu, pool)
    }

    /// A store of block 1 into chunk 2 and a load of it back into block 3.
    fn round_trip(b: &mut HostBackend, gpu: &HostBuffer) {
        // SAFETY: no job is in flight.
        unsafe { gpu.write(PAGE as usize, &[9u8; PAGE as usize]) };
        b.submit_store(JobId(1), &TransferSpec::new(&[1], 0, &[2]))
            .unwrap();
        b.wait(&[JobId(1)], Some(Duration::from_secs(30))).unwrap();
        b.submit_load(JobId(2), &TransferSpec::new(&[3], 0, &[2]))
            .unwrap();
        b.wait(&[JobId(2)], Some(Duration::from_secs(30))).unwrap();
        let mut out = Vec::new();
        b.poll(&mut out);
        assert!(out.iter().all(|r| r.success) && out.len() == 2, "{out:?}");
        // SAFETY: both jobs completed.
        let back = unsafe { gpu.read(3 * PAGE as usize, PAGE as usize) };
        assert_eq!(back, vec![9u8; PAGE as usize]);
    }

    /// The CPUs the kernel lets thread `tid` of this process run on.
    fn cpus_allowed(tid: i32) -> Vec<usize> {
        let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
        let line = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap();
        crate::worker::numa::parse_list(line.trim())
            .unwrap()
            .into_iter()
            .map(|c| c as usize)
            .collect()
    }

    #[test]
    fn copy_threads_run_on_the_home_node_s_cpus_and_copy() {
        let topo = SysfsTopology::system();
        let node = topo.online_nodes().unwrap()[0];
        // One CPU of the node, so that the binding is visible on a machine
        // whose process may run on all of them.
        let cpu = topo.node_cpus(node).unwrap()[0];
        let (mut b, gpu, _pool) = backend(Some(NodeCpus {
            node,
            cpus: vec![cpu],
        }));
        assert_eq!(b.copy_threads_on_home_node(), 2);
        for s in b.started.iter().flatten() {
            assert_eq!(s.pinned_cpus, 1);
            assert_eq!(cpus_allowed(s.tid), vec![cpu], "thread {}", s.tid);
        }
        round_trip(&mut b, &gpu);
    }

    #[test]
    fn without_a_home_the_copy_threads_keep_the_process_s_cpus() {
        // SAFETY: gettid has no preconditions.
        let mine = cpus_allowed(unsafe { libc::gettid() });
        let (mut b, gpu, _pool) = backend(None);
        assert_eq!(b.copy_threads_on_home_node(), 0);
        for s in b.started.iter().flatten() {
            assert_eq!(cpus_allowed(s.tid), mine);
        }
        round_trip(&mut b, &gpu);
    }

    #[test]
    fn a_home_the_system_refuses_leaves_the_threads_unbound_and_copying() {
        // No machine has node 1023 online: set_mempolicy refuses it.
        let (mut b, gpu, _pool) = backend(Some(NodeCpus {
            node: NumaNode(1023),
            cpus: vec![0],
        }));
        assert_eq!(b.copy_threads_on_home_node(), 0);
        round_trip(&mut b, &gpu);
    }
}
