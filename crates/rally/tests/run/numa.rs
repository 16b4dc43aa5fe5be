//! `--numa-binding` with real workers: the binding is read from a made-up
//! sysfs (two NUMA nodes, one GPU each) laid over this machine's real CPUs,
//! applied between fork and exec, and checked from inside each Python worker
//! (`os.sched_getaffinity`, `/proc/self/numa_maps`).

use super::*;

fn write(root: &Path, rel: &str, text: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, text).unwrap();
}

/// This process's CPUs (`Cpus_allowed_list`).
fn my_cpus() -> Vec<usize> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_owned();
    list.split(',')
        .flat_map(|part| match part.split_once('-') {
            Some((a, b)) => (a.parse().unwrap()..=b.parse().unwrap()).collect::<Vec<usize>>(),
            None => vec![part.parse().unwrap()],
        })
        .collect()
}

/// A machine of two nodes on one socket, node `i` holding this machine's
/// `cpus[i]` and one NVIDIA GPU.
fn two_node_sysfs(root: &Path, cpus: [usize; 2]) {
    for (node, cpu) in cpus.into_iter().enumerate() {
        write(
            root,
            &format!("sys/devices/system/node/node{node}/cpulist"),
            &format!("{cpu}\n"),
        );
        let dev = format!("sys/bus/pci/devices/0000:{:02x}:00.0", 0x10 + node);
        write(root, &format!("{dev}/class"), "0x030200\n");
        write(root, &format!("{dev}/vendor"), "0x10de\n");
        write(root, &format!("{dev}/numa_node"), &format!("{node}\n"));
        let c = format!("sys/devices/system/cpu/cpu{cpu}/topology");
        write(root, &format!("{c}/physical_package_id"), "0\n");
        write(
            root,
            &format!("{c}/thread_siblings_list"),
            &format!("{cpu}\n"),
        );
    }
    write(root, "sys/devices/system/node/possible", "0-1\n");
}

fn probe(dir: &Path, flags: &[&str], sysfs: Option<&Path>, name: &str) -> (Vec<Value>, String) {
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    let mut c = rally(&["--standalone", "--nproc-per-node", "2"]);
    c.args(flags)
        .arg(script("numa_probe.py"))
        .env("OUT_DIR", &out);
    match sysfs {
        Some(root) => c.env("RALLY_SYSFS_ROOT", root),
        None => c.env_remove("RALLY_SYSFS_ROOT"),
    };
    c.env_remove("CUDA_VISIBLE_DEVICES");
    let mut job = Job::spawn(c, dir, name);
    let status = job.wait(LIMIT);
    let log = job.output();
    assert!(status.success(), "{log}");
    let seen = (0..2)
        .map(|r| {
            serde_json::from_str(&std::fs::read_to_string(out.join(format!("{r}.json"))).unwrap())
                .unwrap()
        })
        .collect();
    (seen, log)
}

#[test]
fn each_local_rank_runs_on_the_cpus_of_its_gpus_node() {
    let cpus = my_cpus();
    assert!(cpus.len() >= 2, "this test needs two CPUs: {cpus:?}");
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    two_node_sysfs(&root, [cpus[0], cpus[1]]);
    let (seen, log) = probe(dir.path(), &["--numa-binding", "node"], Some(&root), "node");
    for (rank, v) in seen.iter().enumerate() {
        assert_eq!(
            v["cpus"],
            serde_json::json!([cpus[rank]]),
            "rank {rank}: {v}\n{log}"
        );
    }
    assert!(
        log.contains(&format!(
            "--numa-binding node: local rank 1 (GPU 0000:11:00.0, NUMA node 1) on CPUs {}",
            cpus[1]
        )),
        "{log}"
    );
    // Node 0 is real here: its worker's memory is preferred there. (Node 1
    // is made up: the kernel refuses that policy, and the CPUs stay bound.)
    let policies = seen[0]["policies"].to_string();
    assert!(policies.contains("prefer:0"), "{policies}");
    // socket: both nodes are on socket 0.
    let (seen, _) = probe(
        dir.path(),
        &["--numa_binding", "socket"],
        Some(&root),
        "socket",
    );
    for v in &seen {
        assert_eq!(v["cpus"], serde_json::json!([cpus[0], cpus[1]]), "{v}");
    }
}

#[test]
fn without_a_gpu_it_says_so_and_runs_unbound() {
    let cpus = my_cpus();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    write(
        &root,
        "sys/bus/pci/devices/0000:00:02.0/class",
        "0x030000\n",
    );
    write(&root, "sys/bus/pci/devices/0000:00:02.0/vendor", "0x1234\n");
    write(&root, "sys/bus/pci/devices/0000:00:02.0/numa_node", "-1\n");
    let (seen, log) = probe(
        dir.path(),
        &["--numa-binding", "exclusive"],
        Some(&root),
        "none",
    );
    assert!(
        log.contains("--numa-binding exclusive: this machine has no GPU to bind near; the workers run unbound"),
        "{log}"
    );
    for v in &seen {
        assert_eq!(v["cpus"], serde_json::json!(cpus), "{v}");
    }
    // More ranks than GPUs: refused before anything starts.
    let one = dir.path().join("one");
    two_node_sysfs(&one, [cpus[0], cpus[0]]);
    std::fs::remove_dir_all(one.join("sys/bus/pci/devices/0000:11:00.0")).unwrap();
    let out = rally(&[
        "--standalone",
        "--nproc-per-node",
        "2",
        "--numa-binding",
        "node",
    ])
    .arg(script("numa_probe.py"))
    .env("RALLY_SYSFS_ROOT", &one)
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "--numa-binding node: local rank 1 has no GPU: 1 visible (0000:10:00.0 on node 0)"
        ),
        "{err}"
    );
}
