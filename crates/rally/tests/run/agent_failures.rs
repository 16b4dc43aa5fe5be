//! The agent where it breaks: signals in every phase, a rendezvous host that
//! fails or is killed, nodes finishing far apart, and descendants of workers
//! that leave their process group. Included by `run.rs` (one test binary).

use super::*;

/// `sleep` processes whose argument is `token` (a unique sleep length); not the
/// agents and their watchdogs, whose own command lines name it too.
fn procs_with(token: &str) -> Vec<i32> {
    let argv = format!("sleep\0{token}\0");
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c == argv.as_bytes() && alive(*pid))
        })
        .collect()
}

/// A worker shell that leaves three kinds of descendants behind: one in its
/// process group, one in a new session, one double-forked; all sleep `token`
/// seconds (a unique number, to find them).
fn escaping_worker(token: &str) -> String {
    format!("sleep {token} & setsid sleep {token} & (sleep {token} &); sleep {token}")
}

fn unique_token() -> String {
    format!(
        "{}.{}",
        9000 + std::process::id() % 1000,
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_micros()
    )
}

/// Waits until `n` processes carry `token`.
fn wait_procs(token: &str, n: usize) {
    let t0 = Instant::now();
    while procs_with(token).len() < n {
        assert!(t0.elapsed() < LIMIT, "workers never started");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until no process carries `token`; panics after `limit`.
fn assert_none_left(token: &str, limit: Duration, what: &str) {
    let t0 = Instant::now();
    while !procs_with(token).is_empty() {
        assert!(
            t0.elapsed() < limit,
            "{what}: {:?} still running",
            procs_with(token)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn sh_job(args: &[&str], shell: &str, dir: &Path, name: &str) -> Job {
    let mut c = rally(args);
    c.args(["--no-python", "sh", "-c", shell]);
    Job::spawn(c, dir, name)
}

pub(super) fn c10d(endpoint: &str, nnodes: &str, id: &str) -> Vec<String> {
    [
        "--nnodes",
        nnodes,
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        id,
        "--monitor-interval",
        "0.1",
    ]
    .map(String::from)
    .to_vec()
}

pub(super) fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Waits until the c10d rendezvous store at `endpoint` (`127.0.0.1:<port>`)
/// listens, `first` being the only agent started at it so far: whoever binds
/// the endpoint first hosts the store, so `first` is then provably the host,
/// whatever the agents started after it do. Panics, with its output, if
/// `first` exits before, or after [`LIMIT`] (an agent binds within a second).
pub(super) fn wait_hosting(endpoint: &str, first: &mut Job) {
    let t0 = Instant::now();
    while std::net::TcpStream::connect(endpoint).is_err() {
        if let Some(s) = first.child.try_wait().unwrap() {
            panic!(
                "the first agent ended ({s}) before it hosted the store at {endpoint}:\n{}",
                first.output()
            );
        }
        assert!(
            t0.elapsed() < LIMIT,
            "the first agent never hosted the store at {endpoint}:\n{}",
            first.output()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn sigkill_to_the_agent_leaves_no_descendant_even_setsid_or_double_forked() {
    let dir = tempfile::tempdir().unwrap();
    let token = unique_token();
    let mut job = sh_job(
        &["--standalone", "--nproc-per-node", "2"],
        &escaping_worker(&token),
        dir.path(),
        "job",
    );
    // Two workers, four sleeps each.
    wait_procs(&token, 8);
    job.signal(libc::SIGKILL);
    job.wait(LIMIT);
    assert_none_left(&token, Duration::from_secs(1), "after SIGKILL to the agent");
}

#[test]
fn a_signal_while_running_stops_every_descendant_and_exits_128_plus_n() {
    for (sig, name) in [(libc::SIGTERM, "term"), (libc::SIGINT, "int")] {
        let dir = tempfile::tempdir().unwrap();
        let token = unique_token();
        let mut job = sh_job(
            &[
                "--standalone",
                "--nproc-per-node",
                "2",
                "--shutdown-timeout",
                "3",
            ],
            &escaping_worker(&token),
            dir.path(),
            name,
        );
        wait_procs(&token, 8);
        job.signal(sig);
        let status = job.wait(LIMIT);
        assert_eq!(status.code(), Some(128 + sig), "{}", job.output());
        assert_none_left(&token, Duration::from_millis(100), "after the agent exited");
    }
}

#[test]
fn a_signal_during_the_rendezvous_wait_ends_the_agent_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    for (sig, name) in [(libc::SIGTERM, "term"), (libc::SIGINT, "int")] {
        // Waits for a second node that never comes.
        let mut args = c10d(&endpoint, "2", name);
        args.extend(["--nproc-per-node".into(), "1".into()]);
        let mut job = sh_job(&strs(&args), "true", dir.path(), name);
        std::thread::sleep(Duration::from_millis(500));
        let t0 = Instant::now();
        job.signal(sig);
        let status = job.wait(LIMIT);
        assert_eq!(status.code(), Some(128 + sig), "{}", job.output());
        // Not after the join timeout (600 s): the bound is the shutdown timeout
        // (30 s) plus 1 s, and no worker runs here.
        assert!(t0.elapsed() < Duration::from_secs(31), "{:?}", t0.elapsed());
    }
}

#[test]
fn a_signal_during_the_exit_barrier_ends_the_agent_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let token = unique_token();
    let mut args = c10d(&endpoint, "2", "barrier");
    args.extend(["--nproc-per-node".into(), "1".into()]);
    // Node a's worker succeeds at once; node b's runs long, so a waits at the
    // exit barrier (300 s by default).
    let mut a = sh_job(&strs(&args), "true", dir.path(), "a");
    let mut b = sh_job(&strs(&args), &format!("sleep {token}"), dir.path(), "b");
    wait_procs(&token, 1);
    std::thread::sleep(Duration::from_millis(500));
    a.signal(libc::SIGTERM);
    let status = a.wait(Duration::from_secs(31));
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{}", a.output());
    assert!(a.output().contains("during exit_barrier"), "{}", a.output());
    b.signal(libc::SIGTERM);
    b.wait(LIMIT);
    assert_none_left(
        &token,
        Duration::from_millis(100),
        "after both agents exited",
    );
}

#[test]
fn nodes_finishing_far_apart_both_succeed_and_no_worker_is_killed() {
    // Either node may be the one hosting the rendezvous store.
    for host_finishes_first in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let endpoint = format!("127.0.0.1:{}", free_port());
        let mut args = c10d(&endpoint, "2", "apart");
        // 300 s apart in the terms: here the barrier gives up after 1 s
        // and the slow node finishes 4 s after the fast one.
        args.extend(["--nproc-per-node", "1", "--exit-barrier-timeout", "1"].map(String::from));
        let done = dir.path().join("slow.done");
        let slow = format!("sleep 4 && touch {}", done.display());
        let (first, second) = if host_finishes_first {
            ("true", slow.as_str())
        } else {
            (slow.as_str(), "true")
        };
        let mut a = sh_job(&strs(&args), first, dir.path(), "a");
        // a hosts the rendezvous store before b starts.
        wait_hosting(&endpoint, &mut a);
        let mut b = sh_job(&strs(&args), second, dir.path(), "b");
        let (sa, sb) = (a.wait(LIMIT), b.wait(LIMIT));
        let both = format!("{}\n---\n{}", a.output(), b.output());
        assert!(
            sa.success() && sb.success(),
            "host first {host_finishes_first}: {both}"
        );
        assert!(done.exists(), "the slow worker was killed: {both}");
        assert!(!both.contains("SIGTERM"), "{both}");
    }
}

#[test]
fn a_failing_worker_on_the_rendezvous_host_fails_both_nodes_with_its_root_cause() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let token = unique_token();
    let mut args = c10d(&endpoint, "2", "hostfail");
    args.extend(["--nproc-per-node", "1", "--max-restarts", "0"].map(String::from));
    // The first agent hosts the rendezvous store; its worker raises after 1 s.
    let mut a = rally(&strs(&args));
    a.arg(script("raise_after.py")).env("RAISE_AFTER", "1");
    let mut a = Job::spawn(a, dir.path(), "a");
    wait_hosting(&endpoint, &mut a);
    let mut b = sh_job(&strs(&args), &format!("sleep {token}"), dir.path(), "b");
    wait_procs(&token, 1);
    let t0 = Instant::now();
    let (sa, sb) = (a.wait(LIMIT), b.wait(LIMIT));
    let took = t0.elapsed();
    let both = format!("{}\n---\n{}", a.output(), b.output());
    assert_eq!((sa.code(), sb.code()), (Some(1), Some(1)), "{both}");
    for out in [a.output(), b.output()] {
        assert!(out.contains("the host's worker broke on purpose"), "{both}");
    }
    // Before: the other node said "job succeeded" after about 183 s.
    assert!(took < Duration::from_secs(20), "{took:?}: {both}");
    assert_none_left(
        &token,
        Duration::from_millis(100),
        "after both agents exited",
    );
}

#[test]
fn a_sigkilled_rendezvous_host_fails_the_other_node_as_lost() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let token = unique_token();
    let mut args = c10d(&endpoint, "2", "hostkill");
    args.extend(["--nproc-per-node", "1", "--rdzv-lost-timeout", "2"].map(String::from));
    // a hosts the rendezvous store before b starts.
    let mut a = sh_job(&strs(&args), &format!("sleep {token}"), dir.path(), "a");
    wait_hosting(&endpoint, &mut a);
    let mut b = sh_job(&strs(&args), &format!("sleep {token}"), dir.path(), "b");
    wait_procs(&token, 2);
    a.signal(libc::SIGKILL);
    let t0 = Instant::now();
    let sb = b.wait(LIMIT);
    let took = t0.elapsed();
    assert_eq!(sb.code(), Some(1), "{}", b.output());
    assert!(
        b.output().contains("lost the rendezvous host"),
        "{}",
        b.output()
    );
    assert!(!b.output().contains("succeeded"), "{}", b.output());
    assert!(took < Duration::from_secs(20), "{took:?}: {}", b.output());
    a.wait(LIMIT);
    assert_none_left(&token, Duration::from_secs(1), "after both agents exited");
}
