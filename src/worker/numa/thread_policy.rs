//! Binding the calling thread to one NUMA node for a while: new pages
//! preferred on the node (`set_mempolicy(MPOL_PREFERRED)`) and the thread
//! run on the node's CPUs (`sched_setaffinity`), so that pages first touched
//! by the thread, and those a driver allocates on the "local" node for it
//! (pinned memory from `cuMemHostAlloc`), land there. Dropping the binding
//! restores both.

use std::marker::PhantomData;

use super::{NumaError, NumaNode};

/// Words of a node mask: 1,024 nodes, the most a Linux kernel allows.
const MASK_WORDS: usize = 16;
/// Bits of a node mask.
const MASK_BITS: usize = MASK_WORDS * 64;

type NodeMask = [libc::c_ulong; MASK_WORDS];

fn last_error(op: &'static str) -> NumaError {
    NumaError::Refused {
        op,
        source: std::io::Error::last_os_error(),
    }
}

/// The calling thread's memory policy: its mode (with its flags) and nodes.
fn get_policy() -> Result<(libc::c_int, NodeMask), NumaError> {
    let mut mode: libc::c_int = 0;
    let mut mask: NodeMask = [0; MASK_WORDS];
    // SAFETY: `mode` and `mask` are valid for writes of one int and
    // `MASK_BITS` bits; a null address with flags 0 asks for the thread's
    // policy.
    let r = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut libc::c_int,
            mask.as_mut_ptr(),
            MASK_BITS as libc::c_ulong,
            std::ptr::null_mut::<libc::c_void>(),
            0 as libc::c_ulong,
        )
    };
    if r != 0 {
        return Err(last_error("get_mempolicy"));
    }
    Ok((mode, mask))
}

/// Sets the calling thread's memory policy.
fn set_policy(mode: libc::c_int, mask: &NodeMask) -> Result<(), NumaError> {
    // SAFETY: `mask` is valid for reads of `MASK_BITS` bits; the kernel reads
    // `maxnode - 1` of them.
    let r = unsafe {
        libc::syscall(
            libc::SYS_set_mempolicy,
            mode,
            mask.as_ptr(),
            (MASK_BITS + 1) as libc::c_ulong,
        )
    };
    if r != 0 {
        return Err(last_error("set_mempolicy"));
    }
    Ok(())
}

fn get_affinity() -> Result<libc::cpu_set_t, NumaError> {
    // SAFETY: an all-zero `cpu_set_t` is a valid (empty) set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is valid for writes of its size; pid 0 is this thread.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return Err(last_error("sched_getaffinity"));
    }
    Ok(set)
}

fn set_affinity(set: &libc::cpu_set_t) -> Result<(), NumaError> {
    // SAFETY: `set` is valid for reads of its size; pid 0 is this thread.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) };
    if r != 0 {
        return Err(last_error("sched_setaffinity"));
    }
    Ok(())
}

/// The node the calling thread prefers for new pages, where its policy is
/// `MPOL_PREFERRED` of one node; `None` for any other policy.
pub fn preferred_node_of_thread() -> Result<Option<NumaNode>, NumaError> {
    let (mode, mask) = get_policy()?;
    if mode & 0xff != libc::MPOL_PREFERRED {
        return Ok(None);
    }
    let nodes: Vec<u32> = (0..MASK_BITS as u32)
        .filter(|&n| mask[n as usize / 64] & (1 << (n % 64)) != 0)
        .collect();
    Ok(match nodes[..] {
        [n] => Some(NumaNode(n)),
        _ => None,
    })
}

/// While alive, the calling thread prefers one node for new pages and runs
/// on that node's CPUs (those of them it may run on). Dropped on the same
/// thread (it is neither `Send` nor `Sync`), it restores the thread's policy
/// and CPUs as they were.
#[derive(Debug)]
pub struct NodeBoundThread {
    node: NumaNode,
    previous_policy: (libc::c_int, NodeMask),
    previous_cpus: Option<libc::cpu_set_t>,
    pinned_cpus: usize,
    _this_thread: PhantomData<*const ()>,
}

impl NodeBoundThread {
    /// Binds the calling thread to `node`, whose CPUs are `cpus`. The CPUs
    /// are left as they were where none of `cpus` is one the thread may run
    /// on (a node of memory alone, or a thread confined elsewhere).
    pub fn enter(node: NumaNode, cpus: &[usize]) -> Result<Self, NumaError> {
        let bit = node.0 as usize;
        if bit >= MASK_BITS {
            return Err(NumaError::NodeNotOnline {
                node,
                online: Vec::new(),
            });
        }
        let previous_policy = get_policy()?;
        let mut mask: NodeMask = [0; MASK_WORDS];
        mask[bit / 64] |= 1 << (bit % 64);
        set_policy(libc::MPOL_PREFERRED, &mask)?;
        let mut bound = Self {
            node,
            previous_policy,
            previous_cpus: None,
            pinned_cpus: 0,
            _this_thread: PhantomData,
        };
        // From here `bound`'s drop restores the policy if pinning fails.
        let allowed = get_affinity()?;
        // SAFETY: an all-zero `cpu_set_t` is a valid (empty) set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let setsize = 8 * std::mem::size_of::<libc::cpu_set_t>();
        for &c in cpus.iter().filter(|&&c| c < setsize) {
            // SAFETY: `c` is below the set's size (filtered above).
            if unsafe { libc::CPU_ISSET(c, &allowed) } {
                // SAFETY: as above.
                unsafe { libc::CPU_SET(c, &mut set) };
                bound.pinned_cpus += 1;
            }
        }
        if bound.pinned_cpus > 0 {
            set_affinity(&set)?;
            bound.previous_cpus = Some(allowed);
        }
        Ok(bound)
    }

    /// The node.
    pub fn node(&self) -> NumaNode {
        self.node
    }

    /// The node's CPUs the thread runs on meanwhile (0: its CPUs were left
    /// as they were).
    pub fn pinned_cpus(&self) -> usize {
        self.pinned_cpus
    }
}

impl Drop for NodeBoundThread {
    fn drop(&mut self) {
        let (mode, mask) = &self.previous_policy;
        if let Err(e) = set_policy(*mode, mask) {
            tracing::warn!(error = %e, "could not restore the thread's memory policy");
        }
        if let Some(cpus) = &self.previous_cpus
            && let Err(e) = set_affinity(cpus)
        {
            tracing::warn!(error = %e, "could not restore the thread's CPUs");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::numa::SysfsTopology;

    #[test]
    fn binding_prefers_the_node_pins_its_cpus_and_drop_restores_both() {
        // On a thread of its own: the test changes the thread's policy.
        std::thread::spawn(|| {
            let topo = SysfsTopology::system();
            let node = topo.online_nodes().unwrap()[0];
            let cpus = topo.node_cpus(node).unwrap_or_default();
            let before_policy = get_policy().unwrap();
            let before_cpus = get_affinity().unwrap();
            assert_eq!(preferred_node_of_thread().unwrap(), None);
            {
                let b = NodeBoundThread::enter(node, &cpus).unwrap();
                assert_eq!(b.node(), node);
                assert_eq!(preferred_node_of_thread().unwrap(), Some(node));
                let now = get_affinity().unwrap();
                // SAFETY: both are valid sets.
                let running = (0..1024)
                    .filter(|&c| unsafe { libc::CPU_ISSET(c, &now) })
                    .count();
                assert_eq!(running, b.pinned_cpus());
                assert!(b.pinned_cpus() > 0, "node {node:?} has CPUs {cpus:?}");
                for c in 0..1024 {
                    // SAFETY: `c` is below the set's size.
                    if unsafe { libc::CPU_ISSET(c, &now) } {
                        assert!(cpus.contains(&c), "cpu {c} is not one of the node's");
                    }
                }
            }
            assert_eq!(get_policy().unwrap(), before_policy);
            let after = get_affinity().unwrap();
            // SAFETY: both are valid sets.
            assert!(unsafe { libc::CPU_EQUAL(&after, &before_cpus) });
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_node_the_kernel_does_not_have_is_refused_and_nothing_changes() {
        std::thread::spawn(|| {
            let before = get_policy().unwrap();
            let e = NodeBoundThread::enter(NumaNode(1000), &[0]).unwrap_err();
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
            assert_eq!(get_policy().unwrap(), before);
            let e = NodeBoundThread::enter(NumaNode(5000), &[0]).unwrap_err();
            assert!(matches!(e, NumaError::NodeNotOnline { .. }), "{e}");
        })
        .join()
        .unwrap();
    }
}
