//! The machine's NUMA nodes, their CPUs and the node of a PCI device, read
//! from sysfs (under a root that tests replace with a directory of their own).

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use super::{NumaError, NumaNode, PciAddress};

/// Entries a list may expand to: more CPUs or nodes than any kernel allows
/// (8,192 CPUs, 1,024 nodes), so a garbled file is an error, not an
/// allocation of billions.
const MAX_LIST_ENTRIES: usize = 1 << 16;

/// Parses a kernel list (`0-3,8,10-11`; blank is empty), as sysfs writes
/// online nodes and a node's CPUs.
pub fn parse_list(text: &str) -> Result<Vec<u32>, String> {
    let text = text.trim();
    let mut out = Vec::new();
    if text.is_empty() {
        return Ok(out);
    }
    for part in text.split(',') {
        let num = |t: &str| {
            t.trim()
                .parse::<u32>()
                .map_err(|_| format!("{part:?} in {text:?} is not a number or a range"))
        };
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => {
                let n = num(part)?;
                (n, n)
            }
        };
        if lo > hi {
            return Err(format!("range {part:?} in {text:?} runs backwards"));
        }
        if out.len() + (hi - lo) as usize >= MAX_LIST_ENTRIES {
            return Err(format!(
                "{text:?} lists more than {MAX_LIST_ENTRIES} entries"
            ));
        }
        out.extend(lo..=hi);
    }
    Ok(out)
}

/// sysfs, from its root (`/sys` on a running system).
#[derive(Debug, Clone)]
pub struct SysfsTopology {
    root: PathBuf,
}

impl SysfsTopology {
    /// The running system's (`/sys`).
    pub fn system() -> Self {
        Self::at("/sys")
    }

    /// The tree under `root`, laid out as `/sys` is.
    pub fn at(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    fn node_dir(&self) -> PathBuf {
        self.root.join("devices/system/node")
    }

    fn read(path: &Path) -> Result<String, NumaError> {
        std::fs::read_to_string(path).map_err(|e| NumaError::Sysfs {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// The nodes online. A kernel built without NUMA has no node directory:
    /// it is one node, node 0.
    pub fn online_nodes(&self) -> Result<Vec<NumaNode>, NumaError> {
        let dir = self.node_dir();
        if matches!(std::fs::metadata(&dir), Err(e) if e.kind() == ErrorKind::NotFound) {
            return Ok(vec![NumaNode(0)]);
        }
        let path = dir.join("online");
        let text = Self::read(&path)?;
        let nodes = parse_list(&text).map_err(|message| NumaError::Sysfs { path, message })?;
        Ok(nodes.into_iter().map(NumaNode).collect())
    }

    /// The CPUs of `node` (none for a node of memory alone).
    pub fn node_cpus(&self, node: NumaNode) -> Result<Vec<usize>, NumaError> {
        let path = self.node_dir().join(format!("node{}/cpulist", node.0));
        let text = Self::read(&path)?;
        let cpus = parse_list(&text).map_err(|message| NumaError::Sysfs { path, message })?;
        Ok(cpus.into_iter().map(|c| c as usize).collect())
    }

    /// The node `device` is attached to, or `None` where the platform
    /// does not say (`numa_node` is -1: one node, or firmware that leaves
    /// it out).
    pub fn device_node(&self, device: &PciAddress) -> Result<Option<NumaNode>, NumaError> {
        let dir = self.root.join("bus/pci/devices");
        let entries = std::fs::read_dir(&dir).map_err(|e| NumaError::Sysfs {
            path: dir.clone(),
            message: e.to_string(),
        })?;
        let found = entries.flatten().find(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.parse::<PciAddress>().ok())
                .is_some_and(|a| a == *device)
        });
        let entry = found.ok_or(NumaError::DeviceNotFound(*device))?;
        let path = entry.path().join("numa_node");
        let text = Self::read(&path)?;
        let node: i64 = text.trim().parse().map_err(|_| NumaError::Sysfs {
            path: path.clone(),
            message: format!("{:?} is not a node number", text.trim()),
        })?;
        Ok(u32::try_from(node).ok().map(NumaNode))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A sysfs tree with `online` nodes (each with `cpus`), and PCI devices
    /// with their `numa_node` text.
    pub(in crate::worker::numa) fn fake_sysfs(
        online: &str,
        cpus: &[(u32, &str)],
        devices: &[(&str, &str)],
    ) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        let node = d.path().join("devices/system/node");
        std::fs::create_dir_all(&node).unwrap();
        std::fs::write(node.join("online"), format!("{online}\n")).unwrap();
        std::fs::create_dir_all(d.path().join("bus/pci/devices")).unwrap();
        for (n, list) in cpus {
            std::fs::create_dir_all(node.join(format!("node{n}"))).unwrap();
            std::fs::write(node.join(format!("node{n}/cpulist")), format!("{list}\n")).unwrap();
        }
        for (name, numa) in devices {
            let p = d.path().join("bus/pci/devices").join(name);
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("numa_node"), format!("{numa}\n")).unwrap();
        }
        d
    }

    #[test]
    fn kernel_lists_expand() {
        assert_eq!(
            parse_list("0-3,8,10-11\n").unwrap(),
            vec![0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_list("5").unwrap(), vec![5]);
        assert_eq!(parse_list(" \n").unwrap(), Vec::<u32>::new());
        for bad in ["3-1", "a", "1,,2", "0-", "-1", "0-4294967295"] {
            assert!(parse_list(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn nodes_cpus_and_a_device_s_node_are_read() {
        let d = fake_sysfs(
            "0-1",
            &[(0, "0-3,8-11"), (1, "4-7,12-15")],
            &[("0000:3b:00.0", "1"), ("0000:1a:00.0", "-1")],
        );
        let t = SysfsTopology::at(d.path());
        assert_eq!(t.online_nodes().unwrap(), vec![NumaNode(0), NumaNode(1)]);
        assert_eq!(
            t.node_cpus(NumaNode(1)).unwrap(),
            vec![4, 5, 6, 7, 12, 13, 14, 15]
        );
        let gpu: PciAddress = "0000:3B:00.0".parse().unwrap();
        assert_eq!(t.device_node(&gpu).unwrap(), Some(NumaNode(1)));
        let nic: PciAddress = "0000:1a:00.0".parse().unwrap();
        assert_eq!(t.device_node(&nic).unwrap(), None);
        let absent: PciAddress = "0000:99:00.0".parse().unwrap();
        assert!(matches!(t.device_node(&absent), Err(NumaError::DeviceNotFound(a)) if a == absent));
        let e = t.node_cpus(NumaNode(2)).unwrap_err();
        assert!(e.to_string().contains("node2/cpulist"), "{e}");
    }

    #[test]
    fn a_kernel_without_numa_is_one_node_and_garbage_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(
            SysfsTopology::at(d.path()).online_nodes().unwrap(),
            vec![NumaNode(0)]
        );
        let g = fake_sysfs("zero", &[], &[("0000:3b:00.0", "one")]);
        let t = SysfsTopology::at(g.path());
        assert!(matches!(t.online_nodes(), Err(NumaError::Sysfs { .. })));
        let gpu: PciAddress = "0000:3b:00.0".parse().unwrap();
        let e = t.device_node(&gpu).unwrap_err();
        assert!(e.to_string().contains("not a node number"), "{e}");
    }

    #[test]
    fn the_running_system_has_a_node_online() {
        let online = SysfsTopology::system().online_nodes().unwrap();
        assert!(!online.is_empty());
    }
}
