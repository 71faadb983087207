//! The remote tier behind the host tier (`docs/remote-tier.md`): a lookup
//! that misses the host tier asks the remote tier about the rest of the
//! request's prefix, answering "not yet" (vLLM's deferred lookup) until the
//! answer comes; a remote hit becomes a **fetch job**: host slots are
//! allocated for the chunks found (as a store's are), every worker reads its
//! share from the remote tier into them, and the job completes as a store
//! does. The next lookup finds the chunks in the host tier, and the normal
//! load takes them to the GPU. A fetch that misses, fails, times out or
//! stalls ends like a failed store: the slots are freed (or quarantined), and
//! the request's next lookup answers from the host tier alone (it recomputes
//! the rest).
//!
//! Without a remote tier attached nothing here runs: the scheduler's
//! behaviour is vLLM's, exactly (`tests/conformance`).

use std::collections::HashMap;
use std::ops::Range;

use crate::ids::{ChunkId, JobId, RequestId};
use crate::key::ChunkKey;
use crate::remote::{Answer, RemoteTier, Ticket, WritePolicy};

use super::Scheduler;
use super::jobs::JobEntry;
use super::types::{GroupSpan, JobBlocks, JobKeys, JobSlots, LookupOutcome, TransferJob};

/// Remote fetch attempts per request position before it stops asking (so
/// that a host tier evicting fetched chunks before their load cannot make a
/// request ask for ever).
pub(super) const MAX_ATTEMPTS: u8 = 2;

/// Where a request stands with the remote tier.
///
/// With several KV groups a position is the host tier's hit end in tokens
/// (`hybrid/on_remote.rs`); with one, the chunk where its scan stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Probe {
    /// Asked which chunks from `first` on the remote tier holds.
    Asked { first: usize, ticket: Ticket },
    /// Fetching `count` chunks from `first` on into the host tier.
    Fetching { first: usize, count: usize },
    /// With several groups: fetching `count` chunks (chunk indices
    /// `lo..hi`, over the groups) so that the complete chunks' hit ends at
    /// `after` tokens instead of `before`; `tails`: what the same remote
    /// lookup settled of the partial tails past `after`.
    FetchingGroups {
        before: usize,
        after: usize,
        lo: usize,
        hi: usize,
        count: usize,
        tails: TailsAsked,
    },
    /// Chunks from `first_absent` on are not to be had remotely (absent, or
    /// the fetch failed): lookups answer from the host tier alone.
    Known { first_absent: usize },
    /// Partial tails (`hybrid/on_remote_tail.rs`): the complete chunks are
    /// settled at `at` tokens (as `Known`), and the remote tier was asked
    /// about the partial tails in the block after.
    TailAsked { at: usize, ticket: Ticket },
    /// Fetching a partial tail in chunk `last` (`count` keys; from chunk
    /// `chunk` on, the bridge chunk before it with a draft group) past the
    /// complete chunks settled at `at`.
    TailFetching {
        at: usize,
        chunk: usize,
        last: usize,
        count: usize,
    },
    /// The complete chunks and the partial tails past `at` are settled:
    /// lookups at `at` answer from the host tier alone.
    TailKnown { at: usize },
}

impl Probe {
    /// Whether the complete chunks are settled at `position` (tokens, with
    /// several groups): the remote tier is not asked about them again.
    pub(super) fn settled_at(self, position: usize) -> bool {
        match self {
            Probe::Known { first_absent } => first_absent == position,
            Probe::TailAsked { at, .. } | Probe::TailKnown { at } => at == position,
            _ => false,
        }
    }
}

/// What a remote lookup of complete chunks settled of the partial tails
/// past the hit it leads to (`hybrid/on_remote_tail.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TailsAsked {
    /// Not asked: a lookup after the fetch asks.
    No,
    /// Asked when the fetch started, past the hit it leads to (`ticket`):
    /// once the fetch ends, the request's probe waits on that answer
    /// ([`Probe::TailAsked`]).
    Asking(Ticket),
    /// Asked with the complete chunks, none to fetch: settled.
    NoneFound,
    /// Asked, and the fetch brings one in.
    Fetched,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct RequestProbe {
    pub(super) probe: Probe,
    /// Remote lookups of complete chunks sent for the request.
    pub(super) attempts: u8,
    /// Remote lookups of partial tails sent for the request.
    pub(super) tail_attempts: u8,
}

/// Where a fetch job takes a request's probe.
#[derive(Debug, Clone, Copy)]
pub(super) enum FetchAt {
    /// One group: chunks from `first` on.
    Prefix { first: usize },
    /// Several groups: the complete chunks' hit end moves from `before` to
    /// `after` tokens; the fetched chunks lie in `lo..hi`; `groups`: the
    /// number of groups; `tails`: the partial tails past `after`.
    Groups {
        before: usize,
        after: usize,
        lo: usize,
        hi: usize,
        groups: usize,
        tails: TailsAsked,
    },
    /// A partial tail in chunk `last` (from chunk `chunk` on: the bridge
    /// chunk before it, fetched with it beside a draft group), past the
    /// complete chunks settled at `at` tokens; `groups`: the number of
    /// groups.
    Tail {
        at: usize,
        chunk: usize,
        last: usize,
        groups: usize,
    },
}

impl FetchAt {
    /// Where the request's probe stays when the fetch cannot start or fails.
    fn settled(self) -> Probe {
        match self {
            FetchAt::Prefix { first } => Probe::Known {
                first_absent: first,
            },
            FetchAt::Groups { before, .. } => Probe::Known {
                first_absent: before,
            },
            FetchAt::Tail { at, .. } => Probe::TailKnown { at },
        }
    }

    /// The request's probe while the fetch of `count` keys runs.
    fn fetching(self, count: usize) -> Probe {
        match self {
            FetchAt::Prefix { first } => Probe::Fetching { first, count },
            FetchAt::Groups {
                before,
                after,
                lo,
                hi,
                tails,
                ..
            } => Probe::FetchingGroups {
                before,
                after,
                lo,
                hi,
                count,
                tails,
            },
            FetchAt::Tail {
                at, chunk, last, ..
            } => Probe::TailFetching {
                at,
                chunk,
                last,
                count,
            },
        }
    }

    /// With several groups, their number.
    fn groups(self) -> Option<usize> {
        match self {
            FetchAt::Prefix { .. } => None,
            FetchAt::Groups { groups, .. } | FetchAt::Tail { groups, .. } => Some(groups),
        }
    }
}

/// What the remote side of the scheduler did (cumulative).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteLookupStats {
    /// Remote lookups sent (one per request position).
    pub lookups: u64,
    /// Chunks those lookups found.
    pub chunks_found: u64,
    /// Fetch jobs created.
    pub fetch_jobs: u64,
    /// Chunks fetched into the host tier (jobs that succeeded).
    pub chunks_fetched: u64,
    /// Fetch jobs that failed or stalled (their requests recompute).
    pub fetches_failed: u64,
    /// Partial tails (recurrent states inside a block, every group's key at
    /// one boundary) fetched into the host tier: fetch jobs that succeeded.
    pub partial_tails_fetched: u64,
    /// Host-tier allocations refused for a fetch (no room).
    pub allocation_failures: u64,
}

/// The scheduler's remote side: its tier connection (lookups only; the
/// workers fetch and write through on their own connections) and each
/// request's probe.
#[derive(Debug)]
pub(crate) struct RemoteSide {
    pub(super) tier: RemoteTier,
    pub(super) probes: HashMap<RequestId, RequestProbe>,
    /// Lookups in flight -> their request.
    pub(super) asked: HashMap<Ticket, RequestId>,
    /// Answers that came, until their request looks up again.
    pub(super) answered: HashMap<Ticket, Answer>,
    /// With several groups, the `(group, chunk)` each key of a request's
    /// lookup in flight names, in the order asked.
    pub(super) group_asked: HashMap<RequestId, Vec<(usize, usize)>>,
    /// With partial tails, the `(boundary, group)` each key of a request's
    /// partial-tail lookup in flight names, in the order asked.
    pub(super) tail_asked: HashMap<RequestId, Vec<(u64, usize)>>,
    /// Fetch jobs in flight -> their request and keys.
    fetch_jobs: HashMap<JobId, RequestId>,
    /// Chunks in the host tier that came from the remote tier (written on
    /// eviction: not written back, the remote tier has them).
    from_remote: std::collections::HashSet<ChunkKey>,
    /// Per live request, the chunk ranges its fetches brought into the host
    /// tier (what its loads report as read from the remote tier).
    fetched: HashMap<RequestId, Vec<Range<usize>>>,
    scratch: Vec<(Ticket, Answer)>,
    pub(super) stats: RemoteLookupStats,
}

impl RemoteSide {
    /// Chunks from `first` on are not to be had remotely for `req`.
    pub(super) fn known_absent(&mut self, req: RequestId, first: usize, attempts: u8) {
        let probe = Probe::Known {
            first_absent: first,
        };
        self.set_probe(req, probe, attempts);
    }

    /// Sets `req`'s probe and its complete-chunk lookups sent, keeping its
    /// partial-tail lookups sent.
    pub(super) fn set_probe(&mut self, req: RequestId, probe: Probe, attempts: u8) {
        let tail_attempts = self.probes.get(&req).map_or(0, |p| p.tail_attempts);
        self.probes.insert(
            req,
            RequestProbe {
                probe,
                attempts,
                tail_attempts,
            },
        );
    }

    /// The places of `asked` (in the order asked, from the answer's
    /// `first` on) that `answer` says the remote tier holds, counted as
    /// found.
    pub(super) fn found<K: Copy + Eq + std::hash::Hash>(
        &mut self,
        asked: &[K],
        answer: &Answer,
        first: usize,
    ) -> std::collections::HashSet<K> {
        let present: std::collections::HashSet<K> = match answer {
            Answer::Present(p) => asked
                .iter()
                .zip(p.iter().skip(first))
                .filter(|&(_, &here)| here)
                .map(|(&k, _)| k)
                .collect(),
            _ => std::collections::HashSet::new(),
        };
        self.stats.chunks_found += present.len() as u64;
        present
    }

    /// Drops `req`'s lookup in flight, if any, with its answer.
    pub(super) fn drop_asked(&mut self, req: RequestId) {
        let ticket = match self.probes.get(&req).map(|p| p.probe) {
            Some(
                Probe::Asked { ticket, .. }
                | Probe::TailAsked { ticket, .. }
                | Probe::FetchingGroups {
                    tails: TailsAsked::Asking(ticket),
                    ..
                },
            ) => ticket,
            _ => return,
        };
        self.asked.remove(&ticket);
        self.answered.remove(&ticket);
        self.group_asked.remove(&req);
        self.tail_asked.remove(&req);
    }

    pub(super) fn poll(&mut self) {
        self.tier.poll(&mut self.scratch);
        for (t, a) in self.scratch.drain(..) {
            if self.asked.contains_key(&t) {
                self.answered.insert(t, a);
            }
        }
    }
}

impl Scheduler {
    /// Puts `tier` behind the host tier: lookups that miss the host tier ask
    /// it, and remote hits become fetch jobs ([`super::StepPlan::fetches`]),
    /// which the workers execute with their own connections
    /// ([`crate::worker::OffloadWorker::with_remote_tier`]).
    ///
    /// With [`crate::remote::WritePolicy::OnEviction`] (the tier's config),
    /// every chunk the host tier evicts is listed with its slot in the next
    /// plan ([`super::StepPlan::evictions`]) for the workers to write.
    pub fn attach_remote(&mut self, tier: RemoteTier) {
        self.manager
            .track_evicted_slots(tier.write_policy() == WritePolicy::OnEviction);
        self.remote = Some(Box::new(RemoteSide {
            tier,
            probes: HashMap::new(),
            asked: HashMap::new(),
            answered: HashMap::new(),
            group_asked: HashMap::new(),
            tail_asked: HashMap::new(),
            fetch_jobs: HashMap::new(),
            from_remote: std::collections::HashSet::new(),
            fetched: HashMap::new(),
            scratch: Vec::new(),
            stats: RemoteLookupStats::default(),
        }));
    }

    /// The attached remote tier (its connection state and stats).
    pub fn remote_tier(&self) -> Option<&RemoteTier> {
        self.remote.as_ref().map(|r| &r.tier)
    }

    /// What the remote side did, if a tier is attached.
    pub fn remote_lookup_stats(&self) -> Option<RemoteLookupStats> {
        self.remote.as_ref().map(|r| r.stats)
    }

    /// Remote lookups whose answer has not come, and fetch jobs in flight: 0
    /// when the remote side waits on nothing (an answer that came waits for
    /// its request's next lookup without counting).
    pub fn remote_in_flight(&self) -> usize {
        self.remote.as_ref().map_or(0, |r| {
            r.asked
                .keys()
                .filter(|t| !r.answered.contains_key(t))
                .count()
                + r.fetch_jobs.len()
        })
    }

    /// Requests the remote side still holds state for (a leak check: 0 once
    /// every request has finished).
    pub fn remote_probes(&self) -> usize {
        self.remote.as_ref().map_or(0, |r| {
            r.probes.len()
                + r.asked.len()
                + r.answered.len()
                + r.group_asked.len()
                + r.tail_asked.len()
                + r.fetch_jobs.len()
                + r.fetched.len()
        })
    }

    /// Waits (at most `limit`, in real time) until every remote lookup in
    /// flight is answered, so that the next lookups see the answers: for
    /// simulations and tests that must not depend on the I/O thread's timing
    /// (a serving engine never calls it; its lookups answer "not yet").
    pub fn wait_remote_lookups(&mut self, limit: std::time::Duration) {
        let Some(r) = self.remote.as_mut() else {
            return;
        };
        let start = std::time::Instant::now();
        let mut others = Vec::new();
        loop {
            r.poll();
            let pending = r
                .asked
                .keys()
                .find(|t| !r.answered.contains_key(t))
                .copied();
            let Some(t) = pending else {
                return;
            };
            let left = limit.saturating_sub(start.elapsed());
            if left.is_zero() {
                return;
            }
            if let Some(a) = r.tier.wait(t, left, &mut others) {
                r.answered.insert(t, a);
            }
            for (t, a) in others.drain(..) {
                if r.asked.contains_key(&t) {
                    r.answered.insert(t, a);
                }
            }
        }
    }

    /// The remote side's answer for a lookup of `req` whose host scan stopped
    /// at chunk `first` (keys `keys`: chunks `first..` up to the lookup's
    /// end): `Some(Defer)` while asking or fetching, `None` to answer from
    /// the host tier.
    pub(crate) fn remote_lookup(
        &mut self,
        req: RequestId,
        first: usize,
        keys: &[ChunkKey],
    ) -> Option<LookupOutcome> {
        let r = self.remote.as_mut()?;
        r.poll();
        let entry = r.probes.get(&req).copied();
        match entry.map(|e| e.probe) {
            Some(Probe::Known { first_absent }) if first_absent == first => return None,
            Some(
                Probe::Fetching { .. } | Probe::FetchingGroups { .. } | Probe::TailFetching { .. },
            ) => {
                return Some(LookupOutcome::Defer);
            }
            Some(Probe::Asked { first: f, ticket }) if f == first => {
                let Some(answer) = r.answered.remove(&ticket) else {
                    return Some(LookupOutcome::Defer);
                };
                r.asked.remove(&ticket);
                let found = match answer {
                    Answer::Present(p) => p.iter().take_while(|&&x| x).count(),
                    _ => 0,
                };
                r.stats.chunks_found += found as u64;
                let attempts = entry.map_or(0, |e| e.attempts);
                if found == 0 {
                    r.known_absent(req, first, attempts);
                    return None;
                }
                let keys = &keys[..found.min(keys.len())];
                return self.start_fetch(req, keys, &[], attempts, FetchAt::Prefix { first });
            }
            _ => {}
        }
        // A new position (or a stale answer): ask, within the attempts. A
        // lookup still in flight for another position is dropped with its
        // answer.
        r.drop_asked(req);
        let attempts = entry.map_or(0, |e| e.attempts);
        if attempts >= MAX_ATTEMPTS || keys.is_empty() {
            r.known_absent(req, first, attempts);
            return None;
        }
        let ticket = r.tier.lookup(keys);
        r.asked.insert(ticket, req);
        r.stats.lookups += 1;
        r.set_probe(req, Probe::Asked { first, ticket }, attempts + 1);
        Some(LookupOutcome::Defer)
    }

    /// Allocates host slots for `keys` (found remotely) and creates their
    /// fetch job, taking the request's probe to `at`; `None` (answer from
    /// the host tier) when the tier has no room. With several groups,
    /// `key_groups` names each key's group; the job's keys go group by
    /// group (its spans split them in order).
    pub(super) fn start_fetch(
        &mut self,
        req: RequestId,
        keys: &[ChunkKey],
        key_groups: &[usize],
        attempts: u8,
        at: FetchAt,
    ) -> Option<LookupOutcome> {
        let grouped: (Vec<usize>, Vec<ChunkKey>);
        let (key_groups, keys) = if key_groups.is_sorted() {
            (key_groups, keys)
        } else {
            let mut by_group: Vec<(usize, ChunkKey)> = key_groups
                .iter()
                .copied()
                .zip(keys.iter().copied())
                .collect();
            by_group.sort_by_key(|&(g, _)| g);
            grouped = by_group.into_iter().unzip();
            (grouped.0.as_slice(), grouped.1.as_slice())
        };
        let prepared = self.manager.prepare_store(keys, None);
        let r = self.remote.as_mut()?;
        let Some(out) = prepared.filter(|o| !o.keys_to_store.is_empty()) else {
            r.stats.allocation_failures += 1;
            r.set_probe(req, at.settled(), attempts);
            return None;
        };
        let count = out.keys_to_store.len();
        let fetched_keys = out.keys_to_store.clone();
        self.forget_partial_chunks(&fetched_keys);
        let job = self.new_job_id();
        let now = self.now_ns();
        let deadline = self.jobs.deadline_for(now);
        let latch = super::latch::JobLatch::new(self.geo.world_size);
        let entry = JobEntry::store(
            req,
            now,
            latch,
            JobKeys::from_slice(&out.keys_to_store),
            &[],
            false,
        );
        self.jobs.insert(job, entry);
        self.watch.track(job, deadline);
        if let Some(rs) = self.requests.get_mut(&req) {
            rs.jobs.push(job);
        }
        // With groups, each group's part of the keys (for the KV events
        // that announce them; workers fetch by key).
        let groups = match at.groups() {
            Some(groups) => {
                let mut spans = vec![
                    GroupSpan {
                        num_keys: 0,
                        num_blocks: 0,
                        first_block_index: 0,
                    };
                    groups
                ];
                let group_of: HashMap<ChunkKey, usize> = keys
                    .iter()
                    .copied()
                    .zip(key_groups.iter().copied())
                    .collect();
                for k in &out.keys_to_store {
                    if let Some(span) = group_of.get(k).and_then(|&g| spans.get_mut(g)) {
                        span.num_keys += 1;
                    }
                }
                spans
            }
            None => Vec::new(),
        };
        self.batch.fetches.push(TransferJob {
            job,
            req,
            block_ids: JobBlocks::new(),
            chunk_ids: JobSlots::from_slice(&out.chunk_ids),
            keys: JobKeys::from_slice(&out.keys_to_store),
            groups,
        });
        if let Some(r) = self.remote.as_mut() {
            r.fetch_jobs.insert(job, req);
            r.stats.fetch_jobs += 1;
            r.set_probe(req, at.fetching(count), attempts);
        }
        Some(LookupOutcome::Defer)
    }

    /// The chunk ranges (indices in the request's chunk keys) that `req`'s
    /// fetches brought from the remote tier into the host tier, while it
    /// lives: empty without a remote tier or such a fetch.
    pub fn remote_fetched_chunks(&self, req: RequestId) -> &[Range<usize>] {
        self.remote
            .as_ref()
            .and_then(|r| r.fetched.get(&req))
            .map_or(&[], Vec::as_slice)
    }

    /// The evicted chunks to write to the remote tier (written on eviction):
    /// those taken from the manager, less the ones the remote tier gave.
    pub(crate) fn remote_evictions(&mut self, out: &mut Vec<(ChunkKey, ChunkId)>) {
        let Some(r) = self.remote.as_mut() else {
            return;
        };
        self.manager.take_evicted_slots(out);
        out.retain(|(k, _)| !r.from_remote.remove(k));
    }

    /// A job ended: if it was a fetch, its request's probe learns how (and,
    /// written on eviction, its chunks are remembered as the remote tier's).
    pub(crate) fn remote_job_ended(&mut self, job: JobId, keys: &[ChunkKey], success: bool) {
        let Some(r) = self.remote.as_mut() else {
            return;
        };
        let Some(req) = r.fetch_jobs.remove(&job) else {
            return;
        };
        if success && r.tier.write_policy() == WritePolicy::OnEviction {
            r.from_remote.extend(keys.iter().copied());
        }
        let Some(p) = r.probes.get_mut(&req) else {
            return;
        };
        let known = |first_absent| Probe::Known { first_absent };
        let (failed, done, chunks, count) = match p.probe {
            Probe::Fetching { first, count } => (
                known(first),
                known(first + count),
                first..first + count,
                count,
            ),
            Probe::FetchingGroups {
                before,
                after,
                lo,
                hi,
                count,
                tails,
            } => {
                let done = match tails {
                    TailsAsked::No => known(after),
                    TailsAsked::Asking(ticket) => {
                        if !success {
                            // The hit the tails were asked past is not
                            // there: their answer is of no use.
                            r.asked.remove(&ticket);
                            r.answered.remove(&ticket);
                            r.tail_asked.remove(&req);
                        }
                        Probe::TailAsked { at: after, ticket }
                    }
                    TailsAsked::NoneFound | TailsAsked::Fetched => Probe::TailKnown { at: after },
                };
                if success && tails == TailsAsked::Fetched {
                    r.stats.partial_tails_fetched += 1;
                }
                (known(before), done, lo..hi, count)
            }
            Probe::TailFetching {
                at,
                chunk,
                last,
                count,
            } => {
                let settled = Probe::TailKnown { at };
                if success {
                    r.stats.partial_tails_fetched += 1;
                }
                (settled, settled, chunk..last + 1, count)
            }
            _ => return,
        };
        p.probe = if success {
            r.stats.chunks_fetched += count as u64;
            r.fetched.entry(req).or_default().push(chunks);
            done
        } else {
            r.stats.fetches_failed += 1;
            failed
        };
    }

    /// The request is gone: its probe and any lookup answer go too.
    pub(crate) fn remote_forget(&mut self, req: RequestId) {
        let Some(r) = self.remote.as_mut() else {
            return;
        };
        r.fetched.remove(&req);
        r.drop_asked(req);
        r.group_asked.remove(&req);
        r.tail_asked.remove(&req);
        r.probes.remove(&req);
    }

    /// A reset: every probe and fetch is forgotten (the host tier is empty;
    /// late lookup answers are dropped when they come).
    pub(crate) fn remote_reset(&mut self) {
        if let Some(r) = self.remote.as_mut() {
            r.probes.clear();
            r.asked.clear();
            r.answered.clear();
            r.group_asked.clear();
            r.tail_asked.clear();
            r.fetch_jobs.clear();
            r.from_remote.clear();
            r.fetched.clear();
        }
    }
}
