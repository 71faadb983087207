//! Records the control-plane calls of a simulation as a replayable trace
//! (docs/trace-format.md), and optionally the decisions the scheduler made, in
//! the fields `kvoffload replay` prints for them.

use std::io::Write;

use serde_json::{Value, json};

use crate::config::OffloadConfig;
use crate::ids::RequestId;
use crate::scheduler::TransferJob;

/// Trace writer and decision log (both optional).
pub struct Recorder {
    out: Option<Box<dyn Write + Send>>,
    decisions: Option<Vec<Value>>,
    error: Option<std::io::Error>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("tracing", &self.out.is_some())
            .field("decisions", &self.decisions.as_ref().map(Vec::len))
            .finish()
    }
}

/// The name of a request in a trace.
pub fn req_name(r: RequestId) -> String {
    format!("r{}", r.0)
}

/// Sorted, unique request names (how replay prints request sets).
pub fn req_set(rs: &[RequestId]) -> Value {
    let mut v: Vec<String> = rs.iter().map(|&r| req_name(r)).collect();
    v.sort();
    v.dedup();
    Value::from(v)
}

/// Jobs as replay prints them.
pub fn jobs_value(jobs: &[TransferJob]) -> Value {
    Value::Array(
        jobs.iter()
            .map(|j| {
                json!({
                    "job": j.job.0,
                    "req": req_name(j.req),
                    "block_ids": j.block_ids.iter().map(|b| b.0).collect::<Vec<_>>(),
                    "chunk_ids": j.chunk_ids.iter().map(|c| c.0).collect::<Vec<_>>(),
                    "keys": j.keys.iter().map(|k| k.0).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}

impl Recorder {
    /// A recorder that records nothing.
    pub fn off() -> Self {
        Self {
            out: None,
            decisions: None,
            error: None,
        }
    }

    /// Writes the trace to `out`, starting with the header for `cfg`.
    pub fn trace_to(&mut self, mut out: Box<dyn Write + Send>, cfg: &OffloadConfig) {
        let header = json!({"kvoffload_trace": 1, "config": cfg});
        if let Err(e) = writeln!(out, "{header}") {
            self.error = Some(e);
        }
        self.out = Some(out);
    }

    /// Keeps the decisions in memory.
    pub fn keep_decisions(&mut self) {
        self.decisions = Some(Vec::new());
    }

    /// Whether anything is recorded (callers skip building values otherwise).
    pub fn active(&self) -> bool {
        self.out.is_some() || self.decisions.is_some()
    }

    /// Records one call; `line` builds it only when a trace is written (a
    /// run without `--record` builds no JSON).
    pub fn call(&mut self, line: impl FnOnce() -> Value) {
        if let Some(out) = self.out.as_mut()
            && self.error.is_none()
            && let Err(e) = writeln!(out, "{}", line())
        {
            self.error = Some(e);
        }
    }

    /// Records the decision of the last call (`op` and the fields replay
    /// prints); `d` builds it only when decisions are kept.
    pub fn decision(&mut self, d: impl FnOnce() -> Value) {
        if let Some(v) = self.decisions.as_mut() {
            v.push(d());
        }
    }

    /// Flushes the trace; the first write error, if any.
    pub fn finish(&mut self) -> Result<Vec<Value>, std::io::Error> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        if let Some(out) = self.out.as_mut() {
            out.flush()?;
        }
        Ok(self.decisions.take().unwrap_or_default())
    }
}
