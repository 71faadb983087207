//! How long a run may go without progress before it is declared stuck: a
//! bound that follows from the workload and the engine's stall handling, not
//! from the number of requests, so a run of any length is judged alike.

use crate::config::OffloadConfig;

use super::SimOptions;
use super::faults::MAX_STALL_FATE_STEPS;

/// Margin over one request's worst single-handed path: room for queueing
/// behind preemptions, deferred lookups and other requests' stalls.
const MARGIN: u64 = 8;

/// Steps a run may go without finishing a request while requests are live
/// (and, once every request has finished, steps the drain may take) before
/// it stops with [`super::SimError::Stuck`] or [`super::SimError::NoDrain`].
///
/// One request's worst path: the prefill of the longest prompt the workload
/// can make (the longest system prompt and every turn's longest user and
/// generated tokens) at `max_batch_tokens` a step, its longest output at one
/// token a step, and twice the slowest stall cleanup (a stalled load, then a
/// stalled store): the stall timeout, the next scan, the latest stall fate and
/// the longest late report. The limit is `MARGIN` (8) times that.
pub fn derived_progress_limit(cfg: &OffloadConfig, opts: &SimOptions) -> u64 {
    let step_ms = opts.step_ms.max(1);
    let shape = &opts.shape;
    let turn = shape.user_tokens.1 + 1 + shape.output_tokens.1;
    let longest_prompt = shape
        .system_tokens
        .1
        .saturating_add(shape.turns.1.saturating_mul(turn));
    let prefill = longest_prompt.div_ceil(opts.max_batch_tokens.max(1));
    let request = prefill.saturating_add(shape.output_tokens.1);
    let stall = cfg
        .stall_timeout_ms
        .div_ceil(step_ms)
        .saturating_add(cfg.stall_scan_interval_ms.div_ceil(step_ms))
        .saturating_add(MAX_STALL_FATE_STEPS)
        .saturating_add(u64::from(opts.faults.max_delay_steps));
    MARGIN.saturating_mul(request.saturating_add(stall.saturating_mul(2)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::sim::default_config;

    #[test]
    fn the_limit_follows_the_workload_not_the_request_count() {
        let cfg = default_config();
        let small = SimOptions {
            requests: 10,
            ..SimOptions::default()
        };
        let huge = SimOptions {
            requests: 1_000_000_000,
            ..SimOptions::default()
        };
        let base = derived_progress_limit(&cfg, &small);
        assert_eq!(base, derived_progress_limit(&cfg, &huge));
        // Default workload: a 1540-token prompt (1 prefill step) and 96 output
        // tokens; a stall costs 30 + 5 + 20 + 40 steps: 8 * (97 + 2 * 95).
        assert_eq!(base, 8 * (97 + 2 * 95));
        // Longer outputs and a longer stall timeout give more room.
        let mut long = SimOptions::default();
        long.shape.output_tokens = (16, 2000);
        assert!(derived_progress_limit(&cfg, &long) > base + 8 * 1800);
        let slow = OffloadConfig {
            stall_timeout_ms: 3000,
            ..default_config()
        };
        assert_eq!(
            derived_progress_limit(&slow, &small),
            base + 8 * 2 * (300 - 30)
        );
    }
}
