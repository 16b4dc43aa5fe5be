//! One client connection: the job-secret handshake (when the server has a
//! secret), PyTorch's handshake, request loop, waits, and clean-up.
//!
//! Reads go into a per-thread scratch buffer; only the tail of a request split across
//! reads is copied into the connection's own buffer, so an idle connection owns no
//! buffer at all. Every complete request in a read is handled under one keyspace
//! lock, replies are gathered and written with one `write`.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use std::os::fd::AsRawFd;

use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use rallypoint_auth::{RefusalKind, Service};

use super::Shared;
use crate::keyspace::{Keyspace, Signal, WaitStart, WaiterId};
use crate::protocol::reply::{put_byte, put_int, put_nonce, put_value};
use crate::protocol::{
    decode_request, Command, DecodeError, Decoded, Request, CHECK_NOT_READY, CHECK_READY,
    STOP_WAITING, VALIDATE_MAGIC, WAIT_CANCELED,
};
use crate::secret::REFUSAL_ECHO;

const SCRATCH_LEN: usize = 64 * 1024;
/// Buffers above this are released after use so idle connections stay small.
const KEEP_BUFFER: usize = 4 * 1024;

thread_local! {
    static SCRATCH: RefCell<Vec<u8>> = RefCell::new(vec![0; SCRATCH_LEN]);
}

/// Why a connection ended.
#[derive(Debug)]
enum Close {
    /// The client closed it, or the server is shutting down.
    Normal,
    Io(std::io::Error),
    /// Bad input: the connection is closed and the reason logged.
    Protocol(String),
}

struct Connection {
    shared: Arc<Shared>,
    signal: Arc<Signal>,
    validated: bool,
    /// Bytes of a request not yet complete.
    partial: Vec<u8>,
    /// `partial` needs at least this many bytes before decoding is worth trying.
    needed: usize,
    /// `handle_all` stopped before the end of its input because the output
    /// reached [`OUTPUT_HIGH_WATER`]: flush, then handle the rest of `partial`.
    paused: bool,
    out: Vec<u8>,
    /// Waits this connection registered; some may have completed since.
    waits: Vec<WaiterId>,
    /// Waits registered and not yet answered.
    outstanding: u32,
}

pub(super) async fn serve(
    mut stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    cancel: CancellationToken,
) {
    if let Some(secret) = &shared.secret {
        let deadline = std::time::Instant::now() + shared.handshake_deadline;
        let proof = rallypoint_auth::io::tokio::server_handshake(
            &mut stream,
            peer,
            secret,
            Service::STORE,
            deadline,
        );
        let refused = tokio::select! {
            r = proof => r.err(),
            () = cancel.cancelled() => None,
        };
        if let Some(refusal) = refused {
            shared.refusals.count(&refusal);
            tracing::warn!("store: {refusal}");
            if refusal.kind() == RefusalKind::NotOurProtocol {
                // A client without the secret: our own reads this where it
                // expects its ping's echo and says a secret is needed.
                let _ = stream.write_all(&REFUSAL_ECHO).await;
            }
            shared.stats.closed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if cancel.is_cancelled() {
            shared.stats.closed.fetch_add(1, Ordering::Relaxed);
            return;
        }
    }
    let mut conn = Connection {
        shared,
        signal: Signal::new(),
        validated: false,
        partial: Vec::new(),
        needed: 0,
        paused: false,
        out: Vec::new(),
        waits: Vec::new(),
        outstanding: 0,
    };
    let close = conn.run(&mut stream, &cancel).await;
    if !conn.waits.is_empty() {
        conn.shared.keyspace().cancel(&conn.waits);
    }
    let stats = &conn.shared.stats;
    stats.closed.fetch_add(1, Ordering::Relaxed);
    match close {
        Close::Normal => tracing::trace!(%peer, "connection closed"),
        Close::Io(e) => tracing::debug!(%peer, error = %e, "connection failed"),
        Close::Protocol(reason) => {
            stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, %reason, "closing store connection after bad input");
        }
    }
}

impl Connection {
    async fn run(&mut self, stream: &mut TcpStream, cancel: &CancellationToken) -> Close {
        // Created once: re-registering with the shared token on every loop turn
        // would contend across all connections.
        let cancelled = cancel.cancelled();
        tokio::pin!(cancelled);
        let signal = self.signal.clone();
        loop {
            tokio::select! {
                biased;
                _ = &mut cancelled => return Close::Normal,
                _ = signal.notified(), if self.outstanding > 0 => self.report_fired(),
                ready = stream.readable() => {
                    if let Err(e) = ready {
                        return Close::Io(e);
                    }
                    match self.read_and_handle(stream) {
                        Ok(true) => {}
                        Ok(false) => return Close::Normal,
                        Err(close) => {
                            // Send what was answered before the bad request.
                            let _ = self.flush(stream).await;
                            return close;
                        }
                    }
                }
            }
            if let Err(e) = self.flush(stream).await {
                return Close::Io(e);
            }
            // Requests left over by a full output buffer, one high-water mark at
            // a time: the output of a connection stays bounded.
            while self.paused {
                self.paused = false;
                let partial = std::mem::take(&mut self.partial);
                let used = match self.handle_all(&partial) {
                    Ok(used) => used,
                    Err(close) => {
                        let _ = self.flush(stream).await;
                        return close;
                    }
                };
                self.partial = partial;
                self.partial.drain(..used);
                if let Err(e) = self.flush(stream).await {
                    return Close::Io(e);
                }
            }
        }
    }

    /// Reads what is available and handles every complete request. `Ok(false)` on EOF.
    fn read_and_handle(&mut self, stream: &TcpStream) -> Result<bool, Close> {
        SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            let n = match read_clearing_readiness(stream, &mut scratch) {
                Ok(0) => return Ok(false),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return Ok(true),
                Err(e) => return Err(Close::Io(e)),
            };
            if self.partial.is_empty() {
                let used = self.handle_all(&scratch[..n])?;
                if used < n {
                    self.partial.extend_from_slice(&scratch[used..n]);
                }
            } else {
                self.partial.extend_from_slice(&scratch[..n]);
                if self.partial.len() >= self.needed {
                    let partial = std::mem::take(&mut self.partial);
                    let used = self.handle_all(&partial)?;
                    self.partial = partial;
                    self.partial.drain(..used);
                    if self.partial.is_empty() && self.partial.capacity() > KEEP_BUFFER {
                        self.partial = Vec::new();
                    }
                }
            }
            Ok(true)
        })
    }

    /// Handles every complete request at the front of `input`; returns the bytes used.
    fn handle_all(&mut self, input: &[u8]) -> Result<usize, Close> {
        let shared = self.shared.clone();
        let mut keyspace = None;
        let mut at = 0;
        while at < input.len() {
            if self.out.len() >= OUTPUT_HIGH_WATER {
                self.paused = true;
                self.needed = 0;
                return Ok(at);
            }
            match decode_request(&input[at..], &shared.limits) {
                Ok(Decoded::Complete(req, used)) => {
                    at += used;
                    if !self.validated {
                        self.handshake(&req)?;
                        continue;
                    }
                    let ks = keyspace.get_or_insert_with(|| shared.keyspace());
                    self.handle(ks, req)?;
                }
                Ok(Decoded::Incomplete { needed }) => {
                    self.needed = needed;
                    return Ok(at);
                }
                Err(e) => return Err(self.bad_input(e)),
            }
        }
        self.needed = 0;
        Ok(at)
    }

    fn bad_input(&self, e: DecodeError) -> Close {
        Close::Protocol(format!("undecodable request: {e}"))
    }

    fn handshake(&mut self, req: &Request) -> Result<(), Close> {
        match req {
            Request::Validate {
                magic: VALIDATE_MAGIC,
            } => {
                self.validated = true;
                Ok(())
            }
            Request::Validate { magic } => Err(Close::Protocol(format!(
                "handshake magic {magic:#010x} is not {VALIDATE_MAGIC:#010x}"
            ))),
            other => Err(Close::Protocol(format!(
                "first request was {}, not VALIDATE",
                other.command().name()
            ))),
        }
    }

    fn handle(&mut self, ks: &mut Keyspace, req: Request) -> Result<(), Close> {
        self.shared
            .stats
            .requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let max_value = self.shared.limits.max_value_len;
        let out = &mut self.out;
        match req {
            Request::Validate { .. } => {
                return Err(Close::Protocol("VALIDATE after the handshake".into()))
            }
            Request::Set { key, value } => ks.set(key, Bytes::copy_from_slice(value)),
            Request::CompareSet {
                key,
                expected,
                desired,
            } => put_value(out, &ks.compare_set(key, expected, desired)),
            Request::Get { key } => put_value(out, &ks.get(key).unwrap_or_default()),
            Request::Add { key, delta } => match ks.add(key, delta) {
                Ok(v) => put_int(out, v),
                Err(e) => return Err(counter_error(Command::Add, key, e)),
            },
            Request::Check { keys } => put_byte(
                out,
                if ks.check(&keys) {
                    CHECK_READY
                } else {
                    CHECK_NOT_READY
                },
            ),
            Request::Wait { keys } => {
                let start = ks.wait(&keys, &self.signal);
                self.started(ks, start);
            }
            Request::GetNumKeys => put_int(out, ks.num_keys()),
            Request::DeleteKey { key } => put_int(out, i64::from(ks.delete(key))),
            Request::Append { key, value } => {
                if let Err(e) = ks.append(key, value, max_value) {
                    return Err(Close::Protocol(format!(
                        "APPEND to {:?}: {e}",
                        String::from_utf8_lossy(key)
                    )));
                }
            }
            Request::MultiGet { keys } => {
                let values = ks.multi_get(&keys);
                // Refused before anything is built: a request naming one large
                // value many times would otherwise ask for far more memory than
                // any limit allows.
                let size: u64 = values
                    .iter()
                    .map(|v| 8 + v.as_ref().map_or(0, |v| v.len() as u64))
                    .sum();
                let max = max_reply(max_value);
                if size > max {
                    return Err(Close::Protocol(format!(
                        "MULTI_GET of {} keys would reply {size} bytes, over the limit of {max}",
                        keys.len()
                    )));
                }
                for v in values {
                    put_value(out, &v.unwrap_or_default());
                }
            }
            Request::MultiSet { pairs } => {
                for (k, v) in pairs {
                    ks.set(k, Bytes::copy_from_slice(v));
                }
            }
            Request::CancelWait => {
                ks.cancel(&self.waits);
                self.waits.clear();
                self.outstanding = 0;
                // Waits that completed before the cancel are still answered first,
                // so the client reads STOP_WAITING then WAIT_CANCELED.
                for _ in 0..self.signal.take() {
                    put_byte(out, STOP_WAITING);
                }
                put_byte(out, WAIT_CANCELED);
            }
            Request::Ping { nonce } => put_nonce(out, nonce),
            Request::QueuePush { key, value } => ks.queue_push(key, Bytes::copy_from_slice(value)),
            Request::QueuePop { key } => {
                let (len, item) = ks.queue_pop(key);
                put_int(out, len);
                if let Some(item) = item {
                    put_value(out, &item);
                }
            }
            Request::QueueLen { key } => put_int(out, ks.queue_len(key)),
            Request::ListKeys => {
                let keys = ks.list_keys();
                put_int(out, keys.len() as i64);
                for k in keys {
                    put_value(out, &k);
                }
            }
            Request::Barrier { key, world_size } => match ks.barrier(key, world_size, &self.signal)
            {
                Ok(start) => self.started(ks, start),
                Err(e) => return Err(counter_error(Command::Barrier, key, e)),
            },
        }
        // A request of ours may have completed one of our own waits.
        if self.outstanding > 0 {
            self.report_fired();
        }
        Ok(())
    }

    /// Records a wait or barrier that has begun.
    fn started(&mut self, ks: &Keyspace, start: WaitStart) {
        match start {
            WaitStart::Ready => put_byte(&mut self.out, STOP_WAITING),
            WaitStart::Pending(id) => {
                if self.waits.len() >= 8 {
                    self.waits.retain(|w| ks.is_pending(*w));
                }
                self.waits.push(id);
                self.outstanding += 1;
            }
        }
    }

    /// Answers waits that completed since the last look.
    fn report_fired(&mut self) {
        let n = self.signal.take();
        for _ in 0..n {
            put_byte(&mut self.out, STOP_WAITING);
        }
        self.outstanding = self.outstanding.saturating_sub(n);
        if self.outstanding == 0 {
            self.waits.clear();
        }
    }

    async fn flush(&mut self, stream: &mut TcpStream) -> std::io::Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        let r = stream.write_all(&self.out).await;
        if self.out.capacity() > KEEP_BUFFER {
            self.out = Vec::new();
        } else {
            self.out.clear();
        }
        r
    }
}

/// Past this much unsent output, a connection stops handling requests until it
/// has written what it has (requests already read wait in its input buffer).
const OUTPUT_HIGH_WATER: usize = 64 << 20;

/// The largest single reply: the high-water mark, or one value at the limit.
fn max_reply(max_value: u64) -> u64 {
    (OUTPUT_HIGH_WATER as u64).max(max_value + 16)
}

/// Reads once into `buf`. A read that does not fill the buffer drained the socket, so
/// it also clears tokio's readiness flag: otherwise the next turn of the loop would
/// spend a `recv` just to learn `EAGAIN` (tokio's `try_read` does not do this; its
/// `poll_read` does). Tokio only clears the flag if no new readiness event arrived
/// meanwhile, so data that lands after the read is never missed.
fn read_clearing_readiness(stream: &TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    let fd = stream.as_raw_fd();
    let mut short = 0;
    let r = stream.try_io(Interest::READABLE, || {
        // SAFETY: `buf` is valid for `buf.len()` writable bytes, and `fd` is the
        // open socket `stream` owns for the duration of this call.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let n = n as usize;
        if n > 0 && n < buf.len() {
            short = n;
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    });
    match r {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && short > 0 => Ok(short),
        other => other,
    }
}

fn counter_error(cmd: Command, key: &[u8], e: crate::keyspace::CounterError) -> Close {
    Close::Protocol(format!(
        "{} on {:?}: {e}",
        cmd.name(),
        String::from_utf8_lossy(key)
    ))
}
