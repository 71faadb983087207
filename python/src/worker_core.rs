//! `WorkerCore`: one worker's data plane, vLLM's worker-side connector hooks
//! over [`kvoffload::worker::OffloadWorker`], on the host backend (CPU KV
//! tensors) or the CUDA backend (CUDA KV tensors, a pinned host pool), either
//! wrapped in a [`FaultInjector`] (the fault-injection tests' `set_fault`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvoffload::JobId;
use kvoffload::worker::cuda::{
    CudaBackend, MAX_REGISTER_PIECE, PinnedBuffer, borrowed_stream, open_context, pool_near,
};
use kvoffload::worker::numa::{self, HostPlacement, PoolNear, PoolPlacement, SysfsTopology};
use kvoffload::worker::{
    Fault, FaultControl, FaultInjector, GpuLayout, GpuLayoutKind, GpuRegion, HeadOrder, HeadPage,
    HeadPlacement, HostBackend, HostBackendOptions, HostBuffer, HostRowLayout, OffloadWorker,
    RemoteShares, SharedRegion, SlotLayout, StoreWriters, TransferBackend, WorkerLayout,
    WorkerPlan, decode_plan,
};
use pyo3::prelude::*;

use crate::convert::{runtime_error, value_error};

/// The worker over its backend (boxed: the two differ in size).
enum Worker {
    Host(Box<OffloadWorker<FaultInjector<HostBackend>>>),
    Cuda(Box<OffloadWorker<FaultInjector<CudaBackend>>>),
}

/// The host pool the worker copies to, kept alive after the worker.
enum Pool {
    Host(#[allow(dead_code)] Arc<HostBuffer>),
    /// A region every worker process of the engine maps (host backend).
    Shared(Arc<SharedRegion>),
    Pinned(PinnedBuffer),
}

impl Pool {
    /// Removes the file name of the shared region under the pool, if it is one.
    fn unlink_shared(&self) -> Result<(), kvoffload::worker::SharedRegionError> {
        match self {
            Pool::Host(_) => Ok(()),
            Pool::Shared(r) => r.unlink(),
            Pool::Pinned(p) => p.unlink_shared(),
        }
    }

    /// The path of the shared region under the pool, if it is one.
    fn shared_path(&self) -> Option<std::path::PathBuf> {
        match self {
            Pool::Host(_) => None,
            Pool::Shared(r) => Some(r.path().to_path_buf()),
            Pool::Pinned(p) => p.shared_path().map(|p| p.to_path_buf()),
        }
    }
}

/// Which stores a worker copies: its turn where given, else every store or
/// none (`store_writer`).
fn store_writers(store_writer: bool, store_turn: Option<(u32, u32)>) -> PyResult<StoreWriters> {
    match store_turn {
        Some((index, count)) => StoreWriters::turn(index, count).map_err(value_error),
        None if store_writer => Ok(StoreWriters::Every),
        None => Ok(StoreWriters::Reader),
    }
}

/// The placement `numa` names (`"auto"`, `"off"` or a node number).
fn parse_placement(numa: &str) -> PyResult<HostPlacement> {
    numa.parse().map_err(value_error)
}

/// Opens the shared region at `path` for a pool of `len` bytes.
fn open_shared(path: &str, len: usize) -> PyResult<SharedRegion> {
    SharedRegion::open(std::path::Path::new(path), len).map_err(runtime_error)
}

/// Runs `$e` with `$w` bound to the worker, whichever its backend.
macro_rules! with_worker {
    ($worker:expr, $w:ident => $e:expr) => {
        match $worker {
            Worker::Host($w) => $e,
            Worker::Cuda($w) => $e,
        }
    };
}

/// One worker's data plane: the KV cache tensors (by address) and a host
/// pool this object owns.
#[pyclass(module = "kvoffload._native", unsendable)]
pub(crate) struct WorkerCore {
    // Dropped before the pool: the backend's threads and streams end first.
    worker: Worker,
    pool: Pool,
    plan: Option<WorkerPlan>,
    pool_bytes: u64,
    /// Where the host pool was placed (its NUMA node).
    placement: PoolPlacement,
    /// Host copy threads running on the pool's node's CPUs (the host
    /// backend, with the pool placed; 0 otherwise).
    copy_threads_on_node: usize,
    /// This worker's slot of a chunk row and the blocks a chunk (where a
    /// remote tier's shares lie).
    slot: SlotLayout,
    blocks_per_chunk: u32,
}

/// The GPU-side layout of `tensors` (`(address, block stride, page bytes)`)
/// and the host row layout of `blocks_per_chunk` blocks of them.
fn layouts(
    tensors: &[(u64, u64, u64)],
    num_blocks: u32,
    blocks_per_chunk: u32,
    num_chunks: u32,
    cross_layer: bool,
) -> PyResult<(GpuLayout, HostRowLayout, u64)> {
    let regions: Vec<GpuRegion> = tensors
        .iter()
        .map(|&(base, block_stride, page_bytes)| GpuRegion {
            base,
            block_stride,
            page_bytes,
        })
        .collect();
    let pages: Vec<u64> = regions.iter().map(|r| r.page_bytes).collect();
    let kind = if cross_layer {
        GpuLayoutKind::CrossLayer
    } else {
        GpuLayoutKind::PerLayer
    };
    let gpu = GpuLayout::from_regions(kind, regions, num_blocks).map_err(value_error)?;
    let row = HostRowLayout::uniform(blocks_per_chunk, 1, &pages).map_err(value_error)?;
    let pool_bytes = row
        .pool_bytes(num_chunks)
        .ok_or_else(|| value_error("host pool size overflows"))?;
    Ok((gpu, row, pool_bytes))
}

/// `layout` with the tensors of each KV group (`None`: one group of every tensor).
fn with_groups(layout: WorkerLayout, groups: Option<Vec<Vec<usize>>>) -> PyResult<WorkerLayout> {
    match groups {
        None => Ok(layout),
        Some(g) => layout.with_groups(g).map_err(value_error),
    }
}

impl WorkerCore {
    fn faults(&mut self) -> &mut dyn FaultControl {
        match &mut self.worker {
            Worker::Host(w) => w.backend_mut(),
            Worker::Cuda(w) => w.backend_mut(),
        }
    }
}

#[pymethods]
impl WorkerCore {
    /// A worker on the host backend, copying between CPU `tensors`
    /// (`(address, block stride, page bytes)` each, `num_blocks` blocks) and
    /// a host pool of `num_chunks` chunks of `blocks_per_chunk` blocks.
    /// `cross_layer`: one tensor holds every layer of a block. `groups`:
    /// with several KV groups (vLLM's hybrid manager), the indices in
    /// `tensors` of each group's layers (a tensor may serve several groups;
    /// a job then moves each group's blocks over its tensors); `None`: one
    /// group of every tensor.
    ///
    /// The caller (the connector) keeps the tensors alive and unmoved for the
    /// lifetime of this object, and touches no block while a job it was given
    /// for that block is in flight; the addresses are checked for overflow,
    /// not for ownership.
    ///
    /// `shared_region`: the path of a file every worker of the engine maps
    /// as its host pool (one copy of KV replicated on every rank), in place
    /// of a pool of its own; `store_writer`: whether this worker writes the
    /// stores (with a shared region, one rank does; the others acknowledge
    /// them without copying); `store_turn`: `(index, count)`, this worker's
    /// turn of the `count` workers that share the region and take turns by
    /// host chunk (it copies, puts and fetches the chunks whose id is
    /// `index` modulo `count`; `store_writer` is then ignored). An existing
    /// file of another size raises `RuntimeError`; a turn out of range
    /// `ValueError`.
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (tensors, num_blocks, blocks_per_chunk, num_chunks, cross_layer, groups=None, shared_region=None, store_writer=true, store_turn=None, numa="auto"))]
    fn host(
        tensors: Vec<(u64, u64, u64)>,
        num_blocks: u32,
        blocks_per_chunk: u32,
        num_chunks: u32,
        cross_layer: bool,
        groups: Option<Vec<Vec<usize>>>,
        shared_region: Option<String>,
        store_writer: bool,
        store_turn: Option<(u32, u32)>,
        numa: &str,
    ) -> PyResult<Self> {
        let writers = store_writers(store_writer, store_turn)?;
        let asked = parse_placement(numa)?;
        let (gpu, row, pool_bytes) = layouts(
            &tensors,
            num_blocks,
            blocks_per_chunk,
            num_chunks,
            cross_layer,
        )?;
        let len = usize::try_from(pool_bytes).map_err(value_error)?;
        let slot = row
            .slot(0)
            .cloned()
            .ok_or_else(|| value_error("no worker slot"))?;
        // KV caches in host memory (CPU inference): `auto` places the pool
        // on the node holding most of their pages; a node asked for is
        // applied.
        let caches: Vec<(usize, usize)> = (0..gpu.regions().len())
            .filter_map(|i| gpu.region_range(i))
            .map(|(start, end)| (start as usize, (end - start) as usize))
            .collect();
        let near = PoolNear::HostCaches(numa::sample_ranges_nodes(&caches, 1024));
        let guard = numa::enter(asked, &near, &SysfsTopology::system()).map_err(value_error)?;
        let (pool, pool_addr) = match shared_region {
            Some(path) => {
                let r = Arc::new(open_shared(&path, len)?);
                let addr = r.addr();
                (Pool::Shared(r), addr)
            }
            None => {
                let b = Arc::new(HostBuffer::new(len).map_err(value_error)?);
                let addr = b.addr();
                (Pool::Host(b), addr)
            }
        };
        let placement = guard.finish(pool_addr as usize, len);
        let layout = with_groups(
            WorkerLayout::new(gpu, row, 0, pool_addr, num_chunks).map_err(value_error)?,
            groups,
        )?;
        // The copy threads run on the pool's node, where it was placed.
        let options = HostBackendOptions {
            home: placement.home(),
            ..HostBackendOptions::default()
        };
        // SAFETY: the pool is owned by this object (dropped after the worker,
        // whose threads end in its drop); the tensors' memory is kept alive
        // and untouched during their jobs by the caller (documented above).
        let backend = unsafe { HostBackend::from_raw(layout, options) };
        let copy_threads_on_node = backend.copy_threads_on_home_node();
        Ok(Self {
            worker: Worker::Host(Box::new(
                OffloadWorker::new(FaultInjector::new(backend), true).with_store_writers(writers),
            )),
            pool,
            plan: None,
            pool_bytes,
            placement,
            copy_threads_on_node,
            slot,
            blocks_per_chunk,
        })
    }

    /// A worker on the CUDA backend of device `device`, copying between CUDA
    /// `tensors` (as for `host`) and a pinned, mapped host pool allocated
    /// here; transfers are ordered after the work on `stream` (a `CUstream`
    /// handle, PyTorch's `torch.cuda.current_stream().cuda_stream`; 0 is the
    /// legacy default stream). `groups`: as for `host`. Raises `RuntimeError`
    /// without a CUDA driver or device.
    ///
    /// `strategy_table`: the path of a table written by `kvoffload bench
    /// --calibrate` (its rules choose each job's copy strategy, its tuning
    /// sets the backend's launch shape, ring depth and prefer-overlap);
    /// without it, the built-in defaults. A bad file raises `ValueError`
    /// naming it.
    ///
    /// The caller keeps the tensors and the stream alive for the lifetime of
    /// this object, as for `host`.
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (tensors, num_blocks, blocks_per_chunk, num_chunks, cross_layer, device, stream, strategy_table=None, groups=None, shared_region=None, store_writer=true, store_turn=None, numa="auto"))]
    fn cuda(
        tensors: Vec<(u64, u64, u64)>,
        num_blocks: u32,
        blocks_per_chunk: u32,
        num_chunks: u32,
        cross_layer: bool,
        device: usize,
        stream: u64,
        strategy_table: Option<String>,
        groups: Option<Vec<Vec<usize>>>,
        shared_region: Option<String>,
        store_writer: bool,
        store_turn: Option<(u32, u32)>,
        numa: &str,
    ) -> PyResult<Self> {
        let writers = store_writers(store_writer, store_turn)?;
        let asked = parse_placement(numa)?;
        let options = crate::strategy_table::cuda_options(strategy_table.as_deref())?;
        let (gpu, row, pool_bytes) = layouts(
            &tensors,
            num_blocks,
            blocks_per_chunk,
            num_chunks,
            cross_layer,
        )?;
        let len = usize::try_from(pool_bytes).map_err(value_error)?;
        let slot = row
            .slot(0)
            .cloned()
            .ok_or_else(|| value_error("no worker slot"))?;
        let ctx = open_context(device).map_err(runtime_error)?;
        // The pool is allocated (its pages placed and pinned) on this
        // thread, bound meanwhile to the GPU's NUMA node.
        let guard =
            numa::enter(asked, &pool_near(&ctx), &SysfsTopology::system()).map_err(value_error)?;
        let pool = match shared_region {
            // Registered in pieces of whole rows, as vLLM registers its region.
            Some(path) => PinnedBuffer::over_shared(
                &ctx,
                open_shared(&path, len)?,
                MAX_REGISTER_PIECE,
                usize::try_from(row.row_bytes()).map_err(value_error)?,
            ),
            None => PinnedBuffer::host_alloc(&ctx, len),
        }
        .map_err(runtime_error)?;
        let placement = guard.finish(pool.addr() as usize, len);
        let layout = with_groups(
            WorkerLayout::new(gpu, row, 0, pool.addr(), num_chunks).map_err(value_error)?,
            groups,
        )?;
        // SAFETY: the caller keeps `stream` (a stream of this device's primary
        // context, which PyTorch uses) alive while this object lives.
        let compute = unsafe { borrowed_stream(&ctx, stream) };
        // SAFETY: the GPU regions are the caller's live CUDA tensors on this
        // device, untouched during their jobs but through `compute`'s order;
        // the pinned, mapped pool is owned by this object and dropped after
        // the backend (which synchronises its streams on drop).
        let backend =
            unsafe { CudaBackend::new(ctx, layout, compute, options) }.map_err(runtime_error)?;
        Ok(Self {
            worker: Worker::Cuda(Box::new(
                OffloadWorker::new(FaultInjector::new(backend), true).with_store_writers(writers),
            )),
            pool: Pool::Pinned(pool),
            plan: None,
            pool_bytes,
            placement,
            copy_threads_on_node: 0,
            slot,
            blocks_per_chunk,
        })
    }

    /// Bytes of the host pool.
    #[getter]
    fn pool_bytes(&self) -> u64 {
        self.pool_bytes
    }

    /// Where the host pool was placed: `asked` (`"auto"`, `"off"` or the
    /// node), `node` (the NUMA node it was placed on, or None: wherever the
    /// kernel put it), `reason`, and a sample of its pages: `sampled`,
    /// `by_node` ({node: pages}), `absent`, `unknown`, `elsewhere` (pages of
    /// a placed pool on another node); `copy_threads_on_node` (the host
    /// backend's copy threads running on the placed pool's node: 2, or 0
    /// where the pool was not placed, the backend is CUDA's (no copy
    /// threads) or the system refused); `summary`, one line.
    #[getter]
    fn host_placement<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let p = &self.placement;
        let d = pyo3::types::PyDict::new(py);
        d.set_item("asked", p.asked.to_string())?;
        d.set_item("node", p.node.map(|n| n.0))?;
        d.set_item("reason", &p.reason)?;
        d.set_item("sampled", p.pages.sampled)?;
        let by_node: HashMap<u32, usize> = p.pages.by_node.iter().map(|(n, c)| (n.0, *c)).collect();
        d.set_item("by_node", by_node)?;
        d.set_item("absent", p.pages.absent)?;
        d.set_item("unknown", p.pages.unknown)?;
        d.set_item("elsewhere", p.pages_elsewhere())?;
        d.set_item("copy_threads_on_node", self.copy_threads_on_node)?;
        let summary = match (&self.worker, p.node) {
            (Worker::Host(_), Some(_)) => format!(
                "{p}; host copy threads on its CPUs: {} of 2",
                self.copy_threads_on_node
            ),
            _ => p.to_string(),
        };
        d.set_item("summary", summary)?;
        Ok(d)
    }

    /// The backend: `"host"` or `"cuda"`.
    #[getter]
    fn backend(&self) -> &'static str {
        match self.worker {
            Worker::Host(_) => "host",
            Worker::Cuda(_) => "cuda",
        }
    }

    /// The path of the shared region the pool is, or None for a pool of
    /// this worker's own.
    #[getter]
    fn shared_region(&self) -> Option<String> {
        self.pool
            .shared_path()
            .map(|p| p.to_string_lossy().into_owned())
    }

    /// Whether this worker writes its stores (False: it acknowledges them
    /// without copying, another rank writing the shared region).
    #[getter]
    fn store_writer(&self) -> bool {
        with_worker!(&self.worker, w => w.is_store_writer())
    }

    /// `(index, count)`: this worker's turn of the workers writing the
    /// shared region by turns; None where it writes every store or none.
    #[getter]
    fn store_turn(&self) -> Option<(u32, u32)> {
        match with_worker!(&self.worker, w => w.store_writers()) {
            StoreWriters::Turn { index, count } => Some((index, count)),
            StoreWriters::Every | StoreWriters::Reader => None,
        }
    }

    /// Removes the shared region's file name, once every worker has mapped
    /// it: the mappings stay, and the memory goes with the last worker,
    /// however it ends. A name already removed (by another worker) is not
    /// an error; without a shared region, nothing happens.
    fn unlink_shared_region(&self) -> PyResult<()> {
        self.pool.unlink_shared().map_err(runtime_error)
    }

    /// Binds the step's plan (the bytes `SchedulerCore.build_step` made).
    fn bind(&mut self, plan: &[u8]) -> PyResult<()> {
        self.plan = Some(decode_plan(plan).map_err(value_error)?);
        Ok(())
    }

    /// The bound plan's synchronous loads (finished within the step, before
    /// its compute): `[(job, [GPU block, ...])]`, the blocks vLLM must
    /// recompute if the load fails.
    fn sync_loads(&self) -> PyResult<Vec<(u64, Vec<u32>)>> {
        let plan = bound_plan(self.plan.as_ref())?;
        Ok(plan
            .loads
            .iter()
            .filter(|l| l.request.is_none())
            .map(|l| (l.job.0, l.spec.gpu_blocks.iter().map(|b| b.0).collect()))
            .collect())
    }

    /// Hook 1: flushed jobs are finished before the step reuses their blocks.
    fn handle_preemptions(&mut self) -> PyResult<()> {
        let plan = bound_plan(self.plan.as_mut())?;
        with_worker!(&mut self.worker, w => w.handle_preemptions(plan)).map_err(runtime_error)
    }

    /// Hook 2: stores queued last step, then this step's loads, start; the
    /// synchronous loads are waited for.
    fn start_transfers(&mut self) -> PyResult<()> {
        let plan = bound_plan(self.plan.as_ref())?;
        with_worker!(&mut self.worker, w => w.start_transfers(plan)).map_err(runtime_error)
    }

    /// Hook 3 (after the step's compute): this step's stores are queued for
    /// the next step.
    fn queue_stores(&mut self) -> PyResult<()> {
        let plan = bound_plan(self.plan.as_mut())?;
        with_worker!(&mut self.worker, w => w.queue_stores(plan));
        Ok(())
    }

    /// Hook 4: jobs that ended since the last call: `(completed, failed,
    /// stats)` with `completed` as `{job: 1}`, `failed` the failed jobs,
    /// `stats` `{"load": (bytes, seconds, [sizes]), "store": ...}`.
    #[allow(clippy::type_complexity)]
    fn get_finished(
        &mut self,
    ) -> (
        HashMap<u64, u32>,
        Vec<u64>,
        HashMap<&'static str, (u64, f64, Vec<u64>)>,
    ) {
        let r = with_worker!(&mut self.worker, w => w.get_finished());
        let completed = r.completed.iter().map(|(j, &n)| (j.0, n)).collect();
        let failed = r.failed.iter().map(|j| j.0).collect();
        let mut stats = HashMap::new();
        for (name, d) in [("load", &r.stats.load), ("store", &r.stats.store)] {
            stats.insert(name, (d.bytes, d.time.as_secs_f64(), d.sizes.clone()));
        }
        (completed, failed, stats)
    }

    /// Fault injection (tests): `kind` is `"stall"` (the job never reports
    /// until released or cancelled), `"fail"` or `"delay:N"` (reports after N
    /// more polls); it applies when the job is submitted.
    fn set_fault(&mut self, job: u64, kind: &str) -> PyResult<()> {
        let fault = match kind {
            "stall" => Fault::Stall,
            "fail" => Fault::Fail,
            k => match k.strip_prefix("delay:").and_then(|n| n.parse().ok()) {
                Some(n) => Fault::DelayPolls(n),
                None => {
                    return Err(value_error(format!(
                        "fault {k:?}: allowed \"stall\", \"fail\", \"delay:N\""
                    )));
                }
            },
        };
        self.faults().set_fault(JobId(job), fault);
        Ok(())
    }

    /// Lets a stalled job run now (its report comes late). Whether it was stalled.
    fn release_stalled(&mut self, job: u64) -> bool {
        self.faults().release_stalled(JobId(job))
    }

    /// Waits (at most `timeout_s`) until every submitted job not held stalled
    /// has copied its bytes; they report at the next poll (tests: completion
    /// independent of thread timing). Host backend only.
    #[pyo3(signature = (timeout_s = 30.0))]
    fn settle(&mut self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = Duration::from_secs_f64(timeout_s.max(0.0));
        match &mut self.worker {
            Worker::Host(w) => {
                let backend = w.backend_mut();
                py.detach(|| backend.settle(timeout)).map_err(runtime_error)
            }
            Worker::Cuda(_) => Err(runtime_error(
                "settle is a test helper of the host backend (CUDA jobs report when their events complete)",
            )),
        }
    }

    /// Cancels a job that has not started copying (a stalled one): it will
    /// never write nor report. Whether it was cancelled.
    fn cancel(&mut self, job: u64) -> bool {
        let cancelled = self.faults().cancel_stalled(JobId(job));
        if cancelled {
            with_worker!(&mut self.worker, w => w.forget_job(JobId(job)));
        }
        cancelled
    }

    /// Writes every chunk this worker stores through to a remote tier, as
    /// rank `rank` of `world_size`, and runs the plans' remote fetches from
    /// it (`config_json` and `namespace` as `SchedulerCore.attach_remote`;
    /// call before the first step). Raises `ValueError` for a bad
    /// configuration or rank, `RuntimeError` if the store refuses the
    /// credentials or a tier is already attached. An unreachable store is
    /// not an error (puts are dropped and counted, fetches miss).
    fn attach_remote(
        &mut self,
        config_json: &str,
        namespace: u64,
        rank: u32,
        world_size: u32,
    ) -> PyResult<()> {
        if rank >= world_size {
            return Err(value_error(format!(
                "rank {rank} is out of range: allowed 0..{world_size}"
            )));
        }
        if with_worker!(&self.worker, w => w.remote_tier().is_some()) {
            return Err(runtime_error("a remote tier is already attached"));
        }
        let tier = crate::remote::start_tier(
            config_json,
            namespace,
            world_size,
            kvoffload::MonotonicClock::shared(),
        )?;
        with_worker!(&mut self.worker, w => w.set_remote_tier(tier, rank));
        Ok(())
    }

    /// [`attach_remote`](Self::attach_remote) with KV heads as the shares of
    /// a chunk (`docs/remote-tier.md`, "Keys and values": shares): a chunk has `total_heads`
    /// shares, each one KV head's bytes in an order no parallel layout
    /// changes, and this worker (tensor-parallel rank `tp_rank` of
    /// `tp_size`) puts and fetches its heads', so that nodes of other
    /// tensor-parallel sizes read its chunks. `head_pages`: per tensor, in
    /// the order given at construction, `(order, halves, block_tokens,
    /// heads, head_bytes)`: order `"nhd"` (a token's heads together) or
    /// `"hnd"` (a head's tokens together), halves 2 (K and V apart) or 1
    /// (side by side), this worker's heads in the page, the bytes of one
    /// head of one token in one half. Raises `ValueError` where the pages or
    /// the placement do not fit the tensors, as `attach_remote` otherwise.
    fn attach_remote_heads(
        &mut self,
        config_json: &str,
        namespace: u64,
        head_pages: Vec<(String, u32, u64, u32, u64)>,
        total_heads: u32,
        tp_size: u32,
        tp_rank: u32,
    ) -> PyResult<()> {
        let pages = head_pages
            .into_iter()
            .map(|(order, halves, block_tokens, heads, head_bytes)| {
                let order = match order.as_str() {
                    "nhd" => HeadOrder::TokenMajor,
                    "hnd" => HeadOrder::HeadMajor,
                    other => {
                        return Err(value_error(format!(
                            "head order {other:?} (allowed: \"nhd\", \"hnd\")"
                        )));
                    }
                };
                Ok(HeadPage {
                    order,
                    halves,
                    block_tokens,
                    heads,
                    head_bytes,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let placement = HeadPlacement {
            total_heads,
            tp_size,
            tp_rank,
        };
        let shares = RemoteShares::kv_heads(&pages, &self.slot, self.blocks_per_chunk, placement)
            .map_err(value_error)?;
        if with_worker!(&self.worker, w => w.remote_tier().is_some()) {
            return Err(runtime_error("a remote tier is already attached"));
        }
        let tier = crate::remote::start_tier(
            config_json,
            namespace,
            shares.total(),
            kvoffload::MonotonicClock::shared(),
        )?;
        with_worker!(&mut self.worker, w => w.set_remote_tier_shares(tier, shares));
        Ok(())
    }

    /// Waits (at most `timeout_s`, real time) until every remote fetch in
    /// flight has its answers (their reports come at the next
    /// `get_finished`) and every queued put is written (tests: what a step
    /// fetches and what another node finds do not depend on the I/O thread's
    /// timing; a serving engine never calls it). Whether nothing was left
    /// waiting.
    #[pyo3(signature = (timeout_s = 10.0))]
    fn wait_remote(&mut self, py: Python<'_>, timeout_s: f64) -> bool {
        let limit = Duration::from_secs_f64(timeout_s.clamp(0.0, 3600.0));
        let start = std::time::Instant::now();
        with_worker!(&mut self.worker, w => {
            py.detach(|| {
                w.wait_fetches(limit);
                let Some(tier) = w.remote_tier() else {
                    return true;
                };
                tier.wait_queued_puts(limit.saturating_sub(start.elapsed()))
                    && w.pending_fetches() == 0
            })
        })
    }

    /// The worker's remote tier stats (puts written, bytes, drops, fetch
    /// hits and misses, ...), or `None` without a tier.
    fn remote_stats<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<Bound<'py, pyo3::types::PyDict>>> {
        match with_worker!(&self.worker, w => w.remote_tier().map(|t| t.stats())) {
            Some(st) => crate::remote::stats_dict(py, &st).map(Some),
            None => Ok(None),
        }
    }

    /// Jobs submitted and not reported yet.
    fn in_flight(&self) -> usize {
        match &self.worker {
            Worker::Host(w) => w.backend().in_flight(),
            Worker::Cuda(w) => w.backend().in_flight(),
        }
    }
}

/// The plan `bind` gave, or the error a hook called before `bind` raises.
fn bound_plan<P>(plan: Option<P>) -> PyResult<P> {
    plan.ok_or_else(|| runtime_error("no plan bound"))
}

/// The path of an engine's shared host region (`name`: its engine id):
/// `/dev/shm/kvoffload_<name>.mmap`, the name's characters outside
/// `[A-Za-z0-9._-]` made `_`.
#[pyfunction]
pub(crate) fn shared_region_path(name: &str) -> String {
    SharedRegion::default_path(name)
        .to_string_lossy()
        .into_owned()
}
