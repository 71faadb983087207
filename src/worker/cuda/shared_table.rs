//! The strategy table the CUDA workers read on every submit, replaceable
//! while they run: `bench --calibrate` or a reload swaps a new table in, and
//! the read path takes no lock.
//!
//! Built on crossbeam-epoch: a reader pins the current epoch, loads the
//! table's pointer and answers from it; [`SharedStrategyTable::replace`]
//! swaps the pointer and defers freeing the old table until every thread
//! pinned before the swap has unpinned. A reader therefore sees either the
//! old table or the new one, whole, and a table is never freed under it. A
//! lock would do the same job, but a submit would then wait behind a reload
//! (and behind every other worker thread's submit, on a `Mutex`), and the
//! data plane's threads are the ones that must never wait.

use std::sync::atomic::Ordering;

use crossbeam_epoch::{self as epoch, Atomic, Owned};

use super::strategy::{Strategy, StrategyTable};
use crate::Direction;

/// A table and the number of replacements before it.
#[derive(Debug)]
struct Versioned {
    table: StrategyTable,
    version: u64,
}

/// A [`StrategyTable`] shared by worker threads and replaceable at run time.
#[derive(Debug)]
pub struct SharedStrategyTable {
    /// Never null: set at construction, only ever swapped for another table.
    current: Atomic<Versioned>,
}

impl SharedStrategyTable {
    /// Starts with `table` (version 0).
    pub fn new(table: StrategyTable) -> Self {
        Self {
            current: Atomic::new(Versioned { table, version: 0 }),
        }
    }

    /// Runs `f` on the current table and its version, without a lock.
    fn read<T>(&self, f: impl FnOnce(&StrategyTable, u64) -> T) -> T {
        let guard = epoch::pin();
        let shared = self.current.load(Ordering::Acquire, &guard);
        // SAFETY: `current` is never null (see the field). The pointee stays
        // allocated while `guard` is pinned: `replace` frees a table only
        // through `defer_destroy`, after every thread pinned before the swap
        // (this one included) has unpinned, and `drop` runs only when no
        // reader can exist (`&mut self`).
        let v = unsafe { shared.deref() };
        f(&v.table, v.version)
    }

    /// The strategy for a job ([`StrategyTable::choose`] on the current table).
    pub fn choose(
        &self,
        direction: Direction,
        bytes_per_descriptor: u64,
        descriptors: usize,
    ) -> Strategy {
        self.read(|t, _| t.choose(direction, bytes_per_descriptor, descriptors))
    }

    /// A copy of the current table.
    pub fn snapshot(&self) -> StrategyTable {
        self.read(|t, _| t.clone())
    }

    /// How many times the table was replaced.
    pub fn version(&self) -> u64 {
        self.read(|_, v| v)
    }

    /// Swaps `table` in; readers already answering from the old one finish
    /// with it, later ones see the new one. Returns the new version.
    pub fn replace(&self, table: StrategyTable) -> u64 {
        let guard = epoch::pin();
        // Versions stay ordered under concurrent replacements: each one
        // publishes the version after the table it displaced.
        let mut new = Owned::new(Versioned { table, version: 0 });
        loop {
            let old = self.current.load(Ordering::Acquire, &guard);
            // SAFETY: as in `read`: non-null and alive while `guard` is pinned.
            new.version = unsafe { old.deref() }.version + 1;
            match self.current.compare_exchange(
                old,
                new,
                Ordering::AcqRel,
                Ordering::Acquire,
                &guard,
            ) {
                Ok(installed) => {
                    // SAFETY: `old` is no longer reachable from `current`, so
                    // no reader pinned after this point can load it; readers
                    // pinned before hold guards, and the epoch scheme frees it
                    // only after they unpin. It is deferred exactly once: only
                    // the thread whose exchange displaced it gets here.
                    unsafe { guard.defer_destroy(old) };
                    // SAFETY: `installed` was just published and is not freed
                    // while `guard` is pinned.
                    return unsafe { installed.deref() }.version;
                }
                Err(e) => new = e.new,
            }
        }
    }
}

impl Drop for SharedStrategyTable {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no other thread can be reading or replacing,
        // so the current table is reclaimed here directly (tables displaced
        // earlier were handed to the epoch collector by `replace`).
        unsafe {
            let current = self.current.swap(
                epoch::Shared::null(),
                Ordering::Relaxed,
                epoch::unprotected(),
            );
            if !current.is_null() {
                drop(current.into_owned());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64};

    use super::*;

    #[test]
    fn a_replacement_is_seen_with_its_version() {
        let t = SharedStrategyTable::new(StrategyTable::always(Strategy::Dma));
        assert_eq!(t.version(), 0);
        assert_eq!(t.choose(Direction::Store, 4096, 64), Strategy::Dma);
        assert_eq!(t.replace(StrategyTable::always(Strategy::KernelGraph)), 1);
        assert_eq!(t.choose(Direction::Load, 4096, 64), Strategy::KernelGraph);
        assert_eq!(t.snapshot(), StrategyTable::always(Strategy::KernelGraph));
        assert_eq!(t.version(), 1);
    }

    /// Readers on several threads while another thread keeps replacing the
    /// table: every answer comes from one whole table (each table answers
    /// the strategy its version names), versions never go back for a
    /// reader, and every table is freed once (Miri checks the frees).
    #[test]
    fn readers_see_whole_tables_while_a_writer_replaces_them() {
        let strategy_of = |version: u64| Strategy::ALL[(version % 4) as usize];
        let table_for = |version: u64| {
            // Two rules that must agree: a torn or freed table would not.
            let mut t = StrategyTable::always(strategy_of(version));
            t.rules.push(super::super::strategy::StrategyRule {
                direction: None,
                min_bytes_per_descriptor: 0,
                max_bytes_per_descriptor: None,
                min_descriptors: 0,
                max_descriptors: None,
                strategy: strategy_of(version),
            });
            t
        };
        let shared = Arc::new(SharedStrategyTable::new(table_for(0)));
        let replacements: u64 = if cfg!(miri) { 20 } else { 2_000 };
        let done = Arc::new(AtomicBool::new(false));
        let reads = Arc::new(AtomicU64::new(0));
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let (shared, done, reads) = (shared.clone(), done.clone(), reads.clone());
                std::thread::spawn(move || {
                    let mut last = 0;
                    while !done.load(Ordering::Acquire) {
                        let (strategy, version) = shared.read(|t, v| {
                            let a = t.choose(Direction::Store, 4096, 16);
                            let b = t.fallback;
                            assert_eq!(a, b, "one table: rule and fallback agree");
                            (a, v)
                        });
                        assert_eq!(strategy, strategy_of(version));
                        assert!(version >= last, "version went back: {version} < {last}");
                        last = version;
                        reads.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for v in 1..=replacements {
            assert_eq!(shared.replace(table_for(v)), v);
            if v % 10 == 0 {
                // Let the readers in between replacements.
                let seen = reads.load(Ordering::Relaxed);
                while reads.load(Ordering::Relaxed) < seen + 3 {
                    std::thread::yield_now();
                }
            }
        }
        done.store(true, Ordering::Release);
        for r in readers {
            r.join().unwrap();
        }
        assert_eq!(shared.version(), replacements);
        assert!(reads.load(Ordering::Relaxed) > 0);
    }
}
