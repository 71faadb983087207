//! An in-process [`RemoteStore`] with fault switches: for tests and
//! examples of the remote tier without a server (the tier's own logic:
//! queueing, deadlines, reconnection, value checks). Real-store behaviour is
//! tested against real Redis servers (`tests/remote_redis.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::store::{ItemResult, RemoteStore, StoreConnector, StoreError};

/// The shared state of a [`MemoryStore`]: its keys and its fault switches.
#[derive(Debug, Default)]
pub struct MemoryState {
    map: Mutex<HashMap<String, Vec<u8>>>,
    down: AtomicBool,
    refuse_credentials: AtomicBool,
    held: Mutex<bool>,
    released: Condvar,
    calls_entered: AtomicU64,
    entered: Condvar,
    connects: AtomicU64,
}

impl MemoryState {
    /// A new, empty, healthy store.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn map(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        match self.map.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn held(&self) -> MutexGuard<'_, bool> {
        match self.held.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Makes every call (and connection) fail as unreachable, or heals it.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// Makes connections fail as refused credentials.
    pub fn set_refuse_credentials(&self, refuse: bool) {
        self.refuse_credentials.store(refuse, Ordering::SeqCst);
    }

    /// Holds every call until [`Self::release`] (a stalled store).
    pub fn hold(&self) {
        *self.held() = true;
    }

    /// Lets held calls go on.
    pub fn release(&self) {
        *self.held() = false;
        self.released.notify_all();
    }

    /// Waits until at least `n` calls have entered the store (held or not).
    pub fn wait_calls_entered(&self, n: u64) {
        let mut g = self.held();
        while self.calls_entered.load(Ordering::SeqCst) < n {
            g = match self.entered.wait(g) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
    }

    /// Connections opened so far.
    pub fn connects(&self) -> u64 {
        self.connects.load(Ordering::SeqCst)
    }

    /// Writes a raw value (as another writer, or corruption, would).
    pub fn insert_raw(&self, key: &str, value: Vec<u8>) {
        self.map().insert(key.to_string(), value);
    }

    /// A stored value.
    pub fn get_raw(&self, key: &str) -> Option<Vec<u8>> {
        self.map().get(key).cloned()
    }

    /// Deletes a key (as the store's eviction would).
    pub fn remove(&self, key: &str) -> bool {
        self.map().remove(key).is_some()
    }

    /// Keys stored.
    pub fn len(&self) -> usize {
        self.map().len()
    }

    /// Whether no key is stored.
    pub fn is_empty(&self) -> bool {
        self.map().is_empty()
    }

    /// Counts the call, waits while held, then fails if down.
    fn enter(&self) -> Result<(), StoreError> {
        let mut g = self.held();
        self.calls_entered.fetch_add(1, Ordering::SeqCst);
        self.entered.notify_all();
        while *g {
            g = match self.released.wait(g) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
        drop(g);
        if self.down.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable("memory store is down".into()));
        }
        Ok(())
    }
}

/// A connection to a [`MemoryState`].
#[derive(Debug)]
pub struct MemoryStore {
    state: Arc<MemoryState>,
}

impl RemoteStore for MemoryStore {
    fn put_many(&mut self, items: &[(&str, &[u8])]) -> Vec<ItemResult<()>> {
        if let Err(e) = self.state.enter() {
            return items.iter().map(|_| Err(e.clone())).collect();
        }
        let mut m = self.state.map();
        items
            .iter()
            .map(|&(k, v)| {
                m.insert(k.to_string(), v.to_vec());
                Ok(())
            })
            .collect()
    }

    fn get_many(&mut self, keys: &[&str]) -> Vec<ItemResult<Option<Vec<u8>>>> {
        if let Err(e) = self.state.enter() {
            return keys.iter().map(|_| Err(e.clone())).collect();
        }
        let m = self.state.map();
        keys.iter().map(|k| Ok(m.get(*k).cloned())).collect()
    }

    fn exists_many(&mut self, keys: &[&str]) -> Vec<ItemResult<bool>> {
        if let Err(e) = self.state.enter() {
            return keys.iter().map(|_| Err(e.clone())).collect();
        }
        let m = self.state.map();
        keys.iter().map(|k| Ok(m.contains_key(*k))).collect()
    }

    fn ping(&mut self) -> Result<(), StoreError> {
        if self.state.down.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable("memory store is down".into()));
        }
        Ok(())
    }
}

/// Opens [`MemoryStore`] connections (failing as the switches say).
#[derive(Debug, Clone)]
pub struct MemoryConnector {
    state: Arc<MemoryState>,
}

impl MemoryConnector {
    /// A connector to `state`.
    pub fn new(state: Arc<MemoryState>) -> Self {
        Self { state }
    }
}

impl StoreConnector for MemoryConnector {
    fn connect(&mut self) -> Result<Box<dyn RemoteStore>, StoreError> {
        if self.state.refuse_credentials.load(Ordering::SeqCst) {
            return Err(StoreError::Auth("WRONGPASS (memory store)".into()));
        }
        if self.state.down.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable("memory store is down".into()));
        }
        self.state.connects.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(MemoryStore {
            state: self.state.clone(),
        }))
    }

    fn describe(&self) -> String {
        "memory store".into()
    }
}
