//! The CUDA transfer backend: a stream per direction, stores (and loads) ordered
//! after an event of the caller's compute stream, one of four copy strategies per
//! job, completion by event query from the head of each direction's queue.

use crate::Direction;
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys};

use crate::ids::JobId;
use crate::profiling::{self, InFlightRange, JobPhase};
use crate::worker::descriptors::{CopyDesc, DescriptorTable, plan};
use crate::worker::{BackendError, TransferBackend, TransferResult, TransferSpec, WorkerLayout};

use super::context::guarded;
use super::dma::{self, BatchCopy};
use super::error::{CudaError, driver};
use super::kernel::{CopyKernels, LaunchShape, TableRing, kernel_pieces, table_bytes};
use super::shared_table::SharedStrategyTable;
use super::strategy::{Strategy, StrategyTable};

/// Options of the CUDA backend.
#[derive(Debug, Clone)]
pub struct CudaBackendOptions {
    /// Kernel grid: the SM budget.
    pub shape: LaunchShape,
    /// Descriptor capacities of the persistent tables (one graph per capacity).
    pub capacities: Vec<usize>,
    /// Tables per capacity and direction (a ring; staging is reused round-robin).
    pub ring_slots: usize,
    /// Kernel descriptors are split into pieces of at most this many bytes
    /// (fewer where a job needs more pieces to keep every warp busy:
    /// `kernel::piece_bytes`).
    pub kernel_split_bytes: u64,
    /// The strategy table, read on every submit; shared with other backends
    /// (a pool's workers) and replaceable while they run
    /// ([`SharedStrategyTable::replace`]).
    pub strategies: Arc<SharedStrategyTable>,
    /// Batched copies ask the driver to overlap with compute
    /// (`CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`); off by default until
    /// measured on a GPU (docs/dataplane.md).
    pub batch_prefer_overlap: bool,
}

impl Default for CudaBackendOptions {
    fn default() -> Self {
        Self {
            shape: LaunchShape::default(),
            capacities: vec![64, 256, 1024, 4096, 16384, 65536],
            ring_slots: 4,
            kernel_split_bytes: 64 << 10,
            strategies: Arc::new(SharedStrategyTable::new(StrategyTable::default())),
            batch_prefer_overlap: false,
        }
    }
}

/// Counters of what the backend did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CudaBackendStats {
    /// Jobs per strategy actually used (`Strategy::ALL` order).
    pub jobs_by_strategy: [u64; 4],
    /// Graphs captured.
    pub graphs_captured: u64,
    /// Times a table refill had to wait for the device (host sync).
    pub staging_waits: u64,
    /// Jobs that fell back to per-run DMA (no batch call, no kernels, table too big).
    pub fallbacks: u64,
    /// Bytes of descriptor tables copied to the device by kernel jobs (a
    /// graph replay copies only its live entries where the driver lets the
    /// exec's copy node be narrowed).
    pub table_bytes_copied: u64,
}

#[derive(Debug)]
struct InFlight {
    job: JobId,
    start: CudaEvent,
    end: CudaEvent,
    bytes: u64,
    range: InFlightRange,
    /// Queueing failed part way: reported failed when `end` completes.
    failed: bool,
}

/// The CUDA backend. See the module docs.
#[derive(Debug)]
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    layout: WorkerLayout,
    compute: Arc<CudaStream>,
    compute_event: CudaEvent,
    streams: [Arc<CudaStream>; 2],
    // Fields drop in declaration order: the rings' graph execs launch the
    // kernels' functions, so they go before the module is unloaded.
    rings: Vec<TableRing>,
    kernels: Option<CopyKernels>,
    batch: BatchCopy,
    queues: [VecDeque<InFlight>; 2],
    ids: HashSet<JobId>,
    events: Vec<CudaEvent>,
    table: DescriptorTable,
    split: Vec<CopyDesc>,
    options: CudaBackendOptions,
    forced: Option<Strategy>,
    stats: CudaBackendStats,
    /// The event timing call failed once (warned once, durations read 0).
    elapsed_warned: bool,
}

impl CudaBackend {
    /// A backend copying with `layout` (GPU addresses: device memory of `ctx`;
    /// host pool: pinned, mapped memory), ordered after `compute`.
    ///
    /// # Safety
    /// The layout's GPU regions and host pool must stay valid (and the pool
    /// pinned and mapped) for the lifetime of the backend, and nothing may rewrite
    /// the bytes of an in-flight job other than through the ordering given by
    /// `compute`.
    pub unsafe fn new(
        ctx: Arc<CudaContext>,
        layout: WorkerLayout,
        compute: Arc<CudaStream>,
        options: CudaBackendOptions,
    ) -> Result<Self, CudaError> {
        guarded("CudaBackend::new", || {
            ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
            // SAFETY: the backend synchronises through its own events, never through
            // cudarc's per-slice tracking, and graph capture requires it off.
            unsafe { ctx.disable_event_tracking() };
            let kernels = match CopyKernels::load(&ctx) {
                Ok(k) => Some(k),
                Err(CudaError::KernelsNotBuilt) => {
                    tracing::warn!("kernels not built: kernel strategies fall back to DMA");
                    None
                }
                Err(e) => return Err(e),
            };
            let streams = [
                ctx.new_stream().map_err(driver("cuStreamCreate"))?,
                ctx.new_stream().map_err(driver("cuStreamCreate"))?,
            ];
            let mut rings = if kernels.is_some() {
                vec![
                    TableRing::new(&ctx, &options.capacities, options.ring_slots)?,
                    TableRing::new(&ctx, &options.capacities, options.ring_slots)?,
                ]
            } else {
                Vec::new()
            };
            // Every graph is captured now, not on the submit path (a capture
            // and its upload take far longer than a replay).
            let mut graphs_captured = 0;
            if let Some(k) = &kernels {
                for dir in Direction::ALL {
                    if let Some(ring) = rings.get_mut(dir.index()) {
                        graphs_captured += ring.capture_all(
                            &streams[dir.index()],
                            k.table_function(dir),
                            options.shape,
                        )?;
                    }
                }
            }
            Ok(Self {
                compute_event: ctx.new_event(None).map_err(driver("cuEventCreate"))?,
                batch: {
                    let mut b = BatchCopy::resolve();
                    b.set_prefer_overlap(options.batch_prefer_overlap);
                    b
                },
                ctx: ctx.clone(),
                layout,
                compute,
                streams,
                kernels,
                rings,
                queues: [VecDeque::new(), VecDeque::new()],
                ids: HashSet::new(),
                events: Vec::new(),
                table: DescriptorTable::default(),
                split: Vec::new(),
                options,
                forced: None,
                stats: CudaBackendStats {
                    graphs_captured,
                    ..CudaBackendStats::default()
                },
                elapsed_warned: false,
            })
        })
    }

    /// Forces one strategy for every job (None: use the table). For tests and sweeps.
    pub fn force_strategy(&mut self, strategy: Option<Strategy>) {
        self.forced = strategy;
    }

    /// Whether the driver has `cuMemcpyBatchAsync`.
    pub fn has_batch_copy(&self) -> bool {
        self.batch.available()
    }

    /// Whether the copy kernels are loaded.
    pub fn has_kernels(&self) -> bool {
        self.kernels.is_some()
    }

    /// Counters.
    pub fn stats(&self) -> &CudaBackendStats {
        &self.stats
    }

    /// The layout.
    pub fn layout(&self) -> &WorkerLayout {
        &self.layout
    }

    /// The stream of a direction.
    pub fn stream(&self, direction: Direction) -> &Arc<CudaStream> {
        &self.streams[direction.index()]
    }

    fn timing_event(&mut self) -> Result<CudaEvent, CudaError> {
        match self.events.pop() {
            Some(e) => Ok(e),
            None => self
                .ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(driver("cuEventCreate")),
        }
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
        // Chosen on descriptors (the copies a DMA submit makes), not blocks.
        let descriptors = self.table.descs.len();
        let per_descriptor = bytes / descriptors.max(1) as u64;
        let strategy = self.forced.unwrap_or_else(|| {
            self.options
                .strategies
                .choose(dir, per_descriptor, descriptors)
        });
        let (start, end, failed) = guarded("submit", || self.enqueue(dir, strategy))?;
        if let Some(e) = &failed {
            // Copies queued before the failure still run: the job stays in
            // flight, failed, until its end event says they are done, so its
            // host chunk is not reused while one may still be written.
            tracing::error!(%job, %dir, error = %e, "CUDA transfer failed while being queued");
        }
        self.ids.insert(job);
        self.queues[dir.index()].push_back(InFlight {
            job,
            start,
            end,
            bytes,
            range: profiling::in_flight(dir, job, bytes),
            failed: failed.is_some(),
        });
        Ok(())
    }

    /// Queues the job: `(start, end, None)`, or `(start, end, Some(error))`
    /// when queueing failed after some of its copies were queued (the end
    /// event follows them: the job ends, failed, when they have run). An
    /// `Err` means nothing of the job can still run.
    fn enqueue(
        &mut self,
        dir: Direction,
        strategy: Strategy,
    ) -> Result<(CudaEvent, CudaEvent, Option<CudaError>), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        let stream = self.streams[dir.index()].clone();
        // Both directions wait for the compute stream: stores must see the KV
        // written so far, loads must land after any zeroing of their blocks.
        self.compute_event
            .record(&self.compute)
            .map_err(driver("cuEventRecord"))?;
        stream
            .wait(&self.compute_event)
            .map_err(driver("cuStreamWaitEvent"))?;
        let start = self.timing_event()?;
        start.record(&stream).map_err(driver("cuEventRecord"))?;
        let end = self.timing_event()?;
        let copied = guarded("enqueue copies", || {
            self.enqueue_copy(&stream, dir, strategy)
        });
        let used = match copied {
            Ok(used) => used,
            Err(e) => {
                // Some copies may be queued: the end event goes behind them.
                if end.record(&stream).is_ok() {
                    return Ok((start, end, Some(e)));
                }
                // Not even an event: wait for the stream (a context in an
                // error state returns at once), so that nothing queued can
                // still write when the job is refused.
                if let Err(sync) = stream.synchronize() {
                    tracing::error!(error = ?sync, "synchronising a copy stream after a failed submit");
                }
                return Err(e);
            }
        };
        self.stats.jobs_by_strategy[Strategy::ALL.iter().position(|s| *s == used).unwrap_or(0)] +=
            1;
        end.record(&stream).map_err(driver("cuEventRecord"))?;
        Ok((start, end, None))
    }

    /// Enqueues the job's copies; returns the strategy actually used.
    fn enqueue_copy(
        &mut self,
        stream: &Arc<CudaStream>,
        dir: Direction,
        strategy: Strategy,
    ) -> Result<Strategy, CudaError> {
        match strategy {
            Strategy::Dma => {}
            Strategy::BatchDma => {
                let device = self.ctx.ordinal() as i32;
                if self.batch.enqueue(stream, &self.table.descs, dir, device)? {
                    return Ok(Strategy::BatchDma);
                }
                self.stats.fallbacks += 1;
            }
            Strategy::Kernel | Strategy::KernelGraph => {
                if let Some(k) = &self.kernels {
                    self.split.clear();
                    let shape = self.options.shape;
                    kernel_pieces(
                        &self.table,
                        shape,
                        self.options.kernel_split_bytes,
                        &mut self.split,
                    );
                    let n = self.split.len();
                    if let Some(slot) = self.rings.get_mut(dir.index()).and_then(|r| r.acquire(n)) {
                        if slot.fill(&self.split)? {
                            self.stats.staging_waits += 1;
                        }
                        let f = k.table_function(dir);
                        if strategy == Strategy::KernelGraph {
                            if slot.enqueue_graph(&self.ctx, stream, f, n, shape)? {
                                self.stats.graphs_captured += 1;
                            }
                            self.stats.table_bytes_copied +=
                                slot.graph_copy_bytes().unwrap_or(0) as u64;
                        } else {
                            slot.enqueue_direct(stream, f, n, shape)?;
                            self.stats.table_bytes_copied += table_bytes(n) as u64;
                        }
                        return Ok(strategy);
                    }
                }
                self.stats.fallbacks += 1;
            }
        }
        dma::enqueue_each(stream, &self.table.descs)?;
        Ok(Strategy::Dma)
    }

    fn wait_one(end: &CudaEvent, deadline: Option<Instant>) -> Result<bool, CudaError> {
        match deadline {
            None => {
                end.synchronize().map_err(driver("cuEventSynchronize"))?;
                Ok(true)
            }
            Some(d) => loop {
                if end.try_is_complete().map_err(driver("cuEventQuery"))? {
                    return Ok(true);
                }
                if Instant::now() >= d {
                    return Ok(false);
                }
                std::thread::yield_now();
            },
        }
    }
}

impl TransferBackend for CudaBackend {
    fn submit_store(&mut self, job: JobId, spec: &TransferSpec) -> Result<(), BackendError> {
        self.submit(Direction::Store, job, spec)
    }

    fn submit_load(&mut self, job: JobId, spec: &TransferSpec) -> Result<(), BackendError> {
        self.submit(Direction::Load, job, spec)
    }

    fn poll(&mut self, out: &mut Vec<TransferResult>) {
        if self.ctx.bind_to_thread().is_err() {
            tracing::error!("cannot bind the CUDA context in poll");
            return;
        }
        for dir in Direction::ALL {
            while let Some(head) = self.queues[dir.index()].front() {
                let done = head.end.try_is_complete();
                if matches!(done, Ok(false)) {
                    break;
                }
                let Some(f) = self.queues[dir.index()].pop_front() else {
                    break;
                };
                let _complete = profiling::phase(JobPhase::Complete, dir, f.job, f.bytes);
                f.range.end();
                self.ids.remove(&f.job);
                let (success, duration) = match done {
                    Ok(_) if f.failed => (false, Duration::ZERO),
                    Ok(_) => {
                        // cudarc's elapsed-time call needs a 12.8+ driver and
                        // panics without it: guarded, a transfer without a
                        // duration rather than a dead worker thread.
                        let ms = guarded("cuEventElapsedTime", || {
                            f.start
                                .elapsed_ms(&f.end)
                                .map_err(driver("cuEventElapsedTime"))
                        });
                        let ms = match ms {
                            Ok(ms) => ms,
                            Err(e) => {
                                if !self.elapsed_warned {
                                    self.elapsed_warned = true;
                                    tracing::warn!(error = %e, "no transfer durations: the event timing call failed");
                                }
                                0.0
                            }
                        };
                        (true, Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
                    }
                    Err(e) => {
                        tracing::error!(job = %f.job, %dir, error = ?e, "CUDA transfer failed");
                        (false, Duration::ZERO)
                    }
                };
                out.push(TransferResult {
                    job: f.job,
                    direction: dir,
                    success,
                    bytes: if success { f.bytes } else { 0 },
                    duration,
                });
                self.events.push(f.start);
                self.events.push(f.end);
            }
        }
    }

    fn wait(&mut self, jobs: &[JobId], timeout: Option<Duration>) -> Result<(), BackendError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| BackendError::Cuda(driver("cuCtxSetCurrent")(e)))?;
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut pending = Vec::new();
        for q in &self.queues {
            for f in q.iter().filter(|f| jobs.contains(&f.job)) {
                if !Self::wait_one(&f.end, deadline)? {
                    pending.push(f.job);
                }
            }
        }
        if pending.is_empty() {
            Ok(())
        } else {
            Err(BackendError::WaitTimedOut { pending })
        }
    }

    fn in_flight(&self) -> usize {
        self.ids.len()
    }

    fn check_spec(&self, spec: &TransferSpec) -> Result<(), BackendError> {
        Ok(self.layout.validate(spec)?)
    }

    /// The pinned pool is mapped host memory (the constructor's contract):
    /// a store's bytes are there once its completion event has been seen
    /// (which `poll` waits for), and bytes written here before a load is
    /// submitted are what the load's DMA reads. Compiled, not run on a GPU.
    fn host_share(&self, chunk: crate::ids::ChunkId) -> Option<crate::worker::HostShare> {
        self.layout.host_share(chunk)
    }

    fn blocks_per_chunk(&self) -> Option<u32> {
        Some(self.layout.row().blocks_per_chunk())
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Tables and events must outlive the copies that use them.
        for s in &self.streams {
            if let Err(e) = s.synchronize() {
                tracing::error!(error = ?e, "synchronising a copy stream on drop failed");
            }
        }
    }
}
