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
//!   the rank abort from that op with what it found, as [`Error::Diverged`];
//!   a lower op found diverged after the grace aborts at once.
//! - An operation whose **deadline** passes during the grace fails with what
//!   was found, not as a timeout ([`Shared::diverged_before`]).
//! - An operation that fails on a **peer gone** while its group holds such a
//!   finding waits for the grace to settle first ([`Shared::settle_diverged`]):
//!   the peer is most likely a bystander that finished its part and exited
//!   (a rank whose calls differ from ours sends us nothing we can take), and
//!   the first mismatch is the cause to report.
//! - A rank that **leaves the group** (drops it: its process exits) during
//!   the grace cannot wait it out. It reports what it found as it leaves, but
//!   provisionally ([`Origin::Leaving`]): the members it is connected with
//!   hold the report as if they had found it themselves, with a grace of
//!   their own. Reporting it as final, as this module once did, let a rank
//!   whose part was only to send, and that had finished, preempt the first
//!   mismatch on the others (simulator seed 1189, with the first mismatch
//!   found by a rank slower than the one leaving).
//!
//! Shared memory compares calls without their histories (its calls meet in
//! one place, in order), so only the TCP transport holds.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::time::{sleep, sleep_until, Instant};

use super::{lock, Clash, Origin, Shared};
use crate::error::{Error, DIVERGED_GRACE};

/// A group's finding of diverged calls, held (see the module docs).
pub(crate) struct Held {
    /// The lowest op found diverged so far.
    seq: u64,
    /// The error it reports.
    err: Error,
    /// Whence the finding: `None`, found here; a member that reported it
    /// provisionally as it left.
    told_by: Option<usize>,
    /// The grace ended (later findings abort at once).
    ended: bool,
    /// Turns true when the grace has ended and its outcome is in place.
    settled: watch::Receiver<bool>,
}

impl Shared {
    /// Holds a clash of calls found diverged here.
    pub(super) fn hold(self: &Arc<Self>, c: Clash) {
        let err = self.clash_error(&c);
        self.hold_finding(c.comm, c.seq, err, None);
    }

    /// Holds calls found diverged by member `peer`, which reported them
    /// provisionally as it left the group (from op `from`).
    pub(super) fn hold_told(self: &Arc<Self>, comm: u64, err: Error, from: u64, peer: usize) {
        if self.aborted_for(comm, Some(from)).is_some() {
            return;
        }
        self.hold_finding(comm, from, err, Some(peer));
    }

    fn hold_finding(self: &Arc<Self>, comm: u64, seq: u64, err: Error, told_by: Option<usize>) {
        tracing::debug!(
            rank = self.cfg.rank,
            comm,
            seq,
            ?told_by,
            "calls found diverged: {err}"
        );
        let tx = {
            let mut d = lock(&self.diverged);
            match d.get_mut(&comm) {
                None => {
                    let (tx, rx) = watch::channel(false);
                    d.insert(
                        comm,
                        Held {
                            seq,
                            err,
                            told_by,
                            ended: false,
                            settled: rx,
                        },
                    );
                    tx
                }
                // A lower op: kept, in the grace that runs, or reported at
                // once after it.
                Some(held) if seq < held.seq => {
                    held.seq = seq;
                    held.err = err.clone();
                    held.told_by = told_by;
                    if held.ended {
                        drop(d);
                        self.abort(comm, err, Self::reporting(told_by), seq);
                    }
                    return;
                }
                Some(_) => return,
            }
        };
        let me = self.clone();
        let grace = DIVERGED_GRACE.max(self.cfg.probe_after * 4);
        self.rt.spawn(async move {
            let leaving = tokio::select! {
                _ = sleep(grace) => false,
                _ = me.cancel.cancelled() => true,
            };
            let lowest = lock(&me.diverged).get_mut(&comm).map(|held| {
                held.ended = true;
                (held.seq, held.err.clone(), held.told_by)
            });
            if let Some((seq, err, told_by)) = lowest {
                tracing::debug!(
                    rank = me.cfg.rank,
                    comm,
                    seq,
                    leaving,
                    "the grace of calls found diverged ended"
                );
                if me.aborted_for(comm, Some(seq)).is_none() {
                    let how = if leaving {
                        Origin::Leaving
                    } else {
                        Self::reporting(told_by)
                    };
                    me.abort(comm, err, how, seq);
                }
            }
            let _ = tx.send(true);
        });
    }

    /// How a finding whose grace ended is reported: as found here, or as
    /// passed on from the member that reported it.
    fn reporting(told_by: Option<usize>) -> Origin {
        match told_by {
            None => Origin::Here,
            Some(p) => Origin::Passed(Some(p)),
        }
    }

    /// What calls found diverged on group `comm` at op `seq` or before, held
    /// in their grace, report: for an op whose deadline passed meanwhile
    /// (they are why it waited, not the rank it waited for).
    pub fn diverged_before(&self, comm: u64, seq: u64) -> Option<Error> {
        lock(&self.diverged)
            .get(&comm)
            .filter(|h| h.seq <= seq)
            .map(|h| h.err.clone())
    }

    /// Waits (until `deadline` at the latest) for the grace of calls found
    /// diverged on group `comm`, if one runs, to end or be cut short by an
    /// abort of the group.
    pub async fn settle_diverged(&self, comm: u64, deadline: Instant) {
        let Some(mut settled) = lock(&self.diverged).get(&comm).map(|h| h.settled.clone()) else {
            return;
        };
        let aborted = lock(&self.router).abort_signal(comm);
        tokio::select! {
            _ = settled.wait_for(|s| *s) => {}
            _ = aborted.cancelled() => {}
            _ = self.cancel.cancelled() => {}
            _ = sleep_until(deadline) => {}
        }
    }
}
