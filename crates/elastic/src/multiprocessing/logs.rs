//! Log directories and the pumps that carry worker output to files and the console.
//!
//! Layout, as torchrun's: `<log_dir>/<run_id>_<suffix>/attempt_<n>/<local_rank>/`
//! holding `stdout.log`, `stderr.log` and `error.json`. The attempt directory is
//! wiped and recreated for each attempt.
//!
//! Each worker stream goes where torchrun's `DefaultLogsSpecs` sends it
//! (`route`): by default the worker inherits the launcher's stdin, stdout and
//! stderr, so a terminal stays a terminal (`isatty()`, colours, `\r` progress
//! bars, `breakpoint()`) and lines carry no prefix. `-r` hands the worker its log
//! file directly. A rank hidden by the console filter and not redirected writes
//! to `/dev/null`. Only `-t` (tee) involves the launcher: the stream is a pipe,
//! and the pump writes its bytes to the file and echoes them, prefixed, to the
//! console. torchrun tails the file instead, which shows output up to 0.1 s late.
//!
//! The pump cuts each teed stream into segments (`Lines`): lines, `\r`-ended
//! progress updates, a partial line once it has waited [`PARTIAL_AFTER`], and
//! pieces of [`MAX_LINE`] bytes of a line without end. `\r\n` is one line
//! ending, even cut between two reads: an update ending a read shows at once
//! and its `\r` goes out with the next byte.
//! Each segment is written whole under the console's lock, so lines of different
//! workers never interleave mid-line: a line another worker left open is ended
//! before the next one starts, and the rest of a partial line continues it
//! without a second prefix unless another worker wrote in between (then it
//! starts a new line with its prefix). A pump
//! stops at end of file, or, when the worker has exited but a grandchild still
//! holds the pipe open, once the pipe has been quiet for [`DRAIN_AFTER_EXIT`],
//! so such a grandchild never hangs the launcher.
//!
//! The console is written by its own thread behind a bounded queue, so a slow
//! console never stalls the pump (and with it every worker). When the queue is
//! full the stream falls *behind*: its bytes still go to the log file at once,
//! but no longer to the console; the pump remembers how far into the file the
//! console got and, whenever the queue has room, reads the file back from there
//! and cuts it into segments exactly as it would have cut the live stream, until
//! it has caught up and goes live again. So the console lags, as torchrun's tail
//! of the file does, but never drops a line, and the launcher's memory stays
//! bounded (one read-back chunk per stream, plus the queue) however far behind
//! the console is. At the end of a stream the pump waits for the console to
//! take the rest; only a console that takes nothing for [`CONSOLE_STALL`] is
//! given up on (the lines are in the file; their number is in
//! [`console_lines_dropped`]), so a console nobody reads cannot hang the
//! launcher.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
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

/// Which console stream a teed stream is echoed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Console {
    Stdout,
    Stderr,
}

/// Where one worker stream goes, decided as torchrun's `DefaultLogsSpecs.reify`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Route {
    /// The launcher's own stream, handed to the worker as is (torchrun's
    /// default): a terminal stays a terminal.
    Inherit,
    /// Neither kept nor shown: a rank the console filter hides, not redirected.
    Discard,
    /// The worker writes the file directly (`-r`, or `-t` for a hidden rank).
    File(PathBuf),
    /// Through a pipe to the pump, which writes the file and echoes prefixed
    /// lines to the console (`-t`).
    Tee {
        file: PathBuf,
        console: Console,
        prefix: String,
    },
}

/// Decides the route of one stream from the spec. With logging off
/// (`log_dir=/dev/null`, `file` is `/dev/null`) every stream is inherited, as in
/// torchrun, which then has nowhere to redirect to.
pub(crate) fn route(
    spec: &LogsSpec,
    local_rank: usize,
    stream: Std,
    file: &Path,
    prefix: &str,
) -> Route {
    if file == Path::new(DEV_NULL) {
        return Route::Inherit;
    }
    let pick = |s: Std| {
        if stream == Std::Out {
            s.stdout()
        } else {
            s.stderr()
        }
    };
    let tee = pick(spec.tee.get(local_rank));
    let redirect = tee || pick(spec.redirects.get(local_rank));
    // As torchrun: an empty filter filters nothing.
    let shown = spec
        .local_ranks_filter
        .as_ref()
        .is_none_or(|f| f.is_empty() || f.contains(&local_rank));
    match (redirect, tee && shown, shown) {
        (true, true, _) => Route::Tee {
            file: file.to_owned(),
            console: if stream == Std::Out {
                Console::Stdout
            } else {
                Console::Stderr
            },
            prefix: prefix.to_owned(),
        },
        (true, false, _) => Route::File(file.to_owned()),
        (false, _, true) => Route::Inherit,
        (false, _, false) => Route::Discard,
    }
}

/// One teed worker stream for the pump: its pipe, its file and console, and
/// whether its worker has exited.
pub(crate) struct Stream {
    pub pipe: OwnedFd,
    pub file: PathBuf,
    pub console: Console,
    pub prefix: String,
    pub exited: Arc<AtomicBool>,
}

/// The pump: one thread that `poll`s every teed pipe of a group. One thread (not
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

/// A partial line (a prompt, a progress bar without `\r`) quiet this long is
/// shown as it is; the rest of the line follows when it comes.
pub const PARTIAL_AFTER: Duration = Duration::from_millis(100);

/// A line longer than this is shown in pieces of this size, so a stream without
/// newlines cannot grow the launcher's memory.
pub const MAX_LINE: usize = 64 * 1024;

/// How often the pump wakes when nothing arrives (idle partial lines, exits).
const TICK_MS: libc::c_int = 20;

/// How often it wakes while a console is behind, to feed it from the file.
const BEHIND_TICK_MS: libc::c_int = 5;

struct Active {
    /// Identifies the stream to the console thread.
    id: u64,
    src: File,
    file: Option<File>,
    /// `file` opened for reading at the start (not later by path: the next
    /// attempt may have replaced the directory), to read it back when the
    /// console falls behind.
    reader: Option<File>,
    /// Bytes written to `file` so far.
    written: u64,
    /// Set while the console lags behind the file.
    behind: Option<Behind>,
    console: Console,
    lines: Lines,
    exited: Arc<AtomicBool>,
    /// Since when the pipe has been quiet after the worker's exit was seen.
    quiet_since: Option<Instant>,
    /// Since when part of the current line has waited to be shown.
    pending_since: Option<Instant>,
}

/// A teed stream whose console fell behind its log file.
struct Behind {
    /// The log file, read back from `cursor`.
    reader: File,
    /// Bytes of the file already cut into console segments.
    cursor: u64,
    /// Segments cut but not yet taken by the console queue.
    held: Option<ConsoleMsg>,
}

/// How much of the file one catch-up step reads back.
const CATCH_UP_CHUNK: usize = 256 * 1024;

/// At the end of a stream, a console that takes nothing for this long is given
/// up on (its lines are in the file): a console nobody reads must not hang the
/// launcher.
pub const CONSOLE_STALL: Duration = Duration::from_secs(5);

/// A run of console output from one stream.
struct Segments {
    console: Console,
    stream: u64,
    /// The stream's prefix, for the console thread to add when `continues` but
    /// another stream wrote in between.
    prefix: Arc<[u8]>,
    bytes: Vec<u8>,
    /// The first segment continues a line this stream left open (no prefix).
    continues: bool,
    /// The last segment leaves the line open (no `\n` or `\r` yet).
    open: bool,
    /// Segments in `bytes`, for the drop count.
    count: u64,
}

/// A message for the console thread.
enum ConsoleMsg {
    Out(Segments),
    /// Acknowledged once everything queued before it is written.
    Flush(std::sync::mpsc::SyncSender<()>),
}

static CONSOLE_DROPPED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Console segments (lines, `\r` updates, pieces of partial or over-long lines)
/// not shown so far in this process because the console took nothing for
/// [`CONSOLE_STALL`] at the end of a stream. A console that is only slow never
/// loses one; every one of them is in its log file.
pub fn console_lines_dropped() -> u64 {
    CONSOLE_DROPPED.load(Ordering::Relaxed)
}

/// A console that writes this much in [`CONSOLE_STALL`] (13 KB/s) is slow,
/// not stuck.
const PROGRESS_PIECE: usize = 64 * 1024;

/// Bytes of output the console queue holds at most; past it, a stream falls
/// behind and is read back from its file (so the launcher's memory does not
/// grow with a slow console).
const CONSOLE_QUEUE_BYTES: usize = 4 << 20;

/// The process-wide console: a writer thread behind a queue bounded in bytes.
struct ConsoleQueue {
    tx: std::sync::mpsc::SyncSender<ConsoleMsg>,
    /// Bytes queued and not yet written.
    queued: Arc<std::sync::atomic::AtomicUsize>,
    /// Pieces the writer finished (messages, and [`PROGRESS_PIECE`]s of long
    /// ones), to tell a slow console from a stuck one.
    done: Arc<std::sync::atomic::AtomicU64>,
    /// `done + 1` when a wait gave up on the console; while `done` has not
    /// moved since, the console is still stuck and nobody waits again.
    stuck_at: std::sync::atomic::AtomicU64,
}

impl ConsoleMsg {
    fn len(&self) -> usize {
        match self {
            ConsoleMsg::Out(s) => s.bytes.len(),
            ConsoleMsg::Flush(_) => 0,
        }
    }
}

impl ConsoleQueue {
    /// Queues `msg` if the byte budget has room (a queue holding nothing takes
    /// any message); else hands it back.
    fn offer(&self, msg: ConsoleMsg) -> Result<(), ConsoleMsg> {
        let n = msg.len();
        let before = self.queued.fetch_add(n, Ordering::AcqRel);
        if before > 0 && before + n > CONSOLE_QUEUE_BYTES {
            self.queued.fetch_sub(n, Ordering::AcqRel);
            return Err(msg);
        }
        match self.tx.try_send(msg) {
            Ok(()) => Ok(()),
            Err(
                std::sync::mpsc::TrySendError::Full(m)
                | std::sync::mpsc::TrySendError::Disconnected(m),
            ) => {
                self.queued.fetch_sub(n, Ordering::AcqRel);
                Err(m)
            }
        }
    }

    /// Queues `msg`, waiting for room as long as the console makes progress:
    /// false if it took nothing for [`CONSOLE_STALL`].
    fn send(&self, mut msg: ConsoleMsg) -> bool {
        let mut seen = self.done.load(Ordering::Acquire);
        let mut since = Instant::now();
        loop {
            match self.offer(msg) {
                Ok(()) => return true,
                Err(m) => msg = m,
            }
            if self.still_stuck() {
                return false;
            }
            let now = self.done.load(Ordering::Acquire);
            if now != seen {
                (seen, since) = (now, Instant::now());
            } else if since.elapsed() >= CONSOLE_STALL {
                self.stuck_at.store(now + 1, Ordering::Release);
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A wait gave up on the console and it has written nothing since.
    fn still_stuck(&self) -> bool {
        self.stuck_at.load(Ordering::Acquire) == self.done.load(Ordering::Acquire) + 1
    }
}

/// The process-wide console writer. It tracks, per console stream, which worker
/// stream left a line open, so that the rest of that line is written without a
/// second prefix, and a line of another worker in between gets its own.
fn console() -> &'static ConsoleQueue {
    static QUEUE: std::sync::OnceLock<ConsoleQueue> = std::sync::OnceLock::new();
    QUEUE.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<ConsoleMsg>(1024);
        let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (q, d) = (queued.clone(), done.clone());
        std::thread::Builder::new()
            .name("rally-console".into())
            .spawn(move || {
                // The stream whose line is open on stdout, and on stderr.
                let mut open: [Option<u64>; 2] = [None, None];
                for msg in rx {
                    let n = msg.len();
                    match msg {
                        ConsoleMsg::Out(s) => {
                            let slot = &mut open[s.console as usize];
                            let cont = s.continues && *slot == Some(s.stream);
                            let mut w: Box<dyn Write> = match s.console {
                                Console::Stdout => Box::new(std::io::stdout().lock()),
                                Console::Stderr => Box::new(std::io::stderr().lock()),
                            };
                            // Another line is open here (a partial line of
                            // another worker): end it, so this starts a line.
                            if slot.is_some() && !cont {
                                let _ = w.write_all(b"\n");
                            }
                            if s.continues && !cont {
                                let _ = w.write_all(&s.prefix);
                            }
                            // In pieces, each counted as progress: a slow
                            // console is not taken for a stuck one.
                            for piece in s.bytes.chunks(PROGRESS_PIECE) {
                                let _ = w.write_all(piece);
                                let _ = w.flush();
                                d.fetch_add(1, Ordering::AcqRel);
                            }
                            *slot = s.open.then_some(s.stream);
                        }
                        ConsoleMsg::Flush(ack) => {
                            let _ = std::io::stdout().flush();
                            let _ = ack.send(());
                        }
                    }
                    q.fetch_sub(n, Ordering::AcqRel);
                    d.fetch_add(1, Ordering::AcqRel);
                }
            })
            .expect("cannot start the console thread");
        ConsoleQueue {
            tx,
            queued,
            done,
            stuck_at: Default::default(),
        }
    })
}

/// Waits until every console line queued so far is written, as long as the
/// console makes progress (one that takes nothing for [`CONSOLE_STALL`] is
/// given up on: a console nobody reads must not hang the launcher).
pub(crate) fn flush_console() {
    let (ack, acked) = std::sync::mpsc::sync_channel(1);
    let q = console();
    if !q.send(ConsoleMsg::Flush(ack)) {
        return;
    }
    let mut seen = q.done.load(Ordering::Acquire);
    let mut since = Instant::now();
    loop {
        match acked.recv_timeout(Duration::from_millis(50)) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        if q.still_stuck() {
            return;
        }
        let now = q.done.load(Ordering::Acquire);
        if now != seen {
            (seen, since) = (now, Instant::now());
        } else if since.elapsed() >= CONSOLE_STALL {
            q.stuck_at.store(now + 1, Ordering::Release);
            return;
        }
    }
}

impl Pump {
    /// Starts pumping `streams`, creating their log files first.
    pub(crate) fn start(streams: Vec<Stream>) -> std::io::Result<Pump> {
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let mut active = Vec::with_capacity(streams.len());
        for s in streams {
            // SAFETY: fcntl on a pipe we own; failure just keeps the default size.
            unsafe {
                libc::fcntl(s.pipe.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_SIZE);
            }
            active.push(Active {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                src: File::from(s.pipe),
                file: Some(File::create(&s.file)?),
                reader: File::open(&s.file).ok(),
                written: 0,
                behind: None,
                console: s.console,
                lines: Lines::new(&s.prefix),
                exited: s.exited,
                quiet_since: None,
                pending_since: None,
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
            // Ended within a tick: what the console has no room for now is
            // not shown (it is in the file) and counted.
            for s in &mut streams {
                s.finish(CatchUp::Drop);
            }
            return;
        }
        fds.clear();
        fds.extend(streams.iter().map(|s| libc::pollfd {
            fd: s.src.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }));
        // A stream behind its console retries soon; otherwise wake each tick.
        let tick = if streams.iter().any(|s| s.behind.is_some()) {
            BEHIND_TICK_MS
        } else {
            TICK_MS
        };
        // SAFETY: `fds` holds one valid pollfd per open stream.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, tick) };
        if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return;
        }
        let mut done = vec![false; streams.len()];
        for (i, s) in streams.iter_mut().enumerate() {
            // A console that fell behind takes what it has room for.
            if s.behind.is_some() {
                s.catch_up(CatchUp::Room);
            }
            // A partial line shows once it is PARTIAL_AFTER old, busy or not.
            if s.behind.is_none()
                && s.pending_since
                    .is_some_and(|t| t.elapsed() >= PARTIAL_AFTER)
            {
                s.flush_partial();
            }
            if fds[i].revents == 0 {
                // Stop once the worker is gone and the pipe has stayed quiet
                // since (a grandchild may hold it open forever). The clock
                // starts when the exit is seen, not at the last read, so output
                // written just before the exit is still read.
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
                s.finish(CatchUp::Wait);
            }
            keep
        });
    }
}

impl Active {
    fn write(&mut self, chunk: &[u8]) {
        let wrote = match &mut self.file {
            Some(f) => f.write_all(chunk).is_ok(),
            None => false,
        };
        if wrote {
            self.written += chunk.len() as u64;
        } else {
            self.file = None;
        }
        if self.behind.is_some() {
            if wrote {
                // In the file: the console reads it from there when it has room.
                return;
            }
            // The file failed: the console is all there is now. Show what the
            // file holds first, waiting for the console.
            self.catch_up(CatchUp::Wait);
        }
        if let Some(out) = self.lines.feed(chunk) {
            self.send_to_console(out);
        }
        self.note_pending();
    }

    /// Starts (or stops) the partial-line clock after new input was cut.
    fn note_pending(&mut self) {
        if self.lines.pending.is_empty() {
            self.pending_since = None;
        } else if self.pending_since.is_none() {
            self.pending_since = Some(Instant::now());
        }
    }

    /// Shows a partial line that has waited [`PARTIAL_AFTER`].
    fn flush_partial(&mut self) {
        self.pending_since = None;
        if let Some(out) = self.lines.flush(false) {
            self.send_to_console(out);
        }
    }

    fn message(&self, out: Out) -> ConsoleMsg {
        ConsoleMsg::Out(Segments {
            console: self.console,
            stream: self.id,
            prefix: self.lines.prefix.clone(),
            bytes: out.bytes,
            continues: out.continues,
            open: out.open,
            count: out.count,
        })
    }

    /// Queues output for the console without waiting. If the queue is full,
    /// the stream falls behind: what follows goes to the file only, and
    /// [`Active::catch_up`] feeds the console from the file later. After a
    /// failed file write the console is all there is, so then it waits.
    fn send_to_console(&mut self, out: Out) {
        let msg = self.message(out);
        if self.file.is_none() {
            self.send_waiting(msg);
            return;
        }
        let Err(msg) = console().offer(msg) else {
            return;
        };
        // Everything written so far was cut already: read back from there.
        match self.reader.as_ref().and_then(|r| r.try_clone().ok()) {
            Some(reader) => {
                self.behind = Some(Behind {
                    reader,
                    cursor: self.written,
                    held: Some(msg),
                })
            }
            // No way back into the file: wait for the console instead.
            None => self.send_waiting(msg),
        }
    }

    /// Queues `msg` as long as the console makes progress; counts it as not
    /// shown if the console is stuck.
    fn send_waiting(&mut self, msg: ConsoleMsg) {
        let count = match &msg {
            ConsoleMsg::Out(s) => s.count,
            ConsoleMsg::Flush(_) => 0,
        };
        if !console().send(msg) {
            CONSOLE_DROPPED.fetch_add(count, Ordering::Relaxed);
        }
    }

    /// Feeds the console from the file, as `mode` says. Back to live once
    /// caught up.
    fn catch_up(&mut self, mode: CatchUp) {
        let q = console();
        let mut buf = Vec::new();
        let mut gave_up = false;
        loop {
            let Some(b) = &mut self.behind else { return };
            if let Some(msg) = b.held.take() {
                let count = match &msg {
                    ConsoleMsg::Out(s) => s.count,
                    ConsoleMsg::Flush(_) => 0,
                };
                if gave_up {
                    CONSOLE_DROPPED.fetch_add(count, Ordering::Relaxed);
                } else {
                    match mode {
                        CatchUp::Wait => {
                            if !q.send(msg) {
                                CONSOLE_DROPPED.fetch_add(count, Ordering::Relaxed);
                                gave_up = true;
                            }
                        }
                        CatchUp::Room => {
                            if let Err(msg) = q.offer(msg) {
                                b.held = Some(msg);
                                return;
                            }
                        }
                        CatchUp::Drop => {
                            if q.offer(msg).is_err() {
                                CONSOLE_DROPPED.fetch_add(count, Ordering::Relaxed);
                                gave_up = true;
                            }
                        }
                    }
                }
            }
            if b.cursor >= self.written {
                self.behind = None;
                self.note_pending();
                return;
            }
            let n = (self.written - b.cursor).min(CATCH_UP_CHUNK as u64) as usize;
            buf.resize(n, 0);
            let n = match b.reader.read_at(&mut buf, b.cursor) {
                Ok(n) if n > 0 => n,
                // The file was cut short under us: what it lost cannot be shown.
                _ => {
                    self.behind = None;
                    return;
                }
            };
            b.cursor += n as u64;
            if let Some(out) = self.lines.feed(&buf[..n]) {
                let msg = self.message(out);
                if let Some(b) = &mut self.behind {
                    b.held = Some(msg);
                }
            }
        }
    }

    /// Shows the rest: what the console has not caught up with, then an
    /// unterminated last line, ended with a newline.
    fn finish(&mut self, mode: CatchUp) {
        self.catch_up(mode);
        if let Some(out) = self.lines.flush(true) {
            self.send_to_console(out);
            self.catch_up(mode);
        }
    }
}

/// How far [`Active::catch_up`] goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CatchUp {
    /// What the console queue has room for now; the rest waits for later.
    Room,
    /// Everything, waiting for the console while it makes progress (one that
    /// takes nothing for [`CONSOLE_STALL`] is given up on).
    Wait,
    /// What the queue has room for now; the rest is not shown (counted).
    Drop,
}

/// Console output cut from a stream, ready to queue.
#[derive(Debug, PartialEq, Eq)]
struct Out {
    bytes: Vec<u8>,
    continues: bool,
    open: bool,
    count: u64,
}

/// Cuts a stream into prefixed console segments: lines ended by `\n`, progress
/// updates ended by `\r` (the next update overwrites it, prefix and all, so it
/// gets its own prefix), and pieces of a line that is partial for too long
/// ([`Lines::flush`]) or longer than [`MAX_LINE`]. Memory per stream stays under
/// [`MAX_LINE`].
struct Lines {
    prefix: Arc<[u8]>,
    /// The current line's bytes not yet sent.
    pending: Vec<u8>,
    /// Part of the current line was sent already: what follows continues it.
    open_on_console: bool,
}

impl Lines {
    fn new(prefix: &str) -> Lines {
        Lines {
            prefix: prefix.as_bytes().into(),
            pending: Vec::new(),
            open_on_console: false,
        }
    }

    /// Appends `chunk`; returns the segments it completes.
    fn feed(&mut self, chunk: &[u8]) -> Option<Out> {
        let mut out = Out {
            bytes: Vec::new(),
            continues: false,
            open: false,
            count: 0,
        };
        // A `\r` held back (it ended the last chunk): ended by `\r\n`, or a
        // progress update of its own.
        if self.pending.last() == Some(&b'\r') && chunk.first() != Some(&b'\n') && !chunk.is_empty()
        {
            self.segment(&mut out, b"", false);
        }
        let mut start = 0;
        for end in memchr::memchr2_iter(b'\n', b'\r', chunk) {
            if chunk[end] == b'\r' {
                match chunk.get(end + 1) {
                    // `\r\n` is one line ending (Windows-style output).
                    Some(b'\n') => continue,
                    // The chunk's last byte: the update shows now, its `\r`
                    // waits for the next byte to say what it ends.
                    None => {
                        self.segment(&mut out, &chunk[start..end], true);
                        self.pending.push(b'\r');
                        return Some(out);
                    }
                    Some(_) => {}
                }
            }
            self.segment(&mut out, &chunk[start..=end], false);
            start = end + 1;
        }
        let mut tail = &chunk[start..];
        while self.pending.len() + tail.len() >= MAX_LINE {
            let take = MAX_LINE - self.pending.len();
            self.segment(&mut out, &tail[..take], true);
            tail = &tail[take..];
        }
        self.pending.extend_from_slice(tail);
        (out.count > 0).then_some(out)
    }

    /// Sends what is pending of the current line: as an open segment, or, at the
    /// end of the stream, ended with a newline.
    fn flush(&mut self, last: bool) -> Option<Out> {
        // A `\r` held back stays back (a `\n` may follow), except at the end.
        let held = !last && self.pending.last() == Some(&b'\r');
        if held {
            self.pending.pop();
        }
        if self.pending.is_empty() && !(last && self.open_on_console) {
            if held {
                self.pending.push(b'\r');
            }
            return None;
        }
        let mut out = Out {
            bytes: Vec::new(),
            continues: false,
            open: false,
            count: 0,
        };
        if last && self.pending.last() == Some(&b'\r') {
            // Ended by its `\r`.
            self.segment(&mut out, b"", false);
        } else if last {
            self.segment(&mut out, b"\n", false);
        } else {
            self.segment(&mut out, b"", true);
        }
        if held {
            self.pending.push(b'\r');
        }
        Some(out)
    }

    /// Emits `pending + piece` as one segment; `open`: the line goes on after it.
    fn segment(&mut self, out: &mut Out, piece: &[u8], open: bool) {
        if out.count == 0 && self.open_on_console {
            out.continues = true;
        } else if !self.open_on_console {
            out.bytes.extend_from_slice(&self.prefix);
        }
        out.bytes.extend_from_slice(&self.pending);
        out.bytes.extend_from_slice(piece);
        self.pending.clear();
        self.open_on_console = open;
        out.open = open;
        out.count += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lines() -> Lines {
        Lines::new("[w0]:")
    }

    #[test]
    fn complete_lines_are_prefixed_and_the_tail_waits() {
        let mut l = lines();
        let out = l.feed(b"a\nbc\nde").unwrap();
        assert_eq!(out.bytes, b"[w0]:a\n[w0]:bc\n");
        assert!(!out.continues && !out.open);
        assert_eq!(out.count, 2);
        let out = l.feed(b"f\n").unwrap();
        assert_eq!(out.bytes, b"[w0]:def\n");
    }

    #[test]
    fn a_carriage_return_shows_a_progress_update_at_once() {
        let mut l = lines();
        let out = l.feed(b" 10%|#   |\r 20%|##  |\r").unwrap();
        // The last update shows at once; its `\r` goes out with what follows
        // (a `\n` would make `\r\n` one line ending).
        assert_eq!(out.bytes, b"[w0]: 10%|#   |\r[w0]: 20%|##  |");
        assert!(out.open);
        assert_eq!(l.feed(b"100%").unwrap().bytes, b"\r");
        assert_eq!(l.flush(true).unwrap().bytes, b"[w0]:100%\n");
    }

    #[test]
    fn a_quiet_partial_line_is_shown_and_its_rest_continues_it() {
        let mut l = lines();
        assert_eq!(l.feed(b"Password: "), None);
        let out = l.flush(false).unwrap();
        assert_eq!(out.bytes, b"[w0]:Password: ");
        assert!(out.open && !out.continues);
        assert_eq!(l.flush(false), None, "nothing new to show");
        let out = l.feed(b"ok\nnext\n").unwrap();
        assert!(out.continues, "the rest of the line has no second prefix");
        assert_eq!(out.bytes, b"ok\n[w0]:next\n");
    }

    #[test]
    fn a_line_longer_than_the_bound_is_split_and_memory_stays_bounded() {
        let mut l = lines();
        let big = vec![b'x'; 3 * MAX_LINE + 10];
        let out = l.feed(&big).unwrap();
        assert_eq!(out.count, 3);
        assert!(out.open);
        assert_eq!(out.bytes.len(), 5 + 3 * MAX_LINE);
        assert_eq!(l.pending.len(), 10);
        let out = l.feed(b"\n").unwrap();
        assert!(out.continues);
        assert_eq!(out.bytes, [vec![b'x'; 10], b"\n".to_vec()].concat());
    }

    #[test]
    fn an_open_line_at_the_end_is_closed_with_a_newline() {
        let mut l = lines();
        l.feed(b"abc");
        l.flush(false).unwrap();
        let out = l.flush(true).unwrap();
        assert!(out.continues);
        assert_eq!(out.bytes, b"\n");
        assert_eq!(l.flush(true), None);
    }

    #[test]
    fn crlf_is_one_line_ending_even_cut_between_chunks() {
        let mut l = lines();
        let out = l.feed(b"a\r\nb\r").unwrap();
        // `b` shows at once, its `\r` waits for the next byte.
        assert_eq!(out.bytes, b"[w0]:a\r\n[w0]:b");
        assert_eq!(l.flush(false), None);
        let out = l.feed(b"\nc\r").unwrap();
        assert!(out.continues);
        assert_eq!(out.bytes, b"\r\n[w0]:c");
        // Not followed by `\n`: a progress update of its own.
        let out = l.feed(b"d\n").unwrap();
        assert_eq!(out.bytes, b"\r[w0]:d\n");
        // At the end, a held `\r` ends its line.
        assert_eq!(l.feed(b"e\r").unwrap().bytes, b"[w0]:e");
        assert_eq!(l.flush(true).unwrap().bytes, b"\r");
    }

    proptest! {
        /// Whatever the chunking and flushes, the console shows every byte, in
        /// order, each line starting with one prefix.
        #[test]
        fn output_is_the_input_with_one_prefix_per_line(
            data in proptest::collection::vec(prop_oneof![Just(b'\n'), Just(b'\r'), Just(b'a'), Just(b'b')], 0..400),
            cuts in proptest::collection::vec((0usize..400, any::<bool>()), 0..20),
        ) {
            let mut l = lines();
            let mut shown = Vec::new();
            let mut open = false;
            let mut take = |out: Option<Out>, shown: &mut Vec<u8>| {
                if let Some(o) = out {
                    prop_assert_eq!(o.continues, open);
                    shown.extend_from_slice(&o.bytes);
                    open = o.open;
                }
                Ok(())
            };
            let mut pos = 0;
            let mut cuts = cuts;
            cuts.sort();
            for (cut, flush) in cuts {
                let cut = cut.min(data.len()).max(pos);
                take(l.feed(&data[pos..cut]), &mut shown)?;
                if flush {
                    take(l.flush(false), &mut shown)?;
                }
                pos = cut;
            }
            take(l.feed(&data[pos..]), &mut shown)?;
            take(l.flush(true), &mut shown)?;
            // Expected: the data, a prefix at the start of every line.
            let mut want = Vec::new();
            let mut at_start = true;
            for (i, &b) in data.iter().enumerate() {
                if at_start {
                    want.extend_from_slice(b"[w0]:");
                }
                want.push(b);
                // `\r\n` is one line ending.
                at_start = b == b'\n' || (b == b'\r' && data.get(i + 1) != Some(&b'\n'));
            }
            if !at_start {
                want.push(b'\n');
            }
            prop_assert_eq!(String::from_utf8_lossy(&shown), String::from_utf8_lossy(&want));
        }
    }
}
