//! The comparison rules of the vLLM oracle's `compare.py` and
//! `compare_connector.py` (`docs/conformance.md`, "Checking"), in Rust, so that CI needs neither Python nor vLLM.
//!
//! Output lines are matched by `"line"`; only the fields the trace format
//! names are compared (extra fields are ignored); an `"error"` in the actual
//! output is a mismatch unless the expected line carries the same error
//! (hand-written traces of kvoffload's own extensions). Lists are compared in
//! order where vLLM's order is defined, as sets where it is not:
//! - `results`, `chunk_ids`, `keys_to_store`, `evicted`: ordered;
//! - `events`: ordered events, the keys of one event as a set;
//! - a step's `loads`/`stores`: by job id, each job's fields exact;
//! - `flush`, `finished_loads`, `failed_loads`, `stalled`: sets;
//! - `state`: the counts exact.

use serde_json::{Map, Value};

/// The first disagreement of a trace.
#[derive(Debug)]
pub struct Mismatch {
    /// Input line of the disagreeing output (`None`: the whole output).
    pub line: Option<u64>,
    /// What differs.
    pub msg: String,
}

fn mismatch(line: u64, msg: impl Into<String>) -> Mismatch {
    Mismatch {
        line: Some(line),
        msg: msg.into(),
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() <= 300 {
        s
    } else {
        format!("{}...", &s[..297])
    }
}

fn need<'a>(
    act: &'a Map<String, Value>,
    field: &str,
    exp: &Value,
    line: u64,
) -> Result<&'a Value, Mismatch> {
    act.get(field).ok_or_else(|| {
        mismatch(
            line,
            format!("missing field {field:?} (expected {})", short(exp)),
        )
    })
}

/// A JSON list as a set of its (type-strict) values.
fn as_set(v: &Value, field: &str, line: u64) -> Result<Vec<String>, Mismatch> {
    let arr = v.as_array().ok_or_else(|| {
        mismatch(
            line,
            format!("field {field:?}: expected a list, got {}", short(v)),
        )
    })?;
    let mut s: Vec<String> = arr.iter().map(Value::to_string).collect();
    s.sort();
    s.dedup();
    Ok(s)
}

fn same_set(exp: &Value, act: &Value, field: &str, line: u64) -> Result<(), Mismatch> {
    if as_set(exp, field, line)? != as_set(act, field, line)? {
        return Err(mismatch(
            line,
            format!(
                "field {field:?}: expected {}, got {} (as sets)",
                short(exp),
                short(act)
            ),
        ));
    }
    Ok(())
}

fn exact(exp: &Value, act: &Value, field: &str, line: u64) -> Result<(), Mismatch> {
    if exp != act {
        return Err(mismatch(
            line,
            format!(
                "field {field:?}: expected {}, got {}",
                short(exp),
                short(act)
            ),
        ));
    }
    Ok(())
}

/// An event as (kind, set of keys).
fn event_form(ev: &Value, line: u64) -> Result<(&'static str, Vec<String>), Mismatch> {
    let obj = ev.as_object().ok_or_else(|| {
        mismatch(
            line,
            format!("an event must be an object, got {}", short(ev)),
        )
    })?;
    let kinds: Vec<&'static str> = ["stored", "removed"]
        .into_iter()
        .filter(|k| obj.contains_key(*k))
        .collect();
    let [kind] = kinds[..] else {
        return Err(mismatch(
            line,
            format!("an event needs one of stored/removed: {}", short(ev)),
        ));
    };
    Ok((kind, as_set(&obj[kind], kind, line)?))
}

fn compare_events(exp: &Value, act: &Value, line: u64) -> Result<(), Mismatch> {
    let (Some(e), Some(a)) = (exp.as_array(), act.as_array()) else {
        return Err(mismatch(
            line,
            format!("field \"events\": expected a list, got {}", short(act)),
        ));
    };
    if e.len() != a.len() {
        return Err(mismatch(
            line,
            format!(
                "field \"events\": expected {} events {}, got {} {}",
                e.len(),
                short(exp),
                a.len(),
                short(act)
            ),
        ));
    }
    for (i, (x, y)) in e.iter().zip(a).enumerate() {
        if event_form(x, line)? != event_form(y, line)? {
            return Err(mismatch(
                line,
                format!(
                    "field \"events\": event #{i} differs: expected {}, got {}",
                    short(x),
                    short(y)
                ),
            ));
        }
    }
    Ok(())
}

fn compare_jobs(exp: &Value, act: &Value, field: &str, line: u64) -> Result<(), Mismatch> {
    let by_job = |v: &Value| -> Option<Vec<Value>> {
        let mut jobs = v.as_array()?.clone();
        jobs.sort_by_key(|j| j.get("job").and_then(Value::as_u64));
        Some(jobs)
    };
    let (Some(e), Some(a)) = (by_job(exp), by_job(act)) else {
        return Err(mismatch(
            line,
            format!(
                "field {field:?}: expected a list of jobs, got {}",
                short(act)
            ),
        ));
    };
    let ids = |v: &[Value]| -> Vec<Value> {
        v.iter()
            .map(|j| j.get("job").cloned().unwrap_or(Value::Null))
            .collect()
    };
    if ids(&e) != ids(&a) {
        return Err(mismatch(
            line,
            format!(
                "field {field:?}: expected jobs {:?}, got {:?}; expected {}, got {}",
                ids(&e),
                ids(&a),
                short(exp),
                short(act)
            ),
        ));
    }
    for (x, y) in e.iter().zip(&a) {
        for f in ["job", "req", "block_ids", "chunk_ids", "keys"] {
            let want = x.get(f).unwrap_or(&Value::Null);
            match y.get(f) {
                Some(got) if got == want => {}
                got => {
                    return Err(mismatch(
                        line,
                        format!(
                            "field {field:?} job {}: {f} expected {}, got {}",
                            short(&x["job"]),
                            short(want),
                            got.map_or("nothing".into(), short)
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

const STATE_FIELDS: [&str; 6] = [
    "jobs",
    "requests",
    "chunks_being_loaded",
    "fenced_blocks",
    "stalled_jobs",
    "quarantined_chunks",
];

/// Compares one output line with its expected line.
fn compare_line(exp: &Map<String, Value>, act: &Map<String, Value>) -> Result<(), Mismatch> {
    let line = exp["line"].as_u64().unwrap_or(0);
    let op = exp["op"].as_str().unwrap_or_default();
    if act.get("op").and_then(Value::as_str) != Some(op) {
        return Err(mismatch(
            line,
            format!("op: expected {op:?}, got {:?}", act.get("op")),
        ));
    }
    match (exp.get("error"), act.get("error")) {
        (None, Some(e)) => return Err(mismatch(line, format!("unexpected error {e}"))),
        (Some(e), None) => return Err(mismatch(line, format!("expected error {e}, got none"))),
        (Some(e), Some(a)) => return exact(e, a, "error", line),
        (None, None) => {}
    }
    let f = |name: &str| -> Result<(&Value, &Value), Mismatch> {
        let e = &exp[name];
        Ok((e, need(act, name, e, line)?))
    };
    match op {
        "manager.lookup" => {
            let (e, a) = f("results")?;
            exact(e, a, "results", line)?;
        }
        "manager.prepare_load" => {
            let (e, a) = f("chunk_ids")?;
            exact(e, a, "chunk_ids", line)?;
        }
        "manager.prepare_store" => {
            let exp_null = exp.get("result") == Some(&Value::Null);
            let act_null = act.get("result") == Some(&Value::Null);
            if exp_null != act_null {
                return Err(mismatch(
                    line,
                    format!("expected result null: {exp_null}, got null: {act_null}"),
                ));
            }
            if !exp_null {
                for name in ["keys_to_store", "chunk_ids", "evicted"] {
                    let (e, a) = f(name)?;
                    exact(e, a, name, line)?;
                }
            }
        }
        "manager.events" | "events" => {
            let (e, a) = f("events")?;
            compare_events(e, a, line)?;
        }
        "lookup" => {
            if exp.get("defer") == Some(&Value::Bool(true)) {
                if act.get("defer") != Some(&Value::Bool(true))
                    || act.get("hit_tokens").is_some_and(|v| !v.is_null())
                {
                    return Err(mismatch(
                        line,
                        format!("expected defer, got {}", short(&Value::Object(act.clone()))),
                    ));
                }
            } else {
                let (e, a) = f("hit_tokens")?;
                exact(e, a, "hit_tokens", line)?;
                if act.get("defer") == Some(&Value::Bool(true)) {
                    return Err(mismatch(line, "unexpected defer"));
                }
            }
        }
        "alloc" => match exp.get("load_job") {
            Some(e) => exact(e, need(act, "load_job", e, line)?, "load_job", line)?,
            None => {
                if act.get("load_job").is_some_and(|v| !v.is_null()) {
                    return Err(mismatch(
                        line,
                        format!("no load expected, got load_job {}", act["load_job"]),
                    ));
                }
            }
        },
        "step" => {
            for name in ["loads", "stores"] {
                let (e, a) = f(name)?;
                compare_jobs(e, a, name, line)?;
            }
            let (e, a) = f("flush")?;
            same_set(e, a, "flush", line)?;
            if exp.contains_key("failed_loads") {
                let (e, a) = f("failed_loads")?;
                same_set(e, a, "failed_loads", line)?;
            }
        }
        "worker_output" => {
            for name in ["finished_loads", "failed_loads"] {
                let (e, a) = f(name)?;
                same_set(e, a, name, line)?;
            }
        }
        "state" => {
            for name in STATE_FIELDS {
                let (e, a) = f(name)?;
                exact(e, a, name, line)?;
            }
            let (e, a) = f("manager")?;
            for name in ["cached", "pending", "pinned", "free"] {
                let got = a.get(name).unwrap_or(&Value::Null);
                exact(&e[name], got, &format!("manager.{name}"), line)?;
            }
        }
        "advance" => {
            let (e, a) = f("now_ms")?;
            exact(e, a, "now_ms", line)?;
        }
        "scan" => {
            let (e, a) = f("stalled")?;
            same_set(e, a, "stalled", line)?;
            if exp.contains_key("failed_loads") {
                let (e, a) = f("failed_loads")?;
                same_set(e, a, "failed_loads", line)?;
            }
        }
        "manager.complete_load"
        | "manager.complete_store"
        | "manager.touch"
        | "manager.request_finished"
        | "manager.reset"
        | "add_request"
        | "update_request"
        | "request_finished"
        | "reset"
        | "confirm_cancelled" => {}
        other => {
            return Err(mismatch(
                line,
                format!("expected file has an unknown op {other:?}"),
            ));
        }
    }
    Ok(())
}

fn parse(text: &str, what: &str) -> Result<Vec<Map<String, Value>>, Mismatch> {
    let mut out = Vec::new();
    for (i, s) in text.lines().enumerate() {
        if s.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(s).map_err(|e| Mismatch {
            line: None,
            msg: format!("{what} line {} is not JSON: {e}", i + 1),
        })?;
        match v {
            Value::Object(m) if m.get("line").and_then(Value::as_u64).is_some() => out.push(m),
            _ => {
                return Err(Mismatch {
                    line: None,
                    msg: format!("{what} line {} has no integer \"line\"", i + 1),
                });
            }
        }
    }
    Ok(out)
}

/// Compares a replay's output with the expected output; `Err` at the first difference.
pub fn compare_outputs(expected: &str, actual: &str) -> Result<(), Mismatch> {
    let exp = parse(expected, "expected output")?;
    let act: Vec<_> = parse(actual, "actual output")?
        .into_iter()
        .filter(|a| a["line"].as_u64() != Some(1))
        .collect();
    for (i, e) in exp.iter().enumerate() {
        let line = e["line"].as_u64().unwrap_or(0);
        let Some(a) = act.get(i) else {
            return Err(mismatch(
                line,
                format!("no output line (the output ends after {} lines)", act.len()),
            ));
        };
        if a["line"] != e["line"] {
            return Err(mismatch(
                line,
                format!(
                    "output out of step: got a line for input line {}",
                    a["line"]
                ),
            ));
        }
        compare_line(e, a)?;
    }
    if act.len() > exp.len() {
        let extra = &act[exp.len()];
        return Err(mismatch(
            extra["line"].as_u64().unwrap_or(0),
            "unexpected extra output line",
        ));
    }
    Ok(())
}
