//! The board that `/v1/watch` long-polls read: which quorum is current, which
//! was the first this service issued, and which quorums lost a member while
//! they were current. The service updates it under the machine's lock as it
//! carries out `Issue` and `Abort`; each watcher holds a receiver of a
//! `tokio::sync::watch` channel over it and re-reads [`Board::answer`] at
//! every change until it has an answer or its `timeout_ms` runs out (`204`).
//!
//! The answers (the wire format of the endpoint, for `ProcessGroupRally`):
//!
//! | when | answer |
//! |---|---|
//! | a member of `Q` was dropped while `Q` was current | `{"quorum_id":Q,"event":"dropped","replica_id":..,"reason":..}` |
//! | `Q` is older than the current quorum (and lost no member while current) | `{"quorum_id":Q,"event":"superseded","current":Q2}` |
//! | a replica told this restarted service of its last quorum, and `Q` is older than this service's first | `{"quorum_id":Q,"event":"dropped",..}`: the replica left `Q`'s generation |
//! | this service never issued `Q` (it restarted, or `Q` is from the future) | `{"quorum_id":Q,"event":"unknown"}` |
//! | `Q` is current and whole | nothing yet: wait |
//!
//! A drop recorded for `Q` is answered even after a newer quorum replaced `Q`
//! (in one machine step a member's drop can abort `Q` and issue `Q+1`): a
//! watcher still on `Q` has a dead peer in its generation, so aborting it is
//! right, and harmless if it had already moved on.

use std::collections::BTreeMap;

/// Drop records kept, newest first out of the window: far more than the
/// quorums a watcher can lag behind.
const DROPS_KEPT: usize = 64;

/// What the watchers see.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Board {
    /// The last quorum issued.
    pub current: Option<i64>,
    /// The first quorum this service issued (older ids are another
    /// incarnation's).
    pub first: Option<i64>,
    /// The first drop of a member of each recent quorum while it was current.
    pub dropped: BTreeMap<i64, Lost>,
    /// A replica left the predecessor's generations (a restarted service
    /// heard its memory, see `machine::Action::AbortPredecessor`): every
    /// quorum this service did not issue is answered as dropped.
    pub predecessor_over: Option<Lost>,
}

/// A member dropped from a quorum.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lost {
    /// Who.
    pub replica_id: String,
    /// Why (the machine's words: session closed, heartbeat silent for ...).
    pub reason: String,
}

/// A watcher's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// A member of the quorum was dropped: abort its generation.
    Dropped {
        quorum_id: i64,
        replica_id: String,
        reason: String,
    },
    /// A newer quorum exists; no abort wanted.
    Superseded { quorum_id: i64, current: i64 },
    /// This service never issued the quorum; no abort wanted.
    Unknown { quorum_id: i64 },
}

impl Board {
    /// A quorum was issued.
    pub fn issued(&mut self, quorum_id: i64) {
        self.current = Some(quorum_id);
        self.first.get_or_insert(quorum_id);
    }

    /// A member of quorum `quorum_id` was dropped while it was current. The
    /// first drop is the one reported.
    pub fn aborted(&mut self, quorum_id: i64, replica_id: &str, reason: &str) {
        self.dropped.entry(quorum_id).or_insert_with(|| Lost {
            replica_id: replica_id.to_owned(),
            reason: reason.to_owned(),
        });
        while self.dropped.len() > DROPS_KEPT {
            self.dropped.pop_first();
        }
    }

    /// The answer for a watcher of `quorum_id`, or `None` to keep waiting.
    pub fn answer(&self, quorum_id: i64) -> Option<Answer> {
        if let Some(d) = self.dropped.get(&quorum_id) {
            return Some(Answer::Dropped {
                quorum_id,
                replica_id: d.replica_id.clone(),
                reason: d.reason.clone(),
            });
        }
        if let Some(d) = &self.predecessor_over {
            if self.first.is_none_or(|first| quorum_id < first) {
                return Some(Answer::Dropped {
                    quorum_id,
                    replica_id: d.replica_id.clone(),
                    reason: d.reason.clone(),
                });
            }
        }
        match (self.first, self.current) {
            (Some(first), Some(current)) if (first..current).contains(&quorum_id) => {
                Some(Answer::Superseded { quorum_id, current })
            }
            (_, Some(current)) if current == quorum_id => None,
            _ => Some(Answer::Unknown { quorum_id }),
        }
    }
}

impl Answer {
    /// The JSON body of the `200` answer.
    pub fn to_json(&self) -> String {
        let v = match self {
            Answer::Dropped {
                quorum_id,
                replica_id,
                reason,
            } => serde_json::json!({
                "quorum_id": quorum_id, "event": "dropped",
                "replica_id": replica_id, "reason": reason,
            }),
            Answer::Superseded { quorum_id, current } => serde_json::json!({
                "quorum_id": quorum_id, "event": "superseded", "current": current,
            }),
            Answer::Unknown { quorum_id } => {
                serde_json::json!({"quorum_id": quorum_id, "event": "unknown"})
            }
        };
        v.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_follow_the_board() {
        let mut b = Board::default();
        assert_eq!(b.answer(5), Some(Answer::Unknown { quorum_id: 5 }));
        b.issued(10);
        assert_eq!(b.answer(10), None, "current and whole: wait");
        assert_eq!(b.answer(9), Some(Answer::Unknown { quorum_id: 9 }));
        assert_eq!(b.answer(11), Some(Answer::Unknown { quorum_id: 11 }));
        b.issued(11);
        assert_eq!(
            b.answer(10),
            Some(Answer::Superseded {
                quorum_id: 10,
                current: 11
            })
        );
        b.aborted(11, "r1", "session closed");
        b.aborted(11, "r2", "later drop, not reported");
        let dropped = Answer::Dropped {
            quorum_id: 11,
            replica_id: "r1".into(),
            reason: "session closed".into(),
        };
        assert_eq!(b.answer(11), Some(dropped.clone()));
        b.issued(12);
        assert_eq!(b.answer(11), Some(dropped), "a drop outlives its quorum");
    }

    /// Once a replica told a restarted service of its last quorum, every
    /// quorum of the predecessor is answered as dropped (its watchers are
    /// waiting on a member that left), never this service's own.
    #[test]
    fn a_predecessor_left_is_answered_as_dropped() {
        let mut b = Board::default();
        let lost = Lost {
            replica_id: "r1".into(),
            reason: "asked for a new quorum".into(),
        };
        b.predecessor_over = Some(lost);
        let dropped = |q| Answer::Dropped {
            quorum_id: q,
            replica_id: "r1".into(),
            reason: "asked for a new quorum".into(),
        };
        assert_eq!(b.answer(5), Some(dropped(5)), "before this service's first");
        b.issued(100);
        assert_eq!(b.answer(99), Some(dropped(99)));
        assert_eq!(b.answer(100), None, "its own current quorum: wait");
        b.issued(101);
        assert_eq!(
            b.answer(100),
            Some(Answer::Superseded {
                quorum_id: 100,
                current: 101
            })
        );
    }

    #[test]
    fn drop_records_are_bounded() {
        let mut b = Board::default();
        for q in 0..(DROPS_KEPT as i64 + 10) {
            b.issued(q);
            b.aborted(q, "r", "x");
        }
        assert_eq!(b.dropped.len(), DROPS_KEPT);
    }

    #[test]
    fn json_is_the_endpoint_format() {
        let a = Answer::Superseded {
            quorum_id: 3,
            current: 4,
        };
        let v: serde_json::Value = serde_json::from_str(&a.to_json()).unwrap();
        assert_eq!(v["event"], "superseded");
        assert_eq!(v["current"], 4);
    }
}
