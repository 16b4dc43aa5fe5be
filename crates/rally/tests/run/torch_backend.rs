//! The `rally` backend for `torch.distributed`, under real torch: every op on
//! every dtype, DDP, the object collectives, subgroups and DeviceMesh
//! (`tests/py/torch_backend.py`), at 2 and 4 ranks, under `rally run` and with
//! processes started by hand (env://, torch's own TCPStore); and what gloo
//! cannot do: a killed rank named at once, a mismatch named on every rank,
//! and a monitored barrier naming every absent rank.
//!
//! The extension module is built here (`cargo build -p rallypoint-torch`, a
//! no-op when fresh) and staged with `python/rallypoint` on PYTHONPATH, as
//! `pip install .` lays it out.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;

use super::{free_port, python, rally, results, script, wait_or_kill, Job};

const LIMIT: Duration = Duration::from_secs(240);

/// `target/.../lib_native.so`, built once per test process.
fn native_module() -> &'static PathBuf {
    static SO: OnceLock<PathBuf> = OnceLock::new();
    SO.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let out = Command::new(cargo)
            .current_dir(&root)
            .args([
                "build",
                "--quiet",
                "-p",
                "rallypoint-torch",
                "--message-format=json",
            ])
            .stderr(Stdio::inherit())
            .output()
            .expect("running cargo build -p rallypoint-torch");
        assert!(
            out.status.success(),
            "cargo build -p rallypoint-torch failed"
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["reason"] == "compiler-artifact" && v["target"]["name"] == "_native")
            .find_map(|v| v["filenames"][0].as_str().map(PathBuf::from))
            .expect("cargo reported no _native artifact")
    })
}

/// A directory holding the `rallypoint` package as pip installs it.
pub(super) fn package(dir: &Path) -> PathBuf {
    let site = dir.join("site");
    let pkg = site.join("rallypoint");
    std::fs::create_dir_all(&pkg).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python/rallypoint");
    copy_py(&src, &pkg);
    std::os::unix::fs::symlink(native_module(), pkg.join("_native.abi3.so")).unwrap();
    site
}

/// Copies the `.py` files of `src` and its subpackages (`rallypoint.ft`) into `dst`.
fn copy_py(src: &Path, dst: &Path) {
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() && p.join("__init__.py").exists() {
            let sub = dst.join(p.file_name().unwrap());
            std::fs::create_dir_all(&sub).unwrap();
            copy_py(&p, &sub);
        } else if p.extension().is_some_and(|x| x == "py") {
            std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
        }
    }
}

/// `torch_backend.py` under `rally run` with `n` workers; its results.
fn under_rally_run(n: usize, scenario: &str) -> (Vec<Value>, String) {
    under_rally_run_with(n, scenario, &[])
}

fn under_rally_run_with(n: usize, scenario: &str, env: &[(&str, &str)]) -> (Vec<Value>, String) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("results");
    std::fs::create_dir(&out).unwrap();
    let nproc = n.to_string();
    let mut c = rally(&["--standalone", "--nproc-per-node", &nproc]);
    c.arg(script("torch_backend.py"))
        .env("PYTHONPATH", package(dir.path()))
        .env("RESULT_DIR", &out)
        .env("SCENARIO", scenario)
        .envs(env.iter().copied());
    let mut job = Job::spawn(c, dir.path(), "job");
    let status = job.wait(LIMIT);
    let log = job.output();
    assert!(status.success(), "{status}\n{log}");
    (results(&out).into_values().collect(), log)
}

/// `torch_backend.py` in `n` processes started by hand (env://).
fn by_hand(n: usize, scenario: &str) -> (Vec<Value>, String) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("results");
    std::fs::create_dir(&out).unwrap();
    let site = package(dir.path());
    let port = free_port().to_string();
    let env = [
        ("RESULT_DIR", out.as_os_str()),
        ("SCENARIO", scenario.as_ref()),
    ];
    let mut children: Vec<(Child, PathBuf)> = (0..n)
        .map(|r| env_rank("torch_backend.py", dir.path(), &site, &port, (r, n), &env))
        .collect();
    let logs = || {
        children_logs(
            &(0..n)
                .map(|r| dir.path().join(format!("rank{r}.log")))
                .collect::<Vec<_>>(),
        )
    };
    let mut statuses = Vec::new();
    for (c, _) in children.iter_mut() {
        statuses.push(wait_or_kill(c, LIMIT, logs));
    }
    (
        results(&out).into_values().collect(),
        format!("{statuses:?}\n{}", logs()),
    )
}

/// Rank `r` of `n` of a `tests/py` script started by hand (env://, rank 0's
/// TCPStore at `port`), with the `rallypoint` package at `site` and `env`
/// set; its output goes to `dir/rank<r>.log`.
pub(super) fn env_rank(
    name: &str,
    dir: &Path,
    site: &Path,
    port: &str,
    (r, n): (usize, usize),
    env: &[(&str, &std::ffi::OsStr)],
) -> (Child, PathBuf) {
    let log = dir.join(format!("rank{r}.log"));
    let f = std::fs::File::create(&log).unwrap();
    let child = Command::new(python())
        .arg(script(name))
        .env("PYTHONPATH", site)
        .envs(env.iter().copied())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port)
        .env("RANK", r.to_string())
        .env("LOCAL_RANK", r.to_string())
        .env("WORLD_SIZE", n.to_string())
        .env("OMP_NUM_THREADS", "1")
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .spawn()
        .unwrap();
    (child, log)
}

pub(super) fn children_logs(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| {
            format!(
                "--- {}\n{}",
                p.display(),
                std::fs::read_to_string(p).unwrap_or_default()
            )
        })
        .collect()
}

/// The checks `every_op` in `torch_backend.py` makes on rank `me` of a group
/// of `k`: per dtype (4 floating, 5 not), all_reduce with each reduce op
/// (5 on floats, 7 on the others) sync and async, broadcast from each root,
/// all_gather's k parts, all_gather_into_tensor, reduce_scatter in its two
/// forms, scatter, all_to_all_single even and split, all_to_all's k parts;
/// reduce at the last rank and gather's k parts at the first; then send/recv
/// with two tags and batch_isend_irecv.
fn every_op_checks(k: u64, me: u64) -> u64 {
    let all_reduce = 2 * (4 * 5 + 5 * 7);
    let per_dtype_k = 3 * k; // broadcast, all_gather, all_to_all
    let per_dtype_one = 1 + 2 + 1 + 2; // into_tensor, reduce_scatter x2, scatter, a2a_single x2
    let root_only = u64::from(me == k - 1) + if me == 0 { k } else { 0 };
    all_reduce + 9 * (per_dtype_k + per_dtype_one + root_only) + 3
}

/// The checks each section of the `ops` scenario makes on rank `r` of `n`,
/// by the section's name in the rank's JSON. A section that stops checking
/// (a loop over nothing, a group skipped, an op never compared) changes its
/// count.
pub(super) fn ops_sections(n: u64, r: u64) -> BTreeMap<String, u64> {
    let mut want = BTreeMap::new();
    want.insert("every_op".to_owned(), every_op_checks(n, r));
    want.insert("objects".to_owned(), 3 + u64::from(r == 0));
    want.insert("bad_input".to_owned(), 3);
    let subsets: [Vec<u64>; 3] = [
        (0..n).collect(),
        (0..n).filter(|i| i % 2 == 0).collect(),
        (1..n).collect(),
    ];
    for ranks in subsets {
        if let Some(me) = ranks
            .iter()
            .position(|&x| x == r)
            .filter(|_| ranks.len() > 1)
        {
            let name = format!("subgroup {ranks:?}");
            // get_backend, then every op in the group.
            want.insert(name, 1 + every_op_checks(ranks.len() as u64, me as u64));
        }
    }
    // Net has four used parameters, each compared; with the unused layer,
    // its two parameters are checked to have no gradient.
    for (name, checks) in [
        ("ddp []", 4),
        ("ddp ['gradient_as_bucket_view']", 4),
        ("ddp ['find_unused_parameters', 'unused']", 6),
        ("ddp ['no_sync']", 4),
        ("ddp ['hook']", 4),
    ] {
        want.insert(name.to_owned(), checks);
    }
    want.insert("device_mesh".to_owned(), 1 + u64::from(n == 4));
    want.insert("reinit cpu:rally".to_owned(), 2);
    want.insert("reinit cpu:rally,cuda:gloo".to_owned(), 2);
    want
}

/// Every rank of an `ops` run ended well, having made every section's checks.
pub(super) fn all_ops_passed(n: usize, (res, log): (Vec<Value>, String)) {
    assert_eq!(res.len(), n, "{log}");
    for v in &res {
        assert_eq!(v["ok"], true, "{v}\n{log}");
        assert_eq!(v["world_size"], n as u64, "{v}");
        let r = v["rank"].as_u64().expect("rank");
        let got: BTreeMap<String, u64> = serde_json::from_value(v["sections"].clone())
            .unwrap_or_else(|e| panic!("sections of rank {r}: {e}\n{v}"));
        assert_eq!(
            got,
            ops_sections(n as u64, r),
            "rank {r}'s checks by section"
        );
    }
}

#[test]
fn every_op_ddp_and_subgroups_under_rally_run_at_two_ranks() {
    all_ops_passed(2, under_rally_run(2, "ops"));
}

#[test]
fn every_op_ddp_and_subgroups_under_rally_run_at_four_ranks() {
    all_ops_passed(4, under_rally_run(4, "ops"));
}

#[test]
fn every_op_ddp_and_subgroups_with_processes_started_by_hand_at_two_ranks() {
    all_ops_passed(2, by_hand(2, "ops"));
}

#[test]
fn every_op_ddp_and_subgroups_with_processes_started_by_hand_at_four_ranks() {
    all_ops_passed(4, by_hand(4, "ops"));
}

#[test]
fn a_killed_rank_fails_every_survivor_at_once_naming_it() {
    // The op timeout is torch's default, 30 minutes: gloo would wait it out.
    let (res, log) = by_hand(3, "dead");
    assert_eq!(res.len(), 2, "{log}");
    for v in &res {
        let e = v["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error: {v}\n{log}"));
        assert!(e.contains("rank 2 is gone"), "{v}");
        assert_eq!(v["is_dist_error"], true, "{v}");
        assert!(v["seconds"].as_f64().unwrap() < 30.0, "{v}");
    }
    // The rank that found the death raises DistNetworkError; a rank told of
    // it by the group's abort raises DistBackendError, naming it the same.
    assert!(
        res.iter().any(|v| v["class"] == "DistNetworkError"),
        "{res:?}"
    );
}

#[test]
fn calls_with_different_reduce_ops_fail_every_rank_naming_both() {
    let (res, log) = under_rally_run(3, "mismatch");
    assert_eq!(res.len(), 3, "{log}");
    for v in &res {
        let e = v["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error: {v}\n{log}"));
        assert_eq!(v["class"], "DistBackendError", "{v}");
        assert!(
            e.contains("all_reduce(f32 x 8, SUM") && e.contains("all_reduce(f32 x 8, MAX"),
            "{v}"
        );
    }
}

#[test]
fn monitored_barrier_names_every_rank_that_did_not_arrive() {
    let (res, log) = under_rally_run(4, "monitored");
    let waited: Vec<&Value> = res.iter().filter(|v| v["skipped"] != true).collect();
    assert_eq!(waited.len(), 2, "{log}");
    for v in waited {
        let e = v["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error: {v}\n{log}"));
        assert_eq!(v["class"], "DistBackendError", "{v}");
        assert!(
            e.contains("2 rank(s) did not arrive within 2 s: 1, 3"),
            "{v}"
        );
    }
}

#[test]
fn torch_debug_detail_is_refused_at_init_with_a_reason() {
    // torch 2.15 wraps plugin backends under DETAIL in a wrapper whose first
    // call fails with an internal assert; rally says so at init instead.
    let (res, log) = under_rally_run_with(2, "detail", &[("TORCH_DISTRIBUTED_DEBUG", "DETAIL")]);
    assert_eq!(res.len(), 2, "{log}");
    for v in &res {
        let e = v["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error: {v}\n{log}"));
        assert_eq!(v["class"], "ValueError", "{v}");
        assert!(
            e.contains("TORCH_DISTRIBUTED_DEBUG=DETAIL") && e.contains("unset it"),
            "{v}"
        );
    }
}
