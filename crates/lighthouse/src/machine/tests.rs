//! Tables of the machine's transitions: events in, actions out.
//!
//! Each case is a list of steps: the moment (ms after the start), the event,
//! and the actions expected, each written as a short line (`issue 101
//! [a,b]`, `refuse s2 a`, `abort 101 b`, `dropped b`), in order.

use std::time::Duration;

use super::*;
use crate::quorum::tests::member;

/// An event of a table, in short.
#[derive(Clone, Copy, Debug)]
enum Ev {
    /// `Join` from session `.0` for replica `.1`.
    Join(Session, &'static str),
    /// `Join` with shrink_only.
    JoinShrink(Session, &'static str),
    /// `Join` reporting a commit failure.
    JoinFailed(Session, &'static str),
    /// `Join` from another process (another manager address) with the id.
    JoinOther(Session, &'static str),
    /// `Heartbeat` from session `.0` for replica `.1`.
    Beat(Session, &'static str),
    /// The `Quorum` call of replica `.1` on session `.0` ended unanswered
    /// (the client gave up: a cancelled call, its deadline).
    Left(Session, &'static str),
    Closed(Session),
    /// A connection `.0` accepted from host `10.0.0..1`.
    Opened(Session, u8),
    /// A request over `.0` that speaks for no replica (HTTP).
    Spoke(Session),
    Tick,
}

fn event(ev: Ev) -> Event {
    let join = |session, id, f: fn(&mut Member)| {
        let mut member = member(id);
        f(&mut member);
        Event::Join {
            session,
            member,
            remembered: None,
        }
    };
    match ev {
        Ev::Join(s, id) => join(s, id, |_| {}),
        Ev::JoinShrink(s, id) => join(s, id, |m| m.shrink_only = true),
        Ev::JoinFailed(s, id) => join(s, id, |m| m.commit_failures = 1),
        Ev::JoinOther(s, id) => join(s, id, |m| m.address = format!("{}-other", m.address)),
        Ev::Beat(session, id) => Event::Heartbeat {
            session,
            replica_id: id.to_owned(),
        },
        Ev::Left(session, id) => Event::Left {
            session,
            replica_id: id.to_owned(),
        },
        Ev::Closed(session) => Event::Closed { session },
        Ev::Opened(session, host) => Event::Opened {
            session,
            peer: std::net::Ipv4Addr::new(10, 0, 0, host).into(),
        },
        Ev::Spoke(session) => Event::Spoke { session },
        Ev::Tick => Event::Tick,
    }
}

/// An action in short.
fn line(a: &Action) -> String {
    match a {
        Action::Issue(q) => {
            let ids: Vec<&str> = q
                .participants
                .iter()
                .map(|m| m.replica_id.as_str())
                .collect();
            format!("issue {} [{}]", q.id, ids.join(","))
        }
        Action::Refuse {
            session,
            replica_id,
            ..
        } => format!("refuse s{session} {replica_id}"),
        Action::Abort {
            quorum_id,
            replica_id,
            ..
        } => format!("abort {quorum_id} {replica_id}"),
        Action::Dropped { replica_id, .. } => format!("dropped {replica_id}"),
        Action::AbortPredecessor { replica_id, .. } => format!("abort predecessor {replica_id}"),
    }
}

struct Case {
    name: &'static str,
    min_replicas: u64,
    join_timeout_ms: u64,
    /// (ms, event, expected actions)
    steps: &'static [(u64, Ev, &'static [&'static str])],
}

/// Heartbeat timeout of every case: 1 s (`Knobs::ours`).
const CASES: &[Case] = &[
    Case {
        name: "two joins make a quorum; ids start above first_id",
        min_replicas: 2,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Join(1, "a"), &[]),
            (10, Ev::Join(2, "b"), &["issue 101 [a,b]"]),
        ],
    },
    Case {
        name: "a heartbeat from a replica never seen is fine",
        min_replicas: 1,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Beat(1, "a"), &[]),
            (0, Ev::Join(1, "a"), &["issue 101 [a]"]),
        ],
    },
    Case {
        name: "a second live process with a replica id is refused; the first keeps it",
        min_replicas: 2,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Join(1, "a"), &[]),
            (0, Ev::JoinOther(2, "a"), &["refuse s2 a"]),
            (0, Ev::Closed(2), &[]),
            (0, Ev::Join(3, "b"), &["issue 101 [a,b]"]),
        ],
    },
    Case {
        // torchft's manager replaces its client after a failed call: for a
        // while one process speaks over two connections.
        name: "one process over two sessions keeps its id until the last closes",
        min_replicas: 1,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Join(1, "a"), &["issue 101 [a]"]),
            (10, Ev::Beat(2, "a"), &[]),
            (20, Ev::Join(2, "a"), &["issue 101 [a]"]),
            (30, Ev::Closed(1), &[]),
            (40, Ev::Beat(2, "a"), &[]),
            (50, Ev::Closed(2), &["abort 101 a", "dropped a"]),
        ],
    },
    Case {
        // torchft's manager, after a failed call, connects anew and then
        // drops its old client: the old connection may end first.
        name: "a replica whose process replaced its connection is adopted by the new one",
        min_replicas: 1,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Opened(1, 1), &[]),
            (0, Ev::Join(1, "a"), &["issue 101 [a]"]),
            (10, Ev::Opened(2, 1), &[]),
            (20, Ev::Closed(1), &[]),
            (30, Ev::Beat(2, "a"), &[]),
            (40, Ev::Join(2, "a"), &["issue 101 [a]"]),
            (1030, Ev::Tick, &[]),
            (1050, Ev::Closed(2), &["abort 101 a", "dropped a"]),
        ],
    },
    Case {
        name: "an orphan is dropped when the fresh session from its host speaks for another",
        min_replicas: 1,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Opened(1, 1), &[]),
            (0, Ev::Join(1, "a"), &["issue 101 [a]"]),
            (10, Ev::Opened(2, 1), &[]),
            (10, Ev::Opened(3, 1), &[]),
            (20, Ev::Closed(1), &[]),
            (30, Ev::Beat(2, "b"), &[]),
            (40, Ev::Spoke(3), &["abort 101 a", "dropped a"]),
            (50, Ev::Join(2, "b"), &["issue 102 [b]"]),
        ],
    },
    Case {
        name: "an orphan is dropped when the fresh session from its host closes unspoken",
        min_replicas: 1,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Opened(1, 1), &[]),
            (0, Ev::Join(1, "a"), &["issue 101 [a]"]),
            (10, Ev::Opened(2, 1), &[]),
            (20, Ev::Closed(1), &[]),
            (30, Ev::Closed(2), &["abort 101 a", "dropped a"]),
        ],
    },
    Case {
        name: "an orphan whose fresh session stays silent goes at its heartbeat timeout",
        min_replicas: 1,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Opened(1, 1), &[]),
            (0, Ev::Join(1, "a"), &["issue 101 [a]"]),
            (10, Ev::Opened(2, 1), &[]),
            (20, Ev::Closed(1), &[]),
            (999, Ev::Tick, &[]),
            (1000, Ev::Tick, &["abort 101 a", "dropped a"]),
            // Not a stalled process: a heartbeat later is a new holder.
            (1010, Ev::Beat(2, "a"), &[]),
            (1020, Ev::Closed(2), &["abort 101 a", "dropped a"]),
        ],
    },
    Case {
        name: "a fresh session from another host, or an old one, delays no drop",
        min_replicas: 1,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Opened(1, 1), &[]),
            (0, Ev::Opened(2, 2), &[]),
            (0, Ev::Opened(3, 1), &[]),
            (0, Ev::Spoke(3), &[]),
            (0, Ev::Join(1, "a"), &["issue 101 [a]"]),
            (20, Ev::Closed(1), &["abort 101 a", "dropped a"]),
        ],
    },
    Case {
        name: "a closed session drops its replicas at once, aborting the current quorum",
        min_replicas: 1,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Beat(1, "a"), &[]),
            (0, Ev::Beat(1, "b"), &[]),
            (0, Ev::Join(2, "c"), &[]),
            (0, Ev::Join(1, "a"), &[]),
            (0, Ev::Join(1, "b"), &["issue 101 [a,b,c]"]),
            (
                5,
                Ev::Closed(1),
                &["abort 101 a", "dropped a", "abort 101 b", "dropped b"],
            ),
            (5, Ev::Join(2, "c"), &["issue 102 [c]"]),
        ],
    },
    Case {
        name: "a closed session of a replica waiting outside the quorum: dropped, no abort",
        min_replicas: 1,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Join(1, "a"), &["issue 101 [a]"]),
            (1, Ev::Beat(2, "b"), &[]),
            (1, Ev::Closed(2), &["dropped b"]),
            (2, Ev::Closed(7), &[]),
        ],
    },
    Case {
        name: "a silent replica is dropped at the tick that sees it",
        min_replicas: 1,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Beat(2, "b"), &[]),
            (0, Ev::Join(1, "a"), &[]),
            (0, Ev::Join(2, "b"), &["issue 101 [a,b]"]),
            (500, Ev::Beat(1, "a"), &[]),
            (999, Ev::Tick, &[]),
            (1000, Ev::Tick, &["abort 101 b", "dropped b"]),
            (1100, Ev::Join(1, "a"), &["issue 102 [a]"]),
        ],
    },
    Case {
        name: "a stopped process that resumes is revived with its waiting call",
        min_replicas: 2,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Join(1, "a"), &[]),
            (1000, Ev::Tick, &["dropped a"]),
            (1500, Ev::Join(2, "b"), &[]),
            (1600, Ev::Beat(1, "a"), &["issue 101 [a,b]"]),
        ],
    },
    Case {
        name: "a silent replica's id taken by another process: the old call and its later beats are refused",
        min_replicas: 2,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Join(1, "a"), &[]),
            (1000, Ev::Tick, &["dropped a"]),
            (1100, Ev::JoinOther(3, "a"), &["refuse s1 a"]),
            (1200, Ev::Beat(1, "a"), &["refuse s1 a"]),
            (1300, Ev::Join(2, "b"), &["issue 101 [a,b]"]),
        ],
    },
    Case {
        // Review item 4: torchft reconfigures only on a new id, so a quorum
        // issued again under an aborted id would leave every member on the
        // aborted generation.
        name: "after an abort of the current quorum, the next quorum gets a new id, even with the same members and no commit failure",
        min_replicas: 2,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Join(1, "a"), &[]),
            (0, Ev::Join(2, "b"), &["issue 101 [a,b]"]),
            (500, Ev::Beat(1, "a"), &[]),
            (1000, Ev::Tick, &["abort 101 b", "dropped b"]),
            // b's process resumes before the next round.
            (1100, Ev::Beat(2, "b"), &[]),
            (1200, Ev::Join(1, "a"), &[]),
            (1200, Ev::Join(2, "b"), &["issue 102 [a,b]"]),
            // The quorum after that, unaborted, keeps its id again.
            (1300, Ev::Join(1, "a"), &[]),
            (1300, Ev::Join(2, "b"), &["issue 102 [a,b]"]),
        ],
    },
    Case {
        // Review item 6: a call that ended is no participant; issuing it
        // would make the others wait on a member that never hears of it.
        name: "a Quorum call that ended unanswered is no longer a participant",
        min_replicas: 1,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Beat(2, "b"), &[]),
            // a alone is a minority of the two healthy: it waits.
            (0, Ev::Join(1, "a"), &[]),
            (10, Ev::Left(1, "a"), &[]),
            // b alone is a minority too: a's ended call does not count.
            (20, Ev::Join(2, "b"), &[]),
            (30, Ev::Join(1, "a"), &["issue 101 [a,b]"]),
        ],
    },
    Case {
        name: "a call left on one session leaves the same process's call on another waiting",
        min_replicas: 1,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Beat(2, "b"), &[]),
            (0, Ev::Join(1, "a"), &[]),
            (10, Ev::Join(3, "a"), &[]),
            (20, Ev::Left(1, "a"), &[]),
            (30, Ev::Left(9, "a"), &[]),
            (40, Ev::Join(2, "b"), &["issue 101 [a,b]"]),
        ],
    },
    Case {
        name: "a stalled replica whose call ended is revived without it",
        min_replicas: 2,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Join(1, "a"), &[]),
            (1000, Ev::Tick, &["dropped a"]),
            (1200, Ev::Left(1, "a"), &[]),
            (1500, Ev::Join(2, "b"), &[]),
            (1600, Ev::Beat(1, "a"), &[]),
            (1700, Ev::Join(1, "a"), &["issue 101 [a,b]"]),
        ],
    },
    Case {
        name: "same members keep the id (fast quorum); a commit failure raises it",
        min_replicas: 2,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Join(1, "a"), &[]),
            (0, Ev::Join(2, "b"), &["issue 101 [a,b]"]),
            (10, Ev::Join(1, "a"), &[]),
            (10, Ev::Join(2, "b"), &["issue 101 [a,b]"]),
            (20, Ev::Join(1, "a"), &[]),
            (20, Ev::JoinFailed(2, "b"), &["issue 102 [a,b]"]),
        ],
    },
    Case {
        name: "stragglers are waited for until the join timeout, at a tick",
        min_replicas: 1,
        join_timeout_ms: 500,
        steps: &[
            (0, Ev::Beat(3, "c"), &[]),
            (0, Ev::Join(1, "a"), &[]),
            (0, Ev::Join(2, "b"), &[]),
            (400, Ev::Beat(3, "c"), &[]),
            (499, Ev::Tick, &[]),
            (500, Ev::Tick, &["issue 101 [a,b]"]),
            // c alone is a minority of three; the fast quorum takes it along.
            (600, Ev::Join(3, "c"), &[]),
            (700, Ev::Join(1, "a"), &[]),
            (700, Ev::Join(2, "b"), &["issue 102 [a,b,c]"]),
        ],
    },
    Case {
        name: "shrink_only leaves a joiner waiting; it comes in at the next quorum",
        min_replicas: 2,
        join_timeout_ms: 60_000,
        steps: &[
            (0, Ev::Join(1, "a"), &[]),
            (0, Ev::Join(2, "b"), &["issue 101 [a,b]"]),
            (10, Ev::Join(3, "c"), &[]),
            (10, Ev::JoinShrink(1, "a"), &[]),
            (10, Ev::Join(2, "b"), &["issue 101 [a,b]"]),
            (20, Ev::Join(1, "a"), &[]),
            (20, Ev::Join(2, "b"), &["issue 102 [a,b,c]"]),
        ],
    },
    Case {
        name: "below min_replicas nothing is issued, however long",
        min_replicas: 3,
        join_timeout_ms: 0,
        steps: &[
            (0, Ev::Join(1, "a"), &[]),
            (0, Ev::Join(2, "b"), &[]),
            (300, Ev::Beat(1, "a"), &[]),
            (300, Ev::Beat(2, "b"), &[]),
            (600, Ev::Tick, &[]),
            (600, Ev::Join(3, "c"), &["issue 101 [a,b,c]"]),
        ],
    },
];

/// A service that has been up for a while (its startup grace over by
/// `t0`): the tables are about the rules after it.
fn warm(knobs: Knobs, first_id: i64, t0: Instant) -> Lighthouse {
    let up = knobs.heartbeat_timeout.min(STARTUP_GRACE_MAX);
    let mut lh = Lighthouse::new(knobs, first_id);
    lh.started = Some(t0.checked_sub(up).expect("an instant before t0"));
    lh.graced = true;
    // Its first call long past: the predecessor's abort with it.
    lh.predecessor_aborted = true;
    lh
}

/// A service that has just started issues no quorum until a heartbeat
/// timeout after it first heard anyone: before that a member that has not
/// reached it yet is unknown, and the first caller alone is a majority.
#[test]
fn a_started_service_waits_a_heartbeat_timeout_before_its_first_quorum() {
    let t0 = Instant::now();
    let mut lh = Lighthouse::new(Knobs::ours(1), 100);
    let at = |ms| t0 + Duration::from_millis(ms);
    assert!(
        issued(&lh.handle(at(0), event(Ev::Join(1, "a")))).is_empty(),
        "a alone, at once"
    );
    assert_eq!(lh.next_deadline(), Some(at(1000)), "the grace's end");
    lh.handle(at(400), event(Ev::Beat(2, "b")));
    assert!(lh.handle(at(500), event(Ev::Join(2, "b"))).is_empty());
    lh.handle(at(900), event(Ev::Beat(1, "a")));
    let got: Vec<String> = lh.handle(at(1000), Event::Tick).iter().map(line).collect();
    assert_eq!(
        got,
        ["issue 101 [a,b]"],
        "one quorum of both, not two of one"
    );
    // Without the grace, a alone is issued a quorum at once.
    let mut broken = Lighthouse::new(Knobs::ours(1), 100);
    broken.sabotage(Sabotage::NoStartupGrace);
    let got = issued(&broken.handle(at(0), event(Ev::Join(1, "a"))));
    assert_eq!(got, ["issue 101 [a]"]);
}

#[test]
fn transitions_table() {
    let t0 = Instant::now();
    for case in CASES {
        let mut knobs = Knobs::ours(case.min_replicas);
        knobs.join_timeout = Duration::from_millis(case.join_timeout_ms);
        let mut lh = warm(knobs, 100, t0);
        for (i, &(ms, ev, want)) in case.steps.iter().enumerate() {
            let got: Vec<String> = lh
                .handle(t0 + Duration::from_millis(ms), event(ev))
                .iter()
                .map(line)
                .collect();
            assert_eq!(got, want, "{}: step {i} ({ev:?} at {ms} ms)", case.name);
        }
    }
}

#[test]
fn next_deadline_names_the_first_expiry_and_the_join_wait() {
    let t0 = Instant::now();
    let mut knobs = Knobs::ours(1);
    knobs.join_timeout = Duration::from_millis(300);
    let mut lh = warm(knobs, 0, t0);
    assert_eq!(lh.next_deadline(), None, "nothing to wait for");
    lh.handle(t0, event(Ev::Beat(1, "a")));
    assert_eq!(
        lh.next_deadline(),
        Some(t0 + Duration::from_secs(1)),
        "a's heartbeat expires"
    );
    lh.handle(t0 + Duration::from_millis(100), event(Ev::Beat(2, "b")));
    lh.handle(t0 + Duration::from_millis(100), event(Ev::Beat(3, "c")));
    lh.handle(t0 + Duration::from_millis(200), event(Ev::Join(2, "b")));
    lh.handle(t0 + Duration::from_millis(200), event(Ev::Join(3, "c")));
    assert_eq!(
        lh.next_deadline(),
        Some(t0 + Duration::from_millis(500)),
        "the join wait for a ends"
    );
}

#[test]
fn status_counts_what_happened() {
    let t0 = Instant::now();
    let mut lh = warm(Knobs::ours(1), 0, t0);
    lh.handle(t0, event(Ev::Join(1, "a")));
    lh.handle(t0, event(Ev::JoinOther(2, "a")));
    lh.handle(t0, event(Ev::Beat(3, "b")));
    lh.handle(t0, event(Ev::Join(3, "b")));
    lh.handle(t0, event(Ev::Closed(1)));
    let s = lh.status(t0);
    // a alone made quorum 1; b waited (a minority beside a) until a's
    // session closed, then made quorum 2 alone.
    assert_eq!(s.quorum_id, 2);
    let ids: Vec<&str> = s
        .quorum
        .iter()
        .flat_map(|q| &q.participants)
        .map(|m| m.replica_id.as_str())
        .collect();
    assert_eq!(ids, ["b"]);
    assert!(s.waiting.is_empty(), "{:?}", s.waiting);
    assert_eq!(s.healthy, vec!["b".to_owned()]);
    assert_eq!(
        s.counters,
        Counters {
            joins: 2,
            heartbeats: 1,
            drops: 1,
            quorums_issued: 2,
            aborts: 1,
            refusals: 1,
            left: 0,
            recalled: 0,
        }
    );
    assert!(
        s.reason
            .contains("[0/0 participants healthy][1 heartbeating]"),
        "{}",
        s.reason
    );
}

#[test]
fn a_heal_reports_replica_is_resolved_by_id_or_by_torchfts_name() {
    let t0 = Instant::now();
    let mut lh = warm(Knobs::ours(1), 0, t0);
    lh.handle(t0, event(Ev::Beat(1, "heal_0:1111")));
    lh.handle(t0, event(Ev::Beat(2, "heal_1:2222")));
    lh.handle(t0, event(Ev::Beat(3, "twin:aaaa")));
    lh.handle(t0, event(Ev::Beat(4, "twin:bbbb")));
    assert_eq!(lh.resolve_replica("heal_1:2222"), Ok("heal_1:2222".into()));
    assert_eq!(lh.resolve_replica("heal_1"), Ok("heal_1:2222".into()));
    let e = lh.resolve_replica("heal_2").unwrap_err();
    assert!(e.contains("unknown replica id \"heal_2\""), "{e}");
    let e = lh.resolve_replica("twin").unwrap_err();
    assert!(e.contains("ambiguous"), "{e}");
    assert!(lh.resolve_replica("heal").is_err(), "a prefix is no name");
    // A replica that is gone is no longer known.
    lh.handle(t0, event(Ev::Closed(2)));
    assert!(lh.resolve_replica("heal_1").is_err());
}

fn restored(last_id: i64, ids: &[&str]) -> Event {
    restored_as(last_id, ids, false)
}

fn restored_as(last_id: i64, ids: &[&str], aborted: bool) -> Event {
    Event::Restored {
        last_id,
        quorum: Some(Quorum {
            id: last_id,
            participants: ids.iter().map(|id| member(id)).collect(),
            created: std::time::SystemTime::UNIX_EPOCH,
        }),
        aborted,
    }
}

/// A quorum its predecessor aborted (saved so before its watchers heard):
/// its members, back, get the next id at once, never the aborted one.
#[test]
fn a_restored_aborted_quorum_is_never_reissued_under_its_id() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let mut lh = Lighthouse::new(Knobs::ours(1), 5_000);
    assert!(lh
        .handle(at(0), restored_as(42, &["a", "b"], true))
        .is_empty());
    assert!(issued(&lh.handle(at(1), event(Ev::Join(1, "a")))).is_empty());
    assert_eq!(
        issued(&lh.handle(at(2), event(Ev::Join(2, "b")))),
        ["issue 43 [a,b]"],
        "all back: at once, under a new id"
    );
}

fn issued(actions: &[Action]) -> Vec<String> {
    actions
        .iter()
        .filter(|a| matches!(a, Action::Issue(_)))
        .map(line)
        .collect()
}

/// A lighthouse that took over from etcd's state re-issues the previous
/// quorum, under its id, as soon as all its members are back, without the
/// startup grace; ids go on from the restored one, not the wall clock's.
#[test]
fn a_restored_quorum_is_reissued_at_once_when_its_members_return() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let mut lh = Lighthouse::new(Knobs::ours(1), 5_000);
    assert!(lh.handle(at(0), restored(42, &["a", "b"])).is_empty());
    assert!(
        issued(&lh.handle(at(1), event(Ev::Join(1, "a")))).is_empty(),
        "b is not back"
    );
    assert_eq!(
        issued(&lh.handle(at(2), event(Ev::Join(2, "b")))),
        ["issue 42 [a,b]"],
        "all back: the same quorum, its id, 2 ms after the start"
    );
    // Restored is heeded only before the first quorum.
    assert!(lh.handle(at(3), restored(7, &["z"])).is_empty());
    lh.handle(at(4), event(Ev::JoinFailed(1, "a")));
    let q = issued(&lh.handle(at(5), event(Ev::Join(2, "b"))));
    assert_eq!(q, ["issue 43 [a,b]"], "a commit failure: the next id");
}

#[test]
fn a_restored_quorum_whose_members_do_not_all_return_waits_the_grace() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    // A standby's machine: its own grace long over when it takes over.
    let mut lh = warm(Knobs::ours(1), 5_000, t0);
    lh.handle(at(0), restored(42, &["a", "b"]));
    assert!(issued(&lh.handle(at(1), event(Ev::Join(1, "a")))).is_empty());
    assert!(
        issued(&lh.handle(at(999), Event::Tick)).is_empty(),
        "in the grace"
    );
    assert_eq!(
        issued(&lh.handle(at(1000), Event::Tick)),
        ["issue 43 [a]"],
        "after the grace, without b: a new id above the restored one"
    );
}

/// The issue's scale: 1,024 members in one process. One round (every member
/// heartbeats, then joins) issues a quorum of all of them, and a second
/// round a fast quorum with the same id.
#[test]
fn a_round_of_1024_members_issues_one_quorum_of_all() {
    let t0 = Instant::now();
    let n: u64 = 1024;
    let mut lh = warm(Knobs::ours(1), 0, t0);
    let ids: Vec<String> = (0..n).map(|i| format!("replica-{i:04}")).collect();
    for (s, id) in (0..n).zip(&ids) {
        assert!(lh
            .handle(
                t0,
                Event::Heartbeat {
                    session: s,
                    replica_id: id.clone()
                }
            )
            .is_empty());
    }
    for round in 0..2 {
        let at = t0 + Duration::from_millis(10 * (round + 1));
        let mut issued = Vec::new();
        for (s, id) in (0..n).zip(&ids) {
            issued.extend(lh.handle(
                at,
                Event::Join {
                    session: s,
                    member: member(id),
                    remembered: None,
                },
            ));
        }
        let [Action::Issue(q)] = issued.as_slice() else {
            panic!(
                "round {round}: wanted one quorum, got {} actions",
                issued.len()
            );
        };
        assert_eq!(q.id, 1, "round {round}");
        assert_eq!(q.participants.len(), 1024, "round {round}");
        assert!(q
            .participants
            .windows(2)
            .all(|w| w[0].replica_id < w[1].replica_id));
    }
}

/// A `Join` of `id` over `session` that remembers quorum `quorum_id` of
/// `members` (our managers' `last_quorum`).
fn join_remembering(session: Session, id: &str, quorum_id: i64, members: &[&str]) -> Event {
    Event::Join {
        session,
        member: member(id),
        remembered: Some(Remembered {
            quorum_id,
            replica_ids: members.iter().map(|m| (*m).to_owned()).collect(),
        }),
    }
}

/// A restarted lighthouse (nothing restored) whose callers remember their
/// last quorum issues its first quorum as soon as every member of the
/// newest remembered one is back and the recall floor has passed, not
/// after the grace; under a new id of its own (every member reconfigures
/// once), never the remembered one.
#[test]
fn a_remembered_quorum_back_ends_the_startup_grace_at_the_floor() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let mut lh = Lighthouse::new(Knobs::ours(2), 5_000);
    let abc = ["a", "b", "c"];
    assert!(issued(&lh.handle(at(0), join_remembering(1, "a", 42, &abc))).is_empty());
    assert!(issued(&lh.handle(at(1), join_remembering(2, "b", 42, &abc))).is_empty());
    assert!(
        issued(&lh.handle(at(2), join_remembering(3, "c", 42, &["c", "b", "a"]))).is_empty(),
        "all back, but a live manager may still be reconnecting: the floor"
    );
    assert_eq!(
        lh.next_deadline(),
        Some(at(350)),
        "the floor, not the grace"
    );
    assert_eq!(
        issued(&lh.handle(at(350), Event::Tick)),
        ["issue 5001 [a,b,c]"],
        "at the floor, under this service's own next id"
    );
    assert_eq!(lh.status(at(350)).counters.recalled, 1);
    // A memory is heeded only before the first quorum.
    lh.handle(at(400), join_remembering(4, "d", 99, &["d"]));
    assert!(issued(&lh.handle(at(401), Event::Tick)).is_empty());
}

/// The review's schedule: a and b missed the predecessor's newest quorum
/// (of a to e) and remember an older one (a, b); c, d and e, in the newer
/// one, are live but not in a `Quorum` call yet. The memory of (a, b) ends
/// the grace but never stands for the previous quorum: a and b are two of
/// five healthy, a minority, and wait for the others.
#[test]
fn a_stale_memory_never_passes_the_fast_path() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let mut lh = Lighthouse::new(Knobs::ours(2), 5_000);
    let old = ["a", "b"];
    let new = ["a", "b", "c", "d", "e"];
    lh.handle(at(0), join_remembering(1, "a", 5, &old));
    lh.handle(at(1), join_remembering(2, "b", 5, &old));
    for (s, id) in (3..).zip(["c", "d", "e"]) {
        lh.handle(at(100), event(Ev::Beat(s, id)));
    }
    assert!(
        issued(&lh.handle(at(350), Event::Tick)).is_empty(),
        "a minority of the healthy"
    );
    assert!(issued(&lh.handle(at(400), join_remembering(3, "c", 6, &new))).is_empty());
    assert!(issued(&lh.handle(at(401), join_remembering(4, "d", 6, &new))).is_empty());
    assert_eq!(
        issued(&lh.handle(at(402), join_remembering(5, "e", 6, &new))),
        ["issue 5001 [a,b,c,d,e]"]
    );
}

/// A member that missed its predecessor's last quorum remembers an older
/// one; the newest memory wins, whatever the order of the joins.
#[test]
fn the_newest_remembered_quorum_wins() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    // c was dropped from quorum 43, and remembers 42 (with a, b, c).
    for order in [["c", "a"], ["a", "c"]] {
        let mut lh = Lighthouse::new(Knobs::ours(1), 5_000);
        let mut got = Vec::new();
        for (s, id) in (1..).zip(order) {
            let ev = if id == "c" {
                join_remembering(s, "c", 42, &["a", "b", "c"])
            } else {
                join_remembering(s, "a", 43, &["a", "b"])
            };
            got.extend(issued(&lh.handle(at(s), ev)));
        }
        got.extend(issued(&lh.handle(at(350), Event::Tick)));
        assert!(got.is_empty(), "{order:?}: b is not back");
        lh.handle(at(360), join_remembering(5, "b", 43, &["a", "b"]));
        assert_eq!(
            lh.status(at(360)).counters.recalled,
            1,
            "{order:?}: 43's members back (c, waiting, comes in with them)"
        );
        assert_eq!(lh.current().map(|q| q.participants.len()), Some(3));
    }
}

/// A memory that does not name its requester is not one of its quorums:
/// ignored (the grace holds); so is one after a restored state, which is
/// the predecessor's own word.
#[test]
fn memories_that_cannot_be_true_are_ignored() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let mut lh = Lighthouse::new(Knobs::ours(1), 5_000);
    lh.handle(at(0), join_remembering(1, "a", 42, &["b"]));
    assert!(
        issued(&lh.handle(at(350), Event::Tick)).is_empty(),
        "a was not in the quorum it names"
    );
    assert_eq!(
        issued(&lh.handle(at(351), join_remembering(2, "b", 41, &["b"]))),
        ["issue 5001 [a,b]"],
        "b's own memory, b back (a, waiting, comes in)"
    );

    let mut lh = Lighthouse::new(Knobs::ours(1), 5_000);
    lh.handle(at(0), restored(42, &["a", "b"]));
    lh.handle(at(1), join_remembering(1, "a", 50, &["a"]));
    assert!(
        issued(&lh.handle(at(350), Event::Tick)).is_empty(),
        "the restored quorum (a, b) decides, not a's memory"
    );
    assert_eq!(
        issued(&lh.handle(at(351), event(Ev::Join(2, "b")))),
        ["issue 42 [a,b]"]
    );
}

/// The grace holds until every remembered member is back, and at least
/// the floor; each sabotage of those rules issues the first caller alone.
#[test]
fn the_grace_holds_until_every_remembered_member_is_back_and_the_floor() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let mut lh = Lighthouse::new(Knobs::ours(1), 5_000);
    let first = join_remembering(1, "a", 42, &["a", "b"]);
    assert!(issued(&lh.handle(at(0), first.clone())).is_empty());
    assert!(issued(&lh.handle(at(350), Event::Tick)).is_empty());
    lh.handle(at(900), event(Ev::Beat(1, "a")));
    assert_eq!(
        issued(&lh.handle(at(1000), Event::Tick)),
        ["issue 5001 [a]"],
        "b never came: the grace's end, as without memories"
    );
    let mut broken = Lighthouse::new(Knobs::ours(1), 5_000);
    broken.sabotage(Sabotage::RecalledAnyBack);
    assert!(issued(&broken.handle(at(0), first.clone())).is_empty());
    assert_eq!(
        issued(&broken.handle(at(350), Event::Tick)),
        ["issue 5001 [a]"]
    );

    let mut broken = Lighthouse::new(Knobs::ours(1), 5_000);
    broken.sabotage(Sabotage::NoRecallFloor);
    assert_eq!(
        issued(&broken.handle(at(0), join_remembering(1, "a", 42, &["a"]))),
        ["issue 5001 [a]"],
        "without the floor, a manager still reconnecting is not counted"
    );
}

/// The grace runs from the first replica heard: a service that ticked
/// alone for a long while (its managers still backing off) has learnt
/// nothing, and still waits the grace, or the floor on a memory.
#[test]
fn the_grace_and_the_floor_run_from_the_first_replica_heard() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let mut lh = Lighthouse::new(Knobs::ours(1), 5_000);
    for ms in (0..5_000).step_by(100) {
        lh.handle(at(ms), Event::Tick);
    }
    assert!(issued(&lh.handle(at(5_000), event(Ev::Join(1, "a")))).is_empty());
    assert_eq!(lh.next_deadline(), Some(at(6_000)));

    let mut lh = Lighthouse::new(Knobs::ours(1), 5_000);
    lh.handle(at(0), Event::Tick);
    assert!(issued(&lh.handle(at(5_000), join_remembering(1, "a", 42, &["a"]))).is_empty());
    assert_eq!(
        lh.next_deadline(),
        Some(at(5_350)),
        "the floor, from a's join"
    );
    assert_eq!(
        issued(&lh.handle(at(5_350), Event::Tick)),
        ["issue 5001 [a]"]
    );
}

/// A replica heard that told of no memory (torchft's manager, or one of
/// ours not in a `Quorum` call yet) keeps the grace: the floor's premise,
/// that every live manager dials again within it, is ours alone.
#[test]
fn a_replica_without_a_memory_keeps_the_grace() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let ab = ["a", "b"];
    let mut lh = Lighthouse::new(Knobs::ours(1), 5_000);
    lh.handle(at(0), join_remembering(1, "a", 42, &ab));
    lh.handle(at(1), join_remembering(2, "b", 42, &ab));
    lh.handle(at(2), event(Ev::Join(3, "t")));
    assert!(
        issued(&lh.handle(at(350), Event::Tick)).is_empty(),
        "t told of none"
    );
    lh.handle(at(900), event(Ev::Beat(1, "a")));
    lh.handle(at(900), event(Ev::Beat(2, "b")));
    lh.handle(at(900), event(Ev::Beat(3, "t")));
    assert_eq!(
        issued(&lh.handle(at(1_000), Event::Tick)),
        ["issue 5001 [a,b,t]"]
    );

    let mut lh = Lighthouse::new(Knobs::ours(1), 5_000);
    lh.handle(at(0), join_remembering(1, "a", 42, &ab));
    lh.handle(at(1), join_remembering(2, "b", 42, &ab));
    lh.handle(at(2), event(Ev::Beat(3, "c")));
    assert!(
        issued(&lh.handle(at(350), Event::Tick)).is_empty(),
        "c is heard but not in a Quorum call"
    );
}

/// The first `Join` a restarted service hears ends the predecessor's
/// generations for its watchers (once), whoever sent it: a member that
/// missed the predecessor's last answer asks anew, and the others, in that
/// quorum's op, would wait for it until their op's timeout. Not after a
/// restore, whose quorum may be re-issued under its id.
#[test]
fn the_first_join_heard_aborts_the_predecessors_generations() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let mut lh = Lighthouse::new(Knobs::ours(1), 5_000);
    let abc = ["a", "b", "c"];
    let got: Vec<String> = lh
        .handle(at(0), join_remembering(1, "b", 42, &abc))
        .iter()
        .map(line)
        .collect();
    assert_eq!(got, ["abort predecessor b"]);
    let got: Vec<String> = lh
        .handle(at(1), join_remembering(2, "a", 42, &abc))
        .iter()
        .map(line)
        .collect();
    assert!(got.is_empty(), "once: {got:?}");
    // torchft's managers tell of no memory: the same.
    let mut lh = Lighthouse::new(Knobs::ours(1), 5_000);
    let got: Vec<String> = lh
        .handle(at(0), event(Ev::Join(1, "b")))
        .iter()
        .map(line)
        .collect();
    assert_eq!(got, ["abort predecessor b"]);
    // After a restore: no abort.
    let mut lh = Lighthouse::new(Knobs::ours(1), 5_000);
    lh.handle(at(0), restored(42, &["a", "b"]));
    let got: Vec<String> = lh
        .handle(at(1), event(Ev::Join(1, "b")))
        .iter()
        .map(line)
        .collect();
    assert!(got.is_empty(), "{got:?}");
}
