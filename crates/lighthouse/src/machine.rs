//! The lighthouse's decisions as a state machine: events in, actions out.
//!
//! The service feeds [`Lighthouse::handle`] what happened (a `Quorum`
//! request, a heartbeat, a connection that ended, time passing) with the
//! moment it happened, and carries out the [`Action`]s it returns: answer
//! the waiting `Quorum` calls of an issued quorum, refuse a request, push an
//! abort to the watchers of the current quorum. Nothing here reads a clock
//! or does I/O, so the simulator (`tests/sim.rs`) drives it through random
//! schedules with a simulated clock.
//!
//! **Quorums** follow torchft's rules ([`crate::quorum`]): a `Join` (a
//! `Quorum` request) makes its replica a participant and counts as a
//! heartbeat; after every join, drop or revival, and at every `Tick`, the
//! machine asks [`quorum::compute`] and, on a verdict to issue, numbers the
//! quorum ([`quorum::next_id`]: ids start above `first_id`, rise on a change
//! of members or a reported commit failure), answers its members' calls and
//! keeps every other participant waiting, its join time reset to now (as
//! torchft puts an unanswered caller back).
//!
//! **Liveness**, beyond torchft:
//!
//! * A started (or restarted) service issues its first quorum no sooner
//!   than a heartbeat timeout (at most [`STARTUP_GRACE_MAX`]) after it
//!   first heard anyone (a `Join` or a heartbeat; ticks and connections
//!   that say nothing do not start it): until then it cannot know every
//!   replica that is alive, and a first caller alone would pass the
//!   majority guard.
//!
//!   *A restart without the grace.* rallypoint's managers say, in each
//!   `Join`, which quorum they were last issued ([`Remembered`]; torchft's
//!   say nothing, and get the grace), and they dial again at least every
//!   250 ms and beat every 100 ms. Before its first quorum, a service with
//!   nothing restored keeps the remembered quorum of the highest id (a
//!   member remembers only a quorum it was in; one that missed the
//!   predecessor's last quorum remembers an older one, and the newest
//!   seen wins). The grace ends early when every member of it is waiting
//!   again, every replica heard is waiting in a call that told of a memory
//!   (a replica without one, torchft's manager or one of ours not in a
//!   call, keeps the grace), **and** [`RECALL_FLOOR`] (350 ms) has passed
//!   since the service first heard anyone: by then every live manager of
//!   ours has reached it and counts among the healthy. That last premise
//!   is a timing assumption, as the grace's own is: it holds for our
//!   managers on one network (a dial every 250 ms at most, a heartbeat
//!   task that dials again within 50 ms of a broken beat, a round trip
//!   well under 100 ms), not across a slow link. The rules then run as after the grace,
//!   *without* a previous quorum: a memory may be stale (some members
//!   missed the predecessor's newest quorum, which the others are in), so
//!   it never stands for the previous quorum's fast path, and
//!   `min_replicas`, the majority guard and the wait for healthy
//!   stragglers all hold. The memory only shortens the wait from the
//!   grace (a heartbeat timeout, at most 1 s) to the floor when the last
//!   quorum's members are back. Ids go on from this service's own
//!   `first_id`, never the remembered one, so every member reconfigures
//!   once.
//!
//!   *The predecessor's generations end at the first call.* The first
//!   `Join` a started service hears, with nothing restored (with or
//!   without a memory: torchft's managers too), ends the predecessor's
//!   generations for their watchers ([`Action::AbortPredecessor`]): a
//!   `Quorum` call comes after its caller's last step, so that member has
//!   left them, and an op of theirs still in flight waits on it in vain
//!   (found beside CPU hogs: the lighthouse was killed while answering
//!   one quorum, one member never got its answer and asked anew, and the
//!   others sat in that quorum's all_reduce until its 30 s timeout while
//!   the new lighthouse waited for them). A first start has no
//!   predecessor, and nobody watches its ids. (A first version also took the memory for the previous quorum;
//!   a review found a schedule where a stale one passed the fast path
//!   while the members of the newer quorum were still reconnecting.)
//!
//! * A session (one client connection) that ends drops every replica it
//!   carried at once ([`Event::Closed`]), with one exception: torchft's
//!   manager replaces its client after any failed call (a lighthouse that
//!   restarted, a blip) by connecting anew and then dropping the old
//!   connection, so the old one may end before the new one has carried a
//!   request (a CI run caught it: a live replica dropped, its quorum
//!   aborted, at a lighthouse restart). So when a replica's last session
//!   ends while a *fresh* session from the same peer address is open (one
//!   that has not spoken yet, [`Event::Opened`]), the replica is orphaned,
//!   not dropped: it is adopted by the first of those sessions that speaks
//!   for it, and dropped (reason: its session closed) as soon as no fresh
//!   session from that address is left (each spoke for another replica or
//!   for none, [`Event::Spoke`], or closed), or at its heartbeat timeout,
//!   whichever comes first. A killed process leaves no fresh session
//!   behind, so its drop stays immediate.
//! * A replica silent for `heartbeat_timeout` is dropped at the `Tick` that
//!   sees it ([`Lighthouse::next_deadline`] says when that is). Its session
//!   may still be open (a stopped process): its claim on the replica id is
//!   released, and if the same session speaks for it again (the process
//!   resumed) the replica is revived, its waiting `Quorum` call with it.
//! * A drop of a member of the current quorum yields [`Action::Abort`] for
//!   that quorum, so the survivors stop waiting on the dead member; the
//!   next quorum issued after an abort always gets a new id, even with the
//!   same members and no commit failure (a member dropped for silence that
//!   resumes before the next round): torchft reconfigures only on a new id,
//!   and the aborted generation is dead.
//! * A `Quorum` call that ends unanswered (its client cancelled it, its
//!   deadline passed) is [`Event::Left`]: the replica stops being a
//!   participant, so it is never issued into a quorum it will not hear of
//!   (the other members would wait on it until their timeout). It stays a
//!   live replica (healthy while it heartbeats).
//! * A replica id is held by one process: the manager address its first
//!   `Join` names, over every session that speaks for it. torchft's manager
//!   replaces its client after a failed call (a lighthouse that restarted,
//!   a blip), so one process may speak over two connections at once: a
//!   heartbeat from a new session is that process's, and the replica is
//!   dropped when its last session ends. A `Join` naming another manager
//!   address while the holder lives is a second process with the same id:
//!   it is refused ([`Action::Refuse`]) and the holder keeps the id. (A
//!   heartbeat names no address, so a second process's heartbeats alone
//!   cannot be told apart; its first `Join` is refused.)
//!
//! **A deviation from the project's rule** that a service refuses a request
//! from a member it does not know: a heartbeat for a replica id never seen
//! is accepted and makes that id a live, healthy replica. torchft's manager
//! starts heartbeating when it is built, before its first `Quorum` call, and
//! torchft's lighthouse accepts that; refusing would fail every manager's
//! first beats. The cost: a stray id that heartbeats but never joins counts
//! among the healthy, so a quorum that is not fast waits the join timeout
//! for it, and enough of them deny a majority, as in torchft. It goes when
//! its session closes or at the heartbeat timeout after its last beat; ids
//! are bounded in length by the service.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Instant, SystemTime};

use crate::quorum::{self, Knobs, Member, Quorum, Roster, Rules, Verdict};

/// The longest a started service waits before its first quorum (see
/// `Lighthouse::grace`): ten of torchft's heartbeat intervals.
pub const STARTUP_GRACE_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// The shortest a started service waits before its first quorum when its
/// callers remember their last one (see the module docs, "A restart
/// without the grace"): rallypoint's managers dial again at least every
/// 250 ms and beat every 100 ms, so by then every live one has reached it.
pub const RECALL_FLOOR: std::time::Duration = std::time::Duration::from_millis(350);

/// One client connection; the service numbers them.
pub type Session = u64;

/// What happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A `Quorum` request arrived (also a heartbeat), with the last quorum
    /// its requester says it was issued, if it says (see [`Remembered`]).
    Join {
        session: Session,
        member: Member,
        remembered: Option<Remembered>,
    },
    /// A heartbeat arrived.
    Heartbeat {
        session: Session,
        replica_id: String,
    },
    /// A `Quorum` call of `replica_id` on `session` ended unanswered (the
    /// client cancelled it or its deadline passed) and no other call of
    /// that replica waits: the replica is no longer a participant.
    Left {
        session: Session,
        replica_id: String,
    },
    /// That connection ended (process killed, host reset).
    Closed { session: Session },
    /// A connection from `peer` was accepted; it is *fresh* until its first
    /// request. Optional: a session never opened is simply never fresh.
    Opened { session: Session, peer: IpAddr },
    /// A request over `session` that speaks for no replica (HTTP `/status`,
    /// `/metrics`, a heal report): the session is not fresh any more.
    Spoke { session: Session },
    /// Time passed (the service sends it every `quorum_tick` and at
    /// [`Lighthouse::next_deadline`]).
    Tick,
    /// A lighthouse that took over (`--state etcd://...`) read what its
    /// predecessor left: the last quorum id issued and that quorum. Ids go
    /// on from `last_id` (durable, so the wall clock is not needed), and
    /// when every member of `quorum` is back in a `Quorum` call it is
    /// re-issued at once, under its id when nothing changed (a fast
    /// quorum), without the startup grace (which starts again at this
    /// event: a standby that takes over knows no replica yet). Only heeded
    /// before the first quorum is issued.
    Restored {
        last_id: i64,
        quorum: Option<Quorum>,
        /// The predecessor aborted that quorum (a member dropped): its id
        /// is never issued again, and its members, once back, get the next.
        aborted: bool,
    },
}

/// The last quorum a requester was issued, as it remembers it
/// (`LighthouseQuorumRequest.last_quorum`, our extension: rallypoint's
/// managers send it, torchft's never do). See the module docs, "A restart
/// without the grace".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Remembered {
    pub quorum_id: i64,
    pub replica_ids: Vec<String>,
}

/// What the service must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Answer every waiting `Join` whose replica is in it; the others keep
    /// waiting.
    Issue(Quorum),
    /// Refuse this session's request for `replica_id` (answer its waiting
    /// `Join`, if any, with this error).
    Refuse {
        session: Session,
        replica_id: String,
        reason: String,
    },
    /// A member of the current quorum was dropped: push an abort to that
    /// quorum's watchers.
    Abort {
        quorum_id: i64,
        replica_id: String,
        reason: String,
    },
    /// A replica was dropped (for logs and metrics).
    Dropped { replica_id: String, reason: String },
    /// A replica asked a (re)started service for a quorum before its
    /// first, with nothing restored: it has left its last generation, so
    /// any op of a predecessor's still in flight waits on it in vain. Push
    /// an abort to the watchers of every quorum this service did not issue
    /// (once per start).
    AbortPredecessor { replica_id: String, reason: String },
}

/// Counts since the service started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// `Join` events accepted.
    pub joins: u64,
    /// `Heartbeat` events accepted.
    pub heartbeats: u64,
    /// Replicas dropped (closed or silent).
    pub drops: u64,
    /// Quorums issued.
    pub quorums_issued: u64,
    /// `Abort` actions.
    pub aborts: u64,
    /// `Refuse` actions.
    pub refusals: u64,
    /// `Quorum` calls that ended unanswered and stopped being participants
    /// ([`Event::Left`]).
    pub left: u64,
    /// First quorums issued before the startup grace's end because every
    /// member of the remembered quorum was back ([`Remembered`]).
    pub recalled: u64,
}

/// The machine's state, for `/status` and `/metrics`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// The last quorum issued (the current one).
    pub quorum: Option<Quorum>,
    /// Its id; `first_id` before the first.
    pub quorum_id: i64,
    /// Replicas waiting in a `Quorum` call, sorted.
    pub waiting: Vec<String>,
    /// Replicas heard from within the heartbeat timeout, sorted.
    pub healthy: Vec<String>,
    /// Why the next quorum is or is not ready (torchft's wording).
    pub reason: String,
    /// Counts since start.
    pub counters: Counters,
}

/// A rule broken on purpose, so that the simulator can show its invariants
/// catch it. Never set outside the simulator's tests.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sabotage {
    #[default]
    None,
    /// Issue a quorum of a minority of the healthy replicas.
    NoMajorityGuard,
    /// Issue quorums below `min_replicas`.
    NoMinReplicas,
    /// Number quorums from 0, whatever `first_id` says.
    IgnoreFirstId,
    /// Do nothing when a session closes.
    IgnoreClosed,
    /// Drop a replica when its last session closes even while a fresh
    /// session from its host is open (no orphans): torchft's client
    /// replacement then drops a live replica.
    NoOrphans,
    /// Drop members of the current quorum without an abort.
    NoAbort,
    /// Forget the waiting call of a replica dropped for silence when it
    /// resumes (neither revive nor refuse it: the call waits forever).
    NoRevive,
    /// Issue the next quorum under an aborted id when its members are the
    /// same and report no commit failure (review item 4).
    ReuseAbortedId,
    /// Ignore [`Event::Left`]: a call that ended stays a participant.
    IgnoreLeft,
    /// Issue the first quorum at once after a start (no startup grace).
    NoStartupGrace,
    /// After [`Event::Restored`], number the first quorum with the restored
    /// id whatever its members (a re-issue of the saved id with others).
    RestoredIdAnyMembers,
    /// Ignore [`Event::Restored`]'s `last_id`: ids go on from this
    /// service's own `first_id` (its clock), below the saved one if that
    /// clock is behind.
    RestoredIdIgnored,
    /// End the startup grace as soon as any member of the recalled quorum
    /// is back (not every member).
    RecalledAnyBack,
    /// End the startup grace on a recalled quorum without waiting the
    /// [`RECALL_FLOOR`].
    NoRecallFloor,
}

/// The process that speaks for a live replica id.
#[derive(Clone, Debug, Default)]
struct Holder {
    /// Its manager's address, from its first `Join` (none before one).
    address: Option<String>,
    /// Every live session it has spoken over.
    sessions: BTreeSet<Session>,
    /// The session of its last `Join` (where its waiting call is).
    joined_on: Option<Session>,
}

impl Holder {
    /// Whether a request over `session` naming `address` (a `Join`'s) comes
    /// from this process.
    fn is(&self, session: Session, address: Option<&str>) -> bool {
        match (address, self.address.as_deref()) {
            (Some(a), Some(mine)) => a == mine,
            _ => self.sessions.contains(&session) || address.is_none() || self.address.is_none(),
        }
    }
}

/// A replica dropped for silence while a session of its stayed open.
#[derive(Clone, Debug)]
struct Stalled {
    holder: Holder,
    /// Its `Quorum` call that was waiting, revived with it.
    waiting: Option<Member>,
}

/// The lighthouse's state (see the module docs).
#[derive(Debug)]
pub struct Lighthouse {
    knobs: Knobs,
    /// The last quorum id issued (`first_id` before the first).
    last_id: i64,
    /// Participants and heartbeats of the live replicas.
    roster: Roster,
    /// The process holding each live replica id.
    holders: BTreeMap<String, Holder>,
    /// The replica ids each session has spoken for.
    sessions: BTreeMap<Session, BTreeSet<String>>,
    /// Replicas dropped for silence whose session is still open.
    stalled: BTreeMap<String, Stalled>,
    /// Sessions whose replica id another process took while they were
    /// silent: they no longer speak for it.
    displaced: BTreeSet<(Session, String)>,
    /// The peer address of each open session that said so ([`Event::Opened`]).
    peers: BTreeMap<Session, IpAddr>,
    /// Open sessions that have not spoken yet.
    fresh: BTreeSet<Session>,
    /// Replicas whose last session closed while a fresh session from the
    /// same peer was open: kept until one speaks for them (adopted) or none
    /// is left (dropped). The address, and the session that closed.
    orphans: BTreeMap<String, (IpAddr, Session)>,
    /// The last quorum issued.
    current: Option<Quorum>,
    /// Whether `current` was aborted: the next quorum issued gets a new id
    /// whatever its members (torchft reconfigures only on a new id).
    aborted: bool,
    /// The moment it first heard a replica (a `Join` or a heartbeat), or
    /// took over ([`Event::Restored`]): until a heartbeat timeout after it,
    /// the replicas alive are not all known yet (see [`Lighthouse::grace`]).
    started: Option<Instant>,
    /// Whether that grace has passed (so no past moment is a deadline).
    graced: bool,
    /// Whether `current` is a quorum restored from a predecessor
    /// ([`Event::Restored`]) that this service has not issued yet.
    restored: bool,
    /// Before the first quorum, with nothing restored: the remembered
    /// quorum of the highest id that the requesters told of (members by
    /// replica id only). It only ends the grace; the rules run without a
    /// previous quorum.
    recalled: Option<Quorum>,
    /// Replicas whose last `Join` told of a remembered quorum: the grace
    /// ends on a memory only when every replica heard is one of them.
    remembering: BTreeSet<String>,
    /// The grace was ended by the memory (counted at the next issue).
    graced_by_memory: bool,
    /// [`Action::AbortPredecessor`] was pushed.
    predecessor_aborted: bool,
    counters: Counters,
    sabotage: Sabotage,
}

impl Lighthouse {
    /// A lighthouse whose quorum ids start above `first_id` (the service
    /// passes unix milliseconds at start, so a restarted service never
    /// reuses an id).
    pub fn new(knobs: Knobs, first_id: i64) -> Lighthouse {
        Lighthouse {
            knobs,
            last_id: first_id,
            roster: Roster::default(),
            holders: BTreeMap::new(),
            sessions: BTreeMap::new(),
            stalled: BTreeMap::new(),
            displaced: BTreeSet::new(),
            peers: BTreeMap::new(),
            fresh: BTreeSet::new(),
            orphans: BTreeMap::new(),
            current: None,
            aborted: false,
            started: None,
            graced: false,
            restored: false,
            recalled: None,
            remembering: BTreeSet::new(),
            graced_by_memory: false,
            predecessor_aborted: false,
            counters: Counters::default(),
            sabotage: Sabotage::None,
        }
    }

    /// Breaks one rule on purpose (the simulator's tests only).
    #[doc(hidden)]
    pub fn sabotage(&mut self, s: Sabotage) {
        self.sabotage = s;
        if s == Sabotage::IgnoreFirstId {
            self.last_id = 0;
        }
    }

    /// The knobs it runs with.
    pub fn knobs(&self) -> &Knobs {
        &self.knobs
    }

    /// Counts since the service started.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// The last quorum issued.
    pub fn current(&self) -> Option<&Quorum> {
        self.current.as_ref()
    }

    /// What `ev`, at `now`, makes the service do.
    pub fn handle(&mut self, now: Instant, ev: Event) -> Vec<Action> {
        // The grace runs from the first replica heard, not from the start
        // (a tick, a connection that has said nothing): a service up long
        // before its managers reconnect has learnt nothing meanwhile.
        if matches!(ev, Event::Join { .. } | Event::Heartbeat { .. }) {
            self.started.get_or_insert(now);
        }
        if !self.graced
            && (self.sabotage == Sabotage::NoStartupGrace || self.grace().is_some_and(|g| now >= g))
        {
            self.graced = true;
        }
        let mut out = Vec::new();
        // A session's first request ends its freshness, whatever it says.
        let spoke = match &ev {
            Event::Join { session, .. }
            | Event::Heartbeat { session, .. }
            | Event::Left { session, .. }
            | Event::Spoke { session } => self.fresh.remove(session),
            _ => false,
        };
        let mut attempt = match ev {
            Event::Join {
                session,
                member,
                remembered,
            } => self.join(now, session, member, remembered, &mut out),
            Event::Heartbeat {
                session,
                replica_id,
            } => self.heartbeat(now, session, replica_id, &mut out),
            Event::Left {
                session,
                replica_id,
            } => self.left(session, &replica_id),
            Event::Closed { session } => self.closed(session, &mut out),
            Event::Opened { session, peer } => {
                self.peers.insert(session, peer);
                self.fresh.insert(session);
                false
            }
            Event::Spoke { .. } => false,
            Event::Tick => {
                self.expire(now, &mut out);
                true
            }
            Event::Restored {
                last_id,
                quorum,
                aborted,
            } => self.restore(now, last_id, quorum, aborted),
        };
        if spoke {
            attempt |= self.settle_orphans(&mut out);
        }
        if attempt {
            self.attempt(now, &mut out);
        }
        out
    }

    /// When a `Tick` is next needed: a live replica's heartbeat expires, or
    /// a quorum that waits for stragglers stops waiting.
    pub fn next_deadline(&self) -> Option<Instant> {
        let replicas = self.roster.replicas.values();
        let expiry = replicas
            .clone()
            .map(|r| r.heard + self.knobs.heartbeat_timeout)
            .min();
        let waiting = self.roster.waiting().count();
        let join_wait = self
            .roster
            .waiting()
            .map(|p| p.joined + self.knobs.join_timeout)
            .min()
            .filter(|_| waiting < self.roster.replicas.len());
        let grace = self.grace().filter(|_| waiting > 0 && !self.graced);
        let floor = self
            .recall_floor()
            .filter(|_| !self.graced && self.recalled_back());
        [expiry, join_wait, grace, floor]
            .into_iter()
            .flatten()
            .min()
    }

    /// When a started (or restarted) service may issue its first quorum: a
    /// heartbeat timeout after it first heard anyone, at most
    /// [`STARTUP_GRACE_MAX`] (torchft's managers beat every 100 ms and
    /// reconnect at their next beat). Before that the
    /// replicas alive are not all known: a member that has not reached this
    /// service yet (torchft's managers reconnect after a failed call) is
    /// neither healthy nor counted, so the first caller alone would be a
    /// majority of one and commit on its own while the others form a
    /// second quorum, two states for one step (the lighthouse restarted
    /// across test hosts did exactly that). A fast quorum needs a previous
    /// one, so this wait is only ever paid once per start.
    fn grace(&self) -> Option<Instant> {
        let wait = self.knobs.heartbeat_timeout.min(STARTUP_GRACE_MAX);
        self.started.map(|t| t + wait)
    }

    /// The state as of `now`.
    pub fn status(&self, now: Instant) -> Status {
        let timeout = self.knobs.heartbeat_timeout;
        Status {
            quorum: self.current.clone(),
            quorum_id: self.last_id,
            waiting: self
                .roster
                .waiting()
                .map(|p| p.member.replica_id.clone())
                .collect(),
            healthy: self
                .roster
                .replicas
                .keys()
                .filter(|id| self.roster.healthy(id, now, timeout))
                .cloned()
                .collect(),
            reason: self.verdict(now).to_string(),
            counters: self.counters,
        }
    }

    /// The replica id a heal report names (`POST /v1/heal`), among the ids
    /// this service knows: the live replicas and the current quorum's
    /// members. `name` is either such an id, or the name torchft's
    /// `Manager` was given, which it turns into `name:uuid4` for the
    /// lighthouse while its process group hears only `name` (a
    /// `ProcessGroupRally` knows no other): then the one known id whose
    /// part before its last `:` is `name`. No such id, or several, is an
    /// error saying which.
    pub fn resolve_replica(&self, name: &str) -> Result<String, String> {
        let participants = self.current.iter().flat_map(|q| &q.participants);
        let known: BTreeSet<&str> = self
            .roster
            .replicas
            .keys()
            .chain(self.holders.keys())
            .map(String::as_str)
            .chain(participants.map(|m| m.replica_id.as_str()))
            .collect();
        if known.contains(name) {
            return Ok(name.to_owned());
        }
        let named: Vec<&str> = known
            .iter()
            .copied()
            .filter(|id| id.rsplit_once(':').is_some_and(|(n, _)| n == name))
            .collect();
        match named[..] {
            [one] => Ok(one.to_owned()),
            [] => Err(format!(
                "unknown replica id {name:?}: it is neither a live replica nor a member of the current quorum, nor the name (before \":uuid\") of one ({} known)",
                known.len()
            )),
            _ => Err(format!(
                "replica name {name:?} is ambiguous: {named:?} are all live; report the full replica id"
            )),
        }
    }

    /// What a predecessor left ([`Event::Restored`]); whether a quorum may
    /// now be ready.
    fn restore(
        &mut self,
        now: Instant,
        last_id: i64,
        quorum: Option<Quorum>,
        aborted: bool,
    ) -> bool {
        if self.counters.quorums_issued > 0 {
            return false;
        }
        // A standby's clock ran while it refused everyone: its grace starts
        // now, when it starts hearing replicas.
        self.started = Some(now);
        self.graced = false;
        if self.sabotage != Sabotage::RestoredIdIgnored {
            self.last_id = last_id;
        }
        self.restored = quorum.is_some();
        // An aborted quorum's id is dead (its members' generation was
        // aborted through the watch): the next quorum takes a new one.
        self.aborted = aborted && quorum.is_some();
        self.current = quorum;
        true
    }

    /// A requester's [`Remembered`] quorum: kept if nothing was issued or
    /// restored yet, the requester was a member of it, and its id is the
    /// highest told of so far (a member that missed the predecessor's last
    /// quorum remembers an older one; the newest wins).
    fn recall(&mut self, requester: &str, r: Remembered) {
        if self.counters.quorums_issued > 0 || self.current.is_some() {
            return;
        }
        if !r.replica_ids.iter().any(|m| m == requester) {
            return;
        }
        if self.recalled.as_ref().is_some_and(|q| q.id >= r.quorum_id) {
            return;
        }
        let mut ids = r.replica_ids;
        ids.sort();
        ids.dedup();
        let participants = ids
            .into_iter()
            .map(|replica_id| Member {
                replica_id,
                address: String::new(),
                store_address: String::new(),
                step: 0,
                world_size: 0,
                shrink_only: false,
                commit_failures: 0,
                data: String::new(),
            })
            .collect();
        self.recalled = Some(Quorum {
            id: r.quorum_id,
            participants,
            created: SystemTime::UNIX_EPOCH,
        });
    }

    /// The earliest the grace may end on a remembered quorum: the
    /// [`RECALL_FLOOR`] after the first event (never later than the grace).
    fn recall_floor(&self) -> Option<Instant> {
        let wait = if self.sabotage == Sabotage::NoRecallFloor {
            std::time::Duration::ZERO
        } else {
            RECALL_FLOOR
        };
        let grace = self.knobs.heartbeat_timeout.min(STARTUP_GRACE_MAX);
        self.started.map(|t| t + wait.min(grace))
    }

    /// Whether every member of the recalled quorum is waiting again, and
    /// every replica heard is waiting and told of a memory (see the module
    /// docs, "A restart without the grace").
    fn recalled_back(&self) -> bool {
        let Some(q) = &self.recalled else {
            return false;
        };
        let all_ours = self
            .roster
            .replicas
            .iter()
            .all(|(id, r)| r.waiting.is_some() && self.remembering.contains(id));
        if !all_ours {
            return false;
        }
        let back = |m: &Member| {
            self.roster
                .replicas
                .get(&m.replica_id)
                .is_some_and(|r| r.waiting.is_some())
        };
        if self.sabotage == Sabotage::RecalledAnyBack {
            return q.participants.iter().any(back);
        }
        q.participants.iter().all(back)
    }

    /// Whether every member of a restored quorum is waiting again: it may
    /// then be re-issued before the startup grace, since the replicas it
    /// waits for are all known.
    fn restored_back(&self) -> bool {
        let Some(q) = self.current.as_ref().filter(|_| self.restored) else {
            return false;
        };
        q.participants.iter().all(|m| {
            self.roster
                .replicas
                .get(&m.replica_id)
                .is_some_and(|r| r.waiting.is_some())
        })
    }

    /// A `Quorum` request; whether a quorum may now be ready.
    fn join(
        &mut self,
        now: Instant,
        session: Session,
        member: Member,
        remembered: Option<Remembered>,
        out: &mut Vec<Action>,
    ) -> bool {
        let id = member.replica_id.clone();
        if !self.claim(now, session, &id, Some(&member.address), out) {
            return false;
        }
        // Memories matter only before the first quorum (nothing restored).
        if self.counters.quorums_issued == 0 && self.current.is_none() {
            // A `Quorum` call comes after its caller's last step ended, so
            // it has left whatever generation it was in: none of the
            // predecessor's can complete without it (and this service's
            // first quorum takes a new id anyway). Not after a restore,
            // whose quorum may be re-issued under its id.
            if !self.predecessor_aborted {
                self.predecessor_aborted = true;
                out.push(Action::AbortPredecessor {
                    replica_id: id.clone(),
                    reason: format!(
                        "{id} asked this lighthouse for a new quorum before its first: the generations of any predecessor are over"
                    ),
                });
            }
            match remembered {
                Some(r) => {
                    self.remembering.insert(id.clone());
                    self.recall(&id, r);
                }
                None => {
                    self.remembering.remove(&id);
                }
            }
        }
        self.counters.joins += 1;
        self.roster.join(member, now);
        true
    }

    /// A heartbeat; whether a quorum may now be ready (a replica revived).
    fn heartbeat(
        &mut self,
        now: Instant,
        session: Session,
        id: String,
        out: &mut Vec<Action>,
    ) -> bool {
        let revived = self.stalled.contains_key(&id);
        if !self.claim(now, session, &id, None, out) {
            return false;
        }
        self.counters.heartbeats += 1;
        revived
    }

    /// Records that `session` speaks for `id` at `now` (a `Join` names its
    /// manager's `address`), refusing it if another live process holds
    /// `id`; whether it was accepted.
    fn claim(
        &mut self,
        now: Instant,
        session: Session,
        id: &str,
        address: Option<&str>,
        out: &mut Vec<Action>,
    ) -> bool {
        if self.displaced.contains(&(session, id.to_owned())) {
            let reason = format!(
                "replica id {id:?} was taken by another process while this session's was silent"
            );
            self.refuse(session, id, reason, out);
            return false;
        }
        let mut holder = match self.holders.remove(id) {
            Some(h) if !h.is(session, address) => {
                let mine = h.address.clone().unwrap_or_default();
                self.holders.insert(id.to_owned(), h);
                self.refuse(
                    session,
                    id,
                    format!(
                        "replica id {id:?} is held by another live process (manager {mine}); this request names {}: a replica id names one process",
                        address.unwrap_or("no address")
                    ),
                    out,
                );
                return false;
            }
            Some(h) => h,
            None => self.unstall(now, session, id, address, out),
        };
        holder.sessions.insert(session);
        if holder.address.is_none() {
            holder.address = address.map(str::to_owned);
        }
        if address.is_some() {
            holder.joined_on = Some(session);
        }
        self.holders.insert(id.to_owned(), holder);
        self.sessions
            .entry(session)
            .or_default()
            .insert(id.to_owned());
        self.roster.heard(id, now);
        true
    }

    /// The holder of `id` that was dropped for silence, if this request is
    /// its process speaking again (revived with its waiting call); else a
    /// fresh holder, the stalled process's waiting call refused.
    fn unstall(
        &mut self,
        now: Instant,
        session: Session,
        id: &str,
        address: Option<&str>,
        out: &mut Vec<Action>,
    ) -> Holder {
        let Some(stalled) = self.stalled.remove(id) else {
            return Holder::default();
        };
        if stalled.holder.is(session, address) {
            // The stopped process resumed: its waiting call waits again.
            let revive = self.sabotage != Sabotage::NoRevive;
            if let Some(member) = stalled.waiting.filter(|_| revive) {
                self.roster.join(member, now);
            }
            return stalled.holder;
        }
        // Another process takes the id: the old one's waiting call is
        // answered with an error, and its sessions no longer speak for it.
        for s in &stalled.holder.sessions {
            if let Some(ids) = self.sessions.get_mut(s) {
                ids.remove(id);
            }
            self.displaced.insert((*s, id.to_owned()));
        }
        if let (Some(_), Some(on)) = (&stalled.waiting, stalled.holder.joined_on) {
            let reason = format!(
                "replica id {id:?} was dropped for silence and taken by another process (session {session})"
            );
            self.refuse(on, id, reason, out);
        }
        Holder::default()
    }

    fn refuse(&mut self, session: Session, id: &str, reason: String, out: &mut Vec<Action>) {
        self.counters.refusals += 1;
        out.push(Action::Refuse {
            session,
            replica_id: id.to_owned(),
            reason,
        });
    }

    /// A `Quorum` call ended unanswered: if it was the replica's last
    /// `Join` (made over `session`), the replica stops being a participant
    /// (a stalled one is revived without it); whether a quorum may now be
    /// ready. A call over another session, or an older one, changes nothing.
    fn left(&mut self, session: Session, id: &str) -> bool {
        if self.sabotage == Sabotage::IgnoreLeft {
            return false;
        }
        if let Some(h) = self.holders.get(id) {
            if h.joined_on != Some(session) {
                return false;
            }
            let Some(r) = self.roster.replicas.get_mut(id) else {
                return false;
            };
            if r.waiting.take().is_none() {
                return false;
            }
        } else if let Some(st) = self.stalled.get_mut(id) {
            if st.holder.joined_on != Some(session) || st.waiting.take().is_none() {
                return false;
            }
        } else {
            return false;
        }
        self.counters.left += 1;
        true
    }

    /// A session ended: drops every replica it held; whether any was.
    fn closed(&mut self, session: Session, out: &mut Vec<Action>) -> bool {
        if self.sabotage == Sabotage::IgnoreClosed {
            return false;
        }
        self.displaced.retain(|(s, _)| *s != session);
        let peer = self.peers.remove(&session);
        let mut any = self.fresh.remove(&session) && self.settle_orphans(out);
        let Some(ids) = self.sessions.remove(&session) else {
            return any;
        };
        for id in ids {
            if let Some(h) = self.holders.get_mut(&id) {
                h.sessions.remove(&session);
                if !h.sessions.is_empty() {
                    continue;
                }
                if let Some(ip) = peer.filter(|ip| self.fresh_from(*ip)) {
                    // Perhaps its process's new connection (see the module
                    // docs): kept until that one speaks.
                    self.orphans.insert(id, (ip, session));
                    continue;
                }
                self.holders.remove(&id);
                self.drop_replica(&id, format!("its session ({session}) closed"), out);
                any = true;
            } else if let Some(st) = self.stalled.get_mut(&id) {
                st.holder.sessions.remove(&session);
                if st.holder.sessions.is_empty() {
                    self.stalled.remove(&id);
                }
            }
        }
        any
    }

    /// Whether a fresh session from `ip` is open.
    fn fresh_from(&self, ip: IpAddr) -> bool {
        self.sabotage != Sabotage::NoOrphans
            && self.fresh.iter().any(|s| self.peers.get(s) == Some(&ip))
    }

    /// Settles the orphans after a fresh session spoke or closed: adopted
    /// if a session speaks for them again, dropped if no fresh session from
    /// their peer is left; whether any was dropped.
    fn settle_orphans(&mut self, out: &mut Vec<Action>) -> bool {
        let orphans = std::mem::take(&mut self.orphans);
        let mut any = false;
        for (id, (ip, closed)) in orphans {
            let Some(h) = self.holders.get(&id) else {
                continue; // dropped for silence meanwhile
            };
            if !h.sessions.is_empty() {
                continue; // adopted
            }
            if self.fresh_from(ip) {
                self.orphans.insert(id, (ip, closed));
                continue;
            }
            self.holders.remove(&id);
            self.drop_replica(&id, format!("its session ({closed}) closed"), out);
            any = true;
        }
        any
    }

    /// Drops the replicas silent for `heartbeat_timeout` at `now`.
    fn expire(&mut self, now: Instant, out: &mut Vec<Action>) {
        let timeout = self.knobs.heartbeat_timeout;
        let silent: Vec<(String, Instant, Option<Member>)> = self
            .roster
            .replicas
            .iter()
            .filter(|(_, r)| now.saturating_duration_since(r.heard) >= timeout)
            .map(|(id, r)| {
                let waiting = r.waiting.as_ref().map(|p| p.member.clone());
                (id.clone(), r.heard, waiting)
            })
            .collect();
        for (id, last, waiting) in silent {
            self.orphans.remove(&id);
            // An orphan has no open session to resume over.
            if let Some(holder) = self.holders.remove(&id).filter(|h| !h.sessions.is_empty()) {
                self.stalled.insert(id.clone(), Stalled { holder, waiting });
            }
            let ms = now.saturating_duration_since(last).as_millis();
            self.drop_replica(
                &id,
                format!(
                    "no heartbeat for {ms} ms (heartbeat timeout {} ms)",
                    timeout.as_millis()
                ),
                out,
            );
        }
    }

    /// Forgets `id`'s heartbeat and waiting call; an abort if it is a member
    /// of the current quorum.
    fn drop_replica(&mut self, id: &str, reason: String, out: &mut Vec<Action>) {
        self.roster.replicas.remove(id);
        self.counters.drops += 1;
        if let Some(q) = &self.current {
            let member = q
                .participants
                .binary_search_by(|m| m.replica_id.as_str().cmp(id))
                .is_ok();
            if member && self.sabotage != Sabotage::NoAbort {
                self.counters.aborts += 1;
                self.aborted = true;
                out.push(Action::Abort {
                    quorum_id: q.id,
                    replica_id: id.to_owned(),
                    reason: reason.clone(),
                });
            }
        }
        out.push(Action::Dropped {
            replica_id: id.to_owned(),
            reason,
        });
    }

    fn rules(&self) -> Rules {
        Rules {
            min_replicas: self.sabotage != Sabotage::NoMinReplicas,
            majority_guard: self.sabotage != Sabotage::NoMajorityGuard,
        }
    }

    fn verdict(&self, now: Instant) -> Verdict {
        quorum::compute_with(
            now,
            &self.roster,
            self.current.as_ref(),
            &self.knobs,
            self.rules(),
        )
    }

    /// Issues a quorum if torchft's rules allow one now.
    fn attempt(&mut self, now: Instant, out: &mut Vec<Action>) {
        if self.roster.waiting().next().is_none() {
            return;
        }
        if !self.graced {
            let floor_passed = self.recall_floor().is_some_and(|f| now >= f);
            let by_memory = !self.restored_back() && floor_passed && self.recalled_back();
            if !self.restored_back() && !by_memory {
                return;
            }
            self.graced_by_memory = by_memory;
            // Every member of the predecessor's last quorum is back (and,
            // on a memory, every live manager of ours has reached us): the
            // replicas alive are known, as after the grace.
            self.graced = true;
        }
        let Verdict::Issue { members, .. } = self.verdict(now) else {
            return;
        };
        self.last_id = if self.restored && self.sabotage == Sabotage::RestoredIdAnyMembers {
            self.last_id
        } else if self.aborted && self.sabotage != Sabotage::ReuseAbortedId {
            self.last_id + 1
        } else {
            quorum::next_id(self.last_id, self.current.as_ref(), &members)
        };
        self.aborted = false;
        for m in &members {
            if let Some(r) = self.roster.replicas.get_mut(&m.replica_id) {
                r.waiting = None;
            }
        }
        // The callers left out wait again, as if they had just joined.
        for p in self
            .roster
            .replicas
            .values_mut()
            .filter_map(|r| r.waiting.as_mut())
        {
            p.joined = now;
        }
        let q = Quorum {
            id: self.last_id,
            participants: members,
            // The one clock read: a timestamp for humans, decided nothing.
            created: SystemTime::now(),
        };
        self.counters.quorums_issued += 1;
        self.counters.recalled += u64::from(std::mem::take(&mut self.graced_by_memory));
        self.restored = false;
        self.recalled = None;
        self.remembering.clear();
        self.current = Some(q.clone());
        out.push(Action::Issue(q));
    }
}

#[cfg(test)]
#[path = "machine/tests.rs"]
mod tests;
