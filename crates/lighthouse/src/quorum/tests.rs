//! A table of torchft's rules: each row a roster, a previous quorum, the
//! knobs, and the members issued or the reason there are none.

use super::*;

const HOUR: Duration = Duration::from_secs(3600);

/// A member of the tables (the machine's tables use it too).
pub(crate) fn member(id: &str) -> Member {
    Member {
        replica_id: id.to_owned(),
        address: format!("addr-{id}"),
        store_address: format!("store-{id}"),
        step: 1,
        world_size: 1,
        shrink_only: false,
        commit_failures: 0,
        data: String::new(),
    }
}

fn knobs(min_replicas: u64, join_timeout: Duration) -> Knobs {
    Knobs {
        min_replicas,
        join_timeout,
        quorum_tick: Duration::from_millis(10),
        heartbeat_timeout: Duration::from_secs(5),
    }
}

fn quorum(id: i64, ids: &[&str]) -> Quorum {
    Quorum {
        id,
        participants: ids.iter().map(|i| member(i)).collect(),
        created: SystemTime::UNIX_EPOCH,
    }
}

/// A replica in a row: its id, seconds since its last heartbeat, seconds
/// since it joined (`None`: not a participant), shrink_only.
type Replica = (&'static str, u64, Option<u64>, bool);

/// The expected verdict of a row.
#[derive(Debug)]
enum Want {
    Issue(&'static [&'static str], bool),
    BelowMin,
    Minority,
    Stragglers,
}

struct Row {
    name: &'static str,
    replicas: &'static [Replica],
    prev: Option<&'static [&'static str]>,
    min_replicas: u64,
    join_timeout: Duration,
    want: Want,
}

fn roster(now: Instant, replicas: &[Replica]) -> Roster {
    let mut r = Roster::default();
    for &(id, heard, joined, shrink_only) in replicas {
        if let Some(joined) = joined {
            let mut m = member(id);
            m.shrink_only = shrink_only;
            r.join(m, now - Duration::from_secs(joined));
        }
        r.heard(id, now - Duration::from_secs(heard));
    }
    r
}

const ROWS: &[Row] = &[
    Row {
        name: "nobody: below min_replicas",
        replicas: &[],
        prev: None,
        min_replicas: 1,
        join_timeout: HOUR,
        want: Want::BelowMin,
    },
    Row {
        name: "all healthy joined: issue at once",
        replicas: &[("a", 0, Some(0), false), ("b", 0, Some(0), false)],
        prev: None,
        min_replicas: 1,
        join_timeout: HOUR,
        want: Want::Issue(&["a", "b"], false),
    },
    Row {
        name: "a healthy straggler: wait for the join timeout",
        replicas: &[
            ("a", 0, Some(0), false),
            ("b", 0, Some(0), false),
            ("c", 0, None, false),
        ],
        prev: None,
        min_replicas: 1,
        join_timeout: HOUR,
        want: Want::Stragglers,
    },
    Row {
        name: "the join timeout passed: issue without the straggler",
        replicas: &[
            ("a", 0, Some(36_000), false),
            ("b", 0, Some(0), false),
            ("c", 0, None, false),
        ],
        prev: None,
        min_replicas: 1,
        join_timeout: HOUR,
        want: Want::Issue(&["a", "b"], false),
    },
    Row {
        name: "an expired heartbeat does not count",
        replicas: &[("a", 10, Some(0), false)],
        prev: None,
        min_replicas: 1,
        join_timeout: Duration::ZERO,
        want: Want::BelowMin,
    },
    Row {
        name: "one healthy, one expired: a quorum of the healthy one",
        replicas: &[("a", 10, Some(0), false), ("b", 0, Some(0), false)],
        prev: None,
        min_replicas: 1,
        join_timeout: Duration::ZERO,
        want: Want::Issue(&["b"], false),
    },
    Row {
        name: "split brain: one of two healthy joined",
        replicas: &[("a", 0, Some(0), false), ("b", 0, None, false)],
        prev: None,
        min_replicas: 1,
        join_timeout: HOUR,
        want: Want::Minority,
    },
    Row {
        name: "split brain holds past the join timeout",
        replicas: &[("a", 0, Some(36_000), false), ("b", 0, None, false)],
        prev: None,
        min_replicas: 1,
        join_timeout: HOUR,
        want: Want::Minority,
    },
    Row {
        name: "two of three is a majority, after the join timeout",
        replicas: &[
            ("a", 0, Some(7200), false),
            ("b", 0, Some(0), false),
            ("c", 0, None, false),
        ],
        prev: None,
        min_replicas: 1,
        join_timeout: HOUR,
        want: Want::Issue(&["a", "b"], false),
    },
    Row {
        name: "fast quorum: the previous member is back, the other healthy one not joined",
        replicas: &[("a", 0, Some(0), false), ("b", 0, None, false)],
        prev: Some(&["a"]),
        min_replicas: 1,
        join_timeout: HOUR,
        want: Want::Issue(&["a"], true),
    },
    Row {
        name: "fast quorum takes a waiting joiner along",
        replicas: &[("a", 0, Some(0), false), ("b", 0, Some(0), false)],
        prev: Some(&["a"]),
        min_replicas: 1,
        join_timeout: HOUR,
        want: Want::Issue(&["a", "b"], true),
    },
    Row {
        name: "fast quorum skips min_replicas (the previous quorum passed it)",
        replicas: &[("a", 0, Some(0), false), ("b", 0, Some(0), false)],
        prev: Some(&["a", "b"]),
        min_replicas: 3,
        join_timeout: HOUR,
        want: Want::Issue(&["a", "b"], true),
    },
    Row {
        name: "no fast quorum when a previous member is silent",
        replicas: &[("a", 0, Some(0), false), ("b", 10, Some(0), false)],
        prev: Some(&["a", "b"]),
        min_replicas: 2,
        join_timeout: HOUR,
        want: Want::BelowMin,
    },
    Row {
        name: "no fast quorum when a previous member has not joined: wait for it",
        replicas: &[
            ("a", 0, Some(0), false),
            ("b", 0, Some(0), false),
            ("c", 0, None, false),
        ],
        prev: Some(&["a", "b", "c"]),
        min_replicas: 2,
        join_timeout: HOUR,
        want: Want::Stragglers,
    },
    Row {
        name: "below min_replicas",
        replicas: &[("a", 0, Some(0), false), ("b", 0, Some(0), false)],
        prev: None,
        min_replicas: 3,
        join_timeout: Duration::ZERO,
        want: Want::BelowMin,
    },
    Row {
        name: "shrink_only: the joiner is left out",
        replicas: &[("a", 0, Some(0), true), ("c", 0, Some(0), true)],
        prev: Some(&["a", "b"]),
        min_replicas: 1,
        join_timeout: HOUR,
        want: Want::Issue(&["a"], false),
    },
    Row {
        name: "shrink_only in a fast quorum keeps the joiner out",
        replicas: &[
            ("a", 0, Some(0), true),
            ("b", 0, Some(0), false),
            ("c", 0, Some(0), false),
        ],
        prev: Some(&["a", "b"]),
        min_replicas: 1,
        join_timeout: HOUR,
        want: Want::Issue(&["a", "b"], true),
    },
    Row {
        name: "a shrink_only that would go below min_replicas is ignored (torchft would issue [a])",
        replicas: &[("a", 0, Some(0), true), ("c", 0, Some(0), false)],
        prev: Some(&["a", "b"]),
        min_replicas: 2,
        join_timeout: HOUR,
        want: Want::Issue(&["a", "c"], false),
    },
    Row {
        name: "a joiner's shrink_only keeps nobody out (torchft would issue [a])",
        replicas: &[("a", 0, Some(0), false), ("c", 0, Some(0), true)],
        prev: Some(&["a"]),
        min_replicas: 1,
        join_timeout: HOUR,
        want: Want::Issue(&["a", "c"], true),
    },
    Row {
        name: "an unhealthy participant's shrink_only counts for nothing",
        replicas: &[("a", 10, Some(0), true), ("c", 0, Some(0), false)],
        prev: Some(&["a", "b"]),
        min_replicas: 1,
        join_timeout: HOUR,
        want: Want::Issue(&["c"], false),
    },
];

#[test]
fn torchfts_rules_table() {
    let now = Instant::now() + Duration::from_secs(100_000);
    for row in ROWS {
        let r = roster(now, row.replicas);
        let prev = row.prev.map(|ids| quorum(1, ids));
        let k = knobs(row.min_replicas, row.join_timeout);
        let v = compute(now, &r, prev.as_ref(), &k);
        let ok = match (&row.want, &v) {
            (
                Want::Issue(ids, fast),
                Verdict::Issue {
                    members, fast: f, ..
                },
            ) => {
                members
                    .iter()
                    .map(|m| m.replica_id.as_str())
                    .collect::<Vec<_>>()
                    == *ids
                    && f == fast
            }
            (
                Want::BelowMin,
                Verdict::Wait {
                    why: Why::BelowMin { .. },
                    ..
                },
            )
            | (
                Want::Minority,
                Verdict::Wait {
                    why: Why::Minority { .. },
                    ..
                },
            )
            | (
                Want::Stragglers,
                Verdict::Wait {
                    why: Why::Stragglers { .. },
                    ..
                },
            ) => true,
            _ => false,
        };
        assert!(ok, "{}: wanted {:?}, got {v:?} ({v})", row.name, row.want);
    }
}

#[test]
fn reasons_read_as_torchfts() {
    let now = Instant::now() + Duration::from_secs(100_000);
    let k = knobs(1, HOUR);
    let v = compute(now, &Roster::default(), None, &k);
    assert!(
        v.to_string().contains(
            "New quorum not ready, only have 0 participants, need min_replicas 1 [0/0 participants healthy]"
        ),
        "{v}"
    );
    let r = roster(now, &[("a", 0, Some(0), false), ("b", 0, None, false)]);
    let v = compute(now, &r, None, &k);
    assert!(v.to_string().contains("New quorum not ready, only have 1 participants, need at least half of 2 healthy workers [1/1 participants healthy][2 heartbeating]"), "{v}");
    let r = roster(now, &[("a", 0, Some(0), true)]);
    let v = compute(now, &r, Some(&quorum(1, &["a"])), &k);
    assert!(v.to_string().contains("[shrink_only=true]"), "{v}");
}

#[test]
fn the_wait_says_when_to_look_again() {
    let now = Instant::now() + Duration::from_secs(100_000);
    let k = knobs(1, Duration::from_secs(60));
    // Joined 10 s ago, the straggler heard 1 s ago: the join wait ends in
    // 50 s, the straggler's heartbeat expires in 4 s.
    let r = roster(
        now,
        &[
            ("a", 0, Some(10), false),
            ("b", 0, Some(10), false),
            ("c", 1, None, false),
        ],
    );
    let Verdict::Wait {
        until,
        why: Why::Stragglers {
            until: join_end, ..
        },
        ..
    } = compute(now, &r, None, &k)
    else {
        panic!("wanted a wait for stragglers");
    };
    assert_eq!(join_end, now + Duration::from_secs(50));
    assert_eq!(until, Some(now + Duration::from_secs(4)));
    // Below min_replicas: only a new event helps.
    let v = compute(now, &r, None, &knobs(5, HOUR));
    assert!(matches!(v, Verdict::Wait { until: None, .. }), "{v:?}");
}

#[test]
fn ids_rise_on_change_or_commit_failure() {
    let q = quorum(7, &["a", "b"]);
    let same = q.participants.clone();
    assert_eq!(next_id(7, None, &same), 8, "the first quorum");
    assert_eq!(next_id(7, Some(&q), &same), 7, "same members");
    let mut moved = same.clone();
    moved[0].address = "elsewhere".into();
    moved[0].step = 1000;
    assert_eq!(
        next_id(7, Some(&q), &moved),
        7,
        "an address or step is not a change"
    );
    assert_eq!(next_id(7, Some(&q), &same[..1]), 8, "a member left");
    let mut failed = same.clone();
    failed[1].commit_failures = 2;
    assert_eq!(next_id(7, Some(&q), &failed), 8, "a commit failure");
    let other = quorum(0, &["a", "c"]).participants;
    assert_eq!(next_id(7, Some(&q), &other), 8, "a member replaced");
}

/// A random case: per replica (heard ms ago, joined ms ago or not,
/// shrink_only, in the previous quorum), whether there is a previous quorum,
/// min_replicas, the join timeout in ms.
type Case = (Vec<(u64, Option<u64>, bool, bool)>, bool, u64, u64);

fn arbitrary() -> impl proptest::strategy::Strategy<Value = Case> {
    use proptest::prelude::*;
    (
        proptest::collection::vec(
            (
                0u64..8_000,
                proptest::option::of(0u64..4_000),
                any::<bool>(),
                any::<bool>(),
            ),
            0..12,
        ),
        any::<bool>(),
        0u64..5,
        prop_oneof![Just(0u64), Just(500), Just(3_000)],
    )
}

proptest::proptest! {
    /// Whatever the roster: an issued quorum is sorted, made of healthy
    /// participants, never below min_replicas, and either fast (holding
    /// every previous member) or backed by more than half of the healthy
    /// replicas; with shrink_only (from a previous member) honoured, it adds
    /// no one.
    #[test]
    fn an_issued_quorum_keeps_the_rules((replicas, with_prev, min, join_ms) in arbitrary()) {
        let now = Instant::now() + Duration::from_secs(100_000);
        let mut knobs = knobs(min, Duration::from_millis(join_ms));
        knobs.heartbeat_timeout = Duration::from_secs(5);
        let mut r = Roster::default();
        let mut prev_ids = Vec::new();
        for (i, (heard, joined, shrink_only, in_prev)) in replicas.iter().enumerate() {
            let id = format!("r{i:02}");
            if let Some(joined) = joined {
                let mut m = member(&id);
                m.shrink_only = *shrink_only;
                r.join(m, now - Duration::from_millis(*joined));
            }
            r.heard(&id, now - Duration::from_millis(*heard));
            if *in_prev {
                prev_ids.push(id);
            }
        }
        let prev_ids: Vec<&str> = prev_ids.iter().map(String::as_str).collect();
        let prev = (with_prev && !prev_ids.is_empty()).then(|| quorum(1, &prev_ids));
        let v = compute(now, &r, prev.as_ref(), &knobs);
        let Verdict::Issue { members, fast, census } = v else {
            return Ok(());
        };
        let timeout = knobs.heartbeat_timeout;
        let ids: Vec<&str> = members.iter().map(|m| m.replica_id.as_str()).collect();
        proptest::prop_assert!(ids.windows(2).all(|w| w[0] < w[1]), "sorted: {ids:?}");
        for id in &ids {
            let rep = &r.replicas[*id];
            proptest::prop_assert!(rep.waiting.is_some() && r.healthy(id, now, timeout));
        }
        proptest::prop_assert!(members.len() as u64 >= min || fast, "{ids:?} below {min}");
        if fast {
            for p in &prev_ids {
                proptest::prop_assert!(ids.contains(p), "fast without {p}: {ids:?}");
            }
        } else {
            proptest::prop_assert!(census.healthy_participants * 2 > census.healthy, "{census}");
        }
        if census.shrink_only && members.len() as u64 >= min {
            let added: Vec<&&str> = ids.iter().filter(|id| !prev_ids.contains(id)).collect();
            let shrunk = prev_ids.iter().filter(|p| {
                r.replicas.get(**p).is_some_and(|x| x.waiting.is_some())
                    && r.healthy(p, now, timeout)
            }).count() as u64;
            if shrunk >= min {
                proptest::prop_assert!(added.is_empty(), "shrink_only let in {added:?}");
            }
        }
    }
}
