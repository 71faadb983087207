//! The simulation's engine configuration: its defaults, overlaid with the keys
//! of a configuration file (TOML or JSON, the engine's keys and validation).

use std::path::Path;

use serde_json::{Map, Value};

use crate::config::{ConfigError, OffloadConfig};

/// The engine configuration the simulation uses unless told otherwise: two
/// workers, 16-token blocks, 2048 host chunks, a 300 ms stall timeout scanned
/// every 50 ms of simulated time.
pub fn default_config() -> OffloadConfig {
    OffloadConfig {
        num_cpu_chunks: Some(2048),
        world_size: 2,
        stall_timeout_ms: 300,
        stall_scan_interval_ms: 50,
        ..OffloadConfig::default()
    }
}

/// [`default_config`] with the keys set in the file at `path` (unknown keys and
/// out-of-range values are rejected by name, as by [`OffloadConfig::from_path`]).
pub fn config_from_path(path: impl AsRef<Path>) -> Result<OffloadConfig, ConfigError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    let json = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .map_or_else(|| text.trim_start().starts_with('{'), |e| e == "json");
    let file: Map<String, Value> = if json {
        serde_json::from_str(&text).map_err(|e| ConfigError::Parse {
            format: "JSON",
            message: e.to_string(),
        })?
    } else {
        let table: toml::Table = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            format: "TOML",
            message: e.to_string(),
        })?;
        match serde_json::to_value(table) {
            Ok(Value::Object(m)) => m,
            Ok(_) | Err(_) => {
                return Err(ConfigError::Parse {
                    format: "TOML",
                    message: "not a table of keys".into(),
                });
            }
        }
    };
    overlay(file)
}

/// [`default_config`] with `file`'s keys set.
pub fn overlay(file: Map<String, Value>) -> Result<OffloadConfig, ConfigError> {
    let Ok(Value::Object(mut base)) = serde_json::to_value(default_config()) else {
        return Err(ConfigError::Conflict("default configuration".into()));
    };
    // The two ways of sizing the host tier exclude each other.
    if file.contains_key("cpu_bytes_to_use") {
        base.insert("num_cpu_chunks".into(), Value::Null);
    }
    if file.contains_key("num_cpu_chunks") {
        base.insert("cpu_bytes_to_use".into(), Value::Null);
    }
    base.extend(file);
    // A sync-load budget counts bytes per token: without the engine's own
    // figure, the sim's (its blocks' bytes over their tokens).
    let budget = base.get("sync_load_budget_bytes").and_then(Value::as_u64);
    let unset = |k: &str| base.get(k).is_none_or(Value::is_null);
    if budget.is_some_and(|b| b > 0)
        && unset("sync_load_bytes_per_token")
        && unset("kv_bytes_per_block")
        && let Some(tpb) = base.get("tokens_per_block").and_then(Value::as_u64)
        && tpb > 0
    {
        base.insert(
            "sync_load_bytes_per_token".into(),
            Value::from(SIM_BLOCK_BYTES / tpb),
        );
    }
    OffloadConfig::from_json_value(Value::Object(base))
}

/// Bytes of one simulated GPU block on one worker unless the engine's
/// `kv_bytes_per_block` says otherwise.
pub const SIM_BLOCK_BYTES: u64 = 16 * 1024;

/// Sets a per-step sync-load budget of `bytes` (KV bytes per worker), with
/// the sim's bytes per token unless the configuration has its own.
pub fn set_sync_load_budget(cfg: &mut OffloadConfig, bytes: u64) {
    cfg.sync_load_budget_bytes = bytes;
    if bytes > 0 && cfg.sync_load_bytes_per_token().is_none() {
        let tpb = u64::from(cfg.tokens_per_block.max(1));
        cfg.sync_load_bytes_per_token = Some(SIM_BLOCK_BYTES / tpb);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_keys_override_defaults_and_are_validated() {
        let m: Map<String, Value> = serde_json::from_str(r#"{"world_size": 4}"#).unwrap();
        let c = overlay(m).unwrap();
        assert_eq!(c.world_size, 4);
        assert_eq!(c.stall_timeout_ms, 300);
        let m: Map<String, Value> = serde_json::from_str(r#"{"world_size": 0}"#).unwrap();
        let e = overlay(m).unwrap_err().to_string();
        assert!(
            e.contains("world_size = 0") && e.contains("1..=4096"),
            "{e}"
        );
        let m: Map<String, Value> = serde_json::from_str(r#"{"bogus": 1}"#).unwrap();
        assert!(overlay(m).unwrap_err().to_string().contains("bogus"));
    }

    #[test]
    fn a_sync_load_budget_gets_the_sims_bytes_per_token_unless_given() {
        let m: Map<String, Value> =
            serde_json::from_str(r#"{"sync_load_budget_bytes": 65536}"#).unwrap();
        let c = overlay(m).unwrap();
        assert_eq!(c.sync_load_bytes_per_token(), Some(SIM_BLOCK_BYTES / 16));
        let m: Map<String, Value> = serde_json::from_str(
            r#"{"sync_load_budget_bytes": 65536, "tokens_per_block": 32, "sync_load_bytes_per_token": 7}"#,
        )
        .unwrap();
        assert_eq!(overlay(m).unwrap().sync_load_bytes_per_token(), Some(7));
        let m: Map<String, Value> = serde_json::from_str(
            r#"{"sync_load_budget_bytes": 65536, "tokens_per_block": 32, "kv_bytes_per_block": 4096}"#,
        )
        .unwrap();
        assert_eq!(overlay(m).unwrap().sync_load_bytes_per_token(), Some(128));
        let mut c = default_config();
        set_sync_load_budget(&mut c, 1 << 20);
        assert_eq!(
            (c.sync_load_budget_bytes, c.sync_load_bytes_per_token()),
            (1 << 20, Some(1024))
        );
        c.validate().unwrap();
    }
}
