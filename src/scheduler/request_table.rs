//! The table of tracked requests: dense slots plus an id index, with a
//! positional cache for the step's scheduled list.
//!
//! A step names its scheduled requests by id, usually in the same order as in
//! the previous step (the serving backend's running queue changes at its
//! ends). [`RequestTable::resolve_scheduled`] remembers, for each position of
//! the list, the slot it resolved to last time; a position whose request is
//! unchanged costs one comparison instead of a hash lookup.

use std::collections::HashMap;

use crate::ids::RequestId;
use crate::key::KeyBuildHasher;

use super::request::{FinishInfo, RequestState};

/// What the dense slot array says of one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct SlotTag {
    /// The request it holds (`None`: free).
    req: Option<RequestId>,
    /// The request's state has its finish set ([`RequestTable::set_finish`]),
    /// so that resolving a step's list also tells whether any is finished.
    finished: bool,
}

/// Tracked requests by id, stored in reusable dense slots.
#[derive(Debug, Default)]
pub(crate) struct RequestTable {
    /// Slot -> the request it holds and whether it is finished. Dense, apart
    /// from the states, so that resolving a step's list reads few cache lines.
    ids: Vec<SlotTag>,
    /// Slot -> the request's state (a default state when free).
    states: Vec<RequestState>,
    /// Free slots, reused last-in first-out.
    free: Vec<u32>,
    /// Request id -> slot.
    index: HashMap<RequestId, u32, KeyBuildHasher>,
    /// Position in the last resolved scheduled list -> the slot it resolved to.
    positions: Vec<u32>,
}

impl RequestTable {
    /// Tracked requests.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether `req` is tracked.
    pub fn contains_key(&self, req: &RequestId) -> bool {
        self.index.contains_key(req)
    }

    /// The slot of `req`.
    #[inline]
    pub fn slot_of(&self, req: &RequestId) -> Option<u32> {
        self.index.get(req).copied()
    }

    /// The state of `req`.
    pub fn get(&self, req: &RequestId) -> Option<&RequestState> {
        let s = self.slot_of(req)?;
        self.at(s)
    }

    /// The state of `req`, mutable.
    pub fn get_mut(&mut self, req: &RequestId) -> Option<&mut RequestState> {
        let s = self.slot_of(req)?;
        self.at_mut(s)
    }

    /// The state in slot `slot`, if it holds a request.
    #[inline]
    pub fn at(&self, slot: u32) -> Option<&RequestState> {
        match self.ids.get(slot as usize) {
            Some(SlotTag { req: Some(_), .. }) => self.states.get(slot as usize),
            _ => None,
        }
    }

    /// The state in slot `slot`, mutable.
    #[inline]
    pub fn at_mut(&mut self, slot: u32) -> Option<&mut RequestState> {
        match self.ids.get(slot as usize) {
            Some(SlotTag { req: Some(_), .. }) => self.states.get_mut(slot as usize),
            _ => None,
        }
    }

    /// Sets the finish of the request in slot `slot` (the only way to set it,
    /// so that the slot's tag agrees); returns its state.
    pub fn set_finish(&mut self, slot: u32, info: FinishInfo) -> Option<&mut RequestState> {
        let tag = self.ids.get_mut(slot as usize)?;
        tag.req?;
        tag.finished = true;
        let rs = self.states.get_mut(slot as usize)?;
        rs.finish = Some(info);
        Some(rs)
    }

    /// The first tracked request whose slot tag disagrees with its finish
    /// (for the invariant checks).
    pub fn finish_tag_mismatch(&self) -> Option<RequestId> {
        self.ids
            .iter()
            .zip(&self.states)
            .find(|(t, rs)| t.req.is_some() && t.finished != rs.finish.is_some())
            .and_then(|(t, _)| t.req)
    }

    /// Tracks `req` (replacing any state it had).
    pub fn insert(&mut self, req: RequestId, state: RequestState) {
        let tag = SlotTag {
            req: Some(req),
            finished: state.finish.is_some(),
        };
        if let Some(s) = self.slot_of(&req) {
            self.ids[s as usize] = tag;
            self.states[s as usize] = state;
            return;
        }
        let s = match self.free.pop() {
            Some(s) => {
                self.ids[s as usize] = tag;
                self.states[s as usize] = state;
                s
            }
            None => {
                self.ids.push(tag);
                self.states.push(state);
                (self.ids.len() - 1) as u32
            }
        };
        self.index.insert(req, s);
    }

    /// Stops tracking `req`; returns its state.
    pub fn remove(&mut self, req: &RequestId) -> Option<RequestState> {
        let s = self.index.remove(req)?;
        self.ids[s as usize] = SlotTag::default();
        self.free.push(s);
        Some(std::mem::take(&mut self.states[s as usize]))
    }

    /// Every tracked request (slot order).
    pub fn iter(&self) -> impl Iterator<Item = (&RequestId, &RequestState)> {
        self.ids
            .iter()
            .zip(&self.states)
            .filter_map(|(t, rs)| t.req.as_ref().map(|id| (id, rs)))
    }

    /// Every tracked request's state, mutable (slot order).
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut RequestState> {
        self.ids
            .iter()
            .zip(self.states.iter_mut())
            .filter_map(|(t, rs)| t.req.map(|_| rs))
    }

    /// Resolves the step's scheduled requests to slots, written to `out`
    /// (co-indexed with `reqs`), and tells whether any of them is finished.
    /// Returns the first untracked request, if any (then `out` is incomplete).
    /// Positions whose request is the same as in the last call are resolved
    /// without a hash lookup.
    pub fn resolve_scheduled(
        &mut self,
        reqs: impl ExactSizeIterator<Item = RequestId>,
        out: &mut Vec<u32>,
    ) -> Result<bool, RequestId> {
        out.clear();
        out.reserve(reqs.len());
        let n = reqs.len();
        let mut any_finished = false;
        for (i, req) in reqs.enumerate() {
            // The cached slot is right if it still holds this request.
            let cached = self.positions.get(i).and_then(|&s| {
                let tag = self.ids.get(s as usize)?;
                (tag.req == Some(req)).then_some((s, tag.finished))
            });
            let (s, finished) = match cached {
                Some(hit) => hit,
                None => {
                    let s = self.slot_of(&req).ok_or(req)?;
                    if i < self.positions.len() {
                        self.positions[i] = s;
                    } else {
                        self.positions.push(s);
                    }
                    (s, self.ids.get(s as usize).is_some_and(|t| t.finished))
                }
            };
            any_finished |= finished;
            out.push(s);
        }
        self.positions.truncate(n);
        Ok(any_finished)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rs(prompt: u64) -> RequestState {
        RequestState::new(prompt, &[])
    }

    #[test]
    fn insert_get_remove_reuses_slots() {
        let mut t = RequestTable::default();
        t.insert(RequestId(1), rs(10));
        t.insert(RequestId(2), rs(20));
        assert_eq!(t.len(), 2);
        assert_eq!(t.get(&RequestId(2)).map(|r| r.prompt_tokens), Some(20));
        let s1 = t.slot_of(&RequestId(1)).unwrap();
        assert_eq!(t.remove(&RequestId(1)).map(|r| r.prompt_tokens), Some(10));
        assert!(t.get(&RequestId(1)).is_none());
        assert!(t.remove(&RequestId(1)).is_none());
        t.insert(RequestId(3), rs(30));
        assert_eq!(t.slot_of(&RequestId(3)), Some(s1), "freed slot reused");
        assert_eq!(t.len(), 2);
        let mut ids: Vec<u64> = t.iter().map(|(id, _)| id.0).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![2, 3]);
    }

    #[test]
    fn resolve_scheduled_tracks_changes_in_the_list() {
        let mut t = RequestTable::default();
        for r in 0..4 {
            t.insert(RequestId(r), rs(r));
        }
        let mut out = Vec::new();
        let ids = |v: &[u64]| v.iter().map(|&r| RequestId(r)).collect::<Vec<_>>();
        let check = |t: &mut RequestTable, out: &mut Vec<u32>, v: &[u64]| {
            t.resolve_scheduled(ids(v).into_iter(), out).unwrap();
            let got: Vec<u64> = out
                .iter()
                .map(|&s| t.at(s).unwrap().prompt_tokens)
                .collect();
            assert_eq!(got, v, "slots resolve to the listed requests");
        };
        check(&mut t, &mut out, &[0, 1, 2, 3]);
        check(&mut t, &mut out, &[0, 1, 2, 3]);
        check(&mut t, &mut out, &[1, 2, 3]);
        // A request removed and its slot reused by another: the cache must not
        // resolve the old id to the new request.
        t.remove(&RequestId(2));
        t.insert(RequestId(9), rs(9));
        check(&mut t, &mut out, &[1, 9, 3]);
        assert_eq!(
            t.resolve_scheduled(ids(&[1, 2, 3]).into_iter(), &mut out),
            Err(RequestId(2))
        );
        check(&mut t, &mut out, &[3]);
        check(&mut t, &mut out, &[]);
    }

    #[test]
    fn resolving_tells_whether_a_scheduled_request_is_finished() {
        let mut t = RequestTable::default();
        for r in 0..3 {
            t.insert(RequestId(r), rs(r));
        }
        let mut out = Vec::new();
        let list = || [0, 1, 2].map(RequestId).into_iter();
        assert_eq!(t.resolve_scheduled(list(), &mut out), Ok(false));
        let s1 = t.slot_of(&RequestId(1)).unwrap();
        let info = FinishInfo {
            aborted: false,
            computed_tokens: 0,
        };
        assert!(t.set_finish(s1, info).is_some());
        assert_eq!(t.finish_tag_mismatch(), None);
        assert_eq!(t.resolve_scheduled(list(), &mut out), Ok(true));
        assert_eq!(
            t.resolve_scheduled([0, 2].map(RequestId).into_iter(), &mut out),
            Ok(false)
        );
        // The slot is reused by a new, unfinished request: the tag follows.
        t.remove(&RequestId(1));
        assert!(
            t.set_finish(s1, info).is_none(),
            "a free slot has no finish"
        );
        t.insert(RequestId(7), rs(7));
        assert_eq!(t.slot_of(&RequestId(7)), Some(s1));
        assert_eq!(
            t.resolve_scheduled([0, 7].map(RequestId).into_iter(), &mut out),
            Ok(false)
        );
        // A finish set behind the table's back is an invariant violation.
        t.get_mut(&RequestId(7)).unwrap().finish = Some(info);
        assert_eq!(t.finish_tag_mismatch(), Some(RequestId(7)));
    }
}
