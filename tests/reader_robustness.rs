//! The trace reader (`kvoffload replay`) and the configuration reader never
//! panic, whatever the input: arbitrary bytes, arbitrary text, and the example
//! traces and configurations with random byte mutations (the stable
//! counterpart of the `fuzz/` targets, so CI always covers it).

use std::path::PathBuf;

use kvoffload::OffloadConfig;
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
        let _ = kvoffload::replay::run(data, std::io::sink());
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
        kvoffload::replay::run(&s[..], std::io::sink()).expect("example trace");
    }
}
