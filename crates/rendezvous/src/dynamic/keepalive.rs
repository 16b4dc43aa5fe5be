//! Liveness of the members of a round: each beats and watches its successor
//! ([`Keepalive`]; heartbeat counters here, etcd leases in the etcd backend),
//! and a watcher that sees its successor stop without leaving marks it dead.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rallypoint_store::Store;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::state::Liveness;
use super::{mark_changed, Timing};

/// What a member of a round keeps alive and watches.
pub struct Beat {
    /// The run's own store (keys such as `r3/hb/0`).
    pub store: Arc<dyn Store>,
    /// The run's key prefix in the underlying store, with its trailing `/`.
    pub namespace: String,
    pub round: u64,
    pub rank: usize,
    pub members: usize,
    pub timing: Timing,
    /// Cleared when this member leaves: it stops beating but goes on
    /// watching, so a host that lingers still notices the last members die.
    pub beating: Arc<std::sync::atomic::AtomicBool>,
}

impl Beat {
    /// The rank this member watches: its successor in rank order (`None` alone).
    pub fn successor(&self) -> Option<usize> {
        self.after(self.rank)
    }

    /// The member after `rank` in the ring, `None` once it is this member.
    pub fn after(&self, rank: usize) -> Option<usize> {
        let next = (rank + 1) % self.members.max(1);
        (next != self.rank).then_some(next)
    }

    /// Whether member `rank` left on purpose (see
    /// [`RendezvousHandler::leave`](crate::RendezvousHandler::leave)).
    pub async fn left(&self, rank: usize) -> bool {
        self.store
            .check(&[&format!("r{}/left/{rank}", self.round)])
            .await
            .unwrap_or(false)
    }

    /// Records that member `rank` is dead: the round should re-form, and the
    /// run has one node fewer.
    pub async fn died(&self, rank: usize) {
        tracing::warn!(
            round = self.round,
            rank,
            "rendezvous peer stopped keeping alive; marking the round for re-forming"
        );
        if let Err(e) = mark_changed(&*self.store, &format!("r{}", self.round), "dead").await {
            tracing::warn!(error = %e, "could not mark the round changed");
        }
        if let Err(e) = crate::census::dead(&*self.store).await {
            tracing::warn!(error = %e, "could not count the dead node");
        }
    }

    /// `watched` stopped keeping alive: unless it left, marks it dead; returns
    /// the member to watch next (`None`: nobody else is left to watch).
    pub async fn watched_stopped(&self, watched: usize) -> Option<usize> {
        if !self.left(watched).await {
            self.died(watched).await;
        }
        self.after(watched)
    }
}

/// How members show they are alive and notice a dead successor. Each member runs
/// one for its round, until the round ends; when the member it watches stops
/// keeping alive it must call [`Beat::watched_stopped`] and watch the member
/// that returns.
pub trait Keepalive: Send + Sync {
    fn spawn(&self, beat: Beat) -> JoinHandle<()>;
}

/// The default keep-alive: a heartbeat counter per member in the store, bumped
/// every interval; the watcher reads its successor's counter a few times per
/// interval and declares it dead after `max_misses` intervals without a change.
pub struct CounterKeepalive;

impl Keepalive for CounterKeepalive {
    fn spawn(&self, beat: Beat) -> JoinHandle<()> {
        tokio::spawn(async move {
            let timing = beat.timing;
            let r = format!("r{}", beat.round);
            let mine = format!("{r}/hb/{}", beat.rank);
            let mut watched = beat.successor();
            let store = beat.store.clone();
            let fresh = || {
                Liveness::new(
                    timing.keep_alive,
                    timing.max_misses,
                    std::time::Instant::now(),
                )
            };
            let mut watch = fresh();
            // Watch at a finer grain than the beat, so detection lands within
            // interval * misses plus a fraction of an interval.
            let tick = (timing.keep_alive / 4).max(Duration::from_millis(10));
            let mut next_beat = Instant::now();
            loop {
                if Instant::now() >= next_beat {
                    if beat.beating.load(Ordering::Acquire) {
                        let _ = store.add(&mine, 1).await;
                    }
                    next_beat += timing.keep_alive;
                }
                if let Some(w) = watched {
                    if let Ok(v) = store.add(&format!("{r}/hb/{w}"), 0).await {
                        if watch.observe(v, std::time::Instant::now()) {
                            // Dead or left: either way watch the next one.
                            watched = beat.watched_stopped(w).await;
                            watch = fresh();
                        }
                    }
                }
                let until_beat = next_beat.saturating_duration_since(Instant::now());
                let nap = if watched.is_some() {
                    tick.min(until_beat)
                } else {
                    until_beat
                };
                tokio::time::sleep(nap.max(Duration::from_millis(1))).await;
            }
        })
    }
}
