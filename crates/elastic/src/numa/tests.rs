//! Bindings on made-up machines, built as sysfs trees in a temporary
//! directory: torchrun's own test layouts (test_numa_binding.py, with the
//! bindings it expects) and a few of ours.

use super::*;

/// A made-up machine: hyperthreaded cores (CPUs 2k and 2k+1 are siblings),
/// numbered socket by socket, node by node, L3 by L3, as torchrun's tests
/// build theirs.
struct Machine {
    dir: tempfile::TempDir,
    cpus: usize,
    nodes: usize,
    gpus: usize,
}

impl Machine {
    fn new() -> Machine {
        Machine {
            dir: tempfile::tempdir().unwrap(),
            cpus: 0,
            nodes: 0,
            gpus: 0,
        }
    }

    fn write(&self, rel: &str, text: &str) {
        let p = self.dir.path().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    fn pci(&mut self, class: &str, vendor: &str, node: &str) -> String {
        let addr = format!("0000:{:02x}:00.0", 0x10 + self.gpus);
        let dev = format!("sys/bus/pci/devices/{addr}");
        self.write(&format!("{dev}/class"), class);
        self.write(&format!("{dev}/vendor"), vendor);
        self.write(&format!("{dev}/numa_node"), node);
        self.gpus += 1;
        addr
    }

    fn with(
        sockets: usize,
        nodes_per_socket: usize,
        gpus_per_node: usize,
        l3_per_node: usize,
        cores_per_l3: usize,
    ) -> Machine {
        let mut m = Machine::new();
        for socket in 0..sockets {
            for _ in 0..nodes_per_socket {
                let node = m.nodes;
                let per_node = l3_per_node * cores_per_l3 * 2;
                m.write(
                    &format!("sys/devices/system/node/node{node}/cpulist"),
                    &format!("{}-{}\n", m.cpus, m.cpus + per_node - 1),
                );
                for _ in 0..gpus_per_node {
                    m.pci("0x030200\n", "0x10de\n", &format!("{node}\n"));
                }
                for _ in 0..l3_per_node {
                    let l3 = (m.cpus, m.cpus + 2 * cores_per_l3 - 1);
                    for cpu in m.cpus..m.cpus + 2 * cores_per_l3 {
                        let sib = if cpu % 2 == 1 {
                            format!("{}-{cpu}", cpu - 1)
                        } else {
                            format!("{cpu}-{}", cpu + 1)
                        };
                        let c = format!("sys/devices/system/cpu/cpu{cpu}");
                        m.write(&format!("{c}/topology/thread_siblings_list"), &sib);
                        m.write(
                            &format!("{c}/topology/physical_package_id"),
                            &socket.to_string(),
                        );
                        m.write(&format!("{c}/cache/uevent"), "");
                        for level in 0..5 {
                            let i = format!("{c}/cache/index{level}");
                            let kind = if level == 4 { "Instruction" } else { "Data" };
                            m.write(&format!("{i}/type"), kind);
                            m.write(&format!("{i}/level"), &level.to_string());
                            let shared = match level {
                                3 => format!("{}-{}", l3.0, l3.1),
                                _ => sib.clone(),
                            };
                            m.write(&format!("{i}/shared_cpu_list"), &shared);
                        }
                    }
                    m.cpus += 2 * cores_per_l3;
                }
                m.nodes += 1;
            }
        }
        m.write(
            "sys/devices/system/node/possible",
            &format!("0-{}\n", m.nodes - 1),
        );
        m
    }

    fn topo(&self) -> Topology {
        Topology::new(self.dir.path())
    }

    fn all(&self) -> BTreeSet<usize> {
        (0..self.cpus).collect()
    }

    /// Local rank `rank`'s binding with every GPU a local rank.
    fn bind(&self, mode: Mode, rank: usize) -> Binding {
        self.bind_allowed(mode, rank, &self.all())
    }

    fn bind_allowed(&self, mode: Mode, rank: usize, allowed: &BTreeSet<usize>) -> Binding {
        plan(&self.topo(), mode, rank + 1, allowed, None)
            .unwrap()
            .expect("GPUs")
            .swap_remove(rank)
    }
}

fn set(list: &str) -> BTreeSet<usize> {
    parse_list(list).unwrap()
}

#[test]
fn node_binds_to_the_gpus_node() {
    // torchrun: 8 nodes of 2 GPUs; GPU 11 is on node 5 (--cpunodebind=5 --preferred=5).
    let m = Machine::with(4, 2, 2, 4, 2);
    let b = m.bind(Mode::Node, 11);
    assert_eq!((b.node, b.cpus, b.mem_nodes), (5, set("80-95"), set("5")));
}

#[test]
fn socket_binds_to_every_node_of_the_gpus_socket() {
    // torchrun: GPU 15 on socket 3, whose nodes are 6-7 (--preferred-many=6-7).
    let m = Machine::with(4, 2, 2, 4, 2);
    let b = m.bind(Mode::Socket, 15);
    assert_eq!((b.cpus, b.mem_nodes), (set("96-127"), set("6-7")));
    // One node per socket: the same as node (GPU 7 on node 3).
    let m = Machine::with(4, 1, 2, 4, 2);
    let b = m.bind(Mode::Socket, 7);
    assert_eq!((b.cpus, b.mem_nodes), (set("48-63"), set("3")));
}

#[test]
fn exclusive_splits_the_nodes_physical_cores_and_the_lowest_gpu_gets_the_extra() {
    // torchrun: 3 cores, 2 GPUs on node 0: 0-3 and 4-5.
    let m = Machine::with(2, 1, 2, 1, 3);
    assert_eq!(m.bind(Mode::Exclusive, 0).cpus, set("0-3"));
    assert_eq!(m.bind(Mode::Exclusive, 1).cpus, set("4-5"));
    assert_eq!(m.bind(Mode::Exclusive, 1).mem_nodes, set("0"));
    assert_eq!(m.bind(Mode::Exclusive, 3).cpus, set("10-11"));
    // One core, two GPUs: refused, naming the node and the counts.
    let m = Machine::with(2, 1, 2, 1, 1);
    let e = plan(&m.topo(), Mode::Exclusive, 4, &m.all(), None).unwrap_err();
    assert_eq!(
        e.to_string(),
        "NUMA node 0 has 1 physical core(s) usable here for its 2 GPUs: exclusive binding needs one each"
    );
}

#[test]
fn core_complex_gives_each_gpu_its_own_l3_and_shares_when_there_are_too_few() {
    // torchrun: 3 L3s per node, GPU 3 (second on node 1) gets its second L3.
    let m = Machine::with(2, 1, 2, 3, 3);
    assert_eq!(m.bind(Mode::CoreComplex, 3).cpus, set("24-29"));
    assert_eq!(m.bind(Mode::CoreComplex, 3).mem_nodes, set("1"));
    // One L3 per node: GPUs 2 and 3 share it.
    let m = Machine::with(2, 1, 2, 1, 3);
    assert_eq!(m.bind(Mode::CoreComplex, 3).cpus, set("6-11"));
    assert_eq!(m.bind(Mode::CoreComplex, 2).cpus, set("6-11"));
    // The L3 with the most usable CPUs first.
    let m = Machine::with(1, 1, 1, 3, 3);
    let b = m.bind_allowed(Mode::CoreComplex, 0, &set("0,4,6-7,9"));
    assert_eq!(b.cpus, set("6-7,9"));
    // A tie goes to the lowest CPUs.
    let m = Machine::with(1, 1, 1, 2, 1);
    assert_eq!(m.bind(Mode::CoreComplex, 0).cpus, set("0-1"));
}

#[test]
fn two_sockets_of_two_nodes_with_four_gpus() {
    let m = Machine::with(2, 2, 1, 2, 2);
    let nodes: Vec<(usize, BTreeSet<usize>)> = (0..4)
        .map(|r| {
            let b = m.bind(Mode::Node, r);
            (b.node, b.cpus)
        })
        .collect();
    assert_eq!(
        nodes,
        [
            (0, set("0-7")),
            (1, set("8-15")),
            (2, set("16-23")),
            (3, set("24-31"))
        ]
    );
    assert_eq!(m.bind(Mode::Socket, 3).cpus, set("16-31"));
    assert_eq!(m.bind(Mode::Socket, 3).mem_nodes, set("2-3"));
    assert_eq!(m.bind(Mode::Exclusive, 1).cpus, set("8-15"));
    assert_eq!(m.bind(Mode::CoreComplex, 2).cpus, set("16-19"));
    // The agent's own affinity (a cgroup) narrows every mode.
    let b = m.bind_allowed(Mode::Socket, 0, &set("2-5,20"));
    assert_eq!(b.cpus, set("2-5"));
    let e = plan(&m.topo(), Mode::Node, 4, &set("2-5"), None).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("NUMA node 1 has no CPU this process may use"),
        "{e}"
    );
}

#[test]
fn which_devices_are_gpus_and_in_which_order() {
    let mut m = Machine::with(1, 1, 0, 1, 2);
    // A server's BMC display (ASPEED) and a NIC are not GPUs.
    m.pci("0x030000\n", "0x1a03\n", "-1\n");
    m.pci("0x020000\n", "0x15b3\n", "0\n");
    assert_eq!(
        plan(&m.topo(), Mode::Node, 1, &m.all(), None).unwrap(),
        None
    );
    // An NVIDIA GPU on a one-node machine says -1: node 0.
    let nv = m.pci("0x030200\n", "0x10de\n", "-1\n");
    let amd = m.pci("0x038000\n", "0x1002\n", "0\n");
    let all = plan(&m.topo(), Mode::Node, 2, &m.all(), None)
        .unwrap()
        .unwrap();
    assert_eq!(all[0].gpu, nv);
    assert_eq!((all[1].gpu.as_str(), all[1].node), (amd.as_str(), 0));
    // CUDA_VISIBLE_DEVICES picks and orders them; it ends at a bad index.
    let vis = plan(&m.topo(), Mode::Node, 1, &m.all(), Some("1,0"))
        .unwrap()
        .unwrap();
    assert_eq!(vis[0].gpu, amd);
    let e = plan(&m.topo(), Mode::Node, 2, &m.all(), Some("1,7,0")).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("local rank 1 has no GPU: 1 visible ("),
        "{e}"
    );
    assert_eq!(
        plan(&m.topo(), Mode::Node, 1, &m.all(), Some("")).unwrap(),
        None
    );
    // UUIDs, as the NVIDIA driver lists them.
    m.write(
        &format!("proc/driver/nvidia/gpus/{amd}/information"),
        "Model: \t Fake\nGPU UUID: \t GPU-8f2a-11\n",
    );
    let vis = plan(&m.topo(), Mode::Node, 1, &m.all(), Some("GPU-8f2a"))
        .unwrap()
        .unwrap();
    assert_eq!(vis[0].gpu, amd);
    let e = plan(&m.topo(), Mode::Node, 1, &m.all(), Some("MIG-1,MIG-2")).unwrap_err();
    assert!(
        e.to_string().contains("MIG instances cannot be matched"),
        "{e}"
    );
    // More ranks than GPUs: refused.
    let e = plan(&m.topo(), Mode::Node, 3, &m.all(), None).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("local rank 2 has no GPU: 2 visible"),
        "{e}"
    );
}

#[test]
fn no_pci_bus_means_no_gpu() {
    let m = Machine::new();
    assert_eq!(
        plan(&m.topo(), Mode::Node, 1, &set("0"), None).unwrap(),
        None
    );
}

#[test]
fn a_broken_sysfs_file_is_named() {
    let m = Machine::with(1, 1, 1, 1, 1);
    m.write("sys/devices/system/node/node0/cpulist", "zero\n");
    let e = plan(&m.topo(), Mode::Node, 1, &m.all(), None).unwrap_err();
    assert!(
        e.to_string()
            .ends_with("node/node0/cpulist: \"zero\\n\" is not what sysfs holds there"),
        "{e}"
    );
}

#[test]
fn cpu_lists_parse_and_format_as_sysfs_writes_them() {
    assert_eq!(set("0-2,4,6-7"), BTreeSet::from([0, 1, 2, 4, 6, 7]));
    assert_eq!(
        format_list(&BTreeSet::from([7, 0, 1, 6, 2, 4])),
        "0-2,4,6-7"
    );
    assert_eq!(parse_list("\n"), Some(BTreeSet::new()));
    for bad in ["a", "3-1", "1-", "-", "0-99999999"] {
        assert_eq!(parse_list(bad), None, "{bad}");
    }
}

proptest::proptest! {
    #[test]
    fn any_cpu_set_survives_format_and_parse(v in proptest::collection::btree_set(0usize..300, 0..60)) {
        proptest::prop_assert_eq!(parse_list(&format_list(&v)), Some(v));
    }

    #[test]
    fn any_text_parses_without_a_panic(s in "[0-9,\\- \n]{0,20}") {
        let _ = parse_list(&s);
    }
}

#[test]
fn the_binding_is_applied_in_a_child_before_exec() {
    use std::os::unix::process::CommandExt;
    let allowed = allowed_cpus();
    let cpu = *allowed.iter().next().unwrap();
    let prepared = Binding {
        gpu: "x".into(),
        node: 0,
        cpus: BTreeSet::from([cpu]),
        mem_nodes: BTreeSet::from([0]),
    }
    .prepare();
    let mut c = std::process::Command::new("grep");
    c.args(["Cpus_allowed_list", "/proc/self/status"]);
    // SAFETY: apply makes only system calls.
    unsafe { c.pre_exec(move || prepared.apply()) };
    let out = c.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.split_whitespace().nth(1),
        Some(cpu.to_string().as_str()),
        "{text}"
    );
}
