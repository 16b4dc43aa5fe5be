//! A process that used the `rally` backend exits cleanly, every time, the way
//! users' scripts end (`tests/py/exit_cleanly.py`): after
//! `destroy_process_group`, without it, after an uncaught error, with ops in
//! flight, with an op its peer never joins, and with subgroups. Each way runs
//! [`runs`] times (two ranks started by hand, env://), and every rank must end
//! with the script's own exit code: never a signal (the extension's threads
//! once entered Python after the interpreter had finalized: SIGSEGV or
//! SIGABRT, in a third of the runs; `crates/torch/src/life.rs`).
//!
//! gloo runs the same script beside it where torch itself is the comparison:
//! a clean exit after `destroy_process_group`.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use super::torch_backend::{env_rank, package};
use super::{free_port, wait_or_kill};

/// How many times each way of ending runs: `RALLY_EXIT_RUNS`, default 2:
/// 24 processes of the backend over the six ways, where the defect ended one
/// in five (a loop of 20 each, two CPU hogs beside it, is in the note of the
/// issue that fixed it).
fn runs() -> usize {
    match std::env::var("RALLY_EXIT_RUNS") {
        Err(_) => 2,
        Ok(v) => v
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .unwrap_or_else(|| panic!("RALLY_EXIT_RUNS={v:?} is not a positive count")),
    }
}

/// Two ranks of `exit_cleanly.py`; their exit statuses and logs.
fn pair(backend: &str, mode: &str) -> Vec<(ExitStatus, String)> {
    let dir = tempfile::tempdir().unwrap();
    let site = package(dir.path());
    let port = free_port().to_string();
    let env = [("BACKEND", backend.as_ref()), ("MODE", mode.as_ref())];
    let mut children: Vec<_> = (0..2)
        .map(|r| env_rank("exit_cleanly.py", dir.path(), &site, &port, (r, 2), &env))
        .collect();
    let read = |p: &PathBuf| std::fs::read_to_string(p).unwrap_or_default();
    children
        .iter_mut()
        .map(|(c, log)| {
            // A clean exit takes a few seconds; the bound only keeps a hang
            // from holding the suite (the unmatched op's timeout is 30 min).
            let status = wait_or_kill(c, Duration::from_secs(120), || read(log));
            (status, read(log))
        })
        .collect()
}

/// Every rank of every run ends with `code`, having printed its last line.
fn every_run_exits(backend: &str, mode: &str, code: i32) {
    for run in 0..runs() {
        for (rank, (status, log)) in pair(backend, mode).into_iter().enumerate() {
            assert_eq!(
                status.code(),
                Some(code),
                "{backend} {mode}, run {run}, rank {rank}: {status}\n{log}"
            );
            assert!(
                log.contains(&format!("ended {rank}")),
                "{backend} {mode}, run {run}, rank {rank}: the script did not reach its end\n{log}"
            );
            for bad in [
                "terminate called",
                "Segmentation fault",
                "Fatal Python error",
            ] {
                assert!(
                    !log.contains(bad),
                    "{backend} {mode}, run {run}, rank {rank}\n{log}"
                );
            }
        }
    }
}

#[test]
fn rally_exits_cleanly_after_destroy_process_group() {
    every_run_exits("rally", "destroy", 0);
}

#[test]
fn gloo_exits_cleanly_after_destroy_process_group() {
    every_run_exits("gloo", "destroy", 0);
}

#[test]
fn rally_exits_cleanly_without_destroy_process_group() {
    every_run_exits("rally", "keep", 0);
}

#[test]
fn rally_exits_with_the_scripts_error_after_an_uncaught_exception() {
    every_run_exits("rally", "error", 1);
}

#[test]
fn rally_exits_cleanly_with_ops_in_flight() {
    every_run_exits("rally", "inflight", 0);
}

#[test]
fn rally_exits_cleanly_with_an_op_its_peer_never_joins() {
    every_run_exits("rally", "unmatched", 0);
}

#[test]
fn rally_exits_cleanly_with_subgroups() {
    every_run_exits("rally", "subgroups", 0);
}
