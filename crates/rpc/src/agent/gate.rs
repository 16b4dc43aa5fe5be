//! Work in flight on one worker, and graceful shutdown's gate on new work.
//!
//! Every call in flight (outgoing or being served) and every control message
//! is *active*. Graceful shutdown ends with rounds of "wait until idle, sum
//! the active counts over the group", until the sum is zero. A count read
//! before the sum and work started after the read would race: the sum could
//! be zero while a call has just left for a worker that is tearing down.
//!
//! So the count and the gate are one lock. Once shutdown's last phase has
//! begun (`closing`), the gate is shut whenever this worker's count is zero:
//! new outgoing work waits for the round's verdict. If the round was the last
//! (the sum was zero), it is refused with a shutdown error; if not, it goes
//! ahead and is counted by the next round (a round that ends with this worker
//! idle leaves the gate shut: the next round's read must find it shut too).
//!
//! Work arriving from other workers is always let in, and opens the gate: its
//! sender counts it, so no round can end while it is in flight, and what it
//! starts here (a nested call, an RRef's fork request) must not wait for a
//! verdict that waits for it.

use std::sync::{Arc, Mutex, MutexGuard};

use rallypoint_sync::MutexExt;
use tokio::sync::Notify;

#[derive(Default)]
struct State {
    active: usize,
    /// Shutdown's last phase has begun.
    closing: bool,
    /// New outgoing work waits for the verdict.
    shut: bool,
    /// The last round found nothing anywhere: refuse new work for good.
    ended: bool,
}

#[derive(Default)]
pub(crate) struct Gate {
    st: Mutex<State>,
    /// Woken when the count reaches zero and on every verdict.
    changed: Notify,
}

/// Whether work is started here for another worker (and may have to wait at
/// the gate) or comes from one (always let in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Work {
    Outgoing,
    Incoming,
}

/// One unit of active work; leaves the count when dropped.
pub(crate) struct Active(Arc<Gate>);

impl Drop for Active {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.active -= 1;
        if st.active == 0 {
            if st.closing {
                st.shut = true;
            }
            drop(st);
            self.0.changed.notify_waiters();
        }
    }
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.locked()
    }

    /// Counts new work at once if the gate lets it in now.
    pub(crate) fn try_enter(self: &Arc<Self>, work: Work) -> Option<Active> {
        let mut st = self.lock();
        if work == Work::Outgoing && (st.shut || st.ended) {
            return None;
        }
        st.active += 1;
        if work == Work::Incoming && st.shut {
            st.shut = false;
            drop(st);
            self.changed.notify_waiters();
        }
        Some(Active(self.clone()))
    }

    /// Counts new work, waiting at a shut gate for the round's verdict;
    /// `None` if shutdown ended (the work is refused).
    pub(crate) async fn enter(self: &Arc<Self>, work: Work) -> Option<Active> {
        loop {
            let n = self.changed.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            {
                let mut st = self.lock();
                if st.ended && work == Work::Outgoing {
                    return None;
                }
                if work == Work::Incoming || !st.shut {
                    st.active += 1;
                    if work == Work::Incoming && st.shut {
                        st.shut = false;
                        drop(st);
                        self.changed.notify_waiters();
                    }
                    return Some(Active(self.clone()));
                }
            }
            n.await;
        }
    }

    /// Work in flight now.
    pub(crate) fn count(&self) -> usize {
        self.lock().active
    }

    /// Shutdown's last phase begins: the gate shuts whenever the count is
    /// zero.
    pub(crate) fn close(&self) {
        let mut st = self.lock();
        st.closing = true;
        if st.active == 0 {
            st.shut = true;
        }
    }

    /// Waits until the count is zero (and, once closing, the gate shut).
    pub(crate) async fn idle(&self) {
        loop {
            let n = self.changed.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.lock().active == 0 {
                return;
            }
            n.await;
        }
    }

    /// The round's verdict: `last`, nothing was in flight anywhere (refuse
    /// new outgoing work for good); otherwise let the waiting work in. The
    /// gate stays shut if this worker is idle: the next round reads its
    /// count at once, and nothing may start between that read and its
    /// verdict.
    pub(crate) fn verdict(&self, last: bool) {
        {
            let mut st = self.lock();
            if last {
                st.ended = true;
            } else {
                st.shut = st.active == 0;
            }
        }
        self.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_started_after_an_idle_read_waits_for_the_verdict() {
        let g = Arc::new(Gate::default());
        let a = g.try_enter(Work::Outgoing).expect("open");
        g.close();
        // Not idle yet: the gate is open.
        let b = g.try_enter(Work::Outgoing).expect("open while busy");
        drop((a, b));
        // Idle while closing: the count read now (0) is what the round sums,
        // and nothing outgoing may start until the verdict.
        assert_eq!(g.count(), 0);
        assert!(g.try_enter(Work::Outgoing).is_none());
        // Not the last round, and idle: still shut for the next read.
        g.verdict(false);
        assert!(g.try_enter(Work::Outgoing).is_none());
        // The last round refuses for good.
        g.verdict(true);
        assert!(g.try_enter(Work::Outgoing).is_none());
    }

    #[test]
    fn incoming_work_opens_the_gate_for_what_it_starts() {
        // Shut (closing, idle); a request arrives and its handler makes a
        // nested call: it must not wait for a verdict that waits for it.
        let g = Arc::new(Gate::default());
        g.close();
        assert!(g.try_enter(Work::Outgoing).is_none());
        let inc = g.try_enter(Work::Incoming).expect("incoming");
        let nested = g.try_enter(Work::Outgoing).expect("the handler's call");
        assert_eq!(g.count(), 2);
        drop((nested, inc));
        // Idle again: shut again.
        assert!(g.try_enter(Work::Outgoing).is_none());
    }

    #[test]
    fn a_round_that_was_not_the_last_reopens_only_a_busy_worker() {
        let g = Arc::new(Gate::default());
        let busy = g.try_enter(Work::Outgoing).expect("open");
        g.close();
        g.verdict(false);
        // Busy: open (its work goes on, and is counted by the next round).
        let more = g.try_enter(Work::Outgoing).expect("busy: open");
        drop((busy, more));
        assert!(g.try_enter(Work::Outgoing).is_none());
    }

    #[tokio::test]
    async fn a_waiting_start_goes_ahead_or_is_refused_by_the_verdict() {
        let g = Arc::new(Gate::default());
        g.close();
        let g2 = g.clone();
        let waiting = tokio::spawn(async move { g2.enter(Work::Outgoing).await.is_some() });
        tokio::task::yield_now().await;
        // Work arriving from another worker lets it in.
        let inc = g.try_enter(Work::Incoming).expect("incoming");
        assert!(waiting.await.unwrap(), "let in once work arrived");
        drop(inc);
        let g2 = g.clone();
        let waiting = tokio::spawn(async move { g2.enter(Work::Outgoing).await.is_some() });
        tokio::task::yield_now().await;
        // A round that was not the last leaves an idle worker's gate shut.
        g.verdict(false);
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        g.verdict(true);
        assert!(!waiting.await.unwrap(), "refused after the last round");
    }
}
