//! Fault injection for tests (feature `faults`): killing this rank, at
//! once or at its `n`th frame, and breaking a connection part-way through
//! a frame.

use std::sync::atomic::Ordering;
use std::sync::Arc;

#[cfg(feature = "faults")]
use tokio::io::AsyncWriteExt;

use super::Shared;
#[cfg(feature = "faults")]
use super::{lock, Conn, Origin};
#[cfg(feature = "faults")]
use crate::error::Error;

impl Shared {
    /// Whether this rank was killed (fault injection).
    pub fn is_dead(&self) -> bool {
        self.faults.dead.load(Ordering::Relaxed)
    }

    /// Counts a data frame (or a shared-memory stage) about to be sent, for
    /// `Shared::kill_at_frame` (feature `faults`).
    pub fn count_frame(self: &Arc<Self>) {
        #[cfg(feature = "faults")]
        if self.faults.frames.fetch_add(1, Ordering::Relaxed)
            >= self.faults.kill_at.load(Ordering::Relaxed)
        {
            self.kill();
        }
    }

    /// Test fault: this rank dies as a SIGKILLed process does. Its listener
    /// and connections close with no goodbye and no abort (peers see EOF or a
    /// reset), nothing is written to the store, and its own operations fail.
    #[cfg(feature = "faults")]
    pub fn kill(self: &Arc<Self>) {
        if self.faults.dead.swap(true, Ordering::Relaxed) {
            return;
        }
        self.cancel.cancel();
        lock(&self.peers).clear();
        let (hearers, comms): (Vec<_>, Vec<u64>) = {
            let r = lock(&self.router);
            let live = || r.groups().live();
            (
                live()
                    .filter_map(|(_, g)| g.hearer.as_ref()?.upgrade())
                    .collect(),
                live()
                    .filter(|(_, g)| g.members.is_some())
                    .map(|(c, _)| c)
                    .collect(),
            )
        };
        for h in hearers {
            h.killed();
        }
        for comm in comms {
            let err = Error::Aborted {
                group: self.cfg.name.clone(),
                reason: "this rank was killed (fault injection)".into(),
                by: None,
            };
            self.abort(comm, err, Origin::Passed(None), 0);
        }
    }

    /// Test fault: [`Shared::kill`] when about to send the `n`-th data frame
    /// from now (0: the next).
    #[cfg(feature = "faults")]
    pub fn kill_at_frame(&self, n: u64) {
        let now = self.faults.frames.load(Ordering::Relaxed);
        self.faults.kill_at.store(now + n, Ordering::Relaxed);
    }

    #[cfg(feature = "faults")]
    pub fn killed(&self) -> bool {
        self.is_dead()
    }

    /// Test fault: when about to send the `n`-th TCP frame from now (data or
    /// control; 0: the next), writes its first `after` bytes (header and payload;
    /// all of them or more: the whole frame), then resets the connection,
    /// as a middlebox or a short outage can, while this rank lives on. The
    /// send reports success: what was written before a reset is lost
    /// without the writer knowing.
    #[cfg(feature = "faults")]
    pub fn break_at_frame(&self, n: u64, after: u64) {
        let now = self.faults.tcp_frames.load(Ordering::Relaxed);
        self.faults.break_after.store(after, Ordering::Relaxed);
        self.faults.break_at.store(now + n, Ordering::Relaxed);
    }

    /// Whether [`Shared::break_at_frame`] broke a connection.
    #[cfg(feature = "faults")]
    pub fn broke(&self) -> bool {
        self.faults.broke.load(Ordering::Relaxed)
    }

    /// [`Shared::break_at_frame`]'s turn: whether this frame breaks its
    /// connection, and if so, after how many bytes.
    #[cfg(feature = "faults")]
    pub(super) fn breaks_here(&self) -> Option<usize> {
        if self.faults.tcp_frames.fetch_add(1, Ordering::Relaxed)
            == self.faults.break_at.load(Ordering::Relaxed)
        {
            self.faults.broke.store(true, Ordering::Relaxed);
            return Some(self.faults.break_after.load(Ordering::Relaxed) as usize);
        }
        None
    }
}

/// Test fault: writes the first `after` bytes of a frame to `conn`, then
/// resets it (see [`Shared::break_at_frame`]).
#[cfg(feature = "faults")]
pub(super) async fn break_conn(conn: &Conn, head: &[u8], payload: &[u8], after: usize) {
    use std::os::fd::AsRawFd;
    let mut w = conn.writer.lock().await;
    let n = after.min(head.len());
    let _ = w.write_all(&head[..n]).await;
    let m = (after - n).min(payload.len());
    let _ = w.write_all(&payload[..m]).await;
    // A `connect` to no address (`AF_UNSPEC`) disconnects a TCP socket,
    // with a reset (Linux `tcp_disconnect`); the descriptor stays ours, and
    // both halves then fail.
    let fd = w.as_ref().as_raw_fd();
    // SAFETY: a zeroed `sockaddr` with family `AF_UNSPEC` is a valid
    // argument of its stated length, and `fd` is this connection's socket,
    // open while `w` is held.
    unsafe {
        let mut a: libc::sockaddr = std::mem::zeroed();
        a.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
        libc::connect(
            fd,
            &a,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        );
    }
}
