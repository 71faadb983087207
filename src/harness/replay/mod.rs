//! `kvoffload replay`: runs a trace (`docs/trace-format.md`) against the
//! control plane with a manual clock and writes one JSON line per operation.
//!
//! Deterministic: the same trace gives byte-identical output. A malformed line
//! stops the replay with [`ReplayError::Malformed`]; an operation the engine
//! rejects gives an output line with `"error"` and changes nothing.
//!
//! [`run_timed`] also measures the engine time per step ([`StepTimings`];
//! the attribution rule is in `timing.rs`).

mod exec;
mod intern;
mod parse;
mod timing;

pub use timing::{EngineTimeStats, StepTimings, WARMUP_STEADY_STEPS};

use std::io::{BufRead, Write};
use std::time::Duration;

use serde_json::Value;
use thiserror::Error;

use crate::clock::ManualClock;
use crate::config::OffloadConfig;
use crate::scheduler::Scheduler;

use exec::{Engine, Fail};
use parse::Fields;
use timing::StepTimer;

/// Why a replay stopped.
#[derive(Debug, Error)]
pub enum ReplayError {
    /// Line `line` (1-based) is not a valid trace line.
    #[error("line {line}: {reason}")]
    Malformed {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// Reading the trace or writing the output failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

fn malformed(line: usize, reason: impl Into<String>) -> ReplayError {
    ReplayError::Malformed {
        line,
        reason: reason.into(),
    }
}

/// The trace format version this replay implements.
pub const TRACE_VERSION: u64 = 1;

fn header(line: usize, text: &str) -> Result<OffloadConfig, ReplayError> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| malformed(line, format!("invalid JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| malformed(line, "the header must be an object"))?;
    match obj.get("kvoffload_trace").and_then(Value::as_u64) {
        Some(TRACE_VERSION) => {}
        Some(other) => {
            return Err(malformed(
                line,
                format!("unsupported trace version {other}"),
            ));
        }
        None => {
            return Err(malformed(
                line,
                "missing field \"kvoffload_trace\" (the header)",
            ));
        }
    }
    let cfg = obj
        .get("config")
        .cloned()
        .unwrap_or(Value::Object(Default::default()));
    OffloadConfig::from_json_value(cfg).map_err(|e| malformed(line, format!("config: {e}")))
}

/// Replays the trace read from `input`, writing the output lines to `out`.
pub fn run(input: impl BufRead, out: impl Write) -> Result<(), ReplayError> {
    replay(input, out, None)
}

/// [`run`], also measuring the time spent in the engine per step (see
/// `timing` for which operations count toward which step). Only the
/// scheduler calls are timed: not reading or parsing the trace, not building
/// or writing the output, which is byte-identical to [`run`]'s.
pub fn run_timed(input: impl BufRead, out: impl Write) -> Result<StepTimings, ReplayError> {
    let mut timer = StepTimer::default();
    replay(input, out, Some(&mut timer))?;
    Ok(timer.finish())
}

fn replay(
    input: impl BufRead,
    mut out: impl Write,
    mut timer: Option<&mut StepTimer>,
) -> Result<(), ReplayError> {
    let mut lines = input.lines().enumerate();
    let Some((i, text)) = lines.next() else {
        return Err(malformed(1, "empty trace: no header"));
    };
    let cfg = header(i + 1, &text?)?;
    let clock = ManualClock::new();
    let sched = Scheduler::new(&cfg, clock.shared())
        .map_err(|e| malformed(i + 1, format!("config: {e}")))?;
    let mut engine = Engine {
        sched,
        clock,
        keys: Default::default(),
        reqs: Default::default(),
        timed: timer.is_some(),
        engine_time: Duration::ZERO,
    };
    for (i, text) in lines {
        let n = i + 1;
        let text = text?;
        if text.trim().is_empty() {
            continue;
        }
        let v: Value =
            serde_json::from_str(&text).map_err(|e| malformed(n, format!("invalid JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| malformed(n, "a line must be a JSON object"))?;
        let f = Fields::new(obj);
        let op = f.str("op").map_err(|r| malformed(n, r))?;
        let mut line = String::with_capacity(128);
        line.push_str("{\"line\":");
        line.push_str(&n.to_string());
        line.push_str(",\"op\":");
        line.push_str(&Value::from(op).to_string());
        let result = engine.exec(op, &f);
        if let Some(t) = timer.as_deref_mut() {
            t.record(op, std::mem::take(&mut engine.engine_time));
        }
        match result {
            Ok(fields) => {
                for (name, value) in fields {
                    line.push_str(",\"");
                    line.push_str(name);
                    line.push_str("\":");
                    line.push_str(&value.to_string());
                }
            }
            Err(Fail::Malformed(reason)) => return Err(malformed(n, reason)),
            Err(Fail::Rejected(reason)) => {
                line.push_str(",\"error\":");
                line.push_str(&Value::from(reason).to_string());
            }
        }
        line.push_str("}\n");
        out.write_all(line.as_bytes())?;
    }
    out.flush()?;
    Ok(())
}
