//! The console: the launcher's stdout and stderr, written by one thread of its
//! own behind a queue bounded in bytes, so a slow console never stalls the pump
//! (and with it every worker).
//!
//! Each run of segments (see `lines.rs`) is written whole under the console's
//! lock, so lines of different workers never interleave mid-line: a line another
//! worker left open is ended before the next one starts, and the rest of a
//! partial line continues it without a second prefix unless another worker
//! wrote in between (then it starts a new line with its prefix).
//!
//! A stream whose output finds the queue full falls behind (see `stream.rs`).
//! Waiting for room goes on as long as the console makes progress; only a
//! console that takes nothing for [`CONSOLE_STALL`] is given up on (the lines
//! are in the file; their number is in [`console_lines_dropped`]), so a console
//! nobody reads cannot hang the launcher.

use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which console stream a teed stream is echoed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Console {
    Stdout,
    Stderr,
}

/// At the end of a stream, a console that takes nothing for this long is given
/// up on (its lines are in the file): a console nobody reads must not hang the
/// launcher.
pub const CONSOLE_STALL: Duration = Duration::from_secs(5);

/// A run of console output from one stream.
pub(super) struct Segments {
    pub(super) console: Console,
    pub(super) stream: u64,
    /// The stream's prefix, for the console thread to add when `continues` but
    /// another stream wrote in between.
    pub(super) prefix: Arc<[u8]>,
    pub(super) bytes: Vec<u8>,
    /// The first segment continues a line this stream left open (no prefix).
    pub(super) continues: bool,
    /// The last segment leaves the line open (no `\n` or `\r` yet).
    pub(super) open: bool,
    /// Segments in `bytes`, for the drop count.
    pub(super) count: u64,
}

/// A message for the console thread.
pub(super) enum ConsoleMsg {
    Out(Segments),
    /// Acknowledged once everything queued before it is written.
    Flush(std::sync::mpsc::SyncSender<()>),
}

pub(super) static CONSOLE_DROPPED: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

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
pub(super) struct ConsoleQueue {
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
    pub(super) fn offer(&self, msg: ConsoleMsg) -> Result<(), ConsoleMsg> {
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
    pub(super) fn send(&self, mut msg: ConsoleMsg) -> bool {
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
pub(super) fn console() -> &'static ConsoleQueue {
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
