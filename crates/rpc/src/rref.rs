//! Remote references, with PyTorch's owner-based reference counting.
//!
//! An [`RRef<T>`] names a value held by one worker, its *owner*. Every other
//! worker's handle is a *user*, identified by a fork id unique in the job; the
//! owner keeps the set of fork ids that may still use its value (with the
//! worker holding each), and deletes the value when that set is empty and no
//! local handle is left. The messages and guarantees are PyTorch's ("Note
//! [RRef Protocol]"):
//!
//! * `remote()` creates the first user on the caller; the owner records its
//!   fork when the REMOTE_CALL arrives, and the answer confirms the user.
//! * Passing an RRef in a message forks it: the sender makes a new fork id and
//!   keeps its own handle alive as the child's *parent* until the child has
//!   been accepted (G2: a parent is not deleted before the owner has confirmed
//!   its child). A child on a third worker asks the owner to record it
//!   (FORK_REQUEST), and once the owner has, tells its parent (CHILD_ACCEPT). A
//!   fork made by the owner is recorded at once; a fork sent to the owner
//!   becomes a local handle there.
//! * When the last handle of a user is dropped, the owner is told (USER_DELETE;
//!   G1: the owner is told of every user deletion). A user dropped before it was
//!   confirmed is deleted when the confirmation arrives.
//! * No ordering between workers is assumed: a FORK_REQUEST or fetch may reach
//!   the owner before the REMOTE_CALL that creates the value, and waits for it.
//!   Control messages are retried, so their handlers are idempotent; the owner
//!   remembers a deleted fork (a tombstone) when a message that registers it
//!   may still come: the deletion came first, or the fork was registered by
//!   a FORK_REQUEST, which is retried. A tombstone is kept for
//!   [`TOMBSTONE_TTL`], longer than any retry lasts; the forks the owner
//!   makes itself (a parameter server handing out its RRef) leave none, so a
//!   long-lived value's bookkeeping does not grow with its users.
//! * User functions run only after every RRef among their arguments is
//!   confirmed.
//!
//! Unlike PyTorch, deletion does not wait for a garbage collector: dropping the
//! last `RRef` handle sends the deletion. At graceful shutdown every user still
//! held is released, owners wait for their users' deletions, and whatever is
//! still referenced when time runs out is reported by name (never dropped
//! silently).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tokio::sync::Notify;

use crate::agent::{with_de, with_ser, AgentInner, Value};
use crate::{Error, Result, Rpc};

/// A job-wide unique id: the worker that made it and a counter there
/// (PyTorch's `GloballyUniqueId`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Gid {
    pub created_on: u32,
    pub local: u64,
}

pub type RRefId = Gid;
pub type ForkId = Gid;

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.created_on, self.local)
    }
}

/// What a fork carries on the wire. Every message lists the forks it carries
/// beside its arguments, so the receiver adopts (and, if it never decodes
/// them, releases) each one: a fork can never be lost with an undecodable or
/// unanswered message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkData {
    pub owner: u32,
    pub rref: RRefId,
    pub fork: ForkId,
    pub parent: u32,
    pub type_name: String,
    pub what: String,
}

/// One local handle (an owner's or a user's); dropping the last clone of an
/// [`RRef`] drops it.
pub(crate) struct Handle {
    pub(crate) agent: Weak<AgentInner>,
    pub(crate) id: RRefId,
    pub(crate) owner: u32,
    /// `None` on the owner.
    pub(crate) fork: Option<ForkId>,
    pub(crate) what: String,
    pub(crate) type_name: String,
}

impl Drop for Handle {
    fn drop(&mut self) {
        if let Some(a) = self.agent.upgrade() {
            match self.fork {
                None => a.rrefs.owner_handle_dropped(&a, self.id),
                Some(f) => a.rrefs.user_dropped(&a, f),
            }
        }
    }
}

/// A reference to a value of type `T` held by its owner.
///
/// Clone it freely; pass it as an argument (or return it from a function) to
/// share it with another worker, which forks it.
pub struct RRef<T> {
    pub(crate) h: Arc<Handle>,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for RRef<T> {
    fn clone(&self) -> Self {
        RRef {
            h: self.h.clone(),
            _t: PhantomData,
        }
    }
}

impl<T> fmt::Debug for RRef<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RRef({} owned by worker {}, {})",
            self.h.id, self.h.owner, self.h.what
        )
    }
}

impl<T: Serialize + DeserializeOwned + Send + 'static> RRef<T> {
    pub(crate) fn from_handle(h: Arc<Handle>) -> Self {
        RRef { h, _t: PhantomData }
    }

    /// The id of the referenced value.
    pub fn id(&self) -> RRefId {
        self.h.id
    }

    /// The owner's worker id.
    pub fn owner(&self) -> u32 {
        self.h.owner
    }

    /// The owner's name.
    pub fn owner_name(&self) -> Result<String> {
        let a = self.agent()?;
        Ok(a.worker_by_id(self.h.owner)?.name)
    }

    /// Whether this worker owns the value.
    pub fn is_owner(&self) -> bool {
        self.h.fork.is_none()
    }

    /// Whether the owner has recorded this handle (always true on the owner).
    pub fn confirmed_by_owner(&self) -> bool {
        match self.h.fork {
            None => true,
            Some(f) => self
                .agent()
                .map(|a| a.rrefs.is_confirmed(f))
                .unwrap_or(false),
        }
    }

    fn agent(&self) -> Result<Arc<AgentInner>> {
        self.h
            .agent
            .upgrade()
            .ok_or_else(|| Error::Shutdown("(gone)".into()))
    }

    /// A copy of the value, fetched from the owner (the default timeout).
    pub async fn to_here(&self) -> Result<T> {
        self.to_here_timeout(None).await
    }

    /// [`RRef::to_here`] with a timeout (`Duration::ZERO`: none).
    pub async fn to_here_timeout(&self, timeout: Option<std::time::Duration>) -> Result<T> {
        let a = self.agent()?;
        let timeout = self.usable_within(&a, timeout).await?;
        let rpc = Rpc(a);
        rpc.request(
            self.h.owner,
            crate::wire::Request::Fetch { rref: self.h.id },
            &(),
            timeout,
        )
        .await
    }

    /// Runs `f` on the value, on its owner only.
    pub async fn with_local_value<R>(&self, f: impl FnOnce(&mut T) -> R) -> Result<R> {
        let a = self.agent()?;
        if !self.is_owner() {
            return Err(Error::Invalid(format!(
                "local_value of {} is only available on its owner (worker {})",
                self.h.id, self.h.owner
            )));
        }
        let v = a.rrefs.owner_value(self.h.id).await?;
        let mut g = v.lock().unwrap_or_else(|e| e.into_inner());
        let any = g.as_any();
        let t = any.downcast_mut::<T>().ok_or_else(|| {
            Error::Invalid(format!(
                "{} holds a {}, not a {}",
                self.h.id,
                self.h.type_name,
                std::any::type_name::<T>()
            ))
        })?;
        Ok(f(t))
    }

    /// Runs the registered method `method` on the value at its owner and
    /// returns its result (PyTorch's `rref.rpc_sync().method(...)`).
    pub async fn call<A: Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        args: &A,
    ) -> Result<R> {
        self.call_timeout(method, args, None).await
    }

    /// [`RRef::call`] with a timeout.
    pub async fn call_timeout<A: Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        args: &A,
        timeout: Option<std::time::Duration>,
    ) -> Result<R> {
        let a = self.agent()?;
        let timeout = self.usable_within(&a, timeout).await?;
        Rpc(a)
            .request(
                self.h.owner,
                crate::wire::Request::Method {
                    rref: self.h.id,
                    method: method.to_owned(),
                },
                args,
                timeout,
            )
            .await
    }
}

impl<T> RRef<T> {
    /// Waits until this user is confirmed by its owner, within the use's own
    /// timeout (`None`: the default; zero: none), and returns what is left
    /// of that timeout for the use itself: the confirmation is part of the
    /// use, not a wait before its deadline starts.
    async fn usable_within(
        &self,
        a: &Arc<AgentInner>,
        timeout: Option<Duration>,
    ) -> Result<Option<Duration>> {
        let Some(f) = self.h.fork else {
            return Ok(timeout);
        };
        let t = timeout.unwrap_or(a.default_timeout);
        if t.is_zero() {
            a.rrefs.user_usable(a, f).await?;
            return Ok(timeout);
        }
        let start = std::time::Instant::now();
        let expired = || Error::Timeout {
            worker: a
                .worker_by_id(self.h.owner)
                .map_or_else(|_| self.h.owner.to_string(), |w| w.name),
            what: format!("the owner's confirmation of RRef {}", self.h.id),
            ms: t.as_millis(),
        };
        tokio::time::timeout(t, a.rrefs.user_usable(a, f))
            .await
            .map_err(|_| expired())??;
        match t.checked_sub(start.elapsed()).filter(|l| !l.is_zero()) {
            Some(left) => Ok(Some(left)),
            None => Err(expired()),
        }
    }
}

impl<T> Serialize for RRef<T> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let data = with_ser(|cx| cx.fork(&self.h))
            .ok_or_else(|| {
                serde::ser::Error::custom(
                    "an RRef can only be serialised as part of an RPC message",
                )
            })?
            .map_err(serde::ser::Error::custom)?;
        data.serialize(s)
    }
}

impl<'de, T: 'static> Deserialize<'de> for RRef<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let data = ForkData::deserialize(d)?;
        let want = std::any::type_name::<T>();
        if data.type_name != want {
            let m = format!(
                "RRef {} holds a {}, not a {want}",
                data.rref, data.type_name
            );
            let _ = with_de(|cx| cx.fail::<()>(m.clone()));
            return Err(serde::de::Error::custom(m));
        }
        let h = with_de(|cx| cx.take(&data))
            .ok_or_else(|| {
                serde::de::Error::custom("an RRef can only be deserialised from an RPC message")
            })?
            .map_err(serde::de::Error::custom)?;
        Ok(RRef { h, _t: PhantomData })
    }
}

/// How an owned value stands.
pub(crate) enum OwnerState {
    /// The creating call has not finished (or not arrived).
    Pending,
    Ready(Arc<Mutex<Box<dyn Value>>>),
    Failed(String),
}

pub(crate) struct OwnerEntry {
    pub(crate) state: OwnerState,
    /// Users that may still use the value, with the worker holding each.
    forks: HashMap<ForkId, u32>,
    /// Deleted users, so that a late duplicate fork request is ignored, and
    /// when each was deleted (dropped after [`TOMBSTONE_TTL`]).
    deleted: HashMap<ForkId, Instant>,
    /// Users registered by a FORK_REQUEST (retried, so it may repeat).
    requested: HashSet<ForkId>,
    /// Live local handles (owner `RRef`s).
    local: usize,
    pub(crate) what: String,
    pub(crate) ready: Arc<Notify>,
}

pub(crate) struct UserEntry {
    rref: RRefId,
    owner: u32,
    confirmed: bool,
    /// The last handle is gone; delete once confirmed.
    dropped: bool,
    /// Released by shutdown: unusable.
    released: bool,
    /// `remote()` failed (or timed out): every use reports it.
    error: Option<Error>,
    what: String,
    notify: Arc<Notify>,
}

/// A parent's handle, kept until its child is accepted (G2).
struct Child {
    _parent: Arc<Handle>,
    on: u32,
}

#[derive(Default)]
struct State {
    owners: HashMap<RRefId, OwnerEntry>,
    users: HashMap<ForkId, UserEntry>,
    children: HashMap<ForkId, Child>,
    /// Deleted values and released handles, dropped only after the lock is
    /// released: a value may hold RRefs, whose drop comes back here.
    dead: Vec<Box<dyn Send>>,
}

/// The state's lock; drops what was deleted under it after unlocking.
struct Guard<'a>(Option<std::sync::MutexGuard<'a, State>>);

impl std::ops::Deref for Guard<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        self.0.as_ref().expect("locked")
    }
}

impl std::ops::DerefMut for Guard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.0.as_mut().expect("locked")
    }
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        let dead = self.0.as_mut().map(|g| std::mem::take(&mut g.dead));
        self.0 = None;
        drop(dead);
    }
}

/// One worker's RRef bookkeeping.
#[derive(Default)]
pub(crate) struct RRefContext {
    st: Mutex<State>,
    /// Signalled whenever an owner entry or a child goes away (shutdown waits).
    pub(crate) changed: Notify,
}

/// How long a deleted fork's tombstone is kept: longer than a FORK_REQUEST
/// is retried (5 attempts, each within a call timeout of 60 s by default).
pub(crate) const TOMBSTONE_TTL: Duration = Duration::from_secs(600);

/// An RRef still referenced when shutdown gave up waiting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leak {
    pub rref: RRefId,
    /// What created it, e.g. `remote "make_model" from worker trainer0`.
    pub what: String,
    /// Workers still holding a reference (by name), or why it is leaked.
    pub held_by: Vec<String>,
}

impl fmt::Display for Leak {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RRef {} ({}) still referenced by {}",
            self.rref,
            self.what,
            self.held_by.join(", ")
        )
    }
}

impl RRefContext {
    fn lock(&self) -> Guard<'_> {
        Guard(Some(self.st.lock().unwrap_or_else(|e| e.into_inner())))
    }

    /// The owner's entry for `rref`, created pending if a message about it
    /// arrives before the call that makes it.
    fn entry<'a>(st: &'a mut State, rref: RRefId, what: &str) -> &'a mut OwnerEntry {
        st.owners.entry(rref).or_insert_with(|| OwnerEntry {
            state: OwnerState::Pending,
            forks: HashMap::new(),
            deleted: HashMap::new(),
            requested: HashSet::new(),
            local: 0,
            what: what.to_owned(),
            ready: Arc::new(Notify::new()),
        })
    }

    /// A new value owned here with one local handle (`RRef::new`, or a
    /// `remote()` to self).
    pub(crate) fn new_owned(
        &self,
        a: &Arc<AgentInner>,
        what: String,
        type_name: &'static str,
    ) -> Arc<Handle> {
        let id = a.gid();
        Self::entry(&mut self.lock(), id, &what).local += 1;
        Arc::new(Handle {
            agent: Arc::downgrade(a),
            id,
            owner: a.me.id,
            fork: None,
            what,
            type_name: type_name.to_owned(),
        })
    }

    /// The value of `rref` is ready (or failed).
    pub(crate) fn set_value(&self, rref: RRefId, v: std::result::Result<Box<dyn Value>, String>) {
        let mut st = self.lock();
        let old = st.owners.get_mut(&rref).map(|e| {
            let new = match v {
                Ok(v) => OwnerState::Ready(Arc::new(Mutex::new(v))),
                Err(m) => OwnerState::Failed(m),
            };
            e.ready.notify_waiters();
            std::mem::replace(&mut e.state, new)
        });
        if let Some(OwnerState::Ready(v)) = old {
            st.dead.push(Box::new(v));
        }
    }

    /// A REMOTE_CALL arrived: record the creator's fork.
    pub(crate) fn remote_arrived(&self, rref: RRefId, fork: ForkId, from: u32, what: &str) {
        let mut st = self.lock();
        let e = Self::entry(&mut st, rref, what);
        if !e.deleted.contains_key(&fork) {
            e.forks.insert(fork, from);
        }
    }

    /// The value of `rref` once ready.
    pub(crate) async fn owner_value(&self, rref: RRefId) -> Result<Arc<Mutex<Box<dyn Value>>>> {
        loop {
            let ready = {
                let mut st = self.lock();
                let e = Self::entry(&mut st, rref, "unknown");
                match &e.state {
                    OwnerState::Ready(v) => return Ok(v.clone()),
                    OwnerState::Failed(m) => {
                        return Err(Error::Invalid(format!(
                            "the value of RRef {rref} failed to be created: {m}"
                        )))
                    }
                    OwnerState::Pending => e.ready.clone(),
                }
            };
            let n = ready.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if !matches!(
                self.lock().owners.get(&rref).map(|e| &e.state),
                Some(OwnerState::Pending)
            ) {
                continue;
            }
            n.await;
        }
    }

    /// A user made by `remote()`: unconfirmed until the owner answers.
    pub(crate) fn new_user(
        &self,
        a: &Arc<AgentInner>,
        owner: u32,
        what: String,
        type_name: &'static str,
    ) -> Arc<Handle> {
        let (id, fork) = (a.gid(), a.gid());
        self.lock().users.insert(
            fork,
            UserEntry {
                rref: id,
                owner,
                confirmed: false,
                dropped: false,
                released: false,
                error: None,
                what: what.clone(),
                notify: Arc::new(Notify::new()),
            },
        );
        Arc::new(Handle {
            agent: Arc::downgrade(a),
            id,
            owner,
            fork: Some(fork),
            what,
            type_name: type_name.to_owned(),
        })
    }

    /// The owner has recorded user `fork` (or `error`: it never will).
    pub(crate) fn confirm(&self, a: &Arc<AgentInner>, fork: ForkId, error: Option<Error>) {
        let delete = {
            let mut st = self.lock();
            let Some(u) = st.users.get_mut(&fork) else {
                return;
            };
            u.confirmed = true;
            u.error = error;
            u.notify.notify_waiters();
            u.dropped.then_some((u.owner, u.rref))
        };
        if let Some((owner, rref)) = delete {
            self.lock().users.remove(&fork);
            a.send_control(owner, crate::wire::Request::UserDelete { rref, fork });
        }
    }

    pub(crate) fn is_confirmed(&self, fork: ForkId) -> bool {
        self.lock().users.get(&fork).is_some_and(|u| u.confirmed)
    }

    /// Waits until user `fork` is confirmed; errors if it failed or was released.
    pub(crate) async fn user_usable(&self, a: &Arc<AgentInner>, fork: ForkId) -> Result<()> {
        loop {
            let notify = {
                let st = self.lock();
                let Some(u) = st.users.get(&fork) else {
                    return Err(Error::Invalid(format!(
                        "fork {fork} is not a live user on worker {}",
                        a.me.name
                    )));
                };
                if u.released {
                    return Err(Error::Shutdown(format!(
                        "{} (RRef {} was released at shutdown)",
                        a.me.name, u.rref
                    )));
                }
                if let Some(e) = &u.error {
                    return Err(e.clone());
                }
                if u.confirmed {
                    return Ok(());
                }
                u.notify.clone()
            };
            let n = notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self
                .lock()
                .users
                .get(&fork)
                .is_none_or(|u| u.confirmed || u.released)
            {
                continue;
            }
            n.await;
        }
    }

    /// The last handle of user `fork` is gone.
    pub(crate) fn user_dropped(&self, a: &Arc<AgentInner>, fork: ForkId) {
        let send = {
            let mut st = self.lock();
            let Some(u) = st.users.get_mut(&fork) else {
                return;
            };
            if u.released {
                st.users.remove(&fork);
                return;
            }
            if !u.confirmed {
                u.dropped = true;
                return;
            }
            let u = st.users.remove(&fork).expect("present");
            (u.owner, u.rref)
        };
        a.send_control(
            send.0,
            crate::wire::Request::UserDelete { rref: send.1, fork },
        );
    }

    pub(crate) fn owner_handle_dropped(&self, _a: &Arc<AgentInner>, rref: RRefId) {
        let mut st = self.lock();
        if let Some(e) = st.owners.get_mut(&rref) {
            e.local = e.local.saturating_sub(1);
        }
        self.maybe_delete(&mut st, rref);
    }

    fn maybe_delete(&self, st: &mut State, rref: RRefId) {
        if st.owners.get(&rref).is_some_and(|e| {
            e.forks.is_empty() && e.local == 0 && !matches!(e.state, OwnerState::Pending)
        }) {
            let e = st.owners.remove(&rref).expect("present");
            st.dead.push(Box::new(e));
            self.changed.notify_waiters();
        }
    }

    /// USER_DELETE at the owner. Idempotent.
    pub(crate) fn user_delete(&self, rref: RRefId, fork: ForkId) {
        let mut st = self.lock();
        // Requests run as tasks, so a deletion may be handled before the
        // REMOTE_CALL that creates the value: remember it either way.
        let e = Self::entry(&mut st, rref, "deleted before its creation arrived");
        let known = e.forks.remove(&fork).is_some();
        let repeatable = e.requested.remove(&fork);
        if !known || repeatable {
            // A message registering this fork may still come.
            e.deleted.retain(|_, at| at.elapsed() < TOMBSTONE_TTL);
            e.deleted.insert(fork, Instant::now());
        }
        self.maybe_delete(&mut st, rref);
    }

    /// FORK_REQUEST at the owner. Idempotent, and a deleted fork stays deleted.
    pub(crate) fn fork_request(&self, rref: RRefId, fork: ForkId, from: u32) {
        let mut st = self.lock();
        let e = Self::entry(&mut st, rref, "forked before its creation arrived");
        if !e.deleted.contains_key(&fork) {
            e.forks.insert(fork, from);
            e.requested.insert(fork);
        }
    }

    /// CHILD_ACCEPT at the parent: let the parent's handle go. Idempotent.
    pub(crate) fn child_accept(&self, fork: ForkId) {
        let child = self.lock().children.remove(&fork);
        drop(child); // outside the lock: this may drop the parent's last handle
        self.changed.notify_waiters();
    }

    /// The remote value was deleted (or the call failed) since a creation
    /// finished: make the owner's pending entry deletable.
    pub(crate) fn settle(&self, rref: RRefId) {
        let mut st = self.lock();
        self.maybe_delete(&mut st, rref);
    }

    /// Forks `h` for a message to worker `dest`.
    pub(crate) fn fork(
        &self,
        a: &Arc<AgentInner>,
        h: &Arc<Handle>,
        dest: u32,
    ) -> std::result::Result<ForkData, String> {
        let fork = a.gid();
        let mut st = self.lock();
        if let Some(f) = h.fork {
            match st.users.get(&f) {
                Some(u) if u.released => {
                    return Err(format!("RRef {} was released at shutdown", h.id))
                }
                Some(u) if u.error.is_some() => {
                    return Err(format!(
                        "RRef {} failed: {}",
                        h.id,
                        u.error.as_ref().unwrap()
                    ))
                }
                _ => {}
            }
        } else {
            // The owner records its own forks at once.
            Self::entry(&mut st, h.id, &h.what).forks.insert(fork, dest);
        }
        st.children.insert(
            fork,
            Child {
                _parent: h.clone(),
                on: dest,
            },
        );
        Ok(ForkData {
            owner: h.owner,
            rref: h.id,
            fork,
            parent: a.me.id,
            type_name: h.type_name.to_owned(),
            what: h.what.clone(),
        })
    }

    /// Forks made for a message that was never delivered: let their parents go.
    pub(crate) fn cancel_children(&self, forks: &[(ForkId, RRefId, bool)]) {
        let mut dropped = Vec::new();
        {
            let mut st = self.lock();
            for (f, rref, owner_made) in forks {
                dropped.push(st.children.remove(f));
                if *owner_made {
                    if let Some(e) = st.owners.get_mut(rref) {
                        e.forks.remove(f);
                    }
                    self.maybe_delete(&mut st, *rref);
                }
            }
        }
        drop(dropped);
    }

    /// Worker `peer` is gone: children there will never accept, and its users
    /// of values owned here will never delete.
    pub(crate) fn peer_gone(&self, peer: u32, name: &str) -> Vec<Leak> {
        let mut dropped = Vec::new();
        let mut leaks = Vec::new();
        {
            let mut st = self.lock();
            let gone: Vec<ForkId> = st
                .children
                .iter()
                .filter(|(_, c)| c.on == peer)
                .map(|(f, _)| *f)
                .collect();
            for f in gone {
                dropped.push(st.children.remove(&f));
            }
            for (id, e) in st.owners.iter_mut() {
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
                }
            }
            let ids: Vec<RRefId> = st.owners.keys().copied().collect();
            for id in ids {
                self.maybe_delete(&mut st, id);
            }
        }
        drop(dropped);
        self.changed.notify_waiters();
        leaks
    }

    /// Shutdown, step 1: release every user held here (deleting it at its
    /// owner), so handles the program still holds become unusable. Returns
    /// the deletions to send and the users still unconfirmed.
    pub(crate) fn release_users(&self) -> (Vec<(u32, RRefId, ForkId)>, usize) {
        let mut st = self.lock();
        let mut out = Vec::new();
        let mut unconfirmed = 0;
        // G2: a parent is released only once its children are accepted.
        let parents: HashSet<ForkId> = st
            .children
            .values()
            .filter_map(|c| c._parent.fork)
            .collect();
        for (f, u) in st.users.iter_mut() {
            if u.released || parents.contains(f) {
                continue;
            }
            if !u.confirmed {
                unconfirmed += 1;
                continue;
            }
            u.released = true;
            u.notify.notify_waiters();
            out.push((u.owner, u.rref, *f));
        }
        (out, unconfirmed)
    }

    /// Shutdown: is anything still waiting on others (children unaccepted,
    /// users unconfirmed, owned values with remote users)?
    pub(crate) fn settled(&self, owners: bool) -> bool {
        let st = self.lock();
        st.children.is_empty()
            && st.users.values().all(|u| u.confirmed)
            && (!owners || st.owners.values().all(|e| e.forks.is_empty()))
    }

    /// What is still referenced, by name.
    pub(crate) fn leaks(&self, name_of: &dyn Fn(u32) -> String) -> Vec<Leak> {
        let st = self.lock();
        let mut out: Vec<Leak> = st
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
        out.extend(
            st.users
                .iter()
                .filter(|(_, u)| !u.confirmed)
                .map(|(_, u)| Leak {
                    rref: u.rref,
                    what: u.what.clone(),
                    held_by: vec![format!(
                        "a user here the owner {} never confirmed",
                        name_of(u.owner)
                    )],
                }),
        );
        out.sort_by_key(|l| l.rref);
        out
    }

    /// Counts for tests and reports: (owned values, users, children).
    pub(crate) fn counts(&self) -> (usize, usize, usize) {
        let st = self.lock();
        (st.owners.len(), st.users.len(), st.children.len())
    }

    /// Tombstones of deleted forks kept, over every owned value.
    pub(crate) fn tombstones(&self) -> usize {
        self.lock().owners.values().map(|e| e.deleted.len()).sum()
    }
}

/// The handles adopted from one message, by fork id, and the users among them
/// still to be confirmed by their owner.
#[derive(Default)]
pub(crate) struct Adopted {
    pub(crate) handles: HashMap<ForkId, Arc<Handle>>,
    pub(crate) new_users: Vec<ForkId>,
}

/// The receiving side of every fork a message carries, done on arrival:
/// whatever the message's fate (decoded or not, answered or not), each fork
/// becomes a handle here, and dropping an unused one releases it properly.
pub(crate) fn adopt_all(a: &Arc<AgentInner>, forks: Vec<ForkData>) -> Adopted {
    let mut out = Adopted::default();
    for d in forks {
        let f = d.fork;
        let h = adopt(a, d, &mut out.new_users);
        out.handles.insert(f, h);
    }
    out
}

fn adopt(a: &Arc<AgentInner>, data: ForkData, new_users: &mut Vec<ForkId>) -> Arc<Handle> {
    let ctx = &a.rrefs;
    if data.owner == a.me.id {
        // Sent to its owner: a local handle. A fork the owner itself made is
        // not a user after all.
        {
            let mut st = ctx.lock();
            let e = RRefContext::entry(&mut st, data.rref, &data.what);
            e.local += 1;
            e.forks.remove(&data.fork);
        }
        if data.parent == a.me.id {
            ctx.child_accept(data.fork);
        } else {
            a.send_control(
                data.parent,
                crate::wire::Request::ChildAccept { fork: data.fork },
            );
        }
        return Arc::new(Handle {
            agent: Arc::downgrade(a),
            id: data.rref,
            owner: data.owner,
            fork: None,
            what: data.what,
            type_name: data.type_name,
        });
    }
    let parent_is_owner = data.parent == data.owner;
    ctx.lock().users.insert(
        data.fork,
        UserEntry {
            rref: data.rref,
            owner: data.owner,
            confirmed: parent_is_owner,
            dropped: false,
            released: false,
            error: None,
            what: data.what.clone(),
            notify: Arc::new(Notify::new()),
        },
    );
    if parent_is_owner {
        a.send_control(
            data.parent,
            crate::wire::Request::ChildAccept { fork: data.fork },
        );
    } else {
        new_users.push(data.fork);
        a.fork_to_owner(data.owner, data.rref, data.fork, data.parent);
    }
    Arc::new(Handle {
        agent: Arc::downgrade(a),
        id: data.rref,
        owner: data.owner,
        fork: Some(data.fork),
        what: data.what,
        type_name: data.type_name,
    })
}
