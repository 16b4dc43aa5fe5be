//! `rally run --ft` on loopback (issue 48 §2): its input checked (flags,
//! an unreachable lighthouse, a group id already live), `/status` and
//! `/metrics`, a lighthouse served by one group for the others, and
//! groups of two nodes each. The faults across test hosts are in
//! [`super::ft_run_hosts`].

use std::time::Duration;

use serde_json::Value;

use super::ft_hosts::AT;
use super::LIMIT;

/// `rally run --ft --standalone` on loopback with `args`, running
/// `ft_worker.py`'s `rallypoint.ft` loop.
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
    let (_lh, addr) = super::rally_lighthouse(dir.path(), &["--min_replicas", "1"]);
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

/// Two `rally run --ft` with one replica group id started at the same
/// moment: both pass the check at start (neither is live yet: a worker's
/// hello, seconds away behind torch's import, makes a group live). The
/// lighthouse takes the first join; the other's joins are refused, and
/// once that has lasted the grace (2.5 s) that run stops its workers and
/// fails, naming the id (exit 4). The winner trains on, unharmed.
#[test]
fn two_groups_started_with_one_id_at_once_one_stops_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let site = super::torch_backend::package(dir.path());
    let (_lh, addr) = super::rally_lighthouse(dir.path(), &["--min_replicas", "1"]);
    let stop = dir.path().join("stop");
    let outs = [dir.path().join("a.jsonl"), dir.path().join("b.jsonl")];
    let mut jobs: Vec<super::Job> = ["a", "b"]
        .iter()
        .zip(&outs)
        .map(|(name, out)| {
            let env: Vec<(&str, &std::ffi::OsStr)> = vec![
                ("PYTHONPATH", site.as_os_str()),
                ("FT_OUT", out.as_os_str()),
                ("FT_STOP_FILE", stop.as_os_str()),
            ];
            run_ft_loopback(
                dir.path(),
                name,
                &["--ft-replica-group", "7", "--ft-lighthouse", &addr],
                &env,
            )
        })
        .collect();
    let commits = |i: usize| {
        std::fs::read_to_string(&outs[i])
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"committed\": true"))
            .count()
    };
    // One of them ends on its own.
    let t1 = std::time::Instant::now();
    let (loser, status) = loop {
        if let Some((i, s)) = (0..2).find_map(|i| jobs[i].try_wait().map(|s| (i, s))) {
            break (i, s);
        }
        assert!(
            t1.elapsed() < LIMIT,
            "neither stopped:\n{}\n{}",
            jobs[0].output(),
            jobs[1].output()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let winner = 1 - loser;
    let text = jobs[loser].output();
    assert_eq!(status.code(), Some(4), "{text}");
    // Its joins refused (the case this test is for), or, if its start was
    // slower than the winner's first hello, the check at start.
    let refused = text.contains("refused replica group \"7\"")
        && text.contains("another live group has this id")
        && text.contains("held by another live process");
    let at_start = text.contains("replica group \"7\" is live at the lighthouse");
    assert!(refused || at_start, "{text}");
    eprintln!(
        "the loser stopped {}",
        if refused {
            "on its refused joins"
        } else {
            "at the check at start"
        }
    );
    assert_eq!(
        commits(loser),
        0,
        "the refused group never took part: {text}"
    );
    // The winner trains on after the loser is gone.
    let before = commits(winner);
    let t2 = std::time::Instant::now();
    while commits(winner) < before + 3 {
        assert!(t2.elapsed() < LIMIT, "{}", jobs[winner].output());
        assert!(
            jobs[winner].try_wait().is_none(),
            "{}",
            jobs[winner].output()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::write(&stop, b"").unwrap();
    let s = jobs[winner].wait(LIMIT);
    assert!(s.success(), "{}", jobs[winner].output());
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
        (
            vec![
                "--ft-replica-group",
                "0",
                "--ft-lighthouse",
                "h:1",
                "--ft-min-replicas",
                "2",
            ],
            "--ft-min-replicas is the served lighthouse's",
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
    serve_for_the_others(false);
}

/// The same with a job secret (issue 49): the lighthouse, the managers and
/// the workers' `rallypoint.ft` clients (Python) all prove it, and a plain
/// HTTP client gets nothing from the lighthouse.
#[test]
fn with_a_job_secret_a_group_serves_the_lighthouse_for_the_others() {
    serve_for_the_others(true);
}

fn serve_for_the_others(with_secret: bool) {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let site = super::torch_backend::package(dir.path());
    let port = super::free_port();
    let addr = format!("127.0.0.1:{port}");
    let stop = dir.path().join("stop");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, [9u8; 32]).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let secret = secret.display().to_string();
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
    let mut args0 = vec!["--ft-replica-group", "0", &serve, "--ft-min-replicas", "2"];
    let mut args1 = vec!["--ft-replica-group", "1", "--ft-lighthouse", &addr];
    if with_secret {
        args0.extend(["--job-secret-file", &secret]);
        args1.extend(["--job-secret-file", &secret]);
    }
    let mut g0 = run_ft_loopback(dir.path(), "g0", &args0, &env(0));
    let mut g1 = run_ft_loopback(dir.path(), "g1", &args1, &env(1));
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
    if with_secret {
        // A plain HTTP client: closed without an answer.
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        c.set_read_timeout(Some(LIMIT)).unwrap();
        c.write_all(b"GET /status HTTP/1.1\r\nHost: lh\r\n\r\n")
            .unwrap();
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        assert!(
            !out.starts_with(b"HTTP"),
            "{}",
            String::from_utf8_lossy(&out)
        );
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
    if with_secret {
        assert!(
            g0.output().contains("job secret on (key id"),
            "{}",
            g0.output()
        );
    }
}

#[test]
fn groups_of_two_nodes_restart_only_the_failed_group() {
    let dir = tempfile::tempdir().unwrap();
    let site = super::torch_backend::package(dir.path());
    let (_lh, lighthouse) = super::rally_lighthouse(dir.path(), &["--min_replicas", "1"]);
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
