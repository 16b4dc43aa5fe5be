//! Serving: what arrives from the transport (answers to our calls, requests
//! to run, heartbeats, a worker gone), and the requests' handlers.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use rallypoint_sync::{MutexExt, RwLockExt};
use tokio::time::Instant;

use super::gate::Work;
use super::rrefs::{self, Adopted};
use super::{AgentInner, Args, Encoded, Pending, Rpc};
use crate::device::DeviceInfo;
use crate::error::{Error, Mismatch};
use crate::transport::{Event, Outgoing};
use crate::wire::{self, Envelope, Failure, RRefId, Request};
use crate::worker_info::WorkerInfo;

impl AgentInner {
    /// The transport's entry point.
    pub(crate) fn deliver(self: &Arc<Self>, ev: Event) {
        match ev {
            Event::Message { from, env, bulk } => self.message(from, env, bulk),
            Event::Gone { peer, reason } => self.peer_gone(peer, &reason, true),
        }
    }

    pub(super) fn message(self: &Arc<Self>, from: u32, env: Vec<u8>, bulk: Bytes) {
        if !self.heartbeat.is_zero() {
            self.heard.locked().insert(from, Instant::now());
        }
        match wire::decode::<Envelope>(&env) {
            Ok(Envelope::Heartbeat { answer }) => {
                if answer {
                    self.beat(from, false);
                }
            }
            Ok(Envelope::Response { id, result, forks }) => {
                let adopted = rrefs::adopt_all(self, forks);
                let mut pending = self.pending.locked();
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
                                Error::TypeMismatch(Box::new(Mismatch {
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
                // Requests that run user code take a turn (at most
                // `max_requests` at once); control messages (quick, and what
                // frees references) never wait. The others wait here: the
                // connection is not paused, since it also carries this
                // peer's answers, heartbeats and control messages (pausing
                // it would deadlock nested calls); each caller holds at most
                // `max_requests` in flight to us (`calls.rs`), which bounds
                // what waits.
                let counted = super::calls::counted(&req);
                let sem = self.requests.clone();
                self.rt.spawn(async move {
                    let _active = active;
                    let _turn = match counted {
                        true => sem.acquire_owned().await.ok(),
                        false => None,
                    };
                    a.serve(from, id, req, args, bulk, adopted).await
                });
            }
            Err(e) => {
                tracing::warn!(worker = %self.me.name, from, "dropped an undecodable message: {e}")
            }
        }
    }

    /// Worker `peer` is gone: its transport or process group said so
    /// (`proven`), or the heartbeat heard nothing from it for the deadline,
    /// which a worker cut off for a while and back again also does. Calls
    /// waiting on it fail and its references are released either way, but
    /// only a proven death stops control messages to it from being retried:
    /// a suspect that lives on must still hear of the children it sent
    /// (else its table keeps them and their parents for good, and its
    /// shutdown never settles: 1,590 of the RRef simulator's 10,000 seeds,
    /// the first seed 1, once it could suspect live workers).
    pub(super) fn peer_gone(self: &Arc<Self>, peer: u32, reason: &str, proven: bool) {
        if proven {
            self.gone
                .locked()
                .entry(peer)
                .or_insert_with(|| reason.to_owned());
        }
        let failed: Vec<Pending> = {
            let mut p = self.pending.locked();
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
            self.leaks.locked().extend(leaks);
        }
    }

    pub(super) async fn serve(
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
            if let Ok(t) = self.transport() {
                t.remove_peer(id);
            }
        }
    }

    pub(super) fn args(self: &Arc<Self>, bytes: Vec<u8>, bulk: Bytes, adopted: Adopted) -> Args {
        Args {
            rpc: Rpc(self.clone()),
            bytes,
            bulk,
            adopted,
        }
    }

    pub(super) fn no_function(&self, func: &str) -> String {
        format!(
            "no function named {func:?} is registered on worker {}",
            self.me.name
        )
    }

    pub(super) async fn handle(
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
            // The worker leaves the group before it has its answer (the
            // answer means "you are out"); its connection is dropped only
            // once the answer is sent (see `serve`), or the answer would have
            // nowhere to go.
            Request::Leave { id } => {
                self.remove_worker(id);
                Ok(Self::empty())
            }
            Request::Ping => Ok(Self::empty()),
            ref ctl => {
                self.handle_control(from, ctl)?;
                Ok(Self::empty())
            }
        }
    }

    pub(super) fn handle_control(
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
        self.gone.locked().remove(&info.id);
        if let Some(m) = devices.maps.get(&self.me.name) {
            self.reverse
                .write_locked()
                .insert(info.name.clone(), m.iter().map(|(k, v)| (*v, *k)).collect());
        }
        if let Ok(t) = self.transport() {
            t.add_peer(info.id, addr);
        }
        self.add_worker(info);
    }
}

/// Refuses a call whose expected types (`want`) are not the registered
/// function's, naming the function's (the caller names its own).
pub(super) fn mismatch(
    have: &crate::types::Signature,
    want: crate::types::Sig,
) -> Result<(), Failure> {
    if have.accepts(want) {
        return Ok(());
    }
    Err(Failure {
        message: format!("it takes {} and returns {}", have.args, have.ret),
        types: Some((have.args.clone(), have.ret.clone())),
    })
}
