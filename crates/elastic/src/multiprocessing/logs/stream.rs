//! One teed stream as the pump carries it: its bytes go to the log file at
//! once, and are cut into segments (`lines.rs`) for the console.
//!
//! When the console queue is full the stream falls *behind*: its bytes still
//! go to the log file at once, but no longer to the console; the stream
//! remembers how far into the file the console got and, whenever the queue has
//! room, reads the file back from there and cuts it into segments exactly as it
//! would have cut the live stream, until it has caught up and goes live again.
//! So the console lags, as torchrun's tail of the file does, but never drops a
//! line, and the launcher's memory stays bounded (one read-back chunk per
//! stream, plus the queue) however far behind the console is. At the end of a
//! stream it waits for the console to take the rest (see `console.rs` for when
//! it gives up).

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::console::{console, Console, ConsoleMsg, Segments, CONSOLE_DROPPED};
use super::lines::{Lines, Out};

pub(super) struct Active {
    /// Identifies the stream to the console thread.
    pub(super) id: u64,
    pub(super) src: File,
    pub(super) file: Option<File>,
    /// `file` opened for reading at the start (not later by path: the next
    /// attempt may have replaced the directory), to read it back when the
    /// console falls behind.
    pub(super) reader: Option<File>,
    /// Bytes written to `file` so far.
    pub(super) written: u64,
    /// Set while the console lags behind the file.
    pub(super) behind: Option<Behind>,
    pub(super) console: Console,
    pub(super) lines: Lines,
    pub(super) exited: Arc<AtomicBool>,
    /// Since when the pipe has been quiet after the worker's exit was seen.
    pub(super) quiet_since: Option<Instant>,
    /// Since when part of the current line has waited to be shown.
    pub(super) pending_since: Option<Instant>,
}

/// A teed stream whose console fell behind its log file.
pub(super) struct Behind {
    /// The log file, read back from `cursor`.
    pub(super) reader: File,
    /// Bytes of the file already cut into console segments.
    pub(super) cursor: u64,
    /// Segments cut but not yet taken by the console queue.
    pub(super) held: Option<ConsoleMsg>,
}

/// How much of the file one catch-up step reads back.
const CATCH_UP_CHUNK: usize = 256 * 1024;

impl Active {
    pub(super) fn write(&mut self, chunk: &[u8]) {
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
    pub(super) fn flush_partial(&mut self) {
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
    pub(super) fn catch_up(&mut self, mode: CatchUp) {
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
    pub(super) fn finish(&mut self, mode: CatchUp) {
        self.catch_up(mode);
        if let Some(out) = self.lines.flush(true) {
            self.send_to_console(out);
            self.catch_up(mode);
        }
    }
}

/// How far [`Active::catch_up`] goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CatchUp {
    /// What the console queue has room for now; the rest waits for later.
    Room,
    /// Everything, waiting for the console while it makes progress (one that
    /// takes nothing for [`CONSOLE_STALL`] is given up on).
    Wait,
    /// What the queue has room for now; the rest is not shown (counted).
    Drop,
}
