//! Which copy strategy a CUDA transfer uses, chosen per (direction, bytes per
//! descriptor, block count) from a table with defaults that a calibration run
//! can overwrite (JSON file).

use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::worker::Direction;

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
    /// Smallest average descriptor size (bytes), inclusive.
    #[serde(default)]
    pub min_bytes_per_block: u64,
    /// Largest average descriptor size (bytes), inclusive (None: no limit).
    #[serde(default)]
    pub max_bytes_per_block: Option<u64>,
    /// Smallest block count, inclusive.
    #[serde(default)]
    pub min_blocks: usize,
    /// Largest block count, inclusive (None: no limit).
    #[serde(default)]
    pub max_blocks: Option<usize>,
    /// The strategy.
    pub strategy: Strategy,
}

impl StrategyRule {
    fn matches(&self, direction: Direction, bytes_per_block: u64, blocks: usize) -> bool {
        self.direction.is_none_or(|d| d == direction)
            && bytes_per_block >= self.min_bytes_per_block
            && self
                .max_bytes_per_block
                .is_none_or(|m| bytes_per_block <= m)
            && blocks >= self.min_blocks
            && self.max_blocks.is_none_or(|m| blocks <= m)
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
    /// JSON.
    #[error("strategy file {path}: {source}")]
    Json {
        /// The file.
        path: String,
        /// The error.
        #[source]
        source: serde_json::Error,
    },
}

impl Default for StrategyTable {
    /// Defaults from published figures (see docs/dataplane.md): few blocks go to
    /// DMA (no launch to amortise), large runs to batched DMA (copy engines reach
    /// the link's ceiling without SMs), many small blocks to the graph-replayed
    /// kernel (per-descriptor DMA is slow below ~28 KiB).
    fn default() -> Self {
        Self {
            rules: vec![
                StrategyRule {
                    direction: None,
                    min_bytes_per_block: 0,
                    max_bytes_per_block: None,
                    min_blocks: 0,
                    max_blocks: Some(7),
                    strategy: Strategy::Dma,
                },
                StrategyRule {
                    direction: None,
                    min_bytes_per_block: 256 << 10,
                    max_bytes_per_block: None,
                    min_blocks: 0,
                    max_blocks: None,
                    strategy: Strategy::BatchDma,
                },
                StrategyRule {
                    direction: None,
                    min_bytes_per_block: 0,
                    max_bytes_per_block: Some((256 << 10) - 1),
                    min_blocks: 8,
                    max_blocks: None,
                    strategy: Strategy::KernelGraph,
                },
            ],
            fallback: Strategy::Dma,
        }
    }
}

impl StrategyTable {
    /// A table that always answers `strategy`.
    pub fn always(strategy: Strategy) -> Self {
        Self {
            rules: Vec::new(),
            fallback: strategy,
        }
    }

    /// The strategy for a job.
    pub fn choose(&self, direction: Direction, bytes_per_block: u64, blocks: usize) -> Strategy {
        self.rules
            .iter()
            .find(|r| r.matches(direction, bytes_per_block, blocks))
            .map_or(self.fallback, |r| r.strategy)
    }

    /// Reads a table written by a calibration run.
    pub fn load(path: &Path) -> Result<Self, StrategyFileError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| StrategyFileError::Io {
            path: name.clone(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| StrategyFileError::Json { path: name, source })
    }

    /// Writes the table as JSON.
    pub fn save(&self, path: &Path) -> Result<(), StrategyFileError> {
        let name = path.display().to_string();
        let text =
            serde_json::to_string_pretty(self).map_err(|source| StrategyFileError::Json {
                path: name.clone(),
                source,
            })?;
        std::fs::write(path, text).map_err(|source| StrategyFileError::Io { path: name, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            min_bytes_per_block: 1,
            max_bytes_per_block: Some(2),
            min_blocks: 3,
            max_blocks: None,
            strategy: Strategy::Kernel,
        });
        let json = serde_json::to_string(&t).unwrap();
        assert!(json.contains("\"kernel_graph\"") && json.contains("\"load\""));
        let back: StrategyTable = serde_json::from_str(&json).unwrap();
        assert_eq!(back, t);
        let partial: StrategyTable = serde_json::from_str(
            r#"{"rules":[{"strategy":"dma","max_blocks":3}],"fallback":"kernel"}"#,
        )
        .unwrap();
        assert_eq!(partial.choose(Direction::Store, 10, 2), Strategy::Dma);
        assert_eq!(partial.choose(Direction::Store, 10, 9), Strategy::Kernel);
    }
}
