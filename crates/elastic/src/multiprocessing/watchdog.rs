//! Nothing outlives the agent, even when it is killed with SIGKILL.
//!
//! Process groups and `PR_SET_PDEATHSIG` reach a worker and the children that
//! stay in its group; a child that calls `setsid`, or double-forks away from a
//! dead parent, escapes both. So every worker gets a mark in its environment
//! (`RALLY_AGENT_MARK=<agent pid>-<random>`), which every descendant inherits
//! whatever it does with sessions and groups, and two things kill by mark:
//!
//! - the agent itself, after each stop of a worker group ([`kill_marked`]);
//! - a **watchdog**, a small child process of the agent, forked before the
//!   agent starts any thread ([`fork`]: no exec, about a tenth of a
//!   millisecond; a program embedding the agent calls it first thing, before
//!   its runtime). It sits in its own process group, ignores the terminal's and the
//!   scheduler's signals, and blocks reading a pipe from the agent. The kernel
//!   closes that pipe when the agent dies for any reason, SIGKILL included; the
//!   watchdog then kills every marked process, rescanning `/proc` until none is
//!   left (bounded), and exits. When the agent ends normally it has swept
//!   itself; it writes one byte to say so ([`Watchdog::release`]) and the
//!   watchdog exits without sweeping.
//!
//! What this does not cover: a descendant that clears its environment (`env -i`)
//! or runs as another user, and a SIGKILL that reaches the watchdog itself (e.g.
//! an OOM kill of the watchdog). A cgroup would cover those where one can be
//! created; see `docs/rally-run.md`.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// The environment variable that marks a worker and all its descendants.
pub const MARK_ENV: &str = "RALLY_AGENT_MARK";

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
/// exits; [`Watchdog::release`] lets it exit without sweeping.
pub struct Watchdog {
    pid: u32,
    pipe: Option<File>,
}

impl Watchdog {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The agent ended normally and killed its marked processes itself: the
    /// watchdog exits without a sweep (and is reaped by whoever inherits it).
    pub fn release(mut self) {
        if let Some(mut pipe) = self.pipe.take() {
            let _ = pipe.write_all(RELEASE);
        }
        self.reap();
    }

    fn reap(&self) {
        // SAFETY: non-blocking wait for our own child.
        unsafe { libc::waitpid(self.pid as libc::pid_t, std::ptr::null_mut(), libc::WNOHANG) };
    }
}

impl Drop for Watchdog {
    /// Closes the pipe without [`Watchdog::release`]: the watchdog sweeps.
    fn drop(&mut self) {
        self.pipe.take();
        self.reap();
    }
}

/// What [`Watchdog::release`] writes.
const RELEASE: &[u8] = b"q";

/// Starts a watchdog for `mark` by forking this process.
///
/// # Safety
///
/// No other thread may exist in this process: the child runs ordinary Rust
/// code (it allocates), which is only sound after `fork` in a single-threaded
/// process.
pub unsafe fn fork(mark: &str) -> std::io::Result<Watchdog> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two descriptors we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the descriptors were just created.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: the caller guarantees a single-threaded process.
    match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error()),
        0 => {
            drop(write);
            // stdout may be a pipe someone reads to its end: do not hold it.
            // SAFETY: plain descriptor calls in our own process.
            unsafe {
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                if null >= 0 {
                    libc::dup2(null, 0);
                    libc::dup2(null, 1);
                }
            }
            watch(mark, File::from(read))
        }
        pid => Ok(Watchdog {
            pid: pid as u32,
            pipe: Some(File::from(write)),
        }),
    }
}

/// The watchdog's life: ignore the signals that reach the agent's process
/// group, leave it, wait for the agent to release it, close the pipe or die,
/// then sweep and exit.
fn watch(mark: &str, mut pipe: File) -> ! {
    // SAFETY: ignoring signals and leaving the agent's process group.
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
    let mut byte = [0u8; 1];
    loop {
        match pipe.read(&mut byte) {
            Ok(1) if byte == RELEASE => std::process::exit(0),
            Ok(n) if n > 0 => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            _ => break,
        }
    }
    let left = kill_marked(mark, Duration::from_secs(2));
    if !left.is_empty() {
        // One write: a line in pieces could be split by the workers' output.
        let line =
            format!("rally watchdog: processes {left:?} survived SIGKILL (stuck in the kernel?)\n");
        let _ = std::io::stderr().write_all(line.as_bytes());
    }
    std::process::exit(0);
}
