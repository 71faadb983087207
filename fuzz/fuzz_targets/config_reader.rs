//! Fuzz target: the configuration reader (TOML and JSON) never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = kvoffload::OffloadConfig::from_toml_str(text);
        let _ = kvoffload::OffloadConfig::from_json_str(text);
    }
});
