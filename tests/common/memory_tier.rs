//! A remote tier on the in-memory store, for scheduler tests: the tier a
//! scheduler attaches, and the shares write-through would leave in it.

use std::sync::Arc;

use kvoffload::remote::value::{ValueIdentity, encode};
use kvoffload::remote::{
    MemoryConnector, MemoryState, Namespace, RemoteTier, RemoteTierConfig, WritePolicy,
};
use kvoffload::{ChunkKey, ManualClock};

/// An in-memory store and the namespace its values are keyed in.
pub struct MemoryStore {
    pub state: Arc<MemoryState>,
    pub ns: Namespace,
}

impl MemoryStore {
    /// An empty store in namespace `fingerprint`.
    pub fn new(fingerprint: u64) -> Self {
        Self {
            state: MemoryState::new(),
            ns: Namespace::from_fingerprint(fingerprint),
        }
    }

    /// A tier over this store for `world` workers, written by `write`, on
    /// `clock`.
    pub fn tier(&self, world: u32, write: WritePolicy, clock: &ManualClock) -> RemoteTier {
        RemoteTier::start(
            Box::new(MemoryConnector::new(self.state.clone())),
            &RemoteTierConfig {
                write,
                ..RemoteTierConfig::default()
            },
            self.ns.clone(),
            world,
            clock.shared(),
        )
        .expect("tier")
    }

    /// Worker `rank`'s share of `k` (64 bytes of `fill`), as write-through
    /// leaves it.
    pub fn put_share(&self, k: ChunkKey, rank: u32, fill: u8) {
        let id = ValueIdentity {
            namespace: self.ns.fingerprint(),
            key: k.0,
            rank,
        };
        self.state
            .insert_raw(&self.ns.key(k.0, rank), encode(id, &[fill; 64]));
    }
}
