//! The agent: calls, their answers, remote references and shutdown, over any
//! [`Transport`].
//!
//! A call gets a worker-local id and an entry in the pending table (the callee,
//! what was asked, where to put the answer); the transport's reader hands the
//! response straight to the waiting caller. A timeout is the caller's own
//! `tokio::time::timeout` around that wait, so an expired call leaves nothing
//! behind (PyTorch keeps a timeout map that leaked, #50522). When a transport
//! reports a worker gone, every call waiting on it fails at once, naming it.
//!
//! Requests run as tasks on the callee. Arguments and results are postcard,
//! encoded and decoded inside a thread-local context that knows the peer: an
//! [`RRef`](crate::RRef) inside is forked for it, a [`Payload`](crate::Payload)
//! inside is mapped through the device maps and sent out of band.
//!
//! Every call in flight (outgoing or being served) and every control message
//! counts as *active* (`gate.rs`); graceful shutdown repeats "wait until
//! idle, sum the active counts over the group" until the sum is zero, as
//! PyTorch's `join` does, but with one all-reduce instead of store barriers,
//! and with new outgoing work held at a gate from the moment a round's count
//! is read, so that nothing starts between the read and the verdict.

use std::any::Any;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::oneshot;
use tokio::time::Instant;

mod functions;
mod gate;
pub(crate) mod rrefs;

use crate::device::{Device, DeviceInfo, DeviceMap};
use crate::rref::Leak;
use crate::transport::{BoxFuture, Event, Outgoing, Transport, FOREVER};
use crate::types::{shape, Sig};
use crate::wire::{self, Envelope, Failure, Request};
use crate::wire::{ForkData, ForkId, RRefId};
use crate::{Error, Result, WorkerInfo};
pub use functions::{Args, Functions};
use gate::{Active, Gate, Work};
use rrefs::{Adopted, Handle, RRef, RRefContext};

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

// ---- encoding contexts ------------------------------------------------------

/// Set while encoding a message for worker `dest`.
pub(crate) struct SerCtx {
    agent: Arc<AgentInner>,
    dest: u32,
    dest_name: String,
    /// The device map that applies (towards `dest`, or its inverse for replies).
    map: Option<DeviceMap>,
    bulk: Vec<Bytes>,
    off: u64,
    forks: Vec<ForkId>,
    /// What the message carries of those forks (see [`ForkData`]).
    fork_data: Vec<ForkData>,
    /// The first error, kept here because postcard drops serde's messages.
    error: Option<String>,
}

impl SerCtx {
    fn fail<T>(&mut self, e: String) -> std::result::Result<T, String> {
        self.error.get_or_insert(e.clone());
        Err(e)
    }

    pub(crate) fn push_bulk(
        &mut self,
        device: Device,
        data: Bytes,
    ) -> std::result::Result<(Device, u64), String> {
        let mapped = match self.map.as_ref().and_then(|m| m.get(&device)) {
            Some(d) => *d,
            None if device == Device::Cpu => Device::Cpu,
            None => {
                let m = format!(
                    "a payload on {device} cannot be sent to worker {}: worker {} has no device map entry for {device} towards it (call set_device_map, or move the payload to cpu)",
                    self.dest_name, self.agent.me.name
                );
                return self.fail(m);
            }
        };
        let off = self.off;
        self.off += data.len() as u64;
        if !data.is_empty() {
            self.bulk.push(data);
        }
        Ok((mapped, off))
    }

    pub(crate) fn fork(&mut self, h: &Arc<Handle>) -> std::result::Result<ForkData, String> {
        let d = match self.agent.rrefs.fork(&self.agent, h, self.dest) {
            Ok(d) => d,
            Err(e) => return self.fail(e),
        };
        self.forks.push(d.fork);
        self.fork_data.push(d.clone());
        Ok(d)
    }
}

/// Set while decoding a message: the handles its forks became on arrival.
pub(crate) struct DeCtx {
    bulk: Bytes,
    adopted: HashMap<ForkId, Arc<Handle>>,
    error: Option<String>,
}

impl DeCtx {
    pub(crate) fn fail<T>(&mut self, e: String) -> std::result::Result<T, String> {
        self.error.get_or_insert(e.clone());
        Err(e)
    }

    pub(crate) fn bulk_slice(&mut self, off: u64, len: u64) -> std::result::Result<Bytes, String> {
        let n = self.bulk.len();
        match off.checked_add(len).filter(|e| *e <= n as u64) {
            Some(end) => Ok(self.bulk.slice(off as usize..end as usize)),
            None => self.fail(format!(
                "payload {off}+{len} lies outside the message's {n} bulk bytes"
            )),
        }
    }

    /// The handle fork `d` became when its message arrived.
    pub(crate) fn take(&mut self, d: &ForkData) -> std::result::Result<Arc<Handle>, String> {
        match self.adopted.remove(&d.fork) {
            Some(h) => Ok(h),
            None => self.fail(format!(
                "RRef {} (fork {}) is not among the forks its message declared",
                d.rref, d.fork
            )),
        }
    }
}

thread_local! {
    static SER: RefCell<Option<SerCtx>> = const { RefCell::new(None) };
    static DE: RefCell<Option<DeCtx>> = const { RefCell::new(None) };
}

pub(crate) fn with_ser<R>(f: impl FnOnce(&mut SerCtx) -> R) -> Option<R> {
    SER.with(|c| c.borrow_mut().as_mut().map(f))
}

pub(crate) fn with_de<R>(f: impl FnOnce(&mut DeCtx) -> R) -> Option<R> {
    DE.with(|c| c.borrow_mut().as_mut().map(f))
}

/// Bytes plus bulk plus the forks they made (and carry).
pub(crate) struct Encoded {
    pub bytes: Vec<u8>,
    pub bulk: Vec<Bytes>,
    pub forks: Vec<ForkId>,
    pub fork_data: Vec<ForkData>,
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

/// How the group is held together, for shutdown.
pub(crate) enum Membership {
    Static(rallypoint_collectives::ProcessGroup),
    Dynamic(crate::init::Dynamic),
}

pub struct AgentInner {
    pub(crate) me: WorkerInfo,
    pub(crate) workers: RwLock<Workers>,
    pub(crate) transport: OnceLock<Arc<dyn Transport>>,
    pub(crate) membership: OnceLock<Membership>,
    functions: Functions,
    pending: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    next_gid: AtomicU64,
    pub(crate) rrefs: RRefContext,
    pub(crate) default_timeout: Duration,
    /// Work in flight, and shutdown's gate on new work.
    gate: Arc<Gate>,
    closed: AtomicBool,
    shut: tokio::sync::Mutex<bool>,
    /// My device maps, the inverse of peers' maps towards me, my devices.
    pub(crate) maps: BTreeMap<String, DeviceMap>,
    pub(crate) reverse: RwLock<BTreeMap<String, DeviceMap>>,
    pub(crate) devices: RwLock<Vec<Device>>,
    pub(crate) device_info: DeviceInfo,
    leaks: Mutex<Vec<Leak>>,
    /// Workers found gone (their transport or their process group said so),
    /// and why: control messages to them are not retried.
    gone: Mutex<HashMap<u32, String>>,
    /// Functions registered with [`Functions::register_blocking`] running at
    /// once, at most `num_worker_threads`.
    pub(crate) blocking: Arc<tokio::sync::Semaphore>,
    /// Requests served at once, at most `max_requests`.
    requests: Arc<tokio::sync::Semaphore>,
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

/// Names a worker: its name, its id, or its [`WorkerInfo`].
pub trait ToWorker {
    fn worker_id(&self, a: &AgentInner) -> Result<u32>;
}

impl ToWorker for &str {
    fn worker_id(&self, a: &AgentInner) -> Result<u32> {
        a.id_of(self)
    }
}
impl ToWorker for String {
    fn worker_id(&self, a: &AgentInner) -> Result<u32> {
        a.id_of(self)
    }
}
impl ToWorker for &String {
    fn worker_id(&self, a: &AgentInner) -> Result<u32> {
        a.id_of(self)
    }
}
impl ToWorker for &WorkerInfo {
    fn worker_id(&self, a: &AgentInner) -> Result<u32> {
        a.worker_by_id(self.id).map(|w| w.id)
    }
}
impl ToWorker for u32 {
    fn worker_id(&self, a: &AgentInner) -> Result<u32> {
        a.worker_by_id(*self).map(|w| w.id)
    }
}

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

    pub(crate) fn add_worker(&self, w: WorkerInfo) {
        let mut ws = self.workers.write().unwrap_or_else(|e| e.into_inner());
        ws.by_name.insert(w.name.clone(), w.id);
        ws.by_id.insert(w.id, w);
    }

    pub(crate) fn remove_worker(&self, id: u32) {
        let mut ws = self.workers.write().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = ws.by_id.remove(&id) {
            ws.by_name.remove(&w.name);
        }
    }

    fn id_of(&self, name: &str) -> Result<u32> {
        let ws = self.workers.read().unwrap_or_else(|e| e.into_inner());
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
            .read()
            .unwrap_or_else(|e| e.into_inner())
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

    // ---- encoding ----

    fn encode_for(
        self: &Arc<Self>,
        dest: u32,
        reply: bool,
        f: impl FnOnce() -> std::result::Result<Vec<u8>, String>,
    ) -> std::result::Result<Encoded, String> {
        let dest_name = self.name_of(dest);
        let map = if reply {
            self.reverse
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .get(&dest_name)
                .cloned()
        } else {
            self.maps.get(&dest_name).cloned()
        };
        let cx = SerCtx {
            agent: self.clone(),
            dest,
            dest_name,
            map,
            bulk: Vec::new(),
            off: 0,
            forks: Vec::new(),
            fork_data: Vec::new(),
            error: None,
        };
        let prev = SER.with(|c| c.borrow_mut().replace(cx));
        let r = f();
        let cx = SER
            .with(|c| std::mem::replace(&mut *c.borrow_mut(), prev))
            .expect("context set");
        match r {
            Ok(bytes) => Ok(Encoded {
                bytes,
                bulk: cx.bulk,
                forks: cx.forks,
                fork_data: cx.fork_data,
            }),
            Err(e) => {
                self.rrefs.cancel_children(self, &cx.forks);
                Err(cx.error.unwrap_or(e))
            }
        }
    }

    /// Decodes `bytes` with the handles its message's forks became; the
    /// ones it does not use are dropped (released) with the map.
    fn decode_from<T: DeserializeOwned>(
        self: &Arc<Self>,
        bytes: &[u8],
        bulk: Bytes,
        adopted: HashMap<ForkId, Arc<Handle>>,
    ) -> std::result::Result<T, String> {
        let cx = DeCtx {
            bulk,
            adopted,
            error: None,
        };
        let prev = DE.with(|c| c.borrow_mut().replace(cx));
        let r = wire::decode::<T>(bytes);
        let cx = DE
            .with(|c| std::mem::replace(&mut *c.borrow_mut(), prev))
            .expect("context set");
        r.map_err(|e| cx.error.clone().unwrap_or(e))
    }

    /// Sends a message; to this worker itself without the transport.
    async fn send_to(self: &Arc<Self>, to: u32, msg: Outgoing) -> std::result::Result<(), String> {
        if to == self.me.id {
            let full = self.deliver(Event::Message {
                from: to,
                env: msg.env,
                bulk: concat(msg.bulk),
            });
            if let Some(full) = full {
                full.await;
            }
            return Ok(());
        }
        match self.transport() {
            Ok(t) => t.send(to, msg).await,
            Err(e) => Err(e.to_string()),
        }
    }

    // ---- calling ----

    /// Sends `req` with encoded `args` to `to` and waits for the answer.
    async fn call_raw(
        self: &Arc<Self>,
        to: u32,
        req: Request,
        args: Encoded,
        timeout: Option<Duration>,
    ) -> Result<(Vec<u8>, Bytes, Adopted)> {
        let what = req.describe();
        let worker = self.name_of(to);
        let active = self.gate.enter(Work::Outgoing).await;
        if active.is_none() || self.closed.load(Ordering::SeqCst) {
            self.rrefs.cancel_children(self, &args.forks);
            return Err(Error::Shutdown(self.me.name.clone()));
        }
        let timeout = timeout.unwrap_or(self.default_timeout);
        // The deadline covers the send too: a peer that stops reading must
        // not hold a call past its timeout.
        let deadline = (!timeout.is_zero()).then(|| Instant::now() + timeout);
        let expired = |worker: String, what: String| Error::Timeout {
            worker,
            what,
            ms: timeout.as_millis(),
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let forget = |a: &Self| {
            a.pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
        };
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                id,
                Pending {
                    to,
                    since: Instant::now(),
                    what: what.clone(),
                    tx,
                },
            );
        let env = wire::encode(&Envelope::Request {
            id,
            req,
            args: args.bytes,
            forks: args.fork_data,
        })
        .and_then(|env| {
            wire::check_envelope(env.len(), &format!("the arguments of {what}"))?;
            Ok(env)
        });
        let env = match env {
            Ok(env) => env,
            Err(e) => {
                forget(self);
                self.rrefs.cancel_children(self, &args.forks);
                return Err(Error::Invalid(format!("{e} (to worker {worker})")));
            }
        };
        let send = self.send_to(
            to,
            Outgoing {
                env,
                bulk: args.bulk,
            },
        );
        let sent = match deadline {
            Some(d) => match tokio::time::timeout_at(d, send).await {
                Ok(r) => r,
                Err(_) => {
                    forget(self);
                    return Err(expired(worker, what));
                }
            },
            None => send.await,
        };
        if let Err(reason) = sent {
            forget(self);
            self.rrefs.cancel_children(self, &args.forks);
            return Err(Error::WorkerGone {
                worker,
                what,
                reason,
            });
        }
        let got = match deadline {
            None => rx.await,
            Some(d) => match tokio::time::timeout_at(d, rx).await {
                Ok(r) => r,
                Err(_) => {
                    forget(self);
                    return Err(expired(worker, what));
                }
            },
        };
        got.unwrap_or_else(|_| Err(Error::Shutdown(self.me.name.clone())))
    }

    /// Sends an RRef control message in the background, retried on failure
    /// (its handler is idempotent).
    pub(crate) fn send_control(self: &Arc<Self>, to: u32, req: Request) {
        let a = self.clone();
        let early = self.gate.try_enter(Work::Outgoing);
        self.rt.spawn(async move {
            let Some(_active) = a.admit(early).await else {
                tracing::warn!(worker = %a.me.name, "{} not sent: shutdown ended", req.describe());
                return;
            };
            if let Err(e) = a.control(to, req.clone()).await {
                tracing::warn!(worker = %a.me.name, "could not deliver {}: {e}", req.describe());
            }
        });
    }

    /// A control message, retried like PyTorch's (5 tries, 1 s first delay,
    /// x1.5), handled here directly when it is for this worker.
    pub(crate) async fn control(self: &Arc<Self>, to: u32, req: Request) -> Result<()> {
        if to == self.me.id {
            return self.handle_control(to, &req).map_err(|m| Error::Remote {
                worker: self.me.name.clone(),
                what: req.describe(),
                message: m,
            });
        }
        let mut delay = Duration::from_secs(1);
        let mut last = None;
        for attempt in 0..5 {
            if attempt > 0 {
                // A worker found gone will not come back for a retry.
                if self
                    .gone
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .contains_key(&to)
                {
                    break;
                }
                tokio::time::sleep(delay).await;
                delay = delay.mul_f64(1.5);
            }
            let args = Encoded {
                bytes: Vec::new(),
                bulk: Vec::new(),
                forks: Vec::new(),
                fork_data: Vec::new(),
            };
            match self.call_raw(to, req.clone(), args, None).await {
                Ok(_) => return Ok(()),
                Err(e @ (Error::Remote { .. } | Error::Shutdown(_))) => return Err(e),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("an attempt failed"))
    }

    /// A child's side of a fork to a third worker: ask the owner to record it;
    /// the table then confirms the child and tells its parent (whether the
    /// owner recorded it or could not be reached: the parent holds its handle
    /// until then, and must let it go either way).
    pub(crate) fn fork_to_owner(self: &Arc<Self>, owner: u32, rref: RRefId, fork: ForkId) {
        let a = self.clone();
        let early = self.gate.try_enter(Work::Outgoing);
        self.rt.spawn(async move {
            let Some(_active) = a.admit(early).await else {
                return a
                    .rrefs
                    .fork_registered(&a, fork, Err(Error::Shutdown(a.me.name.clone())));
            };
            let r = a.control(owner, Request::ForkRequest { rref, fork }).await;
            a.rrefs.fork_registered(&a, fork, r);
        });
    }

    // ---- serving ----

    /// The transport's entry point.
    /// The transport's entry point; a future when this worker serves all the
    /// requests it may (see [`crate::transport::Deliver`]).
    pub(crate) fn deliver(self: &Arc<Self>, ev: Event) -> Option<BoxFuture<'static, ()>> {
        match ev {
            Event::Message { from, env, bulk } => self.message(from, env, bulk),
            Event::Gone { peer, reason } => {
                self.peer_gone(peer, &reason);
                None
            }
        }
    }

    fn message(
        self: &Arc<Self>,
        from: u32,
        env: Vec<u8>,
        bulk: Bytes,
    ) -> Option<BoxFuture<'static, ()>> {
        if !self.heartbeat.is_zero() {
            self.heard
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(from, Instant::now());
        }
        match wire::decode::<Envelope>(&env) {
            Ok(Envelope::Heartbeat { answer }) => {
                if answer {
                    self.beat(from, false);
                }
            }
            Ok(Envelope::Response { id, result, forks }) => {
                let adopted = rrefs::adopt_all(self, forks);
                let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
                // Only the worker asked may answer.
                let p = match pending.get(&id) {
                    Some(p) if p.to == from => pending.remove(&id),
                    _ => None,
                };
                drop(pending);
                if let Some(p) = p {
                    let r = result
                        .map(|v| (v, bulk, adopted))
                        .map_err(|f| match f.types {
                            Some((their_args, their_ret)) => {
                                Error::TypeMismatch(Box::new(crate::Mismatch {
                                    worker: self.name_of(p.to),
                                    what: p.what,
                                    their_args,
                                    their_ret,
                                    caller: String::new(),
                                    our_args: String::new(),
                                    our_ret: String::new(),
                                }))
                            }
                            None => Error::Remote {
                                worker: self.name_of(p.to),
                                what: p.what,
                                message: f.message,
                            },
                        });
                    let _ = p.tx.send(r);
                }
            }
            Ok(Envelope::Request {
                id,
                req,
                args,
                forks,
            }) => {
                let adopted = rrefs::adopt_all(self, forks);
                let a = self.clone();
                let active = self.gate.try_enter(Work::Incoming);
                // Requests that run user code take a turn; control messages
                // (quick, and what frees references) never wait.
                let counted = matches!(
                    req,
                    Request::Call { .. }
                        | Request::Remote { .. }
                        | Request::Method { .. }
                        | Request::Fetch { .. }
                );
                let turn = counted.then(|| self.requests.clone().try_acquire_owned());
                let full = matches!(turn, Some(Err(_)));
                let sem = self.requests.clone();
                self.rt.spawn(async move {
                    let _active = active;
                    let _turn = match turn {
                        Some(Err(_)) => sem.acquire_owned().await.ok(),
                        Some(Ok(t)) => Some(t),
                        None => None,
                    };
                    a.serve(from, id, req, args, bulk, adopted).await
                });
                if full {
                    let sem = self.requests.clone();
                    return Some(Box::pin(async move {
                        let _ = sem.acquire().await;
                    }));
                }
            }
            Err(e) => {
                tracing::warn!(worker = %self.me.name, from, "dropped an undecodable message: {e}")
            }
        }
        None
    }

    /// Sends a heartbeat to `to` (a probe when `answer`), in the background,
    /// bounded by the heartbeat deadline.
    fn beat(self: &Arc<Self>, to: u32, answer: bool) {
        let Ok(env) = wire::encode(&Envelope::Heartbeat { answer }) else {
            return;
        };
        let Ok(t) = self.transport().cloned() else {
            return;
        };
        let bound = self.heartbeat.max(Duration::from_millis(100));
        self.rt.spawn(async move {
            let msg = Outgoing {
                env,
                bulk: Vec::new(),
            };
            let _ = tokio::time::timeout(bound, t.send(to, msg)).await;
        });
    }

    /// Starts the heartbeat: each worker that calls are waiting on and that
    /// was not heard from for a quarter of the deadline is probed (at most
    /// once per quarter), and one silent for the whole deadline (counted
    /// from the later of the last thing heard and the oldest call waiting
    /// on it) is gone. Checked every eighth of the deadline, at least every
    /// 250 ms, so a death is named at most that late.
    pub(crate) fn start_heartbeat(self: &Arc<Self>) {
        if self.heartbeat.is_zero() {
            return;
        }
        let weak = Arc::downgrade(self);
        let tick = (self.heartbeat / 8).clamp(Duration::from_millis(5), Duration::from_millis(250));
        let probe_every = self.heartbeat / 4;
        self.rt.spawn(async move {
            let mut every = tokio::time::interval(tick);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(a) = weak.upgrade() else {
                    return;
                };
                if a.closed.load(Ordering::SeqCst) {
                    return;
                }
                a.check_heartbeats(probe_every);
            }
        });
    }

    fn check_heartbeats(self: &Arc<Self>, probe_after: Duration) {
        let mut waited: HashMap<u32, Instant> = HashMap::new();
        for p in self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            let e = waited.entry(p.to).or_insert(p.since);
            *e = (*e).min(p.since);
        }
        waited.remove(&self.me.id);
        if waited.is_empty() {
            return;
        }
        let now = Instant::now();
        let below = self.transport().ok().cloned();
        for (peer, since) in waited {
            let mut last = since;
            if let Some(h) = self
                .heard
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&peer)
            {
                last = last.max(*h);
            }
            if let Some(h) = below.as_ref().and_then(|t| t.heard_from(peer)) {
                last = last.max(Instant::from_std(h));
            }
            let silent = now.saturating_duration_since(last);
            if silent >= self.heartbeat {
                let reason = format!(
                    "nothing was heard from it for {:.1} s while calls waited on it (heartbeat deadline {} s): it is stopped, cut off or its host is down",
                    silent.as_secs_f64(),
                    self.heartbeat.as_secs_f64()
                );
                tracing::warn!(worker = %self.me.name, peer = %self.name_of(peer), "{reason}");
                self.peer_gone(peer, &reason);
            } else if silent >= probe_after {
                let mut probed = self.probed.lock().unwrap_or_else(|e| e.into_inner());
                let due = probed
                    .get(&peer)
                    .is_none_or(|t| now.saturating_duration_since(*t) >= probe_after);
                if due {
                    probed.insert(peer, now);
                    drop(probed);
                    self.beat(peer, true);
                }
            }
        }
    }

    fn peer_gone(self: &Arc<Self>, peer: u32, reason: &str) {
        self.gone
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(peer)
            .or_insert_with(|| reason.to_owned());
        let failed: Vec<Pending> = {
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            let ids: Vec<u64> = p
                .iter()
                .filter(|(_, v)| v.to == peer)
                .map(|(k, _)| *k)
                .collect();
            ids.into_iter().filter_map(|i| p.remove(&i)).collect()
        };
        let worker = self.name_of(peer);
        for p in failed {
            let _ = p.tx.send(Err(Error::WorkerGone {
                worker: worker.clone(),
                what: p.what,
                reason: reason.to_owned(),
            }));
        }
        if !self.closed.load(Ordering::SeqCst) {
            let leaks = self.rrefs.peer_gone(self, peer, &worker);
            for l in &leaks {
                tracing::warn!(worker = %self.me.name, "{l}");
            }
            self.leaks
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(leaks);
        }
    }

    async fn serve(
        self: Arc<Self>,
        from: u32,
        id: u64,
        req: Request,
        args: Vec<u8>,
        bulk: Bytes,
        adopted: Adopted,
    ) {
        let what = req.describe();
        let leaving = match req {
            Request::Leave { id } => Some(id),
            _ => None,
        };
        let r = self.handle(from, req, args, bulk, adopted).await;
        // A result over the envelope limit is answered with why, not sent.
        let r = r.and_then(|e| {
            match wire::check_envelope(e.bytes.len(), &format!("the result of {what}")) {
                Ok(()) => Ok(e),
                Err(m) => {
                    self.rrefs.cancel_children(&self, &e.forks);
                    Err(Failure::from(m))
                }
            }
        });
        let (result, out_bulk, forks, fork_data) = match r {
            Ok(e) => (Ok(e.bytes), e.bulk, e.forks, e.fork_data),
            Err(f) => (Err(f), Vec::new(), Vec::new(), Vec::new()),
        };
        let env = match wire::encode(&Envelope::Response {
            id,
            result,
            forks: fork_data,
        }) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!("encoding a response: {e}");
                self.rrefs.cancel_children(&self, &forks);
                return;
            }
        };
        let msg = Outgoing {
            env,
            bulk: out_bulk,
        };
        if let Err(e) = self.send_to(from, msg).await {
            self.rrefs.cancel_children(&self, &forks);
            tracing::debug!(worker = %self.me.name, "answer to {} not sent: {e}", self.name_of(from));
        }
        if let Some(id) = leaving {
            self.remove_worker(id);
            if let Ok(t) = self.transport() {
                t.remove_peer(id);
            }
        }
    }

    fn args(self: &Arc<Self>, bytes: Vec<u8>, bulk: Bytes, adopted: Adopted) -> Args {
        Args {
            rpc: Rpc(self.clone()),
            bytes,
            bulk,
            adopted,
        }
    }

    fn no_function(&self, func: &str) -> String {
        format!(
            "no function named {func:?} is registered on worker {}",
            self.me.name
        )
    }

    fn encode_value(
        self: &Arc<Self>,
        to: u32,
        v: &dyn Value,
    ) -> std::result::Result<Encoded, String> {
        self.encode_for(to, true, || v.encode())
    }

    fn empty() -> Encoded {
        Encoded {
            bytes: wire::encode(&()).expect("unit"),
            bulk: Vec::new(),
            forks: Vec::new(),
            fork_data: Vec::new(),
        }
    }

    async fn handle(
        self: &Arc<Self>,
        from: u32,
        req: Request,
        args: Vec<u8>,
        bulk: Bytes,
        adopted: Adopted,
    ) -> std::result::Result<Encoded, Failure> {
        // An owned value the request waits for is bounded by the default
        // timeout: the caller has given up by then.
        let owned = |rref: RRefId| {
            let a = self.clone();
            async move {
                a.rrefs
                    .owner_value(&a, rref, a.default_timeout)
                    .await
                    .map_err(|e| e.to_string())
            }
        };
        match req {
            Request::Call { func, sig } => {
                let f = self
                    .functions
                    .func(&func)
                    .ok_or_else(|| self.no_function(&func))?;
                mismatch(&f.sig, sig)?;
                let v = (f.run)(self.args(args, bulk, adopted)).await?;
                Ok(self.encode_value(from, v.as_ref())?)
            }
            Request::Remote {
                func,
                rref,
                fork,
                sig,
            } => {
                let what = format!("remote {func:?} from worker {}", self.name_of(from));
                self.rrefs.remote_arrived(self, rref, fork, from, &what);
                let f = self.functions.func(&func);
                let checked = match &f {
                    Some(f) => mismatch(&f.sig, sig),
                    None => Err(Failure::from(self.no_function(&func))),
                };
                let r = match (f, &checked) {
                    (Some(f), Ok(())) => (f.run)(self.args(args, bulk, adopted)).await,
                    (_, Err(e)) => Err(e.message.clone()),
                    (None, _) => unreachable!("checked"),
                };
                let answer = match (&r, checked) {
                    (_, Err(e)) => Err(e),
                    (Ok(_), Ok(())) => Ok(Self::empty()),
                    (Err(m), Ok(())) => Err(Failure::from(m.clone())),
                };
                self.rrefs.set_value(self, rref, r);
                answer
            }
            Request::Method { rref, method, sig } => {
                let v = owned(rref).await?;
                let held = v.lock().await.type_name();
                let m = self.functions.method(held, &method).map_err(|on| {
                    format!(
                        "no method named {method:?} for a {} value is registered on worker {}{}",
                        crate::types::shape(held),
                        self.me.name,
                        if on.is_empty() {
                            String::new()
                        } else {
                            format!(" (it is for: {})", on.join(", "))
                        }
                    )
                })?;
                mismatch(&m.sig, sig)?;
                let r = (m.run)(self.args(args, bulk, adopted), v).await?;
                Ok(self.encode_value(from, r.as_ref())?)
            }
            Request::Fetch { rref } => {
                drop(adopted);
                let v = owned(rref).await?;
                let g = v.lock().await;
                Ok(self.encode_value(from, g.as_ref())?)
            }
            Request::Join {
                info,
                addr,
                devices,
            } => {
                self.join_peer(info, &addr, &devices);
                Ok(Self::empty())
            }
            // The worker is forgotten once it has its answer (see `serve`):
            // forgetting it first would leave the answer nowhere to go.
            Request::Leave { .. } => Ok(Self::empty()),
            Request::Ping => Ok(Self::empty()),
            ref ctl => {
                self.handle_control(from, ctl)?;
                Ok(Self::empty())
            }
        }
    }

    fn handle_control(
        self: &Arc<Self>,
        from: u32,
        req: &Request,
    ) -> std::result::Result<(), String> {
        match *req {
            Request::UserDelete { rref, fork } => self.rrefs.user_delete(self, rref, fork),
            Request::ForkRequest { rref, fork } => {
                self.rrefs.fork_request(self, rref, fork, from)?
            }
            Request::ChildAccept { fork } => self.rrefs.child_accept(self, fork),
            _ => return Err(format!("{} is not a control message", req.describe())),
        }
        Ok(())
    }

    /// A worker joined (dynamic groups): learn its name, address and the
    /// inverse of its map towards us.
    pub(crate) fn join_peer(&self, info: WorkerInfo, addr: &str, devices: &DeviceInfo) {
        self.gone
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&info.id);
        if let Some(m) = devices.maps.get(&self.me.name) {
            self.reverse
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .insert(info.name.clone(), m.iter().map(|(k, v)| (*v, *k)).collect());
        }
        if let Ok(t) = self.transport() {
            t.add_peer(info.id, addr);
        }
        self.add_worker(info);
    }

    // ---- shutdown ----

    async fn wait_idle(&self, deadline: Option<Instant>) -> bool {
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
    async fn release_and_drain(self: &Arc<Self>, deadline: Option<Instant>, owners: bool) -> bool {
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
        let left: Vec<Pending> = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, p)| p)
            .collect();
        for p in left {
            let _ = p.tx.send(Err(Error::Shutdown(self.me.name.clone())));
        }
        if let Ok(t) = self.transport() {
            t.shutdown(graceful).await;
        }
        if let Some(Membership::Static(pg)) = self.membership.get() {
            if !graceful {
                pg.abort("the RPC agent shut down without waiting for the others");
            }
        }
        *done = true;
        let mut leaked = std::mem::take(&mut *self.leaks.lock().unwrap_or_else(|e| e.into_inner()));
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
    fn group_left(self: &Arc<Self>, e: &rallypoint_collectives::Error) {
        if let rallypoint_collectives::Error::Aborted { by: Some(r), .. } = e {
            if *r as u32 != self.me.id {
                self.peer_gone(
                    *r as u32,
                    "it shut down without waiting for the others (it gave up the group)",
                );
            }
        }
    }

    async fn graceful(self: &Arc<Self>, deadline: Option<Instant>) -> Result<()> {
        let left =
            |d: Option<Instant>| d.map_or(FOREVER, |d| d.saturating_duration_since(Instant::now()));
        let fail = |m: String| Error::ShutdownIncomplete {
            worker: self.me.name.clone(),
            message: m,
        };
        match self.membership.get() {
            Some(Membership::Static(pg)) => {
                // 1. Everyone has reached shutdown.
                pg.with_timeout(left(deadline))
                    .barrier()
                    .await
                    .map_err(|e| {
                        self.group_left(&e);
                        fail(format!("waiting for every worker to reach shutdown: {e}"))
                    })?;
                // 2. Users released, owners drained.
                if !self.release_and_drain(deadline, true).await {
                    tracing::warn!(worker = %self.me.name, "RRefs still referenced when shutdown stopped waiting");
                }
                // 3. No call in flight anywhere: rounds of "idle here, sum
                // over the group", with new outgoing work held at the gate
                // from the moment the count read for a round is zero.
                self.gate.close();
                loop {
                    self.wait_idle(deadline).await;
                    let mut n = [self.gate.count() as u64];
                    let r = pg
                        .with_timeout(left(deadline))
                        .all_reduce(&mut n, rallypoint_collectives::ReduceOp::Sum)
                        .await;
                    if let Err(e) = r {
                        self.gate.verdict(true);
                        self.group_left(&e);
                        return Err(fail(format!(
                            "waiting for every worker's calls to finish: {e}"
                        )));
                    }
                    self.gate.verdict(n[0] == 0);
                    if n[0] == 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Ok(())
            }
            Some(Membership::Dynamic(d)) => {
                // Release while the others can still answer, then leave. The
                // others go on, so values they still hold here are reported.
                self.release_and_drain(deadline, false).await;
                self.wait_idle(deadline).await;
                d.leave(self, deadline)
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                Ok(())
            }
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

impl Rpc {
    /// This worker.
    pub fn me(&self) -> &WorkerInfo {
        &self.0.me
    }

    /// A worker by name (PyTorch's `get_worker_info(name)`).
    pub fn get_worker_info(&self, name: &str) -> Result<WorkerInfo> {
        self.0.worker_by_id(self.0.id_of(name)?)
    }

    /// Every worker this one knows, by id.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        self.0
            .workers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_id
            .values()
            .cloned()
            .collect()
    }

    /// The functions this worker serves (to add more after init).
    pub fn functions(&self) -> &Functions {
        &self.0.functions
    }

    /// The devices this worker uses (declared, or derived from the maps).
    pub fn devices(&self) -> Vec<Device> {
        self.0
            .devices
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The inverse of each peer's device map towards this worker.
    pub fn reverse_device_maps(&self) -> BTreeMap<String, DeviceMap> {
        self.0
            .reverse
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Where this worker's transport listens (empty if it has no address).
    pub fn address(&self) -> String {
        self.0
            .transport
            .get()
            .map(|t| t.address())
            .unwrap_or_default()
    }

    /// The default timeout for calls.
    pub fn default_timeout(&self) -> Duration {
        self.0.default_timeout
    }

    pub(crate) async fn request<A: Serialize, R: DeserializeOwned>(
        &self,
        to: u32,
        req: Request,
        args: &A,
        timeout: Option<Duration>,
    ) -> Result<R> {
        let a = &self.0;
        let enc = a
            .encode_for(to, false, || wire::encode(args))
            .map_err(Error::Codec)?;
        let (bytes, bulk, adopted) = a
            .call_raw(to, req, enc, timeout)
            .await
            .map_err(|e| ours::<A, R>(&a.me.name, e))?;
        a.decode_from::<R>(&bytes, bulk, adopted.handles)
            .map_err(|e| {
                Error::Codec(format!(
                    "decoding the answer of worker {}: {e}",
                    a.name_of(to)
                ))
            })
    }

    /// Calls `func` on `to` and waits for its result (the default timeout).
    pub async fn rpc_sync<A: Serialize, R: DeserializeOwned>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
    ) -> Result<R> {
        self.rpc_sync_timeout(to, func, args, None).await
    }

    /// [`Rpc::rpc_sync`] with a timeout: `None` is the default,
    /// `Some(Duration::ZERO)` never expires.
    pub async fn rpc_sync_timeout<A: Serialize, R: DeserializeOwned>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
        timeout: Option<Duration>,
    ) -> Result<R> {
        let to = to.worker_id(&self.0)?;
        self.request(
            to,
            Request::Call {
                func: func.to_owned(),
                sig: Sig::of::<A, R>(),
            },
            args,
            timeout,
        )
        .await
    }

    /// Starts a call of `func` on `to` and returns at once; await the handle
    /// for the result.
    pub fn rpc_async<A: Serialize, R: DeserializeOwned + Send + 'static>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
    ) -> RpcFuture<R> {
        self.rpc_async_timeout(to, func, args, None)
    }

    /// [`Rpc::rpc_async`] with a timeout (as [`Rpc::rpc_sync_timeout`]).
    pub fn rpc_async_timeout<A: Serialize, R: DeserializeOwned + Send + 'static>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
        timeout: Option<Duration>,
    ) -> RpcFuture<R> {
        let a = self.0.clone();
        let start = (|| {
            let to = to.worker_id(&a)?;
            let enc = a
                .encode_for(to, false, || wire::encode(args))
                .map_err(Error::Codec)?;
            Ok((to, enc))
        })();
        let func = func.to_owned();
        let rt = a.rt.clone();
        // Counted from the call, not from when its task first runs: a
        // shutdown right after `rpc_async` still waits for it (unless
        // shutdown's gate is shut: then the call waits for its verdict).
        let active = a.gate.try_enter(Work::Outgoing);
        RpcFuture(rt.spawn(async move {
            let _active = active;
            let (to, enc) = start?;
            let sig = Sig::of::<A, R>();
            let (bytes, bulk, adopted) = a
                .call_raw(to, Request::Call { func, sig }, enc, timeout)
                .await
                .map_err(|e| ours::<A, R>(&a.me.name, e))?;
            a.decode_from::<R>(&bytes, bulk, adopted.handles)
                .map_err(|e| {
                    Error::Codec(format!(
                        "decoding the answer of worker {}: {e}",
                        a.name_of(to)
                    ))
                })
        }))
    }

    /// Runs `func` on `to` and keeps its result there, returning a reference
    /// owned by `to` (PyTorch's `rpc.remote`). Returns at once; a failure is
    /// recorded on the RRef and reported by its next use.
    pub fn remote<A: Serialize, T: Serialize + DeserializeOwned + Send + 'static>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
    ) -> Result<RRef<T>> {
        self.remote_timeout(to, func, args, None)
    }

    /// [`Rpc::remote`] with a timeout for the creation.
    pub fn remote_timeout<A: Serialize, T: Serialize + DeserializeOwned + Send + 'static>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: &A,
        timeout: Option<Duration>,
    ) -> Result<RRef<T>> {
        let a = &self.0;
        let to = to.worker_id(a)?;
        let type_name = std::any::type_name::<T>();
        let sig = Sig::of::<A, T>();
        let enc = a
            .encode_for(to, false, || wire::encode(args))
            .map_err(Error::Codec)?;
        if to == a.me.id {
            let what = format!("remote {func:?} on worker {} itself", a.me.name);
            let h = a.rrefs.new_owned(a, what, type_name);
            let (rref, a2, func) = (h.id, a.clone(), func.to_owned());
            let early = a.gate.try_enter(Work::Outgoing);
            a.rt.spawn(async move {
                let Some(_active) = a2.admit(early).await else {
                    let m = format!("the RPC agent of worker {} is shut down", a2.me.name);
                    return a2.rrefs.set_value(&a2, rref, Err(m));
                };
                let args = a2.args(
                    enc.bytes,
                    concat(enc.bulk),
                    rrefs::adopt_all(&a2, enc.fork_data),
                );
                let r = match a2.functions.func(&func) {
                    Some(f) if f.sig.accepts(sig) => (f.run)(args).await,
                    Some(f) => Err(ours::<A, T>(
                        &a2.me.name,
                        Error::TypeMismatch(Box::new(crate::Mismatch {
                            worker: a2.me.name.clone(),
                            what: format!("function {func:?}"),
                            their_args: f.sig.args,
                            their_ret: f.sig.ret,
                            caller: String::new(),
                            our_args: String::new(),
                            our_ret: String::new(),
                        })),
                    )
                    .to_string()),
                    None => Err(a2.no_function(&func)),
                };
                a2.rrefs.set_value(&a2, rref, r);
            });
            return Ok(RRef::from_handle(h));
        }
        let what = format!(
            "remote {func:?} on worker {} from {}",
            a.name_of(to),
            a.me.name
        );
        let h = a.rrefs.new_user(a, to, what, type_name);
        let (rref, fork) = (h.id, h.fork.expect("a user"));
        let (a2, func) = (a.clone(), func.to_owned());
        let active = a.gate.try_enter(Work::Outgoing);
        a.rt.spawn(async move {
            let _active = active;
            let req = Request::Remote {
                func,
                rref,
                fork,
                sig,
            };
            let r = a2
                .call_raw(to, req, enc, timeout)
                .await
                .map_err(|e| ours::<A, T>(&a2.me.name, e));
            let err = match r {
                Ok(_) => None,
                Err(Error::Timeout { worker, ms, .. }) => Some(Error::Timeout {
                    worker,
                    what: "RRef creation via rpc.remote()".into(),
                    ms,
                }),
                Err(e) => Some(e),
            };
            a2.rrefs.confirm(&a2, fork, err);
        });
        Ok(RRef::from_handle(h))
    }

    /// A local value behind an RRef owned by this worker (PyTorch's
    /// `RRef(value)`), to pass to others.
    pub fn rref<T: Serialize + DeserializeOwned + Send + 'static>(&self, value: T) -> RRef<T> {
        let a = &self.0;
        let h = a.rrefs.new_owned(
            a,
            format!("a local value of worker {}", a.me.name),
            std::any::type_name::<T>(),
        );
        a.rrefs.set_value(a, h.id, Ok(Box::new(value)));
        RRef::from_handle(h)
    }

    /// Sends an empty request to every worker, opening connections ahead of use.
    pub async fn ping_all(&self) -> Result<()> {
        for w in self.workers() {
            self.0.request_raw(w.id, Request::Ping, None).await?;
        }
        Ok(())
    }

    /// Shuts the agent down. `graceful`: wait for every worker, release
    /// references and let calls in flight everywhere finish, then tear down;
    /// otherwise tear down at once. `timeout` bounds the graceful part
    /// (`None` or zero: unbounded); teardown always runs.
    pub async fn shutdown(
        &self,
        graceful: bool,
        timeout: Option<Duration>,
    ) -> Result<ShutdownReport> {
        self.0.shutdown(graceful, timeout).await
    }

    /// Counts of RRef bookkeeping on this worker: (owned values, users,
    /// parents waiting for their children). For tests and diagnostics.
    pub fn rref_counts(&self) -> (usize, usize, usize) {
        self.0.rrefs.counts()
    }

    /// Tombstones of deleted users kept by the values this worker owns (for
    /// tests and reports: bounded, see the `rref` module).
    pub fn rref_tombstones(&self) -> usize {
        self.0.rrefs.tombstones()
    }

    /// Calls in flight on this worker (outgoing, being served, control).
    pub fn active_calls(&self) -> usize {
        self.0.gate.count()
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

/// The result of [`Rpc::rpc_async`], which is already under way.
pub struct RpcFuture<R>(tokio::task::JoinHandle<Result<R>>);

impl<R> Future for RpcFuture<R> {
    type Output = Result<R>;
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<R>> {
        std::pin::Pin::new(&mut self.0).poll(cx).map(|r| match r {
            Ok(r) => r,
            Err(e) => Err(Error::Shutdown(format!("(call task ended: {e})"))),
        })
    }
}

/// Refuses a call whose expected types (`want`) are not the registered
/// function's, naming the function's (the caller names its own).
fn mismatch(have: &crate::types::Signature, want: crate::types::Sig) -> Result<(), Failure> {
    if have.accepts(want) {
        return Ok(());
    }
    Err(Failure {
        message: format!("it takes {} and returns {}", have.args, have.ret),
        types: Some((have.args.clone(), have.ret.clone())),
    })
}

/// Completes a type mismatch reported by a callee with the caller's side.
fn ours<A: ?Sized, R: ?Sized>(me: &str, e: Error) -> Error {
    match e {
        Error::TypeMismatch(mut m) => {
            m.caller = me.to_owned();
            m.our_args = shape(std::any::type_name::<A>());
            m.our_ret = shape(std::any::type_name::<R>());
            Error::TypeMismatch(m)
        }
        e => e,
    }
}
