//! Two nodes of one host asked to host the same port at once (a c10d endpoint
//! both of them match): exactly one hosts it, and the other joins it.
//!
//! Linux marks a socket listening before it checks the port for other
//! listeners, so two listens that overlap, in two processes, can both fail with
//! EADDRINUSE (45 of 2,000 such races on this machine's kernel, 6.18). A node
//! that then falls back to being a client, as the c10d creator did, is refused
//! until its timeout, and so is the other: neither hosts, and the job fails
//! after 60 s (2 of 40 two-node `rally run`s on 127.0.0.1 did).
//! `TcpStoreBuilder::host_or_join` tries to host again while nothing listens.
//!
//! The race needs two processes: the test runs this binary twice as children
//! (`race_child`), starting both at one instant.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rallypoint_store::{Store, TcpStore};

pub(crate) const PORT: &str = "RALLY_TEST_RACE_PORT";
const AT: &str = "RALLY_TEST_RACE_AT";
const ME: &str = "RALLY_TEST_RACE_ME";
/// Marks a child's own output (the harness prints on the same lines).
const MARK: &str = "@race:";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn now_nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// The role of one node of a race, run by a child the test below starts (see
/// `role` in `main.rs`). Prints `hosted` or `joined` (or `failed: ...`), then,
/// on a line from stdin, whether it sees the other node's key, then waits for
/// stdin to close.
pub(crate) fn race_child() {
    let (Ok(port), Ok(at), Ok(me)) = (std::env::var(PORT), std::env::var(AT), std::env::var(ME))
    else {
        panic!("a race child needs {PORT}, {AT} and {ME}");
    };
    let port: u16 = port.parse().unwrap();
    let at: u128 = at.parse().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(WAITING)
        .enable_all()
        .build()
        .unwrap();
    let builder = TcpStore::builder("127.0.0.1", port).timeout(Duration::from_secs(5));
    while now_nanos() < at {
        std::hint::spin_loop();
    }
    let store = match rt.block_on(builder.host_or_join()) {
        Ok(s) => s,
        Err(e) => {
            println!("{MARK}failed: {e}");
            return;
        }
    };
    // `add`, not `set`: a SET has no reply.
    rt.block_on(store.add(&me, 1)).unwrap();
    println!(
        "{MARK}{}",
        if store.server().is_some() {
            "hosted"
        } else {
            "joined"
        }
    );
    let mut lines = std::io::stdin().lock().lines();
    lines.next();
    let other = if me == "a" { "b" } else { "a" };
    println!("{MARK}sees {:?}", rt.block_on(store.add(other, 0)).ok());
    lines.next();
}

fn child(port: u16, at: u128, me: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .env(PORT, port.to_string())
        .env(AT, at.to_string())
        .env(ME, me)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// The next line a child printed that is its own (not the test harness's).
fn said(out: &mut impl BufRead) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            return "<exited>".into();
        }
        if let Some((_, said)) = line.split_once(MARK) {
            return said.trim().to_owned();
        }
    }
}

/// The name of `race_child`'s runtime thread (15 bytes at most: Linux keeps
/// no more), which the test looks for.
const WAITING: &str = "race-waiting";

/// Whether process `pid` has built its tokio runtime (it has a thread named
/// [`WAITING`]): `race_child` builds it just before it spins, waiting for
/// the instant.
fn waiting_for_the_instant(pid: u32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks.flatten().any(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|c| c.trim_end() == WAITING)
            })
        })
        .unwrap_or(false)
}

/// Every round must leave one host and one client. A round counts as a race
/// only if both children were seen waiting for the instant before it came
/// (else one starts late, finds the other hosting, and there was no race);
/// 300 rounds must be races. A round found not to be one makes the lead
/// before the instant of the next ones twice as long (a loaded machine
/// starts processes slowly). That both then leave the spin at the instant is
/// the scheduler's, which a test cannot see; this is as close as it can get.
#[test]
fn two_nodes_racing_to_host_one_port_leave_exactly_one_host() {
    let rounds = 300;
    let mut lead = Duration::from_millis(30);
    let (mut raced, mut late) = (0, 0);
    while raced < rounds {
        let i = raced + late;
        let port = free_port();
        // Both start at one instant, `lead` ahead for both to be running.
        let at = now_nanos() + lead.as_nanos();
        let mut kids = [child(port, at, "a"), child(port, at, "b")];
        let pids = [kids[0].id(), kids[1].id()];
        let both_waiting = loop {
            if pids.iter().all(|p| waiting_for_the_instant(*p)) {
                break now_nanos() < at;
            }
            if now_nanos() >= at {
                break false;
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        let mut outs: Vec<_> = kids
            .iter_mut()
            .map(|k| BufReader::new(k.stdout.take().unwrap()))
            .collect();
        let roles: Vec<String> = outs.iter_mut().map(said).collect();
        for k in &mut kids {
            let _ = writeln!(k.stdin.as_mut().unwrap());
        }
        let sees: Vec<String> = outs.iter_mut().map(said).collect();
        for k in &mut kids {
            drop(k.stdin.take());
            k.wait().unwrap();
        }
        let mut sorted = roles.clone();
        sorted.sort();
        assert_eq!(sorted, ["hosted", "joined"], "round {i}: {roles:?}");
        assert_eq!(
            sees,
            ["sees Some(1)", "sees Some(1)"],
            "round {i}: {roles:?}"
        );
        if both_waiting {
            raced += 1;
        } else {
            late += 1;
            lead = (lead * 2).min(Duration::from_secs(2));
            assert!(
                late <= 50,
                "{late} rounds of {} had a node start after the instant (lead now {lead:?})",
                raced + late
            );
        }
    }
    eprintln!("{raced} races; {late} rounds not races (a node late); lead {lead:?}");
}
