//! Log directories and the pumps that carry worker output to files and the console.
//!
//! Layout, as torchrun's: `<log_dir>/<run_id>_<suffix>/attempt_<n>/<local_rank>/`
//! holding `stdout.log`, `stderr.log` and `error.json`. The attempt directory is
//! wiped and recreated for each attempt.
//!
//! Every worker stream is a pipe read by its own pump thread. The pump appends raw
//! bytes to the stream's file (when redirected or teed) and writes whole, prefixed
//! lines to the console (when teed, or not redirected at all) under the console's
//! lock, so lines of different workers never interleave mid-line. A pump stops at
//! end of file, or — when the worker has exited but a grandchild still holds the
//! pipe open — once the pipe has been quiet for [`DRAIN_AFTER_EXIT`], so such a
//! grandchild never hangs the launcher.
//!
//! The console is written by its own thread behind a bounded queue, so a slow
//! console never stalls the pump (and with it every worker): a teed stream whose
//! console lines do not fit in the queue loses them from the console only — they
//! are in its file — and a notice says how many were dropped. A stream that goes
//! only to the console has nowhere else to go, so the pump waits for the console,
//! as a worker writing to a terminal would.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::spec::{LogsSpec, Std};

/// How long a pump keeps reading after its worker exited, once the pipe is quiet.
pub const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(100);

/// The per-run log directory (`<log_dir>/<run_id>_<suffix>`), or `/dev/null` when
/// logging is off (as `log_dir=os.devnull` in PyTorch: no files, and an empty
/// `TORCHELASTIC_ERROR_FILE`).
#[derive(Debug)]
pub struct RunLogs {
    pub dir: PathBuf,
    /// With logging off, where function workers' return values go; removed on drop.
    scratch: Option<PathBuf>,
}

impl Drop for RunLogs {
    fn drop(&mut self) {
        if let Some(s) = &self.scratch {
            let _ = std::fs::remove_dir_all(s);
        }
    }
}

/// The `log_dir` that turns log files off.
pub const DEV_NULL: &str = "/dev/null";

/// Paths of one worker's files in one attempt.
#[derive(Debug, Clone)]
pub struct WorkerLogs {
    pub dir: PathBuf,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
    pub error_file: PathBuf,
    /// Where a function worker writes its return value.
    pub return_value: PathBuf,
}

/// Why a log directory could not be prepared.
#[derive(Debug, thiserror::Error)]
#[error("cannot prepare log directory {path}")]
pub struct LogDirError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

fn suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:08x}", h.finish() as u32)
}

impl RunLogs {
    /// Creates `<log_dir>/<run_id>_<suffix>` (a fresh temporary base when the spec
    /// has no `log_dir`).
    pub fn create(spec: &LogsSpec, run_id: &str) -> Result<RunLogs, LogDirError> {
        if spec.log_dir.as_deref() == Some(Path::new(DEV_NULL)) {
            let scratch = std::env::temp_dir().join(format!("rally_{run_id}_{}", suffix()));
            std::fs::create_dir_all(&scratch).map_err(|source| LogDirError {
                path: scratch.clone(),
                source,
            })?;
            return Ok(RunLogs {
                dir: PathBuf::from(DEV_NULL),
                scratch: Some(scratch),
            });
        }
        let base = match &spec.log_dir {
            Some(d) => d.clone(),
            None => std::env::temp_dir().join(format!("torchelastic_{}", suffix())),
        };
        let dir = base.join(format!("{run_id}_{}", suffix()));
        std::fs::create_dir_all(&dir).map_err(|source| LogDirError {
            path: dir.clone(),
            source,
        })?;
        Ok(RunLogs { dir, scratch: None })
    }

    /// Wipes and recreates `attempt_<n>/<rank>/` for every local rank.
    pub fn attempt(&self, attempt: u32, nprocs: usize) -> Result<Vec<WorkerLogs>, LogDirError> {
        if let Some(scratch) = &self.scratch {
            let null = PathBuf::from(DEV_NULL);
            return Ok((0..nprocs)
                .map(|rank| WorkerLogs {
                    dir: null.clone(),
                    stdout: null.clone(),
                    stderr: null.clone(),
                    error_file: PathBuf::new(),
                    return_value: scratch.join(format!("{attempt}_{rank}")),
                })
                .collect());
        }
        let dir = self.dir.join(format!("attempt_{attempt}"));
        let err = |path: &Path| {
            let path = path.to_owned();
            move |source| LogDirError { path, source }
        };
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(&dir)(e)),
        }
        (0..nprocs)
            .map(|rank| {
                let d = dir.join(rank.to_string());
                std::fs::create_dir_all(&d).map_err(err(&d))?;
                Ok(WorkerLogs {
                    stdout: d.join("stdout.log"),
                    stderr: d.join("stderr.log"),
                    error_file: d.join("error.json"),
                    return_value: d.join("return_value"),
                    dir: d,
                })
            })
            .collect()
    }
}

/// Which console stream a pump writes to.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Console {
    Stdout,
    Stderr,
}

/// Where one worker stream goes.
pub(crate) struct Route {
    pub file: Option<PathBuf>,
    pub console: Option<(Console, String)>,
}

/// Decides the route of one stream from the spec.
pub(crate) fn route(
    spec: &LogsSpec,
    local_rank: usize,
    stream: Std,
    file: &Path,
    prefix: &str,
) -> Route {
    let pick = |s: Std| {
        if stream == Std::Out {
            s.stdout()
        } else {
            s.stderr()
        }
    };
    let tee = pick(spec.tee.get(local_rank));
    let redirect = tee || pick(spec.redirects.get(local_rank));
    let shown = spec
        .local_ranks_filter
        .as_ref()
        .is_none_or(|f| f.contains(&local_rank));
    let console = if stream == Std::Out {
        Console::Stdout
    } else {
        Console::Stderr
    };
    Route {
        file: redirect.then(|| file.to_owned()),
        console: ((tee || !redirect) && shown).then(|| (console, prefix.to_owned())),
    }
}

/// One worker stream for the pump: its pipe, where it goes, and whether its worker
/// has exited.
pub(crate) struct Stream {
    pub pipe: OwnedFd,
    pub route: Route,
    pub exited: Arc<AtomicBool>,
}

/// The pump: one thread that `poll`s every worker pipe of a group. One thread (not
/// two per worker) keeps the launcher small, so forking the next worker stays cheap.
pub(crate) struct Pump {
    thread: Option<JoinHandle<()>>,
    /// Set to end the pump whatever its pipes do (a process that would not die,
    /// or a grandchild in another session still writing).
    abandon: Arc<AtomicBool>,
}

/// Pipes are grown to this size, so a chatty worker and the pump trade large chunks
/// instead of switching contexts every 64 KiB.
const PIPE_SIZE: libc::c_int = 1 << 20;

struct Active {
    src: File,
    file: Option<File>,
    console: Option<(Console, String)>,
    partial: Vec<u8>,
    exited: Arc<AtomicBool>,
    quiet_since: Option<Instant>,
    /// Console lines dropped because the console fell behind (teed streams only).
    dropped: u64,
}

/// A message for the console thread.
enum ConsoleMsg {
    Lines(Console, Vec<u8>),
    /// Acknowledged once everything queued before it is written.
    Flush(std::sync::mpsc::SyncSender<()>),
}

static CONSOLE_DROPPED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Console lines dropped so far in this process because the console fell behind
/// (they are in the log files).
pub fn console_lines_dropped() -> u64 {
    CONSOLE_DROPPED.load(Ordering::Relaxed)
}

/// Chunks (each up to ~1 MiB of lines) the console queue holds.
const CONSOLE_QUEUE: usize = 64;

/// The process-wide console writer.
fn console() -> &'static std::sync::mpsc::SyncSender<ConsoleMsg> {
    static TX: std::sync::OnceLock<std::sync::mpsc::SyncSender<ConsoleMsg>> =
        std::sync::OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<ConsoleMsg>(CONSOLE_QUEUE);
        std::thread::Builder::new()
            .name("rally-console".into())
            .spawn(move || {
                for msg in rx {
                    match msg {
                        ConsoleMsg::Lines(Console::Stdout, b) => {
                            let _ = std::io::stdout().lock().write_all(&b);
                        }
                        ConsoleMsg::Lines(Console::Stderr, b) => {
                            let _ = std::io::stderr().lock().write_all(&b);
                        }
                        ConsoleMsg::Flush(ack) => {
                            let _ = std::io::stdout().flush();
                            let _ = ack.send(());
                        }
                    }
                }
            })
            .expect("cannot start the console thread");
        tx
    })
}

/// Waits (up to a second: a console nobody reads must not hang the launcher) until
/// every console line queued so far is written.
pub(crate) fn flush_console() {
    let (ack, done) = std::sync::mpsc::sync_channel(1);
    if console().try_send(ConsoleMsg::Flush(ack)).is_ok() {
        let _ = done.recv_timeout(Duration::from_secs(1));
    }
}

impl Pump {
    /// Starts pumping `streams`, opening their log files first.
    pub(crate) fn start(streams: Vec<Stream>) -> std::io::Result<Pump> {
        let mut active = Vec::with_capacity(streams.len());
        for s in streams {
            // SAFETY: fcntl on a pipe we own; failure just keeps the default size.
            unsafe {
                libc::fcntl(s.pipe.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_SIZE);
            }
            let file = match &s.route.file {
                Some(p) => Some(File::create(p)?),
                None => None,
            };
            active.push(Active {
                src: File::from(s.pipe),
                file,
                console: s.route.console,
                partial: Vec::new(),
                exited: s.exited,
                quiet_since: None,
                dropped: 0,
            });
        }
        let abandon = Arc::new(AtomicBool::new(false));
        let flag = abandon.clone();
        let thread = std::thread::Builder::new()
            .name("rally-log-pump".into())
            .spawn(move || pump(active, &flag))?;
        Ok(Pump {
            thread: Some(thread),
            abandon,
        })
    }

    /// Waits for the pump to finish (every stream at end of file, or drained after
    /// its worker exited).
    pub(crate) fn join(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Ends the pump within one poll tick, whatever its pipes still hold.
    pub(crate) fn abandon(&self) {
        self.abandon.store(true, Ordering::Release);
    }

    /// Whether the pump has ended (every stream done, or abandoned).
    pub(crate) fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }
}

fn pump(mut streams: Vec<Active>, abandon: &AtomicBool) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(streams.len());
    while !streams.is_empty() {
        if abandon.load(Ordering::Acquire) {
            for s in &mut streams {
                s.finish();
            }
            return;
        }
        fds.clear();
        fds.extend(streams.iter().map(|s| libc::pollfd {
            fd: s.src.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }));
        // SAFETY: `fds` holds one valid pollfd per open stream.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 20) };
        if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return;
        }
        let mut done = vec![false; streams.len()];
        for (i, s) in streams.iter_mut().enumerate() {
            if fds[i].revents == 0 {
                // Quiet: stop once the worker is gone and the pipe stays quiet (a
                // grandchild may hold it open forever).
                if s.exited.load(Ordering::Acquire) {
                    let since = *s.quiet_since.get_or_insert_with(Instant::now);
                    done[i] = since.elapsed() >= DRAIN_AFTER_EXIT;
                }
                continue;
            }
            s.quiet_since = None;
            match s.src.read(&mut buf) {
                Ok(0) => done[i] = true,
                Ok(n) => {
                    s.write(&buf[..n]);
                    // A full read means a busy stream: read bigger chunks.
                    if n == buf.len() && buf.len() < PIPE_SIZE as usize {
                        buf.resize(buf.len() * 2, 0);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => done[i] = true,
            }
        }
        let mut i = 0;
        streams.retain_mut(|s| {
            let keep = !done[i];
            i += 1;
            if !keep {
                s.finish();
            }
            keep
        });
    }
}

impl Active {
    fn write(&mut self, chunk: &[u8]) {
        if let Some(f) = &mut self.file {
            if f.write_all(chunk).is_err() {
                self.file = None;
            }
        }
        if let Some((which, prefix)) = &self.console {
            let lines = prefixed_lines(prefix, &mut self.partial, chunk);
            if !lines.is_empty() {
                self.send_to_console(*which, lines);
            }
        }
    }

    /// Queues lines for the console: without waiting when the stream also has a
    /// file (dropping them if the console is behind), else waiting.
    fn send_to_console(&mut self, which: Console, lines: Vec<u8>) {
        let tx = console();
        if self.file.is_none() {
            let _ = tx.send(ConsoleMsg::Lines(which, lines));
            return;
        }
        if self.dropped > 0 {
            let prefix = self.console.as_ref().map_or("", |c| c.1.as_str());
            let notice = format!(
                "{prefix} [rally] console fell behind: {} lines dropped here (they are in the log file)\n",
                self.dropped
            );
            if tx
                .try_send(ConsoleMsg::Lines(which, notice.into_bytes()))
                .is_err()
            {
                self.dropped += memchr::memchr_iter(b'\n', &lines).count() as u64;
                return;
            }
            self.dropped = 0;
        }
        if let Err(std::sync::mpsc::TrySendError::Full(ConsoleMsg::Lines(_, l))) =
            tx.try_send(ConsoleMsg::Lines(which, lines))
        {
            let n = memchr::memchr_iter(b'\n', &l).count() as u64;
            self.dropped += n;
            CONSOLE_DROPPED.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Sends an unterminated last line to the console.
    fn finish(&mut self) {
        if let (Some((which, prefix)), false) = (&self.console, self.partial.is_empty()) {
            let which = *which;
            let mut last = std::mem::take(&mut self.partial);
            last.push(b'\n');
            let lines = prefixed_lines(prefix, &mut Vec::new(), &last);
            self.send_to_console(which, lines);
        }
    }
}

/// The complete lines of `partial + chunk`, each prefixed; the unfinished tail is
/// kept in `partial`.
fn prefixed_lines(prefix: &str, partial: &mut Vec<u8>, chunk: &[u8]) -> Vec<u8> {
    let Some(last_nl) = memchr::memrchr(b'\n', chunk) else {
        partial.extend_from_slice(chunk);
        return Vec::new();
    };
    let (complete, tail) = chunk.split_at(last_nl + 1);
    let lines = memchr::memchr_iter(b'\n', complete).count();
    let mut out = Vec::with_capacity(partial.len() + complete.len() + lines * (prefix.len() + 1));
    let mut start = 0;
    for end in memchr::memchr_iter(b'\n', complete) {
        out.extend_from_slice(prefix.as_bytes());
        out.push(b' ');
        if start == 0 {
            out.extend_from_slice(partial);
        }
        out.extend_from_slice(&complete[start..=end]);
        start = end + 1;
    }
    partial.clear();
    partial.extend_from_slice(tail);
    out
}
