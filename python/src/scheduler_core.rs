//! `SchedulerCore`: the control plane for one engine, vLLM's scheduler-side
//! connector hooks over [`kvoffload::scheduler::Scheduler`].

use std::collections::HashMap;

use kvoffload::adapter::encode_worker_plan;
use kvoffload::scheduler::hybrid::{
    Attention, BoundaryState, GroupAlloc, GroupShape, KvGroups, Retention,
};
use kvoffload::scheduler::{
    CompletionReport, GroupSpan, LookupOutcome, ScheduledRequest, Scheduler, StepInput,
};
use kvoffload::{
    BlockHash, ChunkKey, GpuBlockId, JobId, ManualClock, MonotonicClock, OffloadConfig, RequestId,
    SharedClock,
};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use rustc_hash::FxHashMap;

use crate::borrowed::{for_each_entry, list_item};
use crate::convert::{block_hash, block_list, blocks, int_u64, runtime_error, value_error};
use crate::kv_events::{ChunkSource, EventTracker, block_hash_index};
use crate::names::Names;

/// The most shares a chunk may have in a remote tier (KV heads as shares:
/// models have at most a few hundred).
const MAX_REMOTE_SHARES: u32 = 4096;
/// A request the scheduler tracks: vLLM's `Request` object (read for its
/// token count and block hashes) and the hashes already given to the scheduler.
struct Tracked {
    request: Py<PyAny>,
    /// Its `request_id` object: the scheduler output's keys are this object,
    /// so a request is found by the object's address first.
    name: Py<PyAny>,
    hashes: Vec<BlockHash>,
    /// Its prompt's tokens.
    prompt_tokens: u64,
    /// The token count last given to the scheduler exceeds the prompt: the
    /// request decodes, which a fresher count would not change
    /// ([`SchedulerCore::fresh_token_counts`]).
    past_prompt: bool,
}

/// A scheduled request read from the scheduler output: the key object's
/// address (0 for a new request), the id, the hashes the scheduler has, the
/// new blocks (group 0's), whether they are the whole table, the computed
/// tokens, and with several KV groups the new blocks of groups 1, 2, ...
type Part = (
    usize,
    RequestId,
    usize,
    Vec<GpuBlockId>,
    bool,
    u64,
    Vec<Vec<GpuBlockId>>,
);

/// A cached request's entry in [`SchedulerCore::positions`].
#[derive(Debug, Clone, Copy)]
struct Position {
    /// Its key object's address (0: none).
    address: usize,
    id: RequestId,
    /// Block hashes the scheduler had of it (may lag: see `positions`).
    sent: usize,
    /// [`Scheduler::store_horizon`] after the last step that listed it (0:
    /// unknown); cleared by its lookup and by a reset.
    horizon: u64,
}

impl Position {
    /// No request (a position not seen yet).
    const NONE: Self = Self {
        address: 0,
        id: RequestId(0),
        sent: 0,
        horizon: 0,
    };
}

/// The cached requests' lists of a scheduler output (vLLM's
/// `CachedRequestData`), read by index.
struct CachedLists<'a, 'py> {
    ids: &'a Bound<'py, PyList>,
    blocks: &'a Bound<'py, PyList>,
    computed: &'a Bound<'py, PyList>,
    resumed: &'a Bound<'py, PyAny>,
    has_resumed: bool,
    /// KV groups (the blocks of groups past the first are read too).
    groups: usize,
}

impl CachedLists<'_, '_> {
    /// Cached request `i`'s entries, its key being `key`: whether its block
    /// list is the whole table (resumed), its computed tokens, its new blocks.
    fn read(
        &self,
        i: usize,
        key: Borrowed<'_, '_, PyAny>,
    ) -> PyResult<(bool, u64, Vec<GpuBlockId>)> {
        let full = self.has_resumed && self.resumed.contains(key.to_owned())?;
        let computed = int_u64(list_item(self.computed, i)?)?;
        // Borrowed (no reference taken); its tuple's item is read at once.
        let groups = list_item(self.blocks, i)?;
        let new_blocks = if groups.is_none() {
            Vec::new()
        } else {
            block_list(&groups.get_item(0)?)?
        };
        Ok((full, computed, new_blocks))
    }

    /// Cached request `i`'s new blocks in groups 1, 2, ... (empty with one
    /// group, or when it has no new blocks).
    fn read_other_groups(&self, i: usize) -> PyResult<Vec<Vec<GpuBlockId>>> {
        if self.groups < 2 {
            return Ok(Vec::new());
        }
        let groups = list_item(self.blocks, i)?.to_owned();
        if groups.is_none() {
            return Ok(Vec::new());
        }
        (1..self.groups)
            .map(|g| block_list(&groups.get_item(g)?))
            .collect()
    }
}

/// The control plane for one engine: vLLM's scheduler-side connector hooks.
#[pyclass(module = "kvoffload._native", unsendable)]
pub(crate) struct SchedulerCore {
    s: Scheduler,
    cfg: OffloadConfig,
    names: Names,
    tracked: FxHashMap<RequestId, Tracked>,
    /// Tracked requests by the address of their `request_id` object (alive
    /// while tracked, so the address is theirs), with the number of block
    /// hashes given to the scheduler (the per-step check reads only this).
    by_address: FxHashMap<usize, (RequestId, usize)>,
    /// The last step's cached requests by position in vLLM's list: the key
    /// object's address (0: none), the request and the block hashes the
    /// scheduler had of it. vLLM lists its running requests in the same order
    /// step after step, so the request at a position is usually the one found
    /// there last time: matched by address without a hash lookup. Only
    /// addresses in `by_address` are kept (a tracked request's key object is
    /// alive, so its address is its own); a forgotten request's are cleared.
    /// The hash count may lag behind (a hook between steps gave more): a
    /// lower count only makes the step look at the request's hashes again.
    ///
    /// A request found there with no new blocks, not resumed, and whose
    /// computed plus scheduled tokens stay below its cached store horizon is
    /// left out of the step's input: the scheduler would plan nothing for it
    /// and change nothing of it ([`Scheduler::store_horizon`]), and its new
    /// block hashes can wait until it may store. In steady decode that is all
    /// but the requests completing a chunk (with `offload_prompt_only`, all
    /// once their prompt is stored), so the step touches the others' state
    /// in neither the binding nor the scheduler.
    positions: Vec<Position>,
    /// Positions whose request the step's input lists (their horizons are
    /// read again after the step).
    listed: Vec<usize>,
    /// Finished requests the scheduler may still track (jobs in flight):
    /// forgotten once it no longer does.
    finishing: Vec<RequestId>,
    /// The KV events' hashes and payloads of the chunks in the tier.
    events: EventTracker,
    /// Whether vLLM publishes KV events (`kv_events_config`): without, the
    /// tier's events are dropped and no hash is kept for them.
    kv_events: bool,
    wire: Vec<u8>,
    /// The step's parts and input, kept between steps: with a thousand
    /// requests they are about 100 KiB, which the allocator would otherwise
    /// give back to the kernel and fault in again every step.
    parts: Vec<Option<Part>>,
    input: StepInput,
    /// Set when the scheduler runs on a manual clock (tests).
    manual: Option<ManualClock>,
    /// The scheduler's clock (also the remote tier's, for its deadlines).
    clock: SharedClock,
    /// Counter values at the last `take_stats` (its counters are deltas).
    last_counters: Counters,
    /// vLLM's block hashes per GPU block (`block_size / prefix_match_unit`;
    /// 1 unless `prefix_match_unit` is finer than the blocks): a block's
    /// hash is the last one in it, the one that covers its whole prefix
    /// (vLLM's `BlockHashListWithBlockSize`).
    hashes_per_block: usize,
    /// Store planning reads the current token count of each scheduled
    /// request not yet known to decode (set with EAGLE draft groups): a
    /// draft group's last chunk is volatile once the request decodes, which
    /// the count tells (vLLM's `storable_chunks`); a count from when the
    /// last block completed would keep a request that just began to decode
    /// in its prompt, and store that chunk. Once a count given exceeds the
    /// prompt, a fresher one changes nothing that store planning reads
    /// (the count only grows while the request runs, and stores stop at
    /// its hashed blocks).
    fresh_token_counts: bool,
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
    /// or the request's end reads it). Store planning needs no fresher count
    /// (a chunk is stored only up to the hashed blocks, which the count sent
    /// with them already covers) but with EAGLE draft groups
    /// ([`Self::fresh_token_counts`]).
    /// Returns the number of hashes the scheduler has of the request then (0
    /// for one the connector does not track).
    fn sync(&mut self, py: Python<'_>, id: RequestId, force: bool) -> PyResult<usize> {
        let Some(t) = self.tracked.get_mut(&id) else {
            return Ok(0);
        };
        let req = t.request.bind(py);
        let list = req.getattr(intern!(py, "block_hashes"))?;
        let list = list.cast::<PyList>()?;
        let sent = t.hashes.len();
        let per_block = self.hashes_per_block;
        let blocks = list.len() / per_block;
        // Partial tails need every hash, not only each block's last.
        let units_sent = if self.s.partial_tails_enabled() {
            self.s.num_hash_units(id)
        } else {
            list.len()
        };
        if blocks == sent && units_sent == list.len() && !force {
            return Ok(sent);
        }
        if units_sent < list.len() {
            let units = (units_sent..list.len())
                .map(|i| Ok(block_hash(list.get_item(i)?.cast::<PyBytes>()?.as_bytes())))
                .collect::<PyResult<Vec<_>>>()?;
            self.s.add_hash_units(id, &units).map_err(value_error)?;
        }
        for b in sent..blocks {
            let item = list.get_item(block_hash_index(b, per_block))?;
            t.hashes
                .push(block_hash(item.cast::<PyBytes>()?.as_bytes()));
        }
        if let Some(entry) = self.by_address.get_mut(&(t.name.as_ptr() as usize)) {
            entry.1 = t.hashes.len();
        }
        let num_tokens: u64 = req.getattr(intern!(py, "num_tokens"))?.extract()?;
        t.past_prompt = num_tokens > t.prompt_tokens;
        self.s
            .update_request(id, num_tokens, &t.hashes[sent..])
            .map_err(value_error)?;
        Ok(t.hashes.len())
    }

    /// vLLM's tokens a block hash (its `prefix_match_unit`).
    fn tokens_per_hash(&self) -> usize {
        self.cfg.tokens_per_block as usize / self.hashes_per_block.max(1)
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
    /// nothing is read), or forced while [`Self::fresh_token_counts`] asks
    /// for the request's count. Returns the hashes the scheduler has then
    /// (`sent` when nothing was read).
    fn sync_until(
        &mut self,
        py: Python<'_>,
        id: RequestId,
        sent: usize,
        tokens: u64,
    ) -> PyResult<usize> {
        let tpb = u64::from(self.cfg.tokens_per_block);
        if self.fresh_token_counts && self.tracked.get(&id).is_some_and(|t| !t.past_prompt) {
            return self.sync(py, id, true);
        }
        if sent != usize::MAX && (sent as u64 + 1).saturating_mul(tpb) > tokens {
            return Ok(sent);
        }
        self.sync(py, id, false)
    }

    /// Forgets the key object at `address` (its request is forgotten or
    /// replaced): out of `by_address` and of `positions`.
    fn forget_address(&mut self, address: usize) {
        self.by_address.remove(&address);
        for p in self.positions.iter_mut().filter(|p| p.address == address) {
            p.address = 0;
        }
    }

    /// Forgets the finished requests the scheduler no longer tracks.
    fn forget_finished(&mut self) {
        let mut finishing = std::mem::take(&mut self.finishing);
        finishing.retain(|&id| {
            let gone = !self.s.has_request(id);
            if gone {
                if let Some(t) = self.tracked.remove(&id) {
                    self.forget_address(t.name.as_ptr() as usize);
                }
                self.names.forget(id);
            }
            !gone
        });
        self.finishing = finishing;
    }

    /// Records the chunks a store (or fetch) job writes for the KV events.
    /// `groups`: the job's group spans (empty: every key is group 0's).
    fn remember_store_keys(
        &mut self,
        py: Python<'_>,
        req: RequestId,
        keys: &[ChunkKey],
        groups: &[GroupSpan],
    ) -> PyResult<()> {
        let Some(t) = self.tracked.get(&req) else {
            return Ok(());
        };
        let request = t.request.bind(py);
        let src = ChunkSource {
            request,
            hashes: &t.hashes,
        };
        if groups.is_empty() {
            return self.events.record_store(&src, keys, 0);
        }
        let mut at = 0;
        for (g, span) in groups.iter().enumerate() {
            let n = span.num_keys as usize;
            let part = keys.get(at..at + n).unwrap_or_default();
            self.events.record_store(&src, part, g as u32)?;
            at += n;
        }
        Ok(())
    }

    /// The part of cached request `i` (`None`: not tracked).
    fn cached_part(&self, lists: &CachedLists<'_, '_>, i: usize) -> PyResult<Option<Part>> {
        // Borrowed reads (`crate::borrowed`): the key is read before any
        // Python code may run (the set's comparison gets its own reference;
        // the count's conversion comes after).
        let key = list_item(lists.ids, i)?;
        let Some((id, sent)) = self.resolve_with_hashes(&key)? else {
            return Ok(None);
        };
        let address = key.as_ptr() as usize;
        let (full, computed, new_blocks) = lists.read(i, key)?;
        let others = lists.read_other_groups(i)?;
        Ok(Some((
            address, id, sent, new_blocks, full, computed, others,
        )))
    }

    /// Adds cached request `i`, whose key is `key` (it is the next one
    /// `num_scheduled` lists, `n` tokens), to the step's input: the lockstep
    /// path of [`Self::build_step_with`], found by position when it is where
    /// it was last step (see `positions`).
    fn schedule_cached(
        &mut self,
        py: Python<'_>,
        input: &mut StepInput,
        lists: &CachedLists<'_, '_>,
        i: usize,
        key: Borrowed<'_, '_, PyAny>,
        n: Borrowed<'_, '_, PyAny>,
    ) -> PyResult<()> {
        // Borrowed reads (`crate::borrowed`): the key and the count are read
        // before any Python code may run (the set's comparison gets its own
        // reference of the key).
        let address = key.as_ptr() as usize;
        let scheduled_tokens = int_u64(n)?;
        let (id, sent, registered, horizon) = match self.positions.get(i) {
            Some(p) if p.address == address => (p.id, p.sent, true, p.horizon),
            _ => match self.resolve_with_hashes(&key)? {
                // Found by address (`sent` known): a tracked key object.
                Some((id, sent)) => (id, sent, sent != usize::MAX, 0),
                None => return Ok(()),
            },
        };
        let (full_table, computed_tokens, new_block_ids) = lists.read(i, key)?;
        let group_block_ids = lists.read_other_groups(i)?;
        if !full_table
            && new_block_ids.is_empty()
            && computed_tokens.saturating_add(scheduled_tokens) < horizon
        {
            // Below its store horizon: the step would do nothing with it.
            return Ok(());
        }
        // Store planning this step reads hashes up to the tokens computed by
        // its end: a block completed past them can wait.
        let sent = self.sync_until(
            py,
            id,
            sent,
            computed_tokens.saturating_add(scheduled_tokens),
        )?;
        if registered {
            if self.positions.len() <= i {
                self.positions.resize(i + 1, Position::NONE);
            }
            let p = &mut self.positions[i];
            if p.address != address {
                p.horizon = 0;
            }
            (p.address, p.id, p.sent) = (address, id, sent);
            self.listed.push(i);
        }
        input.scheduled.push(ScheduledRequest {
            req: id,
            new_block_ids,
            computed_tokens,
            scheduled_tokens,
            full_table,
        });
        if lists.groups > 1 {
            input.group_block_ids.push(group_block_ids);
        }
        Ok(())
    }

    /// Adds a scheduled request (its part, `n` tokens) to the step's input,
    /// after giving the scheduler the block hashes its store planning reads.
    fn schedule(
        &mut self,
        py: Python<'_>,
        input: &mut StepInput,
        part: Option<Part>,
        n: Borrowed<'_, '_, PyAny>,
    ) -> PyResult<()> {
        let Some((_, id, sent, new_block_ids, full_table, computed_tokens, group_block_ids)) = part
        else {
            return Ok(());
        };
        let scheduled_tokens = int_u64(n)?;
        // Store planning this step reads hashes up to the tokens computed by
        // its end: a block completed past them can wait.
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
        if self.s.num_groups() > 1 {
            input.group_block_ids.push(group_block_ids);
        }
        Ok(())
    }

    /// [`Self::build_step`] over buffers kept between steps (`parts` and
    /// `input` come in empty).
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn build_step_with<'py>(
        &mut self,
        py: Python<'py>,
        parts: &mut Vec<Option<Part>>,
        input: &mut StepInput,
        num_scheduled: Bound<'py, PyDict>,
        new_requests: Vec<(String, Vec<u32>, u64)>,
        new_group_blocks: Vec<Vec<Vec<u32>>>,
        cached: (
            Bound<'py, PyList>,
            Bound<'py, PyList>,
            Bound<'py, PyList>,
            Bound<'py, PyAny>,
        ),
        preempted: Vec<String>,
        finished: Vec<String>,
    ) -> PyResult<(Bound<'py, PyBytes>, HashMap<u64, String>, Vec<String>)> {
        let (cached_ids, cached_blocks, cached_computed, resumed) = cached;
        let lists = CachedLists {
            ids: &cached_ids,
            blocks: &cached_blocks,
            computed: &cached_computed,
            resumed: &resumed,
            has_resumed: resumed.len()? > 0,
            groups: self.s.num_groups(),
        };
        // The scheduled requests usually come in the cached requests' order
        // (running requests first): those are matched in lockstep, each key
        // against the next cached request's by address. At the first key out
        // of that order, the remaining cached requests and the new ones become
        // parts, matched in order by address or else through an index by id.
        let mut next_cached = 0;
        let mut slow = false;
        let mut index: Option<FxHashMap<RequestId, usize>> = None;
        let mut cursor = 0;
        input.scheduled.reserve(num_scheduled.len());
        for_each_entry(&num_scheduled, |key, n| {
            // The key is read (address, name) before the count's conversion
            // or `sync_until` may run Python code.
            let address = key.as_ptr() as usize;
            if !slow {
                if next_cached < lists.ids.len()
                    && list_item(lists.ids, next_cached)?.as_ptr() as usize == address
                {
                    next_cached += 1;
                    return self.schedule_cached(py, input, &lists, next_cached - 1, key, n);
                }
                slow = true;
                for i in next_cached..lists.ids.len() {
                    if let Some(p) = self.cached_part(&lists, i)? {
                        parts.push(Some(p));
                    }
                }
                for (n, (name, ids, computed)) in new_requests.iter().enumerate() {
                    if let Some(&id) = self.names.ids.get(name.as_str()) {
                        let others = new_group_blocks
                            .get(n)
                            .map(|g| g.iter().map(|ids| blocks(ids)).collect())
                            .unwrap_or_default();
                        parts.push(Some((
                            0,
                            id,
                            usize::MAX,
                            blocks(ids),
                            true,
                            *computed,
                            others,
                        )));
                    }
                }
            }
            while matches!(parts.get(cursor), Some(None)) {
                cursor += 1;
            }
            let in_order = matches!(parts.get(cursor), Some(Some(p)) if p.0 == address);
            let part = if in_order {
                cursor += 1;
                parts[cursor - 1].take()
            } else {
                let Some(id) = self.resolve(&key)? else {
                    return Ok(());
                };
                let index = index.get_or_insert_with(|| {
                    parts
                        .iter()
                        .enumerate()
                        .filter_map(|(i, p)| p.as_ref().map(|p| (p.1, i)))
                        .collect()
                });
                match index.get(&id) {
                    Some(&i) => parts[i].take(),
                    None => Some((address, id, usize::MAX, Vec::new(), false, 0, Vec::new())),
                }
            };
            self.schedule(py, input, part, n)
        })?;
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
        let plan = self.s.build_step(input).map_err(value_error)?;
        for &i in &self.listed {
            if let Some(p) = self.positions.get_mut(i) {
                p.horizon = self.s.store_horizon(p.id).unwrap_or(0);
            }
        }
        if self.kv_events {
            // A fetch job brings chunks into the tier as a store does: its
            // completion announces them (`BlockStored`) by these hashes.
            for st in plan.stores.iter().chain(&plan.fetches) {
                self.remember_store_keys(py, st.req, &st.keys, &st.groups)?;
            }
            // Partial tails' stores, named by vLLM's hash at their boundary.
            let tph = self.tokens_per_hash();
            for t in self.s.last_partial_tails() {
                if let Some(tracked) = self.tracked.get(&t.req) {
                    let request = tracked.request.bind(py);
                    self.events.record_partial_tails(
                        request,
                        std::slice::from_ref(t),
                        tph,
                        true,
                    )?;
                }
            }
        }
        encode_worker_plan(&plan, self.cfg.blocks_per_chunk, &mut self.wire);
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
}

/// Per KV group (`groups` of them, `None`: one), its block in the
/// configuration's blocks, from `block_tokens` (each group's tokens a block;
/// empty: the configuration's for every group).
fn group_block_factors(
    cfg: &OffloadConfig,
    groups: Option<usize>,
    block_tokens: &[u64],
) -> PyResult<Vec<usize>> {
    if block_tokens.is_empty() {
        return Ok(Vec::new());
    }
    let Some(n) = groups else {
        return Err(value_error("block_tokens needs `groups`"));
    };
    if block_tokens.len() != n {
        return Err(value_error(format!(
            "block_tokens names {} groups, `groups` has {n}",
            block_tokens.len()
        )));
    }
    let unit = u64::from(cfg.tokens_per_block);
    block_tokens
        .iter()
        .enumerate()
        .map(|(g, &t)| {
            if t == 0 || !t.is_multiple_of(unit) {
                return Err(value_error(format!(
                    "group {g}: blocks of {t} tokens are not a whole number of the configuration's {unit}-token blocks"
                )));
            }
            Ok((t / unit) as usize)
        })
        .collect()
}

/// One KV group as the connector names it: `None` full attention, an int a
/// sliding window in tokens, `("chunked_local", n)` chunked-local attention
/// over aligned chunks of `n` tokens, `("sliding_window", w, extra)` a
/// sliding window retaining `extra` tokens behind it, `"recurrent_state"` a
/// Mamba group in vLLM's align mode.
#[derive(FromPyObject)]
enum GroupArg {
    /// Full attention (`None`) or a sliding window.
    Window(Option<u64>),
    /// A kind of attention by name, and its size in tokens.
    Kind(String, u64),
    /// A kind of attention by name, its size and the tokens it retains.
    Retaining(String, u64, u64),
    /// A kind of group by name alone: `"recurrent_state"` (Mamba in
    /// vLLM's align mode).
    Named(String),
}

impl GroupArg {
    /// The group's shape over chunks of `tokens_per_chunk` tokens.
    fn shape(self, tokens_per_chunk: u64) -> PyResult<GroupShape> {
        let attention = match self {
            Self::Window(None) => Attention::Full,
            Self::Window(Some(window_tokens)) => Attention::SlidingWindow { window_tokens },
            Self::Kind(kind, chunk_tokens) if kind == "chunked_local" => {
                Attention::ChunkedLocal { chunk_tokens }
            }
            Self::Retaining(kind, window_tokens, extra) if kind == "sliding_window" => {
                return GroupShape::sliding_window(tokens_per_chunk, window_tokens)
                    .and_then(|s| s.retaining(extra))
                    .map_err(value_error);
            }
            Self::Named(kind) if kind == "recurrent_state" => Attention::State,
            Self::Kind(kind, _) | Self::Retaining(kind, _, _) | Self::Named(kind) => {
                return Err(value_error(format!(
                    "unknown KV group kind {kind:?} (expected (\"chunked_local\", n), (\"sliding_window\", n, retained) or \"recurrent_state\")"
                )));
            }
        };
        GroupShape::with_attention(tokens_per_chunk, attention).map_err(value_error)
    }

    /// Whether the group is windowed (its chunks' KV events keep vLLM's
    /// placeholder payload).
    fn windowed(&self) -> bool {
        !matches!(self, Self::Window(None))
    }
}

#[pymethods]
impl SchedulerCore {
    /// A scheduler for the engine configuration `config_json` (kvoffload's
    /// keys, validated: an unknown key or a bad value raises `ValueError`
    /// naming it). `watchdog`: start the stall watchdog thread.
    /// `manual_clock`: time moves only with `advance_clock` (tests).
    /// `kv_events`: vLLM publishes KV events (else `take_events` is empty).
    /// `self_describing`: the events carry each chunk's block hashes, tokens,
    /// parent hash and LoRA (vLLM's `self_describing_kv_events`; only with
    /// `kv_events`; with several groups, the full-attention groups' chunks:
    /// sliding-window chunks keep the placeholder, as vLLM's).
    /// `groups`: per KV group (vLLM's hybrid manager) `None` for full
    /// attention, a sliding window in tokens, `("chunked_local", n)`, or `"recurrent_state"`;
    /// `None` for one full-attention group. `retention_interval`: vLLM's
    /// `prefix_cache_retention_interval`. `eagle_groups`: the groups (of
    /// `groups`) that hold an EAGLE/MTP drafter's layers (vLLM's
    /// `is_eagle_group`): their last chunk is volatile. `hashes_per_block`:
    /// vLLM's block hashes per GPU block (`block_size / prefix_match_unit`,
    /// several groups only): a block's key is the last hash in it.
    /// `block_tokens`: per group of `groups`, its tokens a block, each a
    /// multiple of the configuration's `tokens_per_block` (vLLM gives a
    /// group of smaller pages larger blocks; empty: the configuration's for
    /// every group). The request's hashes are then taken one per
    /// configuration block, and a group's chunk key is the last in it.
    /// `partial_tails`: recurrent-state groups keep states at hash
    /// boundaries inside a block (vLLM's partial tails, with
    /// `hashes_per_block` > 1 and a `"recurrent_state"` group); every hash
    /// of a request is then given to the scheduler too.
    /// `partial_tail_eagle_margin`: with partial tails and an EAGLE/MTP draft
    /// group, vLLM's `eagle_proof_margin` (the hash unit or the block; 0:
    /// the hash unit, vLLM's with fine-grained hits).
    #[new]
    #[pyo3(signature = (config_json, watchdog = true, manual_clock = false, kv_events = true, self_describing = false, groups = None, retention_interval = None, eagle_groups = Vec::new(), hashes_per_block = 1, block_tokens = Vec::new(), partial_tails = false, partial_tail_eagle_margin = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        config_json: &str,
        watchdog: bool,
        manual_clock: bool,
        kv_events: bool,
        self_describing: bool,
        groups: Option<Vec<GroupArg>>,
        retention_interval: Option<u64>,
        eagle_groups: Vec<usize>,
        hashes_per_block: usize,
        block_tokens: Vec<u64>,
        partial_tails: bool,
        partial_tail_eagle_margin: u64,
    ) -> PyResult<Self> {
        let cfg = OffloadConfig::from_json_str(config_json).map_err(value_error)?;
        if hashes_per_block == 0
            || !(cfg.tokens_per_block as usize).is_multiple_of(hashes_per_block)
        {
            return Err(value_error(format!(
                "hashes_per_block ({hashes_per_block}) must divide the block's {} tokens",
                cfg.tokens_per_block
            )));
        }
        if hashes_per_block > 1 && groups.is_none() {
            // vLLM refuses a prefix_match_unit finer than the block with one
            // KV group.
            return Err(value_error(
                "hashes_per_block > 1 needs `groups` (vLLM hashes finer than a block only with several KV groups)",
            ));
        }
        let manual = manual_clock.then(ManualClock::new);
        let clock = match &manual {
            Some(c) => c.shared(),
            None => MonotonicClock::shared(),
        };
        let windowed: Vec<bool> = groups
            .as_ref()
            .map(|w| w.iter().map(GroupArg::windowed).collect())
            .unwrap_or_default();
        let block_factor = group_block_factors(&cfg, groups.as_ref().map(Vec::len), &block_tokens)?;
        if groups.is_none() && !eagle_groups.is_empty() {
            return Err(value_error(
                "eagle_groups names groups of `groups`, which is None",
            ));
        }
        let mut s = match groups {
            None => Scheduler::new(&cfg, clock.clone()),
            Some(windows) => {
                let tokens_per_chunk = cfg.tokens_per_chunk();
                let mut shapes = windows
                    .into_iter()
                    .enumerate()
                    .map(|(g, w)| {
                        let factor = block_factor.get(g).copied().unwrap_or(1) as u64;
                        w.shape(tokens_per_chunk * factor)
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                for &g in &eagle_groups {
                    let n = shapes.len();
                    let shape = shapes.get_mut(g).ok_or_else(|| {
                        value_error(format!("EAGLE group {g}: there are {n} KV groups"))
                    })?;
                    *shape = shape.eagle_draft();
                }
                let groups = KvGroups {
                    shapes,
                    retention: Retention::from_vllm(retention_interval),
                };
                Scheduler::with_groups(&cfg, groups, clock.clone())
            }
        }
        .map_err(value_error)?;
        if partial_tails {
            let tokens_per_hash = u64::from(cfg.tokens_per_block) / hashes_per_block as u64;
            s.enable_partial_tails(tokens_per_hash)
                .map_err(value_error)?;
            if partial_tail_eagle_margin > 0 {
                s.set_partial_tail_eagle_margin(partial_tail_eagle_margin)
                    .map_err(value_error)?;
            }
        }
        // No events published: the host tier logs none (nothing to drain).
        s.manager_mut().set_events_logged(kv_events);
        let events = EventTracker::new(
            cfg.blocks_per_chunk,
            cfg.tokens_per_block,
            kv_events && self_describing,
            windowed,
            hashes_per_block,
            block_factor,
        );
        if watchdog {
            s.start_watchdog().map_err(runtime_error)?;
        }
        Ok(Self {
            s,
            cfg,
            names: Names::default(),
            tracked: FxHashMap::default(),
            by_address: FxHashMap::default(),
            positions: Vec::new(),
            listed: Vec::new(),
            finishing: Vec::new(),
            events,
            kv_events,
            last_counters: Counters::default(),
            wire: Vec::new(),
            parts: Vec::new(),
            input: StepInput::default(),
            manual,
            clock,
            hashes_per_block,
            fresh_token_counts: !eagle_groups.is_empty(),
        })
    }

    /// Puts a remote tier behind the host tier (`config_json`: the remote
    /// tier's keys; `namespace`: the deployment's fingerprint, from
    /// `remote_namespace`): a lookup that misses the host tier asks the store
    /// ("not yet" until it answers), and chunks found there become fetch
    /// jobs in the workers' plan, then host hits. Raises `ValueError` for a
    /// bad configuration, `RuntimeError` if the store refuses the credentials
    /// or a tier is already attached. An unreachable store is not an error.
    /// `shares`: the shares a chunk has in the store (default: one a
    /// worker; 1 where every worker holds the same bytes, a replicated
    /// layout, whose writer alone puts and fetches them; the model's KV
    /// heads where they are the shares, `WorkerCore.attach_remote_heads`).
    #[pyo3(signature = (config_json, namespace, shares = None))]
    fn attach_remote(
        &mut self,
        config_json: &str,
        namespace: u64,
        shares: Option<u32>,
    ) -> PyResult<()> {
        if self.s.remote_tier().is_some() {
            return Err(runtime_error("a remote tier is already attached"));
        }
        let shares = shares.unwrap_or(self.cfg.world_size);
        if shares == 0 || shares > MAX_REMOTE_SHARES {
            return Err(value_error(format!(
                "shares = {shares} is out of range: allowed 1..={MAX_REMOTE_SHARES}"
            )));
        }
        let tier = crate::remote::start_tier(config_json, namespace, shares, self.clock.clone())?;
        self.s.attach_remote(tier);
        Ok(())
    }

    /// Waits (at most `timeout_s`, real time) until every remote lookup in
    /// flight is answered, so that the next lookups see the answers (tests:
    /// decisions independent of the I/O thread's timing; a serving engine
    /// never calls it). Other Python threads run meanwhile.
    #[pyo3(signature = (timeout_s = 10.0))]
    fn wait_remote_lookups(&mut self, py: Python<'_>, timeout_s: f64) {
        let limit = std::time::Duration::from_secs_f64(timeout_s.clamp(0.0, 3600.0));
        let s = &mut self.s;
        py.detach(move || s.wait_remote_lookups(limit));
    }

    /// The remote side's cumulative counts (`lookups`, `chunks_found`,
    /// `fetch_jobs`, `chunks_fetched`, `fetches_failed`,
    /// `partial_tails_fetched`, `allocation_failures`, `requests_held`) and, under `tier`, the scheduler's
    /// own connection's stats; `None` without a tier.
    fn remote_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let (Some(st), Some(tier)) = (self.s.remote_lookup_stats(), self.s.remote_tier()) else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("lookups", st.lookups)?;
        d.set_item("chunks_found", st.chunks_found)?;
        d.set_item("fetch_jobs", st.fetch_jobs)?;
        d.set_item("chunks_fetched", st.chunks_fetched)?;
        d.set_item("fetches_failed", st.fetches_failed)?;
        d.set_item("partial_tails_fetched", st.partial_tails_fetched)?;
        d.set_item("allocation_failures", st.allocation_failures)?;
        d.set_item("requests_held", self.s.remote_probes())?;
        d.set_item("tier", crate::remote::stats_dict(py, &tier.stats())?)?;
        Ok(Some(d))
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
                prompt_tokens: prompt,
                past_prompt: false,
            },
        );
        if let Some(old) = old {
            self.forget_address(old.name.as_ptr() as usize);
        }
        self.by_address.insert(address, (id, 0));
        self.sync(py, id, true).map(|_| ())
    }

    /// Tokens beyond `computed_tokens` the host tier can supply, or `None`:
    /// ask again later (vLLM's `get_num_new_matched_tokens`).
    /// `skip_reading`: the request must not read cached KV (vLLM's
    /// `skip_reading_prefix_cache`): zero, without looking the tier up.
    #[pyo3(signature = (req, computed_tokens, skip_reading = false))]
    fn lookup(
        &mut self,
        py: Python<'_>,
        req: &str,
        computed_tokens: u64,
        skip_reading: bool,
    ) -> PyResult<Option<u64>> {
        let id = self.names.get(req)?;
        self.sync(py, id, true)?;
        // A lookup restarts the request's stores: its horizon may go down.
        for p in self.positions.iter_mut().filter(|p| p.id == id) {
            p.horizon = 0;
        }
        let outcome = if skip_reading {
            self.s.lookup_skip_reading(id, computed_tokens)
        } else {
            self.s.lookup(id, computed_tokens)
        }
        .map_err(value_error)?;
        if self.events.self_describing()
            && let Some(t) = self.tracked.get(&id)
        {
            let request = t.request.bind(py);
            let src = ChunkSource {
                request,
                hashes: &t.hashes,
            };
            if let Some(found) = self.s.last_lookup_hits() {
                self.events.record_lookup(&src, found)?;
            }
            self.events
                .record_group_lookup(&src, self.s.last_lookup_group_hits())?;
            let tph = self.tokens_per_hash();
            self.events
                .record_partial_tails(request, self.s.last_partial_tails(), tph, false)?;
        }
        match outcome {
            LookupOutcome::Hit(n) => Ok(Some(n)),
            LookupOutcome::Defer => Ok(None),
        }
    }

    /// Sets a request's limits from its `kv_transfer_params` (parsed and
    /// checked by the caller): `max_load_tokens` (a lookup answers at most
    /// that many tokens past the computed ones, in whole chunks),
    /// `max_offload_tokens` (at most that many leading tokens stored; 0
    /// stores nothing), `skip_remote_tier` (its lookups never ask the remote
    /// tier, a `kv_load_tiers` filter without it).
    #[pyo3(signature = (req, max_load_tokens = None, max_offload_tokens = None, skip_remote_tier = false))]
    fn set_request_caps(
        &mut self,
        req: &str,
        max_load_tokens: Option<u64>,
        max_offload_tokens: Option<u64>,
        skip_remote_tier: bool,
    ) -> PyResult<()> {
        let id = self.names.get(req)?;
        let caps = kvoffload::scheduler::RequestCaps {
            max_load_tokens,
            max_offload_tokens,
            skip_remote_tier,
        };
        self.s.set_request_caps(id, caps).map_err(value_error)
    }

    /// `external_tokens` (the request's accepted hit) split by source:
    /// `(host, remote)`, the tokens from chunks the host tier held and from
    /// chunks the request's own fetches brought from the remote tier (vLLM's
    /// `get_external_cache_hit_sources`).
    ///
    /// With several KV groups, tokens no loaded chunk covers (a sliding
    /// window's history left unloaded) count with the remote ones: vLLM
    /// labels both `external_unspecified`.
    fn hit_sources(&self, req: &str, external_tokens: u64) -> PyResult<(u64, u64)> {
        let id = self.names.get(req)?;
        let src = self
            .s
            .hit_sources(id, external_tokens)
            .map_err(value_error)?;
        Ok((src.host_tokens, src.remote_tokens + src.uncovered_tokens))
    }

    /// Whether the request's last lookup in this step reserved the step's
    /// sync-load budget (`sync_load_budget_bytes`): its load is then
    /// synchronous and vLLM schedules it at once (`load_kv_async = False`).
    fn sync_load_reserved(&self, req: &str) -> PyResult<bool> {
        let id = self.names.get(req)?;
        Ok(self.s.sync_load_reserved(id))
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

    /// [`Self::on_alloc`] with several KV groups: per group, the request's
    /// block ids and which of them hold cached KV (vLLM: a block hash).
    fn on_alloc_groups(
        &mut self,
        py: Python<'_>,
        req: &str,
        groups: Vec<(Vec<u32>, Vec<bool>)>,
        external_tokens: u64,
    ) -> PyResult<Option<u64>> {
        let id = self.names.get(req)?;
        self.sync(py, id, false)?;
        let ids: Vec<Vec<GpuBlockId>> = groups.iter().map(|(b, _)| blocks(b)).collect();
        let allocs: Vec<GroupAlloc<'_>> = ids
            .iter()
            .zip(&groups)
            .map(|(block_ids, (_, cached))| GroupAlloc { block_ids, cached })
            .collect();
        Ok(self
            .s
            .on_alloc_groups(id, &allocs, external_tokens)
            .map_err(value_error)?
            .map(|j| j.0))
    }

    /// Blocks vLLM allocated in this step to KV groups the connector leaves
    /// out (not prefix-cacheable; they share the GPU block pool): the next
    /// `build_step` counts them as allocated, so a store still reading one
    /// is flushed before the model writes it.
    fn note_allocated(&mut self, block_ids: Vec<u32>) {
        self.s.note_allocated_elsewhere(&blocks(&block_ids));
    }

    /// Where the GPU prefix cache's shared prefix of the request ends
    /// (vLLM's `Request.shared_prefix_boundary`, read before its lookup).
    fn set_shared_prefix_boundary(&mut self, req: &str, tokens: u64) -> PyResult<()> {
        let id = self.names.get(req)?;
        self.s
            .set_shared_prefix_boundary(id, tokens)
            .map_err(value_error)
    }

    /// KV groups the scheduler offloads.
    fn num_groups(&self) -> usize {
        self.s.num_groups()
    }

    /// One step (vLLM's `build_connector_meta`), from the scheduler output's
    /// parts: `num_scheduled` (`{request: tokens}`, in scheduling order),
    /// `new_requests` (`[(request, block ids, computed tokens)]`, whole
    /// tables; with several KV groups `new_group_blocks` holds per new
    /// request the block ids of groups 1, 2, ...), the cached requests' `cached_ids`, `cached_blocks` (each
    /// `None` or a tuple of per-group block lists: this step's additions),
    /// `cached_computed` and `resumed` (ids whose list is the whole table),
    /// then the preempted and finished requests, and the recurrent states
    /// vLLM's core hands over (`boundary_states`: `[(request, group of the
    /// scheduler's, block id, boundary tokens)]`, its
    /// `boundary_state_offloads`). Requests the connector does
    /// not track are skipped. Returns `(plan, load_requests, failed_loads)`:
    /// the workers' plan as compact bytes, the request of every load job in
    /// it (`{job: request}`), and the requests whose load failed or stalled
    /// (they must recompute).
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    #[pyo3(signature = (num_scheduled, new_requests, cached_ids, cached_blocks, cached_computed, resumed, preempted, finished, new_group_blocks = Vec::new(), boundary_states = Vec::new()))]
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
        new_group_blocks: Vec<Vec<Vec<u32>>>,
        boundary_states: Vec<(String, usize, u32, u64)>,
    ) -> PyResult<(Bound<'py, PyBytes>, HashMap<u64, String>, Vec<String>)> {
        // Each scheduled request's part: the cached requests in their order
        // (the running ones come in the order `num_scheduled` lists them),
        // then the new ones.
        let mut parts = std::mem::take(&mut self.parts);
        let mut input = std::mem::take(&mut self.input);
        parts.clear();
        input.scheduled.clear();
        input.preempted.clear();
        input.finished.clear();
        input.group_block_ids.clear();
        input.boundary_states.clear();
        self.listed.clear();
        // Recurrent states handed over (requests the connector tracks), with
        // their requests' hashes up to date.
        for (name, group, block, boundary) in boundary_states {
            let Some(&req) = self.names.ids.get(name.as_str()) else {
                continue;
            };
            if let Err(e) = self.sync(py, req, true) {
                self.parts = parts;
                self.input = input;
                return Err(e);
            }
            input.boundary_states.push(BoundaryState {
                req,
                group,
                block: GpuBlockId(block),
                boundary,
            });
        }
        let result = self.build_step_with(
            py,
            &mut parts,
            &mut input,
            num_scheduled,
            new_requests,
            new_group_blocks,
            (cached_ids, cached_blocks, cached_computed, resumed),
            preempted,
            finished,
        );
        self.parts = parts;
        self.input = input;
        result
    }

    /// Worker reports summed over workers: `{job: count}` and the failed
    /// jobs. Returns `(finished_loads, failed_loads, rejected)`.
    fn on_worker_output(
        &mut self,
        completed: Bound<'_, PyDict>,
        failed: Vec<u64>,
    ) -> PyResult<(Vec<String>, Vec<String>, Vec<String>)> {
        let mut done: Vec<(JobId, u32)> = Vec::with_capacity(completed.len());
        for_each_entry(&completed, |job, n| {
            // Both read before the other's conversion may run Python code.
            let job = job.to_owned();
            let n: u32 = n.extract()?;
            done.push((JobId(job.extract()?), n));
            Ok(())
        })?;
        let mut completed = done;
        completed.sort_unstable();
        let report = CompletionReport {
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
        Ok(answer)
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
        // Every request restarts its stores.
        for p in &mut self.positions {
            p.horizon = 0;
        }
        // The tier is empty: as vLLM, no removal event follows a reset
        // (what it logged before and nobody took yet still goes out).
        if !self.kv_events {
            self.s.discard_events();
        }
        self.events.reset(&mut self.s);
        self.forget_finished();
        Ok(())
    }

    /// Requests the binding holds (names and `Request` objects): a leak check.
    fn held_requests(&self) -> usize {
        self.tracked.len()
    }

    /// The host tier's events since the last call, as vLLM publishes them:
    /// `(removed, group, items)`, the items of one KV group (0 with one). A removal's items are vLLM's block hashes (bytes:
    /// each chunk's last block's, or all of its blocks' where its
    /// self-describing payload is known); a store's are, per chunk, that hash
    /// or, self-describing, the tuple `(block_hashes, parent_block_hash,
    /// token_ids, lora_id, lora_name)`. A failed store's cleanup announces
    /// nothing. A key whose hash is not known is its 8-byte key.
    fn take_events(&mut self, py: Python<'_>) -> PyResult<Vec<crate::kv_events::Event>> {
        if !self.kv_events {
            self.s.discard_events();
            return Ok(Vec::new());
        }
        self.events.take(py, &mut self.s)
    }

    /// Chunk keys whose vLLM hash is held for the events (a leak check).
    fn held_hashes(&self) -> usize {
        self.events.held_hashes()
    }

    /// Self-describing payloads held for the events (a leak check: at most
    /// the chunks the tier holds or is writing).
    fn held_payloads(&self) -> usize {
        self.events.held_payloads()
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
        d.set_item(intern!(py, "usage"), st.usage)?;
        d.set_item(intern!(py, "write_usage"), st.write_usage)?;
        d.set_item(intern!(py, "read_usage"), st.read_usage)?;
        d.set_item(intern!(py, "stalled_jobs"), m.stalled_jobs)?;
        d.set_item(intern!(py, "quarantined_chunks"), m.quarantined_chunks)?;
        let delta = |a: u64, b: u64| a.saturating_sub(b);
        d.set_item(
            intern!(py, "allocation_failures"),
            delta(now.allocation_failures, last.allocation_failures),
        )?;
        d.set_item(
            intern!(py, "stores_skipped"),
            delta(now.stores_skipped, last.stores_skipped),
        )?;
        d.set_item(
            intern!(py, "stalled_stores"),
            delta(now.stalled_stores, last.stalled_stores),
        )?;
        d.set_item(
            intern!(py, "stalled_loads"),
            delta(now.stalled_loads, last.stalled_loads),
        )?;
        d.set_item(
            intern!(py, "late_reports"),
            delta(now.late_reports, last.late_reports),
        )?;
        d.set_item(intern!(py, "allocation_sizes"), sizes)?;
        d.set_item(intern!(py, "lookup_sync_delays"), sync)?;
        d.set_item(intern!(py, "lookup_async_delays"), asynchronous)?;
        Ok(d)
    }

    /// The jobs the last step's plan flushed only because vLLM gave their
    /// hand-off's block to another request in that step (vLLM 0.33.0 does
    /// not flush them): for comparisons with vLLM's decisions.
    fn handoff_flushes(&self) -> Vec<u64> {
        self.s.handoff_flushes().iter().map(|j| j.0).collect()
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
        d.set_item("handoffs_flushed", m.handoffs_flushed)?;
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
        d.set_item("remote_probes", self.s.remote_probes())?;
        d.set_item("remote_in_flight", self.s.remote_in_flight())?;
        d.set_item(
            "hits_cut_at_partial_chunks",
            self.s.hits_cut_at_partial_chunks(),
        )?;
        d.set_item("partial_chunk_records", self.s.partial_chunk_records())?;
        d.set_item("invariants", self.s.check_invariants().err())?;
        Ok(d)
    }
}
