//! kvoffload: offloads an LLM server's paged KV cache to pinned host memory and
//! loads it back, so that a prompt prefix computed once is never recomputed
//! while it still sits anywhere on the machine.
//!
//! The crate has two halves:
//! - the control plane ([`manager`] and [`scheduler`]): which chunks live on
//!   the host tier, which to load, store, flush or evict, and which transfers
//!   stalled; [`replay`] drives it from a trace file;
//! - the data plane (the worker): moving blocks between GPU pages and host chunks;
//! - the remote tier ([`remote`]): chunks shared across nodes through Redis.
//!
//! Time is always injected through a [`clock::Clock`].

pub mod bench;
pub mod clock;
pub mod config;
mod direction;
pub mod engine;
pub mod histogram;
pub mod ids;
pub mod kernels;
pub mod key;
pub mod manager;
pub mod metrics;
pub mod profiling;
pub mod remote;
pub mod replay;
pub mod scheduler;
pub mod sim;
pub(crate) mod sync;
pub mod worker;

pub use clock::{Clock, ManualClock, MonotonicClock, SharedClock};
pub use config::{ConfigError, EvictionPolicyKind, OffloadConfig};
pub use direction::Direction;
pub use ids::{ChunkId, GpuBlockId, JobId, RequestId};
pub use key::{BlockHash, ChunkKey};

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
