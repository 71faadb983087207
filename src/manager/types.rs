//! Public value types of the host-tier manager.

use thiserror::Error;

use crate::ids::ChunkId;
use crate::key::ChunkKey;

/// Answer of [`super::OffloadManager::lookup`] for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LookupResult {
    /// Stored and readable.
    Hit,
    /// Present but its store is still in flight: ask again later.
    HitPending,
    /// Not in the host tier.
    Miss,
}

/// What a successful [`super::OffloadManager::prepare_store`] decided.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrepareStoreOutput {
    /// The offered keys that were not present, in offer order: these must be written.
    pub keys_to_store: Vec<ChunkKey>,
    /// Host slots for `keys_to_store`, co-indexed.
    pub chunk_ids: Vec<ChunkId>,
    /// Keys evicted to make room, in eviction order.
    pub evicted: Vec<ChunkKey>,
}

/// How a store job ended, for [`super::OffloadManager::complete_store`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoreOutcome {
    /// The bytes are on the host: pending chunks become ready.
    Success,
    /// The transfer failed and is over: pending chunks are removed, their slots freed.
    Failure,
    /// The transfer failed but may still write later (a stall): pending chunks are
    /// removed from lookups at once, but their slots stay out of the free list
    /// until [`super::OffloadManager::release_quarantined`].
    Quarantined,
}

/// Bad input to the manager. The manager's state is unchanged when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ManagerError {
    /// A host tier must hold at least one chunk.
    #[error("host tier capacity must be at least 1 chunk")]
    ZeroCapacity,
    /// More slots than slot ids can name.
    #[error("host tier capacity {0} exceeds the maximum of 4294967294 chunks")]
    CapacityTooLarge(u64),
    /// The key is not in the host tier.
    #[error("key {0} is not in the host tier")]
    UnknownKey(ChunkKey),
    /// The key's store is still in flight; it cannot be loaded yet.
    #[error("key {0} is being stored and cannot be loaded yet")]
    NotReady(ChunkKey),
    /// `complete_load` for a key that no load pins (or more often than it is pinned).
    #[error("key {0} is not pinned by a load")]
    NotPinned(ChunkKey),
    /// `release_quarantined` for a slot that is not quarantined.
    #[error("{0} is not quarantined")]
    NotQuarantined(ChunkId),
}

impl ManagerError {
    /// The chunk key the error is about, if any.
    pub fn key(&self) -> Option<ChunkKey> {
        match self {
            ManagerError::UnknownKey(k)
            | ManagerError::NotReady(k)
            | ManagerError::NotPinned(k) => Some(*k),
            _ => None,
        }
    }
}

/// One change of the host tier's content, for KV-cache events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadEvent {
    /// The keys concerned (a set; order is the order of the operation).
    pub keys: Vec<ChunkKey>,
    /// True: the keys left the tier. False: they were stored.
    pub removed: bool,
    /// True for the cleanup of a failed store: the keys were never announced as
    /// stored, so this removal must not be published as a removed block.
    pub metadata_only: bool,
}

/// Occupancy and usage of the host tier.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ManagerStats {
    /// Total chunk slots.
    pub num_chunks: u32,
    /// Chunks stored and readable (pinned ones included).
    pub cached: u32,
    /// Chunks allocated to a store that has not completed.
    pub pending: u32,
    /// Readable chunks with at least one load in flight.
    pub pinned: u32,
    /// Readable chunks that no load pins (eviction candidates).
    pub evictable: u32,
    /// Slots held back after a stalled store until its late reports arrive.
    pub quarantined: u32,
    /// Slots neither cached, pending nor quarantined.
    pub free: u32,
    /// (pinned + pending) / num_chunks: the part that cannot be evicted.
    pub usage: f64,
    /// pending / num_chunks.
    pub write_usage: f64,
    /// pinned / num_chunks.
    pub read_usage: f64,
    /// Keys dropped by the reuse filter (`store_threshold`).
    pub stores_skipped: u64,
    /// `prepare_store` calls that could not allocate.
    pub allocation_failures: u64,
    /// Keys given to `complete_store` that were not pending in the tier
    /// (never prepared, evicted, failed, reset, or already stored): ignored,
    /// as vLLM ignores them.
    pub ignored_complete_keys: u64,
    /// Events dropped because `take_events` was not called for a long time.
    pub dropped_events: u64,
}
