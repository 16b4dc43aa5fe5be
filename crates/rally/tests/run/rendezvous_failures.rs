//! The defects of issue 18 where they show end to end: the static backend
//! watched (a failure elsewhere stops this node's workers, a node that dies is
//! noticed), the job store outliving the host's own workers, and a join whose
//! rendezvous store is gone. Included by `run.rs` (one test binary).

use super::agent_failures::{c10d, strs, wait_hosting};
use super::*;

/// Flags of node `rank` of a two-node static job whose rank 0 hosts the
/// store on `port`, keeping alive every 0.5 s (dead after two misses).
fn static_node(rank: usize, port: u16) -> Vec<String> {
    static_node_of(2, rank, port)
}

fn static_node_of(nodes: usize, rank: usize, port: u16) -> Vec<String> {
    [
        "--nnodes",
        &nodes.to_string(),
        "--nproc-per-node",
        "1",
        "--node-rank",
        &rank.to_string(),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port.to_string(),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.1",
        "--rdzv-conf",
        "keep_alive_interval=0.5,keep_alive_max_attempt=2",
    ]
    .map(String::from)
    .to_vec()
}

fn sh(args: &[String], shell: &str, dir: &Path, name: &str) -> Job {
    let mut c = rally(&args.iter().map(String::as_str).collect::<Vec<_>>());
    c.args(["--no-python", "sh", "-c", shell]);
    Job::spawn(c, dir, name)
}

/// Waits until `path` exists.
fn wait_file(path: &Path) {
    let t0 = Instant::now();
    while !path.exists() {
        assert!(t0.elapsed() < LIMIT, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Defect 5: under the default backend a failure on one node used to leave
/// the other node's workers running until a collective timed out (here:
/// forever, the workers never talk). Now the published failure stops them, and
/// both nodes report the same root cause.
#[test]
fn static_a_failure_on_one_node_stops_the_other_nodes_workers() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let started = dir.path().join("started");
    let mut a = sh(
        &static_node(0, port),
        &format!("touch {}; sleep 600", started.display()),
        dir.path(),
        "a",
    );
    let mut b = sh(
        &static_node(1, port),
        &format!(
            "while [ ! -e {} ]; do sleep 0.05; done; echo broke on purpose >&2; exit 3",
            started.display()
        ),
        dir.path(),
        "b",
    );
    let t0 = Instant::now();
    let (sa, sb) = (a.wait(LIMIT), b.wait(LIMIT));
    let took = t0.elapsed();
    let both = format!("{}\n---\n{}", a.output(), b.output());
    assert_eq!((sa.code(), sb.code()), (Some(1), Some(1)), "{both}");
    for out in [a.output(), b.output()] {
        assert!(out.contains("exitcode  : 3"), "{both}");
    }
    assert!(took < Duration::from_secs(30), "{took:?}: {both}");
}

/// Defect 5, the other half: a static node killed outright (its agent and
/// workers) is noticed through the keep-alive, and the survivor fails at once
/// naming why, instead of waiting forever (PyTorch's static handler never
/// notices).
#[test]
fn static_a_killed_node_fails_the_job_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let started = dir.path().join("b.started");
    let mut a = sh(&static_node(0, port), "sleep 600", dir.path(), "a");
    let mut b = sh(
        &static_node(1, port),
        &format!("touch {}; sleep 600", started.display()),
        dir.path(),
        "b",
    );
    wait_file(&started);
    b.signal(libc::SIGKILL);
    let t0 = Instant::now();
    let sa = a.wait(LIMIT);
    let took = t0.elapsed();
    assert_eq!(sa.code(), Some(1), "{}", a.output());
    assert!(
        a.output().contains("stopped keeping alive"),
        "{}",
        a.output()
    );
    assert!(took < Duration::from_secs(20), "{took:?}: {}", a.output());
    b.wait(LIMIT);
}

/// A static node that comes late (PyTorch allows minutes) is waited for, not
/// taken for dead by the keep-alive of a node that came before it (found by
/// review: the watchers started before every node was in).
#[test]
fn static_a_late_node_is_not_taken_for_dead() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut a = sh(&static_node_of(3, 0, port), "sleep 1", dir.path(), "a");
    let mut b = sh(&static_node_of(3, 1, port), "sleep 1", dir.path(), "b");
    // Four keep-alive expiries (1 s each) before the third node comes.
    std::thread::sleep(Duration::from_secs(4));
    let mut c = sh(&static_node_of(3, 2, port), "sleep 1", dir.path(), "c");
    let (sa, sb, sc) = (a.wait(LIMIT), b.wait(LIMIT), c.wait(LIMIT));
    let all = format!("{}\n---\n{}\n---\n{}", a.output(), b.output(), c.output());
    assert!(sa.success() && sb.success() && sc.success(), "{all}");
}

/// Defect 1: the round's job store used to go away as soon as the host
/// node's own workers exited; a worker elsewhere that used it later (a final
/// barrier, a checkpoint handshake) then failed. Real PyTorch clients.
#[test]
fn the_job_store_outlives_the_host_nodes_workers() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let mut args = c10d(&endpoint, "2", "late-store");
    args.extend(["--nproc-per-node", "1", "--max-restarts", "0"].map(String::from));
    let job = |name: &str| {
        let mut c = rally(&strs(&args));
        c.arg(script("late_store_user.py")).env("LATE", "3");
        Job::spawn(c, dir.path(), name)
    };
    let mut a = job("a");
    wait_hosting(&endpoint, &mut a);
    let mut b = job("b");
    let (sa, sb) = (a.wait(LIMIT), b.wait(LIMIT));
    let both = format!("{}\n---\n{}", a.output(), b.output());
    assert!(sa.success() && sb.success(), "{both}");
    assert!(
        both.contains("rank 1 used the job store after rank 0 exited"),
        "{both}"
    );
}

/// Defect 7: a node waiting in a join whose rendezvous store stopped answering
/// (its host stopped: a hung machine, a partition; a closed connection fails at
/// once) used to wait for the join timeout (600 s). It fails within
/// `--rdzv-lost-timeout` plus a probe, naming the run.
#[test]
fn a_join_whose_rendezvous_store_is_gone_fails_within_the_lost_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let mut args = c10d(&endpoint, "3", "gone");
    args.extend(["--nproc-per-node", "1", "--rdzv-lost-timeout", "2"].map(String::from));
    // The host and one more node wait for a third that never comes.
    let mut host = sh(&args, "true", dir.path(), "host");
    wait_hosting(&endpoint, &mut host);
    let mut waiting = sh(&args, "true", dir.path(), "waiting");
    // Let the second node reach its wait, then stop the store's host.
    std::thread::sleep(Duration::from_secs(2));
    host.signal(libc::SIGSTOP);
    let t0 = Instant::now();
    let s = waiting.wait(LIMIT);
    let took = t0.elapsed();
    let out = waiting.output();
    assert!(!s.success(), "{out}");
    assert!(out.contains("stopped answering"), "{out}");
    assert!(
        out.contains(&format!("rendezvous store at {endpoint} of run gone")),
        "{out}"
    );
    assert!(took < Duration::from_secs(10), "{took:?}: {out}");
    host.signal(libc::SIGKILL);
    host.signal(libc::SIGCONT);
    host.wait(LIMIT);
}

/// A rendezvous store that stalls for a few seconds (its host stopped, then
/// resumed) while a node waits at the exit barrier: the node notes that the
/// store does not answer and goes on waiting; both nodes succeed. (The note
/// once made the driver abandon the barrier and panic.)
#[test]
fn a_store_that_stalls_during_the_exit_barrier_is_waited_for() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let mut args = c10d(&endpoint, "2", "stall");
    args.extend(["--nproc-per-node", "1", "--rdzv-lost-timeout", "30"].map(String::from));
    let started = dir.path().join("host.started");
    let mut host = sh(
        &args,
        &format!("touch {}; sleep 7", started.display()),
        dir.path(),
        "host",
    );
    wait_hosting(&endpoint, &mut host);
    let mut other = sh(&args, "true", dir.path(), "other");
    wait_file(&started);
    // The other node is at the exit barrier; stop the store's host for longer
    // than a check's bound (2 s).
    std::thread::sleep(Duration::from_secs(1));
    host.signal(libc::SIGSTOP);
    std::thread::sleep(Duration::from_secs(4));
    host.signal(libc::SIGCONT);
    let (sh_, so) = (host.wait(LIMIT), other.wait(LIMIT));
    let both = format!("{}\n---\n{}", host.output(), other.output());
    assert!(sh_.success() && so.success(), "{both}");
    assert!(!both.contains("panicked"), "{both}");
}

/// Defect 2: with three nodes, the rendezvous host used to stop lingering
/// once a finished node stopped keeping alive (counted dead), taking the store
/// from a third node still training. It now lingers until that node leaves.
#[test]
fn the_host_lingers_for_a_third_node_still_running() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let mut args = c10d(&endpoint, "3", "third");
    args.extend(
        [
            "--nproc-per-node",
            "1",
            "--exit-barrier-timeout",
            "1",
            "--rdzv-conf",
            "keep_alive_interval=0.5,keep_alive_max_attempt=2",
        ]
        .map(String::from),
    );
    let done = dir.path().join("slow.done");
    // Whichever node gets rank 2 trains for 6 s (six keep-alive expiries);
    // the others finish at once and leave the exit barrier after 1 s.
    let worker = format!(
        "if [ \"$RANK\" = 2 ]; then sleep 6 && touch {}; fi",
        done.display()
    );
    let mut host = sh(&args, &worker, dir.path(), "host");
    wait_hosting(&endpoint, &mut host);
    let mut b = sh(&args, &worker, dir.path(), "b");
    let mut c = sh(&args, &worker, dir.path(), "c");
    let (sh_, sb, sc) = (host.wait(LIMIT), b.wait(LIMIT), c.wait(LIMIT));
    let all = format!(
        "{}\n---\n{}\n---\n{}",
        host.output(),
        b.output(),
        c.output()
    );
    assert!(sh_.success() && sb.success() && sc.success(), "{all}");
    assert!(done.exists(), "the slow worker did not finish: {all}");
    assert!(!all.contains("lost the rendezvous host"), "{all}");
}

/// Scale (no polling): an agent is woken by the store, not by its monitor
/// tick. With a monitor interval of ten minutes, a failure published by the
/// other node still stops this node's workers at once (the agent of e2f1960
/// looked only every monitor interval, so it ran on for ten minutes).
#[test]
fn a_failure_elsewhere_wakes_an_agent_whose_monitor_interval_is_ten_minutes() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let started = dir.path().join("started");
    let args: Vec<String> = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        &endpoint,
        "--rdzv-id",
        "woken",
        "--monitor-interval",
        "600",
    ]
    .map(String::from)
    .to_vec();
    let mut a = sh(
        &args,
        &format!("touch {}; sleep 600", started.display()),
        dir.path(),
        "a",
    );
    // a hosts the rendezvous store before b starts.
    wait_hosting(&endpoint, &mut a);
    let mut b = sh(
        &args,
        &format!(
            "while [ ! -e {} ]; do sleep 0.05; done; sleep 1; echo broke on purpose >&2; exit 3",
            started.display()
        ),
        dir.path(),
        "b",
    );
    let (sa, sb) = (a.wait(LIMIT), b.wait(LIMIT));
    let both = format!("{}\n---\n{}", a.output(), b.output());
    assert_eq!((sa.code(), sb.code()), (Some(1), Some(1)), "{both}");
    for out in [a.output(), b.output()] {
        assert!(out.contains("exitcode  : 3"), "{both}");
    }
}
