//! Partial tails from the remote tier (`docs/remote-tier.md`). The remote
//! lookup of a request's complete chunks (`on_remote.rs`) also asks about
//! the partial-tail keys (`partial_tail.rs`) the host tier lacks in the
//! block after the furthest those chunks could reach; when the hit over
//! both tiers gets there, the tail joins the same fetch job
//! ([`Scheduler::tails_with_complete_chunks`]). Otherwise the remote tier
//! is asked about the block after the hit over both tiers as the fetch of
//! the complete chunks starts, so that the answer comes while the fetch
//! runs ([`Scheduler::ask_tails_with_fetch`]; dropped if the fetch fails),
//! or, with no fetch, once the complete chunks are settled at `at` tokens
//! (the host tier's complete hit) about the block after `at`, past the
//! host tier's own tail; the request waits ("not yet") until it answers.
//! Either way the rightmost boundary whose keys every group holds in one
//! tier or the other ([`lookup_partial_tail`] over both) is fetched
//! (the keys the host tier lacks), and the next lookup finds that tail in
//! the host tier and loads it. Nothing found, a fetch that fails or no
//! room in the host tier leaves the request to the host tier's answer at
//! `at`; a request asks about partial tails alone at most
//! [`MAX_ATTEMPTS`] times.
//!
//! Beside an EAGLE/MTP draft group a tail may lie in the second block past
//! the complete hit and then needs the complete "bridge" chunk between
//! ([`lookup_partial_tail_bridged`]): the attention groups' bridge keys the
//! host tier lacks are asked about with the tails (as `(BRIDGE, group)`),
//! and fetched with the tail that needs them.

use std::collections::HashSet;

use crate::ids::RequestId;
use crate::key::ChunkKey;
use crate::manager::LookupResult;
use crate::scheduler::remote::{FetchAt, MAX_ATTEMPTS, Probe, RequestProbe, TailsAsked};
use crate::scheduler::request::RequestState;
use crate::scheduler::{LookupOutcome, Scheduler};

use super::lookup::KeyState;
use super::partial_tail::{
    BridgeAnswer, PartialAnswer, PartialTailKey, lookup_partial_tail_bridged,
};

/// The boundary that names a group's bridge chunk key among the
/// `(boundary, group)`s asked about (no tail ends at 0 tokens).
pub(super) const BRIDGE: u64 = 0;

/// The keys a fetch of a partial tail brings: the tail's (every group's
/// key the host tier lacks at its boundary), and, for a tail past the
/// bridge chunk, the attention groups' bridge keys the host tier lacks.
#[derive(Debug, Default)]
pub(super) struct TailFetch {
    /// The boundary of the tail the lookup over both tiers ends on, past
    /// the host tier's hit (`None`: none).
    pub boundary: Option<u64>,
    /// The tail's keys.
    pub tails: Vec<PartialTailKey>,
    /// The bridge chunk (its index) and `(group, key)` of its keys to fetch.
    pub bridge: Option<(usize, Vec<(usize, ChunkKey)>)>,
}

impl TailFetch {
    /// Whether there is anything to fetch.
    pub(super) fn is_empty(&self) -> bool {
        self.tails.is_empty() && self.bridge.is_none()
    }

    /// The tail's chunk in blocks of `block_tokens` (where one is found).
    fn tail_chunk(&self, block_tokens: u64) -> Option<usize> {
        self.boundary.map(|b| (b / block_tokens.max(1)) as usize)
    }

    /// Every key to fetch with its group: the bridge's, then the tail's
    /// (`start_fetch` puts them group by group).
    pub(super) fn keys(&self) -> impl Iterator<Item = (usize, ChunkKey)> + '_ {
        let bridge = self
            .bridge
            .iter()
            .flat_map(|(_, keys)| keys.iter().copied());
        bridge.chain(self.tails.iter().map(|t| (t.group, t.key)))
    }
}

impl Scheduler {
    /// The remote side's answer for the partial tail of `req` (GPU hit
    /// `computed` tokens), whose complete chunks hit `complete_hit` tokens
    /// and whose host-tier lookup with partial tails answered `host`:
    /// `Some(Defer)` while asking or fetching, `None` to answer `host`.
    pub(crate) fn remote_partial_tail(
        &mut self,
        req: RequestId,
        computed: u64,
        complete_hit: u64,
        host: LookupOutcome,
    ) -> Option<LookupOutcome> {
        let LookupOutcome::Hit(host_hit) = host else {
            return None;
        };
        self.partial_tails?;
        let at = usize::try_from(computed.saturating_add(complete_hit)).ok()?;
        let host_end = computed.saturating_add(host_hit);
        let r = self.remote.as_mut()?;
        r.poll();
        let entry = r.probes.get(&req).copied();
        let attempts = entry.map_or(0, |e| e.attempts);
        let tail_attempts = entry.map_or(0, |e| e.tail_attempts);
        match entry.map(|e| e.probe) {
            Some(Probe::TailKnown { at: a }) if a == at => return None,
            Some(Probe::TailFetching { .. }) => return Some(LookupOutcome::Defer),
            Some(Probe::TailAsked { at: a, ticket }) if a == at => {
                let Some(answer) = r.answered.remove(&ticket) else {
                    return Some(LookupOutcome::Defer);
                };
                r.asked.remove(&ticket);
                let asked = r.tail_asked.remove(&req).unwrap_or_default();
                let present = r.found(&asked, &answer, 0);
                return self.fetch_partial_tail(req, computed, complete_hit, host_end, &present);
            }
            // A lookup still in flight for another position is dropped
            // with its answer.
            _ => r.drop_asked(req),
        }
        let (asked, keys) = if tail_attempts >= MAX_ATTEMPTS {
            (Vec::new(), Vec::new())
        } else {
            self.tail_candidates(req, computed, complete_hit, host_end)
        };
        let r = self.remote.as_mut()?;
        if asked.is_empty() {
            r.set_probe(req, Probe::TailKnown { at }, attempts);
            return None;
        }
        let ticket = r.tier.lookup(&keys);
        r.asked.insert(ticket, req);
        r.tail_asked.insert(req, asked);
        r.stats.lookups += 1;
        r.probes.insert(
            req,
            RequestProbe {
                probe: Probe::TailAsked { at, ticket },
                attempts,
                tail_attempts: tail_attempts + 1,
            },
        );
        Some(LookupOutcome::Defer)
    }

    /// The fetch of `req`'s complete chunks, to a hit of `complete_hit`
    /// tokens past `computed`, has started and has not settled the partial
    /// tails past that hit: the remote tier is asked about them now, so
    /// that their answer comes while the fetch runs and the lookup after
    /// it can fetch the tail at once ([`Probe::TailAsked`]) instead of
    /// asking then and waiting once more. With none to ask about they are
    /// settled.
    pub(super) fn ask_tails_with_fetch(
        &mut self,
        req: RequestId,
        computed: u64,
        complete_hit: u64,
    ) {
        if self.partial_tails.is_none() {
            return;
        }
        let tail_attempts = self
            .remote
            .as_ref()
            .and_then(|r| r.probes.get(&req))
            .map_or(MAX_ATTEMPTS, |p| p.tail_attempts);
        if tail_attempts >= MAX_ATTEMPTS {
            return;
        }
        let end = computed.saturating_add(complete_hit);
        let (asked, keys) = self.tail_candidates(req, computed, complete_hit, end);
        let Some(r) = self.remote.as_mut() else {
            return;
        };
        let Some(p) = r.probes.get_mut(&req) else {
            return;
        };
        let Probe::FetchingGroups { tails, .. } = &mut p.probe else {
            return;
        };
        if asked.is_empty() {
            *tails = TailsAsked::NoneFound;
            return;
        }
        let ticket = r.tier.lookup(&keys);
        *tails = TailsAsked::Asking(ticket);
        p.tail_attempts += 1;
        r.asked.insert(ticket, req);
        r.tail_asked.insert(req, asked);
        r.stats.lookups += 1;
    }

    /// The `(boundary, group)`s to ask the remote tier about, and their
    /// keys: every group's partial-tail key the host tier misses at the
    /// boundaries a tail may end on past `host_end`, after a complete hit
    /// of `complete_hit` tokens.
    pub(super) fn tail_candidates(
        &self,
        req: RequestId,
        computed: u64,
        complete_hit: u64,
        host_end: u64,
    ) -> (Vec<(u64, usize)>, Vec<ChunkKey>) {
        let (mut asked, mut keys) = (Vec::new(), Vec::new());
        let (Some((_, lookup)), Some(rs)) = (
            self.partial_lookup(req, computed, complete_hit),
            self.requests.get(&req),
        ) else {
            return (asked, keys);
        };
        let mut past_bridge = false;
        for boundary in lookup.boundaries().take_while(|&b| b > host_end) {
            past_bridge |= boundary >= lookup.bridge_boundary();
            for g in 0..lookup.num_groups {
                if self.host_tail_state(rs, g, boundary) != KeyState::Miss {
                    continue;
                }
                if let Some(key) = self.tail_key(rs, g, boundary) {
                    asked.push((boundary, g));
                    keys.push(key);
                }
            }
        }
        if past_bridge {
            let chunk = (lookup.computed + lookup.complete_hit) / lookup.block_tokens.max(1);
            for (g, key) in self.bridge_keys(rs, chunk as usize) {
                if self.manager.lookup(key) == LookupResult::Miss {
                    asked.push((BRIDGE, g));
                    keys.push(key);
                }
            }
        }
        (asked, keys)
    }

    /// The attention groups' keys of `rs`'s complete chunk `chunk` (the
    /// recurrent groups need none: their tail is the state).
    fn bridge_keys(&self, rs: &RequestState, chunk: usize) -> Vec<(usize, ChunkKey)> {
        let Some(groups) = self.groups.as_deref() else {
            return Vec::new();
        };
        (0..groups.len())
            .filter(|&g| !groups.shapes[g].is_recurrent_state())
            .filter_map(|g| {
                let per_chunk = groups.hashes_per_chunk(g);
                (chunk < rs.num_keys(per_chunk)).then(|| (g, rs.group_key(g, chunk, per_chunk)))
            })
            .collect()
    }

    /// The remote tier answered `present`: fetch the keys the host tier
    /// lacks of the partial tail the lookup over both tiers ends on, when
    /// it ends past `host_end`.
    fn fetch_partial_tail(
        &mut self,
        req: RequestId,
        computed: u64,
        complete_hit: u64,
        host_end: u64,
        present: &HashSet<(u64, usize)>,
    ) -> Option<LookupOutcome> {
        let at = usize::try_from(computed.saturating_add(complete_hit)).ok()?;
        let fetch = self.tail_keys_to_fetch(req, computed, complete_hit, host_end, present);
        let (pt, lookup) = self.partial_lookup(req, computed, complete_hit)?;
        let r = self.remote.as_mut()?;
        let attempts = r.probes.get(&req).map_or(0, |p| p.attempts);
        // Nothing the host tier lacks (its tail needing only the bridge
        // is fetched too).
        let Some(last) = fetch
            .tail_chunk(pt.block_tokens)
            .filter(|_| !fetch.is_empty())
        else {
            r.set_probe(req, Probe::TailKnown { at }, attempts);
            return None;
        };
        let at_fetch = FetchAt::Tail {
            at,
            chunk: fetch.bridge.as_ref().map_or(last, |(c, _)| *c),
            last,
            groups: lookup.num_groups,
        };
        let (key_groups, keys): (Vec<usize>, Vec<ChunkKey>) = fetch.keys().unzip();
        let outcome = self.start_fetch(req, &keys, &key_groups, attempts, at_fetch);
        if outcome.is_some() {
            // The next step's KV events name them by vLLM's hash at the
            // boundary, as a store of them would.
            self.fetched_partial_tails.extend(fetch.tails);
        }
        outcome
    }

    /// The keys the host tier lacks of the partial tail that the lookup
    /// over both tiers (the remote tier holding `present`) ends on, past a
    /// complete hit of `complete_hit` tokens, when it ends past `host_end`
    /// (with the bridge chunk's, past it); none otherwise.
    pub(super) fn tail_keys_to_fetch(
        &self,
        req: RequestId,
        computed: u64,
        complete_hit: u64,
        host_end: u64,
        present: &HashSet<(u64, usize)>,
    ) -> TailFetch {
        let mut fetch = TailFetch::default();
        let (Some((_, lookup)), Some(rs)) = (
            self.partial_lookup(req, computed, complete_hit),
            self.requests.get(&req),
        ) else {
            return fetch;
        };
        let chunk = ((lookup.computed + lookup.complete_hit) / lookup.block_tokens.max(1)) as usize;
        // The bridge over both tiers: a key being loaded or written waits,
        // one neither tier holds misses.
        let bridge_keys = self.bridge_keys(rs, chunk);
        let bridge = |_| {
            let mut answer = BridgeAnswer::default();
            for &(_, key) in &bridge_keys {
                answer.pending |= self.being_loaded.contains_key(&key);
            }
            for &(g, key) in &bridge_keys {
                match self.manager.lookup(key) {
                    LookupResult::Hit => {}
                    LookupResult::HitPending => answer.pending = true,
                    LookupResult::Miss if present.contains(&(BRIDGE, g)) => {}
                    LookupResult::Miss => {
                        answer.miss = true;
                        break;
                    }
                }
            }
            answer
        };
        let answer = lookup_partial_tail_bridged(lookup, bridge, |boundary, g| {
            match self.host_tail_state(rs, g, boundary) {
                KeyState::Miss if present.contains(&(boundary, g)) => KeyState::Hit,
                state => state,
            }
        });
        if let PartialAnswer::Tail(boundary) = answer
            && boundary > host_end
        {
            fetch.boundary = Some(boundary);
            if boundary >= lookup.bridge_boundary() {
                let missing = bridge_keys
                    .iter()
                    .copied()
                    .filter(|&(_, key)| self.manager.lookup(key) == LookupResult::Miss)
                    .collect::<Vec<_>>();
                if !missing.is_empty() {
                    fetch.bridge = Some((chunk, missing));
                }
            }
            let tails = &mut fetch.tails;
            for g in 0..lookup.num_groups {
                if self.host_tail_state(rs, g, boundary) != KeyState::Miss {
                    continue;
                }
                if let Some(key) = self.tail_key(rs, g, boundary) {
                    tails.push(PartialTailKey {
                        req,
                        group: g,
                        boundary,
                        key_tokens: self.tail_key_tokens(g, boundary),
                        key,
                    });
                }
            }
        }
        fetch
    }

    /// Fetching the complete chunks that end the hit over both tiers
    /// `complete_hit` tokens past `computed`, with partial tails found in
    /// the same remote lookup (`tails`, asked past the furthest the
    /// complete chunks could reach): the tail's keys to fetch with them,
    /// and what that settles (nothing unless the hit reaches that far).
    pub(super) fn tails_with_complete_chunks(
        &self,
        req: RequestId,
        computed: u64,
        complete_hit: u64,
        tails: Option<&HashSet<(u64, usize)>>,
    ) -> (TailFetch, TailsAsked) {
        let Some(tails) = tails else {
            return (TailFetch::default(), TailsAsked::No);
        };
        let ceiling = self.hit_with_remote(req, computed, None).unwrap_or(0);
        if complete_hit != ceiling {
            return (TailFetch::default(), TailsAsked::No);
        }
        let end = computed.saturating_add(complete_hit);
        let fetch = self.tail_keys_to_fetch(req, computed, complete_hit, end, tails);
        let settled = if fetch.is_empty() {
            TailsAsked::NoneFound
        } else {
            TailsAsked::Fetched
        };
        (fetch, settled)
    }
}
