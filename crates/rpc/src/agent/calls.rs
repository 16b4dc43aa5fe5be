//! Calling: a call's entry in the pending table, its send and its wait,
//! each within the call's deadline; RRef control messages, retried.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rallypoint_sync::MutexExt;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::gate::Work;
use super::rrefs::Adopted;
use super::{AgentInner, Encoded, Pending};
use crate::error::{Error, Result};
use crate::transport::Outgoing;
use crate::wire::{self, Envelope, ForkId, RRefId, Request};

impl AgentInner {
    /// Sends `req` with encoded `args` to `to` and waits for the answer.
    pub(super) async fn call_raw(
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
        // Backpressure at the source: at most `max_requests` requests that
        // run user code in flight to one worker; the others wait here,
        // within their deadline (the callee never has to pause a
        // connection, which also carries answers and heartbeats).
        let _turn = if counted(&req) {
            let turn = self.outstanding(to).acquire_owned();
            let turn = match deadline {
                Some(d) => match tokio::time::timeout_at(d, turn).await {
                    Ok(t) => t,
                    Err(_) => {
                        self.rrefs.cancel_children(self, &args.forks);
                        return Err(expired(worker, what));
                    }
                },
                None => turn.await,
            };
            turn.ok()
        } else {
            None
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let forget = |a: &Self| {
            a.pending.locked().remove(&id);
        };
        self.pending.locked().insert(
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
                if self.gone.locked().contains_key(&to) {
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
}

/// Whether a request runs user code (and so counts against `max_requests`,
/// at its caller per callee and at its callee); RRef control messages,
/// joins, leaves and pings do not.
pub(super) fn counted(req: &Request) -> bool {
    matches!(
        req,
        Request::Call { .. }
            | Request::Remote { .. }
            | Request::Method { .. }
            | Request::Fetch { .. }
    )
}

impl AgentInner {
    /// The turns for requests in flight to worker `to`.
    fn outstanding(&self, to: u32) -> Arc<tokio::sync::Semaphore> {
        self.outstanding
            .locked()
            .entry(to)
            .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(self.max_requests)))
            .clone()
    }
}
