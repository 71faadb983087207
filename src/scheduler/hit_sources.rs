//! Where a request's external hit comes from (vLLM's
//! `get_external_cache_hit_sources`): the tokens its load reads from chunks
//! that were in the host tier, and those from chunks its own remote fetches
//! brought in. vLLM labels the first `host` and, for a remote store,
//! `external_unspecified`.

use std::ops::Range;

use crate::ids::RequestId;

use super::Scheduler;
use super::types::SchedulerError;

/// A request's external hit split by the tier that supplied it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HitSources {
    /// Tokens from chunks the host tier held.
    pub host_tokens: u64,
    /// Tokens from chunks the request's fetches brought from the remote tier.
    pub remote_tokens: u64,
    /// With several KV groups: tokens of the hit no loaded chunk covers (a
    /// sliding-window group loads only its window; with no full-attention
    /// group, the history before it is covered by none).
    pub uncovered_tokens: u64,
}

/// Tokens of `[start, end)` inside the chunk ranges `fetched` (chunks of
/// `tokens_per_chunk` tokens; overlapping ranges count once).
fn tokens_in_ranges(start: u64, end: u64, fetched: &[Range<usize>], tokens_per_chunk: u64) -> u64 {
    let spans: Vec<(u64, u64)> = fetched
        .iter()
        .map(|r| {
            let lo = (r.start as u64).saturating_mul(tokens_per_chunk);
            let hi = (r.end as u64).saturating_mul(tokens_per_chunk);
            (lo, hi)
        })
        .collect();
    tokens_in_spans(start, end, spans)
}

/// Tokens of `[start, end)` inside the token spans `spans` (`(lo, hi)`;
/// overlapping spans count once).
fn tokens_in_spans(start: u64, end: u64, spans: Vec<(u64, u64)>) -> u64 {
    let mut spans: Vec<(u64, u64)> = spans
        .into_iter()
        .map(|(lo, hi)| (lo.max(start), hi.min(end)))
        .filter(|(lo, hi)| lo < hi)
        .collect();
    spans.sort_unstable();
    let (mut total, mut reach) = (0, start);
    for (lo, hi) in spans {
        let lo = lo.max(reach);
        if hi > lo {
            total += hi - lo;
            reach = hi;
        }
    }
    total
}

impl Scheduler {
    /// Splits `external_tokens` (the hit its last lookup answered and the
    /// backend allocated) by source: host-tier chunks, and chunks `req`'s own
    /// remote fetches brought in (vLLM's tiering manager reports a promoted
    /// chunk's secondary tier to the request that promoted it, and the
    /// primary tier to every other). The two always sum to `external_tokens`.
    pub fn hit_sources(
        &self,
        req: RequestId,
        external_tokens: u64,
    ) -> Result<HitSources, SchedulerError> {
        let rs = self
            .requests
            .get(&req)
            .ok_or(SchedulerError::UnknownRequest(req))?;
        let start = rs.lookup_computed.unwrap_or(0);
        let end = start.saturating_add(external_tokens);
        if self.groups.is_some() {
            // vLLM's sweep over the load's key ranges: a token any loaded
            // chunk covers comes from a tier; from the remote tier where the
            // request's own fetches brought that chunk in (in any group).
            let covered = tokens_in_spans(start, end, rs.load_cover.clone());
            let remote = tokens_in_ranges(
                start,
                end,
                self.remote_fetched_chunks(req),
                self.geo.tokens_per_chunk,
            )
            .min(covered);
            return Ok(HitSources {
                host_tokens: covered - remote,
                remote_tokens: remote,
                uncovered_tokens: external_tokens - covered,
            });
        }
        let remote = tokens_in_ranges(
            start,
            end,
            self.remote_fetched_chunks(req),
            self.geo.tokens_per_chunk,
        );
        Ok(HitSources {
            host_tokens: external_tokens - remote,
            remote_tokens: remote,
            uncovered_tokens: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::tokens_in_ranges;

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // a list of one chunk range
    fn counts_the_overlap_of_the_hit_and_the_fetched_chunks_once() {
        // Chunks of 4 tokens; fetched chunks 2..4 = tokens 8..16.
        assert_eq!(tokens_in_ranges(0, 16, &[2..4], 4), 8);
        assert_eq!(
            tokens_in_ranges(10, 16, &[2..4], 4),
            6,
            "hit starts inside a chunk"
        );
        assert_eq!(tokens_in_ranges(0, 8, &[2..4], 4), 0, "hit ends before");
        assert_eq!(
            tokens_in_ranges(0, 20, &[2..4, 3..5], 4),
            12,
            "overlap counted once"
        );
        assert_eq!(tokens_in_ranges(0, 40, &[6..8, 1..2], 4), 12, "unsorted");
        assert_eq!(tokens_in_ranges(0, 40, &[], 4), 0);
    }
}
