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

use super::ft_hosts::{unix_ms, FtJob, Launch, AT};
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
    j.all_in(10);
    let t0 = unix_ms() as f64 / 1000.0;
    j.c.hosts_mut()[2].power_off();
    let step = j.replicas[0].committed().keys().max().copied().unwrap() + 1;
    j.survivors_commit_past(&[0, 1], step, t0, Duration::from_millis(1250));
    j.finish_but(&[0, 1], Some(2));
    never_restarted(&j, &[0, 1]);
}

/// A host cut off for good: the same bound; its group is left to itself.
#[test]
fn a_host_cut_off_for_good_is_dropped_at_the_keep_alive() {
    let mut j = FtJob::start_with(3, 1000, Launch::RallyRunFt);
    for i in 0..3 {
        group(&mut j, i, &[]);
    }
    j.all_in(10);
    let t0 = unix_ms() as f64 / 1000.0;
    j.c.host(2).cut();
    let step = j.replicas[0].committed().keys().max().copied().unwrap() + 1;
    j.survivors_commit_past(&[0, 1], step, t0, Duration::from_millis(1250));
    j.finish_but(&[0, 1], Some(2));
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
    let first = j.all_in(10);
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
        let missed: Vec<u64> = (first..=until).filter(|s| !c.contains_key(s)).collect();
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
/// The managers remember their last quorum, so the new lighthouse issues
/// its first one as soon as all three are back, without its startup grace
/// (it says so in its log).
#[test]
fn the_lighthouse_killed_and_restarted_restarts_no_group() {
    let mut j = FtJob::start_with(3, 1000, Launch::RallyRunFt);
    for i in 0..3 {
        group(&mut j, i, &[]);
    }
    j.all_in(10);
    let log = j.restart_the_lighthouse();
    assert!(
        log.contains("without the startup grace"),
        "the restarted lighthouse waited its grace:\n{log}"
    );
    j.finish(&[0, 1, 2]);
    never_restarted(&j, &[0, 1, 2]);
}
