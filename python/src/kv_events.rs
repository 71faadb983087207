//! The host tier's KV events in vLLM's terms (its `OffloadingEventsTracker`).
//!
//! The scheduler names a chunk by its [`ChunkKey`]; vLLM's events name it by
//! vLLM's block hash of the chunk's last block (the placeholder payload, its
//! default) or, with `self_describing_kv_events`, by every block hash of the
//! chunk with its tokens, parent hash and LoRA (the self-describing payload).
//! Both are read from the request while the binding still holds it: when a
//! store (or fetch) job is planned, and, self-describing, when a lookup finds
//! the chunk. As vLLM, a payload stays until the chunk's removal event has
//! been translated (or a reset), so the removal fans out to the same hashes;
//! a chunk removed and stored again in one batch of events loses it (vLLM's
//! tracker does the same: its later removal is a placeholder).

use kvoffload::manager::{LookupResult, OffloadEvent};
use kvoffload::scheduler::Scheduler;
use kvoffload::scheduler::hybrid::PartialTailKey;
use kvoffload::{BlockHash, ChunkKey};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySlice, PyTuple};
use rustc_hash::{FxHashMap, FxHashSet};

/// A chunk's self-describing payload (vLLM's `_OffloadEventMetadata` for a
/// full-attention group), as Python objects ready for `BlockStored`.
struct Payload {
    /// `(block_hashes, parent_block_hash, token_ids, lora_id, lora_name)`.
    fields: Py<PyTuple>,
    /// The chunk's block hashes (the removal fans out to them).
    block_hashes: Py<PyAny>,
    /// Whether the host tier holds it as far as the events know (vLLM's
    /// primary residency): set when recorded, cleared by a removal.
    resident: bool,
}

/// The chunks of one request a store or lookup records: its block hashes as
/// the scheduler has them, and where chunk `c`'s key is.
pub(crate) struct ChunkSource<'a> {
    /// vLLM's `Request`.
    pub request: &'a Bound<'a, PyAny>,
    /// Its block hashes as given to the scheduler (one per GPU block).
    pub hashes: &'a [BlockHash],
}

impl ChunkSource<'_> {
    /// Chunks of `per_chunk` hashes the request has.
    fn chunks(&self, per_chunk: usize) -> usize {
        self.hashes.len() / per_chunk
    }

    /// Chunk `c`'s key in KV group `group`, `per_chunk` hashes a chunk.
    fn group_key(&self, c: usize, per_chunk: usize, group: u32) -> ChunkKey {
        ChunkKey::for_group(self.hashes[(c + 1) * per_chunk - 1], group)
    }
}

/// Where GPU block `b`'s hash is in a request's `block_hashes`, `per_block`
/// of them a block (vLLM's `prefix_match_unit` finer than the blocks): the
/// last one in the block, which covers its whole prefix.
pub(crate) fn block_hash_index(b: usize, per_block: usize) -> usize {
    (b + 1) * per_block - 1
}

/// GPU block `b`'s hash in a request's `block_hashes` ([`block_hash_index`]).
fn block_hash_at(
    block_hashes: &Bound<'_, PyList>,
    per_block: usize,
    b: usize,
) -> PyResult<Py<PyAny>> {
    Ok(block_hashes
        .get_item(block_hash_index(b, per_block))?
        .unbind())
}

/// A payload of `request`: `(hashes, parent, its tokens in `tokens`, its
/// LoRA id and name)`, and `block_size` where given (a partial tail's).
fn payload_of(
    request: &Bound<'_, PyAny>,
    hashes: Bound<'_, PyList>,
    parent: Py<PyAny>,
    tokens: std::ops::Range<usize>,
    block_size: Option<Py<PyAny>>,
) -> PyResult<Payload> {
    let py = request.py();
    let all = request.getattr(intern!(py, "all_token_ids"))?;
    let slice = all.get_item(PySlice::new(
        py,
        tokens.start as isize,
        tokens.end as isize,
        1,
    ))?;
    let tokens = PyList::new(py, slice.try_iter()?.collect::<PyResult<Vec<_>>>()?)?;
    let (lora_id, lora_name) = lora_of(request)?;
    let block_hashes = hashes.into_any().unbind();
    let mut fields = vec![
        block_hashes.clone_ref(py),
        parent,
        tokens.into_any().unbind(),
        lora_id,
        lora_name,
    ];
    fields.extend(block_size);
    Ok(Payload {
        fields: PyTuple::new(py, fields)?.unbind(),
        block_hashes,
        resident: true,
    })
}

/// A request's LoRA as an event names it: `(lora_id, lora_name)`, both
/// `None` without one.
fn lora_of(request: &Bound<'_, PyAny>) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
    let py = request.py();
    let lora = request.getattr(intern!(py, "lora_request"))?;
    Ok(if lora.is_none() {
        (py.None(), py.None())
    } else {
        (
            lora.getattr(intern!(py, "adapter_id"))?.unbind(),
            lora.getattr(intern!(py, "name"))?.unbind(),
        )
    })
}

/// One translated event: `(removed, group, items)`, the items of one KV
/// group. A removal's items are block hashes (bytes); a store's are, per
/// chunk, its hash (placeholder) or its payload tuple (self-describing).
/// Consecutive stores of a group come as one run (each item is its own
/// `BlockStored` either way): one Python tuple and list per run instead of
/// per stored chunk. A removal of chunks of several groups comes as one
/// event per group, in the order the groups first appear (vLLM's).
pub(crate) type Event = (bool, u32, Vec<Py<PyAny>>);

/// vLLM's KV events for the host tier: the hashes (and payloads) of the
/// chunks the tier holds or is being written, and the translation.
pub(crate) struct EventTracker {
    /// vLLM's block hash (bytes) of every chunk key stored or being stored,
    /// for the placeholder payload; dropped when the key leaves the tier.
    key_bytes: FxHashMap<u64, Py<PyAny>>,
    /// The KV group of every such key outside group 0 (several groups).
    key_group: FxHashMap<u64, u32>,
    /// Self-describing payloads by chunk key (`None`: placeholders only).
    payloads: Option<FxHashMap<u64, Payload>>,
    /// Per KV group, whether it has a sliding window: its chunks keep the
    /// placeholder payload (vLLM's tracker describes full attention only).
    windowed: Vec<bool>,
    blocks_per_chunk: usize,
    tokens_per_chunk: usize,
    /// vLLM's block hashes per GPU block (`prefix_match_unit` finer than a
    /// block): block `b`'s hash is raw hash `(b + 1) * n - 1`.
    hashes_per_block: usize,
    /// Per KV group, its block in the configuration's blocks (vLLM gives a
    /// group of smaller pages larger blocks; empty: 1 for every group).
    block_factor: Vec<usize>,
    /// The host tier's events still untaken at the last reset (an eviction
    /// by the last step's stores, whose output vLLM's async scheduler has
    /// not processed yet): published at the next take, as vLLM publishes
    /// them, with placeholder payloads (a reset drops the payloads).
    before_reset: Vec<OffloadEvent>,
}

impl EventTracker {
    /// A tracker for chunks of `blocks_per_chunk` blocks of `tokens_per_block`
    /// tokens; `self_describing`: keep the payloads too, of the KV groups
    /// not `windowed` (one full-attention group when empty);
    /// `hashes_per_block`: vLLM's block hashes per GPU block;
    /// `block_factor`: per KV group, its block in blocks of
    /// `tokens_per_block` (empty: 1 for every group).
    pub(crate) fn new(
        blocks_per_chunk: u32,
        tokens_per_block: u32,
        self_describing: bool,
        windowed: Vec<bool>,
        hashes_per_block: usize,
        block_factor: Vec<usize>,
    ) -> Self {
        let bpc = blocks_per_chunk.max(1) as usize;
        Self {
            key_bytes: FxHashMap::default(),
            key_group: FxHashMap::default(),
            payloads: self_describing.then(FxHashMap::default),
            windowed,
            blocks_per_chunk: bpc,
            tokens_per_chunk: bpc * tokens_per_block.max(1) as usize,
            hashes_per_block: hashes_per_block.max(1),
            block_factor,
            before_reset: Vec::new(),
        }
    }

    /// Group `group`'s block in the configuration's blocks.
    fn factor(&self, group: u32) -> usize {
        self.block_factor
            .get(group as usize)
            .copied()
            .unwrap_or(1)
            .max(1)
    }

    /// Whether payloads are kept (`self_describing_kv_events`).
    pub(crate) fn self_describing(&self) -> bool {
        self.payloads.is_some()
    }

    /// Chunk keys whose hash is held (a leak check).
    pub(crate) fn held_hashes(&self) -> usize {
        self.key_bytes.len()
    }

    /// Payloads held (a leak check: never more than the tier's chunks).
    pub(crate) fn held_payloads(&self) -> usize {
        self.payloads.as_ref().map_or(0, FxHashMap::len)
    }

    /// A reset of the host tier in `s` (already reset): the tier is empty,
    /// and as vLLM no removal event follows for what it held. Events the
    /// tier logged before the reset and nobody took yet are kept for the
    /// next [`Self::take`], with the hashes of their keys (vLLM's
    /// placeholder payloads name a chunk by its key's block hash, which its
    /// keys carry); every payload goes, as vLLM's tracker drops its own.
    pub(crate) fn reset(&mut self, s: &mut Scheduler) {
        self.before_reset.extend(s.take_events());
        if let Some(p) = &mut self.payloads {
            p.clear();
        }
        let pending: FxHashSet<u64> = self
            .before_reset
            .iter()
            .flat_map(|e| e.keys.iter().map(|k| k.0))
            .collect();
        self.key_bytes.retain(|k, _| pending.contains(k));
        self.key_group.retain(|k, _| pending.contains(k));
    }

    /// Records the keys a store (or fetch) job writes in KV group `group`
    /// (vLLM's `record_store`): the keys are chunks of the request in
    /// increasing order (chunks the tier already holds are left out), the
    /// first found from the request's end. Payloads are full-attention
    /// groups' only.
    pub(crate) fn record_store(
        &mut self,
        src: &ChunkSource<'_>,
        keys: &[ChunkKey],
        group: u32,
    ) -> PyResult<()> {
        let bpc = self.blocks_per_chunk;
        let factor = self.factor(group);
        let per_chunk = bpc * factor;
        let chunks = src.chunks(per_chunk);
        let Some(first) = keys.first() else {
            return Ok(());
        };
        let key = |c: usize| src.group_key(c, per_chunk, group);
        let Some(mut c) = (0..chunks).rev().find(|&c| key(c) == *first) else {
            return Ok(());
        };
        let py = src.request.py();
        let list = src.request.getattr(intern!(py, "block_hashes"))?;
        let list = list.cast::<PyList>()?;
        let per_block = self.hashes_per_block * factor;
        for k in keys {
            while c < chunks && key(c) != *k {
                c += 1;
            }
            if c == chunks {
                break;
            }
            if let std::collections::hash_map::Entry::Vacant(e) = self.key_bytes.entry(k.0) {
                e.insert(block_hash_at(list, per_block, (c + 1) * bpc - 1)?);
            }
            if group != 0 {
                self.key_group.insert(k.0, group);
            }
            if self.payloads.is_some() && self.describes(group) {
                let payload = self.payload(src.request, list, c, factor)?;
                if let Some(p) = &mut self.payloads {
                    p.insert(k.0, payload);
                }
            }
            c += 1;
        }
        Ok(())
    }

    /// Whether chunks of KV group `group` get a payload (full attention).
    fn describes(&self, group: u32) -> bool {
        !self.windowed.get(group as usize).copied().unwrap_or(false)
    }

    /// Records the chunks `first..end` a lookup found in the tier (vLLM's
    /// `record_lookup`, self-describing only): a payload for each that has
    /// none, and each counts as resident again.
    pub(crate) fn record_lookup(
        &mut self,
        src: &ChunkSource<'_>,
        found: std::ops::Range<usize>,
    ) -> PyResult<()> {
        let found: Vec<(usize, usize)> = found.map(|c| (0, c)).collect();
        self.record_group_lookup(src, &found)
    }

    /// [`Self::record_lookup`] with several KV groups: each `(group, chunk)`
    /// a lookup found in a full-attention group.
    pub(crate) fn record_group_lookup(
        &mut self,
        src: &ChunkSource<'_>,
        found: &[(usize, usize)],
    ) -> PyResult<()> {
        if self.payloads.is_none() || found.is_empty() {
            return Ok(());
        }
        let bpc = self.blocks_per_chunk;
        let py = src.request.py();
        let list = src.request.getattr(intern!(py, "block_hashes"))?;
        let list = list.cast::<PyList>()?;
        for &(g, c) in found {
            let factor = self.factor(g as u32);
            let per_chunk = bpc * factor;
            if c >= src.chunks(per_chunk) || !self.describes(g as u32) {
                continue;
            }
            let k = src.group_key(c, per_chunk, g as u32);
            let known = self.payloads.as_mut().and_then(|p| p.get_mut(&k.0));
            if let Some(p) = known {
                p.resident = true;
                continue;
            }
            let payload = self.payload(src.request, list, c, factor)?;
            if let Some(p) = &mut self.payloads {
                p.insert(k.0, payload);
            }
        }
        Ok(())
    }

    /// Records partial tails (recurrent states inside a block, vLLM's
    /// `record_partial_store` / `record_partial_lookup`) of `request`:
    /// `stored`, a store job writes them (their hash, vLLM's at the
    /// boundary, names them; a payload replaces any held); else a lookup
    /// found them (a payload only where none is held). Payloads are
    /// full-attention groups' only, and cover the block's valid hashes and
    /// tokens up to the boundary, `tokens_per_hash` tokens a hash.
    pub(crate) fn record_partial_tails(
        &mut self,
        request: &Bound<'_, PyAny>,
        tails: &[PartialTailKey],
        tokens_per_hash: usize,
        stored: bool,
    ) -> PyResult<()> {
        if tails.is_empty() || tokens_per_hash == 0 {
            return Ok(());
        }
        let py = request.py();
        let list = request.getattr(intern!(py, "block_hashes"))?;
        let list = list.cast::<PyList>()?;
        for t in tails {
            let boundary = t.key_tokens as usize;
            let Some(idx) = (boundary / tokens_per_hash).checked_sub(1) else {
                continue;
            };
            if idx >= list.len() {
                continue;
            }
            let group = t.group as u32;
            if stored {
                if let std::collections::hash_map::Entry::Vacant(e) = self.key_bytes.entry(t.key.0)
                {
                    e.insert(list.get_item(idx)?.unbind());
                }
                if group != 0 {
                    self.key_group.insert(t.key.0, group);
                }
            }
            if !self.describes(group) {
                continue;
            }
            let held = self
                .payloads
                .as_ref()
                .is_some_and(|p| p.contains_key(&t.key.0));
            if self.payloads.is_none() || (!stored && held) {
                continue;
            }
            let payload = self.partial_payload(request, list, boundary, tokens_per_hash)?;
            if let Some(p) = &mut self.payloads {
                p.insert(t.key.0, payload);
            }
        }
        Ok(())
    }

    /// A partial tail's payload (vLLM's `_record_partial_tail`): the hashes
    /// and tokens from its block's start to `boundary`, the hash before
    /// them, the request's LoRA, and `tokens_per_hash` as its block size
    /// (a sixth field).
    fn partial_payload(
        &self,
        request: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyList>,
        boundary: usize,
        tokens_per_hash: usize,
    ) -> PyResult<Payload> {
        let py = request.py();
        let start = ((boundary - 1) / self.tokens_per_chunk) * self.tokens_per_chunk;
        let first = start / tokens_per_hash;
        let last = boundary / tokens_per_hash;
        let hashes = PyList::new(
            py,
            (first..last)
                .map(|i| Ok(block_hashes.get_item(i)?.unbind()))
                .collect::<PyResult<Vec<_>>>()?,
        )?;
        let parent = if first == 0 {
            py.None()
        } else {
            block_hashes.get_item(first - 1)?.unbind()
        };
        let block_size = tokens_per_hash.into_pyobject(py)?.into_any().unbind();
        payload_of(request, hashes, parent, start..boundary, Some(block_size))
    }

    /// Chunk `c`'s payload in a group of `factor` configuration blocks a
    /// block, read from the request: its block hashes, the hash before
    /// them, its tokens and the request's LoRA.
    fn payload(
        &self,
        request: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyList>,
        c: usize,
        factor: usize,
    ) -> PyResult<Payload> {
        let py = request.py();
        let bpc = self.blocks_per_chunk;
        let first = c * bpc;
        let per_block = self.hashes_per_block * factor;
        let tokens_per_chunk = self.tokens_per_chunk * factor;
        let hashes = PyList::new(
            py,
            (first..first + bpc)
                .map(|b| block_hash_at(block_hashes, per_block, b))
                .collect::<PyResult<Vec<_>>>()?,
        )?;
        let parent = if first == 0 {
            py.None()
        } else {
            block_hash_at(block_hashes, per_block, first - 1)?
        };
        let start = c * tokens_per_chunk;
        payload_of(
            request,
            hashes,
            parent,
            start..start + tokens_per_chunk,
            None,
        )
    }

    /// The scheduler's pending events, translated (vLLM's `take_events`):
    /// a removal fans out to the chunks' block hashes where a payload is
    /// held, a failed store's cleanup (`metadata_only`) announces nothing,
    /// and a store carries each chunk's payload or its hash.
    pub(crate) fn take(&mut self, py: Python<'_>, s: &mut Scheduler) -> PyResult<Vec<Event>> {
        let before_reset = std::mem::take(&mut self.before_reset);
        // Keys of events from before a reset: their hash goes with the
        // event unless the tier holds the key again.
        let stale: Vec<ChunkKey> = before_reset
            .iter()
            .flat_map(|e| e.keys.iter().copied())
            .collect();
        let mut events = before_reset;
        events.extend(s.take_events());
        let mut out: Vec<Event> = Vec::with_capacity(events.len());
        let mut removed: Vec<ChunkKey> = Vec::new();
        for e in events {
            // Per group (in first-appearance order), its items.
            let mut by_group: Vec<(u32, Vec<Py<PyAny>>)> = Vec::with_capacity(1);
            for k in e.keys.iter() {
                let group = self.key_group.get(&k.0).copied().unwrap_or(0);
                let items = match by_group.iter().position(|(g, _)| *g == group) {
                    Some(i) => &mut by_group[i].1,
                    None => {
                        by_group.push((group, Vec::with_capacity(e.keys.len())));
                        &mut by_group.last_mut().expect("just pushed").1
                    }
                };
                let payload = self.payloads.as_mut().and_then(|p| p.get_mut(&k.0));
                if e.removed {
                    removed.push(*k);
                    if let Some(p) = payload {
                        p.resident = false;
                        if !e.metadata_only {
                            items.extend(
                                p.block_hashes
                                    .bind(py)
                                    .try_iter()?
                                    .map(|h| h.map(Bound::unbind))
                                    .collect::<PyResult<Vec<_>>>()?,
                            );
                        }
                        continue;
                    }
                    if !e.metadata_only {
                        items.push(self.hash_of(py, *k));
                    }
                    continue;
                }
                items.push(match payload {
                    Some(p) => p.fields.clone_ref(py).into_any(),
                    None => self.hash_of(py, *k),
                });
            }
            for (group, mut items) in by_group {
                match out.last_mut() {
                    Some((false, g, run)) if !e.removed && *g == group => run.append(&mut items),
                    _ if e.removed && items.is_empty() => {}
                    _ => out.push((e.removed, group, items)),
                }
            }
        }
        // A payload whose chunk left the tier goes; one removed and stored
        // again in the batch loses it too (vLLM keeps it only while resident).
        if let Some(p) = &mut self.payloads {
            for k in &removed {
                if p.get(&k.0).is_some_and(|p| !p.resident) {
                    p.remove(&k.0);
                }
            }
        }
        // A key evicted and stored again in one batch keeps its hash.
        for k in removed.into_iter().chain(stale) {
            if s.manager().lookup(k) == LookupResult::Miss {
                self.key_bytes.remove(&k.0);
                self.key_group.remove(&k.0);
            }
        }
        Ok(out)
    }

    /// vLLM's hash of chunk `k` (its 8-byte key where the hash is not known).
    fn hash_of(&self, py: Python<'_>, k: ChunkKey) -> Py<PyAny> {
        self.key_bytes
            .get(&k.0)
            .map(|b| b.clone_ref(py))
            .unwrap_or_else(|| PyBytes::new(py, &k.0.to_le_bytes()).into_any().unbind())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::block_hash;
    use crate::convert::tests::with_python;
    use kvoffload::manager::StoreOutcome;
    use kvoffload::{ManualClock, OffloadConfig};

    /// A scheduler with a tier of `chunks` chunks of 2 blocks of 2 tokens.
    fn scheduler(chunks: u32) -> Scheduler {
        let cfg = OffloadConfig::from_json_str(&format!(
            r#"{{"tokens_per_block": 2, "blocks_per_chunk": 2, "num_cpu_chunks": {chunks}, "world_size": 1}}"#
        ))
        .unwrap();
        Scheduler::new(&cfg, ManualClock::new().shared()).unwrap()
    }

    /// A request of 8 tokens (4 blocks, 2 chunks) whose block hashes are
    /// `{tag}0`..`{tag}3`, as vLLM's `Request` shows them.
    fn request<'py>(py: Python<'py>, tag: &str) -> (Bound<'py, PyAny>, Vec<BlockHash>) {
        request_with_lora(py, tag, "None")
    }

    /// [`request`] with `lora` (Python source) as its `lora_request`.
    fn request_with_lora<'py>(
        py: Python<'py>,
        tag: &str,
        lora: &str,
    ) -> (Bound<'py, PyAny>, Vec<BlockHash>) {
        let src = format!(
            "__import__('types').SimpleNamespace(block_hashes=[b'{tag}0', b'{tag}1', b'{tag}2', b'{tag}3'], \
             all_token_ids=list(range(100, 108)), lora_request={lora})"
        );
        let req = py
            .eval(&std::ffi::CString::new(src).unwrap(), None, None)
            .unwrap();
        let hashes = (0..4)
            .map(|i| block_hash(format!("{tag}{i}").as_bytes()))
            .collect();
        (req, hashes)
    }

    fn source<'a>(request: &'a Bound<'a, PyAny>, hashes: &'a [BlockHash]) -> ChunkSource<'a> {
        ChunkSource { request, hashes }
    }

    fn keys(hashes: &[BlockHash]) -> Vec<ChunkKey> {
        vec![
            ChunkKey::for_group(hashes[1], 0),
            ChunkKey::for_group(hashes[3], 0),
        ]
    }

    /// Stores `keys` in the tier (prepared, then completed with `outcome`).
    fn store(s: &mut Scheduler, keys: &[ChunkKey], outcome: StoreOutcome) {
        s.manager_mut().prepare_store(keys, None).unwrap();
        s.manager_mut().complete_store(keys, outcome, None).unwrap();
    }

    fn text(py: Python<'_>, v: &Py<PyAny>) -> String {
        v.bind(py).repr().unwrap().to_string()
    }

    #[test]
    fn a_partial_tail_is_named_by_the_hash_at_its_boundary_and_described_up_to_it() {
        with_python(|py| {
            // Chunks of one 4-token block, a hash every token (the 4 hashes
            // of the request's first block), two groups: 1 a Mamba state.
            let cfg = OffloadConfig::from_json_str(
                r#"{"tokens_per_block": 4, "blocks_per_chunk": 1, "num_cpu_chunks": 8, "world_size": 1}"#,
            )
            .unwrap();
            let mut s = Scheduler::new(&cfg, ManualClock::new().shared()).unwrap();
            let (req, hashes) = request(py, "p");
            let tail = |group: usize| PartialTailKey {
                req: kvoffload::RequestId(1),
                group,
                boundary: 3,
                key_tokens: 3,
                key: ChunkKey::for_group(hashes[2], group as u32),
            };
            for self_describing in [false, true] {
                let mut t =
                    EventTracker::new(1, 4, self_describing, vec![false, true], 4, Vec::new());
                // A lookup only describes (and only self-describing).
                t.record_partial_tails(&req, &[tail(0)], 1, false).unwrap();
                assert_eq!(t.held_hashes(), 0);
                assert_eq!(t.held_payloads(), usize::from(self_describing));
                t.record_partial_tails(&req, &[tail(0), tail(1)], 1, true)
                    .unwrap();
                let keys = [tail(0).key, tail(1).key];
                store(&mut s, &keys, StoreOutcome::Success);
                let ev = t.take(py, &mut s).unwrap();
                let items: Vec<(u32, String)> = ev
                    .iter()
                    .flat_map(|(_, g, items)| items.iter().map(|i| (*g, text(py, i))))
                    .collect();
                // The hash of the first 3 tokens names both; full attention's
                // payload covers its block's 3 valid tokens, a hash a token.
                let first = if self_describing {
                    "([b'p0', b'p1', b'p2'], None, [100, 101, 102], None, None, 1)"
                } else {
                    "b'p2'"
                };
                assert_eq!(items, [(0, first.to_string()), (1, "b'p2'".to_string())]);
                s.manager_mut().reset();
                t.reset(&mut s);
            }
        });
    }

    #[test]
    fn events_logged_before_a_reset_and_untaken_still_go_out_named_by_their_hashes() {
        with_python(|py| {
            for self_describing in [false, true] {
                let mut s = scheduler(2);
                let mut t = EventTracker::new(2, 2, self_describing, Vec::new(), 1, Vec::new());
                let (req, hashes) = request(py, "a");
                let k = keys(&hashes);
                t.record_store(&source(&req, &hashes), &k, 0).unwrap();
                store(&mut s, &k, StoreOutcome::Success);
                t.take(py, &mut s).unwrap();
                // A third chunk evicts chunk a1 (its last block hash `a1`);
                // the tier is reset before anyone takes the events (vLLM's
                // async scheduler processes a step's output after the next
                // step's reset).
                let (other, other_hashes) = request(py, "b");
                let k2 = keys(&other_hashes);
                t.record_store(&source(&other, &other_hashes), &k2[..1], 0)
                    .unwrap();
                store(&mut s, &k2[..1], StoreOutcome::Success);
                s.reset().unwrap();
                t.reset(&mut s);
                let ev = t.take(py, &mut s).unwrap();
                let got: Vec<(bool, Vec<String>)> = ev
                    .iter()
                    .map(|(removed, _, items)| {
                        (*removed, items.iter().map(|i| text(py, i)).collect())
                    })
                    .collect();
                // As vLLM's tracker, whose reset drops the payloads: the
                // removal and the store are placeholders, each named by its
                // chunk's last block hash, never by kvoffload's 8-byte key.
                assert_eq!(
                    got,
                    [
                        (true, vec!["b'a1'".to_string()]),
                        (false, vec!["b'b1'".to_string()])
                    ],
                    "self-describing: {self_describing}"
                );
                // The tier is empty: no hash or payload is held any more.
                assert_eq!(t.held_hashes(), 0);
                assert_eq!(t.held_payloads(), 0);
                assert!(t.take(py, &mut s).unwrap().is_empty());
            }
        });
    }

    #[test]
    fn a_stored_chunk_carries_its_hashes_tokens_and_parent_and_its_removal_fans_out() {
        with_python(|py| {
            let mut s = scheduler(2);
            let mut t = EventTracker::new(2, 2, true, Vec::new(), 1, Vec::new());
            let (req, hashes) = request(py, "a");
            let k = keys(&hashes);
            let src = source(&req, &hashes);
            t.record_store(&src, &k, 0).unwrap();
            store(&mut s, &k, StoreOutcome::Success);
            let ev = t.take(py, &mut s).unwrap();
            assert_eq!(ev.len(), 1);
            assert!(!ev[0].0, "a store");
            let items: Vec<String> = ev[0].2.iter().map(|i| text(py, i)).collect();
            assert_eq!(
                items,
                [
                    "([b'a0', b'a1'], None, [100, 101, 102, 103], None, None)",
                    "([b'a2', b'a3'], b'a1', [104, 105, 106, 107], None, None)",
                ]
            );
            assert_eq!(t.held_payloads(), 2);
            // A third chunk evicts the least recently used (chunk 0): its
            // removal names both of its blocks, and its payload goes.
            let (other, other_hashes) = request(py, "b");
            let k2 = keys(&other_hashes);
            t.record_store(&source(&other, &other_hashes), &k2[..1], 0)
                .unwrap();
            store(&mut s, &k2[..1], StoreOutcome::Success);
            let ev = t.take(py, &mut s).unwrap();
            assert_eq!(ev.len(), 2, "a removal, then a store");
            assert!(ev[0].0);
            let removed: Vec<String> = ev[0].2.iter().map(|i| text(py, i)).collect();
            assert_eq!(removed, ["b'a0'", "b'a1'"]);
            assert_eq!(t.held_payloads(), 2, "chunk a1 and b0 remain");
            assert_eq!(t.held_hashes(), 2);
        });
    }

    #[test]
    fn with_hashes_finer_than_blocks_a_payload_names_each_blocks_last_hash() {
        with_python(|py| {
            let mut s = scheduler(2);
            let mut t = EventTracker::new(2, 2, true, Vec::new(), 2, Vec::new());
            // vLLM's prefix_match_unit of 1 token over blocks of 2: eight
            // hashes; block b's is hash 2b + 1 (it covers the block's prefix).
            let req = py
                .eval(
                    c"__import__('types').SimpleNamespace(block_hashes=[b'h%d' % i for i in range(8)], \
                      all_token_ids=list(range(100, 108)), lora_request=None)",
                    None,
                    None,
                )
                .unwrap();
            let hashes: Vec<BlockHash> = [1, 3, 5, 7]
                .iter()
                .map(|i| block_hash(format!("h{i}").as_bytes()))
                .collect();
            let k = keys(&hashes);
            t.record_store(&source(&req, &hashes), &k, 0).unwrap();
            store(&mut s, &k, StoreOutcome::Success);
            let ev = t.take(py, &mut s).unwrap();
            let items: Vec<String> = ev[0].2.iter().map(|i| text(py, i)).collect();
            assert_eq!(
                items,
                [
                    "([b'h1', b'h3'], None, [100, 101, 102, 103], None, None)",
                    "([b'h5', b'h7'], b'h3', [104, 105, 106, 107], None, None)",
                ]
            );
        });
    }

    #[test]
    fn a_group_of_larger_blocks_names_each_chunk_by_its_own_blocks() {
        with_python(|py| {
            let mut s = scheduler(4);
            // One block a chunk, 2-token configuration blocks; group 1's
            // blocks hold 4 tokens (two configuration blocks).
            let mut t = EventTracker::new(1, 2, true, vec![false, false], 1, vec![1, 2]);
            let (req, hashes) = request(py, "e");
            let k = vec![
                ChunkKey::for_group(hashes[1], 1),
                ChunkKey::for_group(hashes[3], 1),
            ];
            t.record_store(&source(&req, &hashes), &k, 1).unwrap();
            store(&mut s, &k, StoreOutcome::Success);
            let ev = t.take(py, &mut s).unwrap();
            assert_eq!((ev[0].0, ev[0].1), (false, 1), "a store of group 1");
            let items: Vec<String> = ev[0].2.iter().map(|i| text(py, i)).collect();
            assert_eq!(
                items,
                [
                    "([b'e1'], None, [100, 101, 102, 103], None, None)",
                    "([b'e3'], b'e1', [104, 105, 106, 107], None, None)",
                ]
            );
        });
    }

    #[test]
    fn a_failed_store_announces_nothing_and_drops_its_payload() {
        with_python(|py| {
            let mut s = scheduler(4);
            let mut t = EventTracker::new(2, 2, true, Vec::new(), 1, Vec::new());
            let (req, hashes) = request(py, "c");
            let k = keys(&hashes);
            let src = source(&req, &hashes);
            t.record_store(&src, &k, 0).unwrap();
            store(&mut s, &k, StoreOutcome::Failure);
            assert!(t.take(py, &mut s).unwrap().is_empty(), "nothing announced");
            assert_eq!((t.held_payloads(), t.held_hashes()), (0, 0));
        });
    }

    #[test]
    fn a_lookup_records_the_chunks_it_found() {
        with_python(|py| {
            let mut s = scheduler(4);
            let mut t = EventTracker::new(2, 2, true, Vec::new(), 1, Vec::new());
            let (req, hashes) = request(py, "d");
            let k = keys(&hashes);
            // Stored without a record (as vLLM after a removal and a store in
            // one batch): the store is a placeholder, the lookup records it.
            store(&mut s, &k, StoreOutcome::Success);
            let src = source(&req, &hashes);
            t.record_lookup(&src, 1..5).unwrap();
            assert_eq!(t.held_payloads(), 1, "chunk 1 only (the range is clipped)");
            let ev = t.take(py, &mut s).unwrap();
            let items: Vec<String> = ev[0].2.iter().map(|i| text(py, i)).collect();
            // Chunk 0: neither recorded nor its hash known: its 8-byte key.
            let key0 = PyBytes::new(py, &k[0].0.to_le_bytes())
                .repr()
                .unwrap()
                .to_string();
            assert_eq!(items[0], key0);
            assert_eq!(
                items[1],
                "([b'd2', b'd3'], b'd1', [104, 105, 106, 107], None, None)"
            );
        });
    }

    #[test]
    fn with_groups_only_full_attention_chunks_carry_a_payload() {
        with_python(|py| {
            let mut s = scheduler(8);
            // Group 0 full attention, group 1 a sliding window.
            let mut t = EventTracker::new(2, 2, true, vec![false, true], 1, Vec::new());
            let (req, hashes) = request(py, "g");
            let src = source(&req, &hashes);
            let full = vec![ChunkKey::for_group(hashes[1], 0)];
            let window = vec![ChunkKey::for_group(hashes[3], 1)];
            t.record_store(&src, &full, 0).unwrap();
            t.record_store(&src, &window, 1).unwrap();
            store(&mut s, &full, StoreOutcome::Success);
            store(&mut s, &window, StoreOutcome::Success);
            let ev = t.take(py, &mut s).unwrap();
            let got: Vec<(bool, u32, Vec<String>)> = ev
                .iter()
                .map(|(r, g, items)| (*r, *g, items.iter().map(|i| text(py, i)).collect()))
                .collect();
            assert_eq!(
                got,
                [
                    (
                        false,
                        0,
                        vec![
                            "([b'g0', b'g1'], None, [100, 101, 102, 103], None, None)".to_string()
                        ]
                    ),
                    (false, 1, vec!["b'g3'".to_string()]),
                ]
            );
            assert_eq!(t.held_payloads(), 1);
            // A lookup's finds: a window group's chunk gets no payload; a
            // full-attention chunk already described stays one.
            t.record_group_lookup(&src, &[(1, 1), (0, 0)]).unwrap();
            assert_eq!(t.held_payloads(), 1);
            t.record_group_lookup(&src, &[(0, 1), (0, 9)]).unwrap();
            assert_eq!(
                t.held_payloads(),
                2,
                "chunk 1 of group 0; chunk 9 is past the request"
            );
        });
    }

    #[test]
    fn placeholders_name_each_chunk_by_its_last_block() {
        with_python(|py| {
            let mut s = scheduler(4);
            let mut t = EventTracker::new(2, 2, false, Vec::new(), 1, Vec::new());
            let (req, hashes) = request(py, "e");
            let k = keys(&hashes);
            let src = source(&req, &hashes);
            t.record_store(&src, &k, 0).unwrap();
            t.record_lookup(&src, 0..2).unwrap();
            store(&mut s, &k, StoreOutcome::Success);
            let ev = t.take(py, &mut s).unwrap();
            let items: Vec<String> = ev[0].2.iter().map(|i| text(py, i)).collect();
            assert_eq!(items, ["b'e1'", "b'e3'"]);
            assert_eq!(t.held_payloads(), 0);
        });
    }

    #[test]
    fn a_payload_carries_the_requests_lora() {
        with_python(|py| {
            let mut s = scheduler(4);
            let mut t = EventTracker::new(2, 2, true, Vec::new(), 1, Vec::new());
            let lora = "__import__('types').SimpleNamespace(adapter_id=7, name='sql-adapter')";
            let (req, hashes) = request_with_lora(py, "f", lora);
            let k = keys(&hashes);
            let src = source(&req, &hashes);
            t.record_store(&src, &k[..1], 0).unwrap();
            store(&mut s, &k[..1], StoreOutcome::Success);
            let ev = t.take(py, &mut s).unwrap();
            assert_eq!(
                text(py, &ev[0].2[0]),
                "([b'f0', b'f1'], None, [100, 101, 102, 103], 7, 'sql-adapter')"
            );
        });
    }
}
