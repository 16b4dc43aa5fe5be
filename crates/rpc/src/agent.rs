//! The agent: calls, their answers, remote references and shutdown, over any
//! [`Transport`].
//!
//! A call gets a worker-local id and an entry in the pending table (the callee,
//! what was asked, where to put the answer); the transport's reader hands the
//! response straight to the waiting caller (`calls.rs`, `serve.rs`). A timeout
//! is the caller's own `tokio::time::timeout` around that wait, so an expired
//! call leaves nothing behind (PyTorch keeps a timeout map that leaked,
//! #50522). When a transport, the process group or the heartbeat
//! (`heartbeat.rs`) finds a worker gone, every call waiting on it fails at
//! once, naming it.
//!
//! Requests run as tasks on the callee, at most `max_requests` at once.
//! Arguments and results are postcard, encoded and decoded inside a
//! thread-local context that knows the peer (`codec.rs`): an
//! [`RRef`](crate::RRef) inside is forked for it, a
//! [`Payload`](crate::Payload) inside is mapped through the device maps and
//! sent out of band.
//!
//! Every call in flight (outgoing or being served) and every control message
//! counts as *active* (`gate.rs`); graceful shutdown repeats "wait until
//! idle, sum the active counts over the group" until the sum is zero, as
//! PyTorch's `join` does, but with one all-reduce instead of store barriers,
//! and with new outgoing work held at a gate from the moment a round's count
//! is read, so that nothing starts between the read and the verdict. How the
//! group is held together (a process group, or dynamic membership) is the
//! lifecycle layer's, behind [`Group`].

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use bytes::Bytes;
use rallypoint_sync::{MutexExt, RwLockExt};
use serde::Serialize;
use tokio::sync::oneshot;
use tokio::time::Instant;

mod api;
mod calls;
mod codec;
mod functions;
pub(crate) mod gate;
mod heartbeat;
pub(crate) mod rrefs;
mod serve;

use crate::device::{Device, DeviceInfo, DeviceMap};
use crate::error::{Error, Result};
use crate::rref::Leak;
use crate::transport::{BoxFuture, Event, Outgoing, Transport};
use crate::wire::{self, Request};
use crate::worker_info::WorkerInfo;
pub use api::{RpcFuture, ToWorker};
pub(crate) use codec::{with_de, with_ser, Encoded};
pub use functions::{Args, Functions};
use gate::{Active, Gate, Work};
use rrefs::{Adopted, RRefContext};

/// A value an owner keeps for an RRef, or a function's result.
pub trait Value: Any + Send {
    fn encode(&self) -> std::result::Result<Vec<u8>, String>;
    fn as_any(&mut self) -> &mut dyn Any;
    fn type_name(&self) -> &'static str;
}

impl<T: Serialize + Send + 'static> Value for T {
    fn encode(&self) -> std::result::Result<Vec<u8>, String> {
        wire::encode(self)
    }
    fn as_any(&mut self) -> &mut dyn Any {
        self
    }
    fn type_name(&self) -> &'static str {
        std::any::type_name::<T>()
    }
}

// ---- the agent --------------------------------------------------------------

struct Pending {
    to: u32,
    /// When the call started (the heartbeat counts silence from then).
    since: Instant,
    what: String,
    tx: oneshot::Sender<Result<(Vec<u8>, Bytes, Adopted)>>,
}

#[derive(Default)]
pub(crate) struct Workers {
    pub by_id: BTreeMap<u32, WorkerInfo>,
    pub by_name: HashMap<String, u32>,
}

/// How the group is held together: the lifecycle layer's (`shutdown.rs`
/// for static groups, `membership.rs` for dynamic ones), which the agent
/// calls at shutdown without knowing what it is.
pub(crate) trait Group: Send + Sync {
    /// The graceful part of shutdown, within `deadline`.
    fn graceful<'a>(
        &'a self,
        agent: &'a Arc<AgentInner>,
        deadline: Option<Instant>,
    ) -> BoxFuture<'a, Result<()>>;
    /// Shutdown without waiting: let the others know.
    fn abandon(&self) {}
}

pub struct AgentInner {
    pub(crate) me: WorkerInfo,
    pub(crate) workers: RwLock<Workers>,
    pub(crate) transport: OnceLock<Arc<dyn Transport>>,
    pub(crate) membership: OnceLock<Box<dyn Group>>,
    functions: Functions,
    pending: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    next_gid: AtomicU64,
    pub(crate) rrefs: RRefContext,
    pub(crate) default_timeout: Duration,
    /// Work in flight, and shutdown's gate on new work.
    pub(crate) gate: Arc<Gate>,
    closed: AtomicBool,
    shut: tokio::sync::Mutex<bool>,
    /// My device maps, the inverse of peers' maps towards me, my devices.
    pub(crate) maps: BTreeMap<String, DeviceMap>,
    pub(crate) reverse: RwLock<BTreeMap<String, DeviceMap>>,
    pub(crate) devices: RwLock<Vec<Device>>,
    pub(crate) device_info: DeviceInfo,
    leaks: Mutex<Vec<Leak>>,
    /// Workers found gone (their transport or their process group said so,
    /// not the heartbeat alone), and why: control messages to them are not
    /// retried.
    gone: Mutex<HashMap<u32, String>>,
    /// Functions registered with [`Functions::register_blocking`] running at
    /// once, at most `num_worker_threads`.
    pub(crate) blocking: Arc<tokio::sync::Semaphore>,
    /// Requests served at once, at most `max_requests`.
    requests: Arc<tokio::sync::Semaphore>,
    /// Requests in flight to each worker, at most `max_requests` each.
    outstanding: Mutex<HashMap<u32, Arc<tokio::sync::Semaphore>>>,
    max_requests: usize,
    /// The heartbeat deadline (zero: none), and when each peer was last
    /// heard from (any message).
    heartbeat: Duration,
    heard: Mutex<HashMap<u32, Instant>>,
    /// When each peer was last probed.
    probed: Mutex<HashMap<u32, Instant>>,
    /// The runtime the agent was started on: every task it starts goes there,
    /// so dropping an RRef off the runtime cannot panic.
    rt: tokio::runtime::Handle,
}

/// A worker's handle on its RPC agent (cheap to clone).
#[derive(Clone)]
pub struct Rpc(pub(crate) Arc<AgentInner>);

/// What graceful shutdown found.
#[derive(Debug, Clone, Default)]
pub struct ShutdownReport {
    /// References still held elsewhere when shutdown stopped waiting, or lost
    /// with a worker that died.
    pub leaked: Vec<Leak>,
}

impl AgentInner {
    pub(crate) fn new(
        me: WorkerInfo,
        functions: Functions,
        default_timeout: Duration,
        device_info: DeviceInfo,
        num_worker_threads: usize,
        heartbeat: Duration,
        max_requests: usize,
    ) -> Arc<AgentInner> {
        let id = me.id;
        Arc::new(AgentInner {
            me,
            workers: RwLock::default(),
            transport: OnceLock::new(),
            membership: OnceLock::new(),
            functions,
            pending: Mutex::default(),
            next_id: AtomicU64::new(1),
            next_gid: AtomicU64::new(1),
            rrefs: RRefContext::new(id),
            default_timeout,
            gate: Arc::default(),
            closed: AtomicBool::new(false),
            shut: tokio::sync::Mutex::new(false),
            maps: device_info.maps.clone(),
            reverse: RwLock::default(),
            devices: RwLock::default(),
            device_info,
            leaks: Mutex::default(),
            gone: Mutex::default(),
            blocking: Arc::new(tokio::sync::Semaphore::new(num_worker_threads.max(1))),
            requests: Arc::new(tokio::sync::Semaphore::new(max_requests.max(1))),
            outstanding: Mutex::default(),
            max_requests: max_requests.max(1),
            heartbeat,
            heard: Mutex::default(),
            probed: Mutex::default(),
            rt: tokio::runtime::Handle::current(),
        })
    }

    pub(crate) fn gid(&self) -> crate::wire::Gid {
        crate::wire::Gid {
            created_on: self.me.id,
            local: self.next_gid.fetch_add(1, Ordering::Relaxed),
        }
    }

    fn transport(&self) -> Result<&Arc<dyn Transport>> {
        self.transport
            .get()
            .ok_or_else(|| Error::Shutdown(self.me.name.clone()))
    }

    /// The inverse of the others' maps towards this worker, and the devices
    /// it uses, from every member's device information.
    pub(crate) fn set_devices(&self, all: &[(String, DeviceInfo)]) {
        let reverse = crate::device::reverse_maps(&self.me.name, all);
        let devices = crate::device::device_list(&self.device_info.devices, &self.maps, &reverse);
        *self.reverse.write_locked() = reverse;
        *self.devices.write_locked() = devices;
    }

    pub(crate) fn add_worker(&self, w: WorkerInfo) {
        let mut ws = self.workers.write_locked();
        ws.by_name.insert(w.name.clone(), w.id);
        ws.by_id.insert(w.id, w);
    }

    pub(crate) fn remove_worker(&self, id: u32) {
        let mut ws = self.workers.write_locked();
        if let Some(w) = ws.by_id.remove(&id) {
            ws.by_name.remove(&w.name);
        }
    }

    fn id_of(&self, name: &str) -> Result<u32> {
        let ws = self.workers.read_locked();
        ws.by_name.get(name).copied().ok_or_else(|| {
            Error::Invalid(format!(
                "no worker named {name:?} (workers: {})",
                ws.by_id
                    .values()
                    .map(|w| w.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
    }

    pub(crate) fn worker_by_id(&self, id: u32) -> Result<WorkerInfo> {
        self.workers
            .read_locked()
            .by_id
            .get(&id)
            .cloned()
            .ok_or_else(|| Error::Invalid(format!("no worker with id {id}")))
    }

    fn name_of(&self, id: u32) -> String {
        self.worker_by_id(id)
            .map(|w| w.name)
            .unwrap_or_else(|_| format!("#{id}"))
    }

    /// Sends a message; to this worker itself without the transport.
    async fn send_to(self: &Arc<Self>, to: u32, msg: Outgoing) -> std::result::Result<(), String> {
        if to == self.me.id {
            self.deliver(Event::Message {
                from: to,
                env: msg.env,
                bulk: concat(msg.bulk),
            });
            return Ok(());
        }
        match self.transport() {
            Ok(t) => t.send(to, msg).await,
            Err(e) => Err(e.to_string()),
        }
    }

    // ---- shutdown ----

    pub(crate) async fn wait_idle(&self, deadline: Option<Instant>) -> bool {
        match deadline {
            Some(d) => tokio::time::timeout_at(d, self.gate.idle()).await.is_ok(),
            None => {
                self.gate.idle().await;
                true
            }
        }
    }

    /// Outgoing work counted at once (`early`), or admitted by shutdown's
    /// gate once it opens; `None`: refused, shutdown ended.
    async fn admit(&self, early: Option<Active>) -> Option<Active> {
        match early {
            Some(a) => Some(a),
            None => self.gate.enter(Work::Outgoing).await,
        }
    }

    /// Releases this worker's users and waits (bounded) until its children
    /// are accepted and the users of what it owns are deleted.
    pub(crate) async fn release_and_drain(
        self: &Arc<Self>,
        deadline: Option<Instant>,
        owners: bool,
    ) -> bool {
        loop {
            self.rrefs.release_users(self);
            let n = self.rrefs.changed.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.rrefs.settled(owners) {
                return true;
            }
            // Confirmations and deletions arrive as messages; re-check on each
            // change, and at least every 20 ms for confirmations.
            let step = Instant::now() + Duration::from_millis(20);
            let until = deadline.map_or(step, |d| d.min(step));
            let _ = tokio::time::timeout_at(until, n).await;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return self.rrefs.settled(owners);
            }
        }
    }

    pub(crate) async fn shutdown(
        self: &Arc<Self>,
        graceful: bool,
        timeout: Option<Duration>,
    ) -> Result<ShutdownReport> {
        let mut done = self.shut.lock().await;
        if *done {
            return Ok(ShutdownReport::default());
        }
        let deadline = timeout.filter(|t| !t.is_zero()).map(|t| Instant::now() + t);
        let r = if graceful {
            self.graceful(deadline).await
        } else {
            Ok(())
        };
        // Teardown runs whatever happened above.
        self.closed.store(true, Ordering::SeqCst);
        let left: Vec<Pending> = self.pending.locked().drain().map(|(_, p)| p).collect();
        for p in left {
            let _ = p.tx.send(Err(Error::Shutdown(self.me.name.clone())));
        }
        if let Ok(t) = self.transport() {
            t.shutdown(graceful).await;
        }
        if let Some(g) = self.membership.get() {
            if !graceful {
                g.abandon();
            }
        }
        *done = true;
        let mut leaked = std::mem::take(&mut *self.leaks.locked());
        if graceful {
            leaked.extend(self.rrefs.leaks(&|id| self.name_of(id)));
        }
        for l in &leaked {
            tracing::warn!(worker = %self.me.name, "leaked at shutdown: {l}");
        }
        match r {
            Ok(()) => Ok(ShutdownReport { leaked }),
            Err(Error::ShutdownIncomplete {
                worker,
                mut message,
            }) if !leaked.is_empty() => {
                let l: Vec<String> = leaked.iter().map(|l| l.to_string()).collect();
                message.push_str(&format!("; leaked: {}", l.join("; ")));
                Err(Error::ShutdownIncomplete { worker, message })
            }
            Err(e) => Err(e),
        }
    }

    /// The process group reports that a member gave it up (its agent shut
    /// down without waiting for the others): membership says that worker is
    /// gone, whatever its connections still say.
    pub(crate) fn group_left(self: &Arc<Self>, e: &rallypoint_collectives::Error) {
        if let rallypoint_collectives::Error::Aborted { by: Some(r), .. } = e {
            if *r as u32 != self.me.id {
                self.peer_gone(
                    *r as u32,
                    "it shut down without waiting for the others (it gave up the group)",
                    true,
                );
            }
        }
    }

    async fn graceful(self: &Arc<Self>, deadline: Option<Instant>) -> Result<()> {
        match self.membership.get() {
            Some(g) => g.graceful(self, deadline).await,
            None => Ok(()),
        }
    }

    pub(crate) async fn request_raw(
        self: &Arc<Self>,
        to: u32,
        req: Request,
        timeout: Option<Duration>,
    ) -> Result<()> {
        self.call_raw(to, req, Self::empty(), timeout)
            .await
            .map(|_| ())
    }
}

fn concat(parts: Vec<Bytes>) -> Bytes {
    match parts.len() {
        0 => Bytes::new(),
        1 => parts.into_iter().next().expect("one"),
        _ => {
            let mut v = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
            for p in parts {
                v.extend_from_slice(&p);
            }
            v.into()
        }
    }
}
