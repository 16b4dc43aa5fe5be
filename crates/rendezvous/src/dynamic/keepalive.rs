//! Liveness of the members of a round ([`Keepalive`]; heartbeat counters
//! here, etcd leases in the etcd backend).
//!
//! With counters, every member bumps `r/hb/<rank>` once per keep-alive
//! interval: its one store operation per interval, which also tells it
//! whether the store still answers ([`Health`]). Watching is split so that it
//! costs almost nothing per member: the first [`WATCHERS`] ranks read every
//! member's counter in one `MULTI_GET` a few times per interval (detection
//! within `interval * misses` plus a fraction of an interval, at O(1)
//! operations per round, not per member), and every other member reads its
//! successor's counter once every [`RING_INTERVALS`] intervals, so that a
//! round whose watchers all died together is still noticed, later. A watcher
//! that sees a counter stop checks `r/left/<rank>` and, unless the member
//! left, marks it dead; the first to mark a member (`r/dead/<rank>`) marks
//! the round to re-form, and the first to bump `r/census/<rank>` counts it out
//! of the run, so two watchers never count one death twice, and a member
//! found dead while only cut off, which bumps it on its way back, is not
//! counted out twice (see `census`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rallypoint_store::Store;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::state::Liveness;
use super::{mark_changed, Timing};
use crate::census::Standing;
use crate::Health;

/// Ranks that watch every member of their round.
pub const WATCHERS: usize = 2;
/// Intervals between two reads of a successor's counter by the other members.
pub const RING_INTERVALS: u32 = 8;

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
    /// Where each beat's outcome goes (a failed beat wakes a waiting agent).
    pub health: Health,
    /// This member's standing in the census: reconciled when its beats
    /// reach the store again after failing (it may have been found dead
    /// meanwhile: see `census`).
    pub(crate) standing: Arc<Standing>,
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

    /// Records that member `rank` is dead (`r/dead/<rank>`, the first
    /// watcher marks the round to re-form) and counts it out of the run: by
    /// whoever bumps `r/census/<rank>` first, a watcher or the member itself,
    /// alive after all (see `census::Standing`).
    pub async fn died(&self, rank: usize) {
        match self
            .store
            .add(&format!("r{}/dead/{rank}", self.round), 1)
            .await
        {
            Ok(1) => {}
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(error = %e, "could not mark a dead member");
                return;
            }
        }
        tracing::warn!(
            round = self.round,
            rank,
            "rendezvous peer stopped keeping alive; marking the round for re-forming"
        );
        if let Err(e) = mark_changed(&*self.store, &format!("r{}", self.round), "dead").await {
            tracing::warn!(error = %e, "could not mark the round changed");
        }
        if let Err(e) = crate::census::found_dead(&*self.store, self.round, rank).await {
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

/// The default keep-alive: a heartbeat counter per member in the store (see
/// the module doc for who reads which).
pub struct CounterKeepalive;

impl Keepalive for CounterKeepalive {
    fn spawn(&self, beat: Beat) -> JoinHandle<()> {
        tokio::spawn(async move {
            let ka = beat.timing.keep_alive;
            let mine = format!("r{}/hb/{}", beat.round, beat.rank);
            let mut watch = Watch::new(&beat);
            // Spread over the interval by rank: a round's members do not all
            // beat (or look) in the same instant, and none right at the join
            // (the counters start at 0, so the first beat is not urgent).
            let spread = |every: Duration| every.mul_f64(spread(beat.rank));
            let mut next_beat = Instant::now() + spread(ka);
            let mut next_look = Instant::now() + spread(watch.every);
            // A beat failed, or none reached the store for an expiry (the
            // process was stopped, or this loop held up), since the standing
            // was last reconciled: a watcher may have counted it dead.
            let mut missed = false;
            let expiry = ka * beat.timing.max_misses;
            let mut last_ok = Instant::now();
            loop {
                if Instant::now() >= next_beat {
                    if beat.beating.load(Ordering::Acquire) {
                        // A beat slower than an interval is as bad as a lost one.
                        let done = tokio::time::timeout(ka, beat.store.add(&mine, 1)).await;
                        let ok = matches!(done, Ok(Ok(_)));
                        beat.health.report(match done {
                            Ok(Ok(_)) => Ok(()),
                            Ok(Err(e)) => Err(e.to_string()),
                            Err(_) => Err(format!("a keep-alive beat got no answer within {ka:?}")),
                        });
                        missed |= !ok || last_ok.elapsed() >= expiry;
                        if ok {
                            last_ok = Instant::now();
                        }
                        // Back after failing: perhaps found dead meanwhile.
                        if ok && missed {
                            let r = tokio::time::timeout(ka, beat.standing.reconcile(&*beat.store));
                            missed = !matches!(r.await, Ok(Ok(())));
                        }
                    }
                    next_beat += ka;
                }
                if Instant::now() >= next_look {
                    watch.look(&beat).await;
                    next_look += watch.every;
                }
                let nap = next_beat
                    .min(next_look)
                    .saturating_duration_since(Instant::now());
                tokio::time::sleep(nap.max(Duration::from_millis(1))).await;
            }
        })
    }
}

/// A fraction in [0, 1) for `rank`, evenly spread over any run of ranks (the
/// golden-ratio sequence).
fn spread(rank: usize) -> f64 {
    (rank as f64 * 0.618_033_988_749_895).fract()
}

/// What one member watches (see the module doc).
struct Watch {
    /// Time between two looks.
    every: Duration,
    /// A watcher's view of every other member (`None` once settled: dead or
    /// left); empty for the others.
    all: Vec<Option<Liveness>>,
    /// The successor a non-watcher reads, and its counter's history.
    ring: Option<(usize, Liveness)>,
}

impl Watch {
    fn new(beat: &Beat) -> Watch {
        let t = beat.timing;
        let fresh = || Liveness::new(t.keep_alive, t.max_misses, std::time::Instant::now());
        if beat.rank < WATCHERS {
            let all = (0..beat.members)
                .map(|m| (m != beat.rank).then(fresh))
                .collect();
            Watch {
                // Finer than the beat, so detection lands within
                // interval * misses plus a fraction of an interval.
                every: (t.keep_alive / 4).max(Duration::from_millis(10)),
                all,
                ring: None,
            }
        } else {
            Watch {
                every: t.keep_alive * RING_INTERVALS,
                all: Vec::new(),
                ring: beat.successor().map(|s| (s, fresh())),
            }
        }
    }

    async fn look(&mut self, beat: &Beat) {
        let now = std::time::Instant::now;
        let bound = beat.timing.keep_alive;
        if let Some((watched, live)) = &mut self.ring {
            let key = format!("r{}/hb/{watched}", beat.round);
            if let Ok(Ok(v)) = tokio::time::timeout(bound, beat.store.add(&key, 0)).await {
                if live.observe(v, now()) {
                    // Dead or left: either way watch the next one.
                    self.ring = beat.watched_stopped(*watched).await.map(|next| {
                        let t = beat.timing;
                        (next, Liveness::new(t.keep_alive, t.max_misses, now()))
                    });
                }
            }
            return;
        }
        let ranks: Vec<usize> = (0..self.all.len())
            .filter(|&m| self.all[m].is_some())
            .collect();
        if ranks.is_empty() {
            return;
        }
        let keys: Vec<String> = ranks
            .iter()
            .map(|m| format!("r{}/hb/{m}", beat.round))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let Ok(Ok(values)) = tokio::time::timeout(bound, beat.store.multi_get(&refs)).await else {
            return;
        };
        for (&m, v) in ranks.iter().zip(values) {
            let v: i64 = String::from_utf8_lossy(&v).parse().unwrap_or(0);
            let stopped = self.all[m]
                .as_mut()
                .is_some_and(|live| live.observe(v, now()));
            if stopped {
                if !beat.left(m).await {
                    beat.died(m).await;
                }
                self.all[m] = None;
            }
        }
    }
}
