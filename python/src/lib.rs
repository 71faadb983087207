//! `kvoffload._native`: Python bindings of kvoffload's control plane
//! ([`kvoffload::scheduler::Scheduler`]) and data plane
//! ([`kvoffload::worker::OffloadWorker`] over the host backend). A thin layer:
//! it translates names and values (request ids as strings, vLLM's block
//! hashes as bytes, block lists as Python lists) and holds no logic of its
//! own. The vLLM connector (`kvoffload.vllm`) is written on top of it.

use std::collections::HashMap;
use std::sync::Arc;

use kvoffload::engine::to_worker_plan;
use kvoffload::manager::LookupResult;
use kvoffload::scheduler::{LookupOutcome, ScheduledRequest, Scheduler, StepInput, WorkerReport};
use kvoffload::worker::Fault;
use kvoffload::worker::{
    GpuLayout, GpuLayoutKind, GpuRegion, HostBackend, HostBackendOptions, HostBuffer,
    HostRowLayout, OffloadWorker, StepPlan, WorkerLayout, decode_plan, encode_plan,
};
use kvoffload::{
    BlockHash, ChunkKey, GpuBlockId, JobId, ManualClock, MonotonicClock, OffloadConfig, RequestId,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use rustc_hash::FxHashMap;

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

fn blocks(ids: &[u32]) -> Vec<GpuBlockId> {
    ids.iter().map(|&b| GpuBlockId(b)).collect()
}

/// Request names (vLLM's request ids) and kvoffload's numeric ids.
#[derive(Default)]
struct Names {
    ids: FxHashMap<String, RequestId>,
    names: FxHashMap<RequestId, String>,
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

/// A request the scheduler tracks: vLLM's `Request` object (read for its
/// token count and block hashes) and the hashes already given to the scheduler.
struct Tracked {
    request: Py<PyAny>,
    /// Its `request_id` object: the scheduler output's keys are this object,
    /// so a request is found by the object's address first.
    name: Py<PyAny>,
    hashes: Vec<BlockHash>,
}

/// The control plane for one engine: vLLM's scheduler-side connector hooks.
#[pyclass(module = "kvoffload._native", unsendable)]
struct SchedulerCore {
    s: Scheduler,
    cfg: OffloadConfig,
    names: Names,
    tracked: FxHashMap<RequestId, Tracked>,
    /// Tracked requests by the address of their `request_id` object (alive
    /// while tracked, so the address is theirs), with the number of block
    /// hashes given to the scheduler (the per-step check reads only this).
    by_address: FxHashMap<usize, (RequestId, usize)>,
    /// Finished requests the scheduler may still track (jobs in flight):
    /// forgotten once it no longer does.
    finishing: Vec<RequestId>,
    /// vLLM's block hash (bytes) of every chunk key stored or being stored,
    /// for the KV events; dropped when the key leaves the tier.
    key_bytes: FxHashMap<u64, Py<PyAny>>,
    /// Whether vLLM publishes KV events (`kv_events_config`): without, the
    /// tier's events are dropped and no hash is kept for them.
    kv_events: bool,
    wire: Vec<u8>,
    /// Set when the scheduler runs on a manual clock (tests).
    manual: Option<ManualClock>,
    /// Counter values at the last `take_stats` (its counters are deltas).
    last_counters: Counters,
}

/// The cumulative counters `take_stats` reports as deltas.
#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    allocation_failures: u64,
    stores_skipped: u64,
    stalled_stores: u64,
    stalled_loads: u64,
    late_reports: u64,
}

impl SchedulerCore {
    /// Gives the scheduler the request's new block hashes, with its token
    /// count; `force`: the token count even when no block completed (a lookup
    /// or the request's end reads it). Store planning needs no fresher count:
    /// a chunk is stored only up to the hashed blocks, which the count sent
    /// with them already covers.
    fn sync(&mut self, py: Python<'_>, id: RequestId, force: bool) -> PyResult<()> {
        let Some(t) = self.tracked.get_mut(&id) else {
            return Ok(());
        };
        let req = t.request.bind(py);
        let list = req.getattr(intern!(py, "block_hashes"))?;
        let list = list.cast::<PyList>()?;
        let sent = t.hashes.len();
        if list.len() == sent && !force {
            return Ok(());
        }
        for i in sent..list.len() {
            t.hashes
                .push(block_hash(list.get_item(i)?.cast::<PyBytes>()?.as_bytes()));
        }
        if let Some(entry) = self.by_address.get_mut(&(t.name.as_ptr() as usize)) {
            entry.1 = t.hashes.len();
        }
        let num_tokens: u64 = req.getattr(intern!(py, "num_tokens"))?.extract()?;
        self.s
            .update_request(id, num_tokens, &t.hashes[sent..])
            .map_err(value_error)
    }

    /// The request a scheduler-output key names: by the key object's
    /// address, else by its text; `None` for one the connector does not track.
    fn resolve(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<RequestId>> {
        Ok(self.resolve_with_hashes(key)?.map(|(id, _)| id))
    }

    /// [`Self::resolve`], with the block hashes the scheduler has of it
    /// (`usize::MAX` when found by text: unknown, so checked).
    fn resolve_with_hashes(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<(RequestId, usize)>> {
        if let Some(&found) = self.by_address.get(&(key.as_ptr() as usize)) {
            return Ok(Some(found));
        }
        let name = key.cast::<pyo3::types::PyString>()?;
        Ok(self
            .names
            .ids
            .get(name.to_str()?)
            .map(|&id| (id, usize::MAX)))
    }

    /// [`Self::sync`] when a block ending at or before `tokens` may have
    /// been hashed since the last one, `sent` hashes given so far (else
    /// nothing is read).
    fn sync_until(
        &mut self,
        py: Python<'_>,
        id: RequestId,
        sent: usize,
        tokens: u64,
    ) -> PyResult<()> {
        let tpb = u64::from(self.cfg.tokens_per_block);
        if sent != usize::MAX && (sent as u64 + 1).saturating_mul(tpb) > tokens {
            return Ok(());
        }
        self.sync(py, id, false)
    }

    /// Forgets the finished requests the scheduler no longer tracks.
    fn forget_finished(&mut self) {
        let (s, tracked, names, by_address) = (
            &self.s,
            &mut self.tracked,
            &mut self.names,
            &mut self.by_address,
        );
        self.finishing.retain(|&id| {
            let gone = !s.has_request(id);
            if gone {
                if let Some(t) = tracked.remove(&id) {
                    by_address.remove(&(t.name.as_ptr() as usize));
                }
                names.forget(id);
            }
            !gone
        });
    }

    /// Records vLLM's hash bytes of the keys a store job writes: the job's
    /// keys are chunks of its request in increasing order (chunks the tier
    /// already holds are left out), the first found from the request's end.
    fn remember_store_keys(
        &mut self,
        py: Python<'_>,
        req: RequestId,
        keys: &[ChunkKey],
    ) -> PyResult<()> {
        let (Some(t), Some(first)) = (self.tracked.get(&req), keys.first()) else {
            return Ok(());
        };
        let bpc = self.cfg.blocks_per_chunk as usize;
        let chunks = t.hashes.len() / bpc;
        let key_of = |c: usize| ChunkKey::for_group(t.hashes[(c + 1) * bpc - 1], 0);
        let Some(mut c) = (0..chunks).rev().find(|&c| key_of(c) == *first) else {
            return Ok(());
        };
        let list = t.request.bind(py).getattr(intern!(py, "block_hashes"))?;
        let list = list.cast::<PyList>()?;
        for k in keys {
            while c < chunks && key_of(c) != *k {
                c += 1;
            }
            if c == chunks {
                break;
            }
            self.key_bytes
                .entry(k.0)
                .or_insert(list.get_item((c + 1) * bpc - 1)?.unbind());
            c += 1;
        }
        Ok(())
    }
}

#[pymethods]
impl SchedulerCore {
    /// A scheduler for the engine configuration `config_json` (kvoffload's
    /// keys, validated: an unknown key or a bad value raises `ValueError`
    /// naming it). `watchdog`: start the stall watchdog thread.
    /// `manual_clock`: time moves only with `advance_clock` (tests).
    /// `kv_events`: vLLM publishes KV events (else `take_events` is empty).
    #[new]
    #[pyo3(signature = (config_json, watchdog = true, manual_clock = false, kv_events = true))]
    fn new(
        config_json: &str,
        watchdog: bool,
        manual_clock: bool,
        kv_events: bool,
    ) -> PyResult<Self> {
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
            tracked: FxHashMap::default(),
            by_address: FxHashMap::default(),
            finishing: Vec::new(),
            key_bytes: FxHashMap::default(),
            kv_events,
            last_counters: Counters::default(),
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

    /// A new request: vLLM's `Request` object (its `request_id`,
    /// `num_prompt_tokens`, `num_tokens` and `block_hashes` are read now and
    /// at the hooks that need them).
    fn add_request(&mut self, py: Python<'_>, request: Bound<'_, PyAny>) -> PyResult<()> {
        let name_obj = request.getattr(intern!(py, "request_id"))?;
        let name: String = name_obj.extract()?;
        let prompt: u64 = request
            .getattr(intern!(py, "num_prompt_tokens"))?
            .extract()?;
        let id = self.names.intern(&name);
        self.s.add_request(id, prompt, &[]).map_err(value_error)?;
        let address = name_obj.as_ptr() as usize;
        let old = self.tracked.insert(
            id,
            Tracked {
                request: request.unbind(),
                name: name_obj.unbind(),
                hashes: Vec::new(),
            },
        );
        if let Some(old) = old {
            self.by_address.remove(&(old.name.as_ptr() as usize));
        }
        self.by_address.insert(address, (id, 0));
        self.sync(py, id, true)
    }

    /// Tokens beyond `computed_tokens` the host tier can supply, or `None`:
    /// ask again later (vLLM's `get_num_new_matched_tokens`).
    fn lookup(&mut self, py: Python<'_>, req: &str, computed_tokens: u64) -> PyResult<Option<u64>> {
        let id = self.names.get(req)?;
        self.sync(py, id, true)?;
        match self.s.lookup(id, computed_tokens).map_err(value_error)? {
            LookupOutcome::Hit(n) => Ok(Some(n)),
            LookupOutcome::Defer => Ok(None),
        }
    }

    /// The request's allocated blocks; creates its load job when
    /// `external_tokens > 0` (vLLM's `update_state_after_alloc`).
    fn on_alloc(
        &mut self,
        py: Python<'_>,
        req: &str,
        block_ids: Vec<u32>,
        external_tokens: u64,
    ) -> PyResult<Option<u64>> {
        let id = self.names.get(req)?;
        self.sync(py, id, false)?;
        Ok(self
            .s
            .on_alloc(id, &blocks(&block_ids), external_tokens)
            .map_err(value_error)?
            .map(|j| j.0))
    }

    /// One step (vLLM's `build_connector_meta`), from the scheduler output's
    /// parts: `num_scheduled` (`{request: tokens}`, in scheduling order),
    /// `new_requests` (`[(request, block ids, computed tokens)]`, whole
    /// tables), the cached requests' `cached_ids`, `cached_blocks` (each
    /// `None` or a tuple of per-group block lists: this step's additions),
    /// `cached_computed` and `resumed` (ids whose list is the whole table),
    /// then the preempted and finished requests. Requests the connector does
    /// not track are skipped. Returns `(plan, load_requests, failed_loads)`:
    /// the workers' plan as compact bytes, the request of every load job in
    /// it (`{job: request}`), and the requests whose load failed or stalled
    /// (they must recompute).
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn build_step<'py>(
        &mut self,
        py: Python<'py>,
        num_scheduled: Bound<'py, PyDict>,
        new_requests: Vec<(String, Vec<u32>, u64)>,
        cached_ids: Bound<'py, PyList>,
        cached_blocks: Bound<'py, PyList>,
        cached_computed: Bound<'py, PyList>,
        resumed: Bound<'py, PyAny>,
        preempted: Vec<String>,
        finished: Vec<String>,
    ) -> PyResult<(Bound<'py, PyBytes>, HashMap<u64, String>, Vec<String>)> {
        // Each scheduled request's (id, new blocks, whole table, computed
        // tokens): the cached requests in their order (the running ones come
        // in the order `num_scheduled` lists them), then the new ones.
        type Part = (RequestId, Vec<GpuBlockId>, bool, u64);
        let mut parts: Vec<Option<Part>> = Vec::with_capacity(num_scheduled.len());
        let has_resumed = resumed.len()? > 0;
        for (i, key) in cached_ids.iter().enumerate() {
            let Some(id) = self.resolve(&key)? else {
                continue;
            };
            let groups = cached_blocks.get_item(i)?;
            let new_blocks = if groups.is_none() {
                Vec::new()
            } else {
                let ids = groups.get_item(0)?;
                if ids.len()? == 0 {
                    Vec::new()
                } else {
                    blocks(&ids.extract::<Vec<u32>>()?)
                }
            };
            let full = has_resumed && resumed.contains(&key)?;
            let computed: u64 = cached_computed.get_item(i)?.extract()?;
            parts.push(Some((id, new_blocks, full, computed)));
        }
        for (name, ids, computed) in &new_requests {
            if let Some(&id) = self.names.ids.get(name.as_str()) {
                parts.push(Some((id, blocks(ids), true, *computed)));
            }
        }
        // Out-of-order keys are found through this index, built on the first.
        let mut index: Option<FxHashMap<RequestId, usize>> = None;
        let mut cursor = 0;
        let mut input = StepInput::default();
        input.scheduled.reserve(num_scheduled.len());
        for (key, n) in num_scheduled.iter() {
            let Some((id, sent)) = self.resolve_with_hashes(&key)? else {
                continue;
            };
            let in_order = matches!(parts.get(cursor), Some(Some(p)) if p.0 == id);
            let at = if in_order {
                cursor += 1;
                Some(cursor - 1)
            } else {
                let index = index.get_or_insert_with(|| {
                    parts
                        .iter()
                        .enumerate()
                        .filter_map(|(i, p)| p.as_ref().map(|p| (p.0, i)))
                        .collect()
                });
                index.get(&id).copied()
            };
            let (_, new_block_ids, full_table, computed_tokens) = at
                .and_then(|i| parts[i].take())
                .unwrap_or((id, Vec::new(), false, 0));
            let scheduled_tokens: u64 = n.extract()?;
            // Store planning this step reads hashes up to the tokens computed
            // by its end: a block completed past them can wait.
            self.sync_until(
                py,
                id,
                sent,
                computed_tokens.saturating_add(scheduled_tokens),
            )?;
            input.scheduled.push(ScheduledRequest {
                req: id,
                new_block_ids,
                computed_tokens,
                scheduled_tokens,
                full_table,
            });
        }
        for r in &preempted {
            if let Some(&id) = self.names.ids.get(r.as_str()) {
                input.preempted.push(id);
            }
        }
        for r in &finished {
            if let Some(&id) = self.names.ids.get(r.as_str()) {
                input.finished.push(id);
            }
        }
        let plan = self.s.build_step(&input).map_err(value_error)?;
        if self.kv_events {
            for st in &plan.stores {
                self.remember_store_keys(py, st.req, &st.keys)?;
            }
        }
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
        self.finishing.extend_from_slice(&input.finished);
        self.forget_finished();
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
        let answer = (
            out.finished_loads.iter().map(name).collect(),
            out.failed_loads.iter().map(name).collect(),
            out.rejected
                .iter()
                .map(|(j, e)| format!("{j}: {e}"))
                .collect(),
        );
        self.forget_finished();
        answer
    }

    /// The request finished (vLLM's `request_finished`); its last stores
    /// come at the next step listing it in `finished`.
    fn request_finished(
        &mut self,
        py: Python<'_>,
        req: &str,
        block_ids: Vec<u32>,
        aborted: bool,
        computed_tokens: u64,
    ) -> PyResult<()> {
        let id = self.names.get(req)?;
        self.sync(py, id, true)?;
        self.s
            .request_finished(id, &blocks(&block_ids), aborted, computed_tokens)
            .map_err(value_error)
    }

    /// vLLM's `reset_cache`.
    fn reset(&mut self) -> PyResult<()> {
        self.s.reset().map_err(value_error)?;
        // The tier is empty: as vLLM, no removal event follows a reset.
        self.key_bytes.clear();
        self.forget_finished();
        Ok(())
    }

    /// Requests the binding holds (names and `Request` objects): a leak check.
    fn held_requests(&self) -> usize {
        self.tracked.len()
    }

    /// The host tier's events: `(removed, metadata_only, [block hash, ...])`,
    /// each key as vLLM's block hash (bytes) of the chunk's last block (or
    /// its 8-byte key where the hash is not known).
    #[allow(clippy::type_complexity)]
    fn take_events(&mut self, py: Python<'_>) -> Vec<(bool, bool, Vec<Py<PyAny>>)> {
        if !self.kv_events {
            self.s.discard_events();
            return Vec::new();
        }
        let events = self.s.take_events();
        let mut out = Vec::with_capacity(events.len());
        let mut removed: Vec<ChunkKey> = Vec::new();
        for e in events {
            let mut hashes = Vec::with_capacity(e.keys.len());
            for k in e.keys.iter() {
                if e.removed {
                    removed.push(*k);
                }
                let known = self.key_bytes.get(&k.0).map(|b| b.clone_ref(py));
                hashes.push(
                    known.unwrap_or_else(|| {
                        PyBytes::new(py, &k.0.to_le_bytes()).into_any().unbind()
                    }),
                );
            }
            out.push((e.removed, e.metadata_only, hashes));
        }
        // A key evicted and stored again in one batch stays known.
        for k in removed {
            if self.s.manager().lookup(k) == LookupResult::Miss {
                self.key_bytes.remove(&k.0);
            }
        }
        out
    }

    /// Chunk keys whose vLLM hash is held for the events (a leak check).
    fn held_hashes(&self) -> usize {
        self.key_bytes.len()
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

    /// What vLLM's stats carry for one step, since the last call: `{name:
    /// value}` with the gauges (`usage`, `write_usage`, `read_usage`,
    /// `stalled_jobs`, `quarantined_chunks`), the counters' increments
    /// (`allocation_failures`, `stores_skipped`, `stalled_stores`,
    /// `stalled_loads`, `late_reports`) and the raw observations
    /// (`allocation_sizes`, `lookup_sync_delays`, `lookup_async_delays`).
    fn take_stats<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (sync, asynchronous) = self.s.take_lookup_delays();
        let sizes = self.s.manager_mut().take_allocation_sizes();
        let m = self.s.metrics();
        let st = self.s.manager().stats();
        let now = Counters {
            allocation_failures: st.allocation_failures,
            stores_skipped: st.stores_skipped,
            stalled_stores: m.stalled_stores,
            stalled_loads: m.stalled_loads,
            late_reports: m.late_reports,
        };
        let last = std::mem::replace(&mut self.last_counters, now);
        let d = PyDict::new(py);
        d.set_item("usage", st.usage)?;
        d.set_item("write_usage", st.write_usage)?;
        d.set_item("read_usage", st.read_usage)?;
        d.set_item("stalled_jobs", m.stalled_jobs)?;
        d.set_item("quarantined_chunks", m.quarantined_chunks)?;
        let delta = |a: u64, b: u64| a.saturating_sub(b);
        d.set_item(
            "allocation_failures",
            delta(now.allocation_failures, last.allocation_failures),
        )?;
        d.set_item(
            "stores_skipped",
            delta(now.stores_skipped, last.stores_skipped),
        )?;
        d.set_item(
            "stalled_stores",
            delta(now.stalled_stores, last.stalled_stores),
        )?;
        d.set_item(
            "stalled_loads",
            delta(now.stalled_loads, last.stalled_loads),
        )?;
        d.set_item("late_reports", delta(now.late_reports, last.late_reports))?;
        d.set_item("allocation_sizes", sizes)?;
        d.set_item("lookup_sync_delays", sync)?;
        d.set_item("lookup_async_delays", asynchronous)?;
        Ok(d)
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

    /// Waits (at most `timeout_s`) until every submitted job not held stalled
    /// has copied its bytes; they report at the next poll (tests: completion
    /// independent of thread timing).
    #[pyo3(signature = (timeout_s = 30.0))]
    fn settle(&mut self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = std::time::Duration::from_secs_f64(timeout_s.max(0.0));
        let backend = self.worker.backend_mut();
        py.detach(|| backend.settle(timeout)).map_err(runtime_error)
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

/// A step plan's transfers with their GPU blocks, for tests and tools:
/// `(loads, stores, flush)`, each load and store as `(job, gpu_blocks)`.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn plan_transfers(plan: &[u8]) -> PyResult<(Vec<(u64, Vec<u32>)>, Vec<(u64, Vec<u32>)>, Vec<u64>)> {
    let p = decode_plan(plan).map_err(value_error)?;
    let blocks = |s: &kvoffload::worker::TransferSpec| s.gpu_blocks.iter().map(|b| b.0).collect();
    Ok((
        p.loads.iter().map(|l| (l.job.0, blocks(&l.spec))).collect(),
        p.stores
            .iter()
            .map(|s| (s.job.0, blocks(&s.spec)))
            .collect(),
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
    m.add_function(wrap_pyfunction!(plan_transfers, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
