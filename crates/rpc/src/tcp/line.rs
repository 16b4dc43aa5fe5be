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
//! A *probe* (the connection ended on the other side) makes the writer drop
//! the connection and reconnect at once; if that fails, the peer is reported
//! gone. Probes and frames share the queue, and the inline path is open only
//! when nothing is queued, so a frame begun inline is always finished on the
//! connection it began on.

use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
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
}

struct State {
    /// The connection, while the writer is not using it.
    conn: Option<OwnedWriteHalf>,
    /// Jobs queued or in hand: the inline path is open only at 0.
    busy: usize,
}

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
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
        }));
        let w = writer(sh.clone(), to, addr, stream, state.clone(), rx);
        let mut ws = sh.writers.lock().unwrap_or_else(|e| e.into_inner());
        ws.retain(|h| !h.is_finished());
        ws.push(tokio::spawn(w));
        Line { tx, state }
    }

    /// Writes `f` at once if the line is idle and the socket takes all of
    /// it, else queues it (a frame begun inline is finished by the writer).
    pub fn submit(&self, mut f: Frame) -> Submitted {
        let mut st = lock(&self.state);
        if st.busy == 0 {
            if let Some(w) = &st.conn {
                let hb = f.head.encode();
                let mut slices = f.slices(&hb);
                let mut bufs = &mut slices[..];
                let mut written = 0;
                let failed = loop {
                    if bufs.is_empty() {
                        break false;
                    }
                    match w.try_write_vectored(bufs) {
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

    /// The connection ended on the other side: reconnect, or report the peer
    /// gone.
    pub fn probe(&self, why: String) {
        let mut st = lock(&self.state);
        st.busy += 1;
        if self.tx.send(Job::Probe(why)).is_err() {
            st.busy -= 1;
        }
    }
}

/// The line's writer: takes jobs in order.
async fn writer(
    sh: Arc<Shared>,
    to: u32,
    addr: Arc<Mutex<Option<SocketAddr>>>,
    stream: u16,
    state: Arc<Mutex<State>>,
    mut jobs: mpsc::UnboundedReceiver<Job>,
) {
    let open = || async {
        let a = (*addr.lock().unwrap_or_else(|e| e.into_inner())).ok_or_else(|| ConnectFailed {
            refused: false,
            why: format!("worker {to} has left"),
        })?;
        connect(&sh, to, a, stream).await
    };
    while let Some(job) = jobs.recv().await {
        let f = match job {
            Job::Probe(why) => {
                lock(&state).conn = None;
                let fresh = open().await;
                let mut st = lock(&state);
                st.busy -= 1;
                match fresh {
                    Ok(w) => st.conn = Some(w),
                    Err(e) => {
                        drop(st);
                        let reason = format!("{why}, and reconnecting failed: {e}");
                        let _ = (sh.deliver)(Event::Gone { peer: to, reason });
                    }
                }
                continue;
            }
            Job::Frame(f) => f,
        };
        if !f.commit.decide(!f.done.is_closed()) {
            lock(&state).busy -= 1;
            continue;
        }
        let taken = lock(&state).conn.take();
        let w = match (taken, f.skip) {
            (Some(w), _) => Ok(w),
            (None, 0) => match open().await {
                Ok(w) => Ok(w),
                Err(e) => {
                    if e.refused {
                        // Nothing listens there any more: the peer is gone.
                        let reason = format!("connecting to it failed: {e}");
                        let _ = (sh.deliver)(Event::Gone { peer: to, reason });
                    }
                    Err(e.why)
                }
            },
            // Begun on a connection that is gone: it cannot be resumed.
            (None, _) => Err("the connection failed mid-frame".to_owned()),
        };
        let (r, back) = match w {
            Err(e) => (Err(e), None),
            Ok(mut w) => {
                let hb = f.head.encode();
                let mut slices = f.slices(&hb);
                let mut bufs = &mut slices[..];
                IoSlice::advance_slices(&mut bufs, f.skip);
                let stamp = sh.alive.stamp(to);
                let progress = || sh.alive.mark(&stamp);
                match write_vectored_all(&mut w, bufs, &progress).await {
                    Ok(()) => (Ok(()), Some(w)),
                    // Half a frame may be on it: never write on it again.
                    Err(e) => (Err(format!("writing to worker {to}: {e}")), None),
                }
            }
        };
        {
            let mut st = lock(&state);
            st.conn = back;
            st.busy -= 1;
        }
        let _ = f.done.send(r);
    }
    let last = lock(&state).conn.take();
    if let Some(mut w) = last {
        let _ = w.shutdown().await;
    }
}
