//! One outgoing stream to one peer: its connection, its queue and its writer.
//!
//! The connection belongs to the line. A frame is written at once, from the
//! caller, when the line is idle and the whole frame fits in the socket's
//! buffer (a non-blocking write, no await: nothing to cancel); otherwise it
//! is queued for the line's writer task, which writes frames whole, in
//! order, and reconnects when the connection is gone. So a caller that gives
//! up never leaves half a frame and never closes a connection: a queued frame
//! not yet begun is skipped, a frame begun (inline or by the writer) is
//! finished. The parts of one message on several lines share one [`Commit`]:
//! all are written or none.
//!
//! Frames submitted in a burst (within 20 µs of the previous one: many calls
//! at once) are queued even when the line is idle, and the writer yields
//! once before it gathers the queue, so the burst goes in one vectored write
//! (and one wake-up of the reader) instead of one write per call.
//!
//! A *probe* (the connection ended on the other side) makes the writer drop
//! the connection and reconnect at once; if that fails, the peer is reported
//! gone. Probes and frames share the queue, and the inline path is open only
//! when nothing is queued, so a frame begun inline is always finished on the
//! connection it began on.
//!
//! An *open* (a worker joining a dynamic group, before it tells a member)
//! makes the writer open the connection now, if it has none, and report
//! how that went; the frames that follow use it.

use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use rallypoint_collectives::nosigpipe::try_send_vectored;
use rallypoint_sync::MutexExt;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::{mpsc, oneshot};

use super::{connect, write_vectored_all, ConnectFailed, Shared};
use crate::transport::Event;
use crate::wire::FrameHead;

/// The fate of one message, shared by its parts.
#[derive(Default)]
pub(super) struct Commit(AtomicU8);

const PENDING: u8 = 0;
const COMMITTED: u8 = 1;
const CANCELLED: u8 = 2;

impl Commit {
    /// Whether to write a part whose caller is (or is not) still waiting:
    /// yes once any part was begun; no once the caller left before that.
    fn decide(&self, caller_waits: bool) -> bool {
        let want = if caller_waits { COMMITTED } else { CANCELLED };
        match self
            .0
            .compare_exchange(PENDING, want, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => caller_waits,
            Err(state) => state == COMMITTED,
        }
    }
}

/// One part of a message.
pub(super) struct Frame {
    pub head: FrameHead,
    pub env: Bytes,
    pub bulk: Vec<Bytes>,
    pub commit: Arc<Commit>,
    pub done: oneshot::Sender<Result<(), String>>,
    /// Bytes already written (inline) on the line's connection.
    skip: usize,
}

impl Frame {
    pub fn new(
        head: FrameHead,
        env: Bytes,
        bulk: Vec<Bytes>,
        commit: Arc<Commit>,
        done: oneshot::Sender<Result<(), String>>,
    ) -> Frame {
        Frame {
            head,
            env,
            bulk,
            commit,
            done,
            skip: 0,
        }
    }

    fn len(&self) -> usize {
        super::HEAD_LEN + self.env.len() + self.bulk.iter().map(Bytes::len).sum::<usize>()
    }

    /// The frame's bytes from `skip` on, as slices (the header in `hb`).
    fn slices<'a>(&'a self, hb: &'a [u8]) -> Vec<IoSlice<'a>> {
        let mut v = Vec::with_capacity(self.bulk.len() + 2);
        v.push(IoSlice::new(hb));
        if !self.env.is_empty() {
            v.push(IoSlice::new(&self.env));
        }
        v.extend(self.bulk.iter().map(|b| IoSlice::new(b)));
        v
    }
}

enum Job {
    Frame(Frame),
    Probe(String),
    /// Open the connection now if there is none, and say how that went.
    Open(oneshot::Sender<Result<(), ConnectFailed>>),
}

struct State {
    /// The connection, while the writer is not using it.
    conn: Option<OwnedWriteHalf>,
    /// Jobs queued or in hand: the inline path is open only at 0.
    busy: usize,
    /// When the last frame was submitted: frames submitted close together
    /// (a burst of calls) are queued, so the writer sends them in one write.
    last: Option<std::time::Instant>,
}

/// Frames submitted within this of the previous one are a burst.
const BURST: std::time::Duration = std::time::Duration::from_micros(20);

/// What [`Line::submit`] did with a frame.
pub(super) enum Submitted {
    /// Written whole, at once.
    Written,
    /// Queued: its `done` will say.
    Queued,
    /// Not sent: the line is closed (the peer left).
    Closed,
    /// Failed at once.
    Failed(String),
}

/// One outgoing stream.
pub(super) struct Line {
    tx: mpsc::UnboundedSender<Job>,
    state: Arc<Mutex<State>>,
    /// Stream 0 writes from the caller when idle; bulk streams always go
    /// through their writer, on the bulk runtime.
    inline: bool,
}

impl Line {
    /// A line to `to` (whose address is in `addr`) for stream `stream`; its
    /// writer runs until the line is dropped, then shuts the connection.
    pub fn start(
        sh: &Arc<Shared>,
        to: u32,
        addr: Arc<Mutex<Option<SocketAddr>>>,
        stream: u16,
    ) -> Line {
        let (tx, rx) = mpsc::unbounded_channel();
        let state = Arc::new(Mutex::new(State {
            conn: None,
            busy: 0,
            last: None,
        }));
        let w = writer(sh.clone(), to, addr, stream, state.clone(), rx);
        let h = match (stream, sh.bulk_handle()) {
            (0, _) | (_, None) => tokio::spawn(w),
            (_, Some(bulk)) => bulk.spawn(w),
        };
        let mut ws = sh.writers.locked();
        ws.retain(|h| !h.is_finished());
        ws.push(h);
        Line {
            tx,
            state,
            inline: stream == 0,
        }
    }

    /// Writes `f` at once if the line is idle and the socket takes all of
    /// it, else queues it (a frame begun inline is finished by the writer).
    pub fn submit(&self, mut f: Frame) -> Submitted {
        let mut st = self.state.locked();
        let now = std::time::Instant::now();
        let burst = st
            .last
            .is_some_and(|t| now.saturating_duration_since(t) < BURST);
        st.last = Some(now);
        if st.busy == 0 && self.inline && !burst {
            if let Some(w) = &st.conn {
                let hb = f.head.encode();
                let mut slices = f.slices(&hb);
                let mut bufs = &mut slices[..];
                let mut written = 0;
                let failed = loop {
                    if bufs.is_empty() {
                        break false;
                    }
                    match try_send_vectored(w.as_ref(), bufs) {
                        Ok(0) => break true,
                        Ok(n) => {
                            written += n;
                            IoSlice::advance_slices(&mut bufs, n);
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
                        Err(_) => break true,
                    }
                };
                drop(slices);
                if written > 0 {
                    // Begun: the message is committed (its other parts too).
                    f.commit.decide(true);
                }
                if written == f.len() && !failed {
                    return Submitted::Written;
                }
                if failed {
                    // The connection is broken: the writer reconnects.
                    st.conn = None;
                    if written > 0 {
                        return Submitted::Failed("the connection failed mid-frame".into());
                    }
                } else {
                    // The writer finishes it, whatever the caller does.
                    f.skip = written;
                }
            }
        }
        st.busy += 1;
        match self.tx.send(Job::Frame(f)) {
            Ok(()) => Submitted::Queued,
            Err(_) => {
                st.busy -= 1;
                Submitted::Closed
            }
        }
    }

    /// Opens the line's connection now, unless it has one (`init_rpc`
    /// proves the job secret on it early). A failure is only reported here:
    /// the frames that follow try again, and find the peer gone if it is.
    pub async fn open(&self) -> Result<(), ConnectFailed> {
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.state.locked();
            if st.conn.is_some() {
                return Ok(());
            }
            st.busy += 1;
            if self.tx.send(Job::Open(tx)).is_err() {
                st.busy -= 1;
            }
        }
        rx.await.unwrap_or_else(|_| {
            Err(ConnectFailed {
                refused: false,
                secret: false,
                why: "the connection was closed (the peer left, or shutdown)".into(),
            })
        })
    }

    /// The connection ended on the other side: reconnect, or report the peer
    /// gone.
    pub fn probe(&self, why: String) {
        let mut st = self.state.locked();
        st.busy += 1;
        if self.tx.send(Job::Probe(why)).is_err() {
            st.busy -= 1;
        }
    }
}

/// [`Job::Open`]: opens the connection unless the line has one, and says
/// how that went.
async fn open_now<F>(
    state: &Mutex<State>,
    open: impl FnOnce() -> F,
    reply: oneshot::Sender<Result<(), ConnectFailed>>,
) where
    F: std::future::Future<Output = Result<OwnedWriteHalf, ConnectFailed>>,
{
    let has = state.locked().conn.is_some();
    let fresh = if has { None } else { Some(open().await) };
    let mut st = state.locked();
    st.busy -= 1;
    let r = match fresh {
        None => Ok(()),
        Some(Ok(w)) => {
            st.conn = Some(w);
            Ok(())
        }
        Some(Err(e)) => Err(e),
    };
    drop(st);
    let _ = reply.send(r);
}

/// Most slices (`writev`'s limit is 1024) and bytes one batched write takes.
const BATCH_SLICES: usize = 512;
const BATCH_BYTES: usize = 1 << 20;

/// The line's writer: takes jobs in order, and writes the frames queued
/// together in one vectored write.
async fn writer(
    sh: Arc<Shared>,
    to: u32,
    addr: Arc<Mutex<Option<SocketAddr>>>,
    stream: u16,
    state: Arc<Mutex<State>>,
    mut jobs: mpsc::UnboundedReceiver<Job>,
) {
    let open = || async {
        let a = (*addr.locked()).ok_or_else(|| ConnectFailed {
            refused: false,
            secret: false,
            why: format!("worker {to} has left"),
        })?;
        connect(&sh, to, a, stream).await
    };
    // A probe taken while gathering a batch, handled next.
    let mut stashed: Option<Job> = None;
    loop {
        let job = match stashed.take() {
            Some(j) => j,
            None => match jobs.recv().await {
                Some(j) => j,
                None => break,
            },
        };
        let f = match job {
            Job::Probe(why) => {
                state.locked().conn = None;
                let fresh = open().await;
                let mut st = state.locked();
                st.busy -= 1;
                match fresh {
                    Ok(w) => st.conn = Some(w),
                    Err(e) => {
                        drop(st);
                        let reason = format!("{why}, and reconnecting failed: {e}");
                        (sh.deliver)(Event::Gone { peer: to, reason });
                    }
                }
                continue;
            }
            Job::Open(reply) => {
                open_now(&state, &open, reply).await;
                continue;
            }
            Job::Frame(f) => f,
        };
        if !f.commit.decide(!f.done.is_closed()) {
            state.locked().busy -= 1;
            continue;
        }
        let taken = state.locked().conn.take();
        let w = match (taken, f.skip) {
            (Some(w), _) => Ok(w),
            (None, 0) => match open().await {
                Ok(w) => Ok(w),
                Err(e) => {
                    if e.refused {
                        // Nothing listens there any more: the peer is gone.
                        let reason = format!("connecting to it failed: {e}");
                        (sh.deliver)(Event::Gone { peer: to, reason });
                    }
                    Err(e.why)
                }
            },
            // Begun on a connection that is gone: it cannot be resumed.
            (None, _) => Err("the connection failed mid-frame".to_owned()),
        };
        let mut batch = vec![f];
        let (r, back) = match w {
            Err(e) => (Err((e, 0)), None),
            Ok(w) => {
                // Frames queued behind this one go in the same write; let
                // the tasks that are about to queue theirs run first.
                if batch[0].skip == 0 {
                    tokio::task::yield_now().await;
                }
                let mut slices_left = BATCH_SLICES.saturating_sub(batch[0].bulk.len() + 2);
                let mut bytes = batch[0].len();
                while bytes < BATCH_BYTES && slices_left > 0 {
                    match jobs.try_recv() {
                        Ok(Job::Frame(g)) => {
                            if g.bulk.len() + 2 > slices_left {
                                stashed = Some(Job::Frame(g));
                                break;
                            }
                            if g.commit.decide(!g.done.is_closed()) {
                                slices_left -= g.bulk.len() + 2;
                                bytes += g.len();
                                batch.push(g);
                            } else {
                                state.locked().busy -= 1;
                            }
                        }
                        Ok(other) => {
                            stashed = Some(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                let heads: Vec<[u8; super::HEAD_LEN]> =
                    batch.iter().map(|f| f.head.encode()).collect();
                let mut slices = Vec::new();
                for (f, hb) in batch.iter().zip(&heads) {
                    slices.extend(f.slices(hb));
                }
                let mut bufs = &mut slices[..];
                IoSlice::advance_slices(&mut bufs, batch[0].skip);
                let stamp = sh.alive.stamp(to);
                let progress = || sh.alive.mark(&stamp);
                match write_vectored_all(&w, bufs, &progress).await {
                    Ok(()) => (Ok(()), Some(w)),
                    // Half a frame may be on it: never write on it again.
                    Err((e, n)) => (Err((format!("writing to worker {to}: {e}"), n)), None),
                }
            }
        };
        {
            let mut st = state.locked();
            st.conn = back;
            st.busy -= batch.len();
        }
        // The frames written whole before a failure were sent: say so (a
        // call told otherwise would cancel the RRef forks its message
        // delivered).
        let mut end = 0;
        for (i, f) in batch.into_iter().enumerate() {
            let r = match &r {
                Ok(()) => Ok(()),
                Err((e, n)) => {
                    end += f.len() - if i == 0 { f.skip } else { 0 };
                    if end <= *n {
                        Ok(())
                    } else {
                        Err(e.clone())
                    }
                }
            };
            let _ = f.done.send(r);
        }
    }
    let last = state.locked().conn.take();
    if let Some(mut w) = last {
        let _ = w.shutdown().await;
    }
}
