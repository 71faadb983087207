//! Deciding where a pool goes, binding the allocating thread there, and
//! reporting where the pool's pages went.

use std::fmt;

use super::{
    HostPlacement, NodeBoundThread, NodeCpus, NumaError, NumaNode, PageNodes, PciAddress,
    SysfsTopology, sample_page_nodes,
};

/// Pages a report samples (a 64 GiB pool: one page every 16 MiB).
const SAMPLED_PAGES: usize = 4096;

/// What a pool is allocated for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolNear {
    /// No GPU (the host backend).
    NoGpu,
    /// The GPU at this PCI address.
    Gpu(PciAddress),
    /// A GPU whose PCI address the driver did not give (why).
    UnknownGpu(String),
    /// KV caches in host memory (the host backend under CPU inference):
    /// where a sample of their pages is. `auto` places the pool on the node
    /// holding most of them, so that both sides of every copy are local.
    HostCaches(PageNodes),
}

/// Where a pool was placed, why, and where its pages went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolPlacement {
    /// What was asked for.
    pub asked: HostPlacement,
    /// The node the pool was placed on; `None`: wherever the kernel put it.
    pub node: Option<NumaNode>,
    /// Why that node, or why none.
    pub reason: String,
    /// Where a sample of the pool's pages is.
    pub pages: PageNodes,
    /// The node's CPUs (empty: not placed, or the node's CPUs are unknown).
    pub cpus: Vec<usize>,
}

impl PoolPlacement {
    /// Sampled pages of a placed pool that are on another node (the node
    /// ran out of memory, or the pages were there before the placement).
    pub fn pages_elsewhere(&self) -> usize {
        self.node.map_or(0, |n| self.pages.elsewhere(n))
    }

    /// The pool's node and its CPUs, where the threads that copy to and
    /// from the pool belong; `None` where the pool was not placed.
    pub fn home(&self) -> Option<NodeCpus> {
        self.node.map(|node| NodeCpus {
            node,
            cpus: self.cpus.clone(),
        })
    }
}

impl fmt::Display for PoolPlacement {
    /// `node 1 (GPU 0000:3b:00.0 is on node 1): 4096 of 4096 sampled pages
    /// there` (and the others' whereabouts where some are not), or `not
    /// placed (one NUMA node online): 4096 sampled pages: node 0 4096, 0
    /// absent, 0 unknown`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.pages;
        match self.node {
            Some(n) => {
                write!(
                    f,
                    "{n} ({}): {} of {} sampled pages there",
                    self.reason,
                    p.on(n),
                    p.sampled
                )?;
                if p.on(n) < p.sampled {
                    write!(
                        f,
                        ", {} on other nodes, {} absent, {} unknown",
                        p.elsewhere(n),
                        p.absent,
                        p.unknown
                    )?;
                }
                Ok(())
            }
            None => write!(f, "not placed ({}): {p}", self.reason),
        }
    }
}

/// The allocating thread's binding while a pool is allocated
/// ([`enter`]); [`PlacementGuard::finish`] ends it and reports.
#[derive(Debug)]
pub struct PlacementGuard {
    asked: HostPlacement,
    node: Option<NumaNode>,
    reason: String,
    cpus: Vec<usize>,
    bound: Option<NodeBoundThread>,
}

impl PlacementGuard {
    fn unplaced(asked: HostPlacement, reason: impl Into<String>) -> Self {
        Self {
            asked,
            node: None,
            reason: reason.into(),
            cpus: Vec::new(),
            bound: None,
        }
    }

    /// The node the calling thread is bound to, if any.
    pub fn node(&self) -> Option<NumaNode> {
        self.node
    }

    /// Ends the binding (the thread's policy and CPUs are as before) and
    /// reports where the `len` bytes at `addr`, the pool allocated
    /// meanwhile, went.
    pub fn finish(mut self, addr: usize, len: usize) -> PoolPlacement {
        drop(self.bound.take());
        let p = PoolPlacement {
            asked: self.asked,
            node: self.node,
            reason: std::mem::take(&mut self.reason),
            pages: sample_page_nodes(addr, len, SAMPLED_PAGES),
            cpus: std::mem::take(&mut self.cpus),
        };
        if p.pages_elsewhere() > 0 {
            tracing::warn!(placement = %p, "host pool: some pages are not on its node");
        } else {
            tracing::info!(placement = %p, "host pool placement");
        }
        p
    }
}

/// Decides where a pool for `near` (its GPU, or none on the host backend)
/// goes for `asked`, and binds the calling thread there until
/// [`PlacementGuard::finish`]. Allocate the pool on this thread meanwhile.
///
/// `auto` never fails: where it cannot place the pool it says why in the
/// report (logged). A node asked for by number fails where it is not
/// online or the system refuses the binding.
pub fn enter(
    asked: HostPlacement,
    near: &PoolNear,
    topo: &SysfsTopology,
) -> Result<PlacementGuard, NumaError> {
    match asked {
        HostPlacement::Off => Ok(PlacementGuard::unplaced(asked, "placement off")),
        HostPlacement::Node(node) => {
            let online = topo.online_nodes()?;
            if !online.contains(&node) {
                return Err(NumaError::NodeNotOnline { node, online });
            }
            let cpus = topo.node_cpus(node)?;
            let bound = NodeBoundThread::enter(node, &cpus)?;
            Ok(PlacementGuard {
                asked,
                node: Some(node),
                reason: "asked for".to_string(),
                cpus,
                bound: Some(bound),
            })
        }
        HostPlacement::Auto => Ok(auto(near, topo)),
    }
}

/// The nodes online where there are several, or why placing is moot.
fn several_nodes(topo: &SysfsTopology) -> Result<Vec<NumaNode>, String> {
    match topo.online_nodes() {
        Ok(o) if o.len() <= 1 => Err("one NUMA node online".to_string()),
        Ok(o) => Ok(o),
        Err(e) => Err(format!("NUMA nodes unknown: {e}")),
    }
}

/// `auto`: the node of what the pool copies with (its GPU, or KV caches in
/// host memory), or the reason there is none.
fn auto(near: &PoolNear, topo: &SysfsTopology) -> PlacementGuard {
    let asked = HostPlacement::Auto;
    let unplaced = |why: String| PlacementGuard::unplaced(asked, why);
    let (node, why) = match near {
        PoolNear::NoGpu => return unplaced("no GPU to place it near".to_string()),
        PoolNear::UnknownGpu(why) => {
            return unplaced(format!("the GPU's PCI address is unknown: {why}"));
        }
        PoolNear::Gpu(device) => {
            let online = match several_nodes(topo) {
                Ok(o) => o,
                Err(why) => return unplaced(why),
            };
            match topo.device_node(device) {
                Ok(Some(n)) if online.contains(&n) => (n, format!("GPU {device} is on {n}")),
                Ok(Some(n)) => return unplaced(format!("GPU {device} names {n}, not online")),
                Ok(None) => return unplaced(format!("GPU {device} names no NUMA node")),
                Err(e) => {
                    return unplaced(format!("the NUMA node of GPU {device} is unknown: {e}"));
                }
            }
        }
        PoolNear::HostCaches(pages) => {
            let online = match several_nodes(topo) {
                Ok(o) => o,
                Err(why) => return unplaced(why),
            };
            match pages.most() {
                Some((n, k)) if online.contains(&n) => (
                    n,
                    format!(
                        "the KV caches are on {n}: {k} of {} sampled pages",
                        pages.sampled
                    ),
                ),
                Some((n, _)) => return unplaced(format!("the KV caches are on {n}, not online")),
                None => {
                    return unplaced(format!(
                        "no page of the KV caches is in memory yet ({pages})"
                    ));
                }
            }
        }
    };
    let cpus = topo.node_cpus(node).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "the CPUs of the pool's NUMA node are unknown: not pinning them");
        Vec::new()
    });
    match NodeBoundThread::enter(node, &cpus) {
        Ok(bound) => PlacementGuard {
            asked,
            node: Some(node),
            reason: why,
            cpus,
            bound: Some(bound),
        },
        Err(e) => PlacementGuard::unplaced(asked, format!("{why}, but {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::super::sample_ranges_nodes;
    use super::super::thread_policy::preferred_node_of_thread;
    use super::super::topology::tests::fake_sysfs;
    use super::*;
    use crate::worker::HostBuffer;

    const GPU: &str = "0000:3b:00.0";

    fn gpu() -> PciAddress {
        GPU.parse().unwrap()
    }

    /// This machine's first node and its CPUs, as a sysfs list.
    fn real_node0() -> (NumaNode, String) {
        let t = SysfsTopology::system();
        let n = t.online_nodes().unwrap()[0];
        let cpus: Vec<String> = t
            .node_cpus(n)
            .unwrap()
            .iter()
            .map(|c| c.to_string())
            .collect();
        (n, cpus.join(","))
    }

    /// Runs `f` on a thread of its own (placements change the thread).
    fn on_own_thread(f: impl FnOnce() + Send + 'static) {
        std::thread::spawn(f).join().unwrap();
    }

    #[test]
    fn auto_places_the_pool_on_the_gpu_s_node_and_every_sampled_page_is_there() {
        on_own_thread(|| {
            let (n, cpus) = real_node0();
            let other = n.0 + 1;
            let sys = fake_sysfs(
                &format!("{},{other}", n.0),
                &[(n.0, &cpus), (other, "")],
                &[(GPU, &n.0.to_string())],
            );
            let g = enter(
                HostPlacement::Auto,
                &PoolNear::Gpu(gpu()),
                &SysfsTopology::at(sys.path()),
            )
            .unwrap();
            assert_eq!(g.node(), Some(n));
            assert_eq!(preferred_node_of_thread().unwrap(), Some(n));
            let pool = HostBuffer::new(8 << 20).unwrap();
            let p = g.finish(pool.addr() as usize, pool.len());
            assert_eq!(
                preferred_node_of_thread().unwrap(),
                None,
                "finish restores the thread"
            );
            assert_eq!(p.node, Some(n));
            assert_eq!(p.reason, format!("GPU {GPU} is on {n}"));
            assert_eq!(p.pages.sampled, (8 << 20) / 4096);
            assert_eq!(p.pages.on(n), p.pages.sampled, "{p}");
            assert_eq!(
                p.to_string(),
                format!("{n} (GPU {GPU} is on {n}): 2048 of 2048 sampled pages there")
            );
            assert_eq!(p.pages_elsewhere(), 0);
            // Where some pages are elsewhere, the line says where.
            let mut off = p.clone();
            off.pages.by_node.insert(n, 2000);
            off.pages.by_node.insert(NumaNode(n.0 + 1), 40);
            off.pages.absent = 8;
            assert_eq!(off.pages_elsewhere(), 40);
            assert!(
                off.to_string().ends_with(
                    "2000 of 2048 sampled pages there, 40 on other nodes, 8 absent, 0 unknown"
                ),
                "{off}"
            );
        });
    }

    #[test]
    fn auto_places_the_pool_on_the_node_of_kv_caches_in_host_memory() {
        on_own_thread(|| {
            let (n, cpus) = real_node0();
            let other = n.0 + 1;
            let sys = fake_sysfs(
                &format!("{},{other}", n.0),
                &[(n.0, &cpus), (other, "")],
                &[],
            );
            // The KV caches, written (their pages in memory, on this node).
            let caches = HostBuffer::new(4 << 20).unwrap();
            // SAFETY: nothing else uses the buffer.
            unsafe { caches.write(0, &vec![1u8; 4 << 20]) };
            let pages = sample_ranges_nodes(&[(caches.addr() as usize, caches.len())], 64);
            let g = enter(
                HostPlacement::Auto,
                &PoolNear::HostCaches(pages),
                &SysfsTopology::at(sys.path()),
            )
            .unwrap();
            assert_eq!(g.node(), Some(n));
            assert_eq!(preferred_node_of_thread().unwrap(), Some(n));
            let pool = HostBuffer::new(1 << 20).unwrap();
            let p = g.finish(pool.addr() as usize, pool.len());
            assert_eq!(
                p.reason,
                format!("the KV caches are on {n}: 64 of 64 sampled pages")
            );
            assert_eq!(p.pages.on(n), p.pages.sampled, "{p}");
            assert_eq!(p.home().map(|h| h.node), Some(n));
            assert!(!p.cpus.is_empty());
        });
    }

    #[test]
    fn auto_near_kv_caches_says_why_it_does_not_place() {
        on_own_thread(|| {
            let (n, _) = real_node0();
            let on = |node: u32, k: usize| PageNodes {
                sampled: k,
                by_node: [(NumaNode(node), k)].into(),
                ..PageNodes::default()
            };
            let absent = PageNodes {
                sampled: 8,
                absent: 8,
                ..PageNodes::default()
            };
            let two = format!("{},{}", n.0, n.0 + 1);
            let absent_why = format!("no page of the KV caches is in memory yet ({absent})");
            let cases = [
                (
                    n.0.to_string(),
                    on(n.0, 8),
                    "one NUMA node online".to_string(),
                ),
                (two.clone(), absent, absent_why),
                (
                    two,
                    on(9, 8),
                    "the KV caches are on node 9, not online".to_string(),
                ),
            ];
            for (online, pages, why) in cases {
                let sys = fake_sysfs(&online, &[], &[]);
                let g = enter(
                    HostPlacement::Auto,
                    &PoolNear::HostCaches(pages),
                    &SysfsTopology::at(sys.path()),
                )
                .unwrap();
                assert_eq!(g.node(), None, "{why}");
                let p = g.finish(0, 0);
                assert_eq!(p.reason, why);
                assert!(p.home().is_none());
            }
        });
    }

    #[test]
    fn auto_says_why_it_does_not_place() {
        on_own_thread(|| {
            let cases: Vec<(tempfile::TempDir, PoolNear, &str)> = vec![
                (
                    fake_sysfs("0-1", &[], &[(GPU, "1")]),
                    PoolNear::NoGpu,
                    "no GPU to place it near",
                ),
                (
                    fake_sysfs("0-1", &[], &[(GPU, "1")]),
                    PoolNear::UnknownGpu("no attribute".into()),
                    "the GPU's PCI address is unknown: no attribute",
                ),
                (
                    fake_sysfs("0", &[], &[(GPU, "0")]),
                    PoolNear::Gpu(gpu()),
                    "one NUMA node online",
                ),
                (
                    fake_sysfs("0-1", &[], &[(GPU, "-1")]),
                    PoolNear::Gpu(gpu()),
                    "GPU 0000:3b:00.0 names no NUMA node",
                ),
                (
                    fake_sysfs("0-1", &[], &[(GPU, "4")]),
                    PoolNear::Gpu(gpu()),
                    "GPU 0000:3b:00.0 names node 4, not online",
                ),
                (
                    fake_sysfs("0-1", &[], &[]),
                    PoolNear::Gpu(gpu()),
                    "the NUMA node of GPU 0000:3b:00.0 is unknown: PCI device 0000:3b:00.0 not found under /sys/bus/pci/devices",
                ),
            ];
            for (sys, near, why) in cases {
                let g = enter(HostPlacement::Auto, &near, &SysfsTopology::at(sys.path())).unwrap();
                assert_eq!(g.node(), None, "{why}");
                assert_eq!(preferred_node_of_thread().unwrap(), None, "{why}");
                let p = g.finish(0, 0);
                assert_eq!(p.reason, why);
                assert!(
                    p.to_string().starts_with(&format!("not placed ({why})")),
                    "{p}"
                );
            }
        });
    }

    #[test]
    fn auto_on_a_node_the_kernel_refuses_says_so_and_leaves_the_thread_alone() {
        on_own_thread(|| {
            // sysfs says node 700 holds the GPU; this kernel has no node 700.
            let sys = fake_sysfs("0,700", &[(700, "0")], &[(GPU, "700")]);
            let g = enter(
                HostPlacement::Auto,
                &PoolNear::Gpu(gpu()),
                &SysfsTopology::at(sys.path()),
            )
            .unwrap();
            assert_eq!(g.node(), None);
            assert_eq!(preferred_node_of_thread().unwrap(), None);
            let p = g.finish(0, 0);
            assert!(
                p.reason
                    .starts_with("GPU 0000:3b:00.0 is on node 700, but set_mempolicy refused"),
                "{}",
                p.reason
            );
        });
    }

    #[test]
    fn a_node_asked_for_is_placed_or_refused_by_name() {
        on_own_thread(|| {
            let (n, _) = real_node0();
            let sys = SysfsTopology::system();
            let g = enter(HostPlacement::Node(n), &PoolNear::NoGpu, &sys).unwrap();
            assert_eq!(preferred_node_of_thread().unwrap(), Some(n));
            let pool = HostBuffer::new(1 << 20).unwrap();
            let p = g.finish(pool.addr() as usize, pool.len());
            assert_eq!((p.node, p.reason.as_str()), (Some(n), "asked for"));
            assert_eq!(p.pages.on(n), 256);
            let e = enter(HostPlacement::Node(NumaNode(999)), &PoolNear::NoGpu, &sys).unwrap_err();
            assert!(
                matches!(
                    e,
                    NumaError::NodeNotOnline {
                        node: NumaNode(999),
                        ..
                    }
                ),
                "{e}"
            );
            // sysfs lists node 700 online, the kernel refuses it: an error.
            let fake = fake_sysfs("0,700", &[(700, "0")], &[]);
            let e = enter(
                HostPlacement::Node(NumaNode(700)),
                &PoolNear::NoGpu,
                &SysfsTopology::at(fake.path()),
            )
            .unwrap_err();
            assert!(
                matches!(
                    e,
                    NumaError::Refused {
                        op: "set_mempolicy",
                        ..
                    }
                ),
                "{e}"
            );
            assert_eq!(preferred_node_of_thread().unwrap(), None);
            let off = enter(HostPlacement::Off, &PoolNear::Gpu(gpu()), &sys).unwrap();
            assert_eq!(off.finish(0, 0).reason, "placement off");
        });
    }
}
