//! Distinct pseudo-random ids for the data-plane benchmarks (xorshift, fixed
//! seed: every run moves the same blocks).

/// `n` distinct pseudo-random ids in `lo..hi`.
pub fn scattered(seed: u64, n: usize, lo: u32, hi: u32) -> Vec<u32> {
    let mut all: Vec<u32> = (lo..hi).collect();
    let mut s = seed;
    for i in (1..all.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        all.swap(i, (s % (i as u64 + 1)) as usize);
    }
    all.truncate(n);
    all
}
