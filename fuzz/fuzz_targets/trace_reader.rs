//! Fuzz target: the trace reader and executor (`kvoffload replay`) never
//! panic on any input; malformed input is an error, never a crash.
#![no_main]

use libfuzzer_sys::fuzz_target;

/// Host tiers above this many chunks are skipped: the header is valid but
/// allocating the tier would only measure the fuzzer's memory limit.
const MAX_CHUNKS: u32 = 1 << 16;

fn tier_too_big(data: &[u8]) -> bool {
    let first = data.split(|&b| b == b'\n').next().unwrap_or_default();
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(first) else {
        return false;
    };
    let cfg = v.get("config").cloned().unwrap_or_default();
    match kvoffload::OffloadConfig::from_json_value(cfg) {
        Ok(c) => c.num_chunks().map_or(false, |n| n > MAX_CHUNKS),
        Err(_) => false,
    }
}

fuzz_target!(|data: &[u8]| {
    if tier_too_big(data) {
        return;
    }
    let _ = kvoffload::harness::replay::run(data, std::io::sink());
});
