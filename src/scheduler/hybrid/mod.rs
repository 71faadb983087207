//! Several KV cache groups (vLLM's hybrid manager: full-attention and
//! sliding-window groups side by side), built step by step after
//! `docs/hybrid-groups.md`'s plan.
//!
//! What exists: the groups' shapes ([`GroupShape`]), the lookup of a
//! request's hit over every group ([`lookup_complete_chunks`], vLLM 0.33.0's
//! `_lookup_complete_chunks`), the blocks a load fills in each group
//! ([`plan_load`], its `update_state_after_alloc`) and the chunks a store
//! offers in each group ([`store_candidates`], its `_build_store_jobs` with
//! the sliding-window reachable-block mask), checked against vLLM's own
//! answers recorded in `python/tests/corpus/hybrid`. The [`Scheduler`](super::Scheduler) does not
//! use them yet: it offloads one full-attention group, and the vLLM connector
//! refuses a hybrid configuration.

mod load;
mod lookup;
mod recorded_keys;
mod shape;
mod store;

pub use load::{GpuBlock, GroupLoad, LoadPlanError, plan_load};
pub use lookup::{GroupKeys, HybridLookup, KeyState, lookup_complete_chunks};
pub use recorded_keys::{RecordedKeys, UnknownKeyLetter};
pub use shape::{GroupShape, GroupShapeError};
pub use store::{
    Retention, StorePolicy, StoreRequest, StoreView, alignment_tokens, store_candidates,
};
