//! Drop-in fidelity: what a torchrun user sees, checked against torchrun where
//! torchrun can run here. Workers on a terminal (a pseudo-terminal), the static
//! backend's addresses, the failure summary and the launcher's error file, the
//! interpreter, logs, and flags.

use super::*;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::process::CommandExt;
use std::sync::{Arc, Mutex};

/// A process whose stdin, stdout and stderr are a pseudo-terminal that is its
/// controlling terminal, as in an interactive shell.
struct Pty {
    child: Child,
    master: std::fs::File,
    out: Arc<Mutex<Vec<u8>>>,
}

impl Pty {
    fn spawn(mut cmd: Command) -> Pty {
        let (mut m, mut s) = (0, 0);
        // SAFETY: out-pointers to two ints; the rest may be null.
        let r = unsafe {
            libc::openpty(
                &mut m,
                &mut s,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(r, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: openpty returned two fresh descriptors we now own.
        let (master, slave) =
            unsafe { (std::fs::File::from_raw_fd(m), std::fs::File::from_raw_fd(s)) };
        // Neither may leak into the launcher's other children (the child's
        // 0, 1 and 2 are dups, which do not inherit the flag).
        for fd in [&master, &slave] {
            // SAFETY: fcntl on a descriptor we own.
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
        }
        cmd.stdin(slave.try_clone().unwrap())
            .stdout(slave.try_clone().unwrap())
            .stderr(slave);
        // SAFETY: setsid and ioctl are async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                if libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        drop(cmd);
        let out = Arc::new(Mutex::new(Vec::new()));
        let (mut reader, sink) = (master.try_clone().unwrap(), out.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // Ends with EIO once every process on the terminal has closed it.
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Pty { child, master, out }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.out.lock().unwrap()).into_owned()
    }

    /// Waits until the terminal has shown `needle` (the limit only bounds a
    /// failing test).
    fn wait_for(&self, needle: &str, limit: Duration) {
        let t0 = Instant::now();
        while !self.text().contains(needle) {
            assert!(
                t0.elapsed() < limit,
                "no {needle:?} on the terminal after {limit:?}:\n{}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn type_line(&mut self, line: &str) {
        self.master.write_all(line.as_bytes()).unwrap();
        self.master.write_all(b"\n").unwrap();
    }

    fn wait(&mut self, limit: Duration) -> ExitStatus {
        let out = self.out.clone();
        wait_or_kill(&mut self.child, limit, || {
            String::from_utf8_lossy(&out.lock().unwrap()).into_owned()
        })
    }
}

impl Drop for Pty {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a user at the terminal sees of `tty_probe.py` under a launcher.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    /// The worker's `PROBE` line, with whatever precedes it on its line.
    probe: String,
    /// What precedes the progress text on its line (the prefix, if any).
    progress_prefix: String,
    /// The line the worker read from the terminal, as shown.
    got: String,
}

/// The text on the terminal line holding `marker`, from the start of that line
/// (after the last `\n` or `\r` before it) to its end.
fn line_of(text: &str, marker: &str) -> String {
    let at = text
        .find(marker)
        .unwrap_or_else(|| panic!("no {marker:?} in {text}"));
    let start = text[..at].rfind(['\n', '\r']).map_or(0, |i| i + 1);
    let end = text[at..].find(['\n', '\r']).map_or(text.len(), |i| at + i);
    text[start..end].to_owned()
}

/// Runs the probe under `cmd` on a terminal: waits for the progress update to
/// show before the worker has written any newline after it, types a line, and
/// collects what was shown.
fn probe(cmd: Command) -> Seen {
    let mut pty = Pty::spawn(cmd);
    // The progress update must reach the terminal while the worker waits for
    // input, before it ever writes a newline after it.
    pty.wait_for("PROGRESS 50%", LIMIT);
    pty.type_line("go");
    pty.wait_for("GOT go", LIMIT);
    let status = pty.wait(LIMIT);
    let text = pty.text();
    assert!(status.success(), "{text}");
    let progress = line_of(&text, "PROGRESS 50%");
    Seen {
        probe: line_of(&text, "PROBE "),
        progress_prefix: progress[..progress.find("PROGRESS").unwrap()].to_owned(),
        got: line_of(&text, "GOT go"),
    }
}

fn torchrun(args: &[&str]) -> Command {
    let mut c = Command::new(python());
    c.args(["-m", "torch.distributed.run"]).args(args);
    c
}

#[test]
fn on_a_terminal_workers_see_it_as_under_torchrun_and_tee_prefixes_as_torchrun() {
    let probe_py = script("tty_probe.py");
    let probe_py = probe_py.to_str().unwrap();
    let base = ["--standalone", "--nproc-per-node", "1"];
    // Nothing asks for capture: the worker has the terminal itself.
    let mut ours = rally(&base);
    ours.arg(probe_py);
    let ours = probe(ours);
    assert_eq!(
        ours,
        Seen {
            probe: "PROBE stdin=T stdout=T stderr=T".into(),
            progress_prefix: String::new(),
            got: "GOT go".into(),
        }
    );
    // -t 3: output goes through files (torchrun) or pipes (rally run), and
    // every console line is prefixed; stdin is still the terminal.
    let mut ours_tee = rally(&[&base[..], &["-t", "3"]].concat());
    ours_tee.arg(probe_py);
    let ours_tee = probe(ours_tee);
    assert_eq!(
        ours_tee,
        Seen {
            probe: "[default0]:PROBE stdin=T stdout=F stderr=F".into(),
            progress_prefix: "[default0]:".into(),
            got: "[default0]:GOT go".into(),
        }
    );
    // torchrun, run the same way, shows the same.
    let mut theirs = torchrun(&base);
    theirs.arg(probe_py);
    assert_eq!(probe(theirs), ours, "default stdio differs from torchrun's");
    let mut theirs_tee = torchrun(&[&base[..], &["-t", "3"]].concat());
    theirs_tee.arg(probe_py);
    assert_eq!(probe(theirs_tee), ours_tee, "-t 3 differs from torchrun's");
}

#[test]
fn a_prefix_template_with_hostname_applies_to_teed_lines() {
    let dir = tempfile::tempdir().unwrap();
    let host = rallypoint_elastic::multiprocessing::hostname();
    let mut c = rally(&[
        "--standalone",
        "--nproc-per-node",
        "2",
        "--tee",
        "1",
        "--log-line-prefix-template",
        "${hostname}:${rank}: ",
        "--no-python",
        "sh",
        "-c",
        "echo out-$RANK; echo err-$RANK >&2",
    ]);
    c.env_remove("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE");
    let mut job = Job::spawn(c, dir.path(), "job");
    assert!(job.wait(LIMIT).success(), "{}", job.output());
    let log = job.output();
    for r in 0..2 {
        assert!(log.contains(&format!("{host}:{r}: out-{r}\n")), "{log}");
        // stderr is not teed: inherited as is, unprefixed.
        assert!(log.lines().any(|l| l == format!("err-{r}")), "{log}");
    }
}

/// Issue 19: Ctrl-C keeps exit code 130 and, when the launcher was given
/// `TORCHELASTIC_ERROR_FILE`, leaves torchrun's `SignalException` record there.
/// Real torchrun is stopped the same way, and both files have the same layout.
#[test]
fn ctrl_c_leaves_torchruns_signal_exception_in_the_launchers_error_file() {
    let dir = tempfile::tempdir().unwrap();
    let record = |mut c: Command, name: &str| {
        let file = dir.path().join(format!("{name}.json"));
        let started = dir.path().join(format!("{name}.started"));
        c.env("TORCHELASTIC_ERROR_FILE", &file).args([
            "sh",
            "-c",
            &format!("touch {}; sleep 600", started.display()),
        ]);
        let mut job = Job::spawn(c, dir.path(), name);
        let t0 = Instant::now();
        while !started.exists() {
            assert!(t0.elapsed() < LIMIT, "{}", job.output());
            std::thread::sleep(Duration::from_millis(20));
        }
        job.signal(libc::SIGINT);
        let status = job.wait(LIMIT);
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{name}: no error file ({e}): {}", job.output()));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        (status, v)
    };
    let base = ["--standalone", "--nproc-per-node", "1", "--no-python"];
    let (ours, mine) = record(rally(&base), "rally");
    let (_, theirs) = record(torchrun(&base), "torchrun");
    assert_eq!(ours.code(), Some(130));
    let keys = |v: &serde_json::Value| {
        let m = &v["message"];
        let mut k: Vec<String> = m.as_object().unwrap().keys().cloned().collect();
        k.extend(m["extraInfo"].as_object().unwrap().keys().cloned());
        k.sort();
        k
    };
    assert_eq!(keys(&mine), keys(&theirs), "{mine}\n{theirs}");
    for v in [&mine, &theirs] {
        let msg = v["message"]["message"].as_str().unwrap();
        let (pid, sig) = msg
            .strip_prefix("SignalException: Process ")
            .and_then(|r| r.split_once(" got signal: "))
            .unwrap_or_else(|| panic!("{msg}"));
        assert!(pid.parse::<u32>().is_ok() && sig == "2", "{msg}");
        let ts = v["message"]["extraInfo"]["timestamp"].as_str().unwrap();
        assert!(ts.parse::<u64>().is_ok(), "{v}");
    }
}

/// Issue 19: `$name` and `$$` expand as in torchrun's `string.Template`, and
/// a worker's `\r\n` is one line ending on the teed console, even when the
/// `\r` and the `\n` arrive in two reads.
#[test]
fn teed_crlf_is_one_line_ending_and_dollar_templates_expand() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = rally(&[
        "--standalone",
        "--nproc-per-node",
        "1",
        "--tee",
        "1",
        "--log-line-prefix-template",
        "$$r$rank: ",
        "--no-python",
        "sh",
        "-c",
        r"printf 'one\r\n'; printf 'two\r'; sleep 0.3; printf '\nthree\r\n'",
    ]);
    c.env_remove("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE");
    let mut job = Job::spawn(c, dir.path(), "job");
    assert!(job.wait(LIMIT).success(), "{}", job.output());
    let log = job.output();
    assert!(
        log.contains("$r0: one\r\n$r0: two\r\n$r0: three\r\n"),
        "{log:?}"
    );
}

#[test]
fn static_backend_workers_get_the_master_address_and_port_and_the_store_listens_there() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let p = port.to_string();
    let check = format!(
        r#"[ "$MASTER_ADDR" = 127.0.0.1 ] && [ "$MASTER_PORT" = {port} ] || {{ echo "MASTER $MASTER_ADDR:$MASTER_PORT" >&2; exit 7; }}; {py} -c "import torch.distributed as d; s=d.TCPStore('127.0.0.1', {port}, is_master=False); s.set('node$GROUP_RANK', 'x'); s.wait(['node0', 'node1'])""#,
        py = python().display()
    );
    let node = |rank: &str| {
        let mut c = rally(&[
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &p,
            "--no-python",
            "sh",
            "-c",
            &check,
        ]);
        c.env("RALLY_LOG", "info");
        Job::spawn(c, dir.path(), &format!("node{rank}"))
    };
    let (mut a, mut b) = (node("0"), node("1"));
    let (sa, sb) = (a.wait(LIMIT), b.wait(LIMIT));
    let both = format!("{}\n---\n{}", a.output(), b.output());
    assert!(sa.success() && sb.success(), "{both}");
    // No warning about a missing --rdzv-id (torchrun has none for static),
    // and no colour codes in a log file.
    assert!(!both.contains("rdzv-id"), "{both}");
    assert!(!both.contains('\x1b'), "ANSI codes in a log file: {both:?}");

    // The port taken: a clear error, exit code 3, no worker started.
    let taken = std::net::TcpListener::bind(("0.0.0.0", 0)).unwrap();
    let taken_port = taken.local_addr().unwrap().port().to_string();
    let mut c = rally(&[
        "--master-port",
        &taken_port,
        "--no-python",
        "sh",
        "-c",
        "exit 9",
    ]);
    c.env("RALLY_LOG", "info");
    let mut job = Job::spawn(c, dir.path(), "taken");
    let status = job.wait(LIMIT);
    let log = job.output();
    assert_eq!(status.code(), Some(3), "{log}");
    assert!(log.contains("Address already in use"), "{log}");
    assert!(log.contains("--master-port"), "{log}");
}

#[test]
fn the_summary_shows_the_traceback_and_the_launchers_error_file_holds_the_root_cause_as_torchruns()
{
    let dir = tempfile::tempdir().unwrap();
    let run = |mut c: Command, name: &str| {
        let file = dir.path().join(format!("{name}-error.json"));
        c.arg(script("raise_after.py"))
            .env("RAISE_AFTER", "0")
            .env("TORCHELASTIC_ERROR_FILE", &file);
        let mut job = Job::spawn(c, dir.path(), name);
        let status = job.wait(LIMIT);
        let log = job.output();
        assert_ne!(status.code(), Some(0), "{log}");
        let json: Value = serde_json::from_str(
            &std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{e}: {log}")),
        )
        .unwrap();
        (log, json)
    };
    let (log, ours) = run(rally(&["--standalone"]), "rally");
    assert!(log.contains("raise_after.py FAILED"), "{log}");
    assert!(
        log.contains("traceback : Traceback (most recent call last):"),
        "{log}"
    );
    assert!(
        log.contains("RuntimeError: the host's worker broke on purpose"),
        "{log}"
    );
    assert!(log.contains("exitcode  : 1 (pid: "), "{log}");
    assert!(log.contains("attempt_0/0/error.json"), "{log}");
    let (_, theirs) = run(torchrun(&["--standalone"]), "torchrun");
    for v in [&ours, &theirs] {
        assert_eq!(
            v["message"]["message"], "RuntimeError: the host's worker broke on purpose",
            "{v}"
        );
        assert_eq!(v["message"]["errorCode"], 1, "{v}");
        let tb = v["message"]["extraInfo"]["py_callstack"].as_str().unwrap();
        assert!(tb.contains("raise RuntimeError"), "{v}");
    }
}

#[test]
fn without_python_exec_a_python_beside_rally_runs_the_script() {
    let dir = tempfile::tempdir().unwrap();
    // A venv-like bin directory: rally (a copy: the executable's own directory
    // counts, not a symlink's) and a `python`.
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_rally"), bin.join("rally")).unwrap();
    std::os::unix::fs::symlink(python(), bin.join("python")).unwrap();
    let out = dir.path().join("exe.txt");
    std::fs::write(
        dir.path().join("which.py"),
        format!(
            "import sys\nopen({:?}, 'w').write(sys.executable)\n",
            out.to_str().unwrap()
        ),
    )
    .unwrap();
    let mut c = Command::new(bin.join("rally"));
    c.args(["run", "--standalone"])
        .arg(dir.path().join("which.py"))
        .env_remove("PYTHON_EXEC")
        // No python3 to be found on PATH: only the one beside rally.
        .env("PATH", "/nonexistent");
    let mut job = Job::spawn(c, dir.path(), "job");
    assert!(job.wait(LIMIT).success(), "{}", job.output());
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        bin.join("python").to_str().unwrap()
    );
}

#[test]
fn a_missing_module_names_the_interpreter_why_it_was_chosen_and_how_to_choose_another() {
    let dir = tempfile::tempdir().unwrap();
    // python3 on PATH is the only interpreter rally can find.
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::os::unix::fs::symlink(python(), bin.join("python3")).unwrap();
    let train = dir.path().join("train.py");
    std::fs::write(&train, "import os\nimport no_such_module_xyz\n").unwrap();
    let run = |flags: &[&str], python_exec: bool, name: &str| {
        let mut c = rally(&["--standalone", "--max-restarts", "0"]);
        if !flags.is_empty() {
            c.arg("--log-dir")
                .arg(dir.path().join(format!("logs-{name}")));
        }
        c.args(flags).arg(&train);
        if python_exec {
            c.env("PYTHON_EXEC", bin.join("python3"));
        } else {
            c.env_remove("PYTHON_EXEC").env("PATH", &bin);
        }
        let mut job = Job::spawn(c, dir.path(), name);
        let status = job.wait(LIMIT);
        let log = job.output();
        assert_eq!(status.code(), Some(1), "{log}");
        log
    };
    let chosen = format!(
        "the workers ran {} (PYTHON_EXEC is not set, and there is no python beside this rally ({}), so python3 was taken from PATH)",
        bin.join("python3").display(),
        env!("CARGO_BIN_EXE_rally")
    );
    // stderr in a file (-r) or teed (-t): rally reads the traceback itself.
    for (flags, name) in [(["-r", "3"], "r"), (["-t", "3"], "t")] {
        let log = run(&flags, false, name);
        assert!(
            log.contains("traceback : (the last traceback in ")
                && log.contains("stderr.log; the worker wrote no error file)"),
            "{log}"
        );
        assert!(log.contains("    import no_such_module_xyz"), "{log}");
        assert!(
            log.contains(&format!("{chosen}, and it has no module 'no_such_module_xyz'. Choose the interpreter with PYTHON_EXEC")),
            "{log}"
        );
    }
    // stderr on the console: rally cannot see the traceback; it names the
    // interpreter and leaves the reading to the user.
    let log = run(&[], false, "inherit");
    assert!(
        log.contains("ModuleNotFoundError: No module named 'no_such_module_xyz'"),
        "{log}"
    );
    assert!(
        log.contains(&format!(
            "{chosen}; if the traceback above is a ModuleNotFoundError, set PYTHON_EXEC"
        )),
        "{log}"
    );
    // The user chose: no advice.
    let log = run(&["-r", "3"], true, "chosen");
    assert!(
        log.contains("No module named 'no_such_module_xyz'"),
        "{log}"
    );
    assert!(!log.contains("the workers ran"), "{log}");
}

#[test]
fn flags_torchrun_has_are_listed_completed_or_refused_clearly() {
    let help = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["run", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--nproc_per_node",
        "--rdzv_backend",
        "--log-line-prefix-template",
        "--log_line_prefix_template",
        "--print-completion",
        "--numa_binding",
    ] {
        assert!(help.contains(flag), "{flag} not in --help:\n{help}");
    }
    for (shell, needle) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef rally"),
        ("tcsh", "complete rally"),
        ("fish", "complete -c rally"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_rally"))
            .args(["run", "--print_completion", shell])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{shell}");
        assert!(text.contains(needle), "{shell}: {text}");
        assert!(text.contains("nproc-per-node"), "{shell}: {text}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["run", "--numa-binding", "nearest", "train.py"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("[possible values: node, socket, exclusive, core-complex]"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["run", "--nproc-per-node", "gpu", "train.py"])
        .env("CUDA_VISIBLE_DEVICES", "")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("CUDA_VISIBLE_DEVICES=\"\""), "{err}");
}

/// The launcher's own lines reach a console shared with the workers (their
/// stderr is inherited) in one write each, so a worker's output never lands
/// mid-line in them. `eprintln!` writes each formatted piece separately: CI
/// once saw "rally run: round 0 formed: node err-1" with a worker's "err-1"
/// inside. Here stderr is a datagram socket, which keeps every write apart.
#[test]
fn the_launchers_lines_are_written_whole() {
    use std::io::ErrorKind;
    use std::os::unix::net::UnixDatagram;
    let (ours, theirs) = UnixDatagram::pair().unwrap();
    let mut c = rally(&[
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-python",
        "sh",
        "-c",
        "exit 0",
    ]);
    c.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::from(std::os::fd::OwnedFd::from(
            theirs,
        )));
    /// Kills rally if the test fails before it ends.
    struct Reaped(std::process::Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Reaped(c.spawn().unwrap());
    drop(c); // our copy of the child's end
    ours.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut writes = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        match ours.recv(&mut buf) {
            Ok(k) => writes.push(String::from_utf8_lossy(&buf[..k]).into_owned()),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if let Some(s) = child.0.try_wait().unwrap() {
                    break s;
                }
                assert!(Instant::now() < deadline, "rally run did not end");
            }
            Err(e) => panic!("reading rally's stderr: {e}"),
        }
    };
    // What it wrote just before it ended.
    ours.set_nonblocking(true).unwrap();
    while let Ok(k) = ours.recv(&mut buf) {
        writes.push(String::from_utf8_lossy(&buf[..k]).into_owned());
    }
    assert!(status.success(), "{writes:?}");
    let ours: Vec<&String> = writes
        .iter()
        .filter(|w| w.starts_with("rally run"))
        .collect();
    assert!(ours.len() >= 3, "{writes:?}");
    for w in &ours {
        assert!(
            w.ends_with('\n') && w.matches('\n').count() == 1,
            "a launcher line in pieces: {w:?} (all writes: {writes:?})"
        );
    }
    for w in &writes {
        assert!(
            w.ends_with('\n'),
            "a write that ends mid-line: {w:?} (all writes: {writes:?})"
        );
    }
}
