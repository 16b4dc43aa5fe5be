//! Stacks before a stop: the agent reads where each running Python worker is
//! before it stops the group (real Python workers, real gloo), and `rally
//! stacks` reads the same of a running job without stopping it.

use super::*;

/// The 1-based line of `script` holding `text`.
fn line_of_text(script: &Path, text: &str) -> usize {
    std::fs::read_to_string(script)
        .unwrap()
        .lines()
        .position(|l| l.contains(text))
        .unwrap_or_else(|| panic!("{text:?} not in {}", script.display()))
        + 1
}

/// The `stacks.txt` of `local_rank` in the one run under `logs`.
fn stacks_file(logs: &Path, local_rank: usize) -> PathBuf {
    let run = std::fs::read_dir(logs)
        .unwrap()
        .next()
        .expect("a run directory")
        .unwrap()
        .path();
    run.join(format!("attempt_0/{local_rank}/stacks.txt"))
}

/// `rally run` of two workers of `py` logging under `dir/logs`, told
/// `SYNC_DIR=dir`, with `flags`.
fn two_workers(dir: &Path, py: &Path, flags: &[&str]) -> Command {
    let mut c = rally(&["--standalone", "--nproc-per-node", "2"]);
    c.args(flags)
        .arg("--log-dir")
        .arg(dir.join("logs"))
        .arg(py)
        .env("SYNC_DIR", dir);
    c
}

#[test]
fn a_worker_stuck_in_a_named_function_is_dumped_before_it_is_stopped() {
    let py = script("stuck_in_sleep.py");
    let lines: Vec<usize> = ["def wait_forever", "open(os.path.join", "time.sleep(3600)"]
        .iter()
        .map(|t| line_of_text(&py, t))
        .collect();
    let run = |flags: &[&str], name: &str| {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().join("logs");
        let flags = [&["--max-restarts", "0"], flags].concat();
        let c = two_workers(dir.path(), &py, &flags);
        let mut job = Job::spawn(c, dir.path(), name);
        let status = job.wait(LIMIT);
        let log = job.output();
        assert_eq!(status.code(), Some(1), "{log}");
        (dir, logs, log)
    };
    // Rank 0 failed: rank 1 is read where it waits, then stopped.
    let (_dir, logs, log) = run(&[], "dump");
    let file = stacks_file(&logs, 1);
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{e}: {log}"));
    assert!(
        text.starts_with("rank 1 (local_rank 1), pid ")
            && text
                .contains("before it was stopped: local rank 0 on this node failed (exit code 3)"),
        "{text}"
    );
    let at = |line: usize| format!("wait_forever ({}:{line})", py.display());
    // Inside wait_forever: at the marker's line or (most often) the sleep's.
    assert!(lines[1..].iter().any(|&l| text.contains(&at(l))), "{text}");
    assert!(text.contains(&format!("main ({}:", py.display())), "{text}");
    // The summary: the stopped rank, its file, its innermost frames.
    assert!(
        log.contains(
            "Stopped on this node (where each worker was):\n  rank 1 (local_rank: 1, pid: "
        ) && log.contains(&format!(
            "stacks in {}:\n    wait_forever (",
            file.display()
        )),
        "{log}"
    );
    assert!(
        log.contains("read the stacks of 1 of 1 running worker(s)"),
        "{log}"
    );
    assert!(!stacks_file(&logs, 0).exists(), "rank 0 exited by itself");
    // Off: no file, no block.
    let (_dir, logs, log) = run(&["--no-stack-dump"], "off");
    assert!(!stacks_file(&logs, 1).exists(), "{log}");
    assert!(!log.contains("Stopped on this node"), "{log}");
}

#[test]
fn a_signal_dumps_every_worker_and_a_program_that_is_not_python_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let mut c = two_workers(dir.path(), &script("stuck_in_sleep.py"), &[]);
    c.env("FAIL", "0");
    let mut job = Job::spawn(c, dir.path(), "signal");
    wait_for(&dir.path().join("in_wait"), LIMIT);
    job.signal(libc::SIGTERM);
    let status = job.wait(LIMIT);
    let log = job.output();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{log}");
    assert!(
        log.contains("rally run: where each worker was:\n  rank 0"),
        "{log}"
    );
    for rank in [0, 1] {
        let text = std::fs::read_to_string(stacks_file(&logs, rank)).unwrap();
        assert!(
            text.contains("before it was stopped: rally run received SIGTERM"),
            "{text}"
        );
    }
    // Not Python: named, with the reason, and the stop goes on.
    let mut c = rally(&["--standalone", "--nproc-per-node", "2", "--no-python"]);
    c.args([
        "sh",
        "-c",
        "if [ \"$LOCAL_RANK\" = 0 ]; then exit 3; fi; exec sleep 600",
    ]);
    let mut job = Job::spawn(c, dir.path(), "not-python");
    let status = job.wait(LIMIT);
    let log = job.output();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains("read the stacks of 0 of 1 running worker(s)"),
        "{log}"
    );
    assert!(
        log.contains("  rank 1 (local_rank: 1, pid: ") && log.contains("    (stack not read: "),
        "{log}"
    );
}

#[test]
fn a_rank_blocked_in_a_gloo_all_reduce_whose_peer_died_is_dumped_and_rally_stacks_reads_it_live() {
    let py = script("stuck_in_all_reduce.py");
    let call = line_of_text(&py, "    dist.all_reduce(t)\n".trim_end());
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let c = two_workers(dir.path(), &py, &["--max-restarts", "0"]);
    let mut job = Job::spawn(c, dir.path(), "gloo");
    let pid0: u32 = wait_for(&dir.path().join("pid0"), LIMIT)
        .trim()
        .parse()
        .expect("rank 0's pid");
    let pid0 = pid0.to_string();
    // Wait, with `rally stacks` itself, until rank 0 is inside the collective:
    // the job keeps running meanwhile.
    let user_frame = format!("exchange_gradients ({}:{call})", py.display());
    let t0 = Instant::now();
    let live = loop {
        let out = Command::new(env!("CARGO_BIN_EXE_rally"))
            .args(["stacks", &pid0])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if text.contains(&user_frame) && text.contains("all_reduce (") {
            break text;
        }
        assert!(
            t0.elapsed() < LIMIT,
            "rank 0 never seen in the all_reduce: {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        live.contains("on demand (rally stacks; the worker keeps running)"),
        "{live}"
    );
    // The agent's pid names all its workers.
    let out = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["stacks", &job.child.id().to_string()])
        .output()
        .unwrap();
    let both = String::from_utf8_lossy(&out.stdout);
    assert!(
        both.contains("rank 0 (local_rank 0)") && both.contains("rank 1 (local_rank 1)"),
        "{both}"
    );
    // A run id names every worker of the run on this host.
    let log = job.output();
    let run_id = log
        .split("rally run: run ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no run id in {log}"));
    let out = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["stacks", run_id])
        .output()
        .unwrap();
    let by_run = String::from_utf8_lossy(&out.stdout);
    assert!(
        by_run.contains("rank 0 (local_rank 0)") && by_run.contains("rank 1 (local_rank 1)"),
        "{by_run}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["stacks", "no-such-run"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("no worker of run \"no-such-run\" on this host"));
    std::fs::write(dir.path().join("go"), "").unwrap();
    let status = job.wait(LIMIT);
    let log = job.output();
    assert_eq!(status.code(), Some(1), "{log}");
    let text = std::fs::read_to_string(stacks_file(&logs, 0)).unwrap();
    assert!(text.contains(&user_frame), "{text}");
    assert!(
        text.contains("all_reduce (") && text.contains("torch/distributed/distributed_c10d.py"),
        "{text}"
    );
    // The summary shows torch's innermost frames and then the user's.
    let block = &log[log
        .find("Stopped on this node")
        .unwrap_or_else(|| panic!("{log}"))..];
    assert!(block.contains("    all_reduce ("), "{block}");
    assert!(block.contains(&format!("    {user_frame}")), "{block}");
}
