//! The small trait a remote store implements, and its errors.
//!
//! Redis (standalone or cluster, [`super::RedisStore`]) is the first
//! implementation; Mooncake, NIXL or an object store can follow by
//! implementing these four calls. Calls are blocking and batched: the tier
//! runs them on its own I/O thread ([`super::RemoteTier`]), never on the
//! engine's step.
//!
//! Results are per item, because a store may fail for some keys and not
//! others (a cluster with one master down still serves the other masters'
//! slots).

use crate::clock::SharedClock;
use thiserror::Error;

/// Why a store call failed.
///
/// Messages never contain credentials: implementations build them from the
/// store's own error text with any password removed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StoreError {
    /// The store (or the node holding the key) cannot be reached, or timed
    /// out: the tier backs off and retries; reads count as misses.
    #[error("remote store unavailable: {0}")]
    Unavailable(String),
    /// The credentials were refused: a configuration error, never retried.
    #[error("remote store refused the credentials: {0}")]
    Auth(String),
    /// The configuration cannot work (a bad URL, a missing CA file).
    #[error("remote store configuration: {0}")]
    Config(String),
    /// The store answered something unexpected for this item (a wrong type,
    /// an out-of-memory refusal): this item fails, the connection is kept.
    #[error("remote store refused the operation: {0}")]
    Refused(String),
}

impl StoreError {
    /// Whether the error means the connection should be dropped and retried
    /// with backoff.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }
}

/// The outcome of one item of a batched call.
pub type ItemResult<T> = Result<T, StoreError>;

/// A key-value store holding remote chunk values.
pub trait RemoteStore: Send {
    /// Writes every `(key, value)` pair; one result per pair, in order.
    fn put_many(&mut self, items: &[(&str, &[u8])]) -> Vec<ItemResult<()>>;

    /// Reads every key; `Ok(None)` where the key is absent (never written,
    /// or evicted by the store's own policy). One result per key, in order.
    fn get_many(&mut self, keys: &[&str]) -> Vec<ItemResult<Option<Vec<u8>>>>;

    /// Whether each key exists; one result per key, in order.
    fn exists_many(&mut self, keys: &[&str]) -> Vec<ItemResult<bool>>;

    /// Checks that the store answers (used after a reconnect).
    fn ping(&mut self) -> Result<(), StoreError>;
}

/// Opens connections to a store: called at start and at every retry after
/// the store became unavailable.
pub trait StoreConnector: Send {
    /// A fresh connection, or why none could be made.
    fn connect(&mut self) -> Result<Box<dyn RemoteStore>, StoreError>;

    /// Where it connects, with any password removed (for logs and errors).
    fn describe(&self) -> String;

    /// The tier's clock, for the store's own waits (a Redis Cluster master
    /// that could not be reached is skipped for a while); called before the
    /// first [`Self::connect`]. Default: unused.
    fn set_clock(&mut self, _clock: SharedClock) {}
}
