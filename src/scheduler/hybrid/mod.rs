//! Several KV cache groups (vLLM's hybrid manager: full-attention,
//! sliding-window, chunked-local attention and recurrent-state (Mamba)
//! groups side by side), built
//! step by step after `docs/hybrid-groups.md`'s plan.
//!
//! The pure functions: the groups' shapes ([`GroupShape`]), the lookup of a
//! request's hit over every group ([`lookup_complete_chunks`], vLLM 0.33.0's
//! `_lookup_complete_chunks`), the blocks a load fills in each group
//! ([`plan_load`], its `update_state_after_alloc`) and the chunks a store
//! offers in each group ([`store_candidates`], its `_build_store_jobs` with
//! the sliding-window reachable-block mask), each checked against vLLM's own
//! answers recorded in `python/tests/corpus/hybrid`. The
//! [`Scheduler`](super::Scheduler) built by
//! [`with_groups`](super::Scheduler::with_groups) uses them
//! (`on_lookup.rs`, `on_alloc.rs`, `on_step.rs`): per-group block tables and
//! store cursors, one load or store job carrying every group's part
//! ([`GroupSpan`](super::GroupSpan)), recurrent states handed over by
//! vLLM's core (`boundary_store.rs`) and inside a block (partial tails,
//! `partial_tail.rs`), sliding-window fences from a store's
//! creation, stale window blocks dropped. A worker moves each group's part
//! over that group's tensors
//! ([`WorkerLayout::with_groups`](crate::worker::WorkerLayout::with_groups)).

mod boundary_store;
mod groups;
mod holes;
mod load;
mod lookup;
mod on_alloc;
mod on_lookup;
mod on_remote;
mod on_remote_tail;
mod on_step;
mod partial_tail;
mod recorded_keys;
mod shape;
mod store;
mod window_index;

pub use boundary_store::BoundaryState;
pub(crate) use groups::SchedulerGroups;
pub use groups::{KvGroups, KvGroupsError};
pub use load::{GpuBlock, GroupLoad, LoadPlanError, plan_load};
pub use lookup::{
    GroupKeys, HybridLookup, KeyState, lookup_complete_chunks, lookup_complete_chunks_with_ends,
};
pub use on_alloc::GroupAlloc;
pub(crate) use partial_tail::PartialTails;
pub use partial_tail::{
    BridgeAnswer, PartialAnswer, PartialLookup, PartialTailKey, lookup_partial_tail,
    lookup_partial_tail_bridged,
};
pub use recorded_keys::{RecordedKeys, UnknownKeyLetter};
pub use shape::{Attention, GroupShape, GroupShapeError};
pub use store::{
    Retention, StorePolicy, StoreRequest, StoreView, alignment_tokens, store_candidates,
};
pub(crate) use window_index::WindowIndex;
