//! Backward-shift deletion, shared by the linear-probing tables
//! (`key_index`, `slot_index`): after a removal, each later entry of the
//! cluster moves back into the hole if the hole lies between its home and its
//! position, so no tombstones are needed and probes stay short.

/// Empties `entries[hole]` and closes the gap. `home` gives an occupied
/// entry's home position, or `None` for a vacant entry (the end of the
/// cluster); `vacant` is what an empty entry holds. `mask` is the table size
/// minus one (a power of two).
#[inline]
pub(crate) fn remove_at<E: Copy>(
    entries: &mut [E],
    mask: usize,
    mut hole: usize,
    vacant: E,
    home: impl Fn(&E) -> Option<usize>,
) {
    let mut j = hole;
    loop {
        j = (j + 1) & mask;
        let e = entries[j];
        let Some(h) = home(&e) else {
            break;
        };
        if (j.wrapping_sub(h) & mask) >= (j.wrapping_sub(hole) & mask) {
            entries[hole] = e;
            hole = j;
        }
    }
    entries[hole] = vacant;
}
