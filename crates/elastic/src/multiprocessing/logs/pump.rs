//! The pump: one thread that `poll`s every teed pipe of a group (one thread, not
//! two per worker, keeps the launcher small, so forking the next worker stays
//! cheap) and hands what it reads to each stream (`stream.rs`).
//!
//! A pump stops at end of file, or, when the worker has exited but a grandchild
//! still holds the pipe open, once the pipe has been quiet for
//! [`DRAIN_AFTER_EXIT`], so such a grandchild never hangs the launcher. A
//! partial line waits [`PARTIAL_AFTER`] before it is shown as it is.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::console::Console;
use super::lines::Lines;
use super::stream::{Active, CatchUp};

/// How long a pump keeps reading after its worker exited, once the pipe is quiet.
pub const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(100);

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

/// How often the pump wakes when nothing arrives (idle partial lines, exits).
const TICK_MS: libc::c_int = 20;

/// How often it wakes while a console is behind, to feed it from the file.
const BEHIND_TICK_MS: libc::c_int = 5;

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
