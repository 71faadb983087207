//! Synchronization primitives the model-checked code uses: `std`'s normally,
//! loom's when compiled with `RUSTFLAGS="--cfg loom"` (the tokio convention),
//! so that `loom::model` explores every interleaving of their operations.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};
