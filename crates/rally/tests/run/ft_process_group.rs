//! `rallypoint.ft.ProcessGroupRally` (issue 47 §1) under real torch and
//! torchft 0.2.0, processes started by hand on loopback:
//!
//! - torchft's own loop (`tests/py/ft/pg_torchft.py`: its `Manager`,
//!   `DistributedDataParallel`, `Optimizer` and `PGTransport`, unchanged)
//!   with torchft's own lighthouse: a healthy run commits the same steps on
//!   both replicas with bitwise-equal parameters; a replica SIGKILLed inside
//!   the gradient all_reduce leaves the survivor running, that step not
//!   committed, and the survivor committing again alone; the same kill
//!   under torchft's `ProcessGroupGloo` crashes the survivor in torchft's
//!   DDP comm hook (the contrast the adapter exists for);
//! - the group on its own (`tests/py/ft/pg_ops.py`): errors and abort,
//!   bad configure input, membership changes (timed), the lighthouse watch
//!   (a fake `/v1/watch`: drops on command), torchft's `register` path;
//! - with `rally lighthouse` in torchft's loop: a killed replica dropped at
//!   once, and one stopped inside the all_reduce aborted by the push;
//! - the `rally` backend's torch reconfigure API (`tests/py/ft/pg_reconfigure.py`).
//!
//! Each scenario counts its checks per section in its JSON; the counts are
//! asserted here, so a section that stops checking fails.

use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::torch_backend::{children_logs as log_of, env_rank, package};
use super::{free_port, python, script, wait_or_kill};

const LIMIT: Duration = Duration::from_secs(120);

fn read_json(p: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()
}

/// `ft/pg_ops.py` at `n` ranks; each rank's JSON, by rank, after every rank
/// ended normally (but rank `dies`, which must have died by SIGKILL: its
/// JSON is `null`).
fn ops(scenario: &str, n: usize, env: &[(&str, &str)], dies: Option<usize>) -> Vec<Value> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("results");
    std::fs::create_dir(&out).unwrap();
    let site = package(dir.path());
    let port = free_port().to_string();
    let mut vars: Vec<(&str, &std::ffi::OsStr)> = vec![
        ("RESULT_DIR", out.as_os_str()),
        ("SCENARIO", scenario.as_ref()),
    ];
    vars.extend(env.iter().map(|(k, v)| (*k, v.as_ref())));
    let mut kids: Vec<(Child, PathBuf)> = (0..n)
        .map(|r| env_rank("ft/pg_ops.py", dir.path(), &site, &port, (r, n), &vars))
        .collect();
    let logs: Vec<PathBuf> = kids.iter().map(|(_, p)| p.clone()).collect();
    let statuses: Vec<ExitStatus> = kids
        .iter_mut()
        .map(|(c, _)| wait_or_kill(c, LIMIT, || log_of(&logs)))
        .collect();
    (0..n)
        .map(|r| {
            if dies == Some(r) {
                assert!(
                    killed_by_sigkill(statuses[r]),
                    "rank {r} did not die: {:?}\n{}",
                    statuses[r],
                    log_of(&logs)
                );
                return Value::Null;
            }
            let v = read_json(&out.join(format!("{r}.json")));
            assert!(
                statuses[r].success() && v.is_some(),
                "rank {r}: {:?}\n{}",
                statuses[r],
                log_of(&logs)
            );
            v.unwrap()
        })
        .collect()
}

fn checks(v: &Value, section: &str) -> u64 {
    v["checks"][section].as_u64().unwrap_or(0)
}

#[test]
fn a_failed_op_is_reported_by_errored_abort_reaches_every_member_and_configure_clears_it() {
    let res = ops("errors", 2, &[], Some(1));
    // Rank 0 ends after rank 1's death; rank 1 is SIGKILLed (no JSON).
    assert_eq!(checks(&res[0], "errors"), 8, "{res:?}");
    assert_eq!(checks(&res[0], "import"), 1, "{res:?}");
    let died = res[0]["death_error"].as_str().unwrap();
    assert!(died.contains("rank 1 is gone"), "{died}");
    eprintln!(
        "abort to op done: {:.1} ms; death to op done: {:.1} ms",
        res[0]["abort_to_done_ms"].as_f64().unwrap(),
        res[0]["death_to_done_ms"].as_f64().unwrap()
    );
}

#[test]
fn bad_configure_input_is_refused_and_runtime_failures_are_recorded_not_raised() {
    let res = ops("bad_input", 2, &[], None);
    for (r, v) in res.iter().enumerate() {
        assert_eq!(checks(v, "bad_input"), 23, "rank {r}: {v}");
        for (what, e) in v["errors"].as_object().unwrap() {
            eprintln!("rank {r}, {what}: {e}");
        }
    }
}

#[test]
fn membership_changes_three_to_two_and_back_are_timed() {
    let res = ops("membership", 3, &[("ROUNDS", "10")], None);
    for (r, v) in res.iter().enumerate() {
        let want = if r < 2 { 20 } else { 10 };
        assert_eq!(checks(v, "membership"), want, "rank {r}: {v}");
    }
    eprintln!(
        "rank 0 medians over 10 rounds: configure {} ms; configure + first all_reduce {} ms",
        res[0]["configure_ms"], res[0]["configure_and_first_all_reduce_ms"]
    );
}

/// Over TCP (each rank its own host id): from the second round on, every
/// generation runs over the transport of the first, with no new connection
/// (`ProcessGroup::next_generation`).
#[test]
fn membership_changes_keep_the_survivors_connections() {
    let res = ops("membership", 3, &[("ROUNDS", "4"), ("APART", "1")], None);
    for (r, v) in res.iter().enumerate() {
        let want = if r < 2 { 8 + 2 } else { 4 + 2 };
        assert_eq!(checks(v, "membership"), want, "rank {r}: {v}");
    }
    eprintln!(
        "rank 0 over TCP, medians over 4 rounds: configure {} ms; configure + first all_reduce {} ms; (address, connections) per round {}",
        res[0]["configure_ms"], res[0]["configure_and_first_all_reduce_ms"], res[0]["transport_per_round"]
    );
}

#[test]
fn torchfts_register_path_runs_dist_functional_collectives_and_device_mesh_over_it() {
    for (r, v) in ops("register", 2, &[], None).iter().enumerate() {
        assert_eq!(checks(v, "register"), 3, "rank {r}: {v}");
    }
}

#[test]
fn the_lighthouse_watch_aborts_its_generation_only() {
    let res = ops("watch", 2, &[], None);
    assert_eq!(checks(&res[0], "watch"), 9, "{res:?}");
    assert_eq!(checks(&res[1], "watch"), 9, "{res:?}");
}

/// torchft's lighthouse (and the test's coordination store) in a process of
/// its own; it ends normally when its stdin closes.
struct Lighthouse {
    child: Child,
    stdin: Option<ChildStdin>,
    address: String,
    coord_port: u64,
}

impl Lighthouse {
    /// torchft's lighthouse (`own`) and the coordination store, or the
    /// coordination store alone (`address` empty).
    fn start(dir: &Path, site: &Path, out: &Path, min_replicas: u32, own: bool) -> Lighthouse {
        let log = std::fs::File::create(dir.join("lighthouse.log")).unwrap();
        let mut child = Command::new(python())
            .arg(script("ft/pg_lighthouse.py"))
            .env("PYTHONPATH", site)
            .env("RESULT_DIR", out)
            .env("OWN", if own { "1" } else { "0" })
            .env("MIN_REPLICAS", min_replicas.to_string())
            .env("JOIN_TIMEOUT_MS", "1000")
            .env("HEARTBEAT_TIMEOUT_MS", "500")
            .stdin(Stdio::piped())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let path = out.join("lighthouse.json");
        let t0 = Instant::now();
        let v = loop {
            if let Some(v) = read_json(&path) {
                break v;
            }
            if let Some(s) = child.try_wait().unwrap() {
                panic!(
                    "the lighthouse ended ({s}):\n{}",
                    std::fs::read_to_string(dir.join("lighthouse.log")).unwrap_or_default()
                );
            }
            assert!(t0.elapsed() < LIMIT, "the lighthouse never wrote {path:?}");
            std::thread::sleep(Duration::from_millis(20));
        };
        Lighthouse {
            child,
            stdin,
            address: v["address"].as_str().unwrap().to_owned(),
            coord_port: v["coord_port"].as_u64().unwrap(),
        }
    }

    fn stop(mut self) {
        drop(self.stdin.take());
        let s = wait_or_kill(&mut self.child, LIMIT, String::new);
        assert!(s.success(), "the lighthouse ended {s}");
    }
}

/// One replica's outcome: its exit, its JSON (if it wrote one), its log.
struct Replica {
    status: ExitStatus,
    result: Option<Value>,
    log: String,
    /// `rally lighthouse`'s log, when the run had one (the same on both).
    lighthouse_log: String,
}

/// `rally lighthouse` on a free loopback port, with torchft's knobs as
/// `pg_lighthouse.py` sets them; killed when dropped.
struct RallyLighthouse {
    child: Child,
    address: String,
    /// Copies its stderr to `log` until it ends.
    copier: Option<std::thread::JoinHandle<()>>,
    log: PathBuf,
}

impl RallyLighthouse {
    fn start(dir: &Path, min_replicas: u32) -> RallyLighthouse {
        use std::io::{BufRead, BufReader};
        let mut child = Command::new(env!("CARGO_BIN_EXE_rally"))
            .args(["lighthouse", "--min_replicas", &min_replicas.to_string()])
            .args(["--bind", "127.0.0.1:0", "--join_timeout_ms", "1000"])
            .args(["--heartbeat_timeout_ms", "500"])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let log = dir.join("rally-lighthouse.log");
        let path = log.clone();
        let copier = std::thread::spawn(move || {
            let mut f = std::fs::File::create(log).unwrap();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("rally lighthouse: listening on ") {
                    let _ = tx.send(addr.to_owned());
                }
                let _ = std::io::Write::write_all(&mut f, format!("{line}\n").as_bytes());
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("rally lighthouse never said where it listens");
        RallyLighthouse {
            child,
            address: format!("http://{addr}"),
            copier: Some(copier),
            log: path,
        }
    }
}

impl RallyLighthouse {
    /// Stops it; its whole log (the copier ends at its stderr's end).
    fn stop(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(c) = self.copier.take() {
            let _ = c.join();
        }
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for RallyLighthouse {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One run of two `pg_torchft.py` replicas.
struct Run {
    /// "rally" or "gloo".
    pg: &'static str,
    /// Replica 1 dies inside the all_reduce of this step (-1: never; -2: on
    /// entering its first configure of a quorum of both).
    kill_at: i32,
    min_replicas: u32,
    /// `rally lighthouse` instead of torchft's.
    rally_lighthouse: bool,
    /// "kill" (SIGKILL) or "stop" (SIGSTOP; the test kills it at the end).
    how: &'static str,
}

impl Run {
    fn healthy() -> Run {
        Run {
            pg: "rally",
            kill_at: -1,
            min_replicas: 2,
            rally_lighthouse: false,
            how: "kill",
        }
    }

    fn kill(pg: &'static str) -> Run {
        Run {
            pg,
            kill_at: 4,
            min_replicas: 1,
            ..Run::healthy()
        }
    }
}

fn torchft_run(run: Run) -> Vec<Replica> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("results");
    std::fs::create_dir(&out).unwrap();
    let site = package(dir.path());
    let lh = Lighthouse::start(
        dir.path(),
        &site,
        &out,
        run.min_replicas,
        !run.rally_lighthouse,
    );
    let ours = run
        .rally_lighthouse
        .then(|| RallyLighthouse::start(dir.path(), run.min_replicas));
    let address = ours
        .as_ref()
        .map_or(lh.address.clone(), |l| l.address.clone());
    let coord = lh.coord_port.to_string();
    let kill = run.kill_at.to_string();
    let mut kids: Vec<(Child, PathBuf)> = (0..2)
        .map(|r| {
            let victim = if r == 1 && run.kill_at != -1 {
                "1"
            } else {
                "0"
            };
            let env: Vec<(&str, &std::ffi::OsStr)> = vec![
                ("RESULT_DIR", out.as_os_str()),
                ("REPLICA", if r == 0 { "0" } else { "1" }.as_ref()),
                ("PG", run.pg.as_ref()),
                ("KILL_AT", kill.as_ref()),
                ("VICTIM", victim.as_ref()),
                ("HOW", run.how.as_ref()),
                ("STEPS", "8".as_ref()),
                ("TORCHFT_LIGHTHOUSE", address.as_ref()),
                ("COORD_PORT", coord.as_ref()),
            ];
            let port = free_port().to_string();
            env_rank("ft/pg_torchft.py", dir.path(), &site, &port, (r, 2), &env)
        })
        .collect();
    let logs: Vec<PathBuf> = kids.iter().map(|(_, p)| p.clone()).collect();
    let mut statuses = Vec::new();
    for (r, (c, _)) in kids.iter_mut().enumerate() {
        if r == 1 && run.how == "stop" {
            // Stopped inside its all_reduce for good: the fault's end.
            let _ = c.kill();
        }
        statuses.push(wait_or_kill(c, LIMIT, || log_of(&logs)));
    }
    lh.stop();
    let lighthouse_log = ours.map(RallyLighthouse::stop).unwrap_or_default();
    statuses
        .into_iter()
        .enumerate()
        .map(|(r, status)| Replica {
            status,
            result: read_json(&out.join(format!("{r}.json"))),
            log: std::fs::read_to_string(&logs[r]).unwrap_or_default(),
            lighthouse_log: lighthouse_log.clone(),
        })
        .collect()
}

fn committed(v: &Value) -> Vec<i64> {
    v["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["committed"].as_bool().unwrap())
        .map(|s| s["step"].as_i64().unwrap())
        .collect()
}

fn killed_by_sigkill(s: ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    s.signal() == Some(libc::SIGKILL)
}

#[test]
fn torchft_loop_over_rally_commits_the_same_steps_on_both_replicas() {
    let rs = torchft_run(Run::healthy());
    let all = |r: &Replica| format!("{:?}\n{}", r.status, r.log);
    for r in &rs {
        assert!(r.status.success() && r.result.is_some(), "{}", all(r));
    }
    let (a, b) = (
        rs[0].result.as_ref().unwrap(),
        rs[1].result.as_ref().unwrap(),
    );
    assert_eq!(committed(a), (0..8).collect::<Vec<_>>(), "{a}");
    assert_eq!(committed(a), committed(b), "{a}\n{b}");
    assert_eq!(a["params"], b["params"], "parameters differ");
}

/// The survivor of `run` (replica 0) ran on, did not commit the step its
/// peer failed in (that step's error names one of `causes`) and committed again
/// alone; the victim died as `run.how` says. Returns the time from the
/// fault to the survivor's next commit, in ms.
fn survivor_commits_again(run: Run, causes: &[&str]) -> (f64, String) {
    let how = run.how;
    let rs = torchft_run(run);
    let (survivor, victim) = (&rs[0], &rs[1]);
    assert!(
        killed_by_sigkill(victim.status),
        "the victim did not end by SIGKILL ({how}): {:?}\n{}",
        victim.status,
        victim.log
    );
    assert!(
        survivor.status.success(),
        "the survivor crashed: {:?}\n{}",
        survivor.status,
        survivor.log
    );
    let v = survivor.result.as_ref().unwrap();
    let k = v["killed_step"].as_i64().expect("no fault recorded");
    let steps = v["steps"].as_array().unwrap();
    let first = steps.iter().find(|s| s["step"] == k).unwrap();
    assert_eq!(
        first["committed"], false,
        "the failed step was committed: {v}"
    );
    let err = first["error"].as_str().unwrap_or("");
    assert!(
        causes.iter().any(|c| err.contains(c)),
        "the failed step's error names none of {causes:?}: {err:?}"
    );
    let after: Vec<i64> = committed(v).into_iter().filter(|&s| s >= k).collect();
    assert!(after.len() >= 3, "the survivor did not commit again: {v}");
    (
        v["kill_to_commit_ms"].as_f64().unwrap(),
        survivor.lighthouse_log.clone(),
    )
}

#[test]
fn a_replica_killed_inside_all_reduce_leaves_the_survivor_committing() {
    let (ms, _) = survivor_commits_again(Run::kill("rally"), &["rank 1 is gone"]);
    eprintln!("SIGKILL inside all_reduce, torchft's lighthouse (heartbeat timeout 500 ms): next commit {ms:.0} ms after the kill");
}

#[test]
fn a_member_that_never_joins_a_configure_leaves_the_loop_running() {
    // Replica 1 dies on entering configure: the survivor's configure waits
    // its timeout (5 s) for it, or cannot reach its store. Raising would
    // crash torchft's DDP hook; recorded, the step is not committed and the
    // next quorum (without it) proceeds.
    let run = Run {
        kill_at: -2,
        ..Run::kill("rally")
    };
    let (ms, _) = survivor_commits_again(
        run,
        &["never published their entry", "could not reach the store"],
    );
    eprintln!("SIGKILL on entering configure: next commit {ms:.0} ms after the kill");
}

#[test]
fn with_rally_lighthouse_a_killed_replica_is_dropped_at_once() {
    let run = Run {
        rally_lighthouse: true,
        ..Run::kill("rally")
    };
    // Whichever comes first fails the op: its pid's end, or the
    // lighthouse's push. The lighthouse must have dropped it for its closed
    // session (at once), not for its silence (the heartbeat timeout).
    let (ms, log) = survivor_commits_again(run, &["rank 1 is gone", "the lighthouse at"]);
    let drop = log
        .lines()
        .find(|l| l.contains("replica dropped") && l.contains("pg_torchft_1"))
        .unwrap_or_else(|| panic!("the lighthouse never dropped replica 1:\n{log}"));
    assert!(
        drop.contains("session") && drop.contains("closed"),
        "replica 1 was not dropped for its closed session: {drop}"
    );
    eprintln!("SIGKILL inside all_reduce, rally lighthouse: next commit {ms:.0} ms after the kill");
}

#[test]
fn with_rally_lighthouse_a_replica_stopped_inside_all_reduce_is_aborted_by_push() {
    // Its process lives on and its connections stay open: only the
    // lighthouse (500 ms of silence) can tell; its push aborts the
    // survivor's all_reduce, which would otherwise wait for the group's 5 s.
    let run = Run {
        rally_lighthouse: true,
        how: "stop",
        ..Run::kill("rally")
    };
    let (ms, _) = survivor_commits_again(run, &["the lighthouse at"]);
    // The push comes at the keep-alive (500 ms); 2 s of margin on a loaded
    // machine, well under the group's 5 s that the op would wait without it.
    assert!(
        ms < 2500.0,
        "the stop was not pushed: the next commit came {ms:.0} ms after it"
    );
    eprintln!("SIGSTOP inside all_reduce, rally lighthouse: next commit {ms:.0} ms after the stop");
}

#[test]
fn the_same_kill_under_torchfts_gloo_group_crashes_the_survivor_in_its_ddp_hook() {
    let rs = torchft_run(Run::kill("gloo"));
    let (survivor, victim) = (&rs[0], &rs[1]);
    assert!(
        killed_by_sigkill(victim.status),
        "{:?}\n{}",
        victim.status,
        victim.log
    );
    assert!(
        !survivor.status.success() && survivor.log.contains("assert fut._fut"),
        "torchft's gloo survivor did not crash in its comm hook: {:?}\n{}",
        survivor.status,
        survivor.log
    );
}

#[test]
fn the_rally_backend_reconfigures_through_torchs_api_from_two_to_three_members_and_back() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("results");
    std::fs::create_dir(&out).unwrap();
    let site = package(dir.path());
    let port = free_port().to_string();
    let env: Vec<(&str, &std::ffi::OsStr)> = vec![("RESULT_DIR", out.as_os_str())];
    let mut kids: Vec<(Child, PathBuf)> = (0..3)
        .map(|r| {
            env_rank(
                "ft/pg_reconfigure.py",
                dir.path(),
                &site,
                &port,
                (r, 3),
                &env,
            )
        })
        .collect();
    let logs: Vec<PathBuf> = kids.iter().map(|(_, p)| p.clone()).collect();
    for (r, (c, _)) in kids.iter_mut().enumerate() {
        let s = wait_or_kill(c, LIMIT, || log_of(&logs));
        assert!(s.success(), "rank {r}: {s}\n{}", log_of(&logs));
    }
    for r in 0..3 {
        let v = read_json(&out.join(format!("{r}.json"))).unwrap();
        for (section, want) in [
            ("api", 3),
            ("two", 3),
            ("three", 3),
            ("bad", 4),
            ("reversed", 2),
        ] {
            let want = if r == 2 && section == "two" { 0 } else { want };
            assert_eq!(checks(&v, section), want, "rank {r} {section}: {v}");
        }
        if r < 2 {
            // torch still answers with the size the group was made with.
            assert_eq!(v["torch_rank_after"][1], 3, "{v}");
        }
    }
}
