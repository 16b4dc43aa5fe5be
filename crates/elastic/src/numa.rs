//! NUMA binding: each local rank runs on the CPUs nearest its GPU, and
//! allocates memory there first (torchrun's `--numa-binding`, pytorch#148689).
//!
//! Everything is read from sysfs under a root that is a parameter, so tests
//! run against made-up machines:
//!
//! - GPUs: PCI devices of display class (`class` 0x03xxxx) from NVIDIA or
//!   AMD (`vendor` 0x10de, 0x1002), in PCI address order (CUDA's order with
//!   `CUDA_DEVICE_ORDER=PCI_BUS_ID`, and nvidia-smi's), narrowed and reordered
//!   by `CUDA_VISIBLE_DEVICES` with CUDA's rules (indices, or UUIDs read
//!   from the NVIDIA driver's `/proc/driver/nvidia/gpus`; MIG instances are
//!   refused). Visible GPU `i` serves local rank `i`. Its node is `numa_node` (-1, on one-node machines, is 0).
//! - a node's CPUs: `devices/system/node/node<N>/cpulist`, narrowed to the
//!   CPUs this process may use (its own affinity: a container's or a
//!   scheduler's cgroup limits are kept);
//! - a CPU's socket: `topology/physical_package_id`; its physical core: the
//!   lowest of `topology/thread_siblings_list`; its core complex: the lowest
//!   CPU sharing its highest-level data or unified cache
//!   (`cache/index<k>/{type,level,shared_cpu_list}`).
//!
//! The modes, as torchrun's:
//!
//! | mode | CPUs | memory preferred on |
//! |---|---|---|
//! | `node` | every CPU of the GPU's node | that node |
//! | `socket` | every CPU of every node of the GPU's socket | those nodes |
//! | `exclusive` | the node's physical cores split evenly among its GPUs (the lowest GPUs get one more when they do not divide) | the GPU's node |
//! | `core-complex` | one L3 complex of the node per GPU, those with the most usable CPUs first, shared round-robin when there are more GPUs than complexes | the GPU's node |
//!
//! The binding is applied in the child between fork and exec
//! ([`Binding::apply`]): `sched_setaffinity`, then `set_mempolicy` with
//! `MPOL_PREFERRED` (one node) or `MPOL_PREFERRED_MANY` (several; one node
//! on kernels before 5.15), so no `numactl` is needed. Memory is *preferred*
//! there, as torchrun's `numactl --preferred`: when the node is full,
//! allocations spill over instead of the worker being killed for memory, as
//! `--membind` would. A `set_mempolicy` refused (a container's seccomp
//! profile without `CAP_SYS_NICE`) leaves the CPU binding in place.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// How local ranks are bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Node,
    Socket,
    Exclusive,
    CoreComplex,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "node" => Ok(Mode::Node),
            "socket" => Ok(Mode::Socket),
            "exclusive" => Ok(Mode::Exclusive),
            "core-complex" => Ok(Mode::CoreComplex),
            other => Err(format!(
                "{other:?}: expected node, socket, exclusive or core-complex"
            )),
        }
    }
}

/// Where one local rank runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// Its GPU's PCI address.
    pub gpu: String,
    /// Its GPU's NUMA node.
    pub node: usize,
    pub cpus: BTreeSet<usize>,
    /// Nodes memory is preferred on (empty: no memory policy).
    pub mem_nodes: BTreeSet<usize>,
}

/// Why binding could not be worked out.
#[derive(Debug, thiserror::Error)]
pub enum NumaError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {text:?} is not what sysfs holds there")]
    Parse { path: PathBuf, text: String },
    #[error("local rank {local_rank} has no GPU: {found} visible ({gpus})")]
    NoGpu {
        local_rank: usize,
        found: usize,
        gpus: String,
    },
    #[error("CUDA_VISIBLE_DEVICES={0:?}: MIG instances cannot be matched to their GPUs' NUMA nodes here")]
    Visible(String),
    #[error("NUMA node {node} has no CPU this process may use (its affinity is {allowed})")]
    NoCpus { node: usize, allowed: String },
    #[error("NUMA node {node} has {cores} physical core(s) usable here for its {gpus} GPUs: exclusive binding needs one each")]
    TooFewCores {
        node: usize,
        cores: usize,
        gpus: usize,
    },
}

/// `0-2,4,6-7` as sysfs and `numactl` write CPU and node lists.
pub fn parse_list(text: &str) -> Option<BTreeSet<usize>> {
    let mut out = BTreeSet::new();
    for part in text
        .trim()
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if a > b || b - a > 1 << 20 {
                    return None;
                }
                out.extend(a..=b);
            }
            None => {
                out.insert(part.parse().ok()?);
            }
        }
    }
    Some(out)
}

/// The inverse of [`parse_list`]: `{0, 1, 2, 4}` is `0-2,4`.
pub fn format_list(set: &BTreeSet<usize>) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut it = set.iter().copied().peekable();
    while let Some(start) = it.next() {
        let mut end = start;
        while it.peek() == Some(&(end + 1)) {
            end = it.next().expect("peeked");
        }
        out.push(match end == start {
            true => start.to_string(),
            false => format!("{start}-{end}"),
        });
    }
    out.join(",")
}

/// The machine as sysfs under `root` shows it.
pub struct Topology {
    root: PathBuf,
}

impl Topology {
    /// `root` is `/` on a real machine; it holds `sys/...`.
    pub fn new(root: impl Into<PathBuf>) -> Topology {
        Topology { root: root.into() }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    fn read(&self, rel: &str) -> Result<String, NumaError> {
        let path = self.path(rel);
        std::fs::read_to_string(&path).map_err(|source| NumaError::Read { path, source })
    }

    fn list(&self, rel: &str) -> Result<BTreeSet<usize>, NumaError> {
        let text = self.read(rel)?;
        parse_list(&text).ok_or_else(|| NumaError::Parse {
            path: self.path(rel),
            text,
        })
    }

    fn number(&self, rel: &str) -> Result<i64, NumaError> {
        let text = self.read(rel)?;
        let t = text.trim();
        let n = match t.strip_prefix("0x") {
            Some(hex) => i64::from_str_radix(hex, 16).ok(),
            None => t.parse().ok(),
        };
        n.ok_or_else(|| NumaError::Parse {
            path: self.path(rel),
            text,
        })
    }

    /// Every GPU in PCI address order, with its NUMA node.
    pub fn gpus(&self) -> Result<Vec<(String, usize)>, NumaError> {
        let dir = "sys/bus/pci/devices";
        let entries = match std::fs::read_dir(self.path(dir)) {
            Ok(e) => e,
            // No PCI bus (some VMs and containers): no GPU.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => {
                return Err(NumaError::Read {
                    path: self.path(dir),
                    source,
                })
            }
        };
        let mut addrs: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        addrs.sort();
        let mut gpus = Vec::new();
        for addr in addrs {
            let dev = format!("{dir}/{addr}");
            let (Ok(class), Ok(vendor)) = (
                self.number(&format!("{dev}/class")),
                self.number(&format!("{dev}/vendor")),
            ) else {
                continue;
            };
            if class >> 16 != 0x03 || !matches!(vendor, 0x10de | 0x1002) {
                continue;
            }
            let node = self.number(&format!("{dev}/numa_node"))?.max(0) as usize;
            gpus.push((addr, node));
        }
        Ok(gpus)
    }

    fn node_cpus(
        &self,
        node: usize,
        allowed: &BTreeSet<usize>,
    ) -> Result<BTreeSet<usize>, NumaError> {
        let all = self.list(&format!("sys/devices/system/node/node{node}/cpulist"))?;
        let usable: BTreeSet<usize> = all.intersection(allowed).copied().collect();
        if usable.is_empty() {
            return Err(NumaError::NoCpus {
                node,
                allowed: format_list(allowed),
            });
        }
        Ok(usable)
    }

    fn socket_of(&self, cpu: usize) -> Result<i64, NumaError> {
        self.number(&format!(
            "sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id"
        ))
    }

    fn core_of(&self, cpu: usize) -> Result<usize, NumaError> {
        let rel = format!("sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list");
        Ok(self.list(&rel)?.first().copied().unwrap_or(cpu))
    }

    /// The lowest CPU sharing `cpu`'s highest-level data or unified cache.
    fn complex_of(&self, cpu: usize) -> Result<usize, NumaError> {
        let dir = format!("sys/devices/system/cpu/cpu{cpu}/cache");
        let entries = std::fs::read_dir(self.path(&dir)).map_err(|source| NumaError::Read {
            path: self.path(&dir),
            source,
        })?;
        let mut best: Option<(i64, usize)> = None;
        for e in entries.filter_map(Result::ok) {
            let name = e.file_name().to_string_lossy().into_owned();
            let is_index = name
                .strip_prefix("index")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
            if !is_index {
                continue;
            }
            let kind = self.read(&format!("{dir}/{name}/type"))?;
            if !matches!(kind.trim(), "Unified" | "Data") {
                continue;
            }
            let level = self.number(&format!("{dir}/{name}/level"))?;
            if best.is_some_and(|(l, _)| level <= l) {
                continue;
            }
            let shared = self.list(&format!("{dir}/{name}/shared_cpu_list"))?;
            best = Some((level, shared.first().copied().unwrap_or(cpu)));
        }
        Ok(best.map_or(cpu, |(_, c)| c))
    }

    /// Every node in `possible`.
    fn nodes(&self) -> Result<BTreeSet<usize>, NumaError> {
        self.list("sys/devices/system/node/possible")
    }
}

/// The GPUs local ranks use: those `CUDA_VISIBLE_DEVICES` lets a process
/// see, in its order, with CUDA's rules ([`crate::devices::visible_set`]).
fn visible_gpus(
    topo: &Topology,
    all: Vec<(String, usize)>,
    visible: Option<&str>,
) -> Result<Vec<(String, usize)>, NumaError> {
    let uuids: Vec<String> = all
        .iter()
        .map(|(bus, _)| crate::devices::uuid_of(&topo.root, bus))
        .collect();
    match crate::devices::visible_set(visible, &uuids) {
        crate::devices::Visible::Gpus(v) => Ok(v.into_iter().map(|i| all[i].clone()).collect()),
        crate::devices::Visible::Mig(_) => {
            Err(NumaError::Visible(visible.unwrap_or("").to_owned()))
        }
    }
}

/// Where each of `nproc` local ranks runs under `mode`; `None` when the
/// machine has no (visible) GPU, so there is nothing to bind near. `allowed`
/// is the set of CPUs this process may use ([`allowed_cpus`]); `visible` is
/// `CUDA_VISIBLE_DEVICES`.
pub fn plan(
    topo: &Topology,
    mode: Mode,
    nproc: usize,
    allowed: &BTreeSet<usize>,
    visible: Option<&str>,
) -> Result<Option<Vec<Binding>>, NumaError> {
    let gpus = visible_gpus(topo, topo.gpus()?, visible)?;
    if gpus.is_empty() {
        return Ok(None);
    }
    if nproc > gpus.len() {
        return Err(NumaError::NoGpu {
            local_rank: gpus.len(),
            found: gpus.len(),
            gpus: gpus
                .iter()
                .map(|(a, n)| format!("{a} on node {n}"))
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    (0..nproc)
        .map(|rank| bind_one(topo, mode, &gpus, rank, allowed))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn bind_one(
    topo: &Topology,
    mode: Mode,
    gpus: &[(String, usize)],
    rank: usize,
    allowed: &BTreeSet<usize>,
) -> Result<Binding, NumaError> {
    let (gpu, node) = gpus[rank].clone();
    // This GPU's place among the GPUs of its node.
    let on_node: Vec<usize> = (0..gpus.len()).filter(|&g| gpus[g].1 == node).collect();
    let nth = on_node
        .iter()
        .position(|&g| g == rank)
        .expect("its own node");
    let node_cpus = || topo.node_cpus(node, allowed);
    let (cpus, mem_nodes) = match mode {
        Mode::Node => (node_cpus()?, BTreeSet::from([node])),
        Mode::Socket => {
            let socket = topo.socket_of(*node_cpus()?.first().expect("not empty"))?;
            let mut cpus = BTreeSet::new();
            let mut nodes = BTreeSet::new();
            for n in topo.nodes()? {
                let Ok(c) = topo.node_cpus(n, allowed) else {
                    continue;
                };
                if topo.socket_of(*c.first().expect("not empty"))? == socket {
                    cpus.extend(c);
                    nodes.insert(n);
                }
            }
            (cpus, nodes)
        }
        Mode::Exclusive => {
            let cores = group_by(node_cpus()?, |c| topo.core_of(c))?;
            let per = cores.len() / on_node.len();
            if per == 0 {
                return Err(NumaError::TooFewCores {
                    node,
                    cores: cores.len(),
                    gpus: on_node.len(),
                });
            }
            let extra = cores.len() % on_node.len();
            let start = nth * per + nth.min(extra);
            let end = start + per + usize::from(nth < extra);
            let cpus = cores
                .values()
                .skip(start)
                .take(end - start)
                .flatten()
                .copied()
                .collect();
            (cpus, BTreeSet::from([node]))
        }
        Mode::CoreComplex => {
            let complexes = group_by(node_cpus()?, |c| topo.complex_of(c))?;
            let mut order: Vec<(usize, BTreeSet<usize>)> = complexes.into_iter().collect();
            // The most usable CPUs first, then the lowest.
            order.sort_by_key(|(key, cpus)| (std::cmp::Reverse(cpus.len()), *key));
            let cpus = order[nth % order.len()].1.clone();
            (cpus, BTreeSet::from([node]))
        }
    };
    Ok(Binding {
        gpu,
        node,
        cpus,
        mem_nodes,
    })
}

fn group_by(
    cpus: BTreeSet<usize>,
    key: impl Fn(usize) -> Result<usize, NumaError>,
) -> Result<BTreeMap<usize, BTreeSet<usize>>, NumaError> {
    let mut out: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    for c in cpus {
        out.entry(key(c)?).or_default().insert(c);
    }
    Ok(out)
}

/// The CPUs this process may run on (`sched_getaffinity`).
pub fn allowed_cpus() -> BTreeSet<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the kernel fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the size matches the set we pass.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return BTreeSet::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `c` is below CPU_SETSIZE.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

const MPOL_PREFERRED: libc::c_int = 1;
const MPOL_PREFERRED_MANY: libc::c_int = 5;

/// A [`Binding`] in the form the child applies between fork and exec, where
/// only system calls are allowed (no allocation).
#[derive(Clone)]
pub struct Prepared {
    cpus: libc::cpu_set_t,
    /// Node mask words, and the node to prefer alone on old kernels.
    nodes: Vec<libc::c_ulong>,
    fallback_node: usize,
    many: bool,
}

impl Binding {
    /// Prepares the binding for [`Prepared::apply`].
    pub fn prepare(&self) -> Prepared {
        // SAFETY: a zeroed cpu_set_t is a valid empty set.
        let mut cpus: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &c in self
            .cpus
            .iter()
            .filter(|&&c| c < libc::CPU_SETSIZE as usize)
        {
            // SAFETY: `c` is below CPU_SETSIZE.
            unsafe { libc::CPU_SET(c, &mut cpus) };
        }
        let bits = libc::c_ulong::BITS as usize;
        let words = self.mem_nodes.last().map_or(0, |&n| n / bits + 1);
        let mut nodes = vec![0 as libc::c_ulong; words];
        for &n in &self.mem_nodes {
            nodes[n / bits] |= 1 << (n % bits);
        }
        Prepared {
            cpus,
            nodes,
            fallback_node: self.node,
            many: self.mem_nodes.len() > 1,
        }
    }
}

impl Prepared {
    /// Binds the calling process (async-signal-safe: for `pre_exec`). The CPU
    /// binding must succeed; the memory policy is best effort.
    pub fn apply(&self) -> std::io::Result<()> {
        // SAFETY: a valid set of the size given.
        let r = unsafe {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.cpus)
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if self.nodes.is_empty() {
            return Ok(());
        }
        // The kernel reads `maxnode - 1` bits.
        let maxnode = (self.nodes.len() * libc::c_ulong::BITS as usize + 1) as libc::c_ulong;
        let mode = if self.many {
            MPOL_PREFERRED_MANY
        } else {
            MPOL_PREFERRED
        };
        // SAFETY: the mask holds `maxnode - 1` bits.
        let r =
            unsafe { libc::syscall(libc::SYS_set_mempolicy, mode, self.nodes.as_ptr(), maxnode) };
        if r != 0 && self.many {
            // Before Linux 5.15: prefer the GPU's own node.
            let bits = libc::c_ulong::BITS as usize;
            let mut one = [0 as libc::c_ulong; 16];
            if self.fallback_node < one.len() * bits {
                one[self.fallback_node / bits] |= 1 << (self.fallback_node % bits);
                let maxnode = (one.len() * bits + 1) as libc::c_ulong;
                // SAFETY: as above, with a fixed-size mask.
                unsafe {
                    libc::syscall(
                        libc::SYS_set_mempolicy,
                        MPOL_PREFERRED,
                        one.as_ptr(),
                        maxnode,
                    )
                };
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("nodes", &self.nodes)
            .finish()
    }
}

/// Whether this process may set a memory policy (a container's seccomp
/// profile may refuse it without `CAP_SYS_NICE`).
pub fn memory_policy_allowed() -> bool {
    let mut mode: libc::c_int = 0;
    // SAFETY: get_mempolicy with only the mode out-pointer.
    let r = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            std::ptr::null_mut::<libc::c_void>(),
            0 as libc::c_ulong,
        )
    };
    r == 0
}

#[cfg(test)]
mod tests;
