//! The tests' check of a transfer's bytes: the destination holds the
//! source's bytes at every page the transfer moves, and the poison byte
//! everywhere else.
//!
//! Test binaries include it alone:
//!
//! ```ignore
//! #[path = "common/pages.rs"]
//! mod pages;
//! ```
#![allow(dead_code)]

use kvoffload::Direction;

/// Checks that `dst` (read after a transfer in `dir`) holds `src`'s bytes
/// at each `(gpu offset, host offset, bytes)` page and `poison` elsewhere;
/// the first difference as the error.
pub fn moved_exactly(
    src: &[u8],
    mut dst: Vec<u8>,
    pages: &[(usize, usize, usize)],
    dir: Direction,
    poison: u8,
) -> Result<(), String> {
    for &(g, h, n) in pages {
        let (so, doff) = match dir {
            Direction::Store => (g, h),
            Direction::Load => (h, g),
        };
        if dst[doff..doff + n] != src[so..so + n] {
            return Err(format!("{dir} page src {so} dst {doff}: bytes differ"));
        }
        dst[doff..doff + n].fill(poison);
    }
    match dst.iter().position(|&x| x != poison) {
        Some(at) => Err(format!(
            "{dir}: bytes outside the spec were written (at {at})"
        )),
        None => Ok(()),
    }
}
