//! The round's table tests and a seeded property test over random orders
//! of its events.

use super::*;
use proptest::prelude::*;
use proptest::strategy::ValueTree;

const T: Duration = Duration::from_secs(10);

fn setup(w: usize) -> Setup {
    Setup {
        replica_id: "g0".into(),
        address: "mgr:1".into(),
        store_address: "store:2".into(),
        lighthouse: "http://lh:3".into(),
        world_size: w,
    }
}

fn call(step: i64, rank: Rank) -> QuorumCall {
    QuorumCall {
        step,
        metadata: format!("t{rank}:9"),
        shrink_only: false,
        init_sync: true,
        commit_failures: 0,
        timeout: T,
        line: None,
    }
}

/// A round of `w` ranks, all said hello (the lighthouse connection asked).
fn round(w: usize) -> Round {
    let mut r = Round::new(setup(w));
    for rank in 0..w {
        let a = r.handle(Event::Hello {
            rank: rank as u64,
            world_size: w as u64,
        });
        assert_eq!(a[0], Action::Welcome { rank });
        assert_eq!(a.len(), if rank == 0 { 2 } else { 1 }, "{a:?}");
    }
    r
}

fn q(rank: Rank, step: i64, now: Instant) -> Event {
    Event::Quorum {
        rank,
        call: call(step, rank),
        now,
    }
}

fn vote(rank: Rank, step: i64, vote: bool, now: Instant) -> Event {
    Event::Vote {
        rank,
        step,
        line: None,
        vote,
        timeout: T,
        now,
    }
}

fn issued(members: &[QuorumMember]) -> Quorum {
    Quorum {
        quorum_id: 7,
        participants: members.to_vec(),
        created: None,
    }
}

fn fails(a: &[Action]) -> Vec<(Rank, String)> {
    a.iter()
        .filter_map(|a| match a {
            Action::Fail { rank, error } => Some((*rank, error.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn hellos_are_checked() {
    let mut r = Round::new(setup(2));
    let a = r.handle(Event::Hello {
        rank: 0,
        world_size: 2,
    });
    assert_eq!(a, [Action::Welcome { rank: 0 }, Action::Connect]);
    for (rank, w, want) in [
        (0, 2, "already held"),
        (2, 2, "out of range"),
        (1, 3, "group_world_size 3"),
    ] {
        let a = r.handle(Event::Hello {
            rank,
            world_size: w,
        });
        match &a[..] {
            [Action::HelloRefused { error }] => assert!(error.contains(want), "{error}"),
            _ => panic!("{a:?}"),
        }
    }
    assert_eq!(
        r.handle(Event::Hello {
            rank: 1,
            world_size: 2
        }),
        [Action::Welcome { rank: 1 }]
    );
}

#[test]
fn the_lighthouse_is_called_once_all_ranks_called_with_the_group_member() {
    let now = Instant::now();
    let mut r = round(3);
    assert!(r.handle(q(2, 4, now)).is_empty());
    let mut c = call(5, 0);
    c.shrink_only = true;
    c.commit_failures = 2;
    let a = r.handle(Event::Quorum {
        rank: 0,
        call: c,
        now,
    });
    assert!(a.is_empty());
    assert_eq!(r.next_deadline(), Some(now + T));
    let later = now + Duration::from_secs(1);
    let a = r.handle(q(1, 3, later));
    let [Action::CallLighthouse {
        call,
        member,
        deadline,
    }] = &a[..]
    else {
        panic!("{a:?}")
    };
    assert_eq!(*call, 1);
    assert!(r.awaits(1) && !r.awaits(0) && !r.awaits(2));
    assert_eq!(*deadline, now + T, "the earliest caller's deadline");
    assert_eq!(member.replica_id, "g0");
    assert_eq!(member.address, "mgr:1");
    assert_eq!(member.store_address, "store:2");
    assert_eq!(member.step, 3, "the lowest of the ranks' steps (5, 3, 4)");
    assert_eq!(member.world_size, 3);
    assert!(member.shrink_only);
    assert_eq!(member.commit_failures, 2);
    assert_eq!(
        member.data,
        r#"{"lines":[null,null,null],"metadata":["t0:9","t1:9","t2:9"],"steps":[5,3,4]}"#,
        "each rank's metadata and step, in rank order"
    );

    let mut other = member.clone();
    other.replica_id = "g1".into();
    other.store_address = "store1:2".into();
    let a = r.handle(Event::LighthouseAnswered {
        call: 1,
        quorum: issued(&[other, member.clone()]),
    });
    assert_eq!(a.len(), 3);
    for (i, a) in a.iter().enumerate() {
        let Action::AnswerQuorum { rank, result } = a else {
            panic!("{a:?}")
        };
        assert_eq!(*rank, i);
        assert_eq!(result.quorum_id, 7);
        assert_eq!(result.replica_rank, 0);
        assert_eq!(result.replica_world_size, 2);
    }
    assert_eq!(r.next_deadline(), None);
    // A late duplicate of the answer is ignored.
    let a = r.handle(Event::LighthouseAnswered {
        call: 1,
        quorum: issued(std::slice::from_ref(member)),
    });
    assert!(a.is_empty());
}

#[test]
fn a_quorum_without_this_group_fails_its_ranks_naming_it() {
    let now = Instant::now();
    let mut r = round(1);
    let a = r.handle(q(0, 0, now));
    let Action::CallLighthouse { member, .. } = &a[0] else {
        panic!()
    };
    let mut other = member.clone();
    other.replica_id = "g9".into();
    let a = r.handle(Event::LighthouseAnswered {
        call: 1,
        quorum: issued(&[other]),
    });
    let f = fails(&a);
    assert!(f[0].1.contains("\"g0\" is not a participant"), "{f:?}");
}

#[test]
fn a_failed_lighthouse_call_fails_its_ranks_with_the_error() {
    let now = Instant::now();
    let mut r = round(2);
    r.handle(q(0, 0, now));
    r.handle(q(1, 0, now));
    let a = r.handle(Event::LighthouseFailed {
        call: 1,
        error: "refused: id held".into(),
    });
    assert_eq!(
        fails(&a),
        [
            (0, "refused: id held".into()),
            (1, "refused: id held".into())
        ]
    );
    let a = r.handle(Event::LighthouseFailed {
        call: 1,
        error: "again".into(),
    });
    assert!(a.is_empty(), "answered once");
}

#[test]
fn calls_without_hello_or_twice_are_refused() {
    let now = Instant::now();
    let mut r = Round::new(setup(2));
    let f = fails(&r.handle(q(0, 0, now)));
    assert!(f[0].1.contains("without a hello"), "{f:?}");
    let mut r = round(2);
    r.handle(q(0, 0, now));
    let f = fails(&r.handle(q(0, 0, now)));
    assert!(f[0].1.contains("already has a quorum call"), "{f:?}");
    // (A vote while a rank waits in quorum fails at once: a new round.)
    let mut r = round(2);
    r.handle(vote(1, 0, true, now));
    let f = fails(&r.handle(vote(1, 0, true, now)));
    assert!(f[0].1.contains("already has a should_commit call"), "{f:?}");
}

#[test]
fn a_quorum_timeout_names_the_ranks_that_never_called_or_the_lighthouse() {
    let now = Instant::now();
    let mut r = round(3);
    r.handle(q(1, 0, now));
    assert!(r.handle(Event::Tick { now: now + T / 2 }).is_empty());
    let f = fails(&r.handle(Event::Tick { now: now + T }));
    assert_eq!(f.len(), 1);
    assert!(
        f[0].1
            .contains("timed out after 10s waiting for group ranks [0, 2] to call quorum"),
        "{f:?}"
    );

    let mut r = round(1);
    r.handle(q(0, 0, now));
    let f = fails(&r.handle(Event::Tick { now: now + T }));
    assert!(
        f[0].1.contains("waiting for the lighthouse at http://lh:3"),
        "{f:?}"
    );
    // Its answer, late, answers no one.
    let a = r.handle(Event::LighthouseFailed {
        call: 1,
        error: "late".into(),
    });
    assert!(a.is_empty());
}

#[test]
fn should_commit_is_the_and_of_the_votes() {
    let now = Instant::now();
    for (votes, want) in [
        ([true, true], true),
        ([true, false], false),
        ([false, true], false),
        ([false, false], false),
    ] {
        let mut r = round(2);
        assert!(r.handle(vote(0, 3, votes[0], now)).is_empty());
        let a = r.handle(vote(1, 3, votes[1], now));
        assert_eq!(
            a,
            [
                Action::AnswerCommit {
                    rank: 0,
                    commit: want
                },
                Action::AnswerCommit {
                    rank: 1,
                    commit: want
                }
            ]
        );
        // The next step's barrier starts empty.
        assert!(r.handle(vote(0, 4, true, now)).is_empty());
    }
}

/// Each rank's line (the quorum its state was committed in) goes into the
/// member's data in rank order; votes from states of different lines fail
/// naming them, as votes on different steps do (results' "one line of
/// history wins at a step").
#[test]
fn the_ranks_lines_go_to_the_lighthouse_and_votes_from_two_lines_fail() {
    let now = Instant::now();
    let mut r = round(2);
    let mut c = call(4, 0);
    c.line = Some(101);
    r.handle(Event::Quorum {
        rank: 0,
        call: c,
        now,
    });
    let a = r.handle(q(1, 4, now));
    let Some(Action::CallLighthouse { member, .. }) = a.last() else {
        panic!("{a:?}")
    };
    assert_eq!(
        member.data,
        r#"{"lines":[101,null],"metadata":["t0:9","t1:9"],"steps":[4,4]}"#
    );
    let voted = |line: Option<i64>, rank| Event::Vote {
        rank,
        step: 4,
        line,
        vote: true,
        timeout: T,
        now,
    };
    let mut r = round(2);
    r.handle(voted(Some(101), 0));
    let f = fails(&r.handle(voted(Some(7), 1)));
    assert_eq!(f.len(), 2, "{f:?}");
    assert!(
        f[0].1.contains("different lines") && f[0].1.contains("(1, Some(7))"),
        "{f:?}"
    );
    r.handle(voted(Some(7), 0));
    let a = r.handle(voted(Some(7), 1));
    assert_eq!(a.len(), 2);
    assert!(a.contains(&Action::AnswerCommit {
        rank: 0,
        commit: true
    }));
}

#[test]
fn votes_on_different_steps_fail_naming_them() {
    let now = Instant::now();
    let mut r = round(2);
    r.handle(vote(0, 3, true, now));
    let f = fails(&r.handle(vote(1, 4, true, now)));
    assert_eq!(f.len(), 2);
    assert!(f[0].1.contains("[(0, 3), (1, 4)]"), "{f:?}");
}

#[test]
fn a_vote_timeout_names_the_ranks_that_never_voted() {
    let now = Instant::now();
    let mut r = round(3);
    r.handle(vote(2, 3, true, now));
    let f = fails(&r.handle(Event::Tick { now: now + T }));
    assert!(
        f[0].1
            .contains("should_commit (step 3) timed out after 10s: group ranks [0, 1] never voted"),
        "{f:?}"
    );
}

/// Found by `tests/sim.rs` (seeds 302, 354 of its first 1000): a stalled
/// rank left the group's ranks split between the two barriers (one in
/// `quorum`, one in `should_commit`), each timing out waiting for a rank
/// that was in the other one, round after round, forever. A rank that
/// calls quorum has left its step: the votes still waiting for that step
/// fail at once; a vote while ranks wait in quorum (they left the step)
/// fails at once. The ranks then meet in the next quorum.
#[test]
fn ranks_split_between_quorum_and_should_commit_meet_again() {
    let t0 = Instant::now();
    let mut r = round(2);
    // Rank 0 gave up its quorum (timeout) and votes; rank 1, resumed,
    // calls quorum: rank 0's vote can never be matched.
    assert!(r.handle(vote(0, 3, false, t0)).is_empty());
    let a = r.handle(q(1, 3, t0));
    let f = fails(&a);
    assert_eq!(f.len(), 1, "{a:?}");
    assert_eq!(f[0].0, 0);
    assert!(f[0].1.contains("group ranks [1] left step 3"), "{}", f[0].1);
    // Rank 0 follows into the quorum: the lighthouse is called.
    let a = r.handle(q(0, 3, t0));
    assert!(
        matches!(a.last(), Some(Action::CallLighthouse { .. })),
        "{a:?}"
    );

    // The other way round: rank 0 waits in quorum, rank 1's late vote.
    let mut r = round(2);
    assert!(r.handle(q(0, 4, t0)).is_empty());
    let a = r.handle(vote(1, 3, true, t0));
    let f = fails(&a);
    assert_eq!(f.len(), 1, "{a:?}");
    assert_eq!(f[0].0, 1);
    assert!(
        f[0].1.contains("group ranks [0] already wait in quorum"),
        "{}",
        f[0].1
    );
    let a = r.handle(q(1, 4, t0));
    assert!(
        matches!(a.last(), Some(Action::CallLighthouse { .. })),
        "{a:?}"
    );
}

#[test]
fn a_rank_gone_fails_every_waiting_call_and_drops_the_connection() {
    let now = Instant::now();
    let why = "group rank 2's connection to the manager ended";
    // Votes waiting (no rank in quorum: a vote then would fail at once).
    let mut r = round(3);
    r.handle(vote(0, 0, true, now));
    r.handle(vote(1, 0, true, now));
    let a = r.handle(Event::RankGone { rank: 2 });
    assert_eq!(
        fails(&a),
        [0, 1].map(|rank| (rank, format!("should_commit stopped: {why}")))
    );
    let mut r = round(3);
    r.handle(q(0, 0, now));
    r.handle(q(1, 0, now));
    let a = r.handle(Event::RankGone { rank: 2 });
    assert_eq!(
        a,
        [
            Action::Fail {
                rank: 0,
                error: format!("quorum stopped: {why}")
            },
            Action::Fail {
                rank: 1,
                error: format!("quorum stopped: {why}")
            },
            Action::DropConnection { reason: why.into() },
        ]
    );
    assert_eq!(r.next_deadline(), None);
    // Gone twice, or a rank never held: nothing.
    assert!(r.handle(Event::RankGone { rank: 2 }).is_empty());
    // The next hello reconnects.
    let a = r.handle(Event::Hello {
        rank: 2,
        world_size: 3,
    });
    assert_eq!(a, [Action::Welcome { rank: 2 }, Action::Connect]);
}

#[test]
fn workers_stopped_while_the_lighthouse_call_is_in_flight() {
    let now = Instant::now();
    let mut r = round(1);
    let a = r.handle(q(0, 0, now));
    let Action::CallLighthouse { member, .. } = &a[0] else {
        panic!()
    };
    let member = member.clone();
    let a = r.handle(Event::WorkersStopped {
        reason: "rank 0 exited with 1".into(),
    });
    assert_eq!(
        fails(&a),
        [(0, "quorum stopped: rank 0 exited with 1".into())]
    );
    assert!(matches!(a.last(), Some(Action::DropConnection { .. })));
    // The call's answer comes after the stop: stale (the server keeps it
    // out of the status), and nobody is answered.
    assert!(!r.awaits(1));
    let a = r.handle(Event::LighthouseAnswered {
        call: 1,
        quorum: issued(&[member]),
    });
    assert!(a.is_empty());
    // The stop lasts: the stopped worker's next call is refused, nothing
    // reconnects (the dying group would rejoin the quorum once).
    let a = r.handle(q(0, 1, now));
    assert_eq!(
        fails(&a),
        [(0, "group rank 0 called quorum without a hello".into())]
    );
    assert_eq!(a.len(), 1, "{a:?}");
    // Its replacement's hello is welcome before the old connection ends,
    // and its round reconnects first.
    let a = r.handle(Event::Hello {
        rank: 0,
        world_size: 1,
    });
    assert_eq!(a, [Action::Welcome { rank: 0 }, Action::Connect]);
    let a = r.handle(q(0, 1, now));
    assert!(matches!(a[0], Action::CallLighthouse { call: 2, .. }));
    // Stopping twice drops the connection once.
    r.handle(Event::WorkersStopped { reason: "x".into() });
    let a = r.handle(Event::WorkersStopped { reason: "x".into() });
    assert!(a.is_empty());
}

#[test]
fn a_lighthouse_call_answers_only_the_calls_it_was_made_for() {
    let now = Instant::now();
    let mut r = round(2);
    let mut short = call(3, 0);
    short.timeout = Duration::from_secs(1);
    r.handle(Event::Quorum {
        rank: 0,
        call: short,
        now,
    });
    let a = r.handle(q(1, 3, now));
    assert!(
        matches!(a[..], [Action::CallLighthouse { call: 1, .. }]),
        "{a:?}"
    );
    // Rank 0's call times out while the lighthouse call is in flight, and
    // rank 0 calls again.
    let a = r.handle(Event::Tick {
        now: now + Duration::from_secs(1),
    });
    assert_eq!(fails(&a).len(), 1);
    assert!(
        fails(&a)[0].1.contains("waiting for the lighthouse"),
        "{a:?}"
    );
    let later = now + Duration::from_secs(2);
    assert!(r.handle(q(0, 3, later)).is_empty());
    // The old call's failure fails rank 1's call only.
    let a = r.handle(Event::LighthouseFailed {
        call: 1,
        error: "deadline".into(),
    });
    assert_eq!(fails(&a), [(1, "deadline".into())]);
    // Rank 1 calls again: one new lighthouse call for both.
    let a = r.handle(q(1, 3, later));
    let Some(Action::CallLighthouse { call, member, .. }) = a.first() else {
        panic!("{a:?}")
    };
    assert_eq!(*call, 2);
    // Its answer answers both new calls.
    let quorum = issued(std::slice::from_ref(member));
    let a = r.handle(Event::LighthouseAnswered { call: 2, quorum });
    let answered: Vec<Rank> = a
        .iter()
        .filter_map(|a| match a {
            Action::AnswerQuorum { rank, .. } => Some(*rank),
            _ => None,
        })
        .collect();
    assert_eq!(answered, [0, 1], "{a:?}");
}

#[test]
fn a_new_world_size_applies_to_the_next_hellos() {
    let mut r = round(2);
    r.handle(Event::SetWorldSize(3));
    let a = r.handle(Event::Hello {
        rank: 2,
        world_size: 3,
    });
    assert_eq!(a, [Action::Welcome { rank: 2 }]);
    assert_eq!(r.setup().world_size, 3);
}

#[test]
fn a_timeout_beyond_a_week_is_cut_to_a_week() {
    let now = Instant::now();
    let mut r = round(2);
    let mut c = call(0, 0);
    c.timeout = Duration::from_millis(u64::MAX);
    r.handle(Event::Quorum {
        rank: 0,
        call: c,
        now,
    });
    let v = Event::Vote {
        rank: 1,
        step: 0,
        line: None,
        vote: true,
        timeout: Duration::from_millis(u64::MAX),
        now,
    };
    r.handle(v);
    assert_eq!(r.next_deadline(), Some(now + MAX_TIMEOUT));
}

/// One step of the property test's schedule.
#[derive(Clone, Debug)]
enum Step {
    Hello(u64),
    Gone(Rank),
    Quorum(Rank, i64),
    Vote(Rank, i64, bool),
    Answer,
    Fail,
    Tick(u64),
    Stop,
}

fn step() -> impl Strategy<Value = Step> {
    // Votes often and mostly true, so that W true votes on one step (a
    // commit) happen in many orders.
    prop_oneof![
        2 => (0u64..4).prop_map(Step::Hello),
        1 => (0usize..3).prop_map(Step::Gone),
        2 => (0usize..3, 0i64..3).prop_map(|(r, s)| Step::Quorum(r, s)),
        4 => (0usize..3, 0i64..2, proptest::bool::weighted(0.8)).prop_map(|(r, s, v)| Step::Vote(r, s, v)),
        1 => Just(Step::Answer),
        1 => Just(Step::Fail),
        1 => (0u64..15).prop_map(Step::Tick),
        1 => Just(Step::Stop),
    ]
}

/// The workers' side as the server keeps it: which ranks are held and
/// which have a call waiting (a connection has one call at a time).
#[derive(Default)]
struct Model {
    held: BTreeSet<Rank>,
    waiting: BTreeMap<Rank, &'static str>,
    connected: bool,
    calls: Vec<(u64, QuorumMember)>,
    /// The waiting votes: step and vote.
    votes: BTreeMap<Rank, (i64, bool)>,
    /// Commits answered (rank by rank).
    commits: u64,
}

impl Model {
    /// Applies the actions, checking the invariants.
    fn apply(&mut self, actions: &[Action], w: usize) -> Result<(), TestCaseError> {
        // The votes as they were before this batch (one vote's answers
        // come together, one per rank).
        let votes = self.votes.clone();
        for a in actions {
            match a {
                Action::Welcome { rank } => {
                    prop_assert!(self.held.insert(*rank), "welcomed twice");
                }
                Action::HelloRefused { .. } => {}
                Action::Connect => {
                    prop_assert!(!self.connected, "connect while connected");
                    self.connected = true;
                }
                Action::DropConnection { .. } => {
                    prop_assert!(self.connected, "drop while not connected");
                    self.connected = false;
                }
                Action::CallLighthouse { call, member, .. } => {
                    prop_assert!(self.connected, "a call without a connection");
                    let quorum_calls = self.waiting.values().filter(|k| **k == "q").count();
                    prop_assert_eq!(quorum_calls, w, "a call before all W arrived");
                    self.calls.push((*call, member.clone()));
                }
                Action::AnswerQuorum { rank, .. } => {
                    prop_assert_eq!(self.waiting.remove(rank), Some("q"), "answered twice");
                }
                Action::AnswerCommit { rank, commit } => {
                    if *commit {
                        let steps: BTreeSet<i64> = votes.values().map(|v| v.0).collect();
                        prop_assert_eq!(votes.len(), w, "a commit before all W voted");
                        prop_assert_eq!(
                            steps.len(),
                            1,
                            "a commit of votes on different steps: {:?}",
                            votes
                        );
                        prop_assert!(votes.values().all(|v| v.1), "a commit with a false vote");
                        self.commits += 1;
                    }
                    prop_assert_eq!(self.waiting.remove(rank), Some("v"), "answered twice");
                    self.votes.remove(rank);
                }
                Action::Fail { rank, .. } => {
                    prop_assert!(self.waiting.remove(rank).is_some(), "failed twice");
                    self.votes.remove(rank);
                }
            }
        }
        Ok(())
    }
}

/// One random order (below): the invariants after every event; the
/// commits answered.
fn run_order(steps: Vec<Step>) -> Result<u64, TestCaseError> {
    let w = 2;
    let start = Instant::now();
    let mut now = start;
    let mut r = Round::new(setup(w));
    let mut m = Model::default();
    for s in steps {
        let ev = match s {
            Step::Hello(rank) => Event::Hello {
                rank,
                world_size: w as u64,
            },
            Step::Gone(rank) => {
                // The server reports only held ranks' connections.
                if !m.held.remove(&rank) {
                    continue;
                }
                Event::RankGone { rank }
            }
            Step::Quorum(rank, step) => {
                if !m.held.contains(&rank) || m.waiting.contains_key(&rank) {
                    continue;
                }
                m.waiting.insert(rank, "q");
                Event::Quorum {
                    rank,
                    call: call(step, rank),
                    now,
                }
            }
            Step::Vote(rank, step, v) => {
                if !m.held.contains(&rank) || m.waiting.contains_key(&rank) {
                    continue;
                }
                m.waiting.insert(rank, "v");
                m.votes.insert(rank, (step, v));
                Event::Vote {
                    rank,
                    step,
                    line: None,
                    vote: v,
                    timeout: T,
                    now,
                }
            }
            Step::Answer => match m.calls.last() {
                Some((call, member)) => Event::LighthouseAnswered {
                    call: *call,
                    quorum: issued(std::slice::from_ref(member)),
                },
                None => continue,
            },
            Step::Fail => match m.calls.last() {
                Some((call, _)) => Event::LighthouseFailed {
                    call: *call,
                    error: "x".into(),
                },
                None => continue,
            },
            Step::Tick(s) => {
                now += Duration::from_secs(s);
                Event::Tick { now }
            }
            Step::Stop => {
                // Every rank is released: the server forgets the old
                // connections.
                m.held.clear();
                Event::WorkersStopped {
                    reason: "stopped".into(),
                }
            }
        };
        let stop = matches!(ev, Event::WorkersStopped { .. } | Event::RankGone { .. });
        let was_connected = m.connected;
        let actions = r.handle(ev);
        m.apply(&actions, w)?;
        if stop {
            prop_assert!(m.waiting.is_empty(), "a stop fails every waiting call");
            prop_assert!(!m.connected, "a stop drops the connection");
            let dropped = actions
                .iter()
                .any(|a| matches!(a, Action::DropConnection { .. }));
            prop_assert_eq!(dropped, was_connected);
            prop_assert_eq!(r.next_deadline(), None);
        }
        if let Some(d) = r.next_deadline() {
            prop_assert!(d > now, "a deadline passed without its tick");
        }
    }
    Ok(m.commits)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Random orders of hellos, calls, answers, votes on random steps,
    /// deadlines and stops: a call is answered at most once; no lighthouse
    /// call before all W arrived; a commit only of W true votes on one
    /// step; a stop fails every waiting call and drops the connection.
    #[test]
    fn invariants_hold_over_random_orders(steps in proptest::collection::vec(step(), 1..60)) {
        run_order(steps)?;
    }
}

/// The random orders do reach commits (else the commit rule above is
/// never checked).
#[test]
fn random_orders_reach_commits() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = proptest::collection::vec(step(), 1..60);
    let mut commits = 0;
    for _ in 0..512 {
        let steps = strategy.new_tree(&mut runner).unwrap().current();
        commits += run_order(steps).unwrap();
    }
    assert!(commits > 0, "no commit in 512 random orders");
}
