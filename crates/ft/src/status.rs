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
}

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
    NotCommitted {
        step: i64,
        reason: String,
    },
    LighthouseLost {
        error: String,
    },
}

/// The status's writer and the events' sender.
pub(crate) struct Books {
    status: watch::Sender<Status>,
    events: broadcast::Sender<FtEvent>,
}

impl Books {
    pub(crate) fn new(replica_id: &str, lighthouse: &str) -> Books {
        let status = Status {
            replica_id: replica_id.to_owned(),
            lighthouse: lighthouse.to_owned(),
            ..Status::default()
        };
        Books {
            status: watch::Sender::new(status),
            events: broadcast::Sender::new(1024),
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

    pub(crate) fn report(&self, r: &Report) {
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
                    s.not_committed += 1;
                    s.last_not_committed_reason = Some(reason.clone());
                });
                self.emit(FtEvent::NotCommitted {
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
    fn joins_and_drops_are_counted_between_quorums() {
        let b = Books::new("a", "http://lh:1");
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
        let b = Books::new("a", "http://lh:1");
        let st = b.status();
        b.report(&Report::Heal {
            step: 3,
            bytes: 10,
            seconds: 0.5,
            sources: vec![],
        });
        b.report(&Report::NotCommitted {
            step: 4,
            reason: "nan".into(),
        });
        b.committed();
        let s = st.borrow().clone();
        assert_eq!((s.heals, s.heal_bytes, s.heal_seconds), (1, 10, 0.5));
        assert_eq!(s.not_committed, 1);
        assert_eq!(s.last_not_committed_reason.as_deref(), Some("nan"));
        assert_eq!(s.commits, 1);
    }
}
