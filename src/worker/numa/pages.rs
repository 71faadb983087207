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

    /// The node holding the most sampled pages (the lowest-numbered of a
    /// tie), with their count; `None` where no sampled page is present.
    pub fn most(&self) -> Option<(NumaNode, usize)> {
        self.by_node
            .iter()
            .filter(|(_, c)| **c > 0)
            .fold(None, |best, (n, c)| match best {
                Some((_, b)) if b >= *c => best,
                _ => Some((*n, *c)),
            })
    }

    /// Adds another sample's counts (of another range).
    pub fn add(&mut self, other: &PageNodes) {
        self.sampled += other.sampled;
        for (n, c) in &other.by_node {
            *self.by_node.entry(*n).or_insert(0) += c;
        }
        self.absent += other.absent;
        self.unknown += other.unknown;
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

/// The nodes of up to `max_samples` pages spread over `ranges`
/// (`(address, bytes)`), each range sampled in proportion to its size (at
/// least one page each).
pub fn sample_ranges_nodes(ranges: &[(usize, usize)], max_samples: usize) -> PageNodes {
    let total: usize = ranges.iter().map(|r| r.1).sum();
    let mut out = PageNodes::default();
    for &(addr, len) in ranges {
        let share = (max_samples as u128 * len as u128)
            .checked_div(total as u128)
            .unwrap_or(0);
        let n = usize::try_from(share).unwrap_or(max_samples).max(1);
        out.add(&sample_page_nodes(addr, len, n));
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
    fn most_names_the_node_of_the_most_pages_and_ranges_add_up() {
        let mut p = PageNodes {
            sampled: 10,
            by_node: [(NumaNode(0), 3), (NumaNode(1), 6), (NumaNode(2), 0)].into(),
            absent: 1,
            unknown: 0,
        };
        assert_eq!(p.most(), Some((NumaNode(1), 6)));
        p.by_node.insert(NumaNode(0), 6);
        assert_eq!(p.most(), Some((NumaNode(0), 6)), "a tie: the lower node");
        assert_eq!(PageNodes::default().most(), None);
        let absent = PageNodes {
            sampled: 4,
            absent: 4,
            ..PageNodes::default()
        };
        assert_eq!(absent.most(), None, "no page present");
        let ps = page_size();
        let (a, b) = (Anon::new(8 * ps), Anon::new(24 * ps));
        for i in 0..24 {
            // SAFETY: inside the mapping.
            unsafe { *(b.0 as *mut u8).add(i * ps) = 1 };
        }
        let both = sample_ranges_nodes(&[(a.0 as usize, 8 * ps), (b.0 as usize, 24 * ps)], 16);
        // 4 samples of the first range (untouched), 12 of the second.
        assert_eq!((both.sampled, both.absent), (16, 4), "{both}");
        assert_eq!(both.by_node.values().sum::<usize>(), 12, "{both}");
        assert_eq!(sample_ranges_nodes(&[], 16), PageNodes::default());
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
