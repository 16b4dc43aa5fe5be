//! `rallypoint.ft`'s training-loop API (issue 48 §1) under real torch, the
//! parts that need no replica group manager: each case of
//! `tests/py/ft/api_cases.py` in its own process (the sampler's shards, the
//! Manager's averaging over a real two-process `rally` generation, the
//! JSON-lines client's framing and deadlines against an in-test line server,
//! and the API loaded and run with torchft made unimportable).
//!
//! The script runs with the `rallypoint` package staged as pip lays it out
//! (`torch_backend::package`); every check is in the script, which exits
//! non-zero with the failed assertion, and prints `PASS <case>`.

use std::process::Command;
use std::time::Duration;

use super::torch_backend::package;
use super::{python, script, Job};

const LIMIT: Duration = Duration::from_secs(180);

fn case(name: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Command::new(python());
    c.arg(script("ft/api_cases.py"))
        .arg(name)
        .env("PYTHONPATH", package(dir.path()))
        .env("PYTHONUNBUFFERED", "1")
        .env("OMP_NUM_THREADS", "1")
        .env_remove("RALLY_FT_MANAGER")
        .env_remove("TORCHFT_LIGHTHOUSE")
        .env_remove("TORCHFT_TIMEOUT_SEC");
    let mut job = Job::spawn(c, dir.path(), "script");
    let status = job.wait(LIMIT);
    let out = job.output();
    assert!(status.success(), "{name}: {status}\n{out}");
    assert!(out.contains(&format!("PASS {name}")), "{name} did not pass:\n{out}");
    out
}

#[test]
fn the_sampler_shards_by_replica_group_disjoint_and_covering() {
    case("sampler");
}

#[test]
fn allreduce_averages_over_the_participants_and_a_failure_never_raises() {
    case("averaging");
}

#[test]
fn the_manager_client_frames_lines_with_deadlines_and_reconnects() {
    case("client");
}

#[test]
fn the_api_loads_and_runs_with_torchft_hidden() {
    case("no_torchft");
}
