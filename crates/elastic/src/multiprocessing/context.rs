//! A started group of workers: poll, wait, report, close.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::logs::{Pump, WorkerLogs};
use crate::errors::ErrorReport;

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }

    /// PyTorch's exit code convention: negative signal numbers.
    pub fn code(self) -> i32 {
        match self {
            Exit::Code(c) => c,
            Exit::Signal(s) => -s,
        }
    }

    fn from_status(status: libc::c_int) -> Exit {
        if libc::WIFSIGNALED(status) {
            Exit::Signal(libc::WTERMSIG(status))
        } else {
            Exit::Code(libc::WEXITSTATUS(status))
        }
    }
}

/// The name of a signal, e.g. `SIGKILL`.
pub fn signal_name(sig: i32) -> String {
    // SAFETY: strsignal returns a static or thread-local string for any int.
    let desc = unsafe { std::ffi::CStr::from_ptr(libc::strsignal(sig)) };
    let abbrev = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        _ => return desc.to_string_lossy().into_owned(),
    };
    abbrev.to_owned()
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exit code {c}"),
            Exit::Signal(s) => write!(f, "signal {s} ({})", signal_name(*s)),
        }
    }
}

/// One failed worker.
#[derive(Debug, Clone)]
pub struct ProcessFailure {
    pub local_rank: usize,
    pub pid: u32,
    pub exit: Exit,
    /// What the worker wrote to its error file, if anything.
    pub error: Option<ErrorReport>,
    pub error_file: PathBuf,
    /// With no error file: the last Python traceback in the worker's
    /// `stderr.log` (when its stderr went to a file), as (exception line,
    /// traceback), and the file's path.
    pub stderr_traceback: Option<(String, String, PathBuf)>,
    /// When it failed: the error file's timestamp, else when the exit was seen.
    pub timestamp: SystemTime,
}

impl ProcessFailure {
    /// The error message, or a description of the exit.
    pub fn message(&self) -> String {
        match (&self.error, self.exit) {
            (Some(e), _) => e.message.clone(),
            (None, _) if self.stderr_traceback.is_some() => {
                let (line, _, _) = self.stderr_traceback.as_ref().expect("checked");
                line.clone()
            }
            (None, Exit::Signal(s)) => {
                format!(
                    "Signal {s} ({}) received by PID {}",
                    signal_name(s),
                    self.pid
                )
            }
            (None, Exit::Code(c)) => {
                format!("process exited with code {c} and wrote no error file")
            }
        }
    }
}

/// The outcome of a finished group.
#[derive(Debug, Clone, Default)]
pub struct RunResult {
    /// Exit of every worker, by local rank.
    pub exits: BTreeMap<usize, Exit>,
    /// Return values of function workers that succeeded, by local rank.
    pub return_values: BTreeMap<usize, Vec<u8>>,
    pub failures: BTreeMap<usize, ProcessFailure>,
}

impl RunResult {
    pub fn is_failed(&self) -> bool {
        !self.failures.is_empty()
    }

    /// The first failure by time: the root cause.
    pub fn root_cause(&self) -> Option<&ProcessFailure> {
        self.failures.values().min_by_key(|f| f.timestamp)
    }

    /// Copies the root cause into the launcher's own error file (its
    /// `$TORCHELASTIC_ERROR_FILE`, so the cause travels up the process tree), adding
    /// the exit code the child could not know. A child that wrote no file is
    /// described from its exit. Returns whether there was a failure to record.
    pub fn record_root_cause(
        &self,
        parent_file: &std::path::Path,
    ) -> Result<bool, crate::errors::ErrorFileError> {
        let Some(root) = self.root_cause() else {
            return Ok(false);
        };
        let report = match &root.error {
            Some(r) => r.clone(),
            None => ErrorReport::from_json(crate::errors::error_json(
                &root.message(),
                "",
                root.timestamp,
            )),
        };
        crate::errors::copy_with_exit_code(&report, Some(root.exit.code()), parent_file)?;
        Ok(true)
    }
}

/// How [`ProcessContext::wait_forwarding`] ended.
#[derive(Debug)]
pub enum Waited {
    Finished(RunResult),
    TimedOut,
    /// A trapped signal arrived; the workers were stopped with it.
    Signaled {
        signal: i32,
        result: RunResult,
    },
}

/// A started worker.
pub(crate) struct Worker {
    local_rank: usize,
    pid: u32,
    /// Becomes readable when the worker exits, so waits need no polling.
    pidfd: Option<OwnedFd>,
    logs: WorkerLogs,
    exited_flag: Arc<AtomicBool>,
    exit: Option<(Exit, SystemTime)>,
    /// We sent it a stop signal: how it exits is not its own failure.
    signalled: bool,
}

impl Worker {
    pub(crate) fn new(
        local_rank: usize,
        pid: u32,
        logs: WorkerLogs,
        exited_flag: Arc<AtomicBool>,
    ) -> Worker {
        // SAFETY: pidfd_open on our own live (or zombie) child; a negative result
        // (old kernel) just means waits fall back to polling.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        // SAFETY: a non-negative result is a new descriptor we own.
        let pidfd = (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) });
        Worker {
            local_rank,
            pid,
            pidfd,
            logs,
            exited_flag,
            exit: None,
            signalled: false,
        }
    }

    /// Reaps the worker if it has exited; also reaps orphans left in its group.
    fn reap(&mut self) -> Option<Exit> {
        if self.exit.is_none() {
            let mut status = 0;
            // SAFETY: waitpid on our own child.
            let r = unsafe { libc::waitpid(self.pid as libc::pid_t, &mut status, libc::WNOHANG) };
            if r == self.pid as libc::pid_t {
                self.exit = Some((Exit::from_status(status), SystemTime::now()));
                self.exited_flag.store(true, Ordering::Release);
            } else if r < 0 {
                // ECHILD: someone else reaped it; we cannot know how it ended.
                self.exit = Some((Exit::Code(-1), SystemTime::now()));
                self.exited_flag.store(true, Ordering::Release);
            }
        }
        // Only once the worker itself is reaped: sweeping its group earlier could
        // reap the worker and lose its status.
        if self.exit.is_some() {
            self.reap_group_orphans();
        }
        self.exit.map(|(e, _)| e)
    }

    /// Reaps exited grandchildren that were re-parented to us (we are a subreaper)
    /// and still belong to this worker's process group.
    fn reap_group_orphans(&self) {
        loop {
            let mut status = 0;
            // SAFETY: waitpid for any child in the worker's process group.
            let r =
                unsafe { libc::waitpid(-(self.pid as libc::pid_t), &mut status, libc::WNOHANG) };
            if r <= 0 {
                return;
            }
        }
    }

    /// Whether any process (zombies included) is still in the worker's group.
    fn group_exists(&self) -> bool {
        // SAFETY: signal 0 only checks for existence.
        unsafe { libc::killpg(self.pid as libc::pid_t, 0) == 0 }
    }

    fn signal_group(&self, sig: i32) {
        // SAFETY: signalling the worker's own process group.
        unsafe {
            libc::killpg(self.pid as libc::pid_t, sig);
        }
    }

    fn failure(&self) -> Option<ProcessFailure> {
        let (exit, seen) = self.exit?;
        if exit.success() {
            return None;
        }
        let error = match ErrorReport::read(&self.logs.error_file) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "unreadable error file");
                None
            }
        };
        let timestamp = error.as_ref().and_then(|e| e.timestamp).unwrap_or(seen);
        let stderr_traceback = match error {
            Some(_) => None,
            None => stderr_tail(&self.logs.stderr).and_then(|tail| {
                let (line, tb) = crate::errors::last_python_traceback(&tail)?;
                Some((line, tb, self.logs.stderr.clone()))
            }),
        };
        Some(ProcessFailure {
            stderr_traceback,
            local_rank: self.local_rank,
            pid: self.pid,
            exit,
            error,
            error_file: self.logs.error_file.clone(),
            timestamp,
        })
    }
}

/// The last [`STDERR_TAIL`] bytes of a worker's stderr file, if its stderr
/// went to one (not inherited, not `/dev/null`).
fn stderr_tail(path: &std::path::Path) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    if path == std::path::Path::new(super::logs::DEV_NULL) {
        return None;
    }
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(STDERR_TAIL)))
        .ok()?;
    let mut buf = Vec::new();
    f.take(STDERR_TAIL).read_to_end(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// How much of a failed worker's stderr is searched for its traceback.
const STDERR_TAIL: u64 = 16 * 1024;

/// A running group of workers.
pub struct ProcessContext {
    name: String,
    workers: Vec<Worker>,
    pump: Option<Pump>,
    closed: bool,
    grace: Duration,
    /// Created on the first async wait.
    notice: Option<ExitNotice>,
    /// The environment mark every worker carries (see [`super::watchdog`]):
    /// stopping also kills marked processes that left the workers' groups.
    mark: Option<String>,
}

impl ProcessContext {
    pub(crate) fn new(name: String, workers: Vec<Worker>, pump: Option<Pump>) -> Self {
        ProcessContext {
            name,
            workers,
            pump,
            closed: false,
            grace: Duration::from_secs(30),
            notice: None,
            mark: None,
        }
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Pid of each worker, by local rank.
    pub fn pids(&self) -> BTreeMap<usize, u32> {
        self.workers.iter().map(|w| (w.local_rank, w.pid)).collect()
    }

    /// Checks without blocking. `None` while workers run and none has failed. Once
    /// one fails, the rest are stopped (SIGTERM, then SIGKILL after the failure
    /// grace: all-or-nothing, as PyTorch) and the result is returned; likewise once
    /// all have succeeded.
    pub fn poll(&mut self) -> Option<RunResult> {
        let mut running = 0;
        let mut failed = Vec::new();
        for w in &mut self.workers {
            match w.reap() {
                None => running += 1,
                Some(e) if !e.success() => failed.push(w.local_rank),
                Some(_) => {}
            }
        }
        if running > 0 {
            if failed.is_empty() {
                return None;
            }
            self.close(libc::SIGTERM, self.grace);
        }
        // Only workers that failed by themselves are failures; those stopped because
        // of them show in `exits` (as PyTorch reports it).
        Some(self.result(&failed))
    }

    /// The workers still running, to read their stacks before a stop: each
    /// dump goes to `stacks.txt` in the worker's log directory (none with
    /// logs off). `rank` maps a local rank to the job-wide one.
    pub fn stack_targets(&mut self, rank: impl Fn(usize) -> usize) -> Vec<super::stacks::Target> {
        self.workers
            .iter_mut()
            .filter_map(|w| {
                w.reap().is_none().then(|| super::stacks::Target {
                    local_rank: w.local_rank,
                    rank: rank(w.local_rank),
                    pid: w.pid,
                    file: (w.logs.dir != std::path::Path::new(super::logs::DEV_NULL))
                        .then(|| w.logs.dir.join("stacks.txt")),
                })
            })
            .collect()
    }

    /// The first worker that failed by itself (not stopped by us), and how.
    pub fn first_failure(&mut self) -> Option<(usize, Exit)> {
        self.workers
            .iter_mut()
            .filter_map(|w| {
                w.reap();
                let (exit, at) = w.exit?;
                (!exit.success() && !w.signalled).then_some((at, w.local_rank, exit))
            })
            .min_by_key(|(at, ..)| *at)
            .map(|(_, local_rank, exit)| (local_rank, exit))
    }

    /// Stops also kill every process carrying `mark` in its environment
    /// (`RALLY_AGENT_MARK`, which the caller put in the workers' environment).
    pub fn set_mark(&mut self, mark: Option<String>) {
        self.mark = mark;
    }

    /// Grace period of the stop that follows a failure (default 30 s).
    pub fn set_failure_grace(&mut self, grace: Duration) {
        self.grace = grace;
    }

    /// Waits until the group finishes or `timeout` passes. Waiting is event-driven
    /// (each worker's pidfd wakes it the moment the worker exits); `period` only
    /// bounds each sleep, for kernels without pidfds (before Linux 5.3).
    pub fn wait(&mut self, timeout: Option<Duration>, period: Duration) -> Option<RunResult> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(r) = self.poll() {
                return Some(r);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return None;
            }
            self.sleep_until_an_exit(left.map_or(period, |l| l.min(period)));
        }
    }

    /// Sleeps until some running worker exits, or `limit` passes.
    fn sleep_until_an_exit(&self, limit: Duration) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        for w in self.workers.iter().filter(|w| w.exit.is_none()) {
            match &w.pidfd {
                Some(fd) => fds.push(libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                }),
                None => {
                    std::thread::sleep(limit);
                    return;
                }
            }
        }
        let ms = limit.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: `fds` holds valid pollfds for descriptors we own.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    }

    /// Like [`Self::wait`], but stops the workers with any trapped signal that
    /// arrives (forwarding it), waiting up to `grace` before SIGKILL.
    pub fn wait_forwarding(
        &mut self,
        signals: &super::signals::Signals,
        timeout: Option<Duration>,
        period: Duration,
        grace: Duration,
    ) -> Waited {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(signal) = signals.take() {
                tracing::info!(signal = %signal_name(signal), "forwarding signal to workers");
                self.close(signal, grace);
                let failed: Vec<usize> = Vec::new();
                return Waited::Signaled {
                    signal,
                    result: self.result(&failed),
                };
            }
            if let Some(r) = self.poll() {
                return Waited::Finished(r);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Waited::TimedOut;
            }
            // A trapped signal interrupts the sleep (poll is never restarted).
            self.sleep_until_an_exit(period);
        }
    }

    fn result(&mut self, failed: &[usize]) -> RunResult {
        self.join_pump();
        let mut r = RunResult::default();
        for w in &self.workers {
            if let Some((exit, _)) = w.exit {
                r.exits.insert(w.local_rank, exit);
                if exit.success() {
                    if let Ok(v) = std::fs::read(&w.logs.return_value) {
                        r.return_values.insert(w.local_rank, v);
                    }
                }
            }
            if failed.contains(&w.local_rank) {
                if let Some(f) = w.failure() {
                    r.failures.insert(w.local_rank, f);
                }
            }
        }
        r
    }

    /// Waits until all output is in its files (the pump ends once every worker
    /// has exited and its pipes are drained).
    fn join_pump(&mut self) {
        if let Some(p) = &mut self.pump {
            p.join();
            super::logs::flush_console();
        }
    }

    /// Stops every worker: `signal` to each live process group, wait up to `grace`
    /// (output keeps draining), then SIGKILL what is left and reap everything.
    /// Bounded: a process that survives SIGKILL for [`KILL_WAIT`] (stuck in the
    /// kernel) is given up on and its pid returned.
    pub fn close(&mut self, signal: i32, grace: Duration) -> Vec<u32> {
        if self.closed {
            return Vec::new();
        }
        self.closed = true;
        self.signal_live(signal);
        let deadline = Instant::now() + grace;
        while self.reap_all().0 > 0 && Instant::now() < deadline {
            self.sleep_until_an_exit(deadline.saturating_duration_since(Instant::now()));
        }
        if self.kill_live() {
            let deadline = Instant::now() + KILL_WAIT;
            while self.reap_all().0 > 0 && Instant::now() < deadline {
                self.sleep_until_an_exit(deadline.saturating_duration_since(Instant::now()));
            }
        }
        let deadline = Instant::now() + KILL_WAIT;
        while !self.sweep_orphans() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(500));
        }
        self.end_pump()
    }

    /// Sends `signal` to every worker group still running; they count as stopped
    /// by us, not as failed.
    fn signal_live(&mut self, signal: i32) {
        for w in &mut self.workers {
            if w.reap().is_none() {
                w.signalled = true;
                w.signal_group(signal);
            }
        }
    }

    /// SIGKILLs every worker group still running; whether there was any.
    fn kill_live(&mut self) -> bool {
        let mut any = false;
        for w in &mut self.workers {
            if w.reap().is_none() {
                tracing::warn!(
                    pid = w.pid,
                    local_rank = w.local_rank,
                    "worker ignored the stop signal; killing it"
                );
                w.signalled = true;
                w.signal_group(libc::SIGKILL);
                any = true;
            }
        }
        any
    }

    /// Grandchildren that outlived their worker in its process group: SIGKILL
    /// them and reap those re-parented to us. True once every group is empty.
    fn sweep_orphans(&mut self) -> bool {
        let mut empty = true;
        for w in &mut self.workers {
            w.signal_group(libc::SIGKILL);
            w.reap_group_orphans();
            empty &= !w.group_exists();
        }
        empty
    }

    /// Ends output capture (bounded: processes that would not die cannot hold
    /// the pump open) and returns the pids still alive.
    fn end_pump(&mut self) -> Vec<u32> {
        // Marked escapees (setsid, double forks) may hold the pipes open.
        let mut left = match &self.mark {
            Some(mark) => super::watchdog::kill_marked(mark, KILL_WAIT),
            None => Vec::new(),
        };
        let stuck: Vec<u32> = self
            .workers
            .iter_mut()
            .filter_map(|w| w.reap().is_none().then_some(w.pid))
            .collect();
        if let Some(p) = &self.pump {
            if !stuck.is_empty() {
                p.abandon();
            }
        }
        // Drained within DRAIN_AFTER_EXIT once the workers are gone; a grandchild
        // in another session that keeps writing is cut off after a bound.
        let deadline = Instant::now() + KILL_WAIT;
        while self.pump.as_ref().is_some_and(|p| !p.is_finished()) {
            if Instant::now() >= deadline {
                if let Some(p) = &self.pump {
                    p.abandon();
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        self.join_pump();
        left.extend(stuck);
        left.sort_unstable();
        left.dedup();
        if !left.is_empty() {
            tracing::error!(stuck = ?left, "processes still alive after SIGKILL (stuck in the kernel?)");
        }
        left
    }

    /// Every worker has exited, and how: workers that failed by themselves are
    /// failures, those stopped by us show in `exits` only (as PyTorch reports it).
    /// Call once the group has ended ([`Self::watch`] or [`Self::stop`]).
    pub fn outcome(&mut self) -> RunResult {
        let failed: Vec<usize> = self
            .workers
            .iter()
            .filter(|w| !w.signalled && w.exit.is_some_and(|(e, _)| !e.success()))
            .map(|w| w.local_rank)
            .collect();
        self.result(&failed)
    }

    /// Reaps whatever exited: (workers still running, local ranks that failed).
    fn reap_all(&mut self) -> (usize, Vec<usize>) {
        let mut running = 0;
        let mut failed = Vec::new();
        for w in &mut self.workers {
            match w.reap() {
                None => running += 1,
                Some(e) if !e.success() && !w.signalled => failed.push(w.local_rank),
                Some(_) => {}
            }
        }
        (running, failed)
    }

    /// Waits, without blocking the runtime, until every worker has succeeded
    /// (true) or one has failed (false). Nothing is stopped: that is the caller's
    /// decision ([`Self::stop`]).
    pub async fn watch(&mut self) -> bool {
        loop {
            let (running, failed) = self.reap_all();
            if !failed.is_empty() {
                return false;
            }
            if running == 0 {
                return true;
            }
            self.an_exit().await;
        }
    }

    /// Stops the group without blocking the runtime: `signal` to every live
    /// group, up to `grace` (cut short when `hurry` is notified), then SIGKILL,
    /// then orphans. Returns the pids that did not die within [`KILL_WAIT`] of
    /// SIGKILL (stuck in uninterruptible sleep), after which it gives up on them.
    pub async fn stop(
        &mut self,
        signal: i32,
        grace: Duration,
        hurry: &tokio::sync::Notify,
    ) -> Vec<u32> {
        if self.closed {
            return Vec::new();
        }
        self.closed = true;
        self.signal_live(signal);
        let deadline = tokio::time::Instant::now() + grace;
        let in_time = async {
            while self.reap_all().0 > 0 {
                self.an_exit().await;
            }
        };
        tokio::select! {
            _ = in_time => {}
            _ = tokio::time::sleep_until(deadline) => {}
            _ = hurry.notified() => {}
        }
        if self.kill_live() {
            let _ = tokio::time::timeout(KILL_WAIT, async {
                while self.reap_all().0 > 0 {
                    self.an_exit().await;
                }
            })
            .await;
        }
        let deadline = tokio::time::Instant::now() + KILL_WAIT;
        while !self.sweep_orphans() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // The pump ends within DRAIN_AFTER_EXIT (or is abandoned): off the runtime.
        self.end_pump()
    }

    /// Resolves when some worker may have exited.
    async fn an_exit(&mut self) {
        if self.notice.is_none() {
            self.notice = ExitNotice::new().ok();
        }
        let Some(notice) = &mut self.notice else {
            tokio::time::sleep(Duration::from_millis(5)).await;
            return;
        };
        if !notice.sync(&self.workers) {
            // A worker without a pidfd (kernel before 5.3): poll.
            tokio::time::sleep(Duration::from_millis(5)).await;
            return;
        }
        notice.ready().await;
    }
}

/// How long a process may survive SIGKILL before it is reported as stuck.
pub const KILL_WAIT: Duration = Duration::from_secs(1);

/// One epoll instance over the pidfds of the running workers, registered with
/// tokio, so an async wait wakes the moment any of them exits. Exited workers
/// are removed from it (a pidfd stays readable after its exit).
struct ExitNotice {
    epoll: tokio::io::unix::AsyncFd<OwnedFd>,
    /// Raw pidfds registered, by worker index.
    registered: Vec<Option<i32>>,
}

impl ExitNotice {
    fn new() -> std::io::Result<ExitNotice> {
        // SAFETY: plain syscall; a non-negative result is a descriptor we own.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned to us.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an OwnedFd is an open descriptor that stays the same until the
        // AsyncFd drops it.
        let epoll = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE)
        }
        .map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(ExitNotice {
            epoll,
            registered: Vec::new(),
        })
    }

    /// Registers running workers and removes exited ones; false if some running
    /// worker has no pidfd.
    fn sync(&mut self, workers: &[Worker]) -> bool {
        self.registered.resize(workers.len(), None);
        let ep = self.epoll.get_ref().as_raw_fd();
        let mut complete = true;
        for (i, w) in workers.iter().enumerate() {
            let fd = w.pidfd.as_ref().map(AsRawFd::as_raw_fd);
            match (w.exit.is_some(), self.registered[i], fd) {
                (false, None, Some(fd)) => {
                    let mut ev = libc::epoll_event {
                        events: libc::EPOLLIN as u32,
                        u64: i as u64,
                    };
                    // SAFETY: registering a pidfd we own with our epoll instance.
                    if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } == 0 {
                        self.registered[i] = Some(fd);
                    } else {
                        complete = false;
                    }
                }
                (false, None, None) => complete = false,
                (true, Some(fd), _) => {
                    // SAFETY: removing a registered descriptor.
                    unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
                    self.registered[i] = None;
                }
                _ => {}
            }
        }
        complete
    }

    /// Waits until some registered pidfd is readable.
    async fn ready(&mut self) {
        let Ok(mut guard) = self.epoll.readable().await else {
            return;
        };
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 8];
        let ep = self.epoll.get_ref().as_raw_fd();
        // SAFETY: `events` is a valid buffer of 8 entries; timeout 0 never blocks.
        let n = unsafe { libc::epoll_wait(ep, events.as_mut_ptr(), 8, 0) };
        if n <= 0 {
            guard.clear_ready();
        }
    }
}

impl Drop for ProcessContext {
    /// Bounded to [`DROP_WAIT`]: SIGKILL to every group, reap what dies in that
    /// time, and let the pump end by itself (the pipes close as the processes
    /// die). Call [`ProcessContext::close`] or [`ProcessContext::stop`] for an
    /// orderly stop that reports what would not die.
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        for w in &mut self.workers {
            if w.reap().is_none() {
                w.signal_group(libc::SIGKILL);
            }
        }
        let deadline = Instant::now() + DROP_WAIT;
        while !self.sweep_orphans() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
            self.reap_all();
        }
        if let Some(p) = &self.pump {
            p.abandon();
        }
    }
}

/// How long dropping a [`ProcessContext`] waits for its processes to die.
pub const DROP_WAIT: Duration = Duration::from_millis(100);
