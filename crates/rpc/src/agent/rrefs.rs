//! The RRef protocol inside the agent: the handles a program holds
//! ([`RRef`]), their (de)serialisation as forks, and [`RRefContext`], which
//! runs the protocol's pure table ([`crate::rref`]) under a lock and applies
//! its effects (control messages sent, waiters woken, values dropped).

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use rallypoint_sync::MutexExt;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tokio::sync::Notify;

use super::{with_de, with_ser, AgentInner, Value};
use crate::error::{Error, Result};
use crate::rref::table::{Adoption, Control, Effect, OwnerState, Parent, Table, UserStatus};
use crate::rref::Leak;
use crate::wire::{ForkData, ForkId, RRefId, Request};
use crate::Rpc;

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
        let v = a
            .rrefs
            .owner_value(&a, self.h.id, a.default_timeout)
            .await?;
        let mut g = v.lock().await;
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
                    sig: crate::types::Sig::of::<A, R>(),
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
        let want = crate::types::shape(std::any::type_name::<T>());
        if crate::types::shape(&data.type_name) != want {
            let m = format!(
                "RRef {} holds a {}, not a {want}",
                data.rref,
                crate::types::shape(&data.type_name)
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

/// An owned value, shared with the requests using it. Its lock is async: a
/// method waiting for the value holds no runtime thread.
pub(crate) type Held = Arc<tokio::sync::Mutex<Box<dyn Value>>>;

/// One worker's RRef bookkeeping: the protocol's [`Table`] under a lock, and
/// the effects of each event applied after unlocking (control messages sent,
/// waiters woken, deleted values dropped).
pub(crate) struct RRefContext {
    table: Mutex<Table<Held>>,
    /// Woken when a user is confirmed, failed or released.
    users_changed: Notify,
    /// Woken when an owned value is ready or failed.
    values_settled: Notify,
    /// Woken whenever something shutdown waits for goes away.
    pub(crate) changed: Notify,
}

impl RRefContext {
    pub(crate) fn new(me: u32) -> RRefContext {
        RRefContext {
            table: Mutex::new(Table::new(me, Instant::now())),
            users_changed: Notify::new(),
            values_settled: Notify::new(),
            changed: Notify::new(),
        }
    }

    /// Runs one event on the table, then applies its effects unlocked.
    fn with<R>(
        &self,
        a: &Arc<AgentInner>,
        f: impl FnOnce(&mut Table<Held>, &mut Vec<Effect<Held>>) -> R,
    ) -> R {
        let mut out = Vec::new();
        let r = {
            let mut t = self.lock();
            t.tick(Instant::now());
            f(&mut t, &mut out)
        };
        for e in out {
            match e {
                Effect::Send { to, msg } => match msg {
                    Control::UserDelete { rref, fork } => {
                        a.send_control(to, Request::UserDelete { rref, fork })
                    }
                    Control::ChildAccept { fork } => {
                        a.send_control(to, Request::ChildAccept { fork })
                    }
                    Control::ForkRequest { rref, fork } => a.fork_to_owner(to, rref, fork),
                },
                Effect::UserChanged => self.users_changed.notify_waiters(),
                Effect::ValueSettled => self.values_settled.notify_waiters(),
                Effect::Drained => self.changed.notify_waiters(),
                Effect::Deleted { rref, value } => {
                    tracing::trace!(worker = %a.me.name, %rref, "deleted");
                    drop(value)
                }
                Effect::Dispose(v) => drop(v),
            }
        }
        r
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table<Held>> {
        self.table.locked()
    }

    /// A new value owned here with one local handle (`Rpc::rref`, or a
    /// `remote()` to self).
    pub(crate) fn new_owned(
        &self,
        a: &Arc<AgentInner>,
        what: String,
        type_name: &'static str,
    ) -> Arc<Handle> {
        let id = a.gid();
        self.with(a, |t, _| t.new_owned(id, &what));
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
    pub(crate) fn set_value(
        &self,
        a: &Arc<AgentInner>,
        rref: RRefId,
        v: std::result::Result<Box<dyn Value>, String>,
    ) {
        let v = v.map(|v| Arc::new(tokio::sync::Mutex::new(v)));
        self.with(a, |t, out| t.set_value(rref, v, out));
    }

    /// A REMOTE_CALL arrived: record the creator's fork.
    pub(crate) fn remote_arrived(
        &self,
        a: &Arc<AgentInner>,
        rref: RRefId,
        fork: ForkId,
        from: u32,
        what: &str,
    ) {
        self.with(a, |t, _| t.remote_arrived(rref, fork, from, what));
    }

    /// The value of `rref` once ready, waiting at most `timeout` (zero: no
    /// bound) for a creation still running or not arrived.
    pub(crate) async fn owner_value(
        &self,
        a: &AgentInner,
        rref: RRefId,
        timeout: Duration,
    ) -> Result<Held> {
        let wait = async {
            loop {
                let n = self.values_settled.notified();
                tokio::pin!(n);
                n.as_mut().enable();
                match self.lock().value(rref) {
                    Some(OwnerState::Ready(v)) => return Ok(v.clone()),
                    Some(OwnerState::Failed(m)) => {
                        return Err(Error::Invalid(format!(
                            "the value of RRef {rref} failed to be created: {m}"
                        )))
                    }
                    Some(OwnerState::Pending) => {}
                    None => {
                        return Err(Error::Invalid(format!(
                        "RRef {rref} is not known on worker {} (deleted, or never created there)",
                        a.me.name
                    )))
                    }
                }
                n.await;
            }
        };
        if timeout.is_zero() {
            return wait.await;
        }
        tokio::time::timeout(timeout, wait).await.map_err(|_| {
            Error::Invalid(format!(
                "RRef {rref} is not ready on worker {} (waited {} ms for its creation)",
                a.me.name,
                timeout.as_millis()
            ))
        })?
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
        self.lock().new_user(id, fork, owner, &what);
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
        self.with(a, |t, out| t.confirm(fork, error, out));
    }

    /// The FORK_REQUEST of user `fork` ended.
    pub(crate) fn fork_registered(
        &self,
        a: &Arc<AgentInner>,
        fork: ForkId,
        result: std::result::Result<(), Error>,
    ) {
        self.with(a, |t, out| t.fork_registered(fork, result, out));
    }

    pub(crate) fn is_confirmed(&self, fork: ForkId) -> bool {
        self.lock().user(fork) == UserStatus::Confirmed
    }

    /// Waits until user `fork` is confirmed; errors if it failed or was released.
    pub(crate) async fn user_usable(&self, a: &Arc<AgentInner>, fork: ForkId) -> Result<()> {
        loop {
            let n = self.users_changed.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            match self.lock().user(fork) {
                UserStatus::Confirmed => return Ok(()),
                UserStatus::Failed(e) => return Err(e),
                UserStatus::Released { rref } => {
                    return Err(Error::Shutdown(format!(
                        "{} (RRef {rref} was released at shutdown)",
                        a.me.name
                    )))
                }
                UserStatus::Unknown => {
                    return Err(Error::Invalid(format!(
                        "fork {fork} is not a live user on worker {}",
                        a.me.name
                    )))
                }
                UserStatus::Unconfirmed => {}
            }
            n.await;
        }
    }

    /// The last handle of user `fork` is gone.
    pub(crate) fn user_dropped(&self, a: &Arc<AgentInner>, fork: ForkId) {
        self.with(a, |t, out| t.user_dropped(fork, out));
    }

    pub(crate) fn owner_handle_dropped(&self, a: &Arc<AgentInner>, rref: RRefId) {
        self.with(a, |t, out| t.owner_dropped(rref, out));
    }

    /// USER_DELETE at the owner. Idempotent.
    pub(crate) fn user_delete(&self, a: &Arc<AgentInner>, rref: RRefId, fork: ForkId) {
        self.with(a, |t, out| t.user_delete(rref, fork, out));
    }

    /// FORK_REQUEST at the owner. Idempotent, and a deleted fork stays
    /// deleted; refused for a value already deleted.
    pub(crate) fn fork_request(
        &self,
        a: &Arc<AgentInner>,
        rref: RRefId,
        fork: ForkId,
        from: u32,
    ) -> std::result::Result<(), String> {
        self.with(a, |t, out| t.fork_request(rref, fork, from, out))
    }

    /// CHILD_ACCEPT at the parent. Idempotent.
    pub(crate) fn child_accept(&self, a: &Arc<AgentInner>, fork: ForkId) {
        self.with(a, |t, out| t.child_accept(fork, out));
    }

    /// Forks `h` for a message to worker `dest`.
    pub(crate) fn fork(
        &self,
        a: &Arc<AgentInner>,
        h: &Arc<Handle>,
        dest: u32,
    ) -> std::result::Result<ForkData, String> {
        let fork = a.gid();
        let parent = match h.fork {
            Some(f) => Parent::User(f),
            None => Parent::Owner(h.id),
        };
        self.lock().fork(parent, fork, dest)?;
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
    pub(crate) fn cancel_children(&self, a: &Arc<AgentInner>, forks: &[ForkId]) {
        if !forks.is_empty() {
            self.with(a, |t, out| t.cancel_children(forks, out));
        }
    }

    /// Worker `peer` is gone: children there will never accept, and its users
    /// of values owned here will never delete.
    pub(crate) fn peer_gone(&self, a: &Arc<AgentInner>, peer: u32, name: &str) -> Vec<Leak> {
        self.with(a, |t, out| t.peer_gone(peer, name, out))
    }

    /// Shutdown, step 1: release every user held here (deleting it at its
    /// owner), so handles the program still holds become unusable.
    pub(crate) fn release_users(&self, a: &Arc<AgentInner>) {
        self.with(a, |t, out| t.release_users(out));
    }

    /// Shutdown: is anything still waiting on others?
    pub(crate) fn settled(&self, owners: bool) -> bool {
        self.lock().settled(owners)
    }

    /// What is still referenced, by name.
    pub(crate) fn leaks(&self, name_of: &dyn Fn(u32) -> String) -> Vec<Leak> {
        self.lock().leaks(name_of)
    }

    /// Counts for tests and reports: (owned values, users, children).
    pub(crate) fn counts(&self) -> (usize, usize, usize) {
        self.lock().counts()
    }

    /// Tombstones of deleted forks kept, over every owned value.
    pub(crate) fn tombstones(&self) -> usize {
        self.lock().tombstones()
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
    if forks.is_empty() {
        return out;
    }
    for d in forks {
        let kind = a.rrefs.with(a, |t, out| {
            t.adopt(d.owner, d.rref, d.fork, d.parent, &d.what, out)
        });
        if kind == (Adoption::User { unconfirmed: true }) {
            out.new_users.push(d.fork);
        }
        let h = Arc::new(Handle {
            agent: Arc::downgrade(a),
            id: d.rref,
            owner: d.owner,
            fork: (kind != Adoption::Owner).then_some(d.fork),
            what: d.what,
            type_name: d.type_name,
        });
        out.handles.insert(d.fork, h);
    }
    out
}
