//! The manager's status and events, for `rally run`'s `/status`,
//! `/metrics` and event log: [`Status`] on a `tokio::sync::watch`, and
//! [`FtEvent`]s on a broadcast channel. `Books` keeps both from what the
//! server saw (issued quorums, reports, votes, the lighthouse link).

use serde::Serialize;
use tokio::sync::{broadcast, watch};

use crate::wire::Report;

/// The manager's state, as last seen.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Status {
    pub replica_id: String,
    /// The lighthouse's `http://host:port`.
    pub lighthouse: String,
    /// The last heartbeat got through.
    pub connected: bool,
    pub quorum_id: Option<i64>,
    /// The last quorum's replica ids, sorted.
    pub members: Vec<String>,
    pub max_step: i64,
    /// Steps the group's ranks all voted to commit.
    pub commits: u64,
    /// Steps reported not committed.
    pub not_committed: u64,
    pub last_not_committed_reason: Option<String>,
    /// Members that came between consecutive quorums.
    pub joins: u64,
    /// Members gone between consecutive quorums.
    pub drops: u64,
    /// Heals reported, with their bytes and seconds.
    pub heals: u64,
    pub heal_bytes: u64,
    pub heal_seconds: f64,
    pub last_error: Option<String>,
    /// Set once the lighthouse has refused this group's id for its grace
    /// (`Config::id_held_grace`) on end: another live group has it. Fatal
    /// for the run (`rally run --ft` stops on it).
    pub id_refused: Option<String>,
}

/// The default of how long the lighthouse may refuse this group's id
/// ("held by another live process") before the group takes it for another
/// live group's: above `rally lighthouse`'s default heartbeat timeout
/// (1 s), since when a group's host died and the group came back at once,
/// the old holder counts as live that long (`rally run` sets it from the
/// lighthouse's own timeout).
pub const ID_HELD_GRACE: std::time::Duration = std::time::Duration::from_millis(2500);

/// Something the agent shows.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum FtEvent {
    /// A quorum with a new id.
    Quorum {
        id: i64,
        members: Vec<String>,
    },
    Joined {
        replica: String,
    },
    Dropped {
        replica: String,
    },
    Heal {
        step: i64,
        bytes: u64,
        seconds: f64,
    },
    /// A rank's step not committed (each rank reports its own reason).
    NotCommitted {
        rank: usize,
        step: i64,
        reason: String,
    },
    LighthouseLost {
        error: String,
    },
    /// The lighthouse refused this group's id for its grace
    /// (`Config::id_held_grace`): another live group has it.
    IdRefused {
        reason: String,
    },
}

/// The status's writer and the events' sender.
pub(crate) struct Books {
    status: watch::Sender<Status>,
    events: broadcast::Sender<FtEvent>,
    /// Since when every quorum call was refused "held" (none issued since).
    held_since: std::cell::Cell<Option<std::time::Instant>>,
    held_grace: std::time::Duration,
}

impl Books {
    pub(crate) fn new(
        replica_id: &str,
        lighthouse: &str,
        held_grace: std::time::Duration,
    ) -> Books {
        let status = Status {
            replica_id: replica_id.to_owned(),
            lighthouse: lighthouse.to_owned(),
            ..Status::default()
        };
        Books {
            status: watch::Sender::new(status),
            events: broadcast::Sender::new(1024),
            held_since: std::cell::Cell::new(None),
            held_grace,
        }
    }

    pub(crate) fn status(&self) -> watch::Receiver<Status> {
        self.status.subscribe()
    }

    pub(crate) fn events(&self) -> broadcast::Sender<FtEvent> {
        self.events.clone()
    }

    fn emit(&self, e: FtEvent) {
        // No receiver is fine: nobody is watching.
        let _ = self.events.send(e);
    }

    /// An issued quorum: its id, members and max step; joins and drops
    /// against the previous one.
    pub(crate) fn quorum(&self, id: i64, mut members: Vec<String>, max_step: i64) {
        self.held_since.set(None);
        members.sort();
        let mut events = Vec::new();
        self.status.send_modify(|s| {
            s.max_step = max_step;
            if s.quorum_id == Some(id) {
                return;
            }
            if s.quorum_id.is_some() {
                for m in members.iter().filter(|m| !s.members.contains(m)) {
                    s.joins += 1;
                    events.push(FtEvent::Joined { replica: m.clone() });
                }
                for m in s.members.iter().filter(|m| !members.contains(m)) {
                    s.drops += 1;
                    events.push(FtEvent::Dropped { replica: m.clone() });
                }
            }
            s.quorum_id = Some(id);
            s.members = members.clone();
            events.insert(
                0,
                FtEvent::Quorum {
                    id,
                    members: members.clone(),
                },
            );
        });
        for e in events {
            self.emit(e);
        }
    }

    /// Group rank `rank`'s report. A step not committed is counted once,
    /// at rank 0's report (as commits are), every rank's reason kept.
    pub(crate) fn report(&self, rank: usize, r: &Report) {
        match r {
            Report::Heal {
                step,
                bytes,
                seconds,
                ..
            } => {
                self.status.send_modify(|s| {
                    s.heals += 1;
                    s.heal_bytes += bytes;
                    s.heal_seconds += seconds;
                });
                self.emit(FtEvent::Heal {
                    step: *step,
                    bytes: *bytes,
                    seconds: *seconds,
                });
            }
            Report::NotCommitted { step, reason } => {
                self.status.send_modify(|s| {
                    s.not_committed += u64::from(rank == 0);
                    s.last_not_committed_reason = Some(reason.clone());
                });
                self.emit(FtEvent::NotCommitted {
                    rank,
                    step: *step,
                    reason: reason.clone(),
                });
            }
        }
    }

    pub(crate) fn committed(&self) {
        self.status.send_modify(|s| s.commits += 1);
    }

    pub(crate) fn error(&self, e: &str) {
        self.status
            .send_modify(|s| s.last_error = Some(e.to_owned()));
    }

    pub(crate) fn connected(&self, up: bool) {
        self.status
            .send_if_modified(|s| std::mem::replace(&mut s.connected, up) != up);
    }

    /// A quorum call refused at `now`: another live process holds the id.
    /// Once that has lasted the grace without a quorum issued or the
    /// workers stopped in between, the id is taken for another live
    /// group's, for good.
    pub(crate) fn id_held(&self, message: &str, now: std::time::Instant) {
        let since = self.held_since.get().unwrap_or(now);
        self.held_since.set(Some(since));
        if now.duration_since(since) < self.held_grace {
            return;
        }
        let reason = {
            let s = self.status.borrow();
            if s.id_refused.is_some() {
                return;
            }
            format!(
                "the lighthouse {} refused replica group {:?} for {:.1} s: {message}; \
                 another live group has this id (each live group needs its own)",
                s.lighthouse,
                s.replica_id,
                now.duration_since(since).as_secs_f64()
            )
        };
        self.status
            .send_modify(|s| s.id_refused = Some(reason.clone()));
        self.emit(FtEvent::IdRefused { reason });
    }

    /// The workers stopped: refusals so far do not count.
    pub(crate) fn id_not_held(&self) {
        self.held_since.set(None);
    }

    pub(crate) fn lost(&self, error: String) {
        self.status.send_modify(|s| {
            s.connected = false;
            s.last_error = Some(error.clone());
        });
        self.emit(FtEvent::LighthouseLost { error });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_refused_for_the_grace_is_fatal_once_and_a_quorum_between_resets_it() {
        let b = Books::new("g7", "http://lh:1", ID_HELD_GRACE);
        let st = b.status();
        let mut ev = b.events().subscribe();
        let t0 = std::time::Instant::now();
        b.id_held("held by manager m:1", t0);
        b.id_held("held by manager m:1", t0 + ID_HELD_GRACE / 2);
        // A quorum issued in between: the refusals were a passing race;
        // so are refusals before the workers stopped.
        b.quorum(1, vec!["g7".into()], 0);
        b.id_held("held by manager m:1", t0);
        b.id_not_held();
        b.id_held("held by manager m:1", t0 + ID_HELD_GRACE);
        assert_eq!(st.borrow().id_refused, None);
        b.id_held("held by manager m:1", t0 + ID_HELD_GRACE * 2);
        let reason = st.borrow().id_refused.clone().expect("fatal");
        assert!(
            reason.contains("\"g7\"")
                && reason.contains("held by manager m:1")
                && reason.contains("http://lh:1"),
            "{reason}"
        );
        b.id_held("held by manager m:1", t0 + ID_HELD_GRACE * 3);
        let events: Vec<FtEvent> = std::iter::from_fn(|| ev.try_recv().ok()).collect();
        let refused = events
            .iter()
            .filter(|e| matches!(e, FtEvent::IdRefused { .. }))
            .count();
        assert_eq!(refused, 1, "{events:?}");
    }

    #[test]
    fn joins_and_drops_are_counted_between_quorums() {
        let b = Books::new("a", "http://lh:1", ID_HELD_GRACE);
        let st = b.status();
        let mut ev = b.events().subscribe();
        b.quorum(1, vec!["b".into(), "a".into()], 3);
        b.quorum(1, vec!["a".into(), "b".into()], 4);
        b.quorum(2, vec!["a".into(), "c".into()], 5);
        let s = st.borrow().clone();
        assert_eq!(
            (s.quorum_id, s.max_step, s.joins, s.drops),
            (Some(2), 5, 1, 1)
        );
        assert_eq!(s.members, ["a", "c"]);
        let got: Vec<FtEvent> = std::iter::from_fn(|| ev.try_recv().ok()).collect();
        assert_eq!(
            got,
            [
                FtEvent::Quorum {
                    id: 1,
                    members: vec!["a".into(), "b".into()]
                },
                FtEvent::Quorum {
                    id: 2,
                    members: vec!["a".into(), "c".into()]
                },
                FtEvent::Joined {
                    replica: "c".into()
                },
                FtEvent::Dropped {
                    replica: "b".into()
                },
            ]
        );
    }

    #[test]
    fn reports_are_counted() {
        let b = Books::new("a", "http://lh:1", ID_HELD_GRACE);
        let st = b.status();
        b.report(
            0,
            &Report::Heal {
                step: 3,
                bytes: 10,
                seconds: 0.5,
                sources: vec![],
            },
        );
        // A group of two: both ranks report the step; it counts once.
        for (rank, reason) in [(1, "rank 1's nan"), (0, "nan")] {
            b.report(
                rank,
                &Report::NotCommitted {
                    step: 4,
                    reason: reason.into(),
                },
            );
        }
        b.committed();
        let s = st.borrow().clone();
        assert_eq!((s.heals, s.heal_bytes, s.heal_seconds), (1, 10, 0.5));
        assert_eq!(s.not_committed, 1, "one step, counted once");
        assert_eq!(s.last_not_committed_reason.as_deref(), Some("nan"));
        assert_eq!(s.commits, 1);
    }
}
