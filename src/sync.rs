//! Synchronization primitives the model-checked code uses: `std`'s normally,
//! loom's when compiled with `RUSTFLAGS="--cfg loom"` (the tokio convention),
//! so that `loom::model` explores every interleaving of their operations.
//! The job table ([`crate::scheduler`]'s `JobTable`), the watchdog's deadline
//! queue and hand-over queue, and the job latch are built on these.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};
