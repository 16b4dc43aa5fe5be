//! Calls found diverged: held for the first mismatch's abort, reported only
//! if none comes.
//!
//! Every data and want frame carries a hash of the calls before it on its
//! group ([`crate::frame::Desc::hist`]). A clash between calls whose
//! histories differ ([`Clash::diverged`]) is not the first mismatch but a
//! consequence of it: the ranks' calls differed at an earlier op, where some
//! rank (one whose frames cross between the two sides there) finds the calls
//! that differ and aborts the group from that op, which fails the later ones
//! too. So a rank that finds calls diverged holds what it found:
//!
//! - The first such finding on a group starts a **grace**
//!   ([`DIVERGED_GRACE`], or four probes if longer: the first mismatch may be
//!   found only by a probe). The ops that clashed wait meanwhile: their
//!   frames are not delivered.
//! - Only if no abort fails the lowest op found diverged by then (the ranks
//!   that could tell died, or exchanged nothing at the first difference) does
//!   the rank abort from that op with what it found, as [`Error::Diverged`],
//!   recorded in the store and told to every member like any failure found
//!   here; a lower op found diverged after the grace aborts at once.
//! - A rank that cannot wait the grace out reports what it found
//!   **provisionally** ([`Origin::Leaving`]): the members it is connected
//!   with hold the report as if they had found it themselves, with a grace
//!   of their own, and any abort from the same op or an earlier one
//!   supersedes it. That is a rank that **leaves the group** (drops it: its
//!   process exits) during the grace, and one whose op's **deadline** passes
//!   during it ([`Shared::give_up_diverged`]: the op fails with what was
//!   found, not as a timeout). Reporting it as final, as this module once
//!   did as a rank left, let a rank whose part was only to send, and that
//!   had finished, preempt the first mismatch on the others (simulator seed
//!   1189, with the first mismatch found by a rank slower than the one
//!   leaving).
//! - An operation that fails on a **peer gone** while its group holds such a
//!   finding waits for the grace to settle first ([`Shared::settle_diverged`]):
//!   the peer is most likely a bystander that finished its part and exited
//!   (a rank whose calls differ from ours sends us nothing we can take), and
//!   the first mismatch is the cause to report.
//!
//! A finding is kept for the group's life once made (a group whose calls
//! diverged is aborted for good). Shared memory compares calls without their
//! histories (its calls meet in one place, in order), so only the TCP
//! transport holds; a provisional report about an internal group of a group
//! on several hosts is held for the group, at the op that owns the step.
//!
//! The rules above are a state machine without I/O, in
//! `diverged/finding.rs`; this file keeps one per group (in its entry) and
//! carries out what it decides.

mod finding;

use std::sync::Arc;

use tokio::sync::watch;
use tokio::time::{sleep, sleep_until, Instant};

use super::{lock, Clash, Origin, Shared};
use crate::error::{Error, DIVERGED_GRACE};
use finding::{Finding, Found};

/// A group's finding of diverged calls, held (see the module docs).
pub(crate) struct Held {
    finding: Finding,
    /// Turns true when the grace has ended and its outcome is in place.
    settled: watch::Receiver<bool>,
}

impl Shared {
    /// Holds a clash of calls found diverged here.
    pub(super) fn hold(self: &Arc<Self>, c: Clash) {
        let err = self.clash_error(&c);
        tracing::debug!(
            rank = self.cfg.rank,
            comm = c.comm,
            seq = c.seq,
            "calls found diverged: {err}"
        );
        self.hold_finding(c.comm, c.seq, err);
    }

    /// Holds calls found diverged by member `peer`, which reported them
    /// provisionally (from op `from`).
    pub(super) fn hold_told(self: &Arc<Self>, comm: u64, err: Error, from: u64, peer: usize) {
        // About an internal group: held for its group, at the op that owns
        // the step (whose own provisional report comes too).
        let (comm, from) = match self.parent_link(comm) {
            Some(l) => (l.parent, l.parent_seq(from)),
            None => (comm, from),
        };
        tracing::debug!(
            rank = self.cfg.rank,
            comm,
            from,
            peer,
            "told of calls found diverged: {err}"
        );
        if self.aborted_for(comm, Some(from)).is_some() {
            return;
        }
        self.hold_finding(comm, from, err);
    }

    fn hold_finding(self: &Arc<Self>, comm: u64, seq: u64, err: Error) {
        let tx = {
            // Under the router's lock, as `Shared::retire` checks for a
            // finding: a group retired here runs no op, and its finding
            // would be held for nothing.
            let mut r = lock(&self.router);
            let Some(g) = r.groups_mut().entry(comm) else {
                return;
            };
            match finding::found(g.finding.as_mut().map(|h| &mut h.finding), seq, err) {
                Found::StartGrace(finding) => {
                    let (tx, rx) = watch::channel(false);
                    g.finding = Some(Held {
                        finding,
                        settled: rx,
                    });
                    tx
                }
                Found::AbortNow { seq, err } => {
                    drop(r);
                    return self.abort(comm, err, Origin::Here, seq);
                }
                Found::Lowered | Found::Ignore => return,
            }
        };
        let me = self.clone();
        let grace = DIVERGED_GRACE.max(self.cfg.probe_after * 4);
        self.rt.spawn(async move {
            let leaving = tokio::select! {
                _ = sleep(grace) => false,
                _ = me.cancel.cancelled() => true,
            };
            let lowest = me.finding(comm, |held| held.finding.end_grace(leaving));
            if let Some((seq, err, how)) = lowest {
                tracing::debug!(
                    rank = me.cfg.rank,
                    comm,
                    seq,
                    leaving,
                    "the grace of calls found diverged ended"
                );
                me.abort(comm, err, how, seq);
            }
            let _ = tx.send(true);
        });
    }

    /// `f` on the calls found diverged held for group `comm`, if any.
    fn finding<R>(&self, comm: u64, f: impl FnOnce(&mut Held) -> R) -> Option<R> {
        let mut r = lock(&self.router);
        r.groups_mut().get_mut(comm)?.finding.as_mut().map(f)
    }

    /// For an op (collective `seq` of group `comm`) whose deadline passed:
    /// the group's abort that fails it, if one is in place; else, if calls
    /// found diverged at `seq` or before are held, what they report (they
    /// are why it waited, not the rank it waited for), reported
    /// provisionally from their op (see the module docs).
    pub fn give_up_diverged(self: &Arc<Self>, comm: u64, seq: u64) -> Option<Error> {
        if let Some(e) = self.aborted_for(comm, Some(seq)) {
            return Some(e);
        }
        let (at, err) = self.finding(comm, |h| h.finding.give_up(seq)).flatten()?;
        self.abort(comm, err.clone(), Origin::Leaving, at);
        Some(self.aborted_for(comm, Some(seq)).unwrap_or(err))
    }

    /// Waits (until `deadline` at the latest) while calls found diverged on
    /// group `comm` are held in their grace and no abort fails the op they
    /// were found at (the first mismatch's would): the wait ends when the
    /// grace ends or such an abort comes.
    pub async fn settle_diverged(&self, comm: u64, deadline: Instant) {
        loop {
            let held = self.finding(comm, |h| {
                let at = h.finding.in_grace()?;
                Some((at, h.settled.clone()))
            });
            let Some((at, mut settled)) = held.flatten() else {
                return;
            };
            let aborted = {
                let mut r = lock(&self.router);
                if r.aborted_for(comm, Some(at)).is_some() {
                    return;
                }
                r.abort_signal(comm)
            };
            tokio::select! {
                _ = settled.wait_for(|s| *s) => return,
                _ = aborted.cancelled() => {}
                _ = self.cancel.cancelled() => return,
                _ = sleep_until(deadline) => return,
            }
        }
    }
}
