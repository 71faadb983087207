//! The tests' one random number generator: xorshift64*, small, fast and
//! deterministic (a seed fixes the whole sequence). The seed must not be 0.
//!
//! Test binaries that do not use `common/mod.rs` include it alone:
//!
//! ```ignore
//! #[path = "common/rng.rs"]
//! mod rng;
//! ```
#![allow(dead_code)]

/// xorshift64*: deterministic random data, ids and choices.
pub struct Rng(pub u64);

impl Rng {
    /// The generator seeded with `seed` (non-zero).
    pub fn new(seed: u64) -> Self {
        debug_assert_ne!(seed, 0, "xorshift64* needs a non-zero seed");
        Self(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A value in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }

    /// `n` distinct values in `lo..hi`, in random order.
    pub fn distinct(&mut self, n: usize, lo: u32, hi: u32) -> Vec<u32> {
        let mut all: Vec<u32> = (lo..hi).collect();
        for i in (1..all.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            all.swap(i, j);
        }
        all.truncate(n);
        all
    }
}
