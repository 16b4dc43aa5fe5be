//! Nothing outlives the agent, even when it is killed with SIGKILL.
//!
//! Process groups and `PR_SET_PDEATHSIG` reach a worker and the children that
//! stay in its group; a child that calls `setsid`, or double-forks away from a
//! dead parent, escapes both. So every worker gets a mark in its environment
//! (`RALLY_AGENT_MARK=<agent pid>-<random>`), which every descendant inherits
//! whatever it does with sessions and groups, and two things kill by mark:
//!
//! - the agent itself, after each stop of a worker group ([`kill_marked`]);
//! - a **watchdog**, a small child process of the agent started by re-executing
//!   the current binary ([`spawn`]; the binary's `main` must call [`dispatch`]
//!   first). It sits in its own process group, ignores the terminal's and the
//!   scheduler's signals, and blocks reading a pipe from the agent. The kernel
//!   closes that pipe when the agent dies for any reason, SIGKILL included; the
//!   watchdog then kills every marked process, rescanning `/proc` until none is
//!   left (bounded), and exits. When the agent ends normally it closes the pipe
//!   too, and the sweep finds nothing.
//!
//! What this does not cover: a descendant that clears its environment (`env -i`)
//! or runs as another user, and a SIGKILL that reaches the watchdog itself (e.g.
//! an OOM kill of the watchdog). A cgroup would cover those where one can be
//! created; see the README.

use std::io::Read;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// The environment variable that marks a worker and all its descendants.
pub const MARK_ENV: &str = "RALLY_AGENT_MARK";
/// Set on the re-executed binary to make it a watchdog for that mark.
const WATCHDOG_ENV: &str = "RALLY_WATCHDOG_FOR";

/// A fresh mark for this agent: its pid and 64 random bits.
pub fn new_mark() -> String {
    let mut r = [0u8; 8];
    // SAFETY: getrandom writes at most r.len() bytes into r.
    let n = unsafe { libc::getrandom(r.as_mut_ptr().cast(), r.len(), 0) };
    let random = if n == 8 {
        u64::from_ne_bytes(r)
    } else {
        // No getrandom: the time is unique enough next to the pid.
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    };
    format!("{}-{random:016x}", std::process::id())
}

/// Pids of live processes (not zombies) whose environment holds `MARK_ENV=mark`,
/// other than this one.
pub fn marked(mark: &str) -> Vec<u32> {
    let entry = format!("{MARK_ENV}={mark}");
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut buf = Vec::new();
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            buf.clear();
            std::fs::File::open(format!("/proc/{pid}/environ"))
                .and_then(|mut f| f.read_to_end(&mut buf))
                .is_ok()
                && buf.split(|&b| b == 0).any(|v| v == entry.as_bytes())
        })
        .collect()
}

/// SIGKILLs every marked process, rescanning until none is left or `limit`
/// passes (processes may fork while being killed). Returns those still there.
pub fn kill_marked(mark: &str, limit: Duration) -> Vec<u32> {
    let deadline = Instant::now() + limit;
    loop {
        let found = marked(mark);
        if found.is_empty() || Instant::now() >= deadline {
            return found;
        }
        for &pid in &found {
            // SAFETY: signalling a process that carries our mark.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A running watchdog. Dropping it closes the pipe: the watchdog sweeps and
/// exits (it is reaped in the background of the drop, never waited on).
pub struct Watchdog {
    child: Child,
    pipe: Option<ChildStdin>,
}

impl Watchdog {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Watchdog {
    /// Closes the pipe and reaps the watchdog once its sweep is done, waiting
    /// at most 200 ms (it is re-parented if it takes longer).
    fn drop(&mut self) {
        self.pipe.take();
        let deadline = Instant::now() + Duration::from_millis(200);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Starts a watchdog for `mark` by re-executing the current binary, whose
/// `main` must call [`dispatch`] before anything else.
pub fn spawn(mark: &str) -> std::io::Result<Watchdog> {
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .env(WATCHDOG_ENV, mark)
        .env_remove(MARK_ENV)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()?;
    let pipe = child.stdin.take();
    Ok(Watchdog { child, pipe })
}

/// In a binary that may be re-executed as a watchdog: if this process is one,
/// watch and exit; otherwise return at once.
pub fn dispatch() {
    let Some(mark) = std::env::var_os(WATCHDOG_ENV) else {
        return;
    };
    let mark = mark.to_string_lossy().into_owned();
    // SAFETY: ignoring signals and leaving the agent's process group, before any
    // thread exists in this process.
    unsafe {
        for sig in [
            libc::SIGINT,
            libc::SIGTERM,
            libc::SIGHUP,
            libc::SIGQUIT,
            libc::SIGUSR1,
            libc::SIGUSR2,
            libc::SIGPIPE,
            libc::SIGTSTP,
            libc::SIGTTIN,
            libc::SIGTTOU,
        ] {
            libc::signal(sig, libc::SIG_IGN);
        }
        libc::setpgid(0, 0);
    }
    // Blocks until the agent closes the pipe or dies.
    let mut sink = [0u8; 64];
    let mut stdin = std::io::stdin();
    while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
    let left = kill_marked(&mark, Duration::from_secs(2));
    if !left.is_empty() {
        eprintln!("rally watchdog: processes {left:?} survived SIGKILL (stuck in the kernel?)");
    }
    std::process::exit(0);
}
