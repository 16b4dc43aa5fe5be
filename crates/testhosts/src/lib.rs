//! Test hosts on one machine, for tests of what crosses hosts.
//!
//! A [`Cluster`] is N hosts on one bridge. Each host is a network namespace
//! with its own address (`10.77.0.<i>/24` on its `eth0`), its own hostname
//! (`node1`, `node2`, ... in a UTS namespace of its own) and its own
//! `/etc/hosts` that names every host (`ip netns exec` binds
//! `/etc/netns/<ns>/hosts` over `/etc/hosts`). Programs run on a host through
//! [`Host::command`]: real `rally`, `etcd`, Python with torch, or this test
//! binary again.
//!
//! Faults:
//!
//! - [`Host::cut`] takes the host's port off the bridge: packets are lost
//!   silently both ways, nobody sends a reset, and the host's link stays up (as
//!   a switch port failing, or a partition). [`Host::heal`] puts it back.
//! - [`Host::power_off`] cuts the host off, then SIGKILLs everything running
//!   on it: a machine losing power, as its peers see it.
//! - [`Host::cap`] limits the host's bandwidth both ways with `tbf` on both
//!   ends of its link. This kernel has no `netem`, so there is no fixed delay
//!   or random loss.
//!
//! Every name a cluster makes carries the pid of the process that made it
//! (`rpt-<pid>-<n>-<i>` namespaces, `rpb<pid><n>` bridges, `rpv<pid><n><i>`
//! links, in hex to fit the 15 bytes of an interface name), so tests run in
//! parallel, each in its own process, and never touch each other's hosts. A
//! cluster cleans up when dropped, panics included: it kills every process on
//! its hosts, deletes the links, namespaces and `/etc/netns` files. A test
//! killed from outside cannot, so the first cluster a process makes sweeps the
//! leftovers of processes that are gone.
//!
//! It needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and `ip`, `nsenter`,
//! `unshare` and `tc`. Where a cluster cannot be made, [`cluster`] panics with
//! the reason; so it does when `RALLY_NO_NETNS=1`, which says so. Such a
//! machine leaves the tests that need hosts out of the run with nextest's
//! `no-netns` profile, and nextest counts them as skipped: a test that needs
//! hosts is never reported as passed without them.
//!
//! Two hosts, each with its own name, that know each other's. The same check
//! runs in the test `hosts_have_their_own_names_addresses_and_hosts_files`
//! (`tests/hosts.rs`); here it is compiled, not run, since a doc test cannot be
//! left out of a run and counted:
//!
//! ```no_run
//! let cluster = rallypoint_testhosts::cluster(2);
//! let run = |i: usize, args: &[&str]| {
//!     let out = cluster.host(i).command(args[0]).args(&args[1..]).output().unwrap();
//!     String::from_utf8_lossy(&out.stdout).trim().to_owned()
//! };
//! assert_eq!(run(0, &["hostname"]), "node1");
//! assert!(run(1, &["getent", "hosts", "node1"]).starts_with("10.77.0."));
//! ```

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

/// The subnet every cluster uses: hosts see only their own bridge, so
/// clusters never clash.
const SUBNET: [u8; 3] = [10, 77, 0];
const NS_PREFIX: &str = "rpt-";
const BRIDGE_PREFIX: &str = "rpb";
const VETH_PREFIX: &str = "rpv";

/// A cluster of `n` hosts, for a test. Panics, saying why, when hosts cannot
/// be made, and when `RALLY_NO_NETNS=1` says they cannot: a test that needs
/// hosts either runs with them or fails, and is never reported as passed
/// without them. Where hosts cannot be made, leave such tests out of the run
/// with nextest's `no-netns` profile (`.config/nextest.toml`), which counts
/// them as skipped; `.ci/run` picks it when `RALLY_NO_NETNS=1`.
pub fn cluster(n: usize) -> Cluster {
    if std::env::var("RALLY_NO_NETNS").is_ok_and(|v| v == "1") {
        panic!(
            "this test needs test hosts in network namespaces, and RALLY_NO_NETNS=1 says none \
             can be made here: leave the tests that need them out of the run with \
             `cargo nextest run --profile no-netns` (nextest counts them as skipped)"
        );
    }
    match Cluster::new(n) {
        Ok(c) => c,
        Err(e) => panic!(
            "cannot make test hosts in network namespaces: {e}\n\
             These tests need root and iproute2 (ip, tc), nsenter and unshare. Where \
             that cannot be had, set RALLY_NO_NETNS=1 and run `cargo nextest run \
             --profile no-netns`, which leaves them out and counts them as skipped."
        ),
    }
}

/// N hosts on one bridge; see the crate docs.
pub struct Cluster {
    bridge: String,
    hosts: Vec<Host>,
}

/// One test host: a network namespace with its own address and hostname.
pub struct Host {
    /// Its hostname, `node<i>` (1-based), which every host's `/etc/hosts` names.
    pub name: String,
    /// Its address on the bridge.
    pub addr: Ipv4Addr,
    ns: String,
    /// Its port on the bridge (the root namespace's end of its veth pair).
    port: String,
    bridge: String,
    /// A process that holds the host's UTS namespace (its hostname).
    holder: Child,
    /// Every host's namespace, this one's included.
    cluster_ns: Vec<String>,
}

impl Cluster {
    /// Makes `n` hosts (at most 15: a host's number is one hex digit of its
    /// link's name); see [`cluster`].
    pub fn new(n: usize) -> Result<Cluster, String> {
        assert!((1..=15).contains(&n), "a cluster has 1 to 15 hosts");
        static SWEEP: Once = Once::new();
        SWEEP.call_once(sweep_leftovers);
        static SERIAL: AtomicU32 = AtomicU32::new(0);
        let me = std::process::id();
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed) & 0xff;
        let bridge = format!("{BRIDGE_PREFIX}{me:x}{serial:02x}");
        let mut c = Cluster {
            bridge: bridge.clone(),
            hosts: Vec::new(),
        };
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        ip(&["link", "set", &bridge, "up"])?;
        let names: Vec<(String, Ipv4Addr)> = (1..=n)
            .map(|i| {
                let [a, b, c] = SUBNET;
                (format!("node{i}"), Ipv4Addr::new(a, b, c, i as u8))
            })
            .collect();
        let mut hosts_file = String::from("127.0.0.1 localhost\n::1 localhost ip6-localhost\n");
        for (name, addr) in &names {
            hosts_file.push_str(&format!("{addr} {name}\n"));
        }
        for (i, (name, addr)) in names.into_iter().enumerate() {
            let ns = format!("{NS_PREFIX}{me:x}-{serial:02x}-{}", i + 1);
            let port = format!("{VETH_PREFIX}{me:x}{serial:02x}{:x}", i + 1);
            ip(&["netns", "add", &ns])?;
            // Cleaned up with the cluster from here on, whatever fails next.
            let dir = netns_dir(&ns);
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            std::fs::write(dir.join("hosts"), &hosts_file)
                .map_err(|e| format!("{}/hosts: {e}", dir.display()))?;
            ip(&[
                "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            ip(&["link", "set", &port, "master", &bridge, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let holder = Command::new("ip")
                .args(["netns", "exec", &ns, "unshare", "--uts", "--", "sh", "-c"])
                .arg(format!("hostname {name} && exec sleep 2147483647"))
                .stdin(Stdio::null())
                .spawn()
                .map_err(|e| format!("ip netns exec {ns} unshare --uts: {e}"))?;
            c.hosts.push(Host {
                name: name.clone(),
                addr,
                ns,
                port,
                bridge: bridge.clone(),
                holder,
                cluster_ns: Vec::new(),
            });
            let h = c.hosts.last().expect("just pushed");
            h.wait_for_hostname()?;
        }
        let all: Vec<String> = c.hosts.iter().map(|h| h.ns.clone()).collect();
        for h in &mut c.hosts {
            h.cluster_ns = all.clone();
        }
        Ok(c)
    }

    /// Host `i`, 0-based (`node<i+1>`).
    pub fn host(&self, i: usize) -> &Host {
        &self.hosts[i]
    }

    /// Every host, `node1` first.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// Every host, to power one off.
    pub fn hosts_mut(&mut self) -> &mut [Host] {
        &mut self.hosts
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for h in &mut self.hosts {
            h.kill_all(true);
            let _ = h.holder.wait();
            let _ = ip(&["link", "del", &h.port]);
            let _ = ip(&["netns", "del", &h.ns]);
            let _ = std::fs::remove_dir_all(netns_dir(&h.ns));
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

impl Host {
    /// A command that runs `program` on this host: in its network namespace,
    /// with its hostname and its `/etc/hosts`. Add arguments and environment,
    /// then spawn it as any command.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns, "nsenter"])
            .arg(format!("--uts=/proc/{}/ns/uts", self.holder.id()))
            .arg("--")
            .arg(program);
        cmd
    }

    /// The network namespace's name (for `ip netns exec` by hand).
    pub fn ns(&self) -> &str {
        &self.ns
    }

    /// Takes the host off the bridge: silent loss both ways, no reset, its
    /// link stays up.
    pub fn cut(&self) {
        ip(&["link", "set", &self.port, "nomaster"]).expect("cut a host off");
    }

    /// Puts a cut-off host back on the bridge. Neighbour (ARP) entries are
    /// flushed on every host: one that failed, or was still resolving, while
    /// it was away would refuse the first connections after the heal with "No
    /// route to host" for seconds (a link coming back up flushes them too).
    pub fn heal(&self) {
        ip(&["link", "set", &self.port, "master", &self.bridge]).expect("heal a host");
        for ns in &self.cluster_ns {
            let _ = ip(&["-n", ns, "neigh", "flush", "all"]);
        }
    }

    /// Cuts the host off, then SIGKILLs everything running on it. Its name
    /// and address stay; [`Host::heal`] and new commands bring it back.
    pub fn power_off(&mut self) {
        self.cut();
        self.kill_all(false);
    }

    /// Caps the host's bandwidth, each way, at `mbit` Mbit/s: `tbf` on its
    /// `eth0` (what it sends) and on its bridge port (what it receives).
    pub fn cap(&self, mbit: u32) {
        // A burst of at least one timer tick's worth at the rate (and 64 KiB
        // for GSO segments), as tbf wants.
        let burst = (mbit as u64 * 1_000_000 / 8 / 250).max(64 * 1024);
        let args = |dev: &str| {
            vec![
                "qdisc".to_owned(),
                "replace".into(),
                "dev".into(),
                dev.to_owned(),
                "root".into(),
                "tbf".into(),
                "rate".into(),
                format!("{mbit}mbit"),
                "burst".into(),
                burst.to_string(),
                "latency".into(),
                "100ms".into(),
            ]
        };
        run("ip", &["netns", "exec", &self.ns, "tc"], &args("eth0")).expect("tbf on eth0");
        run("tc", &[], &args(&self.port)).expect("tbf on the bridge port");
    }

    /// The pids of every process on this host (its hostname holder included).
    pub fn pids(&self) -> Vec<i32> {
        let out = Command::new("ip")
            .args(["netns", "pids", &self.ns])
            .output();
        out.map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
    }

    /// The pids of the processes run on this host (not its hostname holder).
    pub fn running(&self) -> Vec<i32> {
        let holder = self.holder.id() as i32;
        self.pids().into_iter().filter(|p| *p != holder).collect()
    }

    /// SIGKILLs every process on the host (the holder too, if `holder`), until
    /// none is left (5 s at most: a process stuck in the kernel may outlive it).
    fn kill_all(&mut self, holder: bool) {
        let keep = (!holder).then(|| self.holder.id() as i32);
        let t0 = Instant::now();
        loop {
            let left: Vec<i32> = self
                .pids()
                .into_iter()
                .filter(|p| Some(*p) != keep)
                .collect();
            if left.is_empty() || t0.elapsed() > Duration::from_secs(5) {
                break;
            }
            for p in left {
                // SAFETY: kill(2) has no memory effects; a pid that ended
                // since is ESRCH.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Reap our own children among them (the holder).
        if holder {
            let _ = self.holder.try_wait();
        }
    }

    fn wait_for_hostname(&self) -> Result<(), String> {
        let t0 = Instant::now();
        loop {
            let out = self.command("hostname").output();
            if let Ok(o) = &out {
                if String::from_utf8_lossy(&o.stdout).trim() == self.name {
                    return Ok(());
                }
            }
            if t0.elapsed() > Duration::from_secs(10) {
                return Err(format!("{} never took its hostname: {out:?}", self.ns));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn netns_dir(ns: &str) -> PathBuf {
    PathBuf::from("/etc/netns").join(ns)
}

fn ip(args: &[&str]) -> Result<Output, String> {
    run("ip", args, &[])
}

fn run(program: &str, args: &[&str], more: &[String]) -> Result<Output, String> {
    let out = Command::new(program)
        .args(args)
        .args(more)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(format!(
            "`{program} {} {}` failed ({}): {}",
            args.join(" "),
            more.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The pid that made namespace `ns` (`rpt-<pid>-...`), if it is ours.
fn ns_owner(ns: &str) -> Option<u32> {
    let rest = ns.strip_prefix(NS_PREFIX)?;
    u32::from_str_radix(rest.split('-').next()?, 16).ok()
}

/// Removes the hosts, links and files of clusters whose process is gone (the
/// first cluster of each process does this itself).
pub fn sweep_leftovers() {
    let me = std::process::id();
    let owner_gone = |pid: Option<u32>| pid.is_some_and(|p| p != me && !alive(p));
    let list = Command::new("ip").args(["netns", "list"]).output();
    for line in list
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
        .lines()
    {
        let ns = line.split_whitespace().next().unwrap_or("");
        if owner_gone(ns_owner(ns)) {
            if let Ok(o) = Command::new("ip").args(["netns", "pids", ns]).output() {
                for p in String::from_utf8_lossy(&o.stdout).split_whitespace() {
                    if let Ok(p) = p.parse::<i32>() {
                        // SAFETY: kill(2) has no memory effects.
                        unsafe { libc::kill(p, libc::SIGKILL) };
                    }
                }
            }
            let _ = ip(&["netns", "del", ns]);
            let _ = std::fs::remove_dir_all(netns_dir(ns));
        }
    }
    if let Ok(dir) = std::fs::read_dir("/etc/netns") {
        for e in dir.flatten() {
            if owner_gone(ns_owner(&e.file_name().to_string_lossy())) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    // Links: `rpb<pid><nn>` and `rpv<pid><nn><i>`, all hex.
    let links = std::fs::read_dir("/sys/class/net")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    for link in links {
        let pid = if let Some(rest) = link.strip_prefix(BRIDGE_PREFIX) {
            rest.get(..rest.len().saturating_sub(2))
        } else if let Some(rest) = link.strip_prefix(VETH_PREFIX) {
            rest.get(..rest.len().saturating_sub(3))
        } else {
            continue;
        };
        if owner_gone(pid.and_then(|p| u32::from_str_radix(p, 16).ok())) {
            let _ = ip(&["link", "del", &link]);
        }
    }
}
