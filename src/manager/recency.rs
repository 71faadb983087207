//! What the eviction policy learns from use beyond stores and loads: a
//! request's observations (its record, wherever it lives, and the LRU ranks
//! of what it observed), touches, and the end of a request (vLLM
//! `on_request_finished`).
//!
//! A request's record lives in the manager's map when the public calls name
//! the request by id, or with the caller (the scheduler keeps it in the
//! request's state, with the chunks' positions): [`Record`] says which, and
//! [`OffloadManager::with_record`] lends it to the load and store paths.

use crate::config::EvictionPolicyKind;
use crate::ids::RequestId;
use crate::key::ChunkKey;

use super::OffloadManager;
use super::policy::{EvictionPolicy, FinishedAccess};
use super::request_access::RequestAccess;

/// Where the record of the request a call serves lives.
#[derive(Debug)]
pub(super) enum Record<'a> {
    /// No request: nothing is recorded.
    None,
    /// In the manager's map under the request's id (the public calls).
    Mapped(RequestId),
    /// Kept by the caller (the scheduler's request state: no map probe).
    Kept(&'a mut RequestAccess),
}

impl Record<'_> {
    /// The record of `req` in the manager's map, if there is a request.
    pub(super) fn mapped(req: Option<RequestId>) -> Self {
        req.map_or(Self::None, Self::Mapped)
    }
}

impl OffloadManager {
    /// Runs `f` with the request's record, if any. A record in the map
    /// leaves it for the call (a new request gets an empty one) and goes
    /// back afterwards, so that the paths take a record wherever its owner
    /// keeps it.
    #[inline]
    pub(super) fn with_record<R>(
        &mut self,
        record: Record<'_>,
        f: impl FnOnce(&mut Self, Option<&mut RequestAccess>) -> R,
    ) -> R {
        match record {
            Record::None => f(self, None),
            Record::Kept(acc) => f(self, Some(acc)),
            Record::Mapped(req) => {
                let mut acc = self.requests.remove(&req).unwrap_or_default();
                let out = f(self, Some(&mut acc));
                self.requests.insert(req, acc);
                out
            }
        }
    }

    /// The LRU side of a request's first observations (vLLM's
    /// `on_request_access`): the request takes its rank if it has none, and
    /// each resident key joins the request's group unless it ranks higher.
    pub(super) fn observe_ranked(&mut self, observed: &[(ChunkKey, u64)], acc: &mut RequestAccess) {
        if observed.is_empty() || self.policy_kind != EvictionPolicyKind::Lru {
            return;
        }
        let rank = match acc.rank {
            Some(r) => r,
            None => {
                let Some(r) = self.policy.new_request_rank() else {
                    return;
                };
                acc.rank = Some(r);
                r
            }
        };
        for &(k, p) in observed {
            if let Some(s) = self.indexed(k) {
                self.policy.observe_at(s, &rank, p);
            }
        }
    }

    /// Marks keys as recently used; the first key ends most recent. Absent keys
    /// are ignored (ARC adapts its target when they are in a ghost list).
    pub fn touch(&mut self, keys: &[ChunkKey], _req: Option<RequestId>) {
        for &k in keys.iter().rev() {
            let slot = self.indexed(k);
            let ready = slot.is_some_and(|s| self.slots[s as usize].ref_cnt >= 0);
            self.policy.on_touch(k, slot, ready);
        }
    }

    /// The request will make no more `prepare_*` calls: its observed chunks
    /// are re-ranked tail first so the prefix head ends most recent (LRU), or
    /// the chunks it reused are promoted once and its own insertions keep
    /// their list (ARC). `complete_*` calls for its jobs may still follow.
    /// Unknown or already finished requests are a no-op.
    pub fn request_finished(&mut self, req: RequestId) {
        if let Some(mut acc) = self.requests.remove(&req) {
            self.apply_finished(&mut acc);
        }
    }

    /// [`Self::request_finished`] for a request whose record its caller kept
    /// (see [`Self::prepare_store_for_job`]); a record kept in the map under
    /// `req` (through the public calls) is finished first.
    pub(crate) fn request_finished_with(&mut self, req: RequestId, kept: &mut RequestAccess) {
        self.request_finished(req);
        self.apply_finished(kept);
    }

    /// Replays a record into the policy, once (later calls are no-ops).
    fn apply_finished(&mut self, acc: &mut RequestAccess) {
        if acc.finished {
            return;
        }
        acc.finished = true;
        if !acc.is_of(self.generation) {
            // Recorded before a reset: the reset forgot it (and its rank).
            return;
        }
        let accesses: Vec<FinishedAccess> = acc
            .head_to_tail(self.position_groups)
            .into_iter()
            .rev()
            .filter_map(|s| {
                self.indexed(s.key).map(|slot| FinishedAccess {
                    slot,
                    insertion_only: s.inserted() && !s.reused(),
                    reused: s.reused(),
                })
            })
            .collect();
        self.policy.on_request_finished(&accesses);
        if let Some(r) = acc.rank.as_mut() {
            self.policy.release_rank(r);
        }
    }
}
