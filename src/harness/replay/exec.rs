//! Execution of trace operations against a scheduler and its manager.

use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};

use crate::clock::ManualClock;
use crate::ids::{JobId, RequestId};
use crate::key::{BlockHash, ChunkKey};
use crate::manager::{LookupResult, ManagerError, OffloadEvent, StoreOutcome};
use crate::scheduler::{
    CompletionReport, LookupOutcome, RequestCaps, ScheduledRequest, Scheduler, StepInput,
    TransferJob,
};

use super::intern::{Keys, Requests};
use super::parse::{Fields, key_text};

/// Why an operation produced no normal output.
#[derive(Debug)]
pub(crate) enum Fail {
    /// The line is malformed: the replay stops.
    Malformed(String),
    /// The engine rejected a well-formed operation: an `"error"` output.
    Rejected(String),
}

impl From<String> for Fail {
    fn from(s: String) -> Self {
        Fail::Malformed(s)
    }
}

/// Output fields of one operation, in order.
pub(crate) type Out = Vec<(&'static str, Value)>;

/// The engine under replay.
#[derive(Debug)]
pub(crate) struct Engine {
    pub sched: Scheduler,
    pub clock: ManualClock,
    pub keys: Keys,
    pub reqs: Requests,
    /// Whether [`Engine::engine_time`] is measured (`--timing`).
    pub timed: bool,
    /// Time spent in scheduler calls of the timed operations (`lookup`,
    /// `alloc`, `step`, `worker_output`, `request_finished`) since the caller
    /// last reset it; only the calls themselves, not the parsing of their
    /// fields or the building of their output.
    pub engine_time: Duration,
}

impl Engine {
    /// Runs `call` on the scheduler, adding its duration to `engine_time`
    /// when timing is on.
    fn timed<T>(&mut self, call: impl FnOnce(&mut Scheduler) -> T) -> T {
        if !self.timed {
            return call(&mut self.sched);
        }
        let start = Instant::now();
        let r = call(&mut self.sched);
        self.engine_time += start.elapsed();
        r
    }

    /// A scheduler rejection, with the requests it names written as the
    /// trace names them.
    fn rejected_req(&self, e: impl std::fmt::Display) -> Fail {
        Fail::Rejected(self.reqs.name_ids_in(&e.to_string()))
    }

    /// A manager rejection, with its key written as the trace wrote it.
    fn rejected_key(&self, e: ManagerError) -> Fail {
        let msg = e.to_string();
        match e.key() {
            Some(k) => {
                Fail::Rejected(msg.replacen(&k.to_string(), &self.keys.show(k).to_string(), 1))
            }
            None => Fail::Rejected(msg),
        }
    }

    fn keys(&mut self, f: &Fields<'_>, name: &str) -> Result<Vec<ChunkKey>, Fail> {
        let arr = f.array(name)?;
        let mut out = Vec::with_capacity(arr.len());
        for v in arr {
            let text = key_text(v, name)?;
            out.push(self.keys.intern(text, v.clone()));
        }
        Ok(out)
    }

    fn hashes(
        &mut self,
        f: &Fields<'_>,
        name: &str,
        optional: bool,
    ) -> Result<Vec<BlockHash>, Fail> {
        if optional && !f.has(name) {
            return Ok(Vec::new());
        }
        Ok(self
            .keys(f, name)?
            .into_iter()
            .map(|k| BlockHash(k.0))
            .collect())
    }

    fn req(&mut self, f: &Fields<'_>) -> Result<RequestId, Fail> {
        let name = f.str("req")?;
        Ok(self.reqs.intern(name))
    }

    fn opt_req(&mut self, f: &Fields<'_>) -> Result<Option<RequestId>, Fail> {
        Ok(f.opt_str("req")?.map(|n| self.reqs.intern(n)))
    }

    fn req_set(&self, ids: &[RequestId]) -> Value {
        let mut names: Vec<String> = ids
            .iter()
            .map(|&r| self.reqs.show(r).as_str().unwrap_or_default().to_string())
            .collect();
        names.sort();
        names.dedup();
        Value::from(names)
    }

    fn events(&self, evs: Vec<OffloadEvent>) -> Value {
        Value::Array(
            evs.into_iter()
                .map(|e| {
                    let mut m = Map::new();
                    let name = if e.removed { "removed" } else { "stored" };
                    m.insert(name.into(), self.keys.show_all(&e.keys));
                    if e.metadata_only {
                        m.insert("metadata_only".into(), Value::Bool(true));
                    }
                    Value::Object(m)
                })
                .collect(),
        )
    }

    fn jobs_out(&self, jobs: &[TransferJob]) -> Value {
        Value::Array(
            jobs.iter()
                .map(|j| {
                    json!({
                        "job": j.job.0,
                        "req": self.reqs.show(j.req),
                        "block_ids": j.block_ids.iter().map(|b| b.0).collect::<Vec<_>>(),
                        "chunk_ids": j.chunk_ids.iter().map(|c| c.0).collect::<Vec<_>>(),
                        "keys": self.keys.show_all(&j.keys),
                    })
                })
                .collect(),
        )
    }

    /// Executes one operation.
    pub fn exec(&mut self, op: &str, f: &Fields<'_>) -> Result<Out, Fail> {
        match op {
            "manager.lookup" => {
                let keys = self.keys(f, "keys")?;
                let m = self.sched.manager();
                let results: Vec<&str> = keys
                    .iter()
                    .map(|&k| match m.lookup(k) {
                        LookupResult::Hit => "hit",
                        LookupResult::HitPending => "hit_pending",
                        LookupResult::Miss => "miss",
                    })
                    .collect();
                Ok(vec![("results", Value::from(results))])
            }
            "manager.prepare_load" => {
                let keys = self.keys(f, "keys")?;
                let req = self.opt_req(f)?;
                let ids = self
                    .sched
                    .manager_mut()
                    .prepare_load(&keys, req)
                    .map_err(|e| self.rejected_key(e))?;
                Ok(vec![(
                    "chunk_ids",
                    Value::from(ids.iter().map(|c| c.0).collect::<Vec<_>>()),
                )])
            }
            "manager.complete_load" => {
                let keys = self.keys(f, "keys")?;
                let req = self.opt_req(f)?;
                self.sched
                    .manager_mut()
                    .complete_load(&keys, req)
                    .map_err(|e| self.rejected_key(e))?;
                Ok(vec![])
            }
            "manager.prepare_store" => {
                let keys = self.keys(f, "keys")?;
                let req = self.opt_req(f)?;
                Ok(match self.sched.manager_mut().prepare_store(&keys, req) {
                    None => vec![("result", Value::Null)],
                    Some(out) => vec![
                        ("keys_to_store", self.keys.show_all(&out.keys_to_store)),
                        (
                            "chunk_ids",
                            Value::from(out.chunk_ids.iter().map(|c| c.0).collect::<Vec<_>>()),
                        ),
                        ("evicted", self.keys.show_all(&out.evicted)),
                    ],
                })
            }
            "manager.complete_store" => {
                let keys = self.keys(f, "keys")?;
                let success = f.bool_or("success", true)?;
                let req = self.opt_req(f)?;
                let outcome = if success {
                    StoreOutcome::Success
                } else {
                    StoreOutcome::Failure
                };
                self.sched
                    .manager_mut()
                    .complete_store(&keys, outcome, req)
                    .map_err(|e| self.rejected_key(e))?;
                Ok(vec![])
            }
            "manager.touch" => {
                let keys = self.keys(f, "keys")?;
                let req = self.opt_req(f)?;
                self.sched.manager_mut().touch(&keys, req);
                Ok(vec![])
            }
            "manager.request_finished" => {
                let req = self.req(f)?;
                self.sched.manager_mut().request_finished(req);
                Ok(vec![])
            }
            "manager.events" | "events" => {
                let evs = if op == "events" {
                    self.sched.take_events()
                } else {
                    self.sched.manager_mut().take_events()
                };
                Ok(vec![("events", self.events(evs))])
            }
            "manager.reset" => {
                self.sched.manager_mut().reset();
                Ok(vec![])
            }
            "add_request" => {
                let req = self.req(f)?;
                let prompt = f.u64("prompt_tokens")?;
                let hashes = self.hashes(f, "block_hashes", false)?;
                let caps = RequestCaps {
                    max_load_tokens: f.opt_u64("max_load_tokens")?,
                    max_offload_tokens: f.opt_u64("max_offload_tokens")?,
                    ..RequestCaps::default()
                };
                self.sched
                    .add_request(req, prompt, &hashes)
                    .map_err(|e| self.rejected_req(e))?;
                if caps != RequestCaps::default() {
                    self.sched
                        .set_request_caps(req, caps)
                        .map_err(|e| self.rejected_req(e))?;
                }
                Ok(vec![])
            }
            "update_request" => {
                let req = self.req(f)?;
                let n = f.u64("num_tokens")?;
                let hashes = self.hashes(f, "block_hashes", true)?;
                self.sched
                    .update_request(req, n, &hashes)
                    .map_err(|e| self.rejected_req(e))?;
                Ok(vec![])
            }
            "lookup" => {
                let req = self.req(f)?;
                let computed = f.u64("computed_tokens")?;
                match self
                    .timed(|s| s.lookup(req, computed))
                    .map_err(|e| self.rejected_req(e))?
                {
                    // `sync` only where a sync-load budget reserved the hit.
                    LookupOutcome::Hit(n) if self.sched.sync_load_reserved(req) => Ok(vec![
                        ("hit_tokens", Value::from(n)),
                        ("sync", Value::Bool(true)),
                    ]),
                    LookupOutcome::Hit(n) => Ok(vec![("hit_tokens", Value::from(n))]),
                    LookupOutcome::Defer => Ok(vec![("defer", Value::Bool(true))]),
                }
            }
            "alloc" => {
                let req = self.req(f)?;
                let blocks = f.blocks("block_ids", false)?;
                let ext = f.u64("external_tokens")?;
                match self
                    .timed(|s| s.on_alloc(req, &blocks, ext))
                    .map_err(|e| self.rejected_req(e))?
                {
                    Some(job) => Ok(vec![("load_job", Value::from(job.0))]),
                    None => Ok(vec![]),
                }
            }
            "step" => self.step(f),
            "worker_output" => {
                let completed = f.object("completed")?;
                let mut report = CompletionReport::default();
                for (k, v) in completed {
                    let job: u64 = k
                        .parse()
                        .map_err(|_| format!("\"completed\" key {k:?} is not a job id"))?;
                    let n = v
                        .as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| format!("\"completed\" count for job {k} must be a non-negative integer, got {v}"))?;
                    report.completed.push((JobId(job), n));
                }
                report.failed = f.jobs("failed")?;
                let out = self
                    .timed(|s| {
                        s.check_report(&report)
                            .map(|()| s.on_worker_output(&report))
                    })
                    .map_err(|e| self.rejected_req(e))?;
                Ok(vec![
                    ("finished_loads", self.req_set(&out.finished_loads)),
                    ("failed_loads", self.req_set(&out.failed_loads)),
                ])
            }
            "request_finished" => {
                let req = self.req(f)?;
                let blocks = f.blocks("block_ids", false)?;
                let aborted = f.bool_or("aborted", false)?;
                let computed = if aborted {
                    f.u64("computed_tokens")?
                } else {
                    f.opt_u64("computed_tokens")?.unwrap_or(0)
                };
                self.timed(|s| s.request_finished(req, &blocks, aborted, computed))
                    .map_err(|e| self.rejected_req(e))?;
                Ok(vec![])
            }
            "reset" => {
                self.sched.reset().map_err(|e| self.rejected_req(e))?;
                Ok(vec![])
            }
            "advance" => {
                let ms = f.u64("ms")?;
                self.clock.advance(Duration::from_millis(ms));
                Ok(vec![(
                    "now_ms",
                    Value::from(
                        u64::try_from(crate::clock::Clock::now(&self.clock).as_millis())
                            .unwrap_or(u64::MAX),
                    ),
                )])
            }
            "scan" => {
                let out = self.sched.scan_now();
                Ok(vec![
                    (
                        "stalled",
                        Value::from(out.stalled.iter().map(|j| j.0).collect::<Vec<_>>()),
                    ),
                    ("failed_loads", self.req_set(&out.failed_loads)),
                ])
            }
            "confirm_cancelled" => {
                let job = JobId(f.u64("job")?);
                self.sched
                    .confirm_cancelled(job)
                    .map_err(|e| self.rejected_req(e))?;
                Ok(vec![])
            }
            "state" => {
                let s = self.sched.state();
                Ok(vec![
                    ("jobs", Value::from(s.jobs)),
                    ("requests", Value::from(s.requests)),
                    ("chunks_being_loaded", Value::from(s.chunks_being_loaded)),
                    ("fenced_blocks", Value::from(s.fenced_blocks)),
                    ("stalled_jobs", Value::from(s.stalled_jobs)),
                    ("quarantined_chunks", Value::from(s.quarantined_chunks)),
                    // The manager counts, both as dotted names and as one object.
                    ("manager.cached", Value::from(s.manager.cached)),
                    ("manager.pending", Value::from(s.manager.pending)),
                    ("manager.pinned", Value::from(s.manager.pinned)),
                    ("manager.free", Value::from(s.manager.free)),
                    ("manager.quarantined", Value::from(s.manager.quarantined)),
                    (
                        "manager",
                        json!({
                            "cached": s.manager.cached,
                            "pending": s.manager.pending,
                            "pinned": s.manager.pinned,
                            "free": s.manager.free,
                            "quarantined": s.manager.quarantined,
                        }),
                    ),
                    (
                        "has_pending_work",
                        Value::Bool(self.sched.has_pending_work()),
                    ),
                ])
            }
            other => Err(Fail::Malformed(format!("unknown op {other:?}"))),
        }
    }

    fn step(&mut self, f: &Fields<'_>) -> Result<Out, Fail> {
        let mut input = StepInput::default();
        for (i, v) in f.opt_array("scheduled")?.iter().enumerate() {
            let m = v
                .as_object()
                .ok_or_else(|| format!("\"scheduled\"[{i}] must be an object"))?;
            let e = Fields::new(m);
            let req = self.req(&e)?;
            input.scheduled.push(ScheduledRequest {
                req,
                new_block_ids: e.blocks("new_block_ids", true)?,
                computed_tokens: e.u64("computed_tokens")?,
                scheduled_tokens: e.u64("scheduled_tokens")?,
                full_table: e.bool_or("full_table", false)? || f.bool_or("full_table", false)?,
            });
        }
        input.preempted = f
            .strings("preempted")?
            .into_iter()
            .map(|n| self.reqs.intern(n))
            .collect();
        input.finished = f
            .strings("finished")?
            .into_iter()
            .map(|n| self.reqs.intern(n))
            .collect();
        let plan = self
            .timed(|s| s.build_step(&input))
            .map_err(|e| self.rejected_req(e))?;
        let mut out = vec![
            ("loads", self.jobs_out(&plan.loads)),
            ("stores", self.jobs_out(&plan.stores)),
            (
                "flush",
                Value::from(plan.flush.iter().map(|j| j.0).collect::<Vec<_>>()),
            ),
            ("failed_loads", self.req_set(&plan.failed_loads)),
        ];
        // Only with a sync-load budget, so that other traces' outputs stay as they were.
        if !plan.sync_loads.is_empty() {
            out.push((
                "sync_loads",
                Value::from(plan.sync_loads.iter().map(|j| j.0).collect::<Vec<_>>()),
            ));
        }
        Ok(out)
    }
}
