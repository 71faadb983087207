//! `kvoffload._native`: Python bindings of kvoffload's control plane
//! ([`kvoffload::scheduler::Scheduler`]) and data plane
//! ([`kvoffload::worker::OffloadWorker`] over the host backend). A thin layer:
//! it translates names and values (request ids as strings, vLLM's block
//! hashes as bytes, block lists as Python lists) and holds no logic of its
//! own. The vLLM connector (`kvoffload.vllm`) is written on top of it.

use std::collections::HashMap;
use std::sync::Arc;

use kvoffload::engine::to_worker_plan;
use kvoffload::scheduler::{LookupOutcome, ScheduledRequest, Scheduler, StepInput, WorkerReport};
use kvoffload::worker::Fault;
use kvoffload::worker::{
    GpuLayout, GpuLayoutKind, GpuRegion, HostBackend, HostBackendOptions, HostBuffer,
    HostRowLayout, OffloadWorker, StepPlan, WorkerLayout, decode_plan, encode_plan,
};
use kvoffload::{
    BlockHash, GpuBlockId, JobId, ManualClock, MonotonicClock, OffloadConfig, RequestId,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn runtime_error(e: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

/// A block hash as kvoffload's key: vLLM's hashes are cryptographic digests
/// (sha256 by default), so their first 8 bytes are a uniform 64-bit key.
/// Shorter inputs (or ints) are folded with FNV-1a.
fn block_hash(h: &[u8]) -> BlockHash {
    if h.len() >= 8 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&h[..8]);
        // Keys below 2^63 print as plain integers in traces.
        BlockHash(u64::from_le_bytes(a) & (u64::MAX >> 1))
    } else {
        let mut x: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in h {
            x = (x ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        BlockHash(x & (u64::MAX >> 1))
    }
}

fn hashes(hs: &[Vec<u8>]) -> Vec<BlockHash> {
    hs.iter().map(|h| block_hash(h)).collect()
}

fn blocks(ids: &[u32]) -> Vec<GpuBlockId> {
    ids.iter().map(|&b| GpuBlockId(b)).collect()
}

/// Request names (vLLM's request ids) and kvoffload's numeric ids.
#[derive(Default)]
struct Names {
    ids: HashMap<String, RequestId>,
    names: HashMap<RequestId, String>,
    next: u64,
}

impl Names {
    fn intern(&mut self, name: &str) -> RequestId {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = RequestId(self.next);
        self.next += 1;
        self.ids.insert(name.to_owned(), id);
        self.names.insert(id, name.to_owned());
        id
    }

    fn get(&self, name: &str) -> PyResult<RequestId> {
        self.ids
            .get(name)
            .copied()
            .ok_or_else(|| value_error(format!("unknown request {name:?}")))
    }

    fn name(&self, id: RequestId) -> String {
        self.names.get(&id).cloned().unwrap_or_default()
    }

    /// Forgets a request the scheduler no longer tracks.
    fn forget(&mut self, id: RequestId) {
        if let Some(n) = self.names.remove(&id) {
            self.ids.remove(&n);
        }
    }
}

/// The control plane for one engine: vLLM's scheduler-side connector hooks.
#[pyclass(module = "kvoffload._native", unsendable)]
struct SchedulerCore {
    s: Scheduler,
    cfg: OffloadConfig,
    names: Names,
    wire: Vec<u8>,
    /// Set when the scheduler runs on a manual clock (tests).
    manual: Option<ManualClock>,
}

#[pymethods]
impl SchedulerCore {
    /// A scheduler for the engine configuration `config_json` (kvoffload's
    /// keys, validated: an unknown key or a bad value raises `ValueError`
    /// naming it). `watchdog`: start the stall watchdog thread.
    /// `manual_clock`: time moves only with `advance_clock` (tests).
    #[new]
    #[pyo3(signature = (config_json, watchdog = true, manual_clock = false))]
    fn new(config_json: &str, watchdog: bool, manual_clock: bool) -> PyResult<Self> {
        let cfg = OffloadConfig::from_json_str(config_json).map_err(value_error)?;
        let manual = manual_clock.then(ManualClock::new);
        let clock = match &manual {
            Some(c) => c.shared(),
            None => MonotonicClock::shared(),
        };
        let mut s = Scheduler::new(&cfg, clock).map_err(value_error)?;
        if watchdog {
            s.start_watchdog().map_err(runtime_error)?;
        }
        Ok(Self {
            s,
            cfg,
            names: Names::default(),
            wire: Vec::new(),
            manual,
        })
    }

    /// Moves a manual clock forward (`manual_clock=True` only).
    fn advance_clock(&mut self, ms: u64) -> PyResult<()> {
        match &self.manual {
            Some(c) => {
                c.advance(std::time::Duration::from_millis(ms));
                Ok(())
            }
            None => Err(runtime_error("advance_clock needs manual_clock=True")),
        }
    }

    /// A new request with the hashes of its full blocks.
    fn add_request(
        &mut self,
        req: &str,
        prompt_tokens: u64,
        block_hashes: Vec<Vec<u8>>,
    ) -> PyResult<()> {
        let id = self.names.intern(req);
        self.s
            .add_request(id, prompt_tokens, &hashes(&block_hashes))
            .map_err(value_error)
    }

    /// The request's tokens now, and the hashes of its new full blocks.
    fn update_request(
        &mut self,
        req: &str,
        num_tokens: u64,
        new_block_hashes: Vec<Vec<u8>>,
    ) -> PyResult<()> {
        let id = self.names.get(req)?;
        self.s
            .update_request(id, num_tokens, &hashes(&new_block_hashes))
            .map_err(value_error)
    }

    /// Tokens beyond `computed_tokens` the host tier can supply, or `None`:
    /// ask again later (vLLM's `get_num_new_matched_tokens`).
    fn lookup(&mut self, req: &str, computed_tokens: u64) -> PyResult<Option<u64>> {
        let id = self.names.get(req)?;
        match self.s.lookup(id, computed_tokens).map_err(value_error)? {
            LookupOutcome::Hit(n) => Ok(Some(n)),
            LookupOutcome::Defer => Ok(None),
        }
    }

    /// The request's allocated blocks; creates its load job when
    /// `external_tokens > 0` (vLLM's `update_state_after_alloc`).
    fn on_alloc(
        &mut self,
        req: &str,
        block_ids: Vec<u32>,
        external_tokens: u64,
    ) -> PyResult<Option<u64>> {
        let id = self.names.get(req)?;
        Ok(self
            .s
            .on_alloc(id, &blocks(&block_ids), external_tokens)
            .map_err(value_error)?
            .map(|j| j.0))
    }

    /// One step (vLLM's `build_connector_meta`). `scheduled`: `(request, new
    /// block ids, computed tokens, scheduled tokens, full table)`. Returns
    /// `(plan, load_requests, failed_loads)`: the workers' plan as compact
    /// bytes, the request of every load job in it (`{job: request}`), and
    /// the requests whose load failed or stalled (they must recompute).
    #[allow(clippy::type_complexity)]
    fn build_step<'py>(
        &mut self,
        py: Python<'py>,
        scheduled: Vec<(String, Vec<u32>, u64, u64, bool)>,
        preempted: Vec<String>,
        finished: Vec<String>,
    ) -> PyResult<(Bound<'py, PyBytes>, HashMap<u64, String>, Vec<String>)> {
        let mut input = StepInput::default();
        for (req, new_blocks, computed, n, full) in &scheduled {
            input.scheduled.push(ScheduledRequest {
                req: self.names.get(req)?,
                new_block_ids: blocks(new_blocks),
                computed_tokens: *computed,
                scheduled_tokens: *n,
                full_table: *full,
            });
        }
        for r in &preempted {
            input.preempted.push(self.names.get(r)?);
        }
        for r in &finished {
            input.finished.push(self.names.get(r)?);
        }
        let plan = self.s.build_step(&input).map_err(value_error)?;
        let wplan = to_worker_plan(&plan, self.cfg.blocks_per_chunk);
        encode_plan(&wplan, &mut self.wire);
        let load_requests: HashMap<u64, String> = plan
            .loads
            .iter()
            .map(|l| (l.job.0, self.names.name(l.req)))
            .collect();
        let failed: Vec<String> = plan
            .failed_loads
            .iter()
            .map(|&r| self.names.name(r))
            .collect();
        self.s.recycle_plan(plan);
        Ok((PyBytes::new(py, &self.wire), load_requests, failed))
    }

    /// Worker reports summed over workers: `{job: count}` and the failed
    /// jobs. Returns `(finished_loads, failed_loads, rejected)`.
    fn on_worker_output(
        &mut self,
        completed: HashMap<u64, u32>,
        failed: Vec<u64>,
    ) -> (Vec<String>, Vec<String>, Vec<String>) {
        let mut completed: Vec<(JobId, u32)> =
            completed.into_iter().map(|(j, n)| (JobId(j), n)).collect();
        completed.sort_unstable();
        let report = WorkerReport {
            completed,
            failed: failed.into_iter().map(JobId).collect(),
        };
        let out = self.s.on_worker_output(&report);
        let name = |r: &RequestId| self.names.name(*r);
        (
            out.finished_loads.iter().map(name).collect(),
            out.failed_loads.iter().map(name).collect(),
            out.rejected
                .iter()
                .map(|(j, e)| format!("{j}: {e}"))
                .collect(),
        )
    }

    /// The request finished (vLLM's `request_finished`); its last stores
    /// come at the next step listing it in `finished`.
    fn request_finished(
        &mut self,
        req: &str,
        block_ids: Vec<u32>,
        aborted: bool,
        computed_tokens: u64,
    ) -> PyResult<()> {
        let id = self.names.get(req)?;
        self.s
            .request_finished(id, &blocks(&block_ids), aborted, computed_tokens)
            .map_err(value_error)
    }

    /// Forgets the names of requests the scheduler no longer tracks.
    fn prune_names(&mut self) {
        let gone: Vec<RequestId> = self
            .names
            .ids
            .values()
            .copied()
            .filter(|&id| !self.s.has_request(id))
            .collect();
        for id in gone {
            self.names.forget(id);
        }
    }

    /// vLLM's `reset_cache`.
    fn reset(&mut self) -> PyResult<()> {
        self.s.reset().map_err(value_error)
    }

    /// The host tier's events: `(removed, metadata_only, [key, ...])`.
    fn take_events(&mut self) -> Vec<(bool, bool, Vec<u64>)> {
        self.s
            .take_events()
            .into_iter()
            .map(|e| {
                (
                    e.removed,
                    e.metadata_only,
                    e.keys.iter().map(|k| k.0).collect(),
                )
            })
            .collect()
    }

    /// Whether the engine must keep stepping (jobs in flight, a reset not
    /// drained).
    fn has_pending_work(&self) -> bool {
        self.s.has_pending_work()
    }

    /// A stall scan now, if one is due (for engines without the thread).
    fn scan_if_due(&mut self) -> bool {
        self.s.scan_if_due().is_some()
    }

    /// Counters and gauges (scheduler and host tier) as a dict.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.s.metrics();
        let st = self.s.manager().stats();
        let d = PyDict::new(py);
        d.set_item("stalled_stores", m.stalled_stores)?;
        d.set_item("stalled_loads", m.stalled_loads)?;
        d.set_item("late_reports", m.late_reports)?;
        d.set_item("unknown_reports", m.unknown_reports)?;
        d.set_item("cancellations_confirmed", m.cancellations_confirmed)?;
        d.set_item("allocation_failures", m.allocation_failures)?;
        d.set_item("jobs_created", m.jobs_created)?;
        d.set_item("jobs_in_flight", m.jobs_in_flight)?;
        d.set_item("stalled_jobs", m.stalled_jobs)?;
        d.set_item("quarantined_chunks", m.quarantined_chunks)?;
        d.set_item("usage", st.usage)?;
        d.set_item("write_usage", st.write_usage)?;
        d.set_item("read_usage", st.read_usage)?;
        d.set_item("stores_skipped", st.stores_skipped)?;
        d.set_item("cached_chunks", st.cached)?;
        d.set_item("free_chunks", st.free)?;
        Ok(d)
    }

    /// Live jobs, tracked requests, stalled jobs, quarantined chunks, pinned
    /// and pending chunks (for tests and leak checks).
    fn state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let st = self.s.state();
        let d = PyDict::new(py);
        d.set_item("jobs", st.jobs)?;
        d.set_item("requests", st.requests)?;
        d.set_item("chunks_being_loaded", st.chunks_being_loaded)?;
        d.set_item("fenced_blocks", st.fenced_blocks)?;
        d.set_item("stalled_jobs", st.stalled_jobs)?;
        d.set_item("quarantined_chunks", st.quarantined_chunks)?;
        d.set_item("pinned_chunks", st.manager.pinned)?;
        d.set_item("pending_chunks", st.manager.pending)?;
        d.set_item("cached_chunks", st.manager.cached)?;
        d.set_item("invariants", self.s.check_invariants().err())?;
        Ok(d)
    }
}

/// One worker's data plane over host memory: the KV cache tensors (CPU
/// tensors of vLLM's, by address) and a host pool this object owns.
#[pyclass(module = "kvoffload._native", unsendable)]
struct HostWorkerCore {
    worker: OffloadWorker<HostBackend>,
    _pool: Arc<HostBuffer>,
    plan: Option<StepPlan>,
    pool_bytes: u64,
}

#[pymethods]
impl HostWorkerCore {
    /// A worker copying between `tensors` (`(address, block stride, page
    /// bytes)` each, `num_blocks` blocks) and a host pool of `num_chunks`
    /// chunks of `blocks_per_chunk` blocks. `cross_layer`: one tensor holds
    /// every layer of a block.
    ///
    /// The caller (the connector) keeps the tensors alive and unmoved for the
    /// lifetime of this object, and touches no block while a job it was given
    /// for that block is in flight; the addresses are checked for overflow,
    /// not for ownership.
    #[new]
    fn new(
        tensors: Vec<(u64, u64, u64)>,
        num_blocks: u32,
        blocks_per_chunk: u32,
        num_chunks: u32,
        cross_layer: bool,
    ) -> PyResult<Self> {
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
        let len = usize::try_from(pool_bytes).map_err(value_error)?;
        let pool = Arc::new(HostBuffer::new(len).map_err(value_error)?);
        let layout =
            WorkerLayout::new(gpu, row, 0, pool.addr(), num_chunks).map_err(value_error)?;
        // SAFETY: the pool is owned by this object (dropped after the worker,
        // whose threads end in its drop); the tensors' memory is kept alive
        // and untouched during their jobs by the caller (documented above).
        let backend = unsafe { HostBackend::from_raw(layout, HostBackendOptions::default()) };
        Ok(Self {
            worker: OffloadWorker::new(backend, true),
            _pool: pool,
            plan: None,
            pool_bytes,
        })
    }

    /// Bytes of the host pool.
    #[getter]
    fn pool_bytes(&self) -> u64 {
        self.pool_bytes
    }

    /// Binds the step's plan (the bytes `SchedulerCore.build_step` made).
    fn bind(&mut self, plan: &[u8]) -> PyResult<()> {
        self.plan = Some(decode_plan(plan).map_err(value_error)?);
        Ok(())
    }

    /// Hook 1: flushed jobs are finished before the step reuses their blocks.
    fn handle_preemptions(&mut self) -> PyResult<()> {
        let plan = self
            .plan
            .as_mut()
            .ok_or_else(|| runtime_error("no plan bound"))?;
        self.worker.handle_preemptions(plan).map_err(runtime_error)
    }

    /// Hook 2: stores queued last step, then this step's loads, start.
    fn start_transfers(&mut self) -> PyResult<()> {
        let plan = self
            .plan
            .as_ref()
            .ok_or_else(|| runtime_error("no plan bound"))?;
        self.worker.start_transfers(plan).map_err(runtime_error)
    }

    /// Hook 3 (after the step's compute): this step's stores are queued for
    /// the next step.
    fn queue_stores(&mut self) -> PyResult<()> {
        let plan = self
            .plan
            .as_mut()
            .ok_or_else(|| runtime_error("no plan bound"))?;
        self.worker.queue_stores(plan);
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
        let r = self.worker.get_finished();
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
        self.worker.backend_mut().set_fault(JobId(job), fault);
        Ok(())
    }

    /// Lets a stalled job run now (its report comes late). Whether it was stalled.
    fn release_stalled(&mut self, job: u64) -> bool {
        self.worker.backend_mut().release_stalled(JobId(job))
    }

    /// Cancels a job that has not started copying (a stalled one): it will
    /// never write nor report. Whether it was cancelled.
    fn cancel(&mut self, job: u64) -> bool {
        let cancelled = self.worker.backend_mut().cancel_stalled(JobId(job));
        if cancelled {
            self.worker.forget_job(JobId(job));
        }
        cancelled
    }

    /// Jobs submitted and not reported yet.
    fn in_flight(&self) -> usize {
        use kvoffload::worker::TransferBackend;
        self.worker.backend().in_flight()
    }
}

/// The jobs of an encoded plan: `(loads, stores, flush)` job ids (tests, debugging).
#[pyfunction]
fn plan_jobs(plan: &[u8]) -> PyResult<(Vec<u64>, Vec<u64>, Vec<u64>)> {
    let p = decode_plan(plan).map_err(value_error)?;
    Ok((
        p.loads.iter().map(|l| l.job.0).collect(),
        p.stores.iter().map(|s| s.job.0).collect(),
        p.flush.iter().map(|j| j.0).collect(),
    ))
}

/// The key kvoffload gives a block hash (for tests and events).
#[pyfunction]
fn chunk_key(block_hash: Vec<u8>) -> u64 {
    block_hash_to_key(&block_hash)
}

fn block_hash_to_key(h: &[u8]) -> u64 {
    block_hash(h).0
}

/// kvoffload's Python module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SchedulerCore>()?;
    m.add_class::<HostWorkerCore>()?;
    m.add_function(wrap_pyfunction!(chunk_key, m)?)?;
    m.add_function(wrap_pyfunction!(plan_jobs, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
