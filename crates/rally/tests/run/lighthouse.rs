//! torchft 0.2.0's own managers against `rally lighthouse`: two replica
//! groups of one process each run a tiny torchft loop
//! (`tests/py/ft/lighthouse_loop.py`: torchft's `Manager`, its
//! `ProcessGroupGloo` with a 5 s timeout, its `DistributedDataParallel` and
//! `Optimizer` wrappers) with `TORCHFT_LIGHTHOUSE` pointing at ours, which
//! they reach with torchft's own gRPC client. Healthy, both commit every step
//! together and end normally; with one SIGKILLed between steps, the survivor
//! commits its next step without waiting for a heartbeat to age out, since
//! the dead manager's connection reset drops it at once. A replica healed
//! through `RallyTransport` under torchft's `Manager`
//! (`tests/py/ft/heal_report.py`) shows in the lighthouse's `/status` and
//! `/metrics` with its byte count.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;

use super::torch_backend::package;
use super::{free_port, python, script, Job};

/// How long a run of a few steps may take, imports included (seconds of
/// Python and torch start-up on a loaded 2-core machine).
const RUN_LIMIT: Duration = Duration::from_secs(120);

/// `rally lighthouse` on a free loopback port.
struct Lighthouse {
    child: Child,
    port: u16,
    log: Arc<Mutex<String>>,
}

impl Lighthouse {
    fn start(args: &[&str]) -> Lighthouse {
        let mut all = vec!["--bind", "127.0.0.1:0"];
        all.extend_from_slice(args);
        Lighthouse::start_with(&all)
    }

    /// With exactly these flags (`--bind` among them).
    fn start_with(args: &[&str]) -> Lighthouse {
        let mut child = Command::new(env!("CARGO_BIN_EXE_rally"))
            .arg("lighthouse")
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let kept = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("rally lighthouse: listening on ") {
                    let _ = tx.send(addr.to_owned());
                }
                let mut log = kept.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("rally lighthouse never said where it listens");
        let port = addr.rsplit(':').next().unwrap().parse().unwrap();
        Lighthouse { child, port, log }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Lighthouse {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Replica group `n` of the loop, up to `steps` committed steps; with
/// `pause_at`, it waits after committing that step (for the test's kill).
fn replica(dir: &Path, lh: &Lighthouse, n: u32, steps: u32, pause_at: Option<u32>) -> Job {
    let mut c = replica_command(dir, lh, n, steps);
    if let Some(p) = pause_at {
        c.env("PAUSE_AT", p.to_string());
    }
    Job::spawn(c, dir, &format!("replica{n}"))
}

/// The command of replica group `n` of the loop, up to `steps` steps.
fn replica_command(dir: &Path, lh: &Lighthouse, n: u32, steps: u32) -> Command {
    let mut c = Command::new(python());
    c.arg(script("ft/lighthouse_loop.py"))
        .env("REPLICA", n.to_string())
        .env("REPLICAS", "2")
        .env("STEPS", steps.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("RESULT", dir.join(format!("r{n}.jsonl")))
        .env(
            "TORCHFT_LIGHTHOUSE",
            format!("http://127.0.0.1:{}", lh.port),
        )
        .env("LH_STATUS", format!("http://127.0.0.1:{}/status", lh.port))
        .env("GLOO_SOCKET_IFNAME", "lo");
    c
}

/// How many steps replica `n` has committed.
fn steps_of(dir: &Path, n: u32) -> usize {
    commits(dir, n).len()
}

/// The committed steps of replica `n`, one JSON object each.
fn commits(dir: &Path, n: u32) -> Vec<Value> {
    std::fs::read_to_string(dir.join(format!("r{n}.jsonl")))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn steps(commits: &[Value]) -> Vec<u64> {
    commits
        .iter()
        .map(|c| c["step"].as_u64().unwrap())
        .collect()
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[test]
fn torchft_managers_commit_every_step_together_through_rally_lighthouse() {
    let dir = tempfile::tempdir().unwrap();
    let lh = Lighthouse::start(&["--min_replicas", "2", "--join_timeout_ms", "10000"]);
    let mut jobs = [0, 1].map(|n| replica(dir.path(), &lh, n, 5, None));
    for (n, job) in jobs.iter_mut().enumerate() {
        let status = job.wait(RUN_LIMIT);
        assert!(
            status.success(),
            "replica {n}: {status}\n{}\nlighthouse:\n{}",
            job.output(),
            lh.log()
        );
    }
    for n in [0, 1] {
        let c = commits(dir.path(), n);
        assert_eq!(steps(&c), [1, 2, 3, 4, 5], "replica {n}: {c:?}");
        assert!(
            c.iter().all(|c| c["participants"] == 2),
            "replica {n}: {c:?}"
        );
    }
}

#[test]
fn a_survivor_commits_at_once_after_its_peer_is_sigkilled_between_steps() {
    let dir = tempfile::tempdir().unwrap();
    // --min_replicas 1 so that the survivor may go on alone; a heartbeat
    // timeout of 10 s, so that only the dead manager's connection reset can
    // explain a drop within the bound below.
    let lh = Lighthouse::start(&[
        "--min_replicas",
        "1",
        "--join_timeout_ms",
        "10000",
        "--heartbeat_timeout_ms",
        "10000",
    ]);
    let mut survivor = replica(dir.path(), &lh, 0, 8, None);
    let mut victim = replica(dir.path(), &lh, 1, 8, Some(3));

    let t0 = Instant::now();
    while steps(&commits(dir.path(), 1)).last() != Some(&3) {
        if let Some(s) = victim.child.try_wait().unwrap() {
            panic!("replica 1 ended early: {s}\n{}", victim.output());
        }
        assert!(
            t0.elapsed() < RUN_LIMIT,
            "replica 1 never committed step 3:\n{}",
            victim.output()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let killed_at = unix_now();
    victim.signal(libc::SIGKILL);
    let _ = victim.child.wait();

    let status = survivor.wait(RUN_LIMIT);
    assert!(
        status.success(),
        "survivor: {status}\n{}\nlighthouse:\n{}",
        survivor.output(),
        lh.log()
    );
    let c = commits(dir.path(), 0);
    assert_eq!(steps(&c), (1..=8).collect::<Vec<_>>(), "{c:?}");
    // The victim's last step was 3; the survivor's step 4 is its first
    // without it.
    let next = c.iter().find(|c| c["step"] == 4).unwrap();
    assert_eq!(next["participants"], 1, "{next}");
    let took = next["t"].as_f64().unwrap() - killed_at;
    eprintln!(
        "survivor's next commit {:.3} s after the kill (step {})",
        took, next["step"]
    );
    // torchft's own lighthouse takes its 5 s heartbeat timeout here (10 s
    // at this one, were the connection not watched); the drop is at the
    // reset, and the rest is one small step.
    assert!(
        took < 2.5,
        "survivor's next commit {took:.3} s after the kill\n{}\nlighthouse:\n{}",
        survivor.output(),
        lh.log()
    );
    assert!(
        lh.log().contains("closed"),
        "dropped by its session's end:\n{}",
        lh.log()
    );
}

#[test]
fn rally_lighthouse_stops_cleanly_on_sigterm_and_sigint() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let mut lh = Lighthouse::start(&["--min_replicas", "1"]);
        // SAFETY: signalling our own child.
        unsafe { libc::kill(lh.child.id() as i32, sig) };
        let log = lh.log.clone();
        let status = super::wait_or_kill(&mut lh.child, Duration::from_secs(30), || {
            log.lock().unwrap().clone()
        });
        assert!(status.success(), "signal {sig}: {status}\n{}", lh.log());
    }
}

#[test]
fn rally_lighthouse_refuses_bad_flags_and_a_busy_port() {
    let out = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["lighthouse", "--bind", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--min_replicas"), "{err}");

    let lh = Lighthouse::start(&["--min-replicas", "1", "--heartbeat-timeout-ms", "500"]);
    let bind = format!("127.0.0.1:{}", lh.port);
    let out = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["lighthouse", "--min_replicas", "1", "--bind", &bind])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("failed to listen on {bind}")),
        "{err}"
    );
}

/// A GET of `path` at the lighthouse on `port`; the body of its `200`.
fn get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: lh\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "GET {path}: {out}");
    out.split_once("\r\n\r\n").unwrap().1.to_owned()
}

#[test]
fn a_heal_through_rally_transport_under_torchfts_manager_shows_in_status_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let lh = Lighthouse::start(&["--min_replicas", "1", "--join_timeout_ms", "1000"]);
    let mut c = Command::new(python());
    c.arg(script("ft/heal_report.py"))
        .env("PYTHONPATH", package(dir.path()))
        .env("LIGHTHOUSE", format!("http://127.0.0.1:{}", lh.port))
        .env("MASTER_ADDR", "127.0.0.1")
        .env("PYTHONUNBUFFERED", "1");
    let mut job = Job::spawn(c, dir.path(), "script");
    let status = job.wait(RUN_LIMIT);
    let out = job.output();
    assert!(
        status.success() && out.contains("PASS"),
        "{status}\n{out}\nlighthouse:\n{}",
        lh.log()
    );
    assert!(out.contains("no heal endpoint, logged once"), "{out}");
    let line = out.lines().find(|l| l.starts_with("HEAL step ")).unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    let (step, bytes): (i64, u64) = (words[2].parse().unwrap(), words[4].parse().unwrap());
    // The report left on a daemon thread that the replica waited for at
    // exit; it has landed by now.
    let s: Value = serde_json::from_str(&get(lh.port, "/status")).unwrap();
    let heals = &s["heals"];
    assert_eq!(heals["total"], 1, "one heal: {s}\n{}", lh.log());
    let h = &heals["last"][0];
    assert!(
        h["replica_id"].as_str().unwrap().starts_with("heal_1:"),
        "torchft's name:uuid of replica 1: {h}"
    );
    assert_eq!(h["step"], step, "{h}");
    assert_eq!(h["bytes"], bytes, "the state dict's tensor bytes: {h}");
    assert!(h["seconds"].as_f64().unwrap() > 0.0, "{h}");
    assert_eq!(h["sources"].as_array().unwrap().len(), 1, "{h}");
    assert!(h["quorum_id"].as_i64().is_some(), "{h}");
    assert_eq!(heals["by_replica"][h["replica_id"].as_str().unwrap()], *h);
    let metrics = get(lh.port, "/metrics");
    for want in [
        "rally_lighthouse_heals_total 1".to_owned(),
        format!("rally_lighthouse_heal_bytes_total {bytes}"),
        "rally_lighthouse_heal_seconds_count 1".to_owned(),
    ] {
        assert!(metrics.lines().any(|l| l == want), "{want:?} in\n{metrics}");
    }
    until_log(&lh, "heal reported");
}

/// A real etcd on loopback (Debian's `etcd-server`).
#[cfg(feature = "etcd")]
fn etcd() -> rallypoint_rendezvous::etcd::testing::EtcdServer {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(rallypoint_rendezvous::etcd::testing::EtcdServer::start())
        .unwrap()
}

/// Polls the lighthouse's `/status` until `ok` holds, within `limit`.
fn until_status(lh: &Lighthouse, limit: Duration, ok: impl Fn(&Value) -> bool) -> Duration {
    let t0 = Instant::now();
    loop {
        let s: Value = serde_json::from_str(&get(lh.port, "/status")).unwrap();
        if ok(&s) {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < limit,
            "status never got there within {limit:?}: {s}\n{}",
            lh.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until the lighthouse's log (read from its stderr by a thread)
/// has `needle`, within [`RUN_LIMIT`].
fn until_log(lh: &Lighthouse, needle: &str) {
    let t0 = Instant::now();
    while !lh.log().contains(needle) {
        assert!(
            t0.elapsed() < RUN_LIMIT,
            "{needle:?} never in the log:\n{}",
            lh.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `--state etcd://`: a second `rally lighthouse` on the prefix stands by
/// and takes over when the leader is SIGKILLed, within the lease's TTL
/// (2 s) plus a margin of 8 s.
#[cfg(feature = "etcd")]
#[test]
fn a_standby_rally_lighthouse_takes_over_when_the_leader_is_sigkilled() {
    let etcd = etcd();
    let state = format!("etcd://{}/job1", etcd.endpoint);
    let args = [
        "--min_replicas",
        "1",
        "--state",
        &state,
        "--state_lease_s",
        "2",
    ];
    let mut leader = Lighthouse::start(&args);
    until_status(&leader, RUN_LIMIT, |s| s["role"] == "leader");
    let standby = Lighthouse::start(&args);
    let named = format!("127.0.0.1:{}", leader.port);
    until_status(&standby, RUN_LIMIT, |s| {
        s["role"] == "standby" && s["leader"].as_str().is_some_and(|l| l.contains(&named))
    });
    until_log(&standby, "standing by");
    let metrics = get(standby.port, "/metrics");
    assert!(
        metrics.contains("\nrally_lighthouse_leader 0\n"),
        "{metrics}"
    );

    let killed = Instant::now();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(leader.child.id() as i32, libc::SIGKILL) };
    let _ = leader.child.wait();
    until_status(&standby, Duration::from_secs(10), |s| s["role"] == "leader");
    let took = killed.elapsed();
    eprintln!("the standby led {took:?} after the leader's SIGKILL (lease TTL 2 s)");
    until_log(&standby, "this lighthouse leads now");
    let metrics = get(standby.port, "/metrics");
    assert!(
        metrics.contains("\nrally_lighthouse_leader 1\n"),
        "{metrics}"
    );
}

#[test]
fn rally_lighthouse_names_an_unreachable_state_store_within_its_timeout() {
    let port = free_port();
    let t0 = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["lighthouse", "--min_replicas", "1", "--bind", "127.0.0.1:0"])
        .args(["--state", &format!("etcd://127.0.0.1:{port}/x")])
        .output()
        .unwrap();
    let took = t0.elapsed();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("etcd at 127.0.0.1:{port}")), "{err}");
    // Its timeout is 5 s; a margin of 10 s for a loaded machine.
    assert!(took < Duration::from_secs(15), "{took:?}: {err}");
    let out = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["lighthouse", "--min_replicas", "1", "--state", "http://h:1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("only etcd://HOST:PORT[/prefix]"), "{err}");
}

/// The quorum ids of a lighthouse log's `new quorum issued` lines, in order.
fn issued_ids(log: &str) -> Vec<i64> {
    log.lines()
        .filter(|l| l.contains("new quorum issued"))
        .filter_map(|l| {
            let at = l.find("quorum_id=")? + "quorum_id=".len();
            let digits: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect()
}

/// torchft 0.2.0's managers through a restart of `rally lighthouse
/// --state etcd://` on the same address (SIGKILLed, so the new one waits
/// out the old lease, refusing calls, then leads): no replica crashes,
/// every step is committed by both, and the new lighthouse's first quorum
/// is the saved one under its id (the managers do not reconfigure).
#[cfg(feature = "etcd")]
#[test]
fn torchft_managers_ride_a_sigkilled_and_restarted_rally_lighthouse_with_its_state_in_etcd() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = etcd();
    let state = format!("etcd://{}/ride", etcd.endpoint);
    let bind = format!("127.0.0.1:{}", free_port());
    let args = [
        "--min_replicas",
        "1",
        "--join_timeout_ms",
        "10000",
        "--state",
        &state,
        "--bind",
        &bind,
    ];
    let mut first = Lighthouse::start_with(&args);
    until_status(&first, RUN_LIMIT, |s| s["role"] == "leader");
    let total = 40;
    let mut jobs = [0, 1].map(|n| {
        let mut c = replica_command(dir.path(), &first, n, total);
        c.env("TORCHFT_QUORUM_RETRIES", "120");
        Job::spawn(c, dir.path(), &format!("replica{n}"))
    });
    let t0 = Instant::now();
    while [0, 1].iter().any(|&n| steps_of(dir.path(), n) < 5) {
        assert!(t0.elapsed() < RUN_LIMIT, "no step 5:\n{}", first.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(first.child.id() as i32, libc::SIGKILL) };
    let _ = first.child.wait();
    let before = issued_ids(&first.log());
    let second = Lighthouse::start_with(&args);
    for (n, job) in jobs.iter_mut().enumerate() {
        let status = job.wait(RUN_LIMIT);
        assert!(
            status.success(),
            "replica {n}: {status}\n{}\nlighthouse:\n{}",
            job.output(),
            second.log()
        );
    }
    for n in [0, 1] {
        let c = commits(dir.path(), n);
        assert_eq!(
            steps(&c),
            (1..=u64::from(total)).collect::<Vec<_>>(),
            "replica {n}"
        );
    }
    until_log(&second, "this lighthouse leads now");
    let log = second.log();
    let after = issued_ids(&log);
    assert_eq!(
        after.first(),
        before.last(),
        "the saved quorum re-issued under its id\nfirst:\n{}\nsecond:\n{log}",
        first.log()
    );
}
