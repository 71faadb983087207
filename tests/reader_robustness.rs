//! The trace reader (`kvoffload replay`) and the configuration reader never
//! panic, whatever the input: arbitrary bytes, arbitrary text, and the example
//! traces and configurations with random byte mutations (the stable
//! counterpart of the `fuzz/` targets, so CI always covers it), and
//! structure-aware traces: a valid header, then well-formed operations of
//! every kind with a few mutated, which mostly reach the engine (the share is
//! measured and required, where random bytes almost never pass the header).

#[path = "common/trace_gen.rs"]
mod trace_gen;

use std::path::PathBuf;

use kvoffload::OffloadConfig;
use kvoffload::harness::sim::SimRng;
use proptest::prelude::*;

/// Tiers above this many chunks are skipped (valid, but only measure memory).
const MAX_CHUNKS: u32 = 1 << 16;

fn tier_too_big(data: &[u8]) -> bool {
    let first = data.split(|&b| b == b'\n').next().unwrap_or_default();
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(first) else {
        return false;
    };
    let cfg = v.get("config").cloned().unwrap_or_default();
    OffloadConfig::from_json_value(cfg).is_ok_and(|c| c.num_chunks().is_ok_and(|n| n > MAX_CHUNKS))
}

fn replay(data: &[u8]) {
    if !tier_too_big(data) {
        let _ = kvoffload::harness::replay::run(data, std::io::sink());
    }
}

fn config(text: &str) {
    let _ = OffloadConfig::from_toml_str(text);
    let _ = OffloadConfig::from_json_str(text);
}

fn seeds() -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/traces");
    let mut v: Vec<Vec<u8>> = std::fs::read_dir(dir)
        .expect("examples/traces")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.to_string_lossy().ends_with(".jsonl") && !p.to_string_lossy().contains(".expected.")
        })
        .map(|p| std::fs::read(p).expect("read"))
        .collect();
    v.sort();
    assert!(v.len() >= 5, "example traces found");
    v
}

const CONFIG_SEED: &str = r#"tokens_per_block = 16
blocks_per_chunk = 2
num_cpu_chunks = 1024
world_size = 2
eviction_policy = "arc"
offload_prompt_only = false
stall_timeout_ms = 300000
stall_scan_interval_ms = 10000
"#;

const JSON_SEED: &str = r#"{"tokens_per_block": 4, "blocks_per_chunk": 1, "num_cpu_chunks": 8, "world_size": 1, "eviction_policy": "lru", "stall_timeout_ms": 1000, "stall_scan_interval_ms": 100}"#;

/// Applies `(position, byte, kind)` edits: overwrite, insert or delete.
fn mutate(mut data: Vec<u8>, edits: &[(usize, u8, u8)]) -> Vec<u8> {
    for &(pos, byte, kind) in edits {
        if data.is_empty() {
            data.push(byte);
            continue;
        }
        let p = pos % data.len();
        match kind % 3 {
            0 => data[p] = byte,
            1 => data.insert(p, byte),
            _ => {
                data.remove(p);
            }
        }
    }
    data
}

fn edits() -> impl Strategy<Value = Vec<(usize, u8, u8)>> {
    let byte = prop_oneof![
        any::<u8>(),
        proptest::sample::select(b"{}[]\":,0123456789-.\n ".to_vec())
    ];
    proptest::collection::vec((any::<usize>(), byte, any::<u8>()), 1..12)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn trace_reader_never_panics_on_bytes(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        replay(&data);
    }

    #[test]
    fn trace_reader_never_panics_on_lines_after_a_valid_header(
        lines in proptest::collection::vec("[ -~]{0,80}", 0..20)
    ) {
        let trace = format!(
            "{{\"kvoffload_trace\": 1, \"config\": {{\"num_cpu_chunks\": 8}}}}\n{}\n",
            lines.join("\n")
        );
        replay(trace.as_bytes());
    }

    #[test]
    fn trace_reader_never_panics_on_mutated_examples(pick in any::<usize>(), e in edits()) {
        let s = seeds();
        let data = mutate(s[pick % s.len()].clone(), &e);
        replay(&data);
    }

    #[test]
    fn config_reader_never_panics_on_text(text in "\\PC{0,300}") {
        config(&text);
    }

    #[test]
    fn config_reader_never_panics_on_mutated_examples(json in any::<bool>(), e in edits()) {
        let seed = if json { JSON_SEED } else { CONFIG_SEED };
        let data = mutate(seed.as_bytes().to_vec(), &e);
        config(&String::from_utf8_lossy(&data));
    }
}

/// The seeds themselves parse (so the mutations start from valid input).
#[test]
fn seeds_are_valid() {
    OffloadConfig::from_toml_str(CONFIG_SEED).expect("toml seed");
    OffloadConfig::from_json_str(JSON_SEED).expect("json seed");
    for s in seeds() {
        kvoffload::harness::replay::run(&s[..], std::io::sink()).expect("example trace");
    }
}

/// Of a trace's operation lines, how many reached the executor (an output
/// line, an engine rejection included) and how many the engine accepted.
fn reached(trace: &str) -> (usize, usize, usize) {
    let ops = trace.lines().count().saturating_sub(1);
    let mut out = Vec::new();
    // A malformed line stops the replay with an error: the lines before it
    // have produced their output.
    let _ = kvoffload::harness::replay::run(trace.as_bytes(), &mut out);
    let text = String::from_utf8_lossy(&out);
    let executed = text.lines().count();
    let accepted = text.lines().filter(|l| !l.contains("\"error\"")).count();
    (ops, executed, accepted)
}

/// Structure-aware traces: every operation kind, 4 % of the lines mutated
/// (a field missing, retyped or out of range, an unknown op or field, a line
/// cut short). None panics, and most lines reach the executor; random
/// printable lines after a valid header (the test above) almost never do.
#[test]
fn structure_aware_traces_never_panic_and_mostly_reach_the_executor() {
    let mut rng = SimRng::new(0x5EED);
    let (mut ops, mut executed, mut accepted) = (0, 0, 0);
    let mut kinds = [0usize; trace_gen::OPS];
    for _ in 0..400 {
        let mut trace = trace_gen::header(&mut rng);
        for _ in 0..rng.range(1, 60) {
            let pick = rng.range(0, trace_gen::OPS as u64 - 1) as usize;
            let mut line = trace_gen::well_formed_op(&mut rng, pick);
            if rng.chance(0.04) {
                line = trace_gen::mutate(&mut rng, &line);
            } else {
                kinds[pick] += 1;
            }
            trace.push('\n');
            trace.push_str(&line);
        }
        trace.push('\n');
        let (o, e, a) = reached(&trace);
        ops += o;
        executed += e;
        accepted += a;
    }
    let mut random = (0, 0);
    let mut prng = SimRng::new(7);
    for _ in 0..400 {
        let lines: Vec<String> = (0..20)
            .map(|_| {
                (0..prng.range(0, 80))
                    .map(|_| char::from(prng.range(32, 126) as u8))
                    .collect()
            })
            .collect();
        let trace = format!(
            "{{\"kvoffload_trace\": 1, \"config\": {{\"num_cpu_chunks\": 8}}}}\n{}\n",
            lines.join("\n")
        );
        let (o, e, _) = reached(&trace);
        random.0 += o;
        random.1 += e;
    }
    let share = executed as f64 / ops as f64;
    let random_share = random.1 as f64 / random.0 as f64;
    println!(
        "structure-aware: {executed} of {ops} operation lines reached the executor ({:.1} %), \
         {accepted} accepted ({:.1} %); random printable lines: {} of {} ({:.2} %)",
        share * 100.0,
        accepted as f64 / ops as f64 * 100.0,
        random.1,
        random.0,
        random_share * 100.0
    );
    assert!(
        kinds.iter().all(|&k| k > 0),
        "every operation kind generated: {kinds:?}"
    );
    assert!(
        share >= 0.5,
        "only {:.1} % reached the executor",
        share * 100.0
    );
    assert!(
        accepted > ops / 5,
        "the engine accepted too few to exercise it: {accepted} of {ops}"
    );
}
