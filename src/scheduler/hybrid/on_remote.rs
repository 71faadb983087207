//! The remote tier behind the host tier with several KV groups
//! (`docs/remote-tier.md`): a lookup whose host-tier hit could go further
//! asks the remote tier about every group's chunks the host tier misses, up
//! to where the hit could end; the request waits ("not yet") until the
//! answer comes. The hit the host tier and the remote tier give together is
//! vLLM's lookup ([`lookup_complete_chunks`]) over both; when it ends past
//! the host tier's alone, the chunks that hit reads (every full-attention
//! chunk past the GPU's hit, each sliding window's load window) and only
//! the host tier lacks become one fetch job, and the next lookup finds them
//! in the host tier. A fetch that fails leaves the request to the host tier
//! at the position it asked from.

use std::collections::HashSet;

use crate::ids::RequestId;
use crate::key::ChunkKey;
use crate::manager::LookupResult;
use crate::scheduler::remote::{FetchAt, MAX_ATTEMPTS, Probe, TailsAsked};
use crate::scheduler::{LookupOutcome, Scheduler};

use super::lookup::{GroupKeys, HybridLookup, KeyState, load_chunks, lookup_complete_chunks};

/// A request's keys answered as if the remote tier's `present` chunks were
/// in the host tier too (`present: None`: as if every chunk were).
struct WithRemote<'a> {
    scheduler: &'a Scheduler,
    request: RequestId,
    /// Per group, the request's keys.
    num_keys: Vec<usize>,
    present: Option<&'a HashSet<(usize, usize)>>,
}

impl WithRemote<'_> {
    fn key(&self, group: usize, chunk: usize) -> Option<ChunkKey> {
        self.scheduler.group_key(self.request, group, chunk)
    }

    fn host_state(&self, group: usize, chunk: usize) -> KeyState {
        match self
            .key(group, chunk)
            .map(|k| self.scheduler.manager.lookup(k))
        {
            Some(LookupResult::Hit) => KeyState::Hit,
            Some(LookupResult::HitPending) => KeyState::HitPending,
            _ => KeyState::Miss,
        }
    }
}

impl GroupKeys for WithRemote<'_> {
    fn num_keys(&self, group: usize) -> usize {
        self.num_keys.get(group).copied().unwrap_or(0)
    }

    fn state(&mut self, group: usize, chunk: usize) -> KeyState {
        let Some(present) = self.present else {
            return KeyState::Hit;
        };
        match self.host_state(group, chunk) {
            KeyState::Miss if present.contains(&(group, chunk)) => KeyState::Hit,
            state => state,
        }
    }

    fn being_loaded(&self, group: usize, chunk: usize) -> bool {
        self.present.is_some()
            && !self.scheduler.being_loaded.is_empty()
            && self
                .key(group, chunk)
                .is_some_and(|k| self.scheduler.being_loaded.contains_key(&k))
    }
}

impl Scheduler {
    /// The remote side's answer for restarted request `req` (GPU hit
    /// `computed` tokens) whose host-tier lookup answered `host_hit`:
    /// `Some(Defer)` while asking or fetching, `None` to answer `host_hit`.
    pub(crate) fn remote_lookup_groups(
        &mut self,
        req: RequestId,
        computed: u64,
        host_hit: u64,
    ) -> Option<LookupOutcome> {
        let position = usize::try_from(computed.saturating_add(host_hit)).ok()?;
        let r = self.remote.as_mut()?;
        r.poll();
        let entry = r.probes.get(&req).copied();
        let attempts = entry.map_or(0, |e| e.attempts);
        match entry.map(|e| e.probe) {
            // Settled there (and maybe its partial tails asked about:
            // `on_remote_tail.rs`).
            Some(p) if p.settled_at(position) => return None,
            Some(
                Probe::Fetching { .. } | Probe::FetchingGroups { .. } | Probe::TailFetching { .. },
            ) => {
                return Some(LookupOutcome::Defer);
            }
            Some(Probe::Asked { first, ticket }) if first == position => {
                let Some(answer) = r.answered.remove(&ticket) else {
                    return Some(LookupOutcome::Defer);
                };
                r.asked.remove(&ticket);
                let asked = r.group_asked.remove(&req).unwrap_or_default();
                let tails = r.tail_asked.remove(&req);
                let present = r.found(&asked, &answer, 0);
                let tails = tails.map(|t| r.found(&t, &answer, asked.len()));
                return self.fetch_for_groups(
                    req,
                    computed,
                    host_hit,
                    &present,
                    tails.as_ref(),
                    attempts,
                );
            }
            // A lookup still in flight for another position is dropped
            // with its answer.
            _ => r.drop_asked(req),
        }
        let (asked, mut keys) = if attempts >= MAX_ATTEMPTS {
            (Vec::new(), Vec::new())
        } else {
            self.remote_candidates(req, computed, host_hit)
        };
        if asked.is_empty() {
            self.remote.as_mut()?.known_absent(req, position, attempts);
            return None;
        }
        // With partial tails, the same lookup asks about those past the
        // furthest the complete chunks could reach (`on_remote_tail.rs`):
        // where the hit over both tiers gets there, one round settles both.
        let (tails, tail_keys) = if self.partial_tails.is_some() {
            let ceiling = self.hit_with_remote(req, computed, None).unwrap_or(0);
            let end = computed.saturating_add(ceiling);
            self.tail_candidates(req, computed, ceiling, end)
        } else {
            (Vec::new(), Vec::new())
        };
        keys.extend(tail_keys);
        let r = self.remote.as_mut()?;
        let ticket = r.tier.lookup(&keys);
        r.asked.insert(ticket, req);
        r.group_asked.insert(req, asked);
        if !tails.is_empty() {
            r.tail_asked.insert(req, tails);
        }
        r.stats.lookups += 1;
        let probe = Probe::Asked {
            first: position,
            ticket,
        };
        r.set_probe(req, probe, attempts + 1);
        Some(LookupOutcome::Defer)
    }

    fn group_key(&self, req: RequestId, group: usize, chunk: usize) -> Option<ChunkKey> {
        let rs = self.requests.get(&req)?;
        let per_chunk = self.groups.as_deref()?.hashes_per_chunk(group);
        Some(rs.group_key(group, chunk, per_chunk))
    }

    /// vLLM's lookup of `req` with `present` read as it were in the host
    /// tier (`None`: every chunk): the hit in tokens past `computed`, `None`
    /// when it would wait.
    pub(super) fn hit_with_remote(
        &self,
        req: RequestId,
        computed: u64,
        present: Option<&HashSet<(usize, usize)>>,
    ) -> Option<u64> {
        let groups = self.groups.as_deref()?;
        let rs = self.requests.get(&req)?;
        let mut keys = WithRemote {
            scheduler: self,
            request: req,
            num_keys: (0..groups.len())
                .map(|g| rs.num_keys(groups.hashes_per_chunk(g)))
                .collect(),
            present,
        };
        let lookup = HybridLookup {
            computed,
            num_tokens: rs.num_tokens,
            max_load_tokens: rs.caps.max_load_tokens,
            max_new_tokens: None,
        };
        lookup_complete_chunks(&groups.shapes, &mut keys, lookup)
    }

    /// The `(group, chunk)`s to ask the remote tier about, and their keys:
    /// every group's chunks the host tier misses between the GPU's hit and
    /// the furthest a hit could end; none when the host tier's hit is
    /// already that far.
    fn remote_candidates(
        &self,
        req: RequestId,
        computed: u64,
        host_hit: u64,
    ) -> (Vec<(usize, usize)>, Vec<ChunkKey>) {
        let (mut asked, mut keys) = (Vec::new(), Vec::new());
        let (Some(groups), Some(rs)) = (self.groups.as_deref(), self.requests.get(&req)) else {
            return (asked, keys);
        };
        let ceiling = self.hit_with_remote(req, computed, None).unwrap_or(0);
        if ceiling <= host_hit {
            return (asked, keys);
        }
        let end = computed.saturating_add(ceiling);
        for (g, shape) in groups.shapes.iter().enumerate() {
            let tpc = shape.tokens_per_chunk();
            let per_chunk = groups.hashes_per_chunk(g);
            let num_keys = rs.num_keys(per_chunk);
            let start = (computed / tpc) as usize;
            // A draft group's hit needs the chunk after its end too.
            let peek = usize::from(shape.is_eagle_draft());
            let stop = (end.div_ceil(tpc) as usize + peek).min(num_keys);
            for c in start..stop {
                let key = rs.group_key(g, c, per_chunk);
                if self.manager.lookup(key) == LookupResult::Miss {
                    asked.push((g, c));
                    keys.push(key);
                }
            }
        }
        (asked, keys)
    }

    /// The remote tier answered `present`: fetch what the hit over both tiers
    /// reads and the host tier lacks, when that hit ends past `host_hit`.
    fn fetch_for_groups(
        &mut self,
        req: RequestId,
        computed: u64,
        host_hit: u64,
        present: &HashSet<(usize, usize)>,
        tails: Option<&HashSet<(u64, usize)>>,
        attempts: u8,
    ) -> Option<LookupOutcome> {
        let before = usize::try_from(computed.saturating_add(host_hit)).ok()?;
        let hit = self
            .hit_with_remote(req, computed, Some(present))
            .filter(|&h| h > host_hit);
        let (Some(hit), Some(groups), Some(rs)) =
            (hit, self.groups.as_deref(), self.requests.get(&req))
        else {
            self.remote.as_mut()?.known_absent(req, before, attempts);
            return None;
        };
        let end = computed.saturating_add(hit);
        let mut keys = Vec::new();
        let mut key_groups = Vec::new();
        let (mut lo, mut hi) = (usize::MAX, 0);
        for (g, shape) in groups.shapes.iter().enumerate() {
            let per_chunk = groups.hashes_per_chunk(g);
            let num_keys = rs.num_keys(per_chunk);
            // A draft group's hit also needs the chunk after its end in the
            // host tier (not loaded).
            let after = end.div_ceil(shape.tokens_per_chunk()) as usize;
            let peek = (shape.is_eagle_draft() && after < num_keys).then_some(after);
            for c in load_chunks(shape, computed, end, num_keys).chain(peek) {
                if present.contains(&(g, c)) {
                    keys.push(rs.group_key(g, c, per_chunk));
                    key_groups.push(g);
                    // In the configuration's chunks (one token unit for
                    // every group).
                    let unit = groups.unit_chunks(g, c..c + 1);
                    lo = lo.min(unit.start);
                    hi = hi.max(unit.end);
                }
            }
        }
        if keys.is_empty() {
            self.remote.as_mut()?.known_absent(req, before, attempts);
            return None;
        }
        // Partial tails asked with these chunks, past the hit they lead to
        // (beside a draft group with the bridge chunk before them, unless
        // these chunks hold it already).
        let (fetch, settled) = self.tails_with_complete_chunks(req, computed, hit, tails);
        if let (Some(groups), Some(boundary)) = (self.groups.as_deref(), fetch.boundary) {
            // One block size for every group with partial tails: the
            // bridge's keys in its chunk, the tail's in the tail's.
            let tail_chunk = (boundary / groups.shapes[0].tokens_per_chunk()) as usize;
            let bridge = fetch
                .bridge
                .iter()
                .flat_map(|(c, keys)| keys.iter().map(move |&(g, k)| (g, *c, k)));
            let tail = fetch.tails.iter().map(|t| (t.group, tail_chunk, t.key));
            for (g, c, key) in bridge.chain(tail) {
                if keys.contains(&key) {
                    continue;
                }
                keys.push(key);
                key_groups.push(g);
                let unit = groups.unit_chunks(g, c..c + 1);
                lo = lo.min(unit.start);
                hi = hi.max(unit.end);
            }
        }
        let tail_keys = fetch.tails;
        let after = usize::try_from(end).ok()?;
        let at = FetchAt::Groups {
            before,
            after,
            lo,
            hi,
            groups: self.groups.as_deref().map_or(0, |g| g.shapes.len()),
            tails: settled,
        };
        let outcome = self.start_fetch(req, &keys, &key_groups, attempts, at);
        if outcome.is_some() {
            // Named in the next step's KV events (`on_remote_tail.rs`).
            self.fetched_partial_tails.extend(tail_keys);
            if settled == TailsAsked::No {
                self.ask_tails_with_fetch(req, computed, hit);
            }
        }
        outcome
    }
}
