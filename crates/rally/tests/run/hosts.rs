//! `rally run` across test hosts (network namespaces, each with its own
//! address, hostname and `/etc/hosts`; see `rallypoint-testhosts`): real DDP
//! jobs with real torch over every backend, and hosts cut off mid-run.
//!
//! Bounds here are behaviour: a configured deadline plus a margin, the larger
//! of 5 s and half the deadline.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use rallypoint_testhosts::{cluster, Cluster, Host};

use super::{python, results, script, with_results, Job, LIMIT};

/// `rally run` on `host`, with no `HOSTNAME` in its environment (a shell does
/// not export it).
pub(super) fn rally_on(host: &Host, args: &[&str]) -> Command {
    let mut c = host.command(env!("CARGO_BIN_EXE_rally"));
    c.arg("run")
        .args(args)
        .env("PYTHON_EXEC", python())
        .env("RALLY_LOG", "warn")
        .env_remove("HOSTNAME");
    c
}

#[derive(Clone, Copy, Debug)]
enum Backend {
    C10dByAddress,
    C10dByName,
    Static,
    #[cfg(feature = "etcd")]
    Etcd,
}

/// The rendezvous flags of node `i` of `n`, node1 hosting.
fn rendezvous(c: &Cluster, n: usize, i: usize, backend: Backend) -> Vec<String> {
    let first = c.host(0);
    let mut a = vec!["--nnodes".to_owned(), n.to_string()];
    let mut more = |v: &[&str]| a.extend(v.iter().map(|s| s.to_string()));
    match backend {
        Backend::C10dByAddress => more(&[
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            &format!("{}:29400", first.addr),
            "--rdzv-id",
            "hosts",
        ]),
        Backend::C10dByName => more(&[
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            &format!("{}:29400", first.name),
            "--rdzv-id",
            "hosts",
        ]),
        Backend::Static => more(&[
            "--node-rank",
            &i.to_string(),
            "--master-addr",
            &first.name,
            "--master-port",
            "29500",
        ]),
        #[cfg(feature = "etcd")]
        Backend::Etcd => more(&[
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            &format!("{}:2379", first.name),
            "--rdzv-id",
            "hosts",
        ]),
    }
    a
}

/// A real etcd on `host`, serving every host at `<name>:2379`; up when this
/// returns.
#[cfg(feature = "etcd")]
fn etcd_on(host: &Host, dir: &Path) -> std::process::Child {
    let bin = std::env::var("RALLY_ETCD").unwrap_or_else(|_| "etcd".into());
    let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
    let child = host
        .command(&bin)
        .args(["--name", "t", "--data-dir"])
        .arg(dir.join("etcd-data"))
        .args(["--listen-client-urls", "http://0.0.0.0:2379"])
        .args([
            "--advertise-client-urls",
            &format!("http://{}:2379", host.name),
        ])
        .args(["--listen-peer-urls", "http://127.0.0.1:2380"])
        .args(["--initial-advertise-peer-urls", "http://127.0.0.1:2380"])
        .args(["--initial-cluster", "t=http://127.0.0.1:2380"])
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let up = || {
        host.command("bash")
            .args(["-c", "exec 3<>/dev/tcp/127.0.0.1/2379"])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    while !up() {
        assert!(t0.elapsed() < Duration::from_secs(30), "etcd never came up");
        std::thread::sleep(Duration::from_millis(100));
    }
    child
}

/// One `rally run` per host of `c` (all of them, or the first `n`), each with
/// one DDP worker, over `backend`.
fn ddp_on_hosts(
    c: &Cluster,
    backend: Backend,
    dir: &Path,
    out: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Vec<Job> {
    let n = c.hosts().len();
    c.hosts()
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let mut args = rendezvous(c, n, i, backend);
            args.extend(extra.iter().map(|s| s.to_string()));
            args.extend(["--nproc-per-node".into(), "1".into()]);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let mut cmd = rally_on(h, &args);
            cmd.arg(script("ddp_train.py")).env("RESULT_DIR", out);
            for (k, v) in env {
                cmd.env(k, v);
            }
            Job::spawn(cmd, dir, &h.name)
        })
        .collect()
}

fn ddp_across(n: usize, backend: Backend) {
    let c = cluster(n);
    let (dir, out) = with_results();
    #[cfg(feature = "etcd")]
    let _etcd = matches!(backend, Backend::Etcd).then(|| etcd_on(c.host(0), dir.path()));
    let mut jobs = ddp_on_hosts(&c, backend, dir.path(), &out, &[], &[("STEPS", "5")]);
    for (h, j) in c.hosts().iter().zip(&mut jobs) {
        let s = j.wait(LIMIT);
        assert!(s.success(), "{backend:?}, {}: {s}\n{}", h.name, j.output());
    }
    let r = results(&out);
    assert_eq!(r.len(), n, "{r:?}");
    let mut hosts: Vec<&str> = r.values().map(|v| v["host"].as_str().unwrap()).collect();
    hosts.sort();
    let names: Vec<&str> = c.hosts().iter().map(|h| h.name.as_str()).collect();
    assert_eq!(hosts, names, "one worker on every host");
    // Every worker reached the job store from its own host, at an address
    // that names a host, never a loopback one.
    let master = r[&0]["master_addr"].as_str().unwrap();
    assert!(
        r.values().all(|v| v["master_addr"] == master),
        "workers were told different job stores: {r:?}"
    );
    assert!(
        !rallypoint_store::host::is_loopback_name(master),
        "{backend:?}: workers on other hosts were told MASTER_ADDR={master}"
    );
    assert!(r
        .values()
        .all(|v| v["world_size"] == n as u64 && v["attempt"] == 0));
}

#[test]
fn ddp_across_two_hosts_c10d_by_address() {
    ddp_across(2, Backend::C10dByAddress);
}

#[test]
fn ddp_across_two_hosts_c10d_by_hostname() {
    ddp_across(2, Backend::C10dByName);
}

#[test]
fn ddp_across_two_hosts_static() {
    ddp_across(2, Backend::Static);
}

#[cfg(feature = "etcd")]
#[test]
fn ddp_across_two_hosts_etcd() {
    ddp_across(2, Backend::Etcd);
}

#[test]
fn ddp_across_four_hosts_c10d_by_address() {
    ddp_across(4, Backend::C10dByAddress);
}

#[test]
fn ddp_across_four_hosts_c10d_by_hostname() {
    ddp_across(4, Backend::C10dByName);
}

#[test]
fn ddp_across_four_hosts_static() {
    ddp_across(4, Backend::Static);
}

#[cfg(feature = "etcd")]
#[test]
fn ddp_across_four_hosts_etcd() {
    ddp_across(4, Backend::Etcd);
}

/// The last step every rank of a `ddp_train.py` job has written to `dir`.
fn steps(dir: &Path, ranks: usize) -> Option<Vec<u64>> {
    (0..ranks)
        .map(|r| {
            std::fs::read_to_string(dir.join(format!("{r}.step")))
                .ok()?
                .trim()
                .parse()
                .ok()
        })
        .collect()
}

/// Waits until every rank has done `step` (the job trains across hosts).
pub(super) fn wait_for_step(dir: &Path, ranks: usize, step: u64, jobs: &mut [Job]) {
    let t0 = Instant::now();
    while !steps(dir, ranks).is_some_and(|s| s.iter().all(|k| *k >= step)) {
        let out: Vec<String> = jobs.iter().map(Job::output).collect();
        assert!(
            t0.elapsed() < LIMIT,
            "training never reached step {step}: {out:#?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Nothing is left running on `host` once its agent has exited, within 5 s;
/// names what is left, by command line, otherwise. Not at the instant of the
/// exit: 1 run of 20 saw a process there that was gone by the time the message
/// was formatted. Not confirmed which; the agent's watchdog (a child that
/// exits on reading the agent's release, after the agent) is the likely one.
fn host_empties(host: &Host) {
    let t0 = Instant::now();
    loop {
        let left = host.running();
        if left.is_empty() {
            return;
        }
        if t0.elapsed() > Duration::from_secs(5) {
            let what: Vec<String> = left
                .iter()
                .map(|p| {
                    let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
                    format!("{p}: {}", String::from_utf8_lossy(&cmd).replace('\0', " "))
                })
                .collect();
            panic!("left running on {}: {what:?}", host.name);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Keep-alive of 1 s, 3 beats: a member silent for 3 s is dead.
const KEEP_ALIVE: &str =
    "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1,join_timeout=20";
const DEADLINE: Duration = Duration::from_secs(3);

/// Keep-alive of 1 s, 20 beats: a member silent for 20 s is dead. For the
/// cut that must be ridden out: see [`RIDE_OUT_CUT`].
const KEEP_ALIVE_RIDE_OUT: &str =
    "keep_alive_interval=1,keep_alive_max_attempt=20,last_call_timeout=1,join_timeout=20";
const RIDE_OUT_DEADLINE: Duration = Duration::from_secs(20);

/// How long a member is cut off, well under [`RIDE_OUT_DEADLINE`]. What the
/// rendezvous host sees is longer than the cut: the member's beat comes
/// every second, and what it sent during the cut is retransmitted with
/// TCP's back-off (0.2, 0.6, 1.4, 3 s after the first loss), so a 1.5 s cut
/// healed late (`ip` slow under load) is heard of after 3 s, up to 4 s of
/// silence in all: five times that is the deadline. (With the 3 s deadline
/// of the other tests the same cut came within a second of it.)
const RIDE_OUT_CUT: Duration = Duration::from_millis(1500);

#[test]
fn a_member_cut_off_for_less_than_the_keep_alive_deadline_is_ridden_out() {
    let c = cluster(2);
    let (dir, out) = with_results();
    let progress = dir.path().join("progress");
    std::fs::create_dir_all(&progress).unwrap();
    let p = progress.to_str().unwrap();
    let mut jobs = ddp_on_hosts(
        &c,
        Backend::C10dByName,
        dir.path(),
        &out,
        &["--rdzv-conf", KEEP_ALIVE_RIDE_OUT],
        &[("STEPS", "30"), ("STEP_SLEEP", "0.1"), ("PROGRESS_DIR", p)],
    );
    wait_for_step(&progress, 2, 2, &mut jobs);
    // Less than the deadline: the job's gradients wait, then flow again.
    let t0 = Instant::now();
    c.host(1).cut();
    std::thread::sleep(RIDE_OUT_CUT);
    let during = steps(&progress, 2).unwrap();
    c.host(1).heal();
    let cut_for = t0.elapsed();
    eprintln!("cut off for {cut_for:?} (keep-alive deadline {RIDE_OUT_DEADLINE:?})");
    for (h, j) in c.hosts().iter().zip(&mut jobs) {
        let s = j.wait(LIMIT);
        assert!(s.success(), "{}: {s}\n{}", h.name, j.output());
        assert!(!j.output().contains("membership changed"), "{}", j.output());
    }
    assert!(
        during.iter().all(|s| *s < 29),
        "the cut came after training: {during:?}"
    );
    let r = results(&out);
    assert_eq!(r.len(), 2);
    assert!(
        r.values()
            .all(|v| v["attempt"] == 0 && v["world_size"] == 2),
        "a restart: {r:?}"
    );
}

#[test]
fn a_member_cut_off_for_good_is_dropped_and_stops_its_own_workers() {
    let c = cluster(2);
    let (dir, out) = with_results();
    let progress = dir.path().join("progress");
    let lost = Duration::from_secs(5);
    // node1 hosts the rendezvous (c10d by name); node2 is the one cut off.
    let mut jobs = elastic_on_hosts(&c, "1:2", dir.path(), &out, lost);
    // Both nodes are in the round: wait for two ranks training.
    wait_for_step(&progress, 2, 2, &mut jobs);
    c.host(1).cut();
    let cut_at = Instant::now();
    // node2 stops its workers once it has not reached the rendezvous host
    // for --rdzv-lost-timeout, fails and says why.
    let bound = lost + DEADLINE + (lost / 2).max(Duration::from_secs(5));
    let s2 = jobs[1].wait(LIMIT);
    let took = cut_at.elapsed();
    let out2 = jobs[1].output();
    assert!(!s2.success(), "the cut-off node reported success:\n{out2}");
    assert!(out2.contains("lost the rendezvous host"), "{out2}");
    assert!(
        took < bound,
        "node2 took {took:?} (bound {bound:?}) to give up:\n{out2}"
    );
    host_empties(c.host(1));
    // node1 re-forms alone and finishes the job.
    let s1 = jobs[0].wait(LIMIT);
    let out1 = jobs[0].output();
    assert!(s1.success(), "node1: {s1}\n{out1}");
    let r = results(&out);
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(r[&0]["world_size"], 1);
    assert_eq!(r[&0]["host"], "node1");
    assert!(r[&0]["attempt"].as_u64().unwrap() >= 1, "{r:?}");
}

/// `rally run` on every host of `c`, c10d at node1, one DDP worker each,
/// training long enough to be cut in the middle.
fn elastic_on_hosts(c: &Cluster, nnodes: &str, dir: &Path, out: &Path, lost: Duration) -> Vec<Job> {
    let progress = dir.join("progress");
    std::fs::create_dir_all(&progress).unwrap();
    let lost_s = lost.as_secs().to_string();
    c.hosts()
        .iter()
        .map(|h| {
            let mut cmd = rally_on(
                h,
                &[
                    "--nnodes",
                    nnodes,
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    "node1:29400",
                    "--rdzv-id",
                    "hosts",
                    "--rdzv-conf",
                    KEEP_ALIVE,
                    "--rdzv-lost-timeout",
                    &lost_s,
                    "--max-restarts",
                    "3",
                    "--nproc-per-node",
                    "1",
                ],
            );
            cmd.arg(script("ddp_train.py"))
                .env("RESULT_DIR", out)
                .env("STEPS", "60")
                .env("STEP_SLEEP", "0.1")
                .env("PROGRESS_DIR", &progress);
            Job::spawn(cmd, dir, &h.name)
        })
        .collect()
}

#[test]
fn the_rendezvous_host_cut_off_for_good_fails_every_node() {
    let c = cluster(2);
    let (dir, out) = with_results();
    let lost = Duration::from_secs(5);
    let mut jobs = elastic_on_hosts(&c, "2", dir.path(), &out, lost);
    wait_for_step(&dir.path().join("progress"), 2, 2, &mut jobs);
    c.host(0).cut();
    let cut_at = Instant::now();
    let bound = lost + DEADLINE + (lost / 2).max(Duration::from_secs(5));
    let s2 = jobs[1].wait(LIMIT);
    let took = cut_at.elapsed();
    let out2 = jobs[1].output();
    assert!(!s2.success(), "node2 reported success:\n{out2}");
    assert!(out2.contains("lost the rendezvous host"), "{out2}");
    assert!(
        took < bound,
        "node2 took {took:?} (bound {bound:?}):\n{out2}"
    );
    host_empties(c.host(1));
    // The store host, alone with min = max = 2, cannot re-form: it fails,
    // naming the node it lost.
    let s1 = jobs[0].wait(LIMIT);
    let out1 = jobs[0].output();
    assert!(!s1.success(), "node1 reported success:\n{out1}");
    assert!(out1.contains("node2"), "node1 does not name node2:\n{out1}");
    host_empties(c.host(0));
    no_worker_finished(&out);
}

/// With min = max, a member cut off for good cannot be replaced: the cut-off
/// node fails having lost the rendezvous host, and the host fails too,
/// once the round it waits for cannot form (keep-alive deadline plus
/// `join_timeout`), naming the node it lost. No worker finishes.
#[test]
fn a_member_cut_off_for_good_with_min_equal_to_max_fails_every_node_naming_it() {
    let c = cluster(2);
    let (dir, out) = with_results();
    let lost = Duration::from_secs(5);
    let mut jobs = elastic_on_hosts(&c, "2", dir.path(), &out, lost);
    wait_for_step(&dir.path().join("progress"), 2, 2, &mut jobs);
    c.host(1).cut();
    let cut_at = Instant::now();
    lost_the_rendezvous_host(&mut jobs[1], c.host(1));
    let join = Duration::from_secs(20);
    let bound = DEADLINE + join + ((DEADLINE + join) / 2).max(Duration::from_secs(5));
    let s1 = jobs[0].wait(LIMIT);
    let took = cut_at.elapsed();
    let out1 = jobs[0].output();
    assert!(!s1.success(), "node1 reported success:\n{out1}");
    let failed = out1.lines().find(|l| l.contains("rendezvous failed"));
    assert!(
        failed.is_some_and(|l| l.contains("not back from the last round: node2")),
        "node1 does not name node2:\n{out1}"
    );
    assert!(
        took < bound,
        "node1 took {took:?} (bound {bound:?}):\n{out1}"
    );
    eprintln!("node1 failed {took:?} after the cut:\n{out1}");
    host_empties(c.host(0));
    no_worker_finished(&out);
}

/// Node `j` (on `host`) failed, saying it lost the rendezvous host, and
/// left nothing running there.
fn lost_the_rendezvous_host(j: &mut Job, host: &Host) {
    let s = j.wait(LIMIT);
    let o = j.output();
    assert!(!s.success(), "{} reported success:\n{o}", host.name);
    assert!(o.contains("lost the rendezvous host"), "{o}");
    host_empties(host);
}

fn no_worker_finished(out: &Path) {
    let r = results(out);
    assert!(r.is_empty(), "a worker finished: {r:?}");
}

#[test]
fn a_host_powered_off_mid_run_is_dropped_and_the_others_finish() {
    let mut c = cluster(3);
    let (dir, out) = with_results();
    let lost = Duration::from_secs(5);
    let mut jobs = elastic_on_hosts(&c, "2:3", dir.path(), &out, lost);
    wait_for_step(&dir.path().join("progress"), 3, 2, &mut jobs);
    c.hosts_mut()[2].power_off();
    let _ = jobs[2].wait(Duration::from_secs(10));
    for (h, j) in c.hosts()[..2].iter().zip(&mut jobs) {
        let s = j.wait(LIMIT);
        let o = j.output();
        assert!(s.success(), "{}: {s}\n{o}", h.name);
        // Cut off before it died: no reset reaches the others, the
        // rendezvous finds it dead.
        assert!(o.contains("1 lost: node3:"), "{}: {o}", h.name);
        assert!(
            o.contains("job succeeded (1 restart(s))"),
            "{}: {o}",
            h.name
        );
    }
    let r = results(&out);
    assert_eq!(r.len(), 2, "{r:?}");
    assert!(
        r.values()
            .all(|v| v["world_size"] == 2 && v["attempt"] == 1),
        "{r:?}"
    );
    let mut hosts: Vec<&str> = r.values().map(|v| v["host"].as_str().unwrap()).collect();
    hosts.sort();
    assert_eq!(hosts, ["node1", "node2"]);
}

#[test]
fn a_host_whose_agent_alone_is_sigkilled_leaves_no_worker_and_the_others_finish() {
    let c = cluster(3);
    let (dir, out) = with_results();
    let lost = Duration::from_secs(5);
    let mut jobs = elastic_on_hosts(&c, "2:3", dir.path(), &out, lost);
    wait_for_step(&dir.path().join("progress"), 3, 2, &mut jobs);
    jobs[2].signal(libc::SIGKILL);
    let _ = jobs[2].wait(Duration::from_secs(10));
    // Its worker dies with it: nothing is left on the host.
    host_empties(c.host(2));
    for (h, j) in c.hosts()[..2].iter().zip(&mut jobs) {
        let s = j.wait(LIMIT);
        let o = j.output();
        // Noticed through a worker's failure (the killed worker's connections
        // reset) or through the rendezvous, whichever comes first.
        assert!(s.success(), "{}: {s}\n{o}", h.name);
        assert!(
            o.contains("job succeeded (1 restart(s))"),
            "{}: {o}",
            h.name
        );
    }
    let r = results(&out);
    assert_eq!(r.len(), 2, "{r:?}");
    assert!(
        r.values()
            .all(|v| v["world_size"] == 2 && v["attempt"] == 1),
        "{r:?}"
    );
}

/// Our collectives across hosts: 2 hosts of 2 ranks each under `rally run`,
/// so shared memory inside a host and TCP between. Every op is exact.
#[test]
fn every_collective_is_exact_across_two_hosts_of_two_ranks() {
    use super::collectives::{self_exe, WORKER};
    let c = cluster(2);
    let dir = tempfile::tempdir().unwrap();
    let exe = self_exe();
    let mut jobs: Vec<Job> = c
        .hosts()
        .iter()
        .map(|h| {
            let args = [
                "--nnodes",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                "node1:29400",
                "--rdzv-id",
                "coll",
                "--nproc-per-node",
                "2",
                "--no-python",
                &exe,
            ];
            let mut cmd = rally_on(h, &args);
            cmd.env(WORKER, "ops");
            Job::spawn(cmd, dir.path(), &h.name)
        })
        .collect();
    let mut ranks_seen = Vec::new();
    for (h, j) in c.hosts().iter().zip(&mut jobs) {
        let s = j.wait(LIMIT);
        let o = j.output();
        assert!(s.success(), "{}: {s}\n{o}", h.name);
        let mine: Vec<usize> = (0..4)
            .filter(|r| o.contains(&format!("OK rank {r}")))
            .collect();
        assert_eq!(mine.len(), 2, "{}: two ranks per host\n{o}", h.name);
        ranks_seen.extend(mine);
    }
    ranks_seen.sort();
    assert_eq!(ranks_seen, [0, 1, 2, 3]);
}

/// Processes on test hosts whose output lines are collected as they come,
/// and background ones (a store) killed with them.
struct Watched {
    background: Vec<std::process::Child>,
    children: Vec<std::process::Child>,
    lines: Vec<std::sync::Arc<std::sync::Mutex<Vec<String>>>>,
}

impl Watched {
    fn new() -> Watched {
        Watched {
            background: Vec::new(),
            children: Vec::new(),
            lines: Vec::new(),
        }
    }

    /// A store for the processes, on `host` at `port`.
    fn store_on(&mut self, host: &Host, port: u16) {
        let store = host
            .command(env!("CARGO_BIN_EXE_rally"))
            .args(["store", "serve", "--port", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        self.background.push(store);
    }

    /// Starts `cmd` as process number `self.children.len()`.
    fn spawn(&mut self, mut cmd: Command) {
        use std::io::BufRead;
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        for pipe in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let seen = seen.clone();
            std::thread::spawn(move || {
                for l in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                    seen.lock().unwrap().push(l);
                }
            });
        }
        self.children.push(child);
        self.lines.push(seen);
    }

    /// Waits until every process printed `marker`.
    fn all_say(&self, marker: &str) {
        let t0 = Instant::now();
        while !(0..self.children.len()).all(|k| self.has(k, marker)) {
            assert!(
                t0.elapsed() < LIMIT,
                "no {marker:?} from all: {:?}",
                self.all()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether process `i` printed `marker` (the test harness may print on
    /// the same line before it).
    fn has(&self, i: usize, marker: &str) -> bool {
        self.line(i, marker).is_some()
    }

    /// Process `i`'s first line with `marker`, from the marker on.
    fn line(&self, i: usize, marker: &str) -> Option<String> {
        let l = self.lines[i].lock().unwrap();
        l.iter()
            .find_map(|l| l.find(marker).map(|at| l[at..].to_owned()))
    }

    /// The last count process `i` reported in a line `<prefix><n>`.
    fn count(&self, i: usize, prefix: &str) -> u64 {
        let l = self.lines[i].lock().unwrap();
        l.iter()
            .rev()
            .find_map(|l| l.strip_prefix(prefix)?.parse().ok())
            .unwrap_or(0)
    }

    fn all(&self) -> Vec<Vec<String>> {
        self.lines
            .iter()
            .map(|l| l.lock().unwrap().clone())
            .collect()
    }

    /// Process `i`'s exit status, waiting up to `limit`.
    fn wait(&mut self, i: usize, limit: Duration) -> std::process::ExitStatus {
        let all = self.all();
        super::wait_or_kill(&mut self.children[i], limit, || format!("{all:?}"))
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        for c in self.children.iter_mut().chain(&mut self.background) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Four ranks of our collectives, two on each of two hosts, all-reducing in a
/// loop (`loop-hosts`: `peer_timeout` 3 s, the op timeout at its 30-minute
/// default), on a `rally store serve` on node1: rank `r` is process `r`.
struct LoopingRanks;

const PEER_TIMEOUT: Duration = Duration::from_secs(3);

impl LoopingRanks {
    fn start(c: &Cluster) -> Watched {
        use super::collectives::{self_exe, WORKER};
        let mut w = Watched::new();
        w.store_on(c.host(0), 29600);
        for rank in 0..4 {
            let mut cmd = c.host(rank / 2).command(self_exe());
            cmd.env(WORKER, "loop-hosts")
                .env("MASTER_ADDR", "node1")
                .env("MASTER_PORT", "29600")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "4")
                .env("LOCAL_RANK", (rank % 2).to_string())
                .env("LOCAL_WORLD_SIZE", "2")
                .env("TORCHELASTIC_USE_AGENT_STORE", "True");
            w.spawn(cmd);
        }
        w.all_say("READY");
        w
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Survivors named rank 2 after 9.2 s (3 runs of 3) before the transport
/// stopped checking a timed-out connection with a fresh one.
#[test]
fn a_host_cut_off_for_good_mid_all_reduce_is_named_by_every_survivor() {
    let c = cluster(2);
    let mut ranks = LoopingRanks::start(&c);
    c.host(1).cut();
    let cut_at = unix_now();
    let bound = PEER_TIMEOUT + Duration::from_secs(5);
    for r in 0..2 {
        let s = ranks.wait(r, bound + Duration::from_secs(30));
        let err = ranks
            .line(r, "ERROR ")
            .unwrap_or_else(|| panic!("rank {r}: {:?}", ranks.all()));
        assert_eq!(s.code(), Some(3), "rank {r} must fail, not hang: {err}");
        assert!(
            err.contains("rank 2") || err.contains("rank 3"),
            "rank {r} does not name a cut-off rank: {err}"
        );
        for live in ["rank 0 is gone", "rank 1 is gone"] {
            assert!(!err.contains(live), "rank {r} names a live rank: {err}");
        }
        let at: f64 = err.split_whitespace().nth(1).unwrap().parse().unwrap();
        let lag = Duration::from_secs_f64((at - cut_at).max(0.0));
        eprintln!("rank {r} failed {lag:?} after the cut: {err}");
        assert!(
            lag < bound,
            "rank {r} took {lag:?} (bound {bound:?}): {err}"
        );
    }
}

/// A cut of a tenth of a second, while the ranks all-reduce without pause:
/// frames are lost and must be retransmitted. The peer timeout (3 s, set by
/// the `loop-hosts` scenario) is `TCP_USER_TIMEOUT`: how long sent data may
/// stay unacknowledged. TCP retransmits 0.2, 0.6, 1.4 and 3 s after the
/// first loss, so the data lost in a cut is acknowledged at the first of
/// those after the heal: 0.2 or 0.6 s for this cut (the heal runs `ip` three
/// times, which a loaded machine may take a few hundred milliseconds over),
/// five times under the timeout. A third of the timeout, as this test once
/// cut for, is healed after 1 s plus the heal's own time: acknowledged at
/// 1.4 s if that is quick, else at 3 s, the timeout itself. (A longer cut
/// needs a longer peer timeout in `collectives::worker`.)
const RIDE_OUT_COLLECTIVES_CUT: Duration = Duration::from_millis(100);

#[test]
fn a_host_cut_off_for_less_than_the_peer_timeout_is_ridden_out() {
    let c = cluster(2);
    let ranks = LoopingRanks::start(&c);
    let t0 = Instant::now();
    c.host(1).cut();
    std::thread::sleep(RIDE_OUT_COLLECTIVES_CUT);
    let at_heal: Vec<u64> = (0..4).map(|r| ranks.count(r, "ITER ")).collect();
    c.host(1).heal();
    eprintln!(
        "cut off for {:?} (peer timeout {PEER_TIMEOUT:?})",
        t0.elapsed()
    );
    let t0 = Instant::now();
    while !(0..4).all(|r| ranks.count(r, "ITER ") >= at_heal[r] + 30) {
        assert!(
            (0..4).all(|r| !ranks.has(r, "ERROR")),
            "an op failed over a cut shorter than the peer timeout: {:?}",
            ranks.all()
        );
        assert!(
            t0.elapsed() < LIMIT,
            "ops did not resume: {:?}",
            ranks.all()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// w0 on node1 (beside the store), w1 on node2 and w2 on node3, in the RPC
/// `hosts` scenario with a heartbeat deadline of `heartbeat`: w0 and w1 call
/// w2 in a loop.
fn rpc_on_three_hosts(c: &Cluster, heartbeat: Duration) -> Watched {
    use super::rpc::{HEARTBEAT_MS, WORKER};
    let mut w = Watched::new();
    w.store_on(c.host(0), 29601);
    for rank in 0..3 {
        let mut cmd = c.host(rank).command(super::collectives::self_exe());
        cmd.env(WORKER, "hosts")
            .env("MASTER_ADDR", "node1")
            .env("MASTER_PORT", "29601")
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "3")
            .env("TORCHELASTIC_USE_AGENT_STORE", "True")
            .env(HEARTBEAT_MS, heartbeat.as_millis().to_string());
        w.spawn(cmd);
    }
    w.all_say("READY");
    // Calls under way on both callers.
    let t0 = Instant::now();
    while !(0..2).all(|r| w.count(r, "CALL ") >= 3) {
        assert!(t0.elapsed() < LIMIT, "no calls: {:?}", w.all());
        std::thread::sleep(Duration::from_millis(20));
    }
    w
}

/// Each caller has a call waiting on w2 when w2's host is cut off for good:
/// both name w2 dead within the heartbeat deadline plus the margin, never
/// each other, and the RRef w2 owns fails naming it.
#[test]
fn an_rpc_worker_cut_off_past_the_heartbeat_is_named_dead_by_every_caller() {
    use super::rpc::HEARTBEAT;
    let c = cluster(3);
    let mut w = rpc_on_three_hosts(&c, HEARTBEAT);
    c.host(2).cut();
    let cut_at = unix_now();
    let bound = HEARTBEAT + Duration::from_secs(5);
    for r in 0..2 {
        let s = w.wait(r, bound + Duration::from_secs(30));
        let err = w
            .line(r, "ERROR ")
            .unwrap_or_else(|| panic!("w{r}: {:?}", w.all()));
        assert_eq!(s.code(), Some(3), "w{r} must fail, not hang: {err}");
        assert!(err.contains("w2"), "w{r} does not name w2: {err}");
        assert!(
            !err.contains(&format!("w{}", 1 - r)),
            "w{r} names a live worker: {err}"
        );
        let at: f64 = err.split_whitespace().nth(1).unwrap().parse().unwrap();
        let lag = Duration::from_secs_f64((at - cut_at).max(0.0));
        eprintln!("w{r} failed {lag:?} after the cut: {err}");
        assert!(lag < bound, "w{r} took {lag:?} (bound {bound:?}): {err}");
        let rref = w.line(r, "RREF ").unwrap();
        eprintln!("w{r}'s RRef: {rref}");
        assert!(
            rref.contains("w2") && !rref.contains("returned"),
            "w{r}'s RRef owned by w2: {rref}"
        );
    }
}

/// w2's host cut off for a second, with a heartbeat deadline of 20 s: no
/// caller names it dead, and calls resume once it heals. What the callers
/// hear is later than the heal: what w2 sent during the cut is retransmitted
/// with TCP's back-off (0.2, 0.6, 1.4, 3 s after the first loss), so up to
/// 3 s of silence when the heal is slow; the deadline is several times
/// that. (With the 3 s deadline of the test above, the same cut could end
/// at the deadline itself.)
#[test]
fn an_rpc_worker_cut_off_for_less_than_the_heartbeat_is_ridden_out() {
    let heartbeat = Duration::from_secs(20);
    let c = cluster(3);
    let w = rpc_on_three_hosts(&c, heartbeat);
    let t0 = Instant::now();
    c.host(2).cut();
    std::thread::sleep(Duration::from_secs(1));
    let at_heal: Vec<u64> = (0..2).map(|r| w.count(r, "CALL ")).collect();
    c.host(2).heal();
    eprintln!("cut off for {:?} (heartbeat {heartbeat:?})", t0.elapsed());
    let t0 = Instant::now();
    while !(0..2).all(|r| w.count(r, "CALL ") >= at_heal[r] + 10) {
        assert!(
            (0..2).all(|r| !w.has(r, "ERROR")),
            "a call failed over a cut shorter than the heartbeat: {:?}",
            w.all()
        );
        assert!(t0.elapsed() < LIMIT, "calls did not resume: {:?}", w.all());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The rally backend for torch.distributed across two hosts of two ranks
/// each (its collectives run in two levels: shared memory within a host,
/// TCP between): every op on every dtype, DDP, subgroups and DeviceMesh, as
/// on one host (`tests/py/torch_backend.py`).
#[test]
fn the_rally_backend_passes_every_op_and_ddp_across_two_hosts_of_two_ranks() {
    let c = cluster(2);
    let (dir, out) = with_results();
    let site = super::torch_backend::package(dir.path());
    let mut jobs: Vec<Job> = c
        .hosts()
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let mut args = rendezvous(&c, 2, i, Backend::C10dByAddress);
            args.extend(["--nproc-per-node".into(), "2".into()]);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let mut cmd = rally_on(h, &args);
            cmd.arg(script("torch_backend.py"))
                .env("RESULT_DIR", &out)
                .env("PYTHONPATH", &site)
                .env("SCENARIO", "ops");
            Job::spawn(cmd, dir.path(), &h.name)
        })
        .collect();
    for (h, j) in c.hosts().iter().zip(&mut jobs) {
        let s = j.wait(LIMIT);
        assert!(s.success(), "{}: {s}\n{}", h.name, j.output());
    }
    let log = jobs.iter().map(Job::output).collect::<String>();
    super::torch_backend::all_ops_passed(4, (results(&out).into_values().collect(), log));
}
