//! The `kvoffload` binary: sim (summary, report, record), config validation
//! errors (exit 2, key and allowed range named), bench (table, JSON, CSV, SVG), info,
//! and the CUDA backend of sim and bench (without a driver: exit 2 with
//! `cuda backend unavailable: <reason>`; with a GPU: a short run), and
//! `replay --timing` (stdout unchanged, the timing file, exit 2 when unwritable).

use std::path::PathBuf;
use std::process::{Command, Output};

#[path = "common/scratch.rs"]
mod scratch;
use scratch::{ScratchPath, scratch};

/// The binary under test: `KVOFFLOAD_BIN` where set (a carried test binary on
/// another machine, `scripts/gpu-check.sh run`), else the one cargo built.
fn kvoffload(args: &[&str]) -> Output {
    let bin = std::env::var_os("KVOFFLOAD_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_kvoffload")),
        PathBuf::from,
    );
    Command::new(bin)
        .args(args)
        .output()
        .expect("run kvoffload")
}

fn tmp(name: &str) -> ScratchPath {
    scratch(name)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn sim_prints_the_summary_writes_the_report_and_a_replayable_trace() {
    let report = tmp("report.json");
    let trace = tmp("trace.jsonl");
    let out = kvoffload(&[
        "sim",
        "--requests",
        "80",
        "--seed",
        "9",
        "--report",
        report.to_str().unwrap(),
        "--record",
        trace.to_str().unwrap(),
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        !text(&out.stderr).contains('\r'),
        "no progress bar when not a terminal"
    );
    for line in [
        "requests finished / created",
        "prefix hit rate without offload",
        "prefix hit rate with offload",
        "stalls detected",
        "failed loads recomputed",
        "scheduler time per step",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in\n{stdout}");
    }
    assert!(
        stdout.contains("leaks after drain                0\n"),
        "{stdout}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(json["seed"], 9);
    assert_eq!(json["work"]["finished"], 80);
    assert_eq!(json["leaks"]["total"], 0);
    assert!(json["step_time"]["p99_us"].as_f64().unwrap() > 0.0);
    // The trace replays, and its last line (state) shows nothing left.
    let replay = kvoffload(&["replay", trace.to_str().unwrap()]);
    assert!(replay.status.success());
    let last = text(&replay.stdout).lines().last().unwrap().to_string();
    let last: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert_eq!(last["op"], "state");
    assert_eq!(last["jobs"], 0);
    assert_eq!(last["has_pending_work"], false);
}

/// The content check is on by default (its counts in the summary and the
/// report, 0 mismatches) and `--no-content-check` turns it off without
/// changing any decision.
#[test]
fn sim_content_check_is_reported_and_can_be_turned_off() {
    let run = |extra: &[&str], name: &str| {
        let report = tmp(name);
        let mut args = vec![
            "sim",
            "--requests",
            "80",
            "--seed",
            "4",
            "--report",
            report.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let out = kvoffload(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        (text(&out.stdout), json)
    };
    let (stdout, on) = run(&[], "content-on.json");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("  content check "))
        .unwrap_or_else(|| panic!("no content check line in\n{stdout}"));
    assert!(line.ends_with("; 0 mismatches"), "{line}");
    let c = &on["content"];
    assert_eq!(c["enabled"], true);
    assert!(c["blocks_checked"].as_u64().unwrap() > 0, "{c}");
    assert!(c["loaded_checked"].as_u64().unwrap() > 0, "{c}");
    assert!(c["blocks_written"].as_u64().unwrap() > 0, "{c}");
    assert_eq!(c["mismatches"], 0);
    assert_eq!(c["first_mismatches"], serde_json::json!([]));
    let (stdout, off) = run(&["--no-content-check"], "content-off.json");
    assert!(
        stdout.contains("  content check                    off\n"),
        "{stdout}"
    );
    assert_eq!(off["content"]["enabled"], false);
    assert_eq!(off["content"]["blocks_checked"], 0);
    for k in ["work", "faults", "steps", "leaks"] {
        assert_eq!(on[k], off[k], "{k}");
    }
}

#[test]
fn sim_with_a_sync_load_budget_counts_its_synchronous_loads() {
    let report = tmp("sync.json");
    let out = kvoffload(&[
        "sim",
        "--requests",
        "120",
        "--sync-load-budget",
        "1000000000",
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("  synchronous loads "), "{stdout}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let w = &json["work"];
    assert!(w["sync_loads"].as_u64().unwrap() > 0, "{w}");
    assert_eq!(w["sync_loaded_tokens"], w["loaded_tokens"], "{w}");
    assert_eq!(json["content"]["mismatches"], 0);
    // Without the flag no line, and a budget without bytes per token in a
    // config file takes the sim's.
    let plain = kvoffload(&["sim", "--requests", "40"]);
    assert!(!text(&plain.stdout).contains("synchronous loads"));
    let cfg = tmp("sync.toml");
    std::fs::write(&cfg, "sync_load_budget_bytes = 1000000000\n").unwrap();
    let out = kvoffload(&["sim", "--requests", "40", "--config", cfg.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("  synchronous loads "));
}

#[test]
fn sim_with_replicated_workers_says_so_and_stores_one_copy() {
    let run = |replicated: bool| {
        let report = tmp(&format!("replicated-{replicated}.json"));
        let mut args = vec![
            "sim",
            "--requests",
            "120",
            "--no-faults",
            "--report",
            report.to_str().unwrap(),
        ];
        if replicated {
            args.push("--replicated");
        }
        let out = kvoffload(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let stdout = text(&out.stdout);
        assert_eq!(
            stdout.contains("(same KV: one copy, stores by turns)"),
            replicated,
            "{stdout}"
        );
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        assert_eq!(r["replicated"], replicated);
        assert_eq!(r["content"]["mismatches"], 0);
        assert_eq!(r["leaks"]["total"], 0);
        r
    };
    let same = run(true);
    let own = run(false);
    // Two workers (the sim's default): one copy of each chunk, not two.
    let stored = |r: &serde_json::Value| r["transfers"]["bytes_stored"].as_u64().unwrap();
    assert!(stored(&same) > 0);
    assert_eq!(2 * stored(&same), stored(&own));
}

/// The first NUMA node online here (sysfs), as text.
fn first_numa_node() -> String {
    let online =
        std::fs::read_to_string("/sys/devices/system/node/online").unwrap_or_else(|_| "0".into());
    let first = online.trim().split([',', '-']).next().unwrap_or("0");
    first.to_string()
}

#[test]
fn sim_reports_where_the_host_pool_was_placed_and_refuses_a_node_not_online() {
    let report = tmp("numa.json");
    let node = first_numa_node();
    let args = |numa: &str| {
        kvoffload(&[
            "sim",
            "--requests",
            "40",
            "--numa",
            numa,
            "--report",
            report.to_str().unwrap(),
        ])
    };
    let out = args(&node);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("host pool NUMA placement"))
        .unwrap_or_else(|| panic!("no placement line: {stdout}"));
    // Every sampled page of the pool is on the node asked for.
    let tail = line
        .split(&format!("node {node} (asked for): "))
        .nth(1)
        .expect(line);
    let (there, rest) = tail.split_once(" of ").expect(line);
    let sampled = rest.split(' ').next().unwrap();
    assert_eq!(there, sampled, "{line}");
    assert!(there.parse::<u64>().unwrap() > 0, "{line}");
    // Every worker's two copy threads run on the node's CPUs.
    let (on, of) = line
        .split_once("host copy threads on its CPUs: ")
        .expect(line)
        .1
        .split_once(" of ")
        .expect(line);
    assert_eq!(on, of, "{line}");
    assert!(of.parse::<u64>().unwrap() >= 2, "{line}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(
        r["host_placement"].as_str().unwrap(),
        line.split_once("placement").unwrap().1.trim()
    );
    // The host backend has no GPU: `auto` (the default) does not place.
    let auto = kvoffload(&["sim", "--requests", "40"]);
    assert!(
        text(&auto.stdout).contains("not placed (no GPU to place it near)"),
        "{}",
        text(&auto.stdout)
    );
    let far = args("1023");
    assert_eq!(far.status.code(), Some(1));
    assert!(
        text(&far.stderr).contains("NUMA node 1023 is not online (online: "),
        "{}",
        text(&far.stderr)
    );
    let bad = args("near");
    assert_eq!(bad.status.code(), Some(2));
    assert_eq!(
        text(&bad.stderr),
        "kvoffload sim: NUMA placement \"near\": expected auto, off or a node number\n"
    );
}

#[test]
fn sim_same_seed_same_report_counts() {
    let run = |seed: &str| {
        let out = kvoffload(&["sim", "--requests", "60", "--seed", seed]);
        assert!(out.status.success());
        // Drop the lines with wall-clock figures.
        text(&out.stdout)
            .lines()
            .filter(|l| !l.contains("wall") && !l.contains("per step") && !l.contains("GB/s"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(run("5"), run("5"));
}

#[test]
fn invalid_config_values_are_reported_by_name_with_range_exit_2() {
    let bad = tmp("bad.toml");
    std::fs::write(&bad, "num_cpu_chunks = 64\nworld_size = 0\n").unwrap();
    let out = kvoffload(&["sim", "--config", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("world_size = 0") && err.contains("1..=4096"),
        "{err}"
    );

    // A flag overrides the file and is validated the same way.
    let good = tmp("good.json");
    std::fs::write(&good, r#"{"num_cpu_chunks": 256, "stall_timeout_ms": 300}"#).unwrap();
    let out = kvoffload(&[
        "sim",
        "--config",
        good.to_str().unwrap(),
        "--world-size",
        "5000",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("world_size = 5000"));

    let unknown = tmp("unknown.toml");
    std::fs::write(&unknown, "num_cpu_chunk = 64\n").unwrap();
    let out = kvoffload(&["sim", "--config", unknown.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("num_cpu_chunk"),
        "{}",
        text(&out.stderr)
    );

    let out = kvoffload(&["sim", "--gpu-blocks", "2"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("gpu_blocks = 2 is out of range"));

    let out = kvoffload(&["sim", "--metrics-addr", "not-an-address", "--requests", "5"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("metrics address not-an-address"));

    let out = kvoffload(&["sim", "--backend", "tpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("allowed host, cuda"));

    // A valid file runs.
    let out = kvoffload(&[
        "sim",
        "--config",
        good.to_str().unwrap(),
        "--requests",
        "30",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn bench_json_csv_and_plot() {
    let csv = tmp("bench.csv");
    let svg = tmp("bench.svg");
    let out = kvoffload(&[
        "bench",
        "--json",
        "--block-bytes",
        "4096,16384",
        "--blocks",
        "8",
        "--bytes-per-point",
        "262144",
        "--csv",
        csv.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let host = rows.iter().filter(|r| r["backend"] == "host").count();
    assert_eq!(host, 4, "2 sizes x 1 count x 2 directions");
    for r in rows.iter().filter(|r| r["backend"] == "host") {
        for k in [
            "backend",
            "strategy",
            "direction",
            "block_bytes",
            "blocks",
            "gbps",
            "fraction_of_ceiling",
        ] {
            assert!(r.get(k).is_some(), "missing {k}");
        }
        assert_eq!(r["backend"], "host");
        let g = r["gbps"].as_f64().unwrap();
        let c = r["ceiling_gbps"].as_f64().unwrap();
        assert!(g > 0.0 && c > 0.0);
        let f = r["fraction_of_ceiling"].as_f64().unwrap();
        assert!((f - g / c).abs() < 1e-9);
    }
    // The default (all backends): host rows, and the CUDA sweep where a GPU is.
    if let Some(reason) = cuda_unavailable() {
        let skips: Vec<String> = text(&out.stderr)
            .lines()
            .filter(|l| l.contains("SKIP"))
            .map(str::to_string)
            .collect();
        assert_eq!(skips, vec![format!("SKIP: cuda: {reason}")]);
    }
    let csv = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(csv.lines().count(), rows.len() + 1);
    assert!(csv.starts_with("backend,strategy,direction,block_bytes,blocks,gbps"));
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<polyline"));
    // The table form.
    let out = kvoffload(&[
        "bench",
        "--backend",
        "host",
        "--block-bytes",
        "4096",
        "--blocks",
        "4",
        "--bytes-per-point",
        "65536",
    ]);
    assert!(out.status.success());
    assert!(text(&out.stdout).contains("fraction"));
    let out = kvoffload(&["bench", "--blocks", "0"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn info_and_help_still_work() {
    let out = kvoffload(&["info"]);
    assert!(out.status.success());
    let stdout = text(&out.stdout);
    assert!(stdout.contains("CUDA kernels"));
    // The machine's NUMA nodes, and its GPUs (none without a driver).
    assert!(
        stdout.contains(&format!("NUMA node {}: ", first_numa_node())),
        "{stdout}"
    );
    if let Some(reason) = cuda_unavailable() {
        assert!(
            stdout.contains(&format!("GPUs: none ({reason})")),
            "{stdout}"
        );
    } else {
        assert!(stdout.contains("GPU 0: "), "{stdout}");
    }
    let out = kvoffload(&["--help"]);
    assert!(out.status.success());
    for c in ["sim", "bench", "replay", "info"] {
        assert!(text(&out.stdout).contains(c));
    }
}

fn example_trace(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("examples/traces")
        .join(name)
}

/// The `--timing` file, parsed, with its fields checked for shape and order.
fn read_timing(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let obj = json.as_object().expect("an object");
    assert_eq!(obj.len(), 3, "{text}");
    assert!(json["steps"].is_u64(), "{text}");
    assert!(json["steady_steps"].is_u64(), "{text}");
    assert!(
        json["steady_steps"].as_u64() <= json["steps"].as_u64(),
        "{text}"
    );
    match &json["engine_us"] {
        serde_json::Value::Null => assert_eq!(json["steady_steps"], 0, "{text}"),
        e => {
            let f = |k: &str| e[k].as_f64().unwrap_or_else(|| panic!("{k} in {text}"));
            assert!(json["steady_steps"].as_u64() > Some(0), "{text}");
            assert!(0.0 <= f("p50") && f("p50") <= f("p90") && f("p90") <= f("p99"));
            assert!(f("mean").is_finite() && f("mean") >= 0.0, "{text}");
        }
    }
    json
}

#[test]
fn replay_timing_leaves_stdout_unchanged_and_writes_the_step_counts() {
    let trace = example_trace("preemption.jsonl");
    let trace = trace.to_str().unwrap();
    let plain = kvoffload(&["replay", trace]);
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    let steps = std::fs::read_to_string(trace)
        .unwrap()
        .lines()
        .filter(|l| serde_json::from_str::<serde_json::Value>(l).is_ok_and(|v| v["op"] == "step"))
        .count() as u64;
    assert!(steps > 0);
    // The flag after the trace, then before it: the same stdout either way.
    let after = tmp("timing-after.json");
    let before = tmp("timing-before.json");
    for out in [
        kvoffload(&["replay", trace, "--timing", after.to_str().unwrap()]),
        kvoffload(&["replay", "--timing", before.to_str().unwrap(), trace]),
    ] {
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert_eq!(text(&out.stdout), text(&plain.stdout));
        assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    }
    for path in [&after, &before] {
        let json = read_timing(path);
        assert_eq!(json["steps"], steps);
    }
}

#[test]
fn replay_timing_reports_the_steady_steps_after_the_warm_up() {
    // 40 steps, each followed by its worker_output: all steady; the first 16
    // are the warm-up.
    let mut trace = String::from(
        r#"{"kvoffload_trace": 1, "config": {"tokens_per_block": 4, "num_cpu_chunks": 8}}"#,
    );
    trace.push('\n');
    for _ in 0..40 {
        trace.push_str("{\"op\": \"step\", \"scheduled\": []}\n");
        trace.push_str("{\"op\": \"worker_output\", \"completed\": {}}\n");
    }
    let path = tmp("steady.jsonl");
    std::fs::write(&path, trace).unwrap();
    let timing = tmp("steady-timing.json");
    let out = kvoffload(&[
        "replay",
        path.to_str().unwrap(),
        "--timing",
        timing.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).lines().count(), 80);
    let json = read_timing(&timing);
    assert_eq!(json["steps"], 40);
    assert_eq!(json["steady_steps"], 24);
    assert!(json["engine_us"].is_object());
}

#[test]
fn replay_timing_to_an_unwritable_file_exits_2_before_replaying() {
    let trace = example_trace("preemption.jsonl");
    let bad = tmp("no-such-dir").join("timing.json");
    let out = kvoffload(&[
        "replay",
        trace.to_str().unwrap(),
        "--timing",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty(), "nothing replayed");
    let err = text(&out.stderr);
    assert!(
        err.starts_with("kvoffload replay: --timing ") && err.contains(bad.to_str().unwrap()),
        "{err}"
    );
    // A directory is not writable as a file either.
    let dir = tmp("");
    let out = kvoffload(&[
        "replay",
        trace.to_str().unwrap(),
        "--timing",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    // A malformed trace: exit 2 as before, and no timing file is left behind.
    let malformed = tmp("malformed.jsonl");
    std::fs::write(
        &malformed,
        "{\"kvoffload_trace\": 1, \"config\": {\"num_cpu_chunks\": 8}}\n{not json\n",
    )
    .unwrap();
    let timing = tmp("malformed-timing.json");
    let out = kvoffload(&[
        "replay",
        malformed.to_str().unwrap(),
        "--timing",
        timing.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).starts_with("line 2: "));
    assert!(!timing.exists());
}

/// Why the CUDA backend cannot run in this process, or `None` where it can.
fn cuda_unavailable() -> Option<String> {
    kvoffload::worker::cuda::open_context(0)
        .err()
        .map(|e| e.to_string())
}

/// The reason a `gpu_*` test run without a usable GPU (`--ignored` on a
/// machine without one) returns early, printed; `None` where the GPU is.
fn gpu_missing(test: &str) -> Option<String> {
    let reason = cuda_unavailable()?;
    println!("SKIP: {reason} [{test}]");
    Some(reason)
}

fn sim_on_cuda(report: &std::path::Path) -> Output {
    kvoffload(&[
        "sim",
        "--backend",
        "cuda",
        "--requests",
        "60",
        "--report",
        report.to_str().unwrap(),
    ])
}

#[test]
#[cfg_attr(kvoffload_gpu, ignore = "checks the no-driver path: a driver is here")]
fn sim_on_the_cuda_backend_without_a_driver_is_one_line_and_exit_2() {
    let Some(reason) = cuda_unavailable() else {
        println!("SKIP: a driver is present [the no-driver path of sim --backend cuda]");
        return;
    };
    let out = sim_on_cuda(&tmp("cuda-report-no-driver.json"));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stderr),
        format!("kvoffload sim: cuda backend unavailable: {reason}\n"),
        "one line, no panic"
    );
    assert!(out.stdout.is_empty());
}

#[test]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_sim_on_the_cuda_backend_ends_with_no_leaks() {
    if gpu_missing("gpu_sim_on_the_cuda_backend_ends_with_no_leaks").is_some() {
        return;
    }
    let report = tmp("cuda-report.json");
    let out = sim_on_cuda(&report);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["backend"], "cuda");
    assert_eq!(r["leaks"]["total"], 0, "{r}");
    assert!(text(&out.stdout).contains("leaks after drain                0"));
    // The pinned pool's placement is reported (the GPU's node where the
    // machine has several, else why not), with where its pages are.
    let placement = r["host_placement"].as_str().unwrap();
    assert!(placement.contains("sampled pages"), "{placement}");
}

/// The counters of a sim report that follow from its decisions alone (no
/// wall-clock figure, no backend name).
fn decision_counters(r: &serde_json::Value) -> serde_json::Value {
    let t = &r["transfers"];
    let c = &r["content"];
    serde_json::json!({
        "steps": r["steps"],
        "work": r["work"],
        "faults": r["faults"],
        "leaks": r["leaks"],
        "transfers": [t["bytes_stored"], t["bytes_loaded"], t["store_jobs"], t["load_jobs"]],
        "content": [c["blocks_written"], c["blocks_checked"], c["loaded_checked"],
                    c["prefix_hits_checked"]],
    })
}

/// The CUDA backend moves the same bytes as the host backend: the same seed
/// and options run on both with the content check (blocks written with a
/// pattern of their hash on the device, loads and GPU prefix hits compared
/// with it) and no mismatch, and every decision counter agrees.
#[test]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_sim_on_cuda_moves_the_same_bytes_as_on_host() {
    if gpu_missing("gpu_sim_on_cuda_moves_the_same_bytes_as_on_host").is_some() {
        return;
    }
    let run = |backend: &str| {
        let report = tmp(&format!("same-bytes-{backend}.json"));
        let out = kvoffload(&[
            "sim",
            "--backend",
            backend,
            "--requests",
            "120",
            "--seed",
            "3",
            "--report",
            report.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{backend}: {}\n{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        assert_eq!(r["backend"], backend);
        let c = &r["content"];
        assert_eq!(c["enabled"], true, "{backend}: {c}");
        assert!(c["blocks_checked"].as_u64().unwrap() > 0, "{backend}: {c}");
        assert!(c["loaded_checked"].as_u64().unwrap() > 0, "{backend}: {c}");
        assert_eq!(c["mismatches"], 0, "{backend}: {c}");
        r
    };
    let cuda = run("cuda");
    let host = run("host");
    assert_eq!(decision_counters(&cuda), decision_counters(&host));
}

#[test]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_sim_on_cuda_with_replicated_workers_loads_the_model_s_bytes() {
    if gpu_missing("gpu_sim_on_cuda_with_replicated_workers_loads_the_model_s_bytes").is_some() {
        return;
    }
    // Two workers over one pinned pool, writing it by turns of host chunk:
    // each loads the chunks the other wrote (the content check).
    let report = tmp("replicated-cuda.json");
    let out = kvoffload(&[
        "sim",
        "--backend",
        "cuda",
        "--replicated",
        "--requests",
        "120",
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["replicated"], true);
    assert!(r["content"]["loaded_checked"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["content"]["mismatches"], 0, "{r}");
    assert_eq!(r["leaks"]["total"], 0, "{r}");
}

#[test]
fn sim_on_the_cuda_backend_refuses_a_bad_strategy_table_by_name() {
    // Whatever the machine: the table is read before the device is opened.
    let bad = tmp("bad-table.json");
    std::fs::write(&bad, r#"{"rules":[],"fallback":"warp"}"#).unwrap();
    let out = kvoffload(&[
        "sim",
        "--backend",
        "cuda",
        "--strategy-table",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("bad-table.json") && text(&out.stderr).contains("warp"));
}

const CUDA_BENCH: [&str; 9] = [
    "bench",
    "--backend",
    "cuda",
    "--json",
    "--quick",
    "--block-bytes",
    "16384",
    "--blocks",
    "64",
];

fn calibrate_into(table: &std::path::Path) -> Output {
    kvoffload(&[
        "bench",
        "--quick",
        "--block-bytes",
        "16384,1048576",
        "--blocks",
        "64",
        "--calibrate",
        table.to_str().unwrap(),
    ])
}

#[test]
#[cfg_attr(kvoffload_gpu, ignore = "checks the no-driver path: a driver is here")]
fn bench_on_the_cuda_backend_without_a_driver_is_one_line_and_writes_nothing() {
    let Some(reason) = cuda_unavailable() else {
        println!("SKIP: a driver is present [the no-driver path of bench --backend cuda]");
        return;
    };
    let table = tmp("calibrated-no-driver.json");
    let _ = std::fs::remove_file(&table);
    let line = format!("kvoffload bench: cuda backend unavailable: {reason}\n");
    for o in [&kvoffload(&CUDA_BENCH), &calibrate_into(&table)] {
        assert_eq!(o.status.code(), Some(2));
        assert_eq!(text(&o.stderr), line);
        assert!(o.stdout.is_empty());
    }
    assert!(!table.exists(), "nothing written without a GPU");
}

#[test]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_bench_on_the_cuda_backend_and_calibrate() {
    if gpu_missing("gpu_bench_on_the_cuda_backend_and_calibrate").is_some() {
        return;
    }
    let table = tmp("calibrated.json");
    let _ = std::fs::remove_file(&table);
    let out = kvoffload(&CUDA_BENCH);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        rows.len(),
        16,
        "4 strategies x 2 directions x (cross-layer, 16 tensors)"
    );
    for r in &rows {
        assert_eq!(r["backend"], "cuda");
        assert!(r["tensors"] == 1 || r["tensors"] == 16, "{r}");
        assert_eq!(
            r["verified_bytes"],
            16384 * 64,
            "every row's bytes checked: {r}"
        );
        let g = r["gbps"].as_f64().unwrap();
        let c = r["ceiling_gbps"].as_f64().unwrap();
        assert!(g > 0.0 && c > 0.0, "{r}");
        let f = r["fraction_of_ceiling"].as_f64().unwrap();
        assert!((f - g / c).abs() < 1e-9);
    }
    for s in ["dma", "batch_dma", "kernel", "kernel_graph"] {
        for d in ["store", "load"] {
            assert!(
                rows.iter()
                    .any(|r| r["strategy"] == s && r["direction"] == d)
            );
        }
    }
    let calibrate = calibrate_into(&table);
    assert!(calibrate.status.success(), "{}", text(&calibrate.stderr));
    assert!(
        text(&calibrate.stderr).contains("swapped into running backends"),
        "the calibrated table is swapped into live backends: {}",
        text(&calibrate.stderr)
    );
    let t = kvoffload::worker::cuda::StrategyTable::load(&table).unwrap();
    assert!(!t.rules.is_empty());
}

#[test]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_bench_under_contention_with_launch_shapes_prefer_overlap_and_ring_depths() {
    if gpu_missing("gpu_bench_under_contention_with_launch_shapes_prefer_overlap_and_ring_depths")
        .is_some()
    {
        return;
    }
    let out = kvoffload(&[
        "bench",
        "--backend",
        "cuda",
        "--json",
        "--quick",
        "--block-bytes",
        "65536",
        "--blocks",
        "64",
        "--tensors",
        "1",
        "--contend",
        "--sweep-launch",
        "--sweep-batch-overlap",
        "--sweep-ring",
    ]);
    let stderr = text(&out.stderr);
    println!("{stderr}");
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let (ring, rows): (Vec<_>, Vec<_>) = rows.into_iter().partition(|r| {
        r.get("launch")
            .and_then(|l| l.as_str())
            .is_some_and(|l| l.starts_with("ring="))
    });
    assert_eq!(ring.len(), 8, "4 ring depths x 2 directions");
    for r in &ring {
        assert_eq!(r["strategy"], "kernel_graph", "{r}");
        assert_eq!(r["verified_bytes"], 65536 * 64, "{r}");
        assert!(r["gbps"].as_f64().is_some_and(|g| g > 0.0), "{r}");
    }
    let (shaped, plain): (Vec<_>, Vec<_>) = rows.iter().partition(|r| r.get("launch").is_some());
    assert_eq!(plain.len(), 8, "4 strategies x 2 directions");
    assert_eq!(
        shaped.len(),
        24,
        "12 launch shapes x 2 directions, kernel only"
    );
    for r in &rows {
        assert_eq!(r["verified_bytes"], 65536 * 64, "{r}");
        let g = r["contended_gbps"].as_f64().unwrap_or(0.0);
        assert!(g > 0.0, "a rate under contention: {r}");
        assert!(
            r["compute_slowdown"].as_f64().is_some_and(f64::is_finite),
            "{r}"
        );
    }
    for r in &shaped {
        if r["launch"] == "prefer_overlap" {
            assert_eq!(r["strategy"], "batch_dma", "{r}");
        } else {
            assert_eq!(r["strategy"], "kernel", "{r}");
        }
    }
    assert!(stderr.contains("fastest kernel launch"), "{stderr}");
}

#[test]
fn bench_refuses_zero_tensors_and_a_negative_slowdown_by_name() {
    for (args, name) in [
        (&["bench", "--tensors", "0"][..], "tensors = 0"),
        (
            &["bench", "--max-compute-slowdown", "-1"][..],
            "max_compute_slowdown = -1",
        ),
        (
            &["bench", "--max-compute-slowdown", "NaN"][..],
            "max_compute_slowdown = NaN",
        ),
    ] {
        let out = kvoffload(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(text(&out.stderr).contains(name), "{}", text(&out.stderr));
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn cuda_sweep_flags_with_the_host_backend_are_refused_by_name() {
    for flag in [
        &["--contend"][..],
        &["--sweep-launch"],
        &["--sweep-ring"],
        &["--no-verify"],
        &["--numa", "0"],
    ] {
        let out = kvoffload(&[&["bench", "--backend", "host"][..], flag].concat());
        let flag = flag[0];
        assert_eq!(out.status.code(), Some(2), "{flag}");
        assert!(
            text(&out.stderr).contains(&format!("{flag} measures the CUDA backend")),
            "{}",
            text(&out.stderr)
        );
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn calibration_with_the_host_backend_is_refused() {
    // Calibration measures CUDA: with --backend host it is refused.
    let out = kvoffload(&["bench", "--backend", "host", "--calibrate"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--calibrate"));
}
