//! Placing a worker's host pool on the NUMA node nearest its GPU.
//!
//! On a server with several CPU sockets each GPU hangs off one socket's PCIe
//! root complex. A copy between the GPU and host memory attached to another
//! socket crosses the link between the sockets, which is slower than the
//! socket's own memory and is shared with everything else the machine does.
//! vLLM's offloading connector allocates its pinned pool wherever the kernel
//! puts it (the node of whichever CPU first touches a page); NVIDIA Dynamo's
//! KV block manager places it near the GPU. kvoffload places it too:
//!
//! - [`HostPlacement`] says where a pool goes: `auto` (its GPU's node, where
//!   the machine has several nodes and the GPU names one), `off` (wherever the
//!   kernel puts it), or a node number;
//! - [`enter`] decides the node ([`SysfsTopology`], the device's
//!   [`PciAddress`], [`PoolNear`]) and binds the calling thread to it (a preferred memory
//!   policy and that node's CPUs) while the pool is allocated;
//!   [`PlacementGuard::finish`] restores the thread and reports where the
//!   pool's pages went ([`PoolPlacement`], sampled with `move_pages`);
//! - [`PoolPlacement::home`] names the node and its CPUs, where the threads
//!   that copy to and from the pool run (the host backend's copy threads).
//!
//! The binding prefers the node rather than requiring it: a node out of
//! memory gives pages of another node (counted in the report) instead of a
//! failed allocation or the kernel's out-of-memory killer.

mod pages;
mod pci;
mod placement;
mod thread_policy;
mod topology;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use thiserror::Error;

pub use pages::{PageNodes, sample_page_nodes, sample_ranges_nodes};
pub use pci::PciAddress;
pub use placement::{PlacementGuard, PoolNear, PoolPlacement, enter};
pub use thread_policy::{NodeBoundThread, preferred_node_of_thread};
pub use topology::{SysfsTopology, parse_list};

/// A NUMA node, numbered as Linux numbers them
/// (`/sys/devices/system/node/nodeN`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NumaNode(pub u32);

impl fmt::Display for NumaNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node {}", self.0)
    }
}

/// A NUMA node with its CPUs: where a thread that works on a placed pool
/// runs ([`NodeBoundThread::enter`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeCpus {
    /// The node.
    pub node: NumaNode,
    /// Its CPUs (empty: unknown, the thread keeps the CPUs it has).
    pub cpus: Vec<usize>,
}

/// Where a worker's host pool goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostPlacement {
    /// The node of the worker's GPU where the machine has several nodes and
    /// the GPU names one; elsewhere (one node, the host backend, a device
    /// with no node, a system that refuses memory policies) wherever the
    /// kernel puts it, with the reason in the report.
    #[default]
    Auto,
    /// Wherever the kernel puts it (the node of the CPU that first touches
    /// each page), as vLLM's connector.
    Off,
    /// This node; an error where it is not online or the system refuses to
    /// bind a thread to it.
    Node(NumaNode),
}

impl fmt::Display for HostPlacement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Off => f.write_str("off"),
            Self::Node(n) => write!(f, "{}", n.0),
        }
    }
}

impl FromStr for HostPlacement {
    type Err = NumaError;

    /// `auto`, `off`, or a node number.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "off" => Ok(Self::Off),
            t => t
                .parse::<u32>()
                .map(|n| Self::Node(NumaNode(n)))
                .map_err(|_| NumaError::BadPlacement(s.to_string())),
        }
    }
}

/// A placement could not be decided or applied.
#[derive(Debug, Error)]
pub enum NumaError {
    /// The text is not a placement.
    #[error("NUMA placement {0:?}: expected auto, off or a node number")]
    BadPlacement(String),
    /// The node asked for is not online.
    #[error("NUMA {node} is not online (online: {})", list_nodes(.online))]
    NodeNotOnline {
        /// The node asked for.
        node: NumaNode,
        /// The nodes online.
        online: Vec<NumaNode>,
    },
    /// A sysfs file could not be read or parsed.
    #[error("{path:?}: {message}")]
    Sysfs {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The device is not under `/sys/bus/pci/devices`.
    #[error("PCI device {0} not found under /sys/bus/pci/devices")]
    DeviceNotFound(PciAddress),
    /// The text is not a PCI address (`domain:bus:device.function`).
    #[error("{0:?} is not a PCI address (domain:bus:device.function)")]
    BadPciAddress(String),
    /// The system refused a call that binds the thread.
    #[error("{op} refused: {source}{}", refusal_hint(.source))]
    Refused {
        /// The call (`set_mempolicy`, `get_mempolicy`, `sched_setaffinity`).
        op: &'static str,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
}

/// What to do about a refusal: a container's seccomp profile refuses memory
/// policies to a process without `CAP_SYS_NICE`.
fn refusal_hint(e: &std::io::Error) -> &'static str {
    if e.raw_os_error() == Some(libc::EPERM) {
        " (in a container, memory policies need CAP_SYS_NICE or a seccomp profile that \
         allows them; NUMA placement off skips them)"
    } else {
        ""
    }
}

/// `0, 1, 3`, or `none`.
fn list_nodes(nodes: &[NumaNode]) -> String {
    if nodes.is_empty() {
        return "none".to_string();
    }
    let v: Vec<String> = nodes.iter().map(|n| n.0.to_string()).collect();
    v.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_parse_and_print_back() {
        for (text, want) in [
            ("auto", HostPlacement::Auto),
            ("off", HostPlacement::Off),
            ("1", HostPlacement::Node(NumaNode(1))),
            (" 12 ", HostPlacement::Node(NumaNode(12))),
        ] {
            let got: HostPlacement = text.parse().unwrap();
            assert_eq!(got, want, "{text:?}");
            assert_eq!(got.to_string().parse::<HostPlacement>().unwrap(), want);
        }
        for bad in ["", "none", "-1", "node1", "1.5", "AUTO"] {
            let e = bad.parse::<HostPlacement>().unwrap_err();
            assert!(
                matches!(e, NumaError::BadPlacement(ref t) if t == bad),
                "{bad:?}: {e}"
            );
        }
        assert_eq!(HostPlacement::default(), HostPlacement::Auto);
    }

    #[test]
    fn a_node_not_online_names_the_online_ones() {
        let e = NumaError::NodeNotOnline {
            node: NumaNode(3),
            online: vec![NumaNode(0), NumaNode(1)],
        };
        assert_eq!(e.to_string(), "NUMA node 3 is not online (online: 0, 1)");
    }
}
