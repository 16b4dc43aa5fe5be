//! The service's one piece of shared state: the machine ([`Lighthouse`])
//! with the `Quorum` calls waiting on it, behind one mutex that is never held
//! across an await, plus the watch board and the service's counters.
//!
//! Every input goes through [`Shared::step`]: it locks, hands the event to
//! the machine with the current instant, carries out the actions before
//! unlocking (answer the waiting calls of an issued quorum through their
//! oneshot channels, record an abort on the watch board, log drops), and
//! returns the refusals to its caller. A `Quorum` call registers its waiter
//! in the same critical section as its `Join`, so a quorum issued by that
//! very join reaches it. A waiter leaves the map when its call ends in any
//! way (answered, timed out, cancelled by its client, its connection gone),
//! by [`Waiting`]'s drop; one that ends unanswered sends the machine
//! `Event::Left`, so that a call nobody waits on any more is never issued
//! into a quorum (the other members would wait on it until their timeout).
//! The `waiters` map is the list of calls: whatever path ends a call, the
//! drop runs once, under the lock.
//!
//! [`Shared::ticker`] sends `Tick` every `quorum_tick` and at the machine's
//! `next_deadline`; each step wakes it to look at the deadline again.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rallypoint_sync::MutexExt;
use tokio::sync::{oneshot, watch, Notify};

use super::heals::{Heal, Heals, Report};
use super::watch::Board;
use super::wire::Issued;
use crate::machine::{Action, Event, Lighthouse, Session, Status};
use crate::quorum::{Member, Quorum};

/// The service's own counts (the machine counts joins, drops, quorums and
/// aborts itself).
#[derive(Debug, Default)]
pub struct Counters {
    /// Connections accepted.
    pub sessions: AtomicU64,
    /// Connections open now.
    pub open: AtomicU64,
    /// Requests refused: bad input, a replica id held by another live
    /// process, a request it cannot place.
    pub refused: AtomicU64,
    /// Connections that broke the protocol (not HTTP, not gRPC).
    pub bad_connections: AtomicU64,
    /// `Quorum` calls that reached their deadline without a quorum.
    pub timeouts: AtomicU64,
    /// `/v1/watch` polls answered `dropped` (aborts pushed to survivors).
    pub aborts_pushed: AtomicU64,
}

impl Counters {
    pub fn add(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// A refusal of the machine: a replica id held by another live session.
#[derive(Clone, Debug)]
pub struct Refusal {
    pub session: Session,
    pub replica_id: String,
    pub reason: String,
}

struct Waiter {
    session: Session,
    replica_id: String,
    tx: oneshot::Sender<Answer>,
}

/// What a waiting `Quorum` call gets: its quorum, or the machine's refusal
/// (its replica id was taken by another process while it was silent).
pub type Answer = Result<Arc<Issued>, String>;

struct Inner {
    machine: Lighthouse,
    waiters: HashMap<u64, Waiter>,
    next_waiter: u64,
}

/// The machine, its waiters, the watch board, the counters.
pub struct Shared {
    inner: Mutex<Inner>,
    wake_ticker: Notify,
    board: watch::Sender<Board>,
    pub counters: Counters,
    /// Heals reported (`POST /v1/heal`); its own lock, never held with the
    /// machine's.
    heals: Mutex<Heals>,
}

/// A `Quorum` call's place in line; leaving it (drop) removes the waiter.
pub struct Waiting {
    shared: Arc<Shared>,
    id: u64,
    /// The quorum and its encoded answer, once one that contains the
    /// replica is issued, or a refusal.
    pub rx: oneshot::Receiver<Answer>,
}

impl Drop for Waiting {
    /// A call that ends unanswered (its client cancelled it, its deadline
    /// passed) tells the machine ([`Event::Left`]) so that it is not issued
    /// into a quorum it will never hear of, unless another call of the
    /// same replica waits (the machine's one waiting call is then that
    /// one's).
    fn drop(&mut self) {
        let mut inner = self.shared.inner.locked();
        let Some(w) = inner.waiters.remove(&self.id) else {
            return; // answered or refused
        };
        if inner.waiters.values().any(|o| o.replica_id == w.replica_id) {
            return;
        }
        let refusals = self.shared.step(
            &mut inner,
            Event::Left {
                session: w.session,
                replica_id: w.replica_id,
            },
        );
        log_refusals(refusals);
    }
}

impl Shared {
    pub fn new(machine: Lighthouse) -> Arc<Shared> {
        Arc::new(Shared {
            inner: Mutex::new(Inner {
                machine,
                waiters: HashMap::new(),
                next_waiter: 0,
            }),
            wake_ticker: Notify::new(),
            board: watch::Sender::new(Board::default()),
            counters: Counters::default(),
            heals: Mutex::new(Heals::default()),
        })
    }

    /// A `Quorum` request: the replica joins and waits for a quorum that
    /// contains it, or is refused.
    pub fn join(self: &Arc<Self>, session: Session, member: Member) -> Result<Waiting, String> {
        let (tx, rx) = oneshot::channel();
        let replica_id = member.replica_id.clone();
        let mut inner = self.inner.locked();
        let id = inner.next_waiter;
        inner.next_waiter += 1;
        inner.waiters.insert(
            id,
            Waiter {
                session,
                replica_id: replica_id.clone(),
                tx,
            },
        );
        let refusals = self.step(&mut inner, Event::Join { session, member });
        drop(inner);
        let waiting = Waiting {
            shared: self.clone(),
            id,
            rx,
        };
        match mine(refusals, session, &replica_id) {
            Some(reason) => Err(reason),
            None => Ok(waiting),
        }
    }

    /// A `Heartbeat` request.
    pub fn heartbeat(&self, session: Session, replica_id: String) -> Result<(), String> {
        let mut inner = self.inner.locked();
        let refusals = self.step(
            &mut inner,
            Event::Heartbeat {
                session,
                replica_id: replica_id.clone(),
            },
        );
        match mine(refusals, session, &replica_id) {
            Some(reason) => Err(reason),
            None => Ok(()),
        }
    }

    /// A connection ended: the machine drops every replica it carried.
    pub fn closed(&self, session: Session) {
        let mut inner = self.inner.locked();
        let refusals = self.step(&mut inner, Event::Closed { session });
        log_refusals(refusals);
    }

    /// Time passed; returns when the machine next needs a tick.
    pub fn tick(&self) -> Option<Instant> {
        let mut inner = self.inner.locked();
        let refusals = self.step(&mut inner, Event::Tick);
        log_refusals(refusals);
        inner.machine.next_deadline()
    }

    /// A heal report: recorded under the replica id the machine resolves
    /// its name to (returned), or the machine's reason it cannot.
    pub fn heal(&self, report: Report, at: f64) -> Result<String, String> {
        let replica_id = self
            .inner
            .locked()
            .machine
            .resolve_replica(&report.replica_id)?;
        tracing::info!(
            replica_id,
            step = report.step,
            bytes = report.bytes,
            seconds = report.seconds,
            sources = ?report.sources,
            "heal reported"
        );
        self.heals.locked().record(Heal {
            replica_id: replica_id.clone(),
            step: report.step,
            bytes: report.bytes,
            seconds: report.seconds,
            sources: report.sources,
            quorum_id: report.quorum_id,
            at,
        });
        Ok(replica_id)
    }

    /// The heals reported so far.
    pub fn heals(&self) -> Heals {
        self.heals.locked().clone()
    }

    /// The machine's state now.
    pub fn status(&self) -> Status {
        self.inner.locked().machine.status(Instant::now())
    }

    /// A receiver of the watch board.
    pub fn board(&self) -> watch::Receiver<Board> {
        self.board.subscribe()
    }

    /// Sends `Tick` every `quorum_tick` and at the machine's next deadline,
    /// for ever (the server aborts it when it stops).
    pub async fn ticker(self: Arc<Self>, quorum_tick: Duration) {
        let mut at = Instant::now() + quorum_tick;
        loop {
            let woken = self.wake_ticker.notified();
            tokio::select! {
                () = tokio::time::sleep_until(at.into()) => {
                    let next = self.tick();
                    at = earliest(Instant::now() + quorum_tick, next);
                }
                () = woken => {
                    let next = self.inner.locked().machine.next_deadline();
                    at = earliest(at, next);
                }
            }
        }
    }

    /// Hands one event to the machine and carries out its actions (under the
    /// caller's lock); returns the refusals.
    fn step(&self, inner: &mut Inner, ev: Event) -> Vec<Refusal> {
        let actions = inner.machine.handle(Instant::now(), ev);
        let mut refusals = Vec::new();
        for action in actions {
            match action {
                Action::Issue(q) => self.issue(inner, q),
                Action::Refuse {
                    session,
                    replica_id,
                    reason,
                } => {
                    refuse_waiters(inner, session, &replica_id, &reason);
                    refusals.push(Refusal {
                        session,
                        replica_id,
                        reason,
                    });
                }
                Action::Abort {
                    quorum_id,
                    replica_id,
                    reason,
                } => {
                    tracing::warn!(
                        quorum_id,
                        replica_id,
                        reason,
                        "member of the current quorum dropped: aborting its watchers"
                    );
                    self.board
                        .send_modify(|b| b.aborted(quorum_id, &replica_id, &reason));
                }
                Action::Dropped { replica_id, reason } => {
                    tracing::info!(replica_id, reason, "replica dropped");
                }
            }
        }
        self.wake_ticker.notify_one();
        refusals
    }

    /// Answers every waiting call whose replica is in `q`, all with the same
    /// encoded answer; the others keep waiting (torchft's rule).
    fn issue(&self, inner: &mut Inner, q: Quorum) {
        // Every step re-issues the quorum; a new id is the news.
        if self.board.borrow().current == Some(q.id) {
            tracing::debug!(quorum_id = q.id, "quorum issued again");
        } else {
            let members: Vec<&str> = q
                .participants
                .iter()
                .map(|m| m.replica_id.as_str())
                .collect();
            tracing::info!(quorum_id = q.id, ?members, "new quorum issued");
        }
        self.board.send_modify(|b| b.issued(q.id));
        let members: HashSet<&str> = q
            .participants
            .iter()
            .map(|m| m.replica_id.as_str())
            .collect();
        let answered: Vec<u64> = inner
            .waiters
            .iter()
            .filter(|(_, w)| members.contains(w.replica_id.as_str()))
            .map(|(id, _)| *id)
            .collect();
        if answered.is_empty() {
            return;
        }
        let issued = Arc::new(Issued::new(q));
        for id in answered {
            if let Some(w) = inner.waiters.remove(&id) {
                // The call may have ended meanwhile; nothing to answer then.
                let _ = w.tx.send(Ok(issued.clone()));
            }
        }
    }
}

/// Ends the waiting calls of `replica_id` on `session` with the refusal.
fn refuse_waiters(inner: &mut Inner, session: Session, replica_id: &str, reason: &str) {
    let refused: Vec<u64> = inner
        .waiters
        .iter()
        .filter(|(_, w)| w.session == session && w.replica_id == replica_id)
        .map(|(id, _)| *id)
        .collect();
    for id in refused {
        if let Some(w) = inner.waiters.remove(&id) {
            let _ = w.tx.send(Err(reason.to_owned()));
        }
    }
}

/// The refusal addressed to this caller, if any; the rest are logged.
fn mine(refusals: Vec<Refusal>, session: Session, replica_id: &str) -> Option<String> {
    let mut found = None;
    let mut others = Vec::new();
    for r in refusals {
        if found.is_none() && r.session == session && r.replica_id == replica_id {
            found = Some(r.reason);
        } else {
            others.push(r);
        }
    }
    log_refusals(others);
    found
}

fn log_refusals(refusals: Vec<Refusal>) {
    for r in refusals {
        tracing::warn!(
            session = r.session,
            replica_id = r.replica_id,
            reason = r.reason,
            "refused"
        );
    }
}

fn earliest(a: Instant, b: Option<Instant>) -> Instant {
    b.map_or(a, |b| a.min(b))
}
