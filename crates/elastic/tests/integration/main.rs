//! Integration tests of elastic multiprocessing, with real processes.
//!
//! Some tests re-execute this test binary in a role (`RALLY_TEST_ROLE`) to play a
//! launcher or a Rust worker in a separate process.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rallypoint_elastic::errors;
use rallypoint_elastic::multiprocessing::{
    start_processes, Entrypoint, Exit, LogsSpec, PerRank, ProcessContext, RunLogs, SpawnError,
    StartSpec, Std,
};

const ROLE: &str = "RALLY_TEST_ROLE";

/// This test binary, re-executed to run only `test` in `role`.
fn reexec(test: &str, role: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test, "--nocapture"]).env(ROLE, role);
    c
}

fn sh(scripts: &[&str]) -> StartSpec {
    StartSpec {
        name: "trainer".into(),
        entrypoint: Entrypoint::Program("sh".into()),
        args: scripts
            .iter()
            .enumerate()
            .map(|(i, s)| (i, vec![OsString::from("-c"), OsString::from(*s)]))
            .collect(),
        envs: (0..scripts.len()).map(|i| (i, BTreeMap::new())).collect(),
        global_ranks: BTreeMap::new(),
        bindings: Default::default(),
    }
}

fn redirected(dir: &Path) -> LogsSpec {
    LogsSpec {
        log_dir: Some(dir.to_owned()),
        redirects: PerRank::All(Std::All),
        ..LogsSpec::default()
    }
}

fn start(spec: &StartSpec, logs: &LogsSpec) -> (ProcessContext, RunLogs) {
    let run = RunLogs::create(logs, "run1").unwrap();
    let attempt = run.attempt(0, spec.args.len()).unwrap();
    (start_processes(spec, logs, &attempt).unwrap(), run)
}

fn alive(pid: u32) -> bool {
    // A zombie is not alive; /proc/<pid>/stat's state field tells.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => {
            let state = s[s.rfind(')').unwrap() + 2..].chars().next().unwrap();
            state != 'Z' && state != 'X'
        }
        Err(_) => false,
    }
}

fn rank_file(run: &RunLogs, rank: usize, name: &str) -> PathBuf {
    run.dir.join("attempt_0").join(rank.to_string()).join(name)
}

#[test]
fn exit_codes_are_reported_per_rank_and_logs_land_in_the_layout() {
    let dir = tempfile::tempdir().unwrap();
    let spec = sh(&["echo out0; echo err0 >&2", "sleep 0.3; exit 3", "exit 0"]);
    let (mut ctx, run) = start(&spec, &redirected(dir.path()));
    let r = ctx
        .wait(Some(Duration::from_secs(10)), Duration::from_millis(5))
        .unwrap();
    assert_eq!(r.exits[&0], Exit::Code(0));
    assert_eq!(r.exits[&1], Exit::Code(3));
    let f = &r.failures[&1];
    assert_eq!((f.local_rank, f.exit.code()), (1, 3));
    assert!(f.message().contains("code 3"), "{}", f.message());
    assert_eq!(r.failures.len(), 1);
    assert!(run
        .dir
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("run1_"));
    assert_eq!(
        std::fs::read_to_string(rank_file(&run, 0, "stdout.log")).unwrap(),
        "out0\n"
    );
    assert_eq!(
        std::fs::read_to_string(rank_file(&run, 0, "stderr.log")).unwrap(),
        "err0\n"
    );
}

#[test]
fn signals_are_named_and_the_first_failure_is_the_root_cause() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 1 dies by SIGSEGV first; rank 0 is killed by us later.
    let spec = sh(&["sleep 30", "kill -SEGV $$"]);
    let (mut ctx, _run) = start(&spec, &redirected(dir.path()));
    let pids = ctx.pids();
    let r = ctx
        .wait(Some(Duration::from_secs(10)), Duration::from_millis(5))
        .unwrap();
    let root = r.root_cause().unwrap();
    assert_eq!(root.local_rank, 1);
    assert_eq!(root.exit, Exit::Signal(libc::SIGSEGV));
    assert_eq!(
        root.message(),
        format!("Signal 11 (SIGSEGV) received by PID {}", pids[&1])
    );
    // The launcher's own error file gets the root cause, with its exit code.
    let parent = dir.path().join("launcher-error.json");
    assert!(r.record_root_cause(&parent).unwrap());
    let copied = errors::ErrorReport::read(&parent).unwrap().unwrap();
    assert_eq!(copied.error_code, Some(-libc::SIGSEGV));
    assert!(copied.message.contains("SIGSEGV"), "{}", copied.message);
    // All-or-nothing: rank 0 was stopped because rank 1 failed; it is not itself
    // reported as a failure.
    assert!(!alive(pids[&0]));
    assert_eq!(r.exits[&0], Exit::Signal(libc::SIGTERM));
    assert_eq!(r.failures.len(), 1);
}

#[test]
fn a_worker_killed_by_sigkill_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let (mut ctx, _run) = start(&sh(&["sleep 30"]), &redirected(dir.path()));
    let pid = ctx.pids()[&0];
    // SAFETY: a plain syscall.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let r = ctx
        .wait(Some(Duration::from_secs(10)), Duration::from_millis(5))
        .unwrap();
    assert_eq!(r.exits[&0], Exit::Signal(libc::SIGKILL));
    assert_eq!(r.exits[&0].code(), -9);
}

#[test]
fn close_escalates_to_sigkill_after_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    let spec = sh(&["trap '' TERM; echo ready; sleep 30", "sleep 30"]);
    let (mut ctx, run) = start(&spec, &redirected(dir.path()));
    let pids = ctx.pids();
    // Wait until the trap is installed.
    let ready = rank_file(&run, 0, "stdout.log");
    let t = Instant::now();
    while std::fs::read_to_string(&ready)
        .unwrap_or_default()
        .is_empty()
    {
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(5));
    }
    let t = Instant::now();
    ctx.close(libc::SIGTERM, Duration::from_millis(300));
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(pids.values().all(|&p| !alive(p)));
}

#[test]
fn a_grandchild_holding_stdout_does_not_hang_the_launcher_and_is_reaped() {
    let dir = tempfile::tempdir().unwrap();
    // Teed, so the launcher reads a pipe the grandchild holds open.
    let logs = LogsSpec {
        log_dir: Some(dir.path().to_owned()),
        tee: PerRank::All(Std::Out),
        ..LogsSpec::default()
    };
    let spec = sh(&["sleep 30 & echo $!; exit 0"]);
    let (mut ctx, run) = start(&spec, &logs);
    let t = Instant::now();
    let r = ctx
        .wait(Some(Duration::from_secs(10)), Duration::from_millis(5))
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(!r.is_failed());
    let grandchild: u32 = std::fs::read_to_string(rank_file(&run, 0, "stdout.log"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(alive(grandchild), "still running after its parent exited");
    drop(ctx);
    assert!(
        !alive(grandchild),
        "close ends the worker's whole process group"
    );
}

#[test]
fn bad_input_is_a_clear_error_and_leaves_nothing_running() {
    let dir = tempfile::tempdir().unwrap();
    let logs = redirected(dir.path());
    let run = RunLogs::create(&logs, "bad").unwrap();
    // Ranks that do not cover 0..n.
    let mut spec = sh(&["true", "true"]);
    spec.envs.remove(&1);
    spec.envs.insert(5, BTreeMap::new());
    let err = start_processes(&spec, &logs, &run.attempt(0, 2).unwrap())
        .err()
        .unwrap();
    assert!(
        matches!(&err, SpawnError::Ranks { what: "envs", missing, extra, .. } if missing == &[1] && extra == &[5]),
        "{err}"
    );
    assert!(err.to_string().contains("missing [1], extra [5]"), "{err}");
    // A program that does not exist, after rank 0 already started.
    let mut spec = sh(&["sleep 30", "sleep 30"]);
    spec.entrypoint = Entrypoint::Program("/no/such/program".into());
    let err = start_processes(&spec, &logs, &run.attempt(1, 2).unwrap())
        .err()
        .unwrap();
    assert!(err.to_string().contains("/no/such/program"), "{err}");
    // An unwritable log directory.
    let ro = LogsSpec {
        log_dir: Some("/proc/rally-cannot-write-here".into()),
        ..LogsSpec::default()
    };
    let err = RunLogs::create(&ro, "x").err().unwrap();
    assert!(
        err.to_string().contains("/proc/rally-cannot-write-here"),
        "{err}"
    );
    // No child of ours is left (all reaped, none running).
    let mut status = 0;
    // SAFETY: a plain syscall; `status` is a valid place to write.
    let r = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
    assert_eq!(r, -1, "a child was left behind");
}

/// The tee role: tees `TEE_LINES` lines of 100 bytes (default 1,000,000: 100
/// MB) to this process's console.
fn tee_role() {
    let lines: u64 = std::env::var("TEE_LINES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let dir = tempfile::tempdir().unwrap();
    let logs = LogsSpec {
        log_dir: Some(dir.path().to_owned()),
        tee: PerRank::All(Std::Out),
        ..LogsSpec::default()
    };
    let script = format!("yes 123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789 | head -n {lines}");
    let spec = sh(&[&script]);
    let (mut ctx, run) = start(&spec, &logs);
    let r = ctx
        .wait(Some(Duration::from_secs(120)), Duration::from_millis(5))
        .unwrap();
    drop(ctx);
    let len = std::fs::metadata(rank_file(&run, 0, "stdout.log"))
        .unwrap()
        .len();
    eprintln!("LOGS {}", dir.path().display());
    eprintln!(
        "DONE failed={} bytes={len} dropped={}",
        r.is_failed(),
        rallypoint_elastic::multiprocessing::logs::console_lines_dropped()
    );
    // exit skips destructors: remove the 100 MB log ourselves (every run
    // leaked one into /tmp, which filled a CI machine's disk).
    drop(run);
    dir.close().unwrap();
    std::process::exit(0);
}

/// The log directory a launcher role named (`LOGS <dir>`) is gone: the
/// role exits with `process::exit`, which runs no destructor, and once
/// left 100 MB in /tmp per run.
fn assert_logs_removed(stderr: &str) {
    let dir = stderr
        .lines()
        .find_map(|l| l.strip_prefix("LOGS "))
        .unwrap_or_else(|| panic!("no LOGS line: {stderr}"));
    assert!(!Path::new(dir).exists(), "the role left {dir} behind");
}

/// Runs the tee role of `test` with `lines` lines; the console (a pipe) is
/// first read after `stall`. Checks that the file got every byte and the
/// console every line, none dropped.
fn tee_through_console(test: &str, lines: usize, stall: Duration) {
    use std::io::Read;
    let mut child = reexec(test, "tee")
        .env("TEE_LINES", lines.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Nobody reads the console for a while: the launcher's console thread
    // blocks on a full pipe, its queue fills, and the pump falls behind.
    std::thread::sleep(stall);
    let mut stderr = child.stderr.take().unwrap();
    let err = std::thread::spawn(move || {
        let mut e = String::new();
        stderr.read_to_string(&mut e).unwrap();
        e
    });
    let mut stdout = Vec::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_end(&mut stdout)
        .unwrap();
    child.wait().unwrap();
    let err = err.join().unwrap();
    let done = err
        .lines()
        .find(|l| l.starts_with("DONE "))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        done.contains(&format!("failed=false bytes={}", lines * 100)),
        "{done}"
    );
    assert!(done.ends_with("dropped=0"), "{done}");
    assert_logs_removed(&err);
    let line = b"[trainer0]:123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789";
    // Every line of ours is whole; the harness's own lines are not ours.
    let ours = stdout
        .split(|b| *b == b'\n')
        .filter(|l| l.starts_with(b"[trainer") || l.starts_with(b"[rally"));
    let (mut shown, mut other) = (0, 0);
    for l in ours {
        if l == line {
            shown += 1;
        } else {
            other += 1;
        }
    }
    assert_eq!((shown, other), (lines, 0), "whole lines shown, other lines");
}

#[test]
fn hundred_megabytes_through_tee_arrive_whole_and_every_console_line_is_shown() {
    if std::env::var(ROLE).as_deref() == Ok("tee") {
        return tee_role();
    }
    tee_through_console(
        "hundred_megabytes_through_tee_arrive_whole_and_every_console_line_is_shown",
        1_000_000,
        Duration::ZERO,
    );
}

/// A console that stops reading (a terminal scrolled back, a pager, a slow
/// log shipper) makes the launcher lag, never drop: the lines it could not
/// show at once are read back from the log file (issue 18, defect 9).
#[test]
fn a_console_that_stalls_lags_but_loses_no_line() {
    if std::env::var(ROLE).as_deref() == Ok("tee") {
        return tee_role();
    }
    tee_through_console(
        "a_console_that_stalls_lags_but_loses_no_line",
        300_000,
        Duration::from_secs(2),
    );
}

/// The launcher role: tees two chatty workers to its console.
fn launcher_role() {
    let dir = tempfile::tempdir().unwrap();
    let logs = LogsSpec {
        log_dir: Some(dir.path().to_owned()),
        tee: PerRank::All(Std::All),
        ..LogsSpec::default()
    };
    let line = "x".repeat(3000);
    let script = format!(
        "i=0; while [ $i -lt 300 ]; do echo {line}; i=$((i+1)); done; printf tail-no-newline"
    );
    let mut spec = sh(&[&script, &script]);
    spec.global_ranks = [(0, 4), (1, 5)].into();
    let (mut ctx, _run) = start(&spec, &logs);
    let r = ctx
        .wait(Some(Duration::from_secs(30)), Duration::from_millis(5))
        .unwrap();
    assert!(!r.is_failed());
}

#[test]
fn console_lines_are_prefixed_and_never_interleaved() {
    if std::env::var(ROLE).as_deref() == Ok("launcher") {
        return launcher_role();
    }
    let out = reexec(
        "console_lines_are_prefixed_and_never_interleaved",
        "launcher",
    )
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let ours: Vec<&str> = text.lines().filter(|l| l.starts_with("[trainer")).collect();
    assert_eq!(ours.len(), 2 * 301, "{}", &text[..text.len().min(500)]);
    let body = "x".repeat(3000);
    for l in ours {
        let (prefix, rest) = l.split_at(l.find(':').unwrap() + 1);
        assert!(
            prefix == "[trainer0]:" || prefix == "[trainer1]:",
            "{prefix}"
        );
        assert!(
            rest == body || rest == "tail-no-newline",
            "interleaved line: {}",
            &l[..l.len().min(80)]
        );
    }
}

/// The parent role: starts a worker and prints its pid, then waits to be killed.
fn parent_role() {
    let dir = tempfile::tempdir().unwrap();
    let (ctx, _run) = start(&sh(&["sleep 60"]), &redirected(dir.path()));
    println!("PID {}", ctx.pids()[&0]);
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn a_launcher_killed_by_sigkill_leaves_no_worker() {
    if std::env::var(ROLE).as_deref() == Ok("parent") {
        return parent_role();
    }
    use std::io::BufRead;
    let mut parent = reexec("a_launcher_killed_by_sigkill_leaves_no_worker", "parent")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(parent.stdout.take().unwrap()).lines();
    let worker: u32 = loop {
        let l = lines.next().unwrap().unwrap();
        if let Some(p) = l.strip_prefix("PID ") {
            break p.trim().parse().unwrap();
        }
    };
    assert!(alive(worker));
    parent.kill().unwrap(); // SIGKILL
    parent.wait().unwrap();
    let t = Instant::now();
    while alive(worker) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "worker {worker} outlived its launcher"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A Rust worker that panics with the panic hook installed.
fn panicking_worker() {
    errors::install_panic_hook();
    panic!("boom from rust");
}

#[test]
fn a_rust_panic_arrives_in_the_failure_report() {
    if std::env::var(ROLE).as_deref() == Ok("panicker") {
        panicking_worker();
    }
    let dir = tempfile::tempdir().unwrap();
    let spec = StartSpec {
        name: "rs".into(),
        entrypoint: Entrypoint::Program(std::env::current_exe().unwrap().into()),
        args: [(
            0,
            [
                "--exact",
                "a_rust_panic_arrives_in_the_failure_report",
                "--nocapture",
            ]
            .map(OsString::from)
            .to_vec(),
        )]
        .into(),
        envs: [(0, [(ROLE.to_owned(), "panicker".to_owned())].into())].into(),
        global_ranks: BTreeMap::new(),
        bindings: Default::default(),
    };
    let (mut ctx, _run) = start(&spec, &redirected(dir.path()));
    let r = ctx
        .wait(Some(Duration::from_secs(30)), Duration::from_millis(5))
        .unwrap();
    let f = &r.failures[&0];
    assert!(
        f.message().contains("panic: boom from rust"),
        "{}",
        f.message()
    );
    assert!(f.error.as_ref().unwrap().timestamp.is_some());
}

fn python() -> PathBuf {
    std::env::var_os("RALLY_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"))
}

#[test]
fn a_python_record_exception_arrives_in_the_failure_report() {
    let dir = tempfile::tempdir().unwrap();
    let script = "from torch.distributed.elastic.multiprocessing.errors import record\n\
                  @record\n\
                  def main():\n    raise ValueError('bad learning rate 42')\n\
                  main()\n";
    let spec = StartSpec {
        name: "py".into(),
        entrypoint: Entrypoint::Program(python().into()),
        args: [(0, vec![OsString::from("-c"), OsString::from(script)])].into(),
        envs: [(0, BTreeMap::new())].into(),
        global_ranks: BTreeMap::new(),
        bindings: Default::default(),
    };
    let (mut ctx, _run) = start(&spec, &redirected(dir.path()));
    let r = ctx
        .wait(Some(Duration::from_secs(120)), Duration::from_millis(10))
        .unwrap();
    let f = &r.failures[&0];
    assert_eq!(f.exit, Exit::Code(1));
    assert_eq!(f.message(), "ValueError: bad learning rate 42");
    assert!(f
        .error
        .as_ref()
        .unwrap()
        .callstack
        .as_deref()
        .unwrap()
        .contains("Traceback"));
}

/// The forwarder role: traps the default signals, starts a worker that reports the
/// signal it gets, and prints how the wait ended.
fn forwarder_role() {
    use rallypoint_elastic::multiprocessing::signals::{parse_signals, Signals, DEFAULT_SIGNALS};
    use rallypoint_elastic::multiprocessing::Waited;
    let dir = std::env::var("RALLY_TEST_DIR").unwrap();
    let signals = Signals::install(&parse_signals(DEFAULT_SIGNALS).unwrap()).unwrap();
    let script = "trap 'echo got-term; exit 7' TERM; echo ready; while true; do sleep 0.01; done";
    let (mut ctx, run) = start(&sh(&[script]), &redirected(Path::new(&dir)));
    println!("LOGS {}", run.dir.display());
    let ready = rank_file(&run, 0, "stdout.log");
    while std::fs::read_to_string(&ready)
        .unwrap_or_default()
        .is_empty()
    {
        std::thread::sleep(Duration::from_millis(5));
    }
    println!("READY");
    match ctx.wait_forwarding(
        &signals,
        Some(Duration::from_secs(30)),
        Duration::from_millis(2),
        Duration::from_secs(5),
    ) {
        Waited::Signaled { signal, result } => {
            println!("SIGNALED {signal} worker {:?}", result.exits[&0]);
        }
        other => println!("UNEXPECTED {other:?}"),
    }
}

#[test]
fn a_trapped_signal_is_forwarded_to_the_workers() {
    if std::env::var(ROLE).as_deref() == Ok("forwarder") {
        return forwarder_role();
    }
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let mut launcher = reexec("a_trapped_signal_is_forwarded_to_the_workers", "forwarder")
        .env("RALLY_TEST_DIR", dir.path())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(launcher.stdout.take().unwrap()).lines();
    let mut logs = PathBuf::new();
    loop {
        let l = lines.next().unwrap().unwrap();
        if let Some(p) = l.strip_prefix("LOGS ") {
            logs = PathBuf::from(p);
        }
        if l == "READY" {
            break;
        }
    }
    // SAFETY: a plain syscall.
    unsafe { libc::kill(launcher.id() as i32, libc::SIGTERM) };
    let outcome = lines
        .find_map(|l| {
            l.ok()
                .filter(|l| l.starts_with("SIGNALED") || l.starts_with("UNEXPECTED"))
        })
        .unwrap();
    assert_eq!(outcome, "SIGNALED 15 worker Code(7)");
    assert!(launcher.wait().unwrap().success());
    let out = std::fs::read_to_string(logs.join("attempt_0/0/stdout.log")).unwrap();
    assert_eq!(out, "ready\ngot-term\n");
}

#[test]
fn log_dir_dev_null_turns_files_off() {
    let logs = LogsSpec {
        log_dir: Some("/dev/null".into()),
        redirects: PerRank::All(Std::All),
        ..LogsSpec::default()
    };
    // Exit 4 only if TORCHELASTIC_ERROR_FILE is set and empty, as in PyTorch.
    let spec = sh(&[
        r#"[ "${TORCHELASTIC_ERROR_FILE+set}" = set ] && [ -z "$TORCHELASTIC_ERROR_FILE" ] && exit 4; exit 5"#,
    ]);
    let run = RunLogs::create(&logs, "quiet").unwrap();
    let mut ctx = start_processes(&spec, &logs, &run.attempt(0, 1).unwrap()).unwrap();
    let r = ctx
        .wait(Some(Duration::from_secs(10)), Duration::from_millis(5))
        .unwrap();
    assert_eq!(r.failures[&0].exit, Exit::Code(4));
    assert!(r.failures[&0].error.is_none());
    assert_eq!(run.dir, Path::new("/dev/null"));
}

/// The stalled-console role: tees 20 MB while nobody reads this process's stdout.
fn stalled_console_role() {
    let dir = tempfile::tempdir().unwrap();
    let logs = LogsSpec {
        log_dir: Some(dir.path().to_owned()),
        tee: PerRank::All(Std::Out),
        ..LogsSpec::default()
    };
    let spec = sh(&["yes 123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789 | head -n 200000"]);
    let (mut ctx, run) = start(&spec, &logs);
    let r = ctx
        .wait(Some(Duration::from_secs(60)), Duration::from_millis(5))
        .unwrap();
    let len = std::fs::metadata(rank_file(&run, 0, "stdout.log"))
        .unwrap()
        .len();
    eprintln!("LOGS {}", dir.path().display());
    eprintln!("DONE failed={} bytes={len}", r.is_failed());
    drop((ctx, run));
    dir.close().unwrap(); // exit skips destructors
                          // Exit before the test harness prints to the stdout nobody reads.
    std::process::exit(0);
}

#[test]
fn a_console_nobody_reads_never_blocks_the_workers() {
    if std::env::var(ROLE).as_deref() == Ok("stalled") {
        return stalled_console_role();
    }
    let mut launcher = reexec("a_console_nobody_reads_never_blocks_the_workers", "stalled")
        .stdout(std::process::Stdio::piped()) // never read
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while launcher.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(60) {
            launcher.kill().unwrap();
            panic!("the launcher hung behind its console");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut err = String::new();
    std::io::Read::read_to_string(launcher.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(err.contains("DONE failed=false bytes=20000000"), "{err}");
    assert_logs_removed(&err);
}
