//! kvoffload: offloads an LLM server's paged KV cache to pinned host memory and
//! loads it back, so that a prompt prefix computed once is never recomputed
//! while it still sits anywhere on the machine.
//!
//! The crate has two halves:
//! - the control plane ([`manager`] and [`scheduler`]): which chunks live on
//!   the host tier, which to load, store, flush or evict, and which transfers
//!   stalled;
//! - the data plane ([`worker`]): moving blocks between GPU pages and host
//!   chunks, and [`adapter`], which turns the scheduler's step plan into the
//!   workers' and sums their reports back;
//! - the remote tier ([`remote`]): chunks shared across nodes through Redis.
//!
//! Time is always injected through a [`Clock`].

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod adapter;
mod clock;
mod config;
mod direction;
#[doc(hidden)]
pub mod harness;
mod histogram;
mod ids;
pub mod kernels;
mod key;
pub mod manager;
pub mod metrics;
mod profiling;
pub mod remote;
pub mod scheduler;
pub(crate) mod sync;
pub mod worker;

pub use clock::{Clock, ManualClock, MonotonicClock, SharedClock};
pub use config::{ConfigError, EvictionPolicyKind, HOST_PAGE_BYTES, OffloadConfig};
pub use direction::Direction;
pub use ids::{ChunkId, GpuBlockId, JobId, RequestId};
pub use key::{BlockHash, ChunkKey, chunk_keys};
/// The data plane's NVTX ranges (one per job phase, for `nsys`), switched on
/// or off.
pub use profiling::set_enabled as set_nvtx_enabled;

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
