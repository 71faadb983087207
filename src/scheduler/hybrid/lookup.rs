//! A request's hit over several KV groups: vLLM 0.33.0's
//! `_lookup_complete_chunks` (its `OffloadingConnectorScheduler`), with its
//! Mamba alignment.
//!
//! Full-attention groups first, a prefix lookup each (consecutive hits from
//! the first chunk past the GPU's hit); then windowed groups (sliding
//! windows and chunked-local attention), largest window first, a suffix
//! lookup each (the last run of `window` consecutive
//! hits, scanning from the right; the first run may need the load window,
//! one chunk more). Each group can only shrink the hit's end; when a later
//! group shrinks it, earlier groups are asked again until the end converges.
//! With a sliding-window group the hit leaves the last token to compute.
//! An EAGLE/MTP draft group looks one chunk past the end and drops the last
//! chunk it finds (its last position's draft KV depends on the next token).

use std::ops::Range;

use super::shape::GroupShape;

/// What the host tier answers for one chunk key of one group (vLLM's
/// `LookupResult`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyState {
    /// Stored and readable.
    Hit,
    /// Stored, still being written: counts, but the request waits.
    HitPending,
    /// Not known yet (a tier still looking): the request waits.
    Retry,
    /// Not stored.
    Miss,
}

/// One group's keys for a request: how many chunk keys it has (complete
/// chunks hashed so far) and what the tier answers for each.
pub trait GroupKeys {
    /// Chunk keys the request has in `group`.
    fn num_keys(&self, group: usize) -> usize;
    /// The tier's answer for chunk `chunk` of `group`.
    fn state(&mut self, group: usize, chunk: usize) -> KeyState;
    /// Whether a load of that chunk is in flight for another request.
    fn being_loaded(&self, group: usize, chunk: usize) -> bool;
}

/// A request as one lookup sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HybridLookup {
    /// Tokens the GPU's prefix cache already holds (block-aligned).
    pub computed: u64,
    /// The request's tokens.
    pub num_tokens: u64,
    /// The request's `max_load_tokens` (its `kv_transfer_params`).
    pub max_load_tokens: Option<u64>,
    /// The step's cap on new tokens, where the caller has one.
    pub max_new_tokens: Option<u64>,
}

/// How many tokens past `req.computed` every group can load (`Some(0)`: no
/// hit), or `None` when the request must wait (a counted chunk still being
/// written or not known yet, or being loaded for another request).
pub fn lookup_complete_chunks(
    groups: &[GroupShape],
    keys: &mut impl GroupKeys,
    req: HybridLookup,
) -> Option<u64> {
    lookup_complete_chunks_with_ends(groups, keys, req, &mut Vec::new())
}

/// [`lookup_complete_chunks`], also giving each group's `hit_ends`: for a
/// full-attention group, the chunk after the last one its prefix lookup
/// found (counting an EAGLE group's volatile chunk before it is dropped),
/// from the last time it was asked; 0 for a group never asked and for
/// windowed groups (vLLM's `lookup_hit_end_chunk_idx`, which the
/// partial-tail lookup reads to know which bridge chunks are confirmed).
pub fn lookup_complete_chunks_with_ends(
    groups: &[GroupShape],
    keys: &mut impl GroupKeys,
    req: HybridLookup,
    hit_ends: &mut Vec<usize>,
) -> Option<u64> {
    hit_ends.clear();
    hit_ends.resize(groups.len(), 0);
    let computed = req.computed;
    let mut max_hit = req.num_tokens;
    if let Some(cap) = req.max_new_tokens {
        max_hit = max_hit.min(computed.saturating_add(cap));
    }
    if let Some(cap) = req.max_load_tokens {
        max_hit = max_hit.min(computed.saturating_add(cap));
    }
    let full: Vec<usize> = (0..groups.len())
        .filter(|&g| groups[g].window_chunks().is_none())
        .collect();
    let mut windowed: Vec<usize> = (0..groups.len())
        .filter(|&g| groups[g].window_chunks().is_some())
        .collect();
    // Largest window first; equal windows keep their order (a stable sort,
    // as Python's `sort(reverse=True)`).
    windowed.sort_by_key(|&g| std::cmp::Reverse(groups[g].window_chunks()));
    if !windowed.is_empty() {
        // The last prompt token is computed again for its logits.
        max_hit = max_hit.saturating_sub(1);
        // A recurrent state is kept at its chunks' boundaries only (vLLM's
        // `_mamba_align_size`: the state groups' chunk, one for all).
        if let Some(align) = groups
            .iter()
            .find(|g| g.is_recurrent_state())
            .map(GroupShape::tokens_per_chunk)
        {
            max_hit -= max_hit % align;
        }
    }
    let order: Vec<usize> = full.iter().chain(&windowed).copied().collect();

    let mut hit = 0u64;
    let mut defer = false;
    let mut pending = order.clone();
    // EAGLE draft groups that dropped their volatile last chunk at the
    // current end (asked again once another group narrows the end).
    let mut eagle_verified = vec![false; groups.len()];
    while !pending.is_empty() {
        let mut looked_up_window = false;
        let round = std::mem::take(&mut pending);
        for g in round {
            let shape = groups[g];
            let tpc = shape.tokens_per_chunk();
            let num_keys = keys.num_keys(g);
            let unverified = shape.is_eagle_draft() && !eagle_verified[g];
            max_hit = max_hit.min(num_keys as u64 * tpc);
            if req.max_load_tokens.is_some() {
                max_hit -= max_hit % tpc;
            }
            if max_hit < computed.saturating_add(tpc) {
                return Some(0);
            }
            // An unverified draft group looks one chunk further, then drops
            // the last chunk it found.
            let query_max = if unverified {
                max_hit.saturating_add(tpc).min(num_keys as u64 * tpc)
            } else {
                max_hit
            };
            let extra = u64::from(unverified);
            let num_chunks = (query_max.div_ceil(tpc) as usize).min(num_keys);
            let start = (computed / tpc) as usize;
            let found = match shape.window_chunks() {
                None => {
                    let found = prefix(keys, g, start, num_chunks);
                    hit_ends[g] = start + found.unwrap_or(0);
                    found
                }
                Some(window) => {
                    let candidate_end =
                        max_hit.min((num_chunks as u64).saturating_sub(extra) * tpc);
                    let first_run = shape.load_window_chunks(candidate_end).unwrap_or(window);
                    suffix(
                        keys,
                        g,
                        start,
                        num_chunks,
                        window + extra,
                        first_run + extra,
                    )
                }
            };
            match found {
                Some(0) => return Some(0),
                None => defer = true,
                Some(n) => {
                    let n = n - extra as usize;
                    eagle_verified[g] |= unverified;
                    max_hit = max_hit.min(tpc * (start + n) as u64);
                }
            }
            if max_hit < computed.saturating_add(tpc) {
                return Some(0);
            }
            let new_hit = max_hit - computed;
            if new_hit < hit {
                if !shape.is_eagle_draft() {
                    eagle_verified.fill(false);
                }
                if defer {
                    // Ask every group again: the narrower hit may not wait.
                    defer = false;
                    pending = order.clone();
                } else if looked_up_window && pending.is_empty() {
                    // Windows found earlier must hold at the new end.
                    pending = windowed.clone();
                }
            }
            looked_up_window |= shape.window_chunks().is_some();
            hit = new_hit;
        }
    }
    if defer {
        return None;
    }
    let end = computed + hit;
    for (g, shape) in groups.iter().enumerate() {
        if load_chunks(shape, computed, end, keys.num_keys(g)).any(|c| keys.being_loaded(g, c)) {
            return None;
        }
    }
    Some(hit)
}

/// The chunks of a group with `shape` (and `num_keys` chunk keys) that a
/// hit from `computed` to `end` tokens reads: every chunk past the GPU's hit
/// for full attention, the load window before `end` for a sliding window.
pub fn load_chunks(shape: &GroupShape, computed: u64, end: u64, num_keys: usize) -> Range<usize> {
    let tpc = shape.tokens_per_chunk();
    let start = (computed / tpc) as usize;
    let stop = (end.div_ceil(tpc) as usize).min(num_keys);
    let mut first = start.min(stop);
    if let Some(window) = shape.load_window_chunks(end) {
        first = first.max(stop.saturating_sub(window as usize));
    }
    first..stop
}

/// Consecutive present chunks of `group` from `start` (vLLM's
/// `_maximal_prefix_lookup`); `None` when one counted is pending or one
/// before the first miss is not known yet.
fn prefix(keys: &mut impl GroupKeys, group: usize, start: usize, stop: usize) -> Option<usize> {
    let mut hits = 0;
    let mut defer = false;
    for chunk in start..stop {
        match keys.state(group, chunk) {
            KeyState::Hit => hits += 1,
            KeyState::HitPending => {
                hits += 1;
                defer = true;
            }
            // Not counted, but the scan goes on (a tier starts its lookups).
            KeyState::Retry => defer = true,
            KeyState::Miss => break,
        }
    }
    (!defer).then_some(hits)
}

/// The end (counted from `start`) of the last run of `window` consecutive
/// present chunks of `group` in `start..stop`, scanning from the right; the
/// first run, at the right edge, needs `first_run` (vLLM's
/// `_sliding_window_lookup`). Without a full run, the run at `start`.
/// `None` when a counted chunk is pending or one is not known yet.
fn suffix(
    keys: &mut impl GroupKeys,
    group: usize,
    start: usize,
    stop: usize,
    window: u64,
    first_run: u64,
) -> Option<usize> {
    let window = window as usize;
    let mut required = if first_run == 0 {
        window
    } else {
        first_run as usize
    };
    let mut defer = false;
    let mut pending = false;
    let mut run = 0usize;
    for chunk in (start..stop).rev() {
        match keys.state(group, chunk) {
            KeyState::Hit => run += 1,
            KeyState::HitPending => {
                pending = true;
                run += 1;
            }
            KeyState::Retry => {
                defer = true;
                run = 0;
                pending = false;
                required = window;
            }
            KeyState::Miss => {
                run = 0;
                pending = false;
                required = window;
            }
        }
        if run == required {
            return (!defer && !pending).then_some(chunk - start + required);
        }
    }
    (!defer && !pending).then_some(run)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::hybrid::RecordedKeys;
    use crate::scheduler::hybrid::shape::fixtures::{full, window};

    fn keys(groups: &[&str]) -> RecordedKeys {
        RecordedKeys::parse(groups).unwrap()
    }

    fn ask(groups: &[GroupShape], k: &[&str], computed: u64, num_tokens: u64) -> Option<u64> {
        let req = HybridLookup {
            computed,
            num_tokens,
            max_load_tokens: None,
            max_new_tokens: None,
        };
        lookup_complete_chunks(groups, &mut keys(k), req)
    }

    #[test]
    fn one_full_group_is_a_prefix_lookup() {
        assert_eq!(ask(&[full()], &["HHHM"], 0, 17), Some(12));
        assert_eq!(ask(&[full()], &["HHHH"], 4, 16), Some(12));
        assert_eq!(ask(&[full()], &["MHHH"], 0, 16), Some(0));
        assert_eq!(ask(&[full()], &["HPHM"], 0, 16), None);
        // A retry past the first miss is never asked about.
        assert_eq!(ask(&[full()], &["HHMR"], 0, 16), Some(8));
        // One chunk past the GPU's hit loads; less than a chunk is no hit.
        assert_eq!(ask(&[full()], &["HHHH"], 12, 16), Some(4));
        assert_eq!(ask(&[full()], &["HHHH"], 12, 15), Some(0));
    }

    #[test]
    fn a_window_needs_only_its_last_chunks_and_leaves_the_last_token() {
        // 17 tokens: at most 16 may load; the window (2 chunks) before the
        // end is present.
        assert_eq!(
            ask(&[full(), window(8)], &["HHHH", "MMHH"], 0, 17),
            Some(16)
        );
        // 16 tokens: the last is computed again, so the hit ends at 15, not
        // on a chunk boundary (as vLLM answers).
        assert_eq!(
            ask(&[full(), window(8)], &["HHHH", "MMHH"], 0, 16),
            Some(15)
        );
        // The window's last full run decides; the full group's prefix holds
        // at the narrower end.
        assert_eq!(
            ask(&[full(), window(8)], &["HHHH", "HHHM"], 0, 16),
            Some(12)
        );
        assert_eq!(
            ask(&[full(), window(8)], &["HHHHH", "HHMHM"], 0, 21),
            Some(8)
        );
        // No run of the window and none at the start: no hit.
        assert_eq!(ask(&[full(), window(8)], &["HHHH", "MHMH"], 0, 17), Some(0));
    }

    #[test]
    fn a_recurrent_state_needs_the_state_at_a_chunk_boundary() {
        let state = GroupShape::recurrent_state(4).unwrap();
        // 16 tokens: the last is computed again (15), and the hit ends on
        // the state's chunk boundary (12), where its state is held.
        assert_eq!(ask(&[full(), state], &["HHHH", "MMHH"], 0, 16), Some(12));
        // Only the state at the hit's end is needed.
        assert_eq!(ask(&[full(), state], &["HHHH", "MMMH"], 0, 17), Some(16));
        // No state at 16: the hit falls back to the last state held (12)...
        assert_eq!(ask(&[full(), state], &["HHHH", "MMHM"], 0, 17), Some(12));
        // ...and without one past the GPU's hit there is none.
        assert_eq!(ask(&[full(), state], &["HHHH", "MMMM"], 0, 17), Some(0));
    }

    #[test]
    fn a_draft_group_needs_the_chunk_after_the_hit() {
        let draft = full().eagle_draft();
        // Four chunks held: the last one only proves the third.
        assert_eq!(ask(&[full()], &["HHHH"], 0, 17), Some(16));
        assert_eq!(ask(&[draft], &["HHHH"], 0, 17), Some(12));
        // It looks one chunk past the end the others allow: a fifth key.
        assert_eq!(ask(&[draft], &["HHHHH"], 0, 17), Some(16));
        // Found up to a miss: the last found chunk is dropped.
        assert_eq!(ask(&[draft], &["HHMH"], 0, 17), Some(4));
        assert_eq!(ask(&[draft], &["HMHH"], 0, 17), Some(0));
        // A window beside it narrows the end (chunks 1 and 2): the draft
        // group's prefix holds there, the chunk after it with it (vLLM does
        // not ask the full-attention groups again).
        assert_eq!(
            ask(&[draft, window(8)], &["HHHHH", "MHHMM"], 0, 21),
            Some(12)
        );
    }

    #[test]
    fn a_narrower_end_makes_the_windows_look_again() {
        // Windows of 16 tokens (4 chunks) and 8 (2). The wider one finds
        // chunks 3..7; the narrower one only chunks 1..3, ending the hit at
        // 12 tokens; asked again at 12, the wider window has no run of 4
        // there and only the run at the start (chunk 0): 4 tokens.
        let groups = [window(16), window(8)];
        assert_eq!(ask(&groups, &["HMHHHHH", "HHHMMHM"], 0, 29), Some(4));
        // A run that reaches the request's start needs no full window.
        assert_eq!(ask(&groups, &["HHHHHH", "HHMMMM"], 0, 25), Some(8));
    }

    #[test]
    fn pending_and_loading_chunks_make_the_request_wait() {
        assert_eq!(ask(&[full(), window(8)], &["HHHH", "MHPH"], 0, 17), None);
        // A chunk being loaded inside a group's load window: wait.
        assert_eq!(ask(&[full(), window(8)], &["HHHH", "MHHh"], 0, 17), None);
        // Being loaded outside the window (chunk 0 of the windowed group):
        // it is not loaded again, no wait.
        assert_eq!(
            ask(&[full(), window(8)], &["HHHH", "hHHH"], 0, 17),
            Some(16)
        );
        // For full attention the whole hit is loaded.
        assert_eq!(ask(&[full(), window(8)], &["hHHH", "MHHH"], 0, 17), None);
    }

    #[test]
    fn caps_bound_the_hit() {
        let req = HybridLookup {
            computed: 0,
            num_tokens: 17,
            max_load_tokens: Some(10),
            max_new_tokens: None,
        };
        // Rounded down to a chunk: 8 tokens.
        let got = lookup_complete_chunks(&[full()], &mut keys(&["HHHH"]), req);
        assert_eq!(got, Some(8));
        let req = HybridLookup {
            max_load_tokens: None,
            max_new_tokens: Some(10),
            ..req
        };
        // Not rounded: the last chunk is cut, ending at 10, then aligned by
        // the prefix scan to whole chunks (3 chunks asked, 3 present: 10
        // stays the bound, 12 the chunks' end; the smaller wins).
        let got = lookup_complete_chunks(&[full()], &mut keys(&["HHHH"]), req);
        assert_eq!(got, Some(10));
    }

    proptest::proptest! {
        /// Any input: no panic, and a hit is one vLLM could load: past the
        /// GPU's hit by at least the smallest chunk, within the request (less
        /// its last token with a window), the caps and every group's keys,
        /// every full-attention chunk up to its end present, readable and
        /// not being loaded.
        #[test]
        fn answers_are_loadable_hits(
            windows in proptest::collection::vec(proptest::option::of(1u64..24), 1..4),
            tpc in 1u64..9,
            letters in proptest::collection::vec(
                proptest::collection::vec(proptest::sample::select(b"HHHHHPRMh".to_vec()), 0..12),
                4,
            ),
            computed_chunks in 0u64..6,
            num_tokens in 0u64..100,
            max_load in proptest::option::of(0u64..64),
            max_new in proptest::option::of(0u64..64),
        ) {
            let groups: Vec<GroupShape> = windows.iter().map(|w| GroupShape::new(tpc, *w).unwrap()).collect();
            let mut keys = RecordedKeys::parse(
                &letters[..groups.len()]
                    .iter()
                    .map(|g| String::from_utf8(g.clone()).unwrap())
                    .collect::<Vec<_>>(),
            )
            .unwrap();
            let req = HybridLookup {
                computed: computed_chunks * tpc,
                num_tokens,
                max_load_tokens: max_load,
                max_new_tokens: max_new,
            };
            let Some(hit) = lookup_complete_chunks(&groups, &mut keys, req) else {
                return Ok(());
            };
            if hit == 0 {
                return Ok(());
            }
            let end = req.computed + hit;
            proptest::prop_assert!(hit >= tpc);
            let windowed = windows.iter().any(Option::is_some);
            proptest::prop_assert!(end <= num_tokens.saturating_sub(u64::from(windowed)));
            proptest::prop_assert!(max_load.is_none_or(|c| hit <= c));
            proptest::prop_assert!(max_new.is_none_or(|c| hit <= c));
            for (g, w) in windows.iter().enumerate() {
                proptest::prop_assert!(end <= keys.num_keys(g) as u64 * tpc);
                if w.is_none() {
                    let stop = end.div_ceil(tpc) as usize;
                    for c in (req.computed / tpc) as usize..stop {
                        proptest::prop_assert_eq!(&letters[g][c..=c], b"H", "group {} chunk {}", g, c);
                    }
                }
            }
        }
    }
}
