//! Conformance with vLLM 0.33.0: every committed corpus trace replays through
//! the library with outputs equal to vLLM's own answers.
//!
//! The corpora under `tests/conformance/` were produced by vLLM 0.33.0 itself
//! (the oracle scripts; commands and seeds in `docs/conformance.md`, "Commands
//! and seeds"):
//! - `manager/seed*/`: random host-tier traces (LRU and ARC) run on vLLM's
//!   `CPUOffloadingManager`, one folder per generator seed;
//! - `manager_threshold/`: host-tier traces with the reuse filter on
//!   (`store_threshold`, `max_tracker_size`), answered by vLLM's manager;
//! - `connector/seed*/`: serving workloads recorded from vLLM's engine loop
//!   with its real `OffloadingConnector` (sync and async scheduling, world
//!   sizes 1-4 and 8, one and two blocks per chunk, preemptions, resets, LRU
//!   and ARC); `connector/scenarios/`: the recorder's named scenarios;
//! - `connector_amended/seed*/`: workloads with aborted requests
//!   (`request_finished` with `aborted`/`computed_tokens`);
//! - `kvoffload/`: hand-written traces of what vLLM lacks (stalls, quarantine,
//!   late and unknown reports), with expected outputs derived by hand (the
//!   derivation is beside each trace).
//!
//! Nothing here needs Python, vLLM or the oracle scripts: the comparison is Rust
//! (`conformance/compare.rs`, the rules of the oracle's `compare.py`).

#[path = "conformance/compare.rs"]
mod compare;

use std::io::Read;
use std::path::Path;

/// One corpus trace: its name (`<dir>/<seed set>/<stem>`), the trace and
/// vLLM's expected output.
struct Trace {
    name: String,
    trace: String,
    expected: String,
}

/// Every `NAME.trace.jsonl` with its `NAME.expected.jsonl` under
/// `tests/conformance/<dir>` (subfolders included: one per seed set), and
/// those of every packed seed set there (`SET.tar.gz`: a gzipped tar of
/// `SET/NAME.trace.jsonl` and `SET/NAME.expected.jsonl`, for the large
/// generated sets), sorted by name.
fn corpus(dir: &str) -> Vec<Trace> {
    fn walk(root: &Path, rel: &str, out: &mut Vec<Trace>) {
        let here = root.join(rel);
        let entries =
            std::fs::read_dir(&here).unwrap_or_else(|e| panic!("{}: {e}", here.display()));
        for entry in entries {
            let path = entry.expect("directory entry").path();
            let name = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .to_string();
            if path.is_dir() {
                walk(root, &format!("{rel}/{name}"), out);
            } else if name.ends_with(".tar.gz") {
                unpack(&path, rel, out);
            } else if let Some(stem) = name.strip_suffix(".trace.jsonl") {
                let expected = here.join(format!("{stem}.expected.jsonl"));
                assert!(expected.exists(), "{rel}/{stem}: no expected output");
                out.push(Trace {
                    name: format!("{rel}/{stem}"),
                    trace: std::fs::read_to_string(&path).expect("trace"),
                    expected: std::fs::read_to_string(&expected).expect("expected output"),
                });
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/conformance");
    let mut out = Vec::new();
    walk(&root, dir, &mut out);
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The traces of a packed seed set, named as if unpacked under `rel`.
fn unpack(path: &Path, rel: &str, out: &mut Vec<Trace>) {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(file));
    let mut traces = std::collections::BTreeMap::<String, (Option<String>, Option<String>)>::new();
    for entry in archive
        .entries()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    {
        let mut entry = entry.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let inner = entry
            .path()
            .expect("entry path")
            .to_string_lossy()
            .to_string();
        let (stem, is_trace) = if let Some(stem) = inner.strip_suffix(".trace.jsonl") {
            (stem.to_string(), true)
        } else if let Some(stem) = inner.strip_suffix(".expected.jsonl") {
            (stem.to_string(), false)
        } else {
            continue;
        };
        let mut text = String::new();
        entry
            .read_to_string(&mut text)
            .unwrap_or_else(|e| panic!("{}: {inner}: {e}", path.display()));
        let slot = traces.entry(stem).or_default();
        if is_trace {
            slot.0 = Some(text);
        } else {
            slot.1 = Some(text);
        }
    }
    assert!(!traces.is_empty(), "{}: no traces", path.display());
    for (stem, (trace, expected)) in traces {
        let name = format!("{rel}/{stem}");
        out.push(Trace {
            trace: trace.unwrap_or_else(|| panic!("{name}: no trace")),
            expected: expected.unwrap_or_else(|| panic!("{name}: no expected output")),
            name,
        });
    }
}

fn replay(trace: &str) -> Result<String, String> {
    let mut out = Vec::new();
    kvoffload::harness::replay::run(trace.as_bytes(), &mut out).map_err(|e| e.to_string())?;
    String::from_utf8(out).map_err(|e| e.to_string())
}

/// Replays every trace of `dir`; panics with the first difference of each
/// disagreeing trace. Returns the number of traces.
fn check_corpus(dir: &str) -> usize {
    let traces = corpus(dir);
    let mut bad = Vec::new();
    for t in &traces {
        let result = replay(&t.trace).and_then(|got| {
            compare::compare_outputs(&t.expected, &got).map_err(|m| {
                let input = m
                    .line
                    .and_then(|l| t.trace.lines().nth(l as usize - 1).map(str::to_string))
                    .unwrap_or_default();
                format!("line {:?}: {}\n    input: {input}", m.line, m.msg)
            })
        });
        if let Err(e) = result {
            bad.push(format!("{}: {e}", t.name));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} traces in {dir} disagree with vLLM's answers:\n{}",
        bad.len(),
        traces.len(),
        bad.iter().take(10).cloned().collect::<Vec<_>>().join("\n")
    );
    traces.len()
}

#[test]
fn host_tier_agrees_with_vllm_on_every_manager_trace() {
    let n = check_corpus("manager");
    assert!(
        n >= 4200,
        "the host-tier corpus has {n} traces (at least 4200 expected)"
    );
}

/// The reuse filter (`store_threshold`, `max_tracker_size`): host-tier traces
/// replayed on vLLM's manager with the filter on (`scripts/vllm-threshold-oracle.py`).
#[test]
fn reuse_filter_agrees_with_vllm() {
    let n = check_corpus("manager_threshold");
    assert!(
        n >= 926,
        "the reuse-filter corpus has {n} traces (at least 926)"
    );
}

#[test]
fn control_plane_agrees_with_vllm_on_every_engine_loop_trace() {
    let clean = check_corpus("connector");
    let amended = check_corpus("connector_amended");
    // Every committed set is read, the packed ones included (4,318 and 461
    // traces as of the 2026-12-08 widening).
    assert!(
        clean >= 4318 && amended >= 461,
        "the control-plane corpus has {clean} + {amended} traces (at least 4318 + 461 expected)"
    );
}

#[test]
fn stall_extension_matches_its_derived_outputs() {
    let n = check_corpus("kvoffload");
    assert!(n >= 5, "{n} hand-written traces");
}

/// The comparison can fail: a changed slot id, a reordered eviction, a lost
/// event and an unexpected error are all caught.
#[test]
fn the_comparison_catches_differences() {
    let t = corpus("manager")
        .into_iter()
        .find(|t| t.name.ends_with("seed1101/000"))
        .expect("manager/seed1101/000");
    let want = t.expected;
    let got = replay(&t.trace).unwrap();
    compare::compare_outputs(&want, &got).expect("agrees as committed");
    let store_line = got
        .lines()
        .find(|l| l.contains("\"evicted\":[") && !l.contains("\"evicted\":[]"))
        .expect("a store that evicts");
    let mut v: serde_json::Value = serde_json::from_str(store_line).unwrap();
    let evicted = v["evicted"].as_array_mut().unwrap();
    let mutations: Vec<String> = vec![
        store_line.replacen("\"chunk_ids\":[", "\"chunk_ids\":[999,", 1),
        {
            if evicted.len() > 1 {
                evicted.reverse();
            } else {
                evicted.push(serde_json::json!("other"));
            }
            v.to_string()
        },
        store_line.replacen("\"op\":", "\"error\":\"x\",\"op\":", 1),
    ];
    for m in mutations {
        let mutated = got.replacen(store_line, &m, 1);
        assert!(
            compare::compare_outputs(&want, &mutated).is_err(),
            "a mutated line passed: {m}"
        );
    }
    let events_line = got
        .lines()
        .find(|l| l.contains("\"events\":[{"))
        .expect("an events line");
    let dropped = events_line.replacen("\"events\":[{", "\"events\":[{\"stored\":[\"zz\"]},{", 1);
    assert!(compare::compare_outputs(&want, &got.replacen(events_line, &dropped, 1)).is_err());
}
