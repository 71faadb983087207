//! `OffloadConfig`: every knob of the engine, validated, loadable from TOML or JSON.
//!
//! Field names are the wire names: the same keys are accepted in config files,
//! in a trace header (`docs/trace-format.md`) and by the CLI. Unknown keys are
//! rejected so that a typo never silently falls back to a default.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Host page size used to round a chunk row (matches vLLM's `PAGESIZE` rounding).
pub const HOST_PAGE_BYTES: u64 = 4096;

/// Which eviction policy the host tier uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvictionPolicyKind {
    /// Least recently used.
    #[default]
    Lru,
    /// Adaptive replacement cache (T1/T2 with ghost lists).
    Arc,
}

impl std::fmt::Display for EvictionPolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EvictionPolicyKind::Lru => "lru",
            EvictionPolicyKind::Arc => "arc",
        })
    }
}

/// Configuration of one KV group offloaded to the host tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OffloadConfig {
    /// Tokens per GPU KV block.
    pub tokens_per_block: u32,
    /// GPU blocks per offloaded chunk (the unit of the host tier).
    pub blocks_per_chunk: u32,
    /// Host chunk slots. Exclusive with `cpu_bytes_to_use`.
    pub num_cpu_chunks: Option<u64>,
    /// Host bytes for the tier, all workers together. Needs `kv_bytes_per_block`.
    pub cpu_bytes_to_use: Option<u64>,
    /// KV bytes of one GPU block on one worker (all layers); sizes chunk rows.
    pub kv_bytes_per_block: Option<u64>,
    /// Workers (GPUs) that each report every job once.
    pub world_size: u32,
    /// Eviction policy of the host tier.
    pub eviction_policy: EvictionPolicyKind,
    /// 0 (off) or >= 2: a key is stored only once it was offered this many times.
    pub store_threshold: u32,
    /// Capacity of the offer-count tracker used when `store_threshold >= 2`.
    pub max_tracker_size: u64,
    /// Store prompt tokens only (never generated tokens).
    pub offload_prompt_only: bool,
    /// A transfer job older than this is declared stalled (milliseconds).
    pub stall_timeout_ms: u64,
    /// How often the stall watchdog scans the job table (milliseconds).
    pub stall_scan_interval_ms: u64,
    /// KV bytes (on one worker) a step may load synchronously: a lookup hit
    /// that fits what is left of it is loaded inside the step, before its
    /// compute, and its request runs at once (vLLM's
    /// `sync_load_budget_bytes`). 0: every load is asynchronous.
    pub sync_load_budget_bytes: u64,
    /// KV bytes per token on one worker, as the budget counts them (vLLM:
    /// page bytes x layers / tokens per block). Default: `kv_bytes_per_block
    /// / tokens_per_block`; needed when `sync_load_budget_bytes` is set.
    pub sync_load_bytes_per_token: Option<u64>,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        Self {
            tokens_per_block: 16,
            blocks_per_chunk: 1,
            num_cpu_chunks: None,
            cpu_bytes_to_use: None,
            kv_bytes_per_block: None,
            world_size: 1,
            eviction_policy: EvictionPolicyKind::Lru,
            store_threshold: 0,
            max_tracker_size: 64_000,
            offload_prompt_only: true,
            stall_timeout_ms: 300_000,
            stall_scan_interval_ms: 10_000,
            sync_load_budget_bytes: 0,
            sync_load_bytes_per_token: None,
        }
    }
}

/// Why a configuration was rejected.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    /// A value outside its allowed range.
    #[error("{field} = {value} is out of range: allowed {allowed}")]
    OutOfRange {
        /// The offending key.
        field: &'static str,
        /// The value given.
        value: String,
        /// The allowed range, in words.
        allowed: &'static str,
    },
    /// Two keys that cannot be combined, or a key that needs another.
    #[error("{0}")]
    Conflict(String),
    /// The text could not be parsed (syntax, unknown key, wrong type).
    #[error("cannot parse {format} config: {message}")]
    Parse {
        /// "TOML" or "JSON".
        format: &'static str,
        /// The parser's message (names the key and position).
        message: String,
    },
    /// The file could not be read.
    #[error("cannot read config file {path}: {message}")]
    Io {
        /// The path given.
        path: String,
        /// The OS error.
        message: String,
    },
}

/// The [`ConfigError::OutOfRange`] of `field`.
pub(crate) fn out_of_range(
    field: &'static str,
    value: impl ToString,
    allowed: &'static str,
) -> ConfigError {
    ConfigError::OutOfRange {
        field,
        value: value.to_string(),
        allowed,
    }
}

impl OffloadConfig {
    /// A default configuration with `num_cpu_chunks` host slots.
    pub fn with_chunks(num_cpu_chunks: u64) -> Self {
        Self {
            num_cpu_chunks: Some(num_cpu_chunks),
            ..Self::default()
        }
    }

    /// Parses TOML and validates.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let cfg: Self = toml::from_str(text).map_err(|e| ConfigError::Parse {
            format: "TOML",
            message: e.message().to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses JSON and validates.
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        let cfg: Self = serde_json::from_str(text).map_err(|e| ConfigError::Parse {
            format: "JSON",
            message: e.to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses a JSON value (for example a trace header's `config`) and validates.
    pub fn from_json_value(value: serde_json::Value) -> Result<Self, ConfigError> {
        let cfg: Self = serde_json::from_value(value).map_err(|e| ConfigError::Parse {
            format: "JSON",
            message: e.to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a `.toml` or `.json` file (other extensions: JSON if it starts with `{`, else TOML).
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("json") => Self::from_json_str(&text),
            Some("toml") => Self::from_toml_str(&text),
            _ if text.trim_start().starts_with('{') => Self::from_json_str(&text),
            _ => Self::from_toml_str(&text),
        }
    }

    /// Checks every knob; the first problem found is returned, naming the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        const MAX_U16ISH: u32 = 1 << 16;
        if self.tokens_per_block == 0 || self.tokens_per_block > MAX_U16ISH {
            return Err(out_of_range(
                "tokens_per_block",
                self.tokens_per_block,
                "1..=65536",
            ));
        }
        if self.blocks_per_chunk == 0 || self.blocks_per_chunk > MAX_U16ISH {
            return Err(out_of_range(
                "blocks_per_chunk",
                self.blocks_per_chunk,
                "1..=65536",
            ));
        }
        if self.world_size == 0 || self.world_size > 4096 {
            return Err(out_of_range("world_size", self.world_size, "1..=4096"));
        }
        if self.store_threshold == 1 {
            return Err(out_of_range(
                "store_threshold",
                self.store_threshold,
                "0 (off) or >= 2",
            ));
        }
        if self.store_threshold >= 2 && self.max_tracker_size == 0 {
            return Err(out_of_range(
                "max_tracker_size",
                self.max_tracker_size,
                ">= 1 when store_threshold >= 2",
            ));
        }
        if self.stall_timeout_ms == 0 {
            return Err(out_of_range("stall_timeout_ms", 0, ">= 1"));
        }
        if self.stall_scan_interval_ms == 0 || self.stall_scan_interval_ms > self.stall_timeout_ms {
            return Err(out_of_range(
                "stall_scan_interval_ms",
                self.stall_scan_interval_ms,
                "1..=stall_timeout_ms",
            ));
        }
        if let Some(kv) = self.kv_bytes_per_block
            && kv == 0
        {
            return Err(out_of_range("kv_bytes_per_block", 0, ">= 1"));
        }
        if self.sync_load_budget_bytes > 0 && self.sync_load_bytes_per_token().is_none() {
            return Err(ConfigError::Conflict(
                "sync_load_budget_bytes needs sync_load_bytes_per_token (or kv_bytes_per_block)"
                    .into(),
            ));
        }
        self.num_chunks().map(|_| ())
    }

    /// KV bytes per token on one worker as the sync-load budget counts them:
    /// `sync_load_bytes_per_token`, else `kv_bytes_per_block /
    /// tokens_per_block`; `None` if neither is known.
    pub fn sync_load_bytes_per_token(&self) -> Option<u64> {
        self.sync_load_bytes_per_token.or_else(|| {
            self.kv_bytes_per_block
                .map(|kv| kv / u64::from(self.tokens_per_block.max(1)))
        })
    }

    /// Host chunk slots this configuration gives (validated: at least 1, at most `u32::MAX`).
    pub fn num_chunks(&self) -> Result<u32, ConfigError> {
        let n = match (self.num_cpu_chunks, self.cpu_bytes_to_use) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::Conflict(
                    "num_cpu_chunks and cpu_bytes_to_use are mutually exclusive: set one".into(),
                ));
            }
            (None, None) => {
                return Err(ConfigError::Conflict(
                    "the host tier needs a size: set num_cpu_chunks or cpu_bytes_to_use".into(),
                ));
            }
            (Some(n), None) => n,
            (None, Some(bytes)) => {
                let row = self.chunk_row_bytes().ok_or_else(|| {
                    ConfigError::Conflict(
                        "cpu_bytes_to_use needs kv_bytes_per_block (KV bytes of one GPU block on one worker)"
                            .into(),
                    )
                })?;
                bytes / row
            }
        };
        if n == 0 || n >= u64::from(u32::MAX) {
            return Err(out_of_range(
                "num_cpu_chunks",
                n,
                "1..=4294967294 (cpu_bytes_to_use must hold at least one chunk row)",
            ));
        }
        Ok(n as u32)
    }

    /// Bytes of one host chunk row (every worker's slot, page-rounded), if the block size is known.
    pub fn chunk_row_bytes(&self) -> Option<u64> {
        let kv = self.kv_bytes_per_block?;
        let raw = kv
            .checked_mul(u64::from(self.world_size))?
            .checked_mul(u64::from(self.blocks_per_chunk))?;
        raw.checked_next_multiple_of(HOST_PAGE_BYTES)
    }

    /// Tokens per chunk.
    pub fn tokens_per_chunk(&self) -> u64 {
        u64::from(self.tokens_per_block) * u64::from(self.blocks_per_chunk)
    }

    /// The stall timeout as a duration.
    pub fn stall_timeout(&self) -> Duration {
        Duration::from_millis(self.stall_timeout_ms)
    }

    /// The stall scan interval as a duration.
    pub fn stall_scan_interval(&self) -> Duration {
        Duration::from_millis(self.stall_scan_interval_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_reference() {
        let c = OffloadConfig::default();
        assert_eq!(c.blocks_per_chunk, 1);
        assert_eq!(c.eviction_policy, EvictionPolicyKind::Lru);
        assert_eq!(c.store_threshold, 0);
        assert_eq!(c.max_tracker_size, 64_000);
        assert!(c.offload_prompt_only);
        assert_eq!(c.stall_timeout(), Duration::from_secs(300));
        assert_eq!(c.stall_scan_interval(), Duration::from_secs(10));
        assert!(c.validate().is_err(), "no size given");
        assert!(OffloadConfig::with_chunks(8).validate().is_ok());
    }

    #[test]
    fn a_sync_load_budget_needs_the_bytes_per_token() {
        let e = OffloadConfig::from_json_str(
            r#"{"num_cpu_chunks": 4, "sync_load_budget_bytes": 4096}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("sync_load_bytes_per_token"), "{e}");
        let c = OffloadConfig::from_json_str(
            r#"{"num_cpu_chunks": 4, "sync_load_budget_bytes": 4096, "kv_bytes_per_block": 1024, "tokens_per_block": 16}"#,
        )
        .unwrap();
        assert_eq!(
            c.sync_load_bytes_per_token(),
            Some(64),
            "from the block size"
        );
        let c = OffloadConfig::from_json_str(
            r#"{"num_cpu_chunks": 4, "sync_load_budget_bytes": 4096, "sync_load_bytes_per_token": 96, "kv_bytes_per_block": 1024}"#,
        )
        .unwrap();
        assert_eq!(c.sync_load_bytes_per_token(), Some(96), "given");
        assert_eq!(
            OffloadConfig::with_chunks(4).sync_load_budget_bytes,
            0,
            "off by default"
        );
    }

    #[test]
    fn toml_and_json_load_the_same_config() {
        let t = OffloadConfig::from_toml_str(
            "num_cpu_chunks = 64\nblocks_per_chunk = 4\neviction_policy = \"arc\"\nstall_timeout_ms = 1000\nstall_scan_interval_ms = 100\n",
        )
        .unwrap();
        let j = OffloadConfig::from_json_str(
            r#"{"num_cpu_chunks": 64, "blocks_per_chunk": 4, "eviction_policy": "arc", "stall_timeout_ms": 1000, "stall_scan_interval_ms": 100}"#,
        )
        .unwrap();
        assert_eq!(t, j);
        assert_eq!(t.num_chunks().unwrap(), 64);
        assert_eq!(t.eviction_policy, EvictionPolicyKind::Arc);
    }

    #[test]
    fn unknown_keys_and_bad_policies_are_parse_errors() {
        let e = OffloadConfig::from_json_str(r#"{"num_cpu_chunk": 4}"#).unwrap_err();
        assert!(matches!(e, ConfigError::Parse { .. }));
        assert!(e.to_string().contains("num_cpu_chunk"), "{e}");
        let e = OffloadConfig::from_toml_str("num_cpu_chunks = 4\neviction_policy = \"fifo\"\n")
            .unwrap_err();
        assert!(e.to_string().contains("fifo"), "{e}");
        let e = OffloadConfig::from_json_str(r#"{"num_cpu_chunks": -1}"#).unwrap_err();
        assert!(matches!(e, ConfigError::Parse { .. }));
    }

    #[test]
    fn out_of_range_values_name_the_key_and_range() {
        let cases: &[(&str, &str)] = &[
            (r#"{"num_cpu_chunks": 0}"#, "num_cpu_chunks"),
            (
                r#"{"num_cpu_chunks": 4, "blocks_per_chunk": 0}"#,
                "blocks_per_chunk",
            ),
            (
                r#"{"num_cpu_chunks": 4, "tokens_per_block": 0}"#,
                "tokens_per_block",
            ),
            (r#"{"num_cpu_chunks": 4, "world_size": 0}"#, "world_size"),
            (
                r#"{"num_cpu_chunks": 4, "store_threshold": 1}"#,
                "store_threshold",
            ),
            (
                r#"{"num_cpu_chunks": 4, "store_threshold": 2, "max_tracker_size": 0}"#,
                "max_tracker_size",
            ),
            (
                r#"{"num_cpu_chunks": 4, "stall_timeout_ms": 0}"#,
                "stall_timeout_ms",
            ),
            (
                r#"{"num_cpu_chunks": 4, "stall_timeout_ms": 10, "stall_scan_interval_ms": 11}"#,
                "stall_scan_interval_ms",
            ),
        ];
        for (text, field) in cases {
            let e = OffloadConfig::from_json_str(text).unwrap_err();
            match &e {
                ConfigError::OutOfRange { field: f, .. } => assert_eq!(f, field, "{text}"),
                other => panic!("{text}: expected OutOfRange, got {other:?}"),
            }
            assert!(e.to_string().contains("allowed"), "{e}");
        }
    }

    #[test]
    fn cpu_bytes_sizing_rounds_rows_to_pages() {
        let mut c = OffloadConfig {
            cpu_bytes_to_use: Some(1 << 20),
            kv_bytes_per_block: Some(3000),
            world_size: 2,
            blocks_per_chunk: 2,
            ..OffloadConfig::default()
        };
        // row = 3000*2*2 = 12000 -> 12288 (3 pages); 1 MiB / 12288 = 85
        assert_eq!(c.chunk_row_bytes(), Some(12288));
        assert_eq!(c.num_chunks().unwrap(), 85);
        c.num_cpu_chunks = Some(4);
        assert!(matches!(c.validate(), Err(ConfigError::Conflict(_))));
        c.num_cpu_chunks = None;
        c.kv_bytes_per_block = None;
        assert!(matches!(c.validate(), Err(ConfigError::Conflict(_))));
        c.kv_bytes_per_block = Some(1 << 30);
        assert!(matches!(
            c.validate(),
            Err(ConfigError::OutOfRange {
                field: "num_cpu_chunks",
                ..
            })
        ));
    }

    #[test]
    fn from_path_picks_the_format_and_reports_missing_files() {
        let dir = std::env::temp_dir().join(format!("kvoffload-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("c.toml");
        std::fs::write(&p, "num_cpu_chunks = 3\n").unwrap();
        assert_eq!(
            OffloadConfig::from_path(&p).unwrap().num_chunks().unwrap(),
            3
        );
        let p = dir.join("c.conf");
        std::fs::write(&p, "{\"num_cpu_chunks\": 5}").unwrap();
        assert_eq!(
            OffloadConfig::from_path(&p).unwrap().num_chunks().unwrap(),
            5
        );
        let e = OffloadConfig::from_path(dir.join("missing.toml")).unwrap_err();
        assert!(matches!(e, ConfigError::Io { .. }));
        std::fs::remove_dir_all(&dir).ok();
    }
}
