//! Engine time per step: what `kvoffload replay --timing FILE` measures.
//!
//! Each `step` operation owns a *bucket*: the engine time of the `lookup` and
//! `alloc` operations since the previous `step` (they prepare this one), of the
//! `step` itself, and of the `worker_output` and `request_finished` operations
//! after it up to the next `step` (they report on it). Precisely:
//!
//! - `lookup`, `alloc` (and, for steadiness only, `add_request`) belong to the
//!   next `step` operation; after the last `step` they belong to no step;
//! - `worker_output`, `request_finished` belong to the last `step` operation
//!   before them; before the first `step` they belong to no step;
//! - no other operation is timed or changes a bucket.
//!
//! A bucket is *steady* when it holds no `add_request`, `lookup`, `alloc` or
//! `request_finished` (the decode steps of a serving loop). The first
//! [`WARMUP_STEADY_STEPS`] steady steps are skipped; the statistics are over
//! the rest.

use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

/// Steady steps skipped (warm-up) before the statistics start.
pub const WARMUP_STEADY_STEPS: u64 = 16;

/// Engine time per step of one replay (`kvoffload replay --timing FILE`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepTimings {
    /// Number of `step` operations in the trace (rejected ones included).
    pub steps: u64,
    /// Steady steps counted in the statistics: those after the first
    /// [`WARMUP_STEADY_STEPS`] steady steps.
    pub steady_steps: u64,
    /// Engine time per counted steady step, in microseconds; `None` (`null`
    /// in JSON) when no steady step is left after the warm-up.
    pub engine_us: Option<EngineTimeStats>,
}

/// Statistics of the engine time per step, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EngineTimeStats {
    /// Median (nearest rank).
    pub p50: f64,
    /// 90th percentile (nearest rank).
    pub p90: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
    /// Arithmetic mean.
    pub mean: f64,
}

impl StepTimings {
    /// The JSON object `--timing` writes, as one line (no trailing newline):
    /// `{"steps": n, "steady_steps": n, "engine_us": {"p50": x, "p90": x, "p99": x, "mean": x}}`,
    /// with `"engine_us": null` when no steady step is left after the warm-up.
    pub fn to_json(&self) -> String {
        let engine_us = match self.engine_us {
            None => "null".to_string(),
            Some(s) => format!(
                "{{\"p50\":{},\"p90\":{},\"p99\":{},\"mean\":{}}}",
                Value::from(s.p50),
                Value::from(s.p90),
                Value::from(s.p99),
                Value::from(s.mean)
            ),
        };
        format!(
            "{{\"steps\":{},\"steady_steps\":{},\"engine_us\":{engine_us}}}",
            self.steps, self.steady_steps
        )
    }
}

/// One step's bucket.
#[derive(Debug, Default, Clone, Copy)]
struct Bucket {
    /// Engine time of the bucket's operations.
    time: Duration,
    /// Holds an `add_request`, `lookup`, `alloc` or `request_finished`.
    busy: bool,
}

/// Attributes the engine time of each operation to its step.
#[derive(Debug, Default)]
pub(crate) struct StepTimer {
    steps: u64,
    /// `lookup`/`alloc`/`add_request` since the last `step`: the next step's.
    pending: Bucket,
    /// The last `step`'s bucket, still taking `worker_output`/`request_finished`.
    current: Option<Bucket>,
    /// Steady steps closed so far, warm-up included.
    steady_seen: u64,
    /// Engine time of the steady steps after the warm-up.
    samples: Vec<Duration>,
}

impl StepTimer {
    /// Records operation `op`, whose engine calls took `engine`.
    pub(crate) fn record(&mut self, op: &str, engine: Duration) {
        match op {
            "add_request" | "lookup" | "alloc" => {
                self.pending.time += engine;
                self.pending.busy = true;
            }
            "step" => {
                self.close();
                self.steps += 1;
                let mut b = std::mem::take(&mut self.pending);
                b.time += engine;
                self.current = Some(b);
            }
            "worker_output" | "request_finished" => {
                if let Some(b) = &mut self.current {
                    b.time += engine;
                    b.busy |= op == "request_finished";
                }
            }
            _ => {}
        }
    }

    /// Closes the last step's bucket.
    fn close(&mut self) {
        match self.current.take() {
            Some(b) if !b.busy => {
                self.steady_seen += 1;
                if self.steady_seen > WARMUP_STEADY_STEPS {
                    self.samples.push(b.time);
                }
            }
            _ => {}
        }
    }

    /// The statistics, once the trace has ended.
    pub(crate) fn finish(mut self) -> StepTimings {
        self.close();
        let mut ns: Vec<u128> = self.samples.iter().map(Duration::as_nanos).collect();
        ns.sort_unstable();
        let us = |n: u128| n as f64 / 1e3;
        let engine_us = (!ns.is_empty()).then(|| EngineTimeStats {
            p50: us(percentile(&ns, 50.0)),
            p90: us(percentile(&ns, 90.0)),
            p99: us(percentile(&ns, 99.0)),
            mean: us(ns.iter().sum::<u128>()) / ns.len() as f64,
        });
        StepTimings {
            steps: self.steps,
            steady_steps: ns.len() as u64,
            engine_us,
        }
    }
}

/// Nearest-rank percentile of sorted, non-empty values.
fn percentile(sorted: &[u128], p: f64) -> u128 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// A decode loop: `steps` steady steps, each `step` then `worker_output`.
    fn decode(t: &mut StepTimer, steps: u64, step_us: u64, report_us: u64) {
        for _ in 0..steps {
            t.record("update_request", us(1000));
            t.record("step", us(step_us));
            t.record("worker_output", us(report_us));
            t.record("state", us(1000));
        }
    }

    #[test]
    fn steady_steps_after_the_warm_up_are_counted() {
        let mut t = StepTimer::default();
        decode(&mut t, WARMUP_STEADY_STEPS, 1000, 1000);
        decode(&mut t, 10, 3, 2);
        let s = t.finish();
        assert_eq!(s.steps, WARMUP_STEADY_STEPS + 10);
        assert_eq!(s.steady_steps, 10);
        let e = s.engine_us.expect("steady steps");
        assert_eq!((e.p50, e.p90, e.p99, e.mean), (5.0, 5.0, 5.0, 5.0));
    }

    #[test]
    fn attribution_follows_the_rule() {
        let mut t = StepTimer::default();
        // Before the first step: a worker_output belongs to no step.
        t.record("worker_output", us(7));
        t.record("add_request", Duration::ZERO);
        t.record("lookup", us(1));
        t.record("alloc", us(2));
        t.record("step", us(4)); // busy: 1 + 2 + 4 (+ 8 below)
        t.record("worker_output", us(8));
        decode(&mut t, WARMUP_STEADY_STEPS, 1, 0);
        t.record("step", us(10)); // steady, then busy by its request_finished
        t.record("request_finished", us(1));
        t.record("step", us(20)); // steady: 20 + 30
        t.record("worker_output", us(30));
        t.record("lookup", us(40)); // after the last step: no step
        let s = t.finish();
        assert_eq!(s.steps, 3 + WARMUP_STEADY_STEPS);
        assert_eq!(s.steady_steps, 1);
        assert_eq!(s.engine_us.unwrap().mean, 50.0);
    }

    #[test]
    fn no_steady_step_after_the_warm_up_is_null() {
        let mut t = StepTimer::default();
        decode(&mut t, WARMUP_STEADY_STEPS, 1, 1);
        let s = t.finish();
        assert_eq!(s.steady_steps, 0);
        assert_eq!(s.engine_us, None);
        assert_eq!(
            s.to_json(),
            format!(r#"{{"steps":{WARMUP_STEADY_STEPS},"steady_steps":0,"engine_us":null}}"#)
        );
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u128> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), 50);
        assert_eq!(percentile(&v, 90.0), 90);
        assert_eq!(percentile(&v, 99.0), 99);
        assert_eq!(percentile(&[7], 99.0), 7);
    }
}
