//! Aborts and peers gone: a group's abort fails its ops from a sequence
//! number on, is marked in the hearers of the group (its shared memory),
//! passed to internal groups, recorded in the store and told to every
//! member (bounded); a peer gone fails what waits on it.
//!
//! What an abort sets off is decided in `abort/plan.rs`, without I/O; this
//! file carries it out.

mod plan;

use std::sync::Arc;

use tokio::sync::watch;
use tokio::time::{timeout, Instant};

use plan::{Admit, Effects, Record, Tell};

use super::router::Key;
use super::{lock, HearsAborts, Members, Origin, Shared, Telling, ABORT_DEADLINE};
use crate::error::Error;
use crate::frame::Header;

impl Shared {
    /// `hearer` hears group `comm`'s aborts and this rank's kill from now
    /// on (and those already in place, at once).
    pub fn add_hearer<H: HearsAborts + 'static>(&self, comm: u64, hearer: &Arc<H>) {
        // Registered first, so a kill or an abort racing with this sees it.
        let weak: std::sync::Weak<dyn HearsAborts> = Arc::downgrade(hearer) as _;
        let from = {
            let mut r = lock(&self.router);
            if let Some(g) = r.groups_mut().entry(comm) {
                g.hearer = Some(weak);
            }
            r.aborted_from(comm)
        };
        if self.is_dead() {
            hearer.killed();
        }
        if let Some(from) = from {
            hearer.aborted(from);
        }
    }

    /// Why `peer` is gone, if it is known to be.
    pub fn gone_reason(&self, peer: usize) -> Option<String> {
        lock(&self.router).gone(peer).cloned()
    }

    /// Marks `peer` gone and fails everything waiting on it.
    pub fn mark_gone(&self, peer: usize, reason: &str) {
        if lock(&self.router).mark_gone(peer, reason) {
            tracing::debug!(rank = self.cfg.rank, peer, "gone: {reason}");
        }
        self.flow_changed.notify_waiters();
    }

    /// The data frame at `key` was cut off by its connection breaking while
    /// its sender lived on: fails the receive for it (see [`Router::lose`](super::router::Router::lose)).
    pub(super) fn lose(&self, key: Key, reason: &str) {
        tracing::debug!(rank = self.cfg.rank, ?key, "a frame was cut off: {reason}");
        lock(&self.router).lose(key, reason);
    }

    /// A connection with `peer` broke while it lived on, where no frame was
    /// part-way: fails what may have been lost (see [`Router::lose_peer`](super::router::Router::lose_peer)).
    pub(super) fn lose_peer(&self, peer: usize, reason: &str) {
        tracing::debug!(rank = self.cfg.rank, peer, "a connection broke: {reason}");
        lock(&self.router).lose_peer(peer, reason);
    }

    /// Aborts group `comm` with `err` (the first abort wins): fails its
    /// waiters and wakes its sends, drops its mailbox, and tells the members
    /// this rank has a connection with (but not `sender`, which sent it).
    /// `from_seq`: the first collective it fails (see [`Router::abort`](super::router::Router::abort)).
    ///
    /// [`Origin::Here`]: this rank is where the failure happened (not
    /// passing on another's abort). The origin first records the reason in
    /// the store (`abort/<group>`), so a rank that later finds some member
    /// gone (one that exited on being told, say) reports the cause, not the
    /// bystander.
    ///
    /// The origin whose record is the store's first tells every member,
    /// opening connections as needed; other ranks tell only the members they
    /// have a connection with, so many ranks failing at once open O(n)
    /// connections, not n². A member not told learns when it next reaches an
    /// aborted rank: an aborted group answers every data frame and every new
    /// connection from a member with the abort.
    ///
    /// [`Origin::Leaving`]: calls found diverged, reported before their
    /// grace ended; told marked provisional and not recorded (see the
    /// variant).
    ///
    /// The telling runs in the background; [`Shared::told`] waits for it.
    pub fn abort(self: &Arc<Self>, comm: u64, err: Error, how: Origin, from_seq: u64) {
        let (done, told) = watch::channel(Telling::Recording);
        let (members, fx) = {
            let mut r = lock(&self.router);
            let members = r.groups().members(comm).cloned();
            let covered = r.aborted_for(comm, Some(from_seq)).is_some();
            match plan::admit(how, members.is_some(), covered) {
                Admit::Ignore => return,
                Admit::Unregistered(down) => {
                    r.abort(comm, err.clone(), from_seq);
                    self.queue_control(&mut r);
                    drop(r);
                    return self.pass_down(comm, &err, down, from_seq);
                }
                Admit::Apply => {}
            }
            // Admitted only when registered.
            let Some(members) = members else { return };
            let changed = r.abort(comm, err.clone(), from_seq);
            // The abort drops filed frames: their credit goes back, and a
            // peer out of credit may resume.
            self.queue_control(&mut r);
            let fx = plan::effects(how, changed);
            if fx.provisional {
                r.mark_provisional(comm);
            }
            if let Some(f) = fx.told_by {
                r.note_told(comm, f);
            }
            // Under the router's lock: the watch of the abort that won is
            // the one `told` waits for.
            if let Some(g) = r.groups_mut().entry(comm).filter(|_| fx.telling) {
                g.telling = Some(told);
            }
            (members, fx)
        };
        // Not taken (what is in place stays): nothing follows.
        if fx == Effects::default() {
            return;
        }
        tracing::debug!(
            rank = self.cfg.rank,
            comm,
            from = from_seq,
            ?how,
            "aborted: {err}"
        );
        if let Some(down) = fx.children {
            self.pass_down(comm, &err, down, from_seq);
        }
        // A killed rank writes nothing, in the region as in the store:
        // looked at here, after passing down and before either.
        let fx = if self.is_dead() { fx.killed() } else { fx };
        if let Some(h) = self.hearer(comm).filter(|_| fx.hearer) {
            h.aborted(from_seq);
        }
        if let Some(tell) = fx.tell {
            self.spawn_telling(comm, members, tell, done);
        }
    }

    /// What else hears group `comm`'s aborts, if anything does still.
    fn hearer(&self, comm: u64) -> Option<Arc<dyn HearsAborts>> {
        let r = lock(&self.router);
        r.groups().get(comm)?.hearer.as_ref()?.upgrade()
    }

    /// Records (an origin's) and tells group `comm`'s abort in the
    /// background, saying how far it has come on `done`.
    fn spawn_telling(
        self: &Arc<Self>,
        comm: u64,
        members: Members,
        tell: Tell,
        done: watch::Sender<Telling>,
    ) {
        let me = self.clone();
        // Aborts also run from destructors, possibly as the runtime shuts down;
        // spawning then is a no-op (and dropping `done` ends the waits).
        self.rt.spawn(async move {
            let record = match tell {
                Tell::RecordThenTell => me.record_abort(comm, &members).await,
                Tell::Connected => None,
            };
            let everyone = plan::tell_everyone(tell, record);
            let _ = done.send(Telling::Sending);
            let targets = plan::targets(&members.ranks, me.cfg.rank, everyone, |m| me.connected(m));
            let mut tasks = tokio::task::JoinSet::new();
            for m in targets {
                let me = me.clone();
                tasks.spawn(async move { me.tell_abort(comm, m).await });
            }
            while tasks.join_next().await.is_some() {}
            let _ = done.send(Telling::Sent);
        });
    }

    /// Passes group `comm`'s abort (already in place here) on to its
    /// internal groups, as `how` ([`plan::passed_down`]); each member also
    /// passes on its own.
    pub(super) fn pass_down(self: &Arc<Self>, comm: u64, err: &Error, how: Origin, from_seq: u64) {
        let children = lock(&self.router)
            .groups()
            .get(comm)
            .map(|g| g.children.clone());
        for c in children.iter().flatten() {
            let from = c.abort_from(from_seq);
            self.abort(c.comm, err.clone(), how, from);
        }
    }

    /// Waits (within [`ABORT_DEADLINE`]) until group `comm`'s abort has been
    /// recorded and told, for a rank that must not return its error (and
    /// perhaps exit) before.
    ///
    /// The record is always waited for (its write has its own deadline): a
    /// rank that exits before it leaves the others nothing to find.
    pub async fn told(&self, comm: u64) {
        let Some(mut told) = self.telling(comm) else {
            return;
        };
        // Recording is bounded by `record_abort`'s own deadline; this wait
        // has one too, so that no failing op can outlive it by more.
        let _ = timeout(
            ABORT_DEADLINE * 2,
            told.wait_for(|t| *t != Telling::Recording),
        )
        .await;
        let _ = timeout(ABORT_DEADLINE, told.wait_for(|t| *t == Telling::Sent)).await;
    }

    /// How far the telling of group `comm`'s abort has come, if it is
    /// aborted here.
    fn telling(&self, comm: u64) -> Option<tokio::sync::watch::Receiver<Telling>> {
        lock(&self.router).groups().get(comm)?.telling.clone()
    }

    /// The text an abort frame of `comm` carries: the reason alone, which the
    /// receiver wraps in its own [`Error::Aborted`].
    pub(super) fn abort_reason(&self, comm: u64) -> Option<(String, bool, u64, bool)> {
        let (err, from, provisional) = {
            let r = lock(&self.router);
            (
                r.aborted(comm)?.clone(),
                r.aborted_from(comm)?,
                r.aborted_provisional(comm),
            )
        };
        let members = self.members(comm)?;
        let own = matches!(&err, Error::Aborted { by: Some(r), .. } if *r == members.group_rank(self.cfg.rank));
        let reason = match err {
            Error::Aborted { reason, .. } => reason.to_string(),
            e => e.to_string(),
        };
        Some((reason, own, from, provisional))
    }

    /// Writes the abort of `comm` to `peer`, once.
    pub(super) async fn tell_abort(self: &Arc<Self>, comm: u64, peer: usize) {
        if self.is_dead() || !lock(&self.router).note_told(comm, peer) {
            return;
        }
        let told = self.try_tell_abort(comm, peer).await;
        tracing::debug!(rank = self.cfg.rank, comm, peer, told, "telling the abort");
        if !told {
            // Not written: its next contact with us tells it.
            lock(&self.router).unnote_told(comm, peer);
        }
    }

    pub(super) async fn try_tell_abort(self: &Arc<Self>, comm: u64, peer: usize) -> bool {
        // The record first (an origin's), so that a peer that exits on being
        // told cannot leave a third rank with nothing to find.
        let recording = self.telling(comm);
        if let Some(mut r) = recording {
            let _ = r.wait_for(|t| *t != Telling::Recording).await;
        }
        let Some((reason, own, from, provisional)) = self.abort_reason(comm) else {
            return false;
        };
        let h = Header::Abort {
            comm,
            len: reason.len().min(crate::frame::MAX_REASON as usize) as u64,
            own,
            from,
            provisional,
        };
        let bytes = &reason.as_bytes()[..h.payload_len() as usize];
        let deadline = Instant::now() + ABORT_DEADLINE;
        // A member that has not published its address never joined: there is
        // nothing to tell yet (when it connects, the abort is its answer).
        if !self.connected(peer) && !self.published(peer).await {
            return false;
        }
        self.send_frame(peer, &h, bytes, 0, deadline).await.is_ok()
    }

    /// Tells `peer` of every aborted group it is a member of (a new
    /// connection, or a data frame for an aborted group).
    pub(super) fn tell_aborts_to(self: &Arc<Self>, peer: usize, only: Option<u64>) {
        let comms: Vec<u64> = {
            let r = lock(&self.router);
            r.aborted_groups()
                .into_iter()
                .filter(|&c| only.is_none_or(|o| o == c) && !r.was_told(c, peer))
                .collect()
        };
        for comm in comms {
            if self.members(comm).is_some_and(|m| m.ranks.contains(&peer)) {
                let me = self.clone();
                self.rt
                    .spawn(async move { me.tell_abort(comm, peer).await });
            }
        }
    }

    /// The key of group `comm`'s abort record in the store.
    pub(super) fn record_key(comm: u64) -> String {
        format!("abort/{comm:016x}")
    }

    /// Records the abort of `comm` in the store (the first record wins),
    /// within [`ABORT_DEADLINE`]; `None` when there is no abort to record.
    pub(super) async fn record_abort(&self, comm: u64, members: &Members) -> Option<Record> {
        let (reason, ..) = self.abort_reason(comm)?;
        let text = format!(
            "rank {} aborted it: {reason}",
            members.group_rank(self.cfg.rank)
        );
        let key = Self::record_key(comm);
        let store = self.store();
        let write = store.compare_set(&key, b"", text.as_bytes());
        Some(match timeout(ABORT_DEADLINE, write).await {
            Ok(Ok(now)) => {
                let first = now == text.as_bytes();
                tracing::debug!(rank = self.cfg.rank, comm, first, "recorded the abort");
                if first {
                    Record::First
                } else {
                    Record::Second
                }
            }
            Ok(Err(e)) => {
                tracing::debug!("recording the abort in the store failed: {e}");
                Record::Unknown
            }
            Err(_) => {
                tracing::debug!("recording the abort in the store took over {ABORT_DEADLINE:?}");
                Record::Unknown
            }
        })
    }

    /// Group `comm`'s abort record in the store, if some rank wrote one
    /// (looked up within [`ABORT_DEADLINE`]).
    pub async fn abort_record(&self, comm: u64) -> Option<String> {
        let key = Self::record_key(comm);
        let got = timeout(ABORT_DEADLINE, async {
            if self.store().check(&[&key]).await.ok()? {
                self.store().get_now(&key).await.ok()
            } else {
                None
            }
        })
        .await
        .ok()??;
        Some(String::from_utf8_lossy(&got).into_owned())
    }
}
