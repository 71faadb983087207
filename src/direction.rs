//! Which way a job moves bytes: the one direction type of the control plane
//! (a job's kind) and the data plane (a transfer's direction). A leaf: it
//! depends on nothing in the crate.

use serde::{Deserialize, Serialize};

/// Which way a job moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// GPU pages -> host chunks (offload).
    Store,
    /// Host chunks -> GPU pages (load back).
    Load,
}

impl Direction {
    /// Both directions, store first.
    pub const ALL: [Direction; 2] = [Direction::Store, Direction::Load];

    /// 0 for store, 1 for load (for per-direction arrays).
    pub fn index(self) -> usize {
        match self {
            Direction::Store => 0,
            Direction::Load => 1,
        }
    }
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Direction::Store => "store",
            Direction::Load => "load",
        })
    }
}

impl Direction {
    /// `"store"` or `"load"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Store => "store",
            Direction::Load => "load",
        }
    }
}
