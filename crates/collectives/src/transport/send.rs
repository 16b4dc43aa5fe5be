//! Frames out: sending a frame to a peer within an op's deadline and its
//! credit (flow control), writing frames whole even when the op writing one
//! is cancelled ([`WholeFrame`]), and the per-peer task that sends the flow
//! and want frames the router queues, in order ([`control_loop`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::time::{sleep, sleep_until, timeout, timeout_at, Instant};

use super::flow::{Go, Release};
use super::router::{Fail, Router};
use super::{lock, Shared, ABORT_DEADLINE};
use crate::frame::Header;

impl Shared {
    /// Sends one data frame of group `comm` to world rank `dst`; an abort of
    /// the group ends the wait (connecting, or writing to a full socket).
    pub async fn send(
        self: &Arc<Self>,
        dst: usize,
        header: &Header,
        payload: &[u8],
        pick: usize,
        deadline: Instant,
    ) -> Result<(), Fail> {
        let Header::Data {
            comm, seq, desc, ..
        } = *header
        else {
            unreachable!("only data frames are sent this way")
        };
        let release = Release::of(comm, seq, &desc);
        let seq = (!release.p2p).then_some(seq);
        self.count_frame();
        let signal = {
            let mut r = lock(&self.router);
            if let Some(e) = r.aborted_for(comm, seq) {
                return Err(Fail::Aborted(e));
            }
            r.abort_signal(comm)
        };
        let send = async {
            self.clear_to_send(dst, release, payload.len() as u64, deadline)
                .await?;
            self.send_frame(dst, header, payload, pick, deadline).await
        };
        tokio::pin!(send);
        let mut signal = signal;
        loop {
            tokio::select! {
                r = &mut send => return r,
                _ = signal.cancelled() => {}
            }
            let mut r = lock(&self.router);
            if let Some(e) = r.aborted_for(comm, seq) {
                return Err(Fail::Aborted(e));
            }
            // An abort from a later op: this one goes on, woken again if the
            // abort widens.
            signal = r.abort_signal(comm);
        }
    }

    /// Waits until `dst` has credit for `len` more bytes, or has asked for
    /// `r`; the bytes are counted as sent.
    pub(super) async fn clear_to_send(
        self: &Arc<Self>,
        dst: usize,
        r: Release,
        len: u64,
        deadline: Instant,
    ) -> Result<(), Fail> {
        loop {
            let changed = self.flow_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match lock(&self.outbound).send(dst, &r, len) {
                Go::Now => return Ok(()),
                Go::Wait { say: true } => {
                    tracing::debug!(peer = dst, "out of credit");
                    self.queue(
                        dst,
                        Header::Flow {
                            credit: 0,
                            blocked: true,
                        },
                    );
                }
                Go::Wait { say: false } => {}
            }
            if let Some(reason) = lock(&self.router).gone(dst) {
                return Err(Fail::Gone {
                    rank: dst,
                    reason: reason.clone(),
                });
            }
            tokio::select! {
                _ = changed => {}
                _ = sleep_until(deadline) => return Err(Fail::Timeout),
                _ = self.cancel.cancelled() => return Err(Fail::Gone {
                    rank: dst,
                    reason: "the transport shut down".into(),
                }),
            }
        }
    }

    /// Sends one frame to world rank `dst`, whole (see [`WholeFrame`]).
    pub(super) async fn send_frame(
        self: &Arc<Self>,
        dst: usize,
        header: &Header,
        payload: &[u8],
        pick: usize,
        deadline: Instant,
    ) -> Result<(), Fail> {
        if let Some(reason) = lock(&self.router).gone(dst) {
            return Err(Fail::Gone {
                rank: dst,
                reason: reason.clone(),
            });
        }
        // With one stream per peer every frame to `dst` takes the same
        // connection (the first; a second exists when both sides opened one
        // at once), so a peer reads them in the order sent: it compares our
        // frames of a mismatched op before it can use our frames of the next.
        let pick = if self.cfg.streams > 1 { pick } else { 0 };
        let conn = self.conn(dst, pick, deadline).await?;
        let head = header.encode();
        #[cfg(feature = "faults")]
        if let Some(after) = self.breaks_here() {
            super::faults::break_conn(&conn, &head, payload, after).await;
            return Ok(());
        }
        let write = async {
            let mut frame = WholeFrame {
                w: Some(conn.writer.clone().lock_owned().await),
                parts: [&head, payload],
                written: 0,
                rt: &self.rt,
                finish_within: self.cfg.peer_timeout.max(ABORT_DEADLINE),
            };
            frame.write().await
        };
        match timeout_at(deadline, write).await {
            Err(_) => Err(Fail::Timeout),
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                // This send fails, but the peer is marked gone by its reader,
                // after the frames it sent before it went (still unread in our
                // socket) have been delivered: a peer that did its part and
                // exited must not fail an op that has its frames.
                let reason = format!("sending to it failed: {e}");
                // Its host has not answered for `peer_timeout`: gone (see
                // `host_silent`).
                if e.kind() == std::io::ErrorKind::TimedOut {
                    return Err(Fail::Gone { rank: dst, reason });
                }
                // Dead, or alive with this connection broken (a reset): a
                // connection of its own tells which, so a live rank is not
                // named gone.
                let within =
                    deadline.min(Instant::now() + self.cfg.handshake_timeout + ABORT_DEADLINE);
                match self.open(dst, within).await {
                    Ok(s) => {
                        self.register(dst, s);
                        Err(Fail::Lost { rank: dst, reason })
                    }
                    Err(_) => Err(Fail::Gone { rank: dst, reason }),
                }
            }
        }
    }

    /// Whether this rank is out of credit with `peer` (it has sent more than
    /// the window that the peer's operations have not taken), for timeout
    /// messages.
    pub fn held_by(&self, peer: usize, comm: u64, seq: u64, p2p: bool, tag: u32) -> bool {
        let r = Release {
            comm,
            p2p,
            tag: if p2p { tag } else { 0 },
            seq,
        };
        lock(&self.outbound).waits_for(peer, &r)
    }

    /// Queues the flow and want frames the router decided (its lock held).
    pub(super) fn queue_control(self: &Arc<Self>, r: &mut Router) {
        for (peer, h) in r.take_control() {
            self.queue(peer, h);
        }
    }

    /// Queues a flow or want frame for `peer`, after those queued before.
    pub(super) fn queue(self: &Arc<Self>, peer: usize, h: Header) {
        let mut queues = lock(&self.control);
        let q = queues.entry(peer).or_insert_with(|| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            self.rt.spawn(control_loop(self.clone(), peer, rx));
            tx
        });
        let _ = q.send(h);
    }

    /// Applies a flow frame from `peer`.
    pub(super) fn flow(self: &Arc<Self>, peer: usize, credit: u64, blocked: bool) {
        if blocked {
            self.route(|r| r.peer_blocked(peer));
        } else {
            lock(&self.outbound).credit(peer, credit);
            self.flow_changed.notify_waiters();
        }
    }
}

/// A frame being written. Frames are written whole: if the write is dropped
/// part-way (its op timed out or was cancelled), the rest is copied and
/// finished in the background, still holding the connection's writer, so the
/// peer never reads the next frame (say, the abort that follows) as the rest of
/// this one's payload.
pub(super) struct WholeFrame<'a> {
    w: Option<tokio::sync::OwnedMutexGuard<OwnedWriteHalf>>,
    /// Header and payload.
    parts: [&'a [u8]; 2],
    written: usize,
    rt: &'a tokio::runtime::Handle,
    /// How long the background finish may take; then the connection's
    /// sending side is shut (the peer sees it end) rather than held forever.
    finish_within: Duration,
}

impl WholeFrame<'_> {
    /// Writes the frame, in one vectored write when the socket takes it.
    pub(super) async fn write(&mut self) -> std::io::Result<()> {
        let total = self.parts[0].len() + self.parts[1].len();
        let w = self.w.as_mut().expect("a frame is written once");
        while self.written < total {
            let (h, p) = rest(self.parts, self.written);
            let bufs = [std::io::IoSlice::new(h), std::io::IoSlice::new(p)];
            let n = crate::nosigpipe::send_vectored(w.as_ref(), &bufs).await;
            let n = match n {
                Ok(0) => Err(std::io::ErrorKind::WriteZero.into()),
                r => r,
            };
            match n {
                Ok(n) => self.written += n,
                Err(e) => {
                    // The connection is broken: nothing to finish.
                    self.w = None;
                    return Err(e);
                }
            }
        }
        self.w = None;
        Ok(())
    }
}

/// What is left of a header and a payload after `written` bytes.
pub(super) fn rest([h, p]: [&[u8]; 2], written: usize) -> (&[u8], &[u8]) {
    let from_head = written.min(h.len());
    (&h[from_head..], &p[written - from_head..])
}

impl Drop for WholeFrame<'_> {
    fn drop(&mut self) {
        let Some(mut w) = self.w.take() else { return };
        if self.written == 0 {
            return; // not begun: the connection is clean
        }
        let (h, p) = rest(self.parts, self.written);
        let rest = [h, p].concat();
        let within = self.finish_within;
        // On a runtime shutting down this is a no-op, and so is everything else.
        self.rt.spawn(async move {
            if !matches!(timeout(within, w.write_all(&rest)).await, Ok(Ok(()))) {
                let _ = w.shutdown().await;
            }
        });
    }
}

/// What the control loop does after a frame failed to go out: wait this
/// long and send it again, or drop it (`None`). A peer that is gone, or that
/// refused the handshake (another job's, or a stale group's listener on its
/// address), will never take it, and an aborted group needs it no more;
/// anything else (no answer to the handshake in time, a connection that
/// broke, a deadline) may pass, so it is retried, backing off from 10 ms to
/// 1 s (`attempt` counts this frame's failures, from 0).
pub(super) fn control_retry(f: &Fail, attempt: u32) -> Option<Duration> {
    match f {
        Fail::Gone { .. } | Fail::Refused { .. } | Fail::Secret { .. } | Fail::Aborted(_) => None,
        Fail::Unanswered { .. } | Fail::Lost { .. } | Fail::Timeout => Some(
            Duration::from_millis(10)
                .saturating_mul(1 << attempt.min(7))
                .min(Duration::from_secs(1)),
        ),
    }
}

/// Sends the flow and want frames queued for `peer`, in order. A frame is
/// dropped when it can never be taken ([`control_retry`]).
pub(super) async fn control_loop(
    shared: Arc<Shared>,
    peer: usize,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Header>,
) {
    loop {
        let h = tokio::select! {
            h = rx.recv() => match h { Some(h) => h, None => return },
            _ = shared.cancel.cancelled() => return,
        };
        // A lost credit or want would leave a sender waiting for good:
        // retried until sent or the peer is gone.
        for attempt in 0.. {
            let deadline = Instant::now() + shared.cfg.handshake_timeout + ABORT_DEADLINE;
            let Err(f) = shared.send_frame(peer, &h, &[], 0, deadline).await else {
                break;
            };
            let Some(wait) = control_retry(&f, attempt) else {
                if let Fail::Refused { reason, .. } | Fail::Secret { reason, .. } = &f {
                    tracing::warn!(
                        peer,
                        "a flow-control frame was dropped: the peer refused it: {reason}"
                    );
                }
                break;
            };
            tracing::debug!(peer, ?wait, "a flow-control frame was not sent; retrying");
            tokio::select! {
                _ = sleep(wait) => {}
                _ = shared.cancel.cancelled() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn control_frames_back_off_and_are_dropped_only_when_never_taken() {
        let ms = Duration::from_millis;
        let (rank, reason) = (1, String::from("x"));
        let aborted = Fail::Aborted(Error::Invalid("aborted".into()));
        for never in [
            Fail::Gone {
                rank,
                reason: reason.clone(),
            },
            Fail::Refused {
                rank,
                reason: reason.clone(),
            },
            aborted,
        ] {
            assert_eq!(control_retry(&never, 0), None);
        }
        for maybe in [
            Fail::Unanswered {
                rank,
                reason: reason.clone(),
            },
            Fail::Lost {
                rank,
                reason: reason.clone(),
            },
            Fail::Timeout,
        ] {
            let waits: Vec<_> = [0, 1, 2, 6, 7, 8, 1000]
                .iter()
                .map(|&a| control_retry(&maybe, a))
                .collect();
            assert_eq!(
                waits,
                [10, 20, 40, 640, 1000, 1000, 1000].map(|w| Some(ms(w)))
            );
        }
    }
}
