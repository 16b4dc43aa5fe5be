//! Where running Python workers are: their stacks, read from outside.
//!
//! Before the agent stops workers for any reason other than their own exit,
//! it reads the Python stack of every thread of every worker still running
//! (py-spy as a library: it reads the memory of our own children, so workers
//! need no code and no signal handler), and writes each to
//! `<attempt dir>/<local_rank>/stacks.txt`. A hung collective is the most
//! common reason a job is stopped, and the hardest to find; torchrun only says
//! the workers were killed (pytorch#122694).
//!
//! Every worker is read on its own thread, in parallel, and [`dump`] returns
//! at its deadline whatever happened: a worker not read by then is reported
//! as such (its thread finishes in the background and its result is
//! dropped), so a stop is never held up for longer than the budget. A worker
//! that cannot be read (not a Python process, a Python version py-spy does
//! not know, no permission to read its memory) is named with the reason.
//!
//! Each read suspends the process while its memory is read (py-spy's default
//! for `dump`), so the threads' stacks are consistent with each other. Native
//! frames are not read (that needs libunwind); Python frames name the
//! function, file and line.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

/// One Python frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub function: String,
    pub file: String,
    pub line: i32,
}

impl std::fmt::Display for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}:{})", self.function, self.file, self.line)
    }
}

/// One thread of a Python process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Thread {
    /// The OS thread id, when known (the main thread's is the pid).
    pub os_id: Option<u64>,
    pub name: Option<String>,
    /// Running (not blocked in a system call) when read.
    pub active: bool,
    pub owns_gil: bool,
    /// Innermost first.
    pub frames: Vec<Frame>,
}

/// The stacks of one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stacks {
    /// The interpreter's version, e.g. `3.11.9`.
    pub python: String,
    pub threads: Vec<Thread>,
}

/// A worker to read.
#[derive(Debug, Clone)]
pub struct Target {
    pub local_rank: usize,
    /// The job-wide rank, for the reader.
    pub rank: usize,
    pub pid: u32,
    /// Where to write the dump (`None`: not written, as with logs off).
    pub file: Option<PathBuf>,
}

/// What reading one worker gave.
#[derive(Debug, Clone)]
pub struct WorkerStacks {
    pub target: Target,
    /// The stacks, or why they could not be read.
    pub stacks: Result<Stacks, String>,
    /// The file the dump is in, once written.
    pub written: Option<PathBuf>,
}

/// Reads the Python stacks of process `pid` (blocking; the process is
/// suspended while its memory is read).
pub fn read(pid: u32) -> Result<Stacks, String> {
    if !maps_python(pid)? {
        return Err(
            "not a Python process (no python binary or libpython in its memory map)".into(),
        );
    }
    let config = py_spy::Config {
        blocking: py_spy::config::LockingStrategy::Lock,
        native: false,
        ..py_spy::Config::default()
    };
    let mut spy =
        py_spy::PythonSpy::new(pid as py_spy::Pid, &config).map_err(|e| format!("{e:#}"))?;
    let traces = spy.get_stack_traces().map_err(|e| format!("{e:#}"))?;
    let threads = traces
        .into_iter()
        .map(|t| Thread {
            os_id: t.os_thread_id,
            name: t.thread_name,
            active: t.active,
            owns_gil: t.owns_gil,
            frames: t
                .frames
                .into_iter()
                .map(|f| Frame {
                    function: f.name,
                    file: f.filename,
                    line: f.line,
                })
                .collect(),
        })
        .collect();
    Ok(Stacks {
        python: spy.version.to_string(),
        threads,
    })
}

/// Whether `pid` has a Python interpreter mapped (its executable or a
/// `libpython`): a cheap look that spares py-spy's parse of the binaries of
/// workers that are not Python.
fn maps_python(pid: u32) -> Result<bool, String> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(|e| format!("cannot read its memory map: {e}"))?;
    Ok(maps.lines().any(|l| {
        l.rsplit('/')
            .next()
            .is_some_and(|name| name.starts_with("python") || name.starts_with("libpython"))
    }))
}

/// Reads every target in parallel and writes each dump to its file, returning
/// by `budget` at the latest; a target not read by then is reported as not
/// read in time. In target order.
pub fn dump(targets: Vec<Target>, budget: Duration, why: &str) -> Vec<WorkerStacks> {
    dump_with(targets, budget, why, read)
}

fn dump_with(
    targets: Vec<Target>,
    budget: Duration,
    why: &str,
    read: fn(u32) -> Result<Stacks, String>,
) -> Vec<WorkerStacks> {
    let deadline = Instant::now() + budget;
    let (tx, rx) = mpsc::channel();
    let mut got: Vec<Option<WorkerStacks>> = vec![None; targets.len()];
    for (i, target) in targets.iter().cloned().enumerate() {
        let (tx, why) = (tx.clone(), why.to_owned());
        let spawned = std::thread::Builder::new()
            .name(format!("stacks-{}", target.pid))
            .spawn(move || {
                let stacks = read(target.pid);
                let mut w = WorkerStacks {
                    target,
                    stacks,
                    written: None,
                };
                w.write(&why);
                let _ = tx.send((i, w));
            });
        if let Err(e) = spawned {
            got[i] = Some(WorkerStacks {
                target: targets[i].clone(),
                stacks: Err(format!("cannot start a thread to read it: {e}")),
                written: None,
            });
        }
    }
    drop(tx);
    while got.iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((i, w)) => got[i] = Some(w),
            Err(_) => break,
        }
    }
    got.into_iter()
        .zip(targets)
        .map(|(w, target)| {
            w.unwrap_or_else(|| WorkerStacks {
                target,
                stacks: Err(format!("not read within {budget:?}")),
                written: None,
            })
        })
        .collect()
}

/// Whether a frame is the interpreter's or a library's, not the user's code.
fn is_library(f: &Frame) -> bool {
    f.file.contains("/site-packages/")
        || f.file.contains("/dist-packages/")
        || f.file.contains("/lib/python3")
        || f.file.starts_with('<')
}

impl Stacks {
    /// The thread that runs the script: the one named `MainThread`, else the
    /// one whose id is the pid, else the first.
    pub fn main_thread(&self, pid: u32) -> Option<&Thread> {
        self.threads
            .iter()
            .find(|t| t.name.as_deref() == Some("MainThread"))
            .or_else(|| self.threads.iter().find(|t| t.os_id == Some(pid.into())))
            .or_else(|| self.threads.first())
    }
}

impl WorkerStacks {
    /// Where the worker was, in a few lines: the main thread's innermost
    /// frames, and the innermost frame of the user's own code when the
    /// innermost ones are a library's (a collective inside torch).
    pub fn stuck_frames(&self, innermost: usize) -> Vec<String> {
        let stacks = match &self.stacks {
            Ok(s) => s,
            Err(e) => return vec![format!("(stack not read: {e})")],
        };
        let Some(main) = stacks.main_thread(self.target.pid) else {
            return vec!["(no Python thread)".to_owned()];
        };
        let mut lines: Vec<String> = main
            .frames
            .iter()
            .take(innermost)
            .map(Frame::to_string)
            .collect();
        if let Some((i, user)) = main.frames.iter().enumerate().find(|(_, f)| !is_library(f)) {
            if i >= innermost {
                lines.push("...".to_owned());
                lines.push(user.to_string());
            }
        }
        if lines.is_empty() {
            lines.push("(no Python frame: the interpreter is starting or ending)".to_owned());
        }
        lines
    }

    /// The dump as `stacks.txt` holds it (py-spy's `dump` layout, with the
    /// rank and `why` first: "before it was stopped (...)").
    pub fn render(&self, why: &str) -> String {
        use std::fmt::Write;
        let t = &self.target;
        let mut s = String::new();
        let when = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let _ = writeln!(
            s,
            "rank {} (local_rank {}), pid {}, read at {} {why}",
            t.rank,
            t.local_rank,
            t.pid,
            crate::time::format_time(when)
        );
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", t.pid))
            .map(|b| {
                String::from_utf8_lossy(&b)
                    .trim_end_matches('\0')
                    .replace('\0', " ")
            })
            .unwrap_or_default();
        let _ = writeln!(s, "Process {}: {cmdline}", t.pid);
        match &self.stacks {
            Err(e) => {
                let _ = writeln!(s, "\nThe stack could not be read: {e}");
            }
            Ok(stacks) => {
                let _ = writeln!(s, "Python v{}", stacks.python);
                for th in &stacks.threads {
                    let state = match (th.active, th.owns_gil) {
                        (true, true) => "active+gil",
                        (true, false) => "active",
                        (false, true) => "idle+gil",
                        (false, false) => "idle",
                    };
                    let id = th.os_id.map_or("?".to_owned(), |i| i.to_string());
                    let name = match th.name.as_deref() {
                        Some(n) if !n.is_empty() => format!(": {n:?}"),
                        _ => String::new(),
                    };
                    let _ = writeln!(s, "\nThread {id} ({state}){name}");
                    for f in &th.frames {
                        let _ = writeln!(s, "    {f}");
                    }
                }
            }
        }
        s
    }

    /// Writes [`Self::render`] to the target's file, if it has one.
    fn write(&mut self, why: &str) {
        let Some(file) = &self.target.file else {
            return;
        };
        match std::fs::write(file, self.render(why)) {
            Ok(()) => self.written = Some(file.clone()),
            Err(e) => {
                tracing::warn!(file = %file.display(), error = %e, "cannot write a stack dump")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(function: &str, file: &str, line: i32) -> Frame {
        Frame {
            function: function.into(),
            file: file.into(),
            line,
        }
    }

    fn worker(frames: Vec<Frame>) -> WorkerStacks {
        WorkerStacks {
            target: Target {
                local_rank: 0,
                rank: 3,
                pid: 42,
                file: None,
            },
            stacks: Ok(Stacks {
                python: "3.11.9".into(),
                threads: vec![
                    Thread {
                        os_id: Some(43),
                        name: Some("pin_memory".into()),
                        active: false,
                        owns_gil: false,
                        frames: vec![frame("wait", "/usr/lib/python3.11/threading.py", 320)],
                    },
                    Thread {
                        os_id: Some(42),
                        name: Some("MainThread".into()),
                        active: false,
                        owns_gil: false,
                        frames,
                    },
                ],
            }),
            written: None,
        }
    }

    #[test]
    fn the_user_frame_under_a_library_collective_is_shown() {
        let torch = "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py";
        let w = worker(vec![
            frame("all_reduce", torch, 2500),
            frame("wrapper", torch, 80),
            frame("train_step", "/job/train.py", 12),
            frame("<module>", "/job/train.py", 30),
        ]);
        assert_eq!(
            w.stuck_frames(2),
            [
                format!("all_reduce ({torch}:2500)"),
                format!("wrapper ({torch}:80)"),
                "...".to_owned(),
                "train_step (/job/train.py:12)".to_owned(),
            ]
        );
        // The user's frame already among the innermost: no repeat.
        assert_eq!(w.stuck_frames(3).len(), 3);
        let text = w.render("another rank failed");
        assert!(text.contains("rank 3 (local_rank 0), pid 42"), "{text}");
        assert!(text.contains("Thread 42 (idle): \"MainThread\"\n    all_reduce"));
    }

    #[test]
    fn an_unreadable_worker_is_named_with_the_reason() {
        let mut w = worker(vec![]);
        assert_eq!(
            w.stuck_frames(3),
            ["(no Python frame: the interpreter is starting or ending)"]
        );
        w.stacks = Err("Failed to find python version from target process".into());
        assert_eq!(
            w.stuck_frames(3),
            ["(stack not read: Failed to find python version from target process)"]
        );
        assert!(w.render("x").contains("could not be read: Failed to find"));
    }

    #[test]
    fn a_process_that_is_not_python_is_named_and_the_dump_keeps_to_its_budget() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("stacks.txt");
        let target = Target {
            local_rank: 0,
            rank: 0,
            pid: child.id(),
            file: Some(file.clone()),
        };
        let got = dump(vec![target], Duration::from_secs(5), "test");
        let _ = child.kill();
        let _ = child.wait();
        let err = got[0].stacks.as_ref().unwrap_err();
        assert_eq!(
            err,
            "not a Python process (no python binary or libpython in its memory map)"
        );
        assert_eq!(got[0].written.as_deref(), Some(file.as_path()));
        assert!(std::fs::read_to_string(&file)
            .unwrap()
            .contains("could not be read"));
        // A reader that never returns: the dump returns at its deadline,
        // naming what was not read.
        fn stuck(_: u32) -> Result<Stacks, String> {
            loop {
                std::thread::park();
            }
        }
        let t0 = Instant::now();
        let got = dump_with(
            vec![Target {
                local_rank: 1,
                rank: 1,
                pid: 1,
                file: None,
            }],
            Duration::from_millis(50),
            "test",
            stuck,
        );
        assert!(t0.elapsed() >= Duration::from_millis(50));
        assert_eq!(got[0].stacks.as_ref().unwrap_err(), "not read within 50ms");
    }
}
