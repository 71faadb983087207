//! Which copy strategy a CUDA transfer uses, chosen per (direction, bytes per
//! descriptor, block count) from a table with defaults that a calibration run
//! can overwrite (a JSON file: `kvoffload bench --calibrate FILE` writes it,
//! [`StrategyTable::load`] reads it; format in docs/dataplane.md).

use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::Direction;

use super::tuning::BackendTuning;

/// A copy strategy of the CUDA backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// One `cuMemcpyAsync` per coalesced run (copy engines).
    Dma,
    /// One `cuMemcpyBatchAsync` per job where the driver has it, else [`Strategy::Dma`].
    BatchDma,
    /// The gather/scatter kernel, descriptor table refreshed with a memcpy.
    Kernel,
    /// The same kernel and table refresh, captured once per capacity bucket and replayed.
    KernelGraph,
}

impl Strategy {
    /// All strategies.
    pub const ALL: [Strategy; 4] = [
        Strategy::Dma,
        Strategy::BatchDma,
        Strategy::Kernel,
        Strategy::KernelGraph,
    ];

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Dma => "dma",
            Strategy::BatchDma => "batch_dma",
            Strategy::Kernel => "kernel",
            Strategy::KernelGraph => "kernel_graph",
        }
    }
}

/// One row of the table: the first matching rule wins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StrategyRule {
    /// Direction it applies to (None: both).
    #[serde(default)]
    pub direction: Option<Direction>,
    /// Smallest average descriptor size (bytes), inclusive (read also as
    /// `min_bytes_per_block`, its name before descriptors were counted).
    #[serde(default, alias = "min_bytes_per_block")]
    pub min_bytes_per_descriptor: u64,
    /// Largest average descriptor size (bytes), inclusive (None: no limit).
    #[serde(default, alias = "max_bytes_per_block")]
    pub max_bytes_per_descriptor: Option<u64>,
    /// Smallest descriptor count (copies after coalescing: a block is one
    /// per tensor, so 2 × layers with per-layer caches), inclusive (read
    /// also as `min_blocks`).
    #[serde(default, alias = "min_blocks")]
    pub min_descriptors: usize,
    /// Largest descriptor count, inclusive (None: no limit; `max_blocks`).
    #[serde(default, alias = "max_blocks")]
    pub max_descriptors: Option<usize>,
    /// The strategy.
    pub strategy: Strategy,
}

impl StrategyRule {
    fn matches(&self, direction: Direction, bytes_per_descriptor: u64, descriptors: usize) -> bool {
        self.direction.is_none_or(|d| d == direction)
            && bytes_per_descriptor >= self.min_bytes_per_descriptor
            && self
                .max_bytes_per_descriptor
                .is_none_or(|m| bytes_per_descriptor <= m)
            && descriptors >= self.min_descriptors
            && self.max_descriptors.is_none_or(|m| descriptors <= m)
    }
}

/// The strategy table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StrategyTable {
    /// Rules, first match wins.
    pub rules: Vec<StrategyRule>,
    /// Used when no rule matches.
    pub fallback: Strategy,
    /// Backend options a calibration found better than the defaults (applied
    /// when a backend is built; absent in files without it).
    #[serde(default, skip_serializing_if = "BackendTuning::is_empty")]
    pub tuning: BackendTuning,
}

/// A strategy file could not be read or written.
#[derive(Debug, Error)]
pub enum StrategyFileError {
    /// I/O.
    #[error("strategy file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// JSON (syntax, unknown key, unknown strategy or direction name).
    #[error("strategy file {path}: {source}")]
    Json {
        /// The file.
        path: String,
        /// The error.
        #[source]
        source: serde_json::Error,
    },
    /// The file parses but a rule can never match.
    #[error("strategy file {path}: {source}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        #[source]
        source: StrategyTableError,
    },
}

/// A strategy table whose rules are inconsistent.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StrategyTableError {
    /// `min_bytes_per_descriptor > max_bytes_per_descriptor`.
    #[error(
        "rule {rule}: min_bytes_per_descriptor = {min} is above max_bytes_per_descriptor = {max}"
    )]
    BytesRange {
        /// Index of the rule (0-based).
        rule: usize,
        /// The minimum.
        min: u64,
        /// The maximum.
        max: u64,
    },
    /// `min_descriptors > max_descriptors`.
    #[error("rule {rule}: min_descriptors = {min} is above max_descriptors = {max}")]
    DescriptorsRange {
        /// Index of the rule (0-based).
        rule: usize,
        /// The minimum.
        min: usize,
        /// The maximum.
        max: usize,
    },
    /// A `tuning` field out of its range.
    #[error("tuning: {field} = {value} is out of range: allowed {allowed}")]
    Tuning {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The range allowed.
        allowed: &'static str,
    },
}

impl Default for StrategyTable {
    /// Defaults from published figures (see docs/dataplane.md): few
    /// descriptors go to DMA (no launch to amortise), large runs to batched
    /// DMA (copy engines reach the link's ceiling without SMs), many small
    /// descriptors to the graph-replayed kernel (per-descriptor DMA is slow
    /// below ~28 KiB).
    fn default() -> Self {
        Self {
            rules: vec![
                StrategyRule {
                    direction: None,
                    min_bytes_per_descriptor: 0,
                    max_bytes_per_descriptor: None,
                    min_descriptors: 0,
                    max_descriptors: Some(7),
                    strategy: Strategy::Dma,
                },
                StrategyRule {
                    direction: None,
                    min_bytes_per_descriptor: 256 << 10,
                    max_bytes_per_descriptor: None,
                    min_descriptors: 0,
                    max_descriptors: None,
                    strategy: Strategy::BatchDma,
                },
                StrategyRule {
                    direction: None,
                    min_bytes_per_descriptor: 0,
                    max_bytes_per_descriptor: Some((256 << 10) - 1),
                    min_descriptors: 8,
                    max_descriptors: None,
                    strategy: Strategy::KernelGraph,
                },
            ],
            fallback: Strategy::Dma,
            tuning: BackendTuning::default(),
        }
    }
}

impl StrategyTable {
    /// A table that always answers `strategy`.
    pub fn always(strategy: Strategy) -> Self {
        Self {
            rules: Vec::new(),
            fallback: strategy,
            tuning: BackendTuning::default(),
        }
    }

    /// The strategy for a job of `descriptors` copies (after coalescing) of
    /// `bytes_per_descriptor` on average: what a DMA submit costs is one call
    /// per descriptor, which a block count understates `2 × layers` times
    /// with per-layer caches.
    pub fn choose(
        &self,
        direction: Direction,
        bytes_per_descriptor: u64,
        descriptors: usize,
    ) -> Strategy {
        self.rules
            .iter()
            .find(|r| r.matches(direction, bytes_per_descriptor, descriptors))
            .map_or(self.fallback, |r| r.strategy)
    }

    /// Checks that every rule can match (each minimum at most its maximum)
    /// and that the tuning is in range.
    pub fn validate(&self) -> Result<(), StrategyTableError> {
        self.tuning.validate()?;
        for (rule, r) in self.rules.iter().enumerate() {
            if let Some(max) = r.max_bytes_per_descriptor
                && r.min_bytes_per_descriptor > max
            {
                return Err(StrategyTableError::BytesRange {
                    rule,
                    min: r.min_bytes_per_descriptor,
                    max,
                });
            }
            if let Some(max) = r.max_descriptors
                && r.min_descriptors > max
            {
                return Err(StrategyTableError::DescriptorsRange {
                    rule,
                    min: r.min_descriptors,
                    max,
                });
            }
        }
        Ok(())
    }

    /// Parses and validates a table from JSON text (`path` names it in errors).
    pub fn from_json_str(text: &str, path: &str) -> Result<Self, StrategyFileError> {
        let t: Self = serde_json::from_str(text).map_err(|source| StrategyFileError::Json {
            path: path.to_string(),
            source,
        })?;
        t.validate().map_err(|source| StrategyFileError::Invalid {
            path: path.to_string(),
            source,
        })?;
        Ok(t)
    }

    /// Reads and validates a table written by a calibration run.
    pub fn load(path: &Path) -> Result<Self, StrategyFileError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| StrategyFileError::Io {
            path: name.clone(),
            source,
        })?;
        Self::from_json_str(&text, &name)
    }

    /// Writes the table as JSON (validated first: a table `load` would refuse
    /// is not written).
    pub fn save(&self, path: &Path) -> Result<(), StrategyFileError> {
        let name = path.display().to_string();
        self.validate()
            .map_err(|source| StrategyFileError::Invalid {
                path: name.clone(),
                source,
            })?;
        let text =
            serde_json::to_string_pretty(self).map_err(|source| StrategyFileError::Json {
                path: name.clone(),
                source,
            })?;
        std::fs::write(path, text + "\n")
            .map_err(|source| StrategyFileError::Io { path: name, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tuning_section_round_trips_and_files_without_it_still_load() {
        let plain: StrategyTable =
            serde_json::from_str(r#"{"rules":[],"fallback":"dma"}"#).unwrap();
        assert!(plain.tuning.is_empty());
        assert!(
            !serde_json::to_string(&plain).unwrap().contains("tuning"),
            "an empty tuning is not written"
        );
        let tuned = StrategyTable {
            tuning: BackendTuning {
                kernel_ctas: Some(16),
                ring_slots: Some(8),
                ..BackendTuning::default()
            },
            ..StrategyTable::always(Strategy::Kernel)
        };
        let (_dir, path) = tmp("tuned.json");
        tuned.save(&path).unwrap();
        assert_eq!(StrategyTable::load(&path).unwrap(), tuned);
        let e = StrategyTable::from_json_str(
            r#"{"rules":[],"fallback":"dma","tuning":{"ring_slots":0}}"#,
            "t.json",
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("t.json") && e.to_string().contains("ring_slots = 0"),
            "{e}"
        );
        let e = StrategyTable::from_json_str(
            r#"{"rules":[],"fallback":"dma","tuning":{"warps":3}}"#,
            "t.json",
        )
        .unwrap_err();
        assert!(e.to_string().contains("warps"), "{e}");
    }

    #[test]
    fn files_with_the_block_names_still_load() {
        let old: StrategyTable = serde_json::from_str(
            r#"{"rules":[{"min_bytes_per_block":4096,"max_bytes_per_block":8191,"min_blocks":2,"max_blocks":7,"strategy":"dma"}],"fallback":"kernel"}"#,
        )
        .unwrap();
        let r = &old.rules[0];
        assert_eq!(
            (
                r.min_bytes_per_descriptor,
                r.max_bytes_per_descriptor,
                r.min_descriptors,
                r.max_descriptors
            ),
            (4096, Some(8191), 2, Some(7))
        );
    }

    #[test]
    fn the_default_counts_descriptors_not_blocks() {
        // Seven blocks of a 32-layer per-layer cache are 448 descriptors of
        // 16 KiB: the kernel, not 448 DMA calls.
        let t = StrategyTable::default();
        assert_eq!(t.choose(Direction::Store, 16 << 10, 7), Strategy::Dma);
        assert_eq!(
            t.choose(Direction::Store, 16 << 10, 7 * 2 * 32),
            Strategy::KernelGraph
        );
    }

    #[test]
    fn defaults_route_by_size_and_count() {
        let t = StrategyTable::default();
        assert_eq!(t.choose(Direction::Load, 16 << 10, 4), Strategy::Dma);
        assert_eq!(
            t.choose(Direction::Store, 16 << 10, 256),
            Strategy::KernelGraph
        );
        assert_eq!(t.choose(Direction::Store, 2 << 20, 256), Strategy::BatchDma);
        assert_eq!(
            StrategyTable::always(Strategy::Kernel).choose(Direction::Load, 1, 1),
            Strategy::Kernel
        );
    }

    #[test]
    fn table_round_trips_through_json() {
        let mut t = StrategyTable::default();
        t.rules.push(StrategyRule {
            direction: Some(Direction::Load),
            min_bytes_per_descriptor: 1,
            max_bytes_per_descriptor: Some(2),
            min_descriptors: 3,
            max_descriptors: None,
            strategy: Strategy::Kernel,
        });
        let json = serde_json::to_string(&t).unwrap();
        assert!(json.contains("\"kernel_graph\"") && json.contains("\"load\""));
        let back: StrategyTable = serde_json::from_str(&json).unwrap();
        assert_eq!(back, t);
        let partial: StrategyTable = serde_json::from_str(
            r#"{"rules":[{"strategy":"dma","max_descriptors":3}],"fallback":"kernel"}"#,
        )
        .unwrap();
        assert_eq!(partial.choose(Direction::Store, 10, 2), Strategy::Dma);
        assert_eq!(partial.choose(Direction::Store, 10, 9), Strategy::Kernel);
    }

    /// A path named `name` in a fresh temporary folder, removed when the
    /// returned guard drops.
    fn tmp(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        (dir, path)
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn file_round_trip() {
        let mut t = StrategyTable::default();
        t.rules.insert(
            0,
            StrategyRule {
                direction: Some(Direction::Store),
                min_bytes_per_descriptor: 4096,
                max_bytes_per_descriptor: Some(16383),
                min_descriptors: 64,
                max_descriptors: Some(255),
                strategy: Strategy::Kernel,
            },
        );
        let (_dir, path) = tmp("round-trip.json");
        t.save(&path).unwrap();
        assert_eq!(StrategyTable::load(&path).unwrap(), t);
        assert!(std::fs::read_to_string(&path).unwrap().ends_with("}\n"));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn bad_files_are_typed_errors() {
        let (_dir, missing) = tmp("missing.json");
        assert!(matches!(
            StrategyTable::load(&missing),
            Err(StrategyFileError::Io { .. })
        ));
        for (name, text, needle) in [
            ("syntax.json", "{\"rules\": [", "EOF"),
            (
                "unknown-key.json",
                r#"{"rules":[],"fallback":"dma","extra":1}"#,
                "extra",
            ),
            (
                "bad-strategy.json",
                r#"{"rules":[],"fallback":"warp"}"#,
                "warp",
            ),
            (
                "bad-direction.json",
                r#"{"rules":[{"direction":"sideways","strategy":"dma"}],"fallback":"dma"}"#,
                "sideways",
            ),
            ("no-fallback.json", r#"{"rules":[]}"#, "fallback"),
            (
                "negative.json",
                r#"{"rules":[{"min_descriptors":-1,"strategy":"dma"}],"fallback":"dma"}"#,
                "-1",
            ),
        ] {
            let (_dir, path) = tmp(name);
            std::fs::write(&path, text).unwrap();
            let e = StrategyTable::load(&path).unwrap_err();
            assert!(matches!(e, StrategyFileError::Json { .. }), "{name}: {e}");
            let msg = e.to_string();
            assert!(msg.contains(name) && msg.contains(needle), "{name}: {msg}");
        }
        let (_dir, path) = tmp("inverted.json");
        std::fs::write(
            &path,
            r#"{"rules":[{"strategy":"dma"},{"min_descriptors":9,"max_descriptors":3,"strategy":"kernel"}],"fallback":"dma"}"#,
        )
        .unwrap();
        let e = StrategyTable::load(&path).unwrap_err();
        assert!(
            matches!(
                e,
                StrategyFileError::Invalid {
                    source: StrategyTableError::DescriptorsRange {
                        rule: 1,
                        min: 9,
                        max: 3
                    },
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string()
                .contains("min_descriptors = 9 is above max_descriptors = 3")
        );
        let bad = StrategyTable {
            rules: vec![StrategyRule {
                direction: None,
                min_bytes_per_descriptor: 10,
                max_bytes_per_descriptor: Some(1),
                min_descriptors: 0,
                max_descriptors: None,
                strategy: Strategy::Dma,
            }],
            fallback: Strategy::Dma,
            tuning: BackendTuning::default(),
        };
        let (_dir, out) = tmp("not-written.json");
        assert!(matches!(
            bad.save(&out),
            Err(StrategyFileError::Invalid {
                source: StrategyTableError::BytesRange { rule: 0, .. },
                ..
            })
        ));
        assert!(!out.exists());
    }
}
