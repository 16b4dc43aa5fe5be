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
//!
//! **With `--state etcd://`** ([`super::etcd`], [`super::lead`]) the service
//! has a [`Role`]: a standby (or a leader that lost its lease) refuses every
//! call with [`Refused::Unavailable`] before the machine sees it. A
//! leader's quorum with an id above the last one saved in etcd is held in
//! `pending`, unanswered and off the watch board, until the lead task has
//! saved it ([`Shared::saved`]); one it cannot save answers nobody. So is
//! the abort of a quorum (a member dropped): saved as that quorum marked
//! aborted before the survivors are told, so that a successor never issues
//! the aborted id again (found by the simulator: a takeover right after an
//! abort re-issued it, and the survivors, told of the abort, would have
//! gone on with their aborted generation).

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rallypoint_sync::MutexExt;
use tokio::sync::{oneshot, watch, Notify};

use super::heals::{Heal, Heals, Report};
use super::watch::{Board, Lost};
use super::wire::Issued;
use crate::machine::{Action, Event, Lighthouse, Remembered, Session, Status};
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
    /// Connections refused by the job-secret handshake, by reason.
    pub secret_refusals: rallypoint_auth::Refusals,
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

/// What a waiting `Quorum` call gets: its quorum, or a refusal.
pub type Answer = Result<Arc<Issued>, Refused>;

/// Why a request is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The machine's refusal: the replica id is held by another live
    /// process (or was taken while this one was silent).
    Held(String),
    /// This lighthouse does not serve quorums: it stands by, or it lost
    /// its lease.
    Unavailable(String),
}

/// Whether this lighthouse serves (always, without `--state`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// It leads: under this etcd lease (0 without `--state`).
    Leader { lease: i64 },
    /// Its first campaign has not ended (`--state`): calls wait for it
    /// ([`Shared::settled`]) rather than being refused, so that a manager
    /// reaching a lighthouse restarted in place does not take a refusal
    /// (torchft's then replaces its client, and the closed connection drops
    /// it from the quorum).
    Starting { campaign: String },
    /// Another lighthouse leads.
    Standby { leader: String },
    /// It led and lost its lease: it serves no more.
    Lost { why: String },
}

struct Inner {
    machine: Lighthouse,
    waiters: HashMap<u64, Waiter>,
    next_waiter: u64,
    role: Role,
    /// Quorums with ids up to this one are saved in etcd (`i64::MAX`
    /// without `--state`: nothing to save).
    durable: i64,
    /// Records awaiting their save, oldest first, numbered from
    /// `next_record`: quorums issued above `durable`, and aborts.
    pending: VecDeque<(u64, Pending)>,
    next_record: u64,
    /// The last quorum issued (or restored), for an abort's record.
    last_quorum: Option<Quorum>,
    /// The sessions whose connection is open ([`Shared::opened`] to
    /// [`Shared::closed`]). hyper runs each request as a task of its own,
    /// so a request read just before its connection ended may reach us
    /// after the machine's `Closed`: it is refused, else it would speak for
    /// its replica again over a session that no longer exists (a heartbeat
    /// made a dropped replica healthy, and not joined, until its heartbeat
    /// timeout: every other group's quorum waited the join timeout for it).
    open: HashSet<Session>,
}

/// What waits for its save in etcd before anyone hears of it.
#[derive(Debug)]
enum Pending {
    /// A quorum with a new id: answered once saved.
    Issue(Quorum),
    /// Quorum `quorum` aborted: pushed to its watchers once saved.
    Abort {
        quorum: Quorum,
        replica_id: String,
        reason: String,
    },
}

impl Pending {
    /// The state it saves: a quorum, and whether it was aborted.
    fn record(&self) -> (Quorum, bool) {
        match self {
            Pending::Issue(q) => (q.clone(), false),
            Pending::Abort { quorum, .. } => (quorum.clone(), true),
        }
    }
}

impl Inner {
    /// A refusal if `session`'s connection has ended (see `open`).
    fn gone(&self, session: Session) -> Option<Refused> {
        if self.open.contains(&session) {
            return None;
        }
        tracing::debug!(session, "refused a request of a closed session");
        Some(Refused::Unavailable(format!(
            "this request's connection (session {session}) has closed"
        )))
    }

    /// Why this lighthouse refuses requests now, if it does.
    fn not_serving(&self) -> Option<Refused> {
        match &self.role {
            Role::Leader { .. } => None,
            Role::Starting { campaign } => Some(Refused::Unavailable(format!(
                "this lighthouse is starting: {campaign}"
            ))),
            Role::Standby { leader } => Some(Refused::Unavailable(format!(
                "this lighthouse stands by: {leader} leads; it takes over when that one's etcd lease expires"
            ))),
            Role::Lost { why } => Some(Refused::Unavailable(format!(
                "this lighthouse lost its etcd lease and serves no more: {why}"
            ))),
        }
    }
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
    /// Wakes the lead task: a quorum awaits its save.
    save_wake: Notify,
    /// Past the first campaign (see [`Role::Starting`]).
    settled: watch::Sender<bool>,
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
    /// A service that serves at once (no `--state`), or, with `campaign`
    /// (what it is doing), one that is starting: calls wait until its
    /// first campaign ends ([`Shared::lead`] or [`Shared::stand_by`]).
    pub fn new(machine: Lighthouse, campaign: Option<String>) -> Arc<Shared> {
        let role = match campaign {
            Some(campaign) => Role::Starting { campaign },
            None => Role::Leader { lease: 0 },
        };
        let settled = watch::Sender::new(!matches!(role, Role::Starting { .. }));
        Arc::new(Shared {
            inner: Mutex::new(Inner {
                machine,
                waiters: HashMap::new(),
                next_waiter: 0,
                role,
                durable: i64::MAX,
                pending: VecDeque::new(),
                next_record: 0,
                last_quorum: None,
                open: HashSet::new(),
            }),
            wake_ticker: Notify::new(),
            board: watch::Sender::new(Board::default()),
            counters: Counters::default(),
            heals: Mutex::new(Heals::default()),
            save_wake: Notify::new(),
            settled,
        })
    }

    /// Waits, at most `limit`, until this lighthouse is past its first
    /// campaign (it leads or stands by); at once without `--state`.
    pub async fn settled(&self, limit: Duration) {
        let mut rx = self.settled.subscribe();
        let _ = tokio::time::timeout(limit, rx.wait_for(|s| *s)).await;
    }

    /// Sets the role, and wakes the calls waiting for the first campaign.
    fn set_role(&self, inner: &mut Inner, role: Role) {
        inner.role = role;
        self.settled.send_replace(true);
    }

    /// A `Quorum` request: the replica joins and waits for a quorum that
    /// contains it, or is refused.
    pub fn join(
        self: &Arc<Self>,
        session: Session,
        member: Member,
        remembered: Option<Remembered>,
    ) -> Result<Waiting, Refused> {
        let (tx, rx) = oneshot::channel();
        let replica_id = member.replica_id.clone();
        let mut inner = self.inner.locked();
        if let Some(r) = inner.not_serving().or_else(|| inner.gone(session)) {
            return Err(r);
        }
        tracing::trace!(session, replica_id, "join");
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
        let event = Event::Join {
            session,
            member,
            remembered,
        };
        let refusals = self.step(&mut inner, event);
        drop(inner);
        let waiting = Waiting {
            shared: self.clone(),
            id,
            rx,
        };
        match mine(refusals, session, &replica_id) {
            Some(reason) => Err(Refused::Held(reason)),
            None => Ok(waiting),
        }
    }

    /// A `Heartbeat` request.
    pub fn heartbeat(&self, session: Session, replica_id: String) -> Result<(), Refused> {
        let mut inner = self.inner.locked();
        if let Some(r) = inner.not_serving().or_else(|| inner.gone(session)) {
            return Err(r);
        }
        tracing::trace!(session, replica_id, "heartbeat");
        let refusals = self.step(
            &mut inner,
            Event::Heartbeat {
                session,
                replica_id: replica_id.clone(),
            },
        );
        match mine(refusals, session, &replica_id) {
            Some(reason) => Err(Refused::Held(reason)),
            None => Ok(()),
        }
    }

    /// A connection was accepted: its requests may speak for replicas
    /// until [`Shared::closed`].
    pub fn opened(&self, session: Session, peer: IpAddr) {
        let mut inner = self.inner.locked();
        inner.open.insert(session);
        self.step(&mut inner, Event::Opened { session, peer });
    }

    /// A request over `session` that speaks for no replica (HTTP).
    pub fn spoke(&self, session: Session) {
        let mut inner = self.inner.locked();
        if inner.open.contains(&session) {
            self.step(&mut inner, Event::Spoke { session });
        }
    }

    /// A connection ended: the machine drops every replica it carried, and
    /// a request of it handled from now on is refused.
    pub fn closed(&self, session: Session) {
        let mut inner = self.inner.locked();
        inner.open.remove(&session);
        tracing::debug!(session, "session closed");
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
    pub fn heal(&self, report: Report, at: f64) -> Result<String, Refused> {
        let replica_id = {
            let inner = self.inner.locked();
            if let Some(r) = inner.not_serving() {
                return Err(r);
            }
            inner
                .machine
                .resolve_replica(&report.replica_id)
                .map_err(Refused::Held)?
        };
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

    /// This lighthouse's role.
    pub fn role(&self) -> Role {
        self.inner.locked().role.clone()
    }

    /// Another lighthouse leads (its etcd key names it).
    pub fn stand_by(&self, leader: String) {
        let mut inner = self.inner.locked();
        self.set_role(&mut inner, Role::Standby { leader });
    }

    /// This lighthouse leads under `lease`, going on from what its
    /// predecessor `saved` (its last id and quorum), if anything; returns
    /// the last id it goes on from.
    pub fn lead(&self, lease: i64, saved: Option<super::etcd::Saved>) -> i64 {
        let mut inner = self.inner.locked();
        if let Some(saved) = saved {
            inner.last_quorum = saved.quorum.clone();
            let refusals = self.step(
                &mut inner,
                Event::Restored {
                    last_id: saved.last_id,
                    quorum: saved.quorum,
                    aborted: saved.aborted,
                },
            );
            log_refusals(refusals);
        }
        inner.durable = inner.machine.status(Instant::now()).quorum_id;
        self.set_role(&mut inner, Role::Leader { lease });
        inner.durable
    }

    /// The newest record awaiting its save (its number, the quorum, whether
    /// it was aborted), if any: saving it saves every older one too (the
    /// state is the last record).
    pub fn to_save(&self) -> Option<(u64, Quorum, bool)> {
        let inner = self.inner.locked();
        let (n, p) = inner.pending.back()?;
        let (q, aborted) = p.record();
        Some((*n, q, aborted))
    }

    /// Resolves when a quorum may await its save.
    pub async fn save_wanted(&self) {
        self.save_wake.notified().await;
    }

    /// Records up to number `n` are saved: answers the waiting calls of
    /// their quorums and pushes their aborts, oldest first.
    pub fn saved(&self, n: u64) {
        let mut inner = self.inner.locked();
        while inner.pending.front().is_some_and(|(m, _)| *m <= n) {
            match inner.pending.pop_front().map(|(_, p)| p) {
                Some(Pending::Issue(q)) => {
                    inner.durable = inner.durable.max(q.id);
                    self.issue(&mut inner, q);
                }
                Some(Pending::Abort {
                    quorum,
                    replica_id,
                    reason,
                }) => self.push_abort(quorum.id, &replica_id, &reason),
                None => {}
            }
        }
    }

    /// Queues `p` for its save and wakes the lead task.
    fn pend(&self, inner: &mut Inner, p: Pending) {
        let n = inner.next_record;
        inner.next_record += 1;
        inner.pending.push_back((n, p));
        self.save_wake.notify_one();
    }

    /// Tells quorum `quorum_id`'s watchers that `replica_id` was dropped.
    fn push_abort(&self, quorum_id: i64, replica_id: &str, reason: &str) {
        tracing::warn!(
            quorum_id,
            replica_id,
            reason,
            "member of the current quorum dropped: aborting its watchers"
        );
        self.board
            .send_modify(|b| b.aborted(quorum_id, replica_id, reason));
    }

    /// The lease is lost: nothing pending is answered, every waiting call
    /// ends refused, and every request from now on is.
    pub fn lost(&self, why: &str) {
        let mut inner = self.inner.locked();
        self.set_role(
            &mut inner,
            Role::Lost {
                why: why.to_owned(),
            },
        );
        inner.pending.clear();
        let refused = inner
            .not_serving()
            .unwrap_or(Refused::Unavailable(why.to_owned()));
        for (_, w) in inner.waiters.drain() {
            let _ = w.tx.send(Err(refused.clone()));
        }
    }

    /// The heals reported so far.
    pub fn heals(&self) -> Heals {
        self.heals.locked().clone()
    }

    /// The machine's state now.
    pub fn status(&self) -> Status {
        self.inner.locked().machine.status(Instant::now())
    }

    /// The heartbeat timeout: how long a silent replica still counts as
    /// live (and holds its id).
    pub fn heartbeat_timeout(&self) -> Duration {
        self.inner.locked().machine.knobs().heartbeat_timeout
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
        let recalled = inner.machine.counters().recalled;
        let actions = inner.machine.handle(Instant::now(), ev);
        if inner.machine.counters().recalled > recalled {
            tracing::info!("every member of the last quorum its callers remember is back: the first quorum is issued without the startup grace");
        }
        let mut refusals = Vec::new();
        for action in actions {
            match action {
                Action::Issue(q) if q.id > inner.durable => {
                    // Saved before anyone hears of it (see the module docs).
                    self.pend(inner, Pending::Issue(q));
                }
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
                    // With state, saved first (see the module docs): the
                    // quorum is the last issued, perhaps still pending.
                    let quorum = inner
                        .pending
                        .iter()
                        .rev()
                        .find_map(|(_, p)| match p {
                            Pending::Issue(q) if q.id == quorum_id => Some(q.clone()),
                            _ => None,
                        })
                        .or_else(|| inner.last_quorum.clone().filter(|q| q.id == quorum_id));
                    match quorum {
                        Some(quorum) if inner.durable != i64::MAX => self.pend(
                            inner,
                            Pending::Abort {
                                quorum,
                                replica_id,
                                reason,
                            },
                        ),
                        _ => self.push_abort(quorum_id, &replica_id, &reason),
                    }
                }
                Action::Dropped { replica_id, reason } => {
                    tracing::info!(replica_id, reason, "replica dropped");
                }
                Action::AbortPredecessor { replica_id, reason } => {
                    tracing::warn!(
                        replica_id,
                        reason,
                        "aborting the watchers of the predecessor's quorums"
                    );
                    self.board.send_modify(|b| {
                        b.predecessor_over = Some(Lost { replica_id, reason });
                    });
                }
            }
        }
        self.wake_ticker.notify_one();
        refusals
    }

    /// Answers every waiting call whose replica is in `q`, all with the same
    /// encoded answer; the others keep waiting (torchft's rule).
    fn issue(&self, inner: &mut Inner, q: Quorum) {
        inner.last_quorum = Some(q.clone());
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
            let _ = w.tx.send(Err(Refused::Held(reason.to_owned())));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quorum::Knobs;

    /// A lighthouse with `--state` that is still in its first campaign holds
    /// calls (they would be refused with UNAVAILABLE, and torchft's manager
    /// replaces its client on a refusal, dropping itself from the quorum);
    /// they go on the moment it leads.
    #[tokio::test]
    async fn calls_wait_for_the_first_campaign_then_go_on() {
        let shared = Shared::new(
            Lighthouse::new(Knobs::ours(1), 0),
            Some("campaigning at etcd://x".into()),
        );
        shared.opened(1, std::net::Ipv4Addr::LOCALHOST.into());
        assert!(matches!(
            shared.heartbeat(1, "a".into()),
            Err(Refused::Unavailable(why)) if why.contains("starting")
        ));
        let waiting = tokio::spawn({
            let shared = shared.clone();
            async move { shared.settled(Duration::from_secs(60)).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "it waits while the campaign runs");
        shared.lead(1, None);
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("woken when it leads")
            .unwrap();
        assert!(shared.heartbeat(1, "a".into()).is_ok());
        // Settled: at once from now on.
        tokio::time::timeout(
            Duration::from_secs(10),
            shared.settled(Duration::from_secs(60)),
        )
        .await
        .expect("at once");
    }

    /// hyper runs each request as a task of its own: a heartbeat read just
    /// before its connection ended may be handled after the session closed.
    /// It must not make its replica live again (it would count as healthy
    /// and not joined until its heartbeat timeout, and every other
    /// replica's quorum would wait the join timeout for it); nor may a
    /// `Quorum` request join over it.
    #[tokio::test]
    async fn a_request_handled_after_its_connection_closed_is_refused() {
        let shared = Shared::new(Lighthouse::new(Knobs::ours(1), 0), None);
        shared.opened(1, std::net::Ipv4Addr::LOCALHOST.into());
        shared.heartbeat(1, "a".into()).unwrap();
        let live = |s: &Shared| s.inner.locked().machine.status(Instant::now()).healthy;
        assert_eq!(live(&shared), ["a".to_owned()]);
        shared.closed(1);
        assert!(live(&shared).is_empty());

        let late = shared.heartbeat(1, "a".into());
        assert!(
            matches!(&late, Err(Refused::Unavailable(why)) if why.contains("session 1) has closed")),
            "{late:?}"
        );
        let member = Member {
            replica_id: "a".into(),
            address: "m:1".into(),
            store_address: "s:1".into(),
            step: 0,
            world_size: 1,
            shrink_only: false,
            commit_failures: 0,
            data: String::new(),
        };
        assert!(shared.join(1, member, None).is_err());
        assert!(
            live(&shared).is_empty(),
            "no replica speaks over a closed session"
        );
        assert!(shared.inner.locked().waiters.is_empty());
    }
}
