//! Watching the rendezvous without polling.
//!
//! One task per round, from the join to the end of the round, blocks on the
//! store and hands the phase drivers an [`Observation`] each time something
//! may have changed: the round was woken ([`RendezvousHandler::changed`]: a
//! node waiting, a member dead, a beat that failed) or the run's verdict was
//! published (a `WAIT` on [`run_store::keys::CLOSED`], then on
//! [`run_store::keys::FAILED`] once a success was read). Each wake costs one
//! bounded look ([`observe`]); while nothing happens the node makes no store
//! operation besides its keep-alive. The waits are armed 0.1 s after the join
//! (or one monitor interval, if shorter), so a round shorter than that costs
//! the store nothing. While the store does not answer, the task looks again
//! every monitor interval (kept within 0.1–1 s), so the policy sees time pass
//! towards its `lost_grace`, and sees the store come back. A long monitor
//! interval therefore no longer delays what the rendezvous reports (under
//! torchrun it does: it is the period of every check).
//!
//! The drivers read the latest observation (`tokio::sync::watch`): one that
//! arrives while a driver is busy elsewhere (stopping workers) is not queued
//! behind a newer one.

use std::sync::Arc;
use std::time::Duration;

use rallypoint_rendezvous::RendezvousHandler;
use rallypoint_store::Store;
use tokio::task::JoinHandle;

use super::policy::Observation;
use super::run_store::{self, Closed};
use super::CHECK_TIMEOUT;

/// The waits are armed this long after the join at most (the monitor
/// interval, when shorter).
const ARM_AFTER: Duration = Duration::from_millis(100);
/// Bounds of the interval between looks while the store does not answer (the
/// monitor interval, within them).
const RELOOK_MIN: Duration = Duration::from_millis(100);
const RELOOK_MAX: Duration = Duration::from_secs(1);

/// How long one verdict `WAIT` may sit on the server: the run's whole life.
const FOREVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// The watch of one round; the task ends when this is dropped.
pub(super) struct Watch {
    seen: tokio::sync::watch::Receiver<Option<Observation>>,
    task: JoinHandle<()>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Watch {
    /// Starts watching `round` (its first look is at once).
    pub(super) fn spawn(
        handler: Arc<dyn RendezvousHandler>,
        run_store: Arc<dyn Store>,
        round: u64,
        poll: Duration,
    ) -> Watch {
        let (tx, seen) = tokio::sync::watch::channel(None);
        // Looks at a store that does not answer: often enough for the policy's
        // `lost_grace`, not so often that many nodes hammer a store coming back.
        let relook = poll.clamp(RELOOK_MIN, RELOOK_MAX);
        let task = tokio::spawn(async move {
            let mut woken = 0;
            let mut verdict = None;
            // Armed a moment after the join (a round shorter than that costs
            // the store nothing). A change made before the arming is not
            // missed: the wait returns at once when the round was woken or the
            // verdict is there.
            tokio::time::sleep(poll.min(ARM_AFTER)).await;
            loop {
                let key = match verdict {
                    None => Some(run_store::keys::CLOSED),
                    Some(Closed::Succeeded) => Some(run_store::keys::FAILED),
                    Some(Closed::Failed(_)) => None,
                };
                let published = async {
                    match key {
                        Some(k) => run_store.wait_timeout(&[k], FOREVER).await,
                        None => std::future::pending().await,
                    }
                };
                let failed = tokio::select! {
                    w = handler.changed(woken, poll) => w.map(|w| woken = w).map_err(|e| e.to_string()).err(),
                    p = published => p.err().map(|e| e.to_string()),
                };
                let mut o = match failed {
                    Some(e) => Observation::Unreachable(e),
                    None => observe(&*handler, &*run_store, round).await,
                };
                // While the store does not answer, look every `poll` until it
                // does (the policy counts the time towards its `lost_grace`).
                loop {
                    if let Observation::Closed(c) = &o {
                        verdict = Some(c.clone());
                    }
                    let unreachable = matches!(o, Observation::Unreachable(_));
                    if tx.send(Some(o)).is_err() {
                        return;
                    }
                    if !unreachable {
                        break;
                    }
                    tokio::time::sleep(relook).await;
                    o = observe(&*handler, &*run_store, round).await;
                }
            }
        });
        Watch { seen, task }
    }

    /// The next observation (cancel-safe).
    pub(super) async fn next(&mut self) -> Observation {
        loop {
            if self.seen.changed().await.is_err() {
                // The task ended: it never does while the watch lives.
                return std::future::pending().await;
            }
            if let Some(o) = self.seen.borrow_and_update().clone() {
                return o;
            }
        }
    }
}

/// One bounded look at the run from a node whose round is under way: the
/// verdict if one is published (whatever the backend), else how the membership
/// changed, else healthy; unreachable if the look fails.
pub(super) async fn observe(
    handler: &dyn RendezvousHandler,
    run_store: &dyn Store,
    round: u64,
) -> Observation {
    let look = async {
        if let Some(closed) = run_store::read_verdict(run_store)
            .await
            .map_err(|e| e.to_string())?
        {
            return Ok(Observation::Closed(closed));
        }
        let m = handler.membership().await.map_err(|e| e.to_string())?;
        if m.waiting == 0 && m.dead == 0 {
            return Ok(Observation::Healthy);
        }
        let finishing = m.waiting > 0
            && run_store::finishing(run_store, round)
                .await
                .map_err(|e| e.to_string())?;
        Ok::<_, String>(Observation::Changed {
            waiting: m.waiting,
            dead: m.dead,
            finishing,
            lost: m.lost,
        })
    };
    match tokio::time::timeout(CHECK_TIMEOUT, look).await {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => Observation::Unreachable(e),
        Err(_) => Observation::Unreachable(format!("no answer within {CHECK_TIMEOUT:?}")),
    }
}
