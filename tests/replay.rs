//! `kvoffload replay`: the example traces give their expected outputs (made
//! by vLLM 0.33.0 or derived by hand, never by kvoffload:
//! `examples/traces/README.md`), compared with the conformance rules; malformed
//! lines exit 2 with `line N: <reason>`; `run_timed` writes what `run` writes
//! and counts the steady steps.

#[path = "conformance/compare.rs"]
mod compare;
#[path = "common/trace_gen.rs"]
mod trace_gen;

use std::path::{Path, PathBuf};
use std::process::Command;

fn traces_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/traces")
}

fn replay_lib(trace: &str) -> Result<String, kvoffload::harness::replay::ReplayError> {
    let mut out = Vec::new();
    kvoffload::harness::replay::run(trace.as_bytes(), &mut out)?;
    Ok(String::from_utf8(out).expect("utf-8 output"))
}

/// Every example trace with its expected output.
fn examples() -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(traces_dir()).expect("examples/traces") {
        let path = entry.expect("entry").path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if !name.ends_with(".jsonl") || name.ends_with(".expected.jsonl") {
            continue;
        }
        let trace = std::fs::read_to_string(&path).expect("trace");
        let expected_path = path.with_extension("expected.jsonl");
        let expected = std::fs::read_to_string(&expected_path)
            .unwrap_or_else(|e| panic!("{}: {e}", expected_path.display()));
        out.push((name, trace, expected));
    }
    out.sort();
    out
}

#[test]
fn example_traces_give_their_independent_expected_outputs() {
    let all = examples();
    for (name, trace, expected) in &all {
        let got = replay_lib(trace).unwrap_or_else(|e| panic!("{name}: {e}"));
        if let Err(m) = compare::compare_outputs(expected, &got) {
            panic!("{name}: line {:?}: {}", m.line, m.msg);
        }
        assert_eq!(replay_lib(trace).unwrap(), got, "{name}: not deterministic");
    }
    assert!(
        all.len() >= 7,
        "expected at least 7 example traces, found {}",
        all.len()
    );
}

/// Each example says where its expected output came from: vLLM, or a
/// derivation by hand beside it (`examples/traces/README.md`).
#[test]
fn every_example_names_the_source_of_its_expected_output() {
    let readme = std::fs::read_to_string(traces_dir().join("README.md")).expect("README.md");
    for (name, _, _) in examples() {
        let stem = name.trim_end_matches(".jsonl");
        let row = readme
            .lines()
            .find(|l| l.starts_with(&format!("| `{stem}` |")))
            .unwrap_or_else(|| panic!("{stem}: no row in examples/traces/README.md"));
        if row.contains("**by hand**") {
            let derivation = traces_dir().join(format!("{stem}.derivation.md"));
            let text = std::fs::read_to_string(&derivation)
                .unwrap_or_else(|e| panic!("{}: {e}", derivation.display()));
            let lines = std::fs::read_to_string(traces_dir().join(&name))
                .unwrap()
                .lines()
                .count();
            // Every operation line is explained (a row may cover a range).
            let last = format!("| {lines} |");
            let last_in_range = format!("-{lines} |");
            assert!(
                text.contains(&last) || text.contains(&last_in_range),
                "{stem}: the derivation does not reach line {lines}"
            );
        } else {
            assert!(row.contains("**vLLM 0.33.0**"), "{stem}: {row}");
        }
    }
}

/// The comparison is not vacuous on the examples: a changed slot or a
/// missing error is caught.
#[test]
fn a_changed_example_output_is_caught() {
    let (_, trace, expected) = examples()
        .into_iter()
        .find(|(n, _, _)| n == "stalled_store.jsonl")
        .expect("stalled_store");
    let got = replay_lib(&trace).unwrap();
    compare::compare_outputs(&expected, &got).expect("agrees as committed");
    let wrong_slot = got.replacen("\"chunk_ids\":[2]", "\"chunk_ids\":[0]", 1);
    assert!(compare::compare_outputs(&expected, &wrong_slot).is_err());
    let no_error = got.replacen(
        "\"error\":\"job0 expects 1 more reports, got 2\"",
        "\"finished_loads\":[],\"failed_loads\":[]",
        1,
    );
    assert_ne!(no_error, got);
    assert!(compare::compare_outputs(&expected, &no_error).is_err());
}

#[test]
fn binary_output_matches_the_library() {
    let path = traces_dir().join("stalled_store.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_kvoffload"))
        .arg("replay")
        .arg(&path)
        .output()
        .expect("run kvoffload");
    assert!(out.status.success());
    let trace = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        replay_lib(&trace).unwrap()
    );
}

const HEADER: &str =
    r#"{"kvoffload_trace": 1, "config": {"tokens_per_block": 4, "num_cpu_chunks": 4}}"#;

fn run_bin(trace: &str) -> (i32, String, String) {
    let dir = tempfile::Builder::new()
        .prefix("kvoffload-replay-")
        .tempdir()
        .expect("create a temporary folder");
    let path = dir.path().join("trace.jsonl");
    std::fs::write(&path, trace).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvoffload"))
        .arg("replay")
        .arg(&path)
        .output()
        .expect("run kvoffload");
    drop(dir);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn malformed_lines_exit_2_with_the_line_number() {
    for (line, reason) in [
        ("{not json", "invalid JSON"),
        (
            r#"{"op": "lookup", "req": "r"}"#,
            "missing field \"computed_tokens\"",
        ),
        (
            r#"{"op": "lookup", "req": 7, "computed_tokens": 0}"#,
            "must be a string",
        ),
        (r#"{"op": "manager.lookup", "keys": [-1]}"#, "keys"),
        (r#"{"op": "teleport"}"#, "unknown op"),
    ] {
        let trace = format!("{HEADER}\n{{\"op\": \"state\"}}\n{line}\n{{\"op\": \"state\"}}\n");
        let (code, stdout, stderr) = run_bin(&trace);
        assert_eq!(code, 2, "{line}");
        assert!(stderr.starts_with("line 3: "), "{line}: {stderr}");
        assert!(stderr.contains(reason), "{line}: {stderr}");
        assert_eq!(
            stdout.lines().count(),
            1,
            "lines before the bad one are written"
        );
    }
    let (code, _, stderr) = run_bin("{\"kvoffload_trace\": 1, \"config\": {\"bogus\": 1}}\n");
    assert_eq!(code, 2);
    assert!(stderr.starts_with("line 1: "), "{stderr}");
}

#[test]
fn rejected_operations_print_an_error_and_change_nothing() {
    let trace = format!(
        "{HEADER}\n{}\n{}\n{}\n{}\n",
        r#"{"op": "manager.prepare_load", "keys": ["nope"]}"#,
        r#"{"op": "worker_output", "completed": {"3": 1}}"#,
        r#"{"op": "lookup", "req": "ghost", "computed_tokens": 0}"#,
        r#"{"op": "state"}"#
    );
    let out = replay_lib(&trace).expect("no malformed line");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4);
    assert!(lines[0].contains(r#""error":"key"#) && lines[0].contains(r#""line":2"#));
    assert!(lines[1].contains(r#""error":"unknown job"#));
    assert!(lines[2].contains(r#""error":"unknown request"#));
    assert!(lines[3].contains(r#""jobs":0"#));
}

#[test]
fn keys_print_in_their_first_form() {
    let trace = format!(
        "{HEADER}\n{}\n{}\n",
        r#"{"op": "manager.prepare_store", "keys": ["5", 6]}"#,
        r#"{"op": "manager.prepare_store", "keys": [5, "6", "x"]}"#
    );
    let out = replay_lib(&trace).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].contains(r#""keys_to_store":["5",6]"#),
        "{}",
        lines[0]
    );
    assert!(
        lines[1].contains(r#""keys_to_store":["x"]"#),
        "{}",
        lines[1]
    );
}

#[test]
fn huge_numbers_are_errors_not_panics() {
    let trace = format!(
        "{HEADER}\n{}\n{}\n{}\n{}\n{}\n",
        r#"{"op": "add_request", "req": "r", "prompt_tokens": 18446744073709551615, "block_hashes": [1]}"#,
        r#"{"op": "lookup", "req": "r", "computed_tokens": 18446744073709551615}"#,
        r#"{"op": "alloc", "req": "r", "block_ids": [1], "external_tokens": 18446744073709551615}"#,
        r#"{"op": "step", "scheduled": [{"req": "r", "new_block_ids": [1], "computed_tokens": 18446744073709551615, "scheduled_tokens": 18446744073709551615}]}"#,
        r#"{"op": "advance", "ms": 18446744073709551615}"#
    );
    let out = replay_lib(&trace).expect("well-formed");
    assert_eq!(out.lines().count(), 5);
    assert!(out.lines().nth(2).unwrap().contains("error"));
}

mod fuzz {
    use kvoffload::harness::sim::SimRng;
    use proptest::prelude::*;

    use super::trace_gen;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        /// Well-formed operations of every kind with small values, in any
        /// order (`tests/common/trace_gen.rs`).
        #[test]
        fn well_formed_traces_never_crash_and_are_deterministic(
            picks in proptest::collection::vec((0..trace_gen::OPS, any::<u64>()), 0..60)
        ) {
            let lines: Vec<String> = picks
                .iter()
                .map(|&(op, seed)| trace_gen::well_formed_op(&mut SimRng::new(seed), op))
                .collect();
            let trace = format!(
                "{}\n{}\n",
                r#"{"kvoffload_trace": 1, "config": {"tokens_per_block": 4, "num_cpu_chunks": 6, "world_size": 2, "stall_timeout_ms": 100000, "stall_scan_interval_ms": 1000}}"#,
                lines.join("\n")
            );
            let mut a = Vec::new();
            kvoffload::harness::replay::run(trace.as_bytes(), &mut a).expect("every line is well formed");
            let mut b = Vec::new();
            kvoffload::harness::replay::run(trace.as_bytes(), &mut b).unwrap();
            prop_assert_eq!(a, b);
        }
    }
}

#[test]
fn manager_lru_example_reproduces_the_reference_scenario() {
    let trace = std::fs::read_to_string(traces_dir().join("manager_lru.jsonl")).unwrap();
    let out = replay_lib(&trace).unwrap();
    let line12 = out
        .lines()
        .find(|l| l.contains(r#""line":12,"#))
        .expect("line 12");
    // vLLM's answer too (manager_lru.expected.jsonl is vLLM's output).
    assert!(
        line12.contains(r#""chunk_ids":[2,0,3],"evicted":[4,5,3]"#),
        "store [6,7,8] evicts [4,5,3] into [2,0,3]: {line12}"
    );
}

#[test]
fn a_load_failed_after_a_reset_is_a_failed_load_not_a_finished_one() {
    let trace = r#"{"kvoffload_trace": 1, "config": {"tokens_per_block": 4, "blocks_per_chunk": 1, "num_cpu_chunks": 8, "world_size": 2}}
{"op": "manager.prepare_store", "keys": [61, 62]}
{"op": "manager.complete_store", "keys": [61, 62]}
{"op": "add_request", "req": "r", "prompt_tokens": 9, "block_hashes": [61, 62]}
{"op": "lookup", "req": "r", "computed_tokens": 0}
{"op": "alloc", "req": "r", "block_ids": [1, 2, 3], "external_tokens": 8}
{"op": "step", "scheduled": []}
{"op": "worker_output", "completed": {"0": 1}, "failed": [0]}
{"op": "reset"}
{"op": "step", "scheduled": []}
{"op": "worker_output", "completed": {"0": 1}}
"#;
    let out = replay_lib(trace).unwrap();
    let last = out.lines().last().unwrap();
    assert_eq!(
        last, r#"{"line":11,"op":"worker_output","finished_loads":[],"failed_loads":["r"]}"#,
        "the failure reported before the reset must survive it"
    );
    let after = trace.replace(
        "{\"op\": \"worker_output\", \"completed\": {\"0\": 1}, \"failed\": [0]}\n{\"op\": \"reset\"}",
        "{\"op\": \"reset\"}\n{\"op\": \"worker_output\", \"completed\": {\"0\": 1}, \"failed\": [0]}",
    );
    let out = replay_lib(&after).unwrap();
    assert!(
        out.lines()
            .last()
            .unwrap()
            .contains(r#""failed_loads":["r"]"#),
        "{out}"
    );
}

/// A decode workload (as `scripts/gen-decode-trace.py` writes, smaller):
/// `requests` requests prefilled in one step, then `steps` decode steps of one
/// token each; request r's prompt is 8 + r mod 4 tokens (blocks of 4), so the
/// requests fill their blocks staggered; the stores of each step are completed
/// by a `worker_output` after it (job ids predicted: sequential, in list order).
fn decode_trace(requests: u64, steps: u64) -> String {
    let mut t = String::from(
        r#"{"kvoffload_trace": 1, "config": {"tokens_per_block": 4, "blocks_per_chunk": 1, "num_cpu_chunks": 4096, "offload_prompt_only": false}}"#,
    );
    t.push('\n');
    let prompt = |r: u64| 8 + r % 4;
    let mut tables: Vec<Vec<u64>> = Vec::new();
    let mut next_block = 1;
    for r in 0..requests {
        let table: Vec<u64> = (next_block..next_block + 3).collect();
        next_block += 3;
        t += &format!(
            "{{\"op\":\"add_request\",\"req\":\"r{r}\",\"prompt_tokens\":{},\"block_hashes\":[\"r{r}-0\",\"r{r}-1\"]}}\n",
            prompt(r)
        );
        t += &format!("{{\"op\":\"lookup\",\"req\":\"r{r}\",\"computed_tokens\":0}}\n");
        t += &format!(
            "{{\"op\":\"alloc\",\"req\":\"r{r}\",\"block_ids\":{table:?},\"external_tokens\":0}}\n"
        );
        tables.push(table);
    }
    let scheduled: Vec<String> = (0..requests)
        .map(|r| {
            format!(
                "{{\"req\":\"r{r}\",\"new_block_ids\":{:?},\"computed_tokens\":0,\"scheduled_tokens\":{}}}",
                tables[r as usize],
                prompt(r)
            )
        })
        .collect();
    t += &format!(
        "{{\"op\":\"step\",\"scheduled\":[{}]}}\n",
        scheduled.join(",")
    );
    let completed = |jobs: std::ops::Range<u64>| {
        jobs.map(|j| format!("\"{j}\":1"))
            .collect::<Vec<_>>()
            .join(",")
    };
    t += &format!(
        "{{\"op\":\"worker_output\",\"completed\":{{{}}}}}\n",
        completed(0..requests)
    );
    let mut next_job = requests;
    for k in 1..=steps {
        let first_job = next_job;
        let mut scheduled = Vec::new();
        for r in 0..requests {
            let n = prompt(r) + k;
            let hashes = if n % 4 == 0 {
                next_job += 1;
                format!(",\"block_hashes\":[\"r{r}-{}\"]", n / 4 - 1)
            } else {
                String::new()
            };
            t += &format!(
                "{{\"op\":\"update_request\",\"req\":\"r{r}\",\"num_tokens\":{n}{hashes}}}\n"
            );
            let table = &mut tables[r as usize];
            let new_block = if (n - 1) / 4 >= table.len() as u64 {
                table.push(next_block);
                next_block += 1;
                format!(",\"new_block_ids\":[{}]", next_block - 1)
            } else {
                String::new()
            };
            scheduled.push(format!(
                "{{\"req\":\"r{r}\"{new_block},\"computed_tokens\":{},\"scheduled_tokens\":1}}",
                n - 1
            ));
        }
        t += &format!(
            "{{\"op\":\"step\",\"scheduled\":[{}]}}\n",
            scheduled.join(",")
        );
        t += &format!(
            "{{\"op\":\"worker_output\",\"completed\":{{{}}}}}\n",
            completed(first_job..next_job)
        );
    }
    t += "{\"op\":\"state\"}\n";
    t
}

#[test]
fn run_timed_writes_what_run_writes_and_times_the_steady_steps() {
    let trace = decode_trace(8, 40);
    let plain = replay_lib(&trace).unwrap();
    assert!(!plain.contains("\"error\""), "{plain}");
    assert!(plain.lines().last().unwrap().contains("\"jobs\":0,"));
    let stores = plain.matches("\"job\":").count();
    assert!(stores > 8 + 40, "decode steps store: {stores}");
    let mut out = Vec::new();
    let t = kvoffload::harness::replay::run_timed(trace.as_bytes(), &mut out).unwrap();
    assert_eq!(String::from_utf8(out).unwrap(), plain);
    // The prefill step has lookups and allocs; the 40 decode steps are steady.
    assert_eq!(t.steps, 41);
    assert_eq!(
        t.steady_steps,
        40 - kvoffload::harness::replay::WARMUP_STEADY_STEPS
    );
    let e = t.engine_us.expect("steady steps after the warm-up");
    assert!(e.p50 > 0.0 && e.p50 <= e.p90 && e.p90 <= e.p99, "{e:?}");
    assert!(e.mean > 0.0 && e.mean.is_finite(), "{e:?}");
    let json: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap();
    assert_eq!(json["steps"], 41);
    assert_eq!(json["engine_us"]["p99"], e.p99);

    // A trace without steady steps after the warm-up: `engine_us` is null.
    let short = decode_trace(2, 16);
    let mut out = Vec::new();
    let t = kvoffload::harness::replay::run_timed(short.as_bytes(), &mut out).unwrap();
    assert_eq!((t.steps, t.steady_steps, t.engine_us), (17, 0, None));
    assert!(t.to_json().ends_with(r#""engine_us":null}"#));
}

#[test]
fn a_sync_load_budget_shows_in_the_lookup_and_the_step() {
    // Budget 8 tokens (one byte each); r2's 8-token hit of its 9 is sync.
    let header = r#"{"kvoffload_trace": 1, "config": {"tokens_per_block": 4, "num_cpu_chunks": 4, "offload_prompt_only": false, "sync_load_budget_bytes": 8, "sync_load_bytes_per_token": 1}}"#;
    let ops = [
        r#"{"op": "add_request", "req": "r1", "prompt_tokens": 8, "block_hashes": [11, 12]}"#,
        r#"{"op": "lookup", "req": "r1", "computed_tokens": 0}"#,
        r#"{"op": "alloc", "req": "r1", "block_ids": [1, 2], "external_tokens": 0}"#,
        r#"{"op": "step", "scheduled": [{"req": "r1", "new_block_ids": [1, 2], "computed_tokens": 0, "scheduled_tokens": 8}]}"#,
        r#"{"op": "worker_output", "completed": {"0": 1}}"#,
        r#"{"op": "add_request", "req": "r2", "prompt_tokens": 9, "block_hashes": [11, 12]}"#,
        r#"{"op": "lookup", "req": "r2", "computed_tokens": 0}"#,
        r#"{"op": "alloc", "req": "r2", "block_ids": [5, 6, 7], "external_tokens": 8}"#,
        r#"{"op": "step", "scheduled": [{"req": "r2", "new_block_ids": [5, 6, 7], "computed_tokens": 8, "scheduled_tokens": 1}]}"#,
    ];
    let out = replay_lib(&format!("{header}\n{}\n", ops.join("\n"))).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        !lines[1].contains("sync"),
        "r1's lookup finds nothing: {}",
        lines[1]
    );
    assert!(
        lines[6].contains(r#""hit_tokens":8"#) && lines[6].contains(r#""sync":true"#),
        "{}",
        lines[6]
    );
    assert!(lines[8].contains(r#""sync_loads":[1]"#), "{}", lines[8]);
    assert!(
        !lines[3].contains("sync_loads"),
        "a step without one prints none: {}",
        lines[3]
    );
}
