//! The program's side: [`Rpc`], the handle on a worker's agent (calls,
//! `remote()`, local RRefs, shutdown), and [`ToWorker`].

use std::time::Duration;

use rallypoint_sync::RwLockExt;
use serde::de::DeserializeOwned;
use serde::Serialize;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use super::gate::Work;
use super::rrefs::{self, RRef};
use super::{concat, AgentInner, Encoded, Functions, Rpc, ShutdownReport};
use crate::device::{Device, DeviceMap};
use crate::error::{Error, Mismatch, Result};
use crate::types::{shape, Sig};
use crate::wire::{self, Request};
use crate::worker_info::WorkerInfo;

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
            .read_locked()
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
        self.0.devices.read_locked().clone()
    }

    /// The inverse of each peer's device map towards this worker.
    pub fn reverse_device_maps(&self) -> BTreeMap<String, DeviceMap> {
        self.0.reverse.read_locked().clone()
    }

    /// Where this worker's transport listens (empty if it has no address).
    pub fn address(&self) -> String {
        self.0
            .transport
            .get()
            .map(|t| t.address())
            .unwrap_or_default()
    }

    /// Connections this worker's listener refused at the job-secret
    /// handshake, by reason (all zero without a secret, or with a backend
    /// that does not run it).
    pub fn refusals(&self) -> rallypoint_auth::RefusalCounts {
        self.0
            .transport
            .get()
            .and_then(|t| t.refusals())
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
        call_typed::<A, R>(a, to, req, enc, timeout).await
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
            call_typed::<A, R>(&a, to, Request::Call { func, sig }, enc, timeout).await
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
                        Error::TypeMismatch(Box::new(Mismatch {
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

/// Completes a type mismatch reported by a callee with the caller's side.
pub(super) fn ours<A: ?Sized, R: ?Sized>(me: &str, e: Error) -> Error {
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

/// Sends an encoded call and decodes its answer as an `R`; a type mismatch
/// the callee reports is completed with the caller's side.
async fn call_typed<A: ?Sized, R: DeserializeOwned>(
    a: &Arc<AgentInner>,
    to: u32,
    req: Request,
    enc: Encoded,
    timeout: Option<Duration>,
) -> Result<R> {
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
