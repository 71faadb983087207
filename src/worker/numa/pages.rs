//! Where the pages of a range of memory live, by sampling: `move_pages`
//! with no target nodes only reports each page's node.

use std::collections::BTreeMap;
use std::fmt;

use super::NumaNode;

/// The nodes of a sample of a range's pages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageNodes {
    /// Pages sampled.
    pub sampled: usize,
    /// Sampled pages present in memory, by node.
    pub by_node: BTreeMap<NumaNode, usize>,
    /// Sampled pages not in memory yet (never touched).
    pub absent: usize,
    /// Sampled pages whose node the system would not say (a driver's
    /// mapping, or `move_pages` refused).
    pub unknown: usize,
}

impl PageNodes {
    /// Sampled pages on `node`.
    pub fn on(&self, node: NumaNode) -> usize {
        self.by_node.get(&node).copied().unwrap_or(0)
    }

    /// Sampled pages present on nodes other than `node`.
    pub fn elsewhere(&self, node: NumaNode) -> usize {
        self.by_node
            .iter()
            .filter(|(n, _)| **n != node)
            .map(|(_, c)| c)
            .sum()
    }
}

impl fmt::Display for PageNodes {
    /// `4096 sampled pages: node 0 4000, node 1 96, 0 absent, 0 unknown`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} sampled pages:", self.sampled)?;
        for (n, c) in &self.by_node {
            write!(f, " {n} {c},")?;
        }
        write!(f, " {} absent, {} unknown", self.absent, self.unknown)
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory effects.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p)
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

/// The nodes of up to `max_samples` pages spread evenly over
/// `addr..addr + len`. Only asks: it moves nothing and reads no memory, so
/// any range is safe to ask about (pages not mapped count as unknown).
pub fn sample_page_nodes(addr: usize, len: usize, max_samples: usize) -> PageNodes {
    let ps = page_size();
    let first = addr & !(ps - 1);
    let end = addr.saturating_add(len);
    let pages = end.saturating_sub(first).div_ceil(ps);
    let n = pages.min(max_samples);
    let mut out = PageNodes {
        sampled: n,
        ..PageNodes::default()
    };
    if n == 0 {
        return out;
    }
    let addrs: Vec<*mut libc::c_void> = (0..n)
        .map(|i| (first + (i * pages / n) * ps) as *mut libc::c_void)
        .collect();
    let mut status = vec![0 as libc::c_int; n];
    // SAFETY: `addrs` and `status` hold `n` entries each; with no target
    // nodes the call only writes each page's node (or -errno) to `status`.
    let r = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0 as libc::c_int,
            n as libc::c_ulong,
            addrs.as_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0 as libc::c_int,
        )
    };
    if r != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "move_pages refused");
        out.unknown = n;
        return out;
    }
    for s in status {
        match u32::try_from(s) {
            Ok(node) => *out.by_node.entry(NumaNode(node)).or_insert(0) += 1,
            Err(_) if s == -libc::ENOENT => out.absent += 1,
            Err(_) => out.unknown += 1,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `len` bytes of fresh anonymous memory, unmapped on drop.
    struct Anon(*mut libc::c_void, usize);
    impl Anon {
        fn new(len: usize) -> Self {
            // SAFETY: a fresh private anonymous mapping; checked below.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            Self(p, len)
        }
    }
    impl Drop for Anon {
        fn drop(&mut self) {
            // SAFETY: mapped in `new` with this length.
            unsafe { libc::munmap(self.0, self.1) };
        }
    }

    #[test]
    fn untouched_pages_are_absent_and_touched_ones_have_a_node() {
        let ps = page_size();
        let m = Anon::new(64 * ps);
        let before = sample_page_nodes(m.0 as usize, 64 * ps, 1000);
        assert_eq!(before.sampled, 64);
        assert_eq!(before.absent, 64, "{before}");
        // Touch the first half.
        for i in 0..32 {
            // SAFETY: inside the mapping.
            unsafe { *(m.0 as *mut u8).add(i * ps) = 1 };
        }
        let after = sample_page_nodes(m.0 as usize, 64 * ps, 1000);
        assert_eq!(after.absent, 32, "{after}");
        assert_eq!(after.by_node.values().sum::<usize>(), 32, "{after}");
        assert_eq!(after.unknown, 0);
        // Sampling spreads over the range: 8 samples, 4 in each half.
        let few = sample_page_nodes(m.0 as usize, 64 * ps, 8);
        assert_eq!((few.sampled, few.absent), (8, 4), "{few}");
    }

    #[test]
    fn a_range_not_mapped_is_unknown_and_an_empty_one_has_no_sample() {
        let ps = page_size();
        // Page 1: below the lowest address Linux lets a process map.
        let addr = ps;
        let gone = sample_page_nodes(addr, 4 * ps, 16);
        assert_eq!((gone.sampled, gone.unknown), (4, 4), "{gone}");
        assert_eq!(sample_page_nodes(addr, 0, 16), PageNodes::default());
    }
}
