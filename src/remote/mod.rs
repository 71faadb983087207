//! The remote tier: chunks shared across serving nodes through an existing
//! distributed store (Redis ≥ 7, standalone or Redis Cluster; any RESP server
//! such as Valkey), behind a small trait so that other stores can follow.
//!
//! - [`RemoteStore`] / [`StoreConnector`]: the trait a store implements
//!   (batched put, get, exists, ping) and how connections are opened;
//!   [`RedisStore`] / [`RedisConnector`] implement it on the `redis` crate.
//! - [`RemoteTier`]: the engine's non-blocking front: a bounded queue to an
//!   I/O thread, answers collected by polling, deadlines on the injected
//!   clock, reconnection with backoff, metrics ([`RemoteStats`]).
//! - [`Namespace`]: a deployment's fingerprint (model, layout, block size,
//!   bytes per block, world size) in every key and value.
//! - [`value`]: the checked value format (header, payload, checksum).
//! - [`RemoteTierConfig`]: the URL, credentials and bounds.
//!
//! `docs/remote-tier.md` has the design, the failure behaviour and how to
//! run a cluster for it.

mod cluster_nodes;
pub mod cluster_slots;
mod config;
mod memory_store;
mod metrics;
mod namespace;
mod redis_op;
mod redis_store;
mod store;
mod tier;
pub mod value;

pub use config::{PASSWORD_ENV, RemoteTierConfig, Secret, USERNAME_ENV, WritePolicy};
pub use memory_store::{MemoryConnector, MemoryState, MemoryStore};
pub use metrics::RemoteStats;
pub use namespace::{Namespace, NamespaceParts};
pub use redis_store::{RedisConnector, RedisStore};
pub use store::{ItemResult, RemoteStore, StoreConnector, StoreError};
pub use tier::{Answer, MissReason, Payload, PutOutcome, RemoteError, RemoteTier, Ticket};
