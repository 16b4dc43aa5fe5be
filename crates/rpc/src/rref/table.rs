//! One worker's RRef bookkeeping as a pure machine: events in (a handle made,
//! forked or dropped, a control message received, a worker gone), effects out
//! (a control message to send, waiters to wake, a value deleted).
//!
//! Nothing here locks, sleeps, reads a clock or does I/O, and every map is
//! ordered, so the same events give the same effects in the same order: the agent
//! (`agent/rrefs.rs`) keeps a [`Table`] under a mutex, passes the time
//! in, and applies the effects after unlocking; the simulator (`sim.rs`)
//! drives several tables through reordered, repeated and delayed messages and
//! killed workers, and checks the protocol's guarantees after every step.
//!
//! # What is kept
//!
//! * **Owners** (`owners`, by RRef id): the value's state (pending, ready,
//!   failed), the users that may still use it (fork id → the worker holding
//!   it), the local handles, and the forks it sent that are not accepted yet.
//!   The value is deleted when all three are zero and it is no longer
//!   pending.
//! * **Users** (`users`, by fork id): a handle on a value owned elsewhere;
//!   unconfirmed until the owner has recorded it. When the program drops its
//!   last handle, the owner is told (USER_DELETE), once the user is confirmed
//!   and its own forks are accepted.
//! * **Children** (`children`, by fork id): forks sent in a message and not
//!   yet accepted; each keeps its parent (an owner entry or a user) from being
//!   deleted (PyTorch's G2).
//!
//! # Messages that come early, late or twice
//!
//! Control messages are retried, so they may arrive twice, and nothing orders
//! messages between different workers: a USER_DELETE or FORK_REQUEST may
//! reach the owner before the REMOTE_CALL that creates the value. A message
//! about an unknown value makes a *placeholder* entry (pending, not created);
//! a deleted fork leaves a *tombstone* when a message registering it may
//! still come (the deletion came first, or a FORK_REQUEST, which is retried,
//! registered it). Tombstones expire after [`super::TOMBSTONE_TTL`], and a
//! placeholder whose creation never came (its creator died) goes with its
//! last tombstone: nothing here grows without bound.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use super::{ForkId, Leak, RRefId, TOMBSTONE_TTL};
use crate::error::Error;

/// A control message of the RRef protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Control {
    /// To the owner: user `fork` is gone.
    UserDelete { rref: RRefId, fork: ForkId },
    /// To the owner: record user `fork`. Its outcome comes back through
    /// [`Table::fork_registered`].
    ForkRequest { rref: RRefId, fork: ForkId },
    /// To a parent: the owner knows child `fork`.
    ChildAccept { fork: ForkId },
}

/// What the agent must do after an event.
#[derive(Debug)]
pub(crate) enum Effect<V> {
    /// Send a control message; the agent retries it (handlers are idempotent).
    Send { to: u32, msg: Control },
    /// A user was confirmed, failed or released: its waiters look again.
    UserChanged,
    /// An owned value became ready or failed: its waiters look again.
    ValueSettled,
    /// An owned entry, a remote user or a child went away (shutdown waits
    /// for these).
    Drained,
    /// Owned value `rref` was deleted: drop it outside any lock (a value may
    /// hold RRefs, whose drop comes back here).
    Deleted { rref: RRefId, value: Option<V> },
    /// A value with nowhere to go (its entry was already settled): drop it.
    Dispose(V),
}

/// How an owned value stands.
pub(crate) enum OwnerState<V> {
    /// Being made (or its creation has not arrived).
    Pending,
    Ready(V),
    Failed(String),
}

struct OwnerEntry<V> {
    state: OwnerState<V>,
    /// The creation arrived (or the value was made here); a placeholder made
    /// by an earlier message waits for it.
    created: bool,
    /// Users that may still use the value, with the worker holding each.
    forks: BTreeMap<ForkId, u32>,
    /// Deleted users that a late message could register again, and when
    /// each was deleted.
    deleted: BTreeMap<ForkId, Instant>,
    /// Users registered by a FORK_REQUEST (retried, so it may repeat).
    requested: BTreeSet<ForkId>,
    /// Live local handles (owner `RRef`s).
    local: usize,
    /// Forks of a local handle sent and not yet accepted.
    children: usize,
    /// When the entry was made.
    since: Instant,
    /// Some worker other than the owner used it at some time: messages
    /// about it may still come after it is deleted.
    shared: bool,
    what: String,
}

impl<V> OwnerEntry<V> {
    fn new(what: &str, created: bool, now: Instant) -> Self {
        OwnerEntry {
            state: OwnerState::Pending,
            created,
            forks: BTreeMap::new(),
            deleted: BTreeMap::new(),
            requested: BTreeSet::new(),
            local: 0,
            children: 0,
            since: now,
            shared: false,
            what: what.to_owned(),
        }
    }

    fn unreferenced(&self) -> bool {
        self.forks.is_empty() && self.local == 0 && self.children == 0
    }
}

struct UserEntry {
    rref: RRefId,
    owner: u32,
    /// The worker that sent this fork (`None`: made here by `remote()`).
    parent: Option<u32>,
    confirmed: bool,
    /// The program dropped its last handle.
    dropped: bool,
    /// Released by shutdown: unusable, and already deleted at the owner.
    released: bool,
    /// The creation or the registration failed: every use reports it.
    error: Option<Error>,
    /// Forks of this user sent and not yet accepted.
    children: usize,
    what: String,
}

/// Whose handle a child keeps alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Parent {
    Owner(RRefId),
    User(ForkId),
}

struct Child {
    parent: Parent,
    /// The worker the fork was sent to.
    on: u32,
}

/// A user as its waiters see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum UserStatus {
    Unconfirmed,
    Confirmed,
    Released {
        rref: RRefId,
    },
    Failed(Error),
    /// No such user here.
    Unknown,
}

/// What a fork arriving in a message became here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Adoption {
    /// A local handle of a value owned here.
    Owner,
    /// A user; `unconfirmed` until the owner records it.
    User { unconfirmed: bool },
}

/// How often placeholders and tombstones are swept, at most.
const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// One worker's RRef table. `V` is the value type (the agent's boxed values;
/// a number in the simulator).
pub(crate) struct Table<V> {
    me: u32,
    owners: BTreeMap<RRefId, OwnerEntry<V>>,
    users: BTreeMap<ForkId, UserEntry>,
    children: BTreeMap<ForkId, Child>,
    /// Shared values deleted here, and when: a late FORK_REQUEST is refused
    /// and a late USER_DELETE ignored, instead of making a placeholder.
    retired: BTreeMap<RRefId, Instant>,
    /// The time of the current event.
    now: Instant,
    swept: Option<Instant>,
    /// Breaks G2 on purpose (the simulator's check of itself).
    #[cfg(test)]
    pub(crate) broken: bool,
}

type Out<V> = Vec<Effect<V>>;

impl<V> Table<V> {
    pub(crate) fn new(me: u32, now: Instant) -> Self {
        Table {
            me,
            owners: BTreeMap::new(),
            users: BTreeMap::new(),
            children: BTreeMap::new(),
            retired: BTreeMap::new(),
            now,
            swept: None,
            #[cfg(test)]
            broken: false,
        }
    }

    /// Sets the time of the events that follow (it never goes back).
    pub(crate) fn tick(&mut self, now: Instant) {
        self.now = self.now.max(now);
    }

    fn placeholder(&mut self, rref: RRefId, what: &str) -> &mut OwnerEntry<V> {
        let now = self.now;
        self.owners
            .entry(rref)
            .or_insert_with(|| OwnerEntry::new(what, false, now))
    }

    // ---- values owned here ----

    /// A value made here with one local handle (`Rpc::rref`, or `remote()`
    /// to this worker itself); pending until [`Table::set_value`].
    pub(crate) fn new_owned(&mut self, rref: RRefId, what: &str) {
        let now = self.now;
        let e = self
            .owners
            .entry(rref)
            .or_insert_with(|| OwnerEntry::new(what, true, now));
        e.created = true;
        e.local += 1;
    }

    /// A REMOTE_CALL arrived: the value is being made, and the creator's
    /// `fork` uses it (unless its deletion came first).
    pub(crate) fn remote_arrived(&mut self, rref: RRefId, fork: ForkId, from: u32, what: &str) {
        let e = self.placeholder(rref, what);
        e.created = true;
        e.shared = true;
        e.what = what.to_owned();
        if !e.deleted.contains_key(&fork) {
            e.forks.insert(fork, from);
        }
    }

    /// The value of `rref` is ready (or failed to be made).
    pub(crate) fn set_value(
        &mut self,
        rref: RRefId,
        v: std::result::Result<V, String>,
        out: &mut Out<V>,
    ) {
        match self.owners.get_mut(&rref) {
            Some(e) if matches!(e.state, OwnerState::Pending) => {
                e.state = match v {
                    Ok(v) => OwnerState::Ready(v),
                    Err(m) => OwnerState::Failed(m),
                };
                out.push(Effect::ValueSettled);
                self.maybe_delete(rref, out);
            }
            _ => {
                if let Ok(v) = v {
                    out.push(Effect::Dispose(v));
                }
            }
        }
    }

    /// The value of `rref` as its waiters see it (`None`: unknown here).
    pub(crate) fn value(&self, rref: RRefId) -> Option<&OwnerState<V>> {
        self.owners.get(&rref).map(|e| &e.state)
    }

    /// A local handle of `rref` was dropped.
    pub(crate) fn owner_dropped(&mut self, rref: RRefId, out: &mut Out<V>) {
        if let Some(e) = self.owners.get_mut(&rref) {
            e.local = e.local.saturating_sub(1);
        }
        self.maybe_delete(rref, out);
    }

    fn maybe_delete(&mut self, rref: RRefId, out: &mut Out<V>) {
        let Some(e) = self.owners.get(&rref) else {
            return;
        };
        if e.unreferenced() && !matches!(e.state, OwnerState::Pending) {
            let e = self.owners.remove(&rref).expect("present");
            if e.shared {
                self.retired.insert(rref, self.now);
            }
            let value = match e.state {
                OwnerState::Ready(v) => Some(v),
                _ => None,
            };
            out.push(Effect::Deleted { rref, value });
            out.push(Effect::Drained);
        }
    }

    // ---- control messages at the owner ----

    /// USER_DELETE. Idempotent.
    pub(crate) fn user_delete(&mut self, rref: RRefId, fork: ForkId, out: &mut Out<V>) {
        self.sweep(false, out);
        if self.retired.contains_key(&rref) {
            return;
        }
        let now = self.now;
        let e = self.placeholder(rref, "deleted before its creation arrived");
        let known = e.forks.remove(&fork).is_some();
        let repeatable = e.requested.remove(&fork);
        if !known || repeatable {
            // A message registering this fork may still come.
            e.deleted.insert(fork, now);
        }
        if known {
            out.push(Effect::Drained);
        }
        self.maybe_delete(rref, out);
    }

    /// FORK_REQUEST. Idempotent, and a deleted fork stays deleted. Refused
    /// for a value already deleted: the fork's parent died before the owner
    /// recorded it (a retry of a request that was recorded cannot come
    /// after the deletion: its user is deleted only once confirmed).
    pub(crate) fn fork_request(
        &mut self,
        rref: RRefId,
        fork: ForkId,
        from: u32,
        out: &mut Out<V>,
    ) -> std::result::Result<(), String> {
        self.sweep(false, out);
        if self.retired.contains_key(&rref) {
            return Err(format!(
                "RRef {rref} was deleted by its owner before fork {fork} was recorded (the worker that sent the fork stopped before its owner heard of it)"
            ));
        }
        let e = self.placeholder(rref, "forked before its creation arrived");
        e.shared = true;
        if !e.deleted.contains_key(&fork) {
            e.forks.insert(fork, from);
            e.requested.insert(fork);
        }
        Ok(())
    }

    /// Drops expired tombstones, and placeholders whose creation never came
    /// once nothing refers to them (at most every minute unless `force`).
    pub(crate) fn sweep(&mut self, force: bool, out: &mut Out<V>) {
        let now = self.now;
        if !force
            && self
                .swept
                .is_some_and(|t| now.saturating_duration_since(t) < SWEEP_EVERY)
        {
            return;
        }
        self.swept = Some(now);
        let expired = |at: &Instant| now.saturating_duration_since(*at) >= TOMBSTONE_TTL;
        self.retired.retain(|_, at| !expired(at));
        let mut gone = Vec::new();
        for (id, e) in self.owners.iter_mut() {
            e.deleted.retain(|_, at| !expired(at));
            if !e.created && e.unreferenced() && e.deleted.is_empty() && expired(&e.since) {
                gone.push(*id);
            }
        }
        for rref in gone {
            self.owners.remove(&rref);
            out.push(Effect::Deleted { rref, value: None });
        }
    }

    // ---- users here ----

    /// A user made by `remote()`: unconfirmed until the owner answers.
    pub(crate) fn new_user(&mut self, rref: RRefId, fork: ForkId, owner: u32, what: &str) {
        self.users.insert(
            fork,
            UserEntry {
                rref,
                owner,
                parent: None,
                confirmed: false,
                dropped: false,
                released: false,
                error: None,
                children: 0,
                what: what.to_owned(),
            },
        );
    }

    /// The owner has recorded user `fork` (or `error`: it never will).
    pub(crate) fn confirm(&mut self, fork: ForkId, error: Option<Error>, out: &mut Out<V>) {
        let Some(u) = self.users.get_mut(&fork) else {
            return;
        };
        u.confirmed = true;
        if u.error.is_none() {
            u.error = error;
        }
        out.push(Effect::UserChanged);
        self.maybe_delete_user(fork, out);
    }

    /// The FORK_REQUEST of user `fork` ended: confirm it (or fail it) and let
    /// its parent go.
    pub(crate) fn fork_registered(
        &mut self,
        fork: ForkId,
        result: std::result::Result<(), Error>,
        out: &mut Out<V>,
    ) {
        let parent = self.users.get(&fork).and_then(|u| u.parent);
        self.confirm(fork, result.err(), out);
        if let Some(p) = parent {
            self.accept_at(p, fork, out);
        }
    }

    /// How user `fork` stands.
    pub(crate) fn user(&self, fork: ForkId) -> UserStatus {
        match self.users.get(&fork) {
            None => UserStatus::Unknown,
            Some(u) if u.released => UserStatus::Released { rref: u.rref },
            Some(u) => match &u.error {
                Some(e) => UserStatus::Failed(e.clone()),
                None if u.confirmed => UserStatus::Confirmed,
                None => UserStatus::Unconfirmed,
            },
        }
    }

    /// The program dropped its last handle of user `fork`.
    pub(crate) fn user_dropped(&mut self, fork: ForkId, out: &mut Out<V>) {
        if let Some(u) = self.users.get_mut(&fork) {
            u.dropped = true;
        }
        self.maybe_delete_user(fork, out);
    }

    fn maybe_delete_user(&mut self, fork: ForkId, out: &mut Out<V>) {
        let Some(u) = self.users.get(&fork) else {
            return;
        };
        #[cfg(test)]
        let keep_for_children = u.children > 0 && !self.broken;
        #[cfg(not(test))]
        let keep_for_children = u.children > 0;
        if !u.dropped || keep_for_children {
            return;
        }
        if u.released {
            // Its deletion went at shutdown.
            self.users.remove(&fork);
            out.push(Effect::Drained);
        } else if u.confirmed {
            let u = self.users.remove(&fork).expect("present");
            out.push(Effect::Send {
                to: u.owner,
                msg: Control::UserDelete { rref: u.rref, fork },
            });
            out.push(Effect::Drained);
        }
    }

    // ---- forks ----

    /// Forks the handle `parent` (of `rref`, owned by `owner`) as `fork`,
    /// for a message to worker `dest`. The parent is kept until the child is
    /// accepted or cancelled.
    pub(crate) fn fork(
        &mut self,
        parent: Parent,
        fork: ForkId,
        dest: u32,
    ) -> std::result::Result<(), String> {
        match parent {
            Parent::User(f) => {
                let u = self
                    .users
                    .get_mut(&f)
                    .ok_or_else(|| format!("fork {f} is not a live user"))?;
                if u.released {
                    return Err(format!("RRef {} was released at shutdown", u.rref));
                }
                if let Some(e) = &u.error {
                    return Err(format!("RRef {} failed: {e}", u.rref));
                }
                u.children += 1;
            }
            Parent::Owner(rref) => {
                let e = self
                    .owners
                    .get_mut(&rref)
                    .ok_or_else(|| format!("RRef {rref} is not owned here"))?;
                // The owner records its own forks at once.
                e.forks.insert(fork, dest);
                e.shared |= dest != self.me;
                e.children += 1;
            }
        }
        self.children.insert(fork, Child { parent, on: dest });
        Ok(())
    }

    /// Forks made for a message that was never delivered: let their parents
    /// go, and forget the owner's record of the ones it made.
    pub(crate) fn cancel_children(&mut self, forks: &[ForkId], out: &mut Out<V>) {
        for f in forks {
            if let Some(Child {
                parent: Parent::Owner(rref),
                ..
            }) = self.children.get(f)
            {
                if let Some(e) = self.owners.get_mut(rref) {
                    e.forks.remove(f);
                }
            }
            self.child_accept(*f, out);
        }
    }

    /// CHILD_ACCEPT at the parent: let the parent go. Idempotent.
    pub(crate) fn child_accept(&mut self, fork: ForkId, out: &mut Out<V>) {
        let Some(c) = self.children.remove(&fork) else {
            return;
        };
        match c.parent {
            Parent::User(f) => {
                if let Some(u) = self.users.get_mut(&f) {
                    u.children -= 1;
                }
                self.maybe_delete_user(f, out);
            }
            Parent::Owner(rref) => {
                if let Some(e) = self.owners.get_mut(&rref) {
                    e.children -= 1;
                }
                self.maybe_delete(rref, out);
            }
        }
        out.push(Effect::Drained);
    }

    fn accept_at(&mut self, parent: u32, fork: ForkId, out: &mut Out<V>) {
        if parent == self.me {
            self.child_accept(fork, out);
        } else {
            out.push(Effect::Send {
                to: parent,
                msg: Control::ChildAccept { fork },
            });
        }
    }

    /// A fork arrived in a message (whatever becomes of the message): it is
    /// a local handle if the value is owned here, a user otherwise.
    pub(crate) fn adopt(
        &mut self,
        owner: u32,
        rref: RRefId,
        fork: ForkId,
        parent: u32,
        what: &str,
        out: &mut Out<V>,
    ) -> Adoption {
        if owner == self.me {
            // Sent to its owner: a local handle (of nothing, if the value
            // was deleted: its sender stopped before the owner heard of its
            // fork). A fork the owner made itself is not a user after all.
            if !self.retired.contains_key(&rref) {
                let e = self.placeholder(rref, what);
                e.local += 1;
                e.forks.remove(&fork);
            }
            self.accept_at(parent, fork, out);
            return Adoption::Owner;
        }
        let from_owner = parent == owner;
        self.users.insert(
            fork,
            UserEntry {
                rref,
                owner,
                parent: Some(parent),
                confirmed: from_owner,
                dropped: false,
                released: false,
                error: None,
                children: 0,
                what: what.to_owned(),
            },
        );
        if from_owner {
            // The owner recorded it when it forked.
            self.accept_at(parent, fork, out);
        } else {
            out.push(Effect::Send {
                to: owner,
                msg: Control::ForkRequest { rref, fork },
            });
        }
        Adoption::User {
            unconfirmed: !from_owner,
        }
    }

    // ---- workers gone, shutdown ----

    /// Worker `peer` is gone: its children here will never be accepted, and
    /// its users of values owned here will never be deleted. Returns what it
    /// held, by value.
    pub(crate) fn peer_gone(&mut self, peer: u32, name: &str, out: &mut Out<V>) -> Vec<Leak> {
        let gone: Vec<ForkId> = self
            .children
            .iter()
            .filter(|(_, c)| c.on == peer)
            .map(|(f, _)| *f)
            .collect();
        for f in gone {
            self.child_accept(f, out);
        }
        let mut leaks = Vec::new();
        let mut touched = Vec::new();
        for (id, e) in self.owners.iter_mut() {
            let before = e.forks.len();
            e.forks.retain(|_, w| *w != peer);
            let forks = &e.forks;
            e.requested.retain(|f| forks.contains_key(f));
            if e.forks.len() != before {
                leaks.push(Leak {
                    rref: *id,
                    what: e.what.clone(),
                    held_by: vec![format!("worker {name}, which is gone")],
                });
                touched.push(*id);
            }
        }
        for id in touched {
            self.maybe_delete(id, out);
        }
        out.push(Effect::Drained);
        leaks
    }

    /// Shutdown: release every user held here that has no fork in flight
    /// (deleting it at its owner), so handles the program still holds become
    /// unusable. Returns how many users are still unconfirmed.
    pub(crate) fn release_users(&mut self, out: &mut Out<V>) -> usize {
        let mut unconfirmed = 0;
        for (f, u) in self.users.iter_mut() {
            // G2: a parent is released only once its children are accepted.
            if u.released || u.children > 0 {
                continue;
            }
            if !u.confirmed {
                unconfirmed += 1;
                continue;
            }
            u.released = true;
            out.push(Effect::Send {
                to: u.owner,
                msg: Control::UserDelete {
                    rref: u.rref,
                    fork: *f,
                },
            });
        }
        out.push(Effect::UserChanged);
        let dropped: Vec<ForkId> = self
            .users
            .iter()
            .filter(|(_, u)| u.released && u.dropped)
            .map(|(f, _)| *f)
            .collect();
        for f in dropped {
            self.maybe_delete_user(f, out);
        }
        unconfirmed
    }

    /// Shutdown: is anything still waiting on others (children unaccepted,
    /// users unconfirmed, and with `owners`, owned values with remote users)?
    pub(crate) fn settled(&self, owners: bool) -> bool {
        self.children.is_empty()
            && self.users.values().all(|u| u.confirmed)
            && (!owners || self.owners.values().all(|e| e.forks.is_empty()))
    }

    /// What is still referenced, by name.
    pub(crate) fn leaks(&self, name_of: &dyn Fn(u32) -> String) -> Vec<Leak> {
        let mut out: Vec<Leak> = self
            .owners
            .iter()
            .filter(|(_, e)| !e.forks.is_empty())
            .map(|(id, e)| {
                let mut held_by: Vec<String> = e.forks.values().map(|w| name_of(*w)).collect();
                held_by.sort();
                held_by.dedup();
                Leak {
                    rref: *id,
                    what: e.what.clone(),
                    held_by,
                }
            })
            .collect();
        out.extend(self.users.values().filter(|u| !u.confirmed).map(|u| Leak {
            rref: u.rref,
            what: u.what.clone(),
            held_by: vec![format!(
                "a user here the owner {} never confirmed",
                name_of(u.owner)
            )],
        }));
        out.sort_by_key(|l| l.rref);
        out
    }

    /// Counts for tests and reports: (owned entries, users, children).
    pub(crate) fn counts(&self) -> (usize, usize, usize) {
        (self.owners.len(), self.users.len(), self.children.len())
    }

    /// Tombstones kept: of deleted users, over every owned entry, and of
    /// deleted values.
    pub(crate) fn tombstones(&self) -> usize {
        self.owners.values().map(|e| e.deleted.len()).sum::<usize>() + self.retired.len()
    }

    // ---- for the simulator's invariants ----

    /// Every value owned here (ready, pending or failed), by id.
    #[cfg(test)]
    pub(crate) fn owned(&self) -> Vec<RRefId> {
        self.owners.keys().copied().collect()
    }

    /// Users here: (fork, rref, owner, held: not dropped, released or failed).
    #[cfg(test)]
    pub(crate) fn user_list(&self) -> Vec<(ForkId, RRefId, u32, bool)> {
        self.users
            .iter()
            .map(|(f, u)| {
                (
                    *f,
                    u.rref,
                    u.owner,
                    !u.dropped && !u.released && u.error.is_none(),
                )
            })
            .collect()
    }
}
