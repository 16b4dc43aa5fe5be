//! `rally run --ft` across test hosts (issue 48 §3): three replica groups,
//! one `rally run --ft --standalone` per host, each running
//! `rallypoint.ft`'s own loop (`crates/bench/py/ft_worker.py`,
//! `FT_SIDE=ft`: `Manager`, `DistributedDataParallel`, `Optimizer`, no
//! torchft) on a small MLP, with `rally lighthouse` on the first host.
//!
//! Every test checks, besides its own bound (the harness is
//! [`super::ft_hosts::FtJob`]):
//! - no survivor restarted: each surviving group's records carry one
//!   worker pid, and its agent never restarted the group;
//! - every step committed by several groups has one digest (parameters and
//!   optimizer state, SHA-256), so a healed group's state equals its peers'
//!   bitwise;
//! - every survivor ends normally.
//!
//! Bounds are a deadline plus `ft_hosts::MARGIN` (5 s), never a speed: the groups' own
//! timeout is 30 s, far above them, so meeting one proves the path meant
//! (the manager telling the lighthouse, the lighthouse's keep-alive and its
//! push), not a timeout.

use std::time::Duration;

use serde_json::Value;

use super::ft_hosts::{lighthouse_on, unix_ms, FtJob, Launch, AT};
use super::LIMIT;

/// The survivors' median time between commits before `step`: "one step".
fn step_time(j: &FtJob, ks: &[usize], step: u64) -> Duration {
    let mut gaps: Vec<f64> = Vec::new();
    for &k in ks {
        let t: Vec<f64> = j.replicas[k]
            .records()
            .iter()
            .filter(|r| r["committed"] == true && r["step"].as_u64().is_some_and(|s| s < step))
            .filter_map(|r| r["t"].as_f64())
            .collect();
        gaps.extend(t.windows(2).map(|w| w[1] - w[0]));
    }
    assert!(!gaps.is_empty(), "no steps before {step}\n{}", j.logs());
    gaps.sort_by(f64::total_cmp);
    Duration::from_secs_f64(gaps[gaps.len() / 2])
}

/// The `--events` lines of group `k`'s `rally run`.
fn events(j: &FtJob, k: usize) -> Vec<Value> {
    std::fs::read_to_string(j.dir.path().join(format!("events{k}.jsonl")))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Group `i` under `rally run --ft`, its events in `events<k>.jsonl`.
fn group(j: &mut FtJob, i: usize, env: &[(&str, &str)]) -> usize {
    let k = j.replicas.len();
    let ev = j.dir.path().join(format!("events{k}.jsonl"));
    let ev = ev.to_str().unwrap().to_owned();
    j.replica_with(i, env, &["--events", &ev])
}

/// No `rally run` of `ks` restarted its group.
fn never_restarted(j: &FtJob, ks: &[usize]) {
    for &k in ks {
        let restarts: Vec<Value> = events(j, k)
            .into_iter()
            .filter(|e| e["event"] == "group.restarting")
            .collect();
        assert!(
            restarts.is_empty(),
            "group {k} restarted: {restarts:?}\n{}",
            j.logs()
        );
    }
}

/// A worker SIGKILLed inside its gradient all_reduce: its agent's manager
/// tells the lighthouse at once (its keep-alive is 20 s here), the
/// survivors' step in flight is aborted by the push, and they commit again
/// within one step + 250 ms. Only the victim's group restarts: its new
/// worker rejoins through the quorum, heals from a survivor to bitwise-equal
/// state, and takes part again.
#[test]
fn a_killed_worker_restarts_only_its_group_which_heals_and_rejoins() {
    let mut j = FtJob::start_with(3, 20_000, Launch::RallyRunFt);
    let at = AT.to_string();
    group(&mut j, 0, &[]);
    group(&mut j, 1, &[]);
    let victim = group(
        &mut j,
        2,
        &[("FT_FAULT", "kill-allreduce"), ("FT_FAULT_STEP", &at)],
    );
    j.wait_for("the victim's fault", LIMIT, |j| {
        j.replicas[victim]
            .first(|r| r["event"] == "fault")
            .is_some()
    });
    let t0 = j.fault_time(victim);
    let step = step_time(&j, &[0, 1], AT);
    j.survivors_commit_past(&[0, 1], AT + 1, t0, step + Duration::from_millis(250));
    j.wait_for("the restarted worker's commits", LIMIT, |j| {
        let r = j.replicas[victim].records();
        let Some(back) = r
            .iter()
            .position(|r| r["event"] == "ready" && r["restart"] == 1)
        else {
            return false;
        };
        r[back..].iter().filter(|r| r["committed"] == true).count() >= 3
    });
    j.finish(&[0, 1]);
    let _ = j.replicas[victim].job.wait(LIMIT);
    never_restarted(&j, &[0, 1]);
    let healed = events(&j, victim)
        .into_iter()
        .any(|e| e["event"] == "ft.heal" && e["bytes"].as_u64() > Some(0));
    assert!(healed, "group 2 reported no heal\n{}", j.logs());
    // A survivor that shared a quorum with group 2 saw it go (one that
    // joined late, after the kill, never had it to lose).
    let dropped = [0, 1].iter().any(|&k| {
        events(&j, k)
            .into_iter()
            .any(|e| e["event"] == "ft.dropped" && e["replica_group"] == "2")
    });
    assert!(dropped, "no survivor saw group 2 dropped\n{}", j.logs());
}

/// A worker SIGSTOPped inside its all_reduce: the manager (in the agent)
/// heartbeats on, but the worker's beats stop, so after the worker
/// keep-alive (1 s) the manager closes its connection and takes the group
/// out; the lighthouse's push frees the survivors, who commit again within
/// the keep-alive + 250 ms. Resumed, the worker reconnects, heals and takes
/// part again, and no group restarted.
#[test]
fn a_stopped_worker_takes_its_group_out_within_the_keep_alive_and_rejoins() {
    let mut j = FtJob::start_with(3, 1000, Launch::RallyRunFt);
    let at = AT.to_string();
    group(&mut j, 0, &[]);
    group(&mut j, 1, &[]);
    let victim = group(
        &mut j,
        2,
        &[("FT_FAULT", "stop-allreduce"), ("FT_FAULT_STEP", &at)],
    );
    j.wait_for("the victim's fault", LIMIT, |j| {
        j.replicas[victim]
            .first(|r| r["event"] == "fault")
            .is_some()
    });
    let t0 = j.fault_time(victim);
    j.survivors_commit_past(&[0, 1], AT + 1, t0, Duration::from_millis(1250));
    let pid = j.replicas[victim]
        .records()
        .iter()
        .find(|r| r["event"] == "fault")
        .and_then(|r| r["pid"].as_i64())
        .unwrap();
    // SAFETY: a signal to the stopped worker (it is ours: its pid is in its records).
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    let before = j.replicas[victim].committed().len();
    j.wait_for("the resumed worker's commits", LIMIT, |j| {
        j.replicas[victim].committed().len() >= before + 3
    });
    j.finish(&[0, 1, victim]);
    never_restarted(&j, &[0, 1, victim]);
}

/// A group's rank 0 SIGKILLed between steps, in groups of two processes:
/// the group's manager and its job store live in the agent, so the
/// restarted ranks reconnect to the same manager (its address is in their
/// environment, unchanged) and heal; only that group restarts, and every
/// rank of every group keeps one state per step.
#[test]
fn a_killed_rank_0_takes_neither_the_manager_nor_the_store_away() {
    let mut j = FtJob::start_with(3, 20_000, Launch::RallyRunFt).with_nproc(2);
    let at = AT.to_string();
    group(&mut j, 0, &[]);
    group(&mut j, 1, &[]);
    let victim = group(
        &mut j,
        2,
        &[
            ("FT_FAULT", "kill-between"),
            ("FT_FAULT_STEP", &at),
            ("FT_FAULT_RANK", "0"),
        ],
    );
    j.wait_for("the victim's fault", LIMIT, |j| {
        j.replicas[victim]
            .first(|r| r["event"] == "fault")
            .is_some()
    });
    let t0 = j.fault_time(victim);
    let step = step_time(&j, &[0, 1], AT);
    j.survivors_commit_past(&[0, 1], AT + 1, t0, step + Duration::from_millis(250));
    j.wait_for("both restarted ranks' commits", LIMIT, |j| {
        (0..2).all(|rank| {
            let r = j.replicas[victim].rank(rank);
            let Some(back) = r
                .iter()
                .position(|r| r["event"] == "ready" && r["restart"] == 1)
            else {
                return false;
            };
            r[back..].iter().filter(|r| r["committed"] == true).count() >= 3
        })
    });
    j.finish(&[0, 1]);
    let _ = j.replicas[victim].job.wait(LIMIT);
    never_restarted(&j, &[0, 1]);
    let out = j.replicas[victim].job.output();
    assert_eq!(out.matches("manager at").count(), 1, "{out}");
    // Rank 1 of every group: one pid on the survivors, one state per step
    // across all groups.
    let mut by_step: std::collections::BTreeMap<u64, Vec<String>> = Default::default();
    for (k, r) in j.replicas.iter().enumerate() {
        let recs = r.rank(1);
        let pids: std::collections::BTreeSet<u64> =
            recs.iter().filter_map(|x| x["pid"].as_u64()).collect();
        if k != victim {
            assert_eq!(pids.len(), 1, "group {k} rank 1 restarted: {pids:?}");
        }
        for x in recs.iter().filter(|x| x["committed"] == true) {
            by_step
                .entry(x["step"].as_u64().unwrap())
                .or_default()
                .push(x["digest"].as_str().unwrap_or("").to_owned());
        }
    }
    for (s, ds) in &by_step {
        assert!(
            ds.windows(2).all(|w| w[0] == w[1]),
            "rank 1's step {s}: {ds:?}"
        );
    }
}

/// A host powered off (cut, everything on it killed; no reset reaches
/// anyone): dropped at the lighthouse's keep-alive (1 s), the survivors'
/// step aborted by its push.
#[test]
fn a_host_powered_off_is_dropped_at_the_keep_alive() {
    let mut j = FtJob::start_with(3, 1000, Launch::RallyRunFt);
    for i in 0..3 {
        group(&mut j, i, &[]);
    }
    j.wait_for("step 10 everywhere", LIMIT, |j| {
        j.replicas.iter().all(|r| r.committed().contains_key(&10))
    });
    let t0 = unix_ms() as f64 / 1000.0;
    j.c.hosts_mut()[2].power_off();
    let step = j.replicas[0].committed().keys().max().copied().unwrap() + 1;
    j.survivors_commit_past(&[0, 1], step, t0, Duration::from_millis(1250));
    j.finish(&[0, 1]);
    never_restarted(&j, &[0, 1]);
}

/// A host cut off for good: the same bound; its group is left to itself.
#[test]
fn a_host_cut_off_for_good_is_dropped_at_the_keep_alive() {
    let mut j = FtJob::start_with(3, 1000, Launch::RallyRunFt);
    for i in 0..3 {
        group(&mut j, i, &[]);
    }
    j.wait_for("step 10 everywhere", LIMIT, |j| {
        j.replicas.iter().all(|r| r.committed().contains_key(&10))
    });
    let t0 = unix_ms() as f64 / 1000.0;
    j.c.host(2).cut();
    let step = j.replicas[0].committed().keys().max().copied().unwrap() + 1;
    j.survivors_commit_past(&[0, 1], step, t0, Duration::from_millis(1250));
    j.finish(&[0, 1]);
    never_restarted(&j, &[0, 1]);
    j.c.hosts_mut()[2].power_off();
}

/// A host cut off for less than the keep-alive (20 s here): its group stays
/// in every quorum and misses no step.
#[test]
fn a_host_cut_off_for_less_than_the_keep_alive_misses_no_step() {
    let mut j = FtJob::start_with(3, 20_000, Launch::RallyRunFt);
    for i in 0..3 {
        group(&mut j, i, &[]);
    }
    j.wait_for("step 10 everywhere", LIMIT, |j| {
        j.replicas.iter().all(|r| r.committed().contains_key(&10))
    });
    j.c.host(2).cut();
    std::thread::sleep(Duration::from_millis(1500));
    j.c.host(2).heal();
    let cut_at = j
        .replicas
        .iter()
        .map(|r| r.committed().keys().max().copied().unwrap())
        .max()
        .unwrap();
    let until = cut_at + 5;
    j.wait_for("five steps past the cut everywhere", LIMIT, |j| {
        j.replicas
            .iter()
            .all(|r| r.committed().contains_key(&until))
    });
    j.finish(&[0, 1, 2]);
    never_restarted(&j, &[0, 1, 2]);
    for (k, r) in j.replicas.iter().enumerate() {
        let c = r.committed();
        let missed: Vec<u64> = (10..=until).filter(|s| !c.contains_key(s)).collect();
        assert!(
            missed.is_empty(),
            "group {k} missed steps {missed:?} around the cut\n{}",
            j.logs()
        );
    }
}

/// The lighthouse SIGKILLed and started again on its address: no group
/// restarts (each manager rides it out within its connect timeout), and
/// every group commits again within a second of its return (+ margin).
#[test]
fn the_lighthouse_killed_and_restarted_restarts_no_group() {
    let mut j = FtJob::start_with(3, 1000, Launch::RallyRunFt);
    for i in 0..3 {
        group(&mut j, i, &[]);
    }
    j.wait_for("step 10 everywhere", LIMIT, |j| {
        j.replicas.iter().all(|r| r.committed().contains_key(&10))
    });
    drop(j.lighthouse.take());
    std::thread::sleep(Duration::from_millis(500));
    let dir = j.dir.path().to_owned();
    j.lighthouse = Some(lighthouse_on(j.c.host(0), &dir, 1000));
    let t0 = unix_ms() as f64 / 1000.0;
    let step = j
        .replicas
        .iter()
        .map(|r| r.committed().keys().max().copied().unwrap_or(0))
        .max()
        .unwrap();
    j.survivors_commit_past(&[0, 1, 2], step, t0, Duration::from_secs(1));
    j.finish(&[0, 1, 2]);
    never_restarted(&j, &[0, 1, 2]);
}

/// `rally run --ft` on loopback, `args` then `python -c code`.
fn run_ft_loopback(
    dir: &std::path::Path,
    name: &str,
    args: &[&str],
    env: &[(&str, &std::ffi::OsStr)],
) -> super::Job {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rally"));
    cmd.args(["run", "--ft", "--standalone", "--nproc-per-node", "1"])
        .args(args)
        .arg(super::python())
        .arg(super::ft_hosts::worker())
        .env("FT_SIDE", "ft")
        .env("FT_MODEL", "small");
    for (k, v) in env {
        cmd.env(k, v);
    }
    super::Job::spawn(cmd, dir, name)
}

/// A lighthouse that is not there: the run fails before any worker starts,
/// once `--ft-connect-timeout` has passed, naming the address.
#[test]
fn an_unreachable_lighthouse_fails_the_run_after_the_connect_timeout_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", super::free_port());
    let t0 = std::time::Instant::now();
    let mut j = run_ft_loopback(
        dir.path(),
        "unreachable",
        &[
            "--ft-replica-group",
            "0",
            "--ft-lighthouse",
            &addr,
            "--ft-connect-timeout",
            "1.5",
        ],
        &[],
    );
    let s = j.wait(LIMIT);
    let took = t0.elapsed();
    let out = j.output();
    assert!(!s.success(), "{out}");
    assert!(
        out.contains(&format!(
            "cannot reach the lighthouse at {addr} within 1.5 s"
        )),
        "{out}"
    );
    assert!(!out.contains("round 0 formed"), "a worker started: {out}");
    assert!(
        took >= Duration::from_millis(1400),
        "gave up after {took:?}: {out}"
    );
    assert!(
        took < Duration::from_secs(1) + Duration::from_secs(15),
        "{took:?}: {out}"
    );
}

/// A replica group id used by a live group: a second `rally run --ft` with
/// it fails at once, naming the id; the first trains on, unharmed.
#[test]
fn a_group_id_held_by_a_live_group_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let site = super::torch_backend::package(dir.path());
    let mut lh = std::process::Command::new(env!("CARGO_BIN_EXE_rally"));
    let port = super::free_port();
    lh.args(["lighthouse", "--min_replicas", "1", "--bind"])
        .arg(format!("127.0.0.1:{port}"));
    let lh = super::Job::spawn(lh, dir.path(), "lighthouse");
    let t0 = std::time::Instant::now();
    while !lh.output().contains("listening on") {
        assert!(t0.elapsed() < LIMIT, "{}", lh.output());
        std::thread::sleep(Duration::from_millis(20));
    }
    let addr = format!("127.0.0.1:{port}");
    let out = dir.path().join("first.jsonl");
    let stop = dir.path().join("stop");
    let env: Vec<(&str, &std::ffi::OsStr)> = vec![
        ("PYTHONPATH", site.as_os_str()),
        ("FT_OUT", out.as_os_str()),
        ("FT_STOP_FILE", stop.as_os_str()),
    ];
    let status_port = super::free_port();
    let sp = status_port.to_string();
    let mut first = run_ft_loopback(
        dir.path(),
        "first",
        &[
            "--ft-replica-group",
            "7",
            "--ft-lighthouse",
            &addr,
            "--status-port",
            &sp,
        ],
        &env,
    );
    let commits = || {
        std::fs::read_to_string(&out)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"committed\": true"))
            .count()
    };
    let t0 = std::time::Instant::now();
    while commits() < 3 {
        assert!(t0.elapsed() < LIMIT, "{}", first.output());
        std::thread::sleep(Duration::from_millis(20));
    }
    let other = dir.path().join("second.jsonl");
    let t1 = std::time::Instant::now();
    let mut second = run_ft_loopback(
        dir.path(),
        "second",
        &["--ft-replica-group", "7", "--ft-lighthouse", &addr],
        &[
            ("PYTHONPATH", site.as_os_str()),
            ("FT_OUT", other.as_os_str()),
        ],
    );
    let s = second.wait(LIMIT);
    let took = t1.elapsed();
    let text = second.output();
    assert!(!s.success(), "{text}");
    assert!(
        text.contains("replica group \"7\" is live at the lighthouse"),
        "{text}"
    );
    assert!(!text.contains("round 0 formed"), "a worker started: {text}");
    // The grace for a dead holder's keep-alive (2.5 s), then at once.
    assert!(
        took < Duration::from_millis(2500) + Duration::from_secs(10),
        "{took:?}"
    );
    let before = commits();
    let t2 = std::time::Instant::now();
    while commits() < before + 3 {
        assert!(t2.elapsed() < LIMIT, "{}", first.output());
        std::thread::sleep(Duration::from_millis(20));
    }
    // The group's quorum in the agent's /status and /metrics.
    let body = |path| {
        let r = super::http_get(status_port, path).unwrap();
        r.split_once("\r\n\r\n").unwrap().1.to_owned()
    };
    let status: Value = serde_json::from_str(&body("/status")).unwrap();
    let ft = &status["ft"];
    assert_eq!(ft["replica_group"], "7", "{status}");
    assert_eq!(ft["members"], serde_json::json!(["7"]), "{status}");
    assert!(ft["quorum_id"].as_i64().is_some(), "{status}");
    assert!(ft["commits"].as_u64() >= Some(3), "{status}");
    assert_eq!(ft["connected"], true, "{status}");
    let metrics = body("/metrics");
    assert!(
        metrics.contains("rally_ft_commits_total{replica_group=\"7\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("rally_ft_quorum_members{replica_group=\"7\"} 1"),
        "{metrics}"
    );
    std::fs::write(&stop, b"").unwrap();
    let s = first.wait(LIMIT);
    let out = first.output();
    assert!(s.success(), "{out}");
    assert!(
        out.contains("rally run: replica group \"7\" (lighthouse 127.0.0.1:"),
        "{out}"
    );
}

/// `--ft`'s flags are checked before anything starts.
#[test]
fn ft_flags_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    for (args, says) in [
        (
            vec!["--ft-lighthouse", "h:1"],
            "--ft needs --ft-replica-group",
        ),
        (
            vec!["--ft-replica-group", "0"],
            "--ft needs --ft-lighthouse",
        ),
        (
            vec!["--ft-replica-group", "a b", "--ft-lighthouse", "h:1"],
            "expected 1 to 128 printable",
        ),
        (
            vec!["--ft-replica-group", "0", "--ft-lighthouse", "h"],
            "expected HOST:PORT",
        ),
        (
            vec![
                "--ft-replica-group",
                "0",
                "--ft-lighthouse",
                "h:1",
                "--ft-serve-lighthouse",
            ],
            "give one",
        ),
        (
            vec![
                "--ft-replica-group",
                "0",
                "--ft-lighthouse",
                "h:1",
                "--ft-connect-timeout",
                "0",
            ],
            "--ft-connect-timeout 0",
        ),
    ] {
        let mut j = run_ft_loopback(dir.path(), "flags", &args, &[]);
        let s = j.wait(LIMIT);
        let out = j.output();
        assert_eq!(s.code(), Some(2), "{args:?}: {out}");
        assert!(out.contains(says), "{args:?}: expected {says:?} in {out}");
    }
}

/// One command per host: group 0's `rally run` serves the lighthouse
/// (`--ft-serve-lighthouse=BIND`), group 1 uses it; both train together
/// (quorums of both groups) and end normally.
#[test]
fn a_group_serves_the_lighthouse_for_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let site = super::torch_backend::package(dir.path());
    let port = super::free_port();
    let addr = format!("127.0.0.1:{port}");
    let stop = dir.path().join("stop");
    let outs: Vec<_> = (0..2)
        .map(|i| dir.path().join(format!("g{i}.jsonl")))
        .collect();
    let env = |i: usize| -> Vec<(&str, &std::ffi::OsStr)> {
        vec![
            ("PYTHONPATH", site.as_os_str()),
            ("FT_OUT", outs[i].as_os_str()),
            ("FT_STOP_FILE", stop.as_os_str()),
            ("FT_MIN_REPLICAS", "2".as_ref()),
        ]
    };
    let serve = format!("--ft-serve-lighthouse={addr}");
    let mut g0 = run_ft_loopback(
        dir.path(),
        "g0",
        &["--ft-replica-group", "0", &serve, "--ft-min-replicas", "2"],
        &env(0),
    );
    let mut g1 = run_ft_loopback(
        dir.path(),
        "g1",
        &["--ft-replica-group", "1", "--ft-lighthouse", &addr],
        &env(1),
    );
    let both = |i: usize| {
        std::fs::read_to_string(&outs[i])
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|r| r["committed"] == true && r["participants"] == 2)
            .count()
    };
    let t0 = std::time::Instant::now();
    while both(0) < 5 || both(1) < 5 {
        assert!(t0.elapsed() < LIMIT, "{}\n{}", g0.output(), g1.output());
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::write(&stop, b"").unwrap();
    // Group 1 first: the lighthouse goes with group 0's run.
    let s1 = g1.wait(LIMIT);
    let s0 = g0.wait(LIMIT);
    assert!(
        s0.success() && s1.success(),
        "{}\n{}",
        g0.output(),
        g1.output()
    );
    assert!(
        g0.output()
            .contains(&format!("serving the lighthouse on {addr}")),
        "{}",
        g0.output()
    );
}

/// Replica groups of two nodes each (`--nnodes 2`, a c10d rendezvous per
/// group, on loopback): the manager of the node that forms each round as
/// group rank 0 serves the group, its address published in the round's job
/// store. A worker killed on group 1's second node restarts group 1 on both
/// its nodes; group 0 trains on without a restart, and group 1 heals and
/// takes part again.
#[test]
fn groups_of_two_nodes_restart_only_the_failed_group() {
    let dir = tempfile::tempdir().unwrap();
    let site = super::torch_backend::package(dir.path());
    let lh_port = super::free_port();
    let mut lh = std::process::Command::new(env!("CARGO_BIN_EXE_rally"));
    lh.args(["lighthouse", "--min_replicas", "1", "--bind"])
        .arg(format!("127.0.0.1:{lh_port}"));
    let lh = super::Job::spawn(lh, dir.path(), "lighthouse");
    let t0 = std::time::Instant::now();
    while !lh.output().contains("listening on") {
        assert!(t0.elapsed() < LIMIT, "{}", lh.output());
        std::thread::sleep(Duration::from_millis(20));
    }
    let lighthouse = format!("127.0.0.1:{lh_port}");
    let stop = dir.path().join("stop");
    let at = AT.to_string();
    let mut nodes = Vec::new();
    for g in 0..2 {
        let endpoint = format!("127.0.0.1:{}", super::free_port());
        for node in 0..2 {
            let out = dir.path().join(format!("g{g}.rank{{rank}}.jsonl"));
            let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rally"));
            cmd.args(["run", "--ft", "--nnodes", "2", "--nproc-per-node", "1"])
                .args(["--rdzv-backend", "c10d", "--rdzv-endpoint", &endpoint])
                .args(["--rdzv-id", &format!("group{g}"), "--max-restarts", "3"])
                .args([
                    "--ft-replica-group",
                    &g.to_string(),
                    "--ft-lighthouse",
                    &lighthouse,
                ])
                .args([
                    "--events",
                    dir.path()
                        .join(format!("ev{g}.{node}.jsonl"))
                        .to_str()
                        .unwrap(),
                ])
                .arg(super::python())
                .arg(super::ft_hosts::worker())
                .env("PYTHONPATH", &site)
                .env("FT_SIDE", "ft")
                .env("FT_MODEL", "small")
                .env("FT_DIGEST", "1")
                .env("FT_OUT", &out)
                .env("FT_STOP_FILE", &stop);
            if g == 1 {
                cmd.env("FT_FAULT", "kill-between")
                    .env("FT_FAULT_STEP", &at)
                    .env("FT_FAULT_RANK", "1");
            }
            nodes.push(super::Job::spawn(cmd, dir.path(), &format!("g{g}n{node}")));
        }
    }
    let records = |g: usize, rank: usize| -> Vec<Value> {
        std::fs::read_to_string(dir.path().join(format!("g{g}.rank{rank}.jsonl")))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    let logs = |nodes: &[super::Job]| {
        nodes
            .iter()
            .map(|n| n.output())
            .collect::<Vec<_>>()
            .join("\n----\n")
    };
    // Group 1 restarted, and both its ranks committed three steps after.
    let t0 = std::time::Instant::now();
    loop {
        let done = (0..2).all(|rank| {
            let r = records(1, rank);
            match r
                .iter()
                .position(|x| x["event"] == "ready" && x["restart"] == 1)
            {
                Some(b) => r[b..].iter().filter(|x| x["committed"] == true).count() >= 3,
                None => false,
            }
        });
        if done {
            break;
        }
        assert!(t0.elapsed() < LIMIT * 2, "{}", logs(&nodes));
        std::thread::sleep(Duration::from_millis(50));
    }
    std::fs::write(&stop, b"").unwrap();
    for n in nodes.iter_mut() {
        let s = n.wait(LIMIT);
        assert!(s.success(), "{}", n.output());
    }
    for rank in 0..2 {
        let pids: std::collections::BTreeSet<u64> = records(0, rank)
            .iter()
            .filter_map(|x| x["pid"].as_u64())
            .collect();
        assert_eq!(pids.len(), 1, "group 0 rank {rank} restarted: {pids:?}");
        // Every step both groups committed has one state per group rank.
        let mut by_step: std::collections::BTreeMap<u64, Vec<String>> = Default::default();
        for g in 0..2 {
            for x in records(g, rank).iter().filter(|x| x["committed"] == true) {
                by_step
                    .entry(x["step"].as_u64().unwrap())
                    .or_default()
                    .push(x["digest"].as_str().unwrap_or("").to_owned());
            }
        }
        for (s, ds) in &by_step {
            assert!(
                ds.windows(2).all(|w| w[0] == w[1]),
                "rank {rank} step {s}: {ds:?}"
            );
        }
        let both = by_step.values().filter(|ds| ds.len() == 2).count();
        assert!(
            both >= 3,
            "rank {rank}: only {both} steps committed by both groups"
        );
    }
    for node in 0..2 {
        let ev = std::fs::read_to_string(dir.path().join(format!("ev0.{node}.jsonl"))).unwrap();
        assert!(
            !ev.contains("group.restarting"),
            "group 0 node {node} restarted: {ev}"
        );
    }
}
