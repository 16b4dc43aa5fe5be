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
    /// When it failed: the error file's timestamp, else when the exit was seen.
    pub timestamp: SystemTime,
}

impl ProcessFailure {
    /// The error message, or a description of the exit.
    pub fn message(&self) -> String {
        match (&self.error, self.exit) {
            (Some(e), _) => e.message.clone(),
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
        Some(ProcessFailure {
            local_rank: self.local_rank,
            pid: self.pid,
            exit,
            error,
            error_file: self.logs.error_file.clone(),
            timestamp,
        })
    }
}

/// A running group of workers.
pub struct ProcessContext {
    name: String,
    workers: Vec<Worker>,
    pump: Option<Pump>,
    closed: bool,
    grace: Duration,
}

impl ProcessContext {
    pub(crate) fn new(name: String, workers: Vec<Worker>, pump: Option<Pump>) -> Self {
        ProcessContext {
            name,
            workers,
            pump,
            closed: false,
            grace: Duration::from_secs(30),
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
    pub fn close(&mut self, signal: i32, grace: Duration) {
        if self.closed {
            return;
        }
        self.closed = true;
        for w in &mut self.workers {
            if w.reap().is_none() {
                w.signal_group(signal);
            }
        }
        let deadline = Instant::now() + grace;
        while self.workers.iter_mut().any(|w| w.reap().is_none()) {
            if Instant::now() >= deadline {
                for w in &mut self.workers {
                    if w.reap().is_none() {
                        tracing::warn!(
                            pid = w.pid,
                            local_rank = w.local_rank,
                            "worker ignored the stop signal; killing it"
                        );
                        w.signal_group(libc::SIGKILL);
                    }
                }
                while self.workers.iter_mut().any(|w| w.reap().is_none()) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                break;
            }
            self.sleep_until_an_exit(deadline.saturating_duration_since(Instant::now()));
        }
        // Grandchildren that outlived their worker: end them too, and reap those
        // re-parented to us, until the group is empty (bounded: a process stuck in
        // uninterruptible sleep cannot be waited out).
        for w in &mut self.workers {
            w.signal_group(libc::SIGKILL);
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        for w in &mut self.workers {
            while w.group_exists() && Instant::now() < deadline {
                w.reap_group_orphans();
                std::thread::sleep(Duration::from_micros(500));
            }
            w.reap_group_orphans();
        }
        self.join_pump();
    }
}

impl Drop for ProcessContext {
    fn drop(&mut self) {
        self.close(libc::SIGKILL, Duration::from_secs(5));
    }
}
