//! The policy's table, row by row, in simulated time. Rows named `defect_N` are
//! the failure orders that the policy before it got wrong.

use super::*;
use Action as A;
use Event as E;

const GRACE: Duration = Duration::from_secs(5);
const LINGER_FAILED: Duration = Duration::from_secs(7);

fn limits(max_restarts: u32, hosts_rendezvous: bool) -> Limits {
    Limits {
        max_restarts,
        lost_grace: GRACE,
        hosts_rendezvous,
        linger_after_failure: LINGER_FAILED,
        linger_after_success: None,
        reforms: true,
    }
}

fn policy(max_restarts: u32) -> (Policy, Instant) {
    policy_with(limits(max_restarts, false))
}

fn policy_with(l: Limits) -> (Policy, Instant) {
    let (p, first) = Policy::start(l);
    assert_eq!(first, A::Join);
    (p, Instant::now())
}

/// Drives `events` (each at `t0 + secs`) and returns every action in order.
fn drive(p: &mut Policy, t0: Instant, events: &[(f64, Event)]) -> Vec<Action> {
    events
        .iter()
        .flat_map(|(s, e)| p.on(e.clone(), t0 + Duration::from_secs_f64(*s)))
        .collect()
}

fn running_as(p: &mut Policy, t0: Instant, round: u64, nodes: usize, hosts_job_store: bool) {
    drive(
        p,
        t0,
        &[
            (0.0, E::Joined { round, nodes }),
            (0.0, E::Started { hosts_job_store }),
        ],
    );
    assert!(
        matches!(p.phase(), Phase::Running { .. }),
        "{:?}",
        p.phase()
    );
}

fn running(p: &mut Policy, t0: Instant, round: u64) {
    running_as(p, t0, round, 2, false);
}

fn term() -> Action {
    A::Stop {
        signal: libc::SIGTERM,
    }
}

fn record(rank: usize, time: f64) -> Box<FailureRecord> {
    Box::new(FailureRecord {
        time,
        host: "h".into(),
        group_rank: 0,
        rank,
        local_rank: rank,
        round: 0,
        pid: 1,
        exitcode: 1,
        exit: "exit code 1".into(),
        message: "boom".into(),
        traceback: String::new(),
        error_file: "<N/A>".into(),
    })
}

fn changed(waiting: usize, dead: usize, finishing: bool) -> Event {
    E::Checked(Observation::Changed {
        waiting,
        dead,
        finishing,
        lost: Vec::new(),
    })
}

#[test]
fn success_publishes_closes_counts_and_finishes() {
    let (mut p, t0) = policy(0);
    running(&mut p, t0, 0);
    let ok = Verdict::Succeeded {
        round: 0,
        barrier: None,
    };
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, E::WorkersSucceeded),
            (2.0, E::BarrierPassed),
            (2.1, E::Published(Closed::Succeeded)),
            (2.2, E::RendezvousClosed),
            (2.3, E::MarkedFinished),
        ],
    );
    assert_eq!(
        a,
        [
            A::EnterBarrier { round: 0 },
            A::Publish(Publish::Succeeded),
            A::CloseRendezvous,
            A::MarkFinished { round: 0 },
            A::Finish(ok),
        ]
    );
}

#[test]
fn a_failure_within_budget_stops_records_and_rejoins() {
    let (mut p, t0) = policy(2);
    running(&mut p, t0, 0);
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, E::WorkerFailed),
            (
                1.1,
                E::Stopped {
                    failure: Some(record(0, 1.0)),
                },
            ),
            (
                1.2,
                E::FailureRecorded {
                    failed_rounds: 2,
                    finishing: false,
                },
            ),
        ],
    );
    assert_eq!(
        a,
        [
            term(),
            A::RecordFailure { round: 0 },
            A::NoteRestart { failed_rounds: 2 },
            A::Join
        ]
    );
    assert_eq!(p.phase(), &Phase::Rendezvous);
}

#[test]
fn a_failure_beyond_the_budget_publishes_the_failure_then_closes() {
    let (mut p, t0) = policy(2);
    running(&mut p, t0, 3);
    let local = record(1, 1.0);
    let earlier = record(7, 0.5);
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, E::WorkerFailed),
            (
                1.1,
                E::Stopped {
                    failure: Some(local.clone()),
                },
            ),
            (
                1.2,
                E::FailureRecorded {
                    failed_rounds: 3,
                    finishing: false,
                },
            ),
            // The store's root cause is an earlier failure on another node.
            (1.3, E::Published(Closed::Failed(Some(earlier.clone())))),
            (1.4, E::RendezvousClosed),
            (1.5, E::MarkedFinished),
        ],
    );
    assert_eq!(
        a,
        [
            term(),
            A::RecordFailure { round: 3 },
            A::Publish(Publish::Failed { local: Some(local) }),
            A::CloseRendezvous,
            A::MarkFinished { round: 3 },
            A::Finish(Verdict::Failed {
                why: Failure::OutOfRestarts { failed_rounds: 3 },
                root: Some(earlier),
            }),
        ]
    );
}

#[test]
fn defect_3_an_unrecorded_failure_is_retried_then_fails_without_closing() {
    let (mut p, t0) = policy(5);
    running(&mut p, t0, 0);
    let local = record(0, 1.0);
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, E::WorkerFailed),
            (
                1.1,
                E::Stopped {
                    failure: Some(local.clone()),
                },
            ),
            (3.1, E::FailureNotRecorded("timeout".into())),
        ],
    );
    assert_eq!(
        a,
        [
            term(),
            A::RecordFailure { round: 0 },
            A::NoteRecordRetry {
                error: "timeout".into()
            },
            A::RecordFailure { round: 0 },
        ]
    );
    // Within the grace it is retried; past it the node fails, and never closes
    // the run (a close without a verdict reads as success elsewhere).
    let a = drive(
        &mut p,
        t0,
        &[(6.2, E::FailureNotRecorded("timeout".into()))],
    );
    assert_eq!(
        a,
        [A::Finish(Verdict::Failed {
            why: Failure::Unrecorded,
            root: Some(local)
        })]
    );
}

#[test]
fn defect_3_a_local_start_failure_publishes_the_failure() {
    let (mut p, t0) = policy(3);
    drive(&mut p, t0, &[(0.0, E::Joined { round: 4, nodes: 2 })]);
    let a = p.on(
        E::StartFailed(StartError::Local("no such program".into())),
        t0,
    );
    assert_eq!(a, [A::Publish(Publish::Failed { local: None })]);
    assert!(matches!(
        p.phase(),
        Phase::Ending {
            step: EndStep::Publish,
            ..
        }
    ));
}

#[test]
fn defect_3_a_worker_failure_after_a_close_on_success_publishes_the_failure() {
    let (mut p, t0) = policy(5);
    running(&mut p, t0, 0);
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, E::Checked(Observation::Closed(Closed::Succeeded))),
            (2.0, E::WorkerFailed),
            (
                2.1,
                E::Stopped {
                    failure: Some(record(0, 2.0)),
                },
            ),
            // Budget left, but there are no more rounds.
            (
                2.2,
                E::FailureRecorded {
                    failed_rounds: 1,
                    finishing: false,
                },
            ),
        ],
    );
    assert_eq!(
        a,
        [
            A::NoteClosedAfterSuccess { round: 0 },
            term(),
            A::RecordFailure { round: 0 },
            A::Publish(Publish::Failed {
                local: Some(record(0, 2.0))
            }),
        ]
    );
}

#[test]
fn defect_3_an_unpublished_verdict_is_never_followed_by_a_close() {
    for v in [
        E::WorkersSucceeded,
        E::WorkerFailed, // with max_restarts 0
    ] {
        let (mut p, t0) = policy(0);
        running(&mut p, t0, 0);
        let a = match v {
            E::WorkersSucceeded => drive(
                &mut p,
                t0,
                &[
                    (1.0, E::WorkersSucceeded),
                    (1.1, E::BarrierPassed),
                    (1.2, E::NotPublished("refused".into())),
                ],
            ),
            _ => drive(
                &mut p,
                t0,
                &[
                    (1.0, E::WorkerFailed),
                    (1.1, E::Stopped { failure: None }),
                    (
                        1.2,
                        E::FailureRecorded {
                            failed_rounds: 1,
                            finishing: false,
                        },
                    ),
                    (1.3, E::NotPublished("refused".into())),
                ],
            ),
        };
        assert!(!a.contains(&A::CloseRendezvous), "{a:?}");
        let last = a.last().unwrap();
        assert!(
            matches!(last, A::Finish(Verdict::Failed { .. })),
            "{last:?}"
        );
    }
}

#[test]
fn defect_4_a_member_lost_while_starting_re_forms_without_spending_the_budget() {
    let (mut p, t0) = policy(0);
    drive(&mut p, t0, &[(0.0, E::Joined { round: 0, nodes: 3 })]);
    assert_eq!(p.on(E::Checked(Observation::Healthy), t0), []);
    let a = p.on(changed(0, 1, false), t0);
    assert_eq!(
        a,
        [
            A::NoteReform {
                round: 0,
                waiting: 0,
                dead: 1,
                lost: Vec::new(),
            },
            A::Join
        ]
    );
    // A store step that failed in the start re-forms too.
    let (mut p, t0) = policy(0);
    drive(&mut p, t0, &[(0.0, E::Joined { round: 0, nodes: 3 })]);
    let a = p.on(E::StartFailed(StartError::Store("timed out".into())), t0);
    assert_eq!(a.last(), Some(&A::Join));
    assert!(!a.iter().any(|a| matches!(a, A::Finish(_))), "{a:?}");
}

#[test]
fn defect_6_a_barrier_error_with_a_failure_published_fails_the_node() {
    let (mut p, t0) = policy(0);
    running(&mut p, t0, 0);
    p.on(E::WorkersSucceeded, t0);
    let root = record(3, 0.5);
    let a = p.on(
        E::BarrierFailed {
            error: "timed out".into(),
            timed_out: true,
            seen: Observation::Closed(Closed::Failed(Some(root.clone()))),
        },
        t0,
    );
    assert_eq!(a, [A::CloseRendezvous]);
    let a = p.on(E::RendezvousClosed, t0);
    assert_eq!(a, [A::MarkFinished { round: 0 }]);
    assert_eq!(
        p.on(E::MarkedFinished, t0),
        [A::Finish(Verdict::Failed {
            why: Failure::Elsewhere,
            root: Some(root)
        })]
    );
}

#[test]
fn a_barrier_timeout_publishes_success_but_a_failure_published_meanwhile_wins() {
    let (mut p, t0) = policy(0);
    running(&mut p, t0, 0);
    p.on(E::WorkersSucceeded, t0);
    let a = p.on(
        E::BarrierFailed {
            error: "node 1 never came".into(),
            timed_out: true,
            seen: Observation::Healthy,
        },
        t0,
    );
    assert_eq!(a, [A::Publish(Publish::Succeeded)]);
    let root = record(1, 3.0);
    p.on(E::Published(Closed::Failed(Some(root.clone()))), t0);
    p.on(E::RendezvousClosed, t0);
    assert_eq!(
        p.on(E::MarkedFinished, t0),
        [A::Finish(Verdict::Failed {
            why: Failure::Elsewhere,
            root: Some(root)
        })]
    );
}

#[test]
fn a_barrier_lost_store_fails_without_closing() {
    let (mut p, t0) = policy(0);
    running(&mut p, t0, 0);
    p.on(E::WorkersSucceeded, t0);
    let a = p.on(
        E::BarrierFailed {
            error: "refused".into(),
            timed_out: false,
            seen: Observation::Unreachable("refused".into()),
        },
        t0,
    );
    assert_eq!(
        a,
        [A::Finish(Verdict::Failed {
            why: Failure::LostRendezvous {
                during: During::ExitBarrier
            },
            root: None
        })]
    );
}

#[test]
fn defect_1_and_2_hosts_linger_until_every_node_finished() {
    // The job store's host (rank 0 of the round) lingers even though it does
    // not host the rendezvous; unbounded after a barrier that timed out (others
    // may still run; the backend sees deaths).
    let (mut p, t0) = policy(0);
    running_as(&mut p, t0, 0, 3, true);
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, E::WorkersSucceeded),
            (
                2.0,
                E::BarrierFailed {
                    error: "timed out".into(),
                    timed_out: true,
                    seen: Observation::Healthy,
                },
            ),
            (2.1, E::Published(Closed::Succeeded)),
            (2.2, E::RendezvousClosed),
            (2.3, E::MarkedFinished),
        ],
    );
    assert_eq!(
        a.last(),
        Some(&A::Linger {
            round: 0,
            nodes: 3,
            bound: None,
            after_barrier: false,
            serves: true,
        })
    );
    // After a barrier that passed, every member's workers are done: bounded,
    // and a rendezvous host that ended ends it.
    let (mut p, t0) = policy(0);
    running_as(&mut p, t0, 0, 3, true);
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, E::WorkersSucceeded),
            (2.0, E::BarrierPassed),
            (2.1, E::Published(Closed::Succeeded)),
            (2.2, E::RendezvousClosed),
            (2.3, E::MarkedFinished),
        ],
    );
    assert_eq!(
        a.last(),
        Some(&A::Linger {
            round: 0,
            nodes: 3,
            bound: Some(LINGER_FAILED),
            after_barrier: true,
            serves: true,
        })
    );
    // After a failure, bounded.
    let (mut p, t0) = policy_with(limits(0, true));
    running_as(&mut p, t0, 0, 3, false);
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, E::WorkerFailed),
            (1.1, E::Stopped { failure: None }),
            (
                1.2,
                E::FailureRecorded {
                    failed_rounds: 1,
                    finishing: false,
                },
            ),
            (1.3, E::Published(Closed::Failed(None))),
            (1.4, E::RendezvousClosed),
            (1.5, E::MarkedFinished),
        ],
    );
    assert_eq!(
        a.last(),
        Some(&A::Linger {
            round: 0,
            nodes: 3,
            bound: Some(LINGER_FAILED),
            after_barrier: false,
            serves: true,
        })
    );
    // A lone node lingers only if it serves the rendezvous store (spares
    // may still read the verdict from it; the census ends the wait at once
    // when nobody else was ever a member).
    for hosts_rendezvous in [true, false] {
        let (mut p, t0) = policy_with(limits(0, hosts_rendezvous));
        running_as(&mut p, t0, 0, 1, hosts_rendezvous);
        let a = drive(
            &mut p,
            t0,
            &[
                (1.0, E::WorkersSucceeded),
                (2.0, E::BarrierPassed),
                (2.1, E::Published(Closed::Succeeded)),
                (2.2, E::RendezvousClosed),
                (2.3, E::MarkedFinished),
            ],
        );
        if hosts_rendezvous {
            assert!(matches!(a.last(), Some(A::Linger { .. })), "{a:?}");
        } else {
            assert!(matches!(a.last(), Some(A::Finish(_))), "{a:?}");
        }
    }
    // A spare that serves the rendezvous store lingers for the members.
    let (mut p, t0) = policy_with(limits(0, true));
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, E::JoinClosed),
            (1.1, E::VerdictRead(Some(Closed::Succeeded))),
        ],
    );
    assert!(matches!(a.last(), Some(A::Linger { .. })), "{a:?}");
}

#[test]
fn nodes_waiting_or_a_dead_member_re_form_without_spending_the_budget() {
    let (mut p, t0) = policy(0);
    running(&mut p, t0, 0);
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, changed(1, 0, false)),
            // A worker exiting during the re-form is part of the stop.
            (1.1, E::WorkerFailed),
            (1.2, E::Stopped { failure: None }),
        ],
    );
    assert_eq!(
        a,
        [
            A::NoteReform {
                round: 0,
                waiting: 1,
                dead: 0,
                lost: Vec::new(),
            },
            term(),
            A::Join
        ]
    );
}

#[test]
fn defect_8_nodes_arriving_while_a_member_finished_do_not_re_form_the_round() {
    let (mut p, t0) = policy(0);
    running(&mut p, t0, 0);
    assert_eq!(p.on(changed(1, 0, true), t0), []);
    assert!(matches!(p.phase(), Phase::Running { .. }));
    // A member that died still re-forms the round.
    assert_eq!(p.on(changed(1, 1, true), t0).last(), Some(&term()));
}

#[test]
fn defect_8_a_former_member_whose_join_ends_at_a_failed_close_fails() {
    let (mut p, t0) = policy(1);
    running(&mut p, t0, 0);
    let root = record(2, 1.0);
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, changed(1, 0, false)),
            (1.1, E::Stopped { failure: None }),
            (2.0, E::JoinClosed),
            (
                2.1,
                E::VerdictRead(Some(Closed::Failed(Some(root.clone())))),
            ),
            (2.2, E::MarkedFinished),
        ],
    );
    assert_eq!(
        a.last(),
        Some(&A::Finish(Verdict::Failed {
            why: Failure::Elsewhere,
            root: Some(root)
        }))
    );
    // A spare that never ran: not needed after a success.
    let (mut p, t0) = policy(1);
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, E::JoinClosed),
            (1.1, E::VerdictRead(Some(Closed::Succeeded))),
        ],
    );
    assert_eq!(a, [A::ReadVerdict, A::Finish(Verdict::NotNeeded)]);
}

#[test]
fn a_run_closed_after_success_elsewhere_never_stops_healthy_workers() {
    let (mut p, t0) = policy(3);
    running(&mut p, t0, 0);
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, E::Checked(Observation::Closed(Closed::Succeeded))),
            (2.0, E::Checked(Observation::Closed(Closed::Succeeded))),
            // A node that finished and waits is not a re-form.
            (3.0, changed(1, 0, false)),
            // 300 s later our workers finish too.
            (300.0, E::WorkersSucceeded),
            (300.0, E::BarrierPassed),
        ],
    );
    assert_eq!(
        a,
        [
            A::NoteClosedAfterSuccess { round: 0 },
            A::EnterBarrier { round: 0 },
            A::Publish(Publish::Succeeded),
        ]
    );
}

#[test]
fn a_member_dying_after_a_close_on_success_fails_the_job() {
    let (mut p, t0) = policy(3);
    running(&mut p, t0, 0);
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, E::Checked(Observation::Closed(Closed::Succeeded))),
            (2.0, changed(0, 1, true)),
            (2.5, E::Stopped { failure: None }),
        ],
    );
    assert_eq!(
        a,
        [
            A::NoteClosedAfterSuccess { round: 0 },
            term(),
            A::Publish(Publish::Failed { local: None }),
        ]
    );
}

#[test]
fn a_run_closed_after_failure_elsewhere_stops_the_workers() {
    let (mut p, t0) = policy(3);
    running(&mut p, t0, 0);
    let a = drive(
        &mut p,
        t0,
        &[
            (1.0, E::Checked(Observation::Closed(Closed::Failed(None)))),
            (1.5, E::Stopped { failure: None }),
        ],
    );
    assert_eq!(a, [term(), A::CloseRendezvous]);
}

#[test]
fn an_unreachable_rendezvous_is_tolerated_for_the_grace_then_fails() {
    let (mut p, t0) = policy(3);
    running(&mut p, t0, 0);
    let gone = || E::Checked(Observation::Unreachable("refused".into()));
    let a = drive(&mut p, t0, &[(1.0, gone()), (5.9, gone())]);
    assert_eq!(
        a,
        [A::NoteUnreachable {
            error: "refused".into()
        }]
    );
    // Back in time: the grace starts afresh.
    let a = drive(
        &mut p,
        t0,
        &[
            (6.0, E::Checked(Observation::Healthy)),
            (7.0, gone()),
            (11.9, gone()),
        ],
    );
    assert_eq!(a.len(), 1, "{a:?}");
    let a = drive(
        &mut p,
        t0,
        &[(12.0, gone()), (12.5, E::Stopped { failure: None })],
    );
    assert_eq!(
        a,
        [
            term(),
            A::Finish(Verdict::Failed {
                why: Failure::LostRendezvous {
                    during: During::Running
                },
                root: None
            })
        ]
    );
}

/// Defect 7's kin: every wait on the store ends within the grace, not the
/// store's or the barrier's own timeout.
#[test]
fn an_unreachable_rendezvous_ends_a_start_and_an_exit_barrier_after_the_grace() {
    let gone = || E::Checked(Observation::Unreachable("refused".into()));
    let lost = |during| {
        A::Finish(Verdict::Failed {
            why: Failure::LostRendezvous { during },
            root: None,
        })
    };
    // Starting.
    let (mut p, t0) = policy(3);
    drive(&mut p, t0, &[(0.0, E::Joined { round: 0, nodes: 2 })]);
    let a = drive(&mut p, t0, &[(1.0, gone()), (5.9, gone())]);
    assert_eq!(a.len(), 1, "{a:?}");
    assert_eq!(
        drive(&mut p, t0, &[(6.0, gone())]),
        [lost(During::Starting)]
    );
    // The exit barrier (its own timeout is 300 s).
    let (mut p, t0) = policy(3);
    running(&mut p, t0, 0);
    drive(&mut p, t0, &[(1.0, E::WorkersSucceeded)]);
    let a = drive(
        &mut p,
        t0,
        &[(2.0, gone()), (4.0, E::Checked(Observation::Healthy))],
    );
    assert_eq!(a.len(), 1, "{a:?}");
    let a = drive(&mut p, t0, &[(5.0, gone()), (9.9, gone())]);
    assert_eq!(a.len(), 1, "back in time: the grace starts afresh: {a:?}");
    assert_eq!(
        drive(&mut p, t0, &[(10.0, gone())]),
        [lost(During::ExitBarrier)]
    );
}

#[test]
fn a_signal_in_each_phase() {
    let sig = libc::SIGINT;
    let up = || {
        vec![
            E::Joined { round: 0, nodes: 2 },
            E::Started {
                hosts_job_store: false,
            },
        ]
    };
    let with = |more: Vec<Event>| up().into_iter().chain(more).collect::<Vec<_>>();
    let cases: Vec<(&str, Vec<Event>, Vec<Action>)> = vec![
        (
            "rendezvous",
            vec![],
            vec![A::Finish(Verdict::Signaled(sig))],
        ),
        (
            "starting",
            vec![E::Joined { round: 0, nodes: 2 }],
            vec![A::Finish(Verdict::Signaled(sig))],
        ),
        ("running", up(), vec![A::Stop { signal: sig }]),
        (
            "recording a failure",
            with(vec![E::WorkerFailed, E::Stopped { failure: None }]),
            vec![A::Finish(Verdict::Signaled(sig))],
        ),
        (
            "exit barrier",
            with(vec![E::WorkersSucceeded]),
            vec![A::Finish(Verdict::Signaled(sig))],
        ),
        (
            "stopping for a re-form",
            with(vec![changed(1, 0, false)]),
            vec![],
        ),
        (
            "publishing a success",
            with(vec![E::WorkersSucceeded, E::BarrierPassed]),
            vec![A::Finish(Verdict::Succeeded {
                round: 0,
                barrier: None,
            })],
        ),
    ];
    for (name, before, expected) in cases {
        let (mut p, t0) = policy(1);
        for e in before {
            p.on(e, t0);
        }
        assert_eq!(p.on(E::Signal(sig), t0), expected, "signal during {name}");
    }
}

#[test]
fn a_signal_while_stopping_ends_as_signalled_and_a_second_kills() {
    let (mut p, t0) = policy(1);
    running(&mut p, t0, 0);
    p.on(changed(1, 0, false), t0);
    assert_eq!(p.on(E::Signal(libc::SIGTERM), t0), []);
    assert_eq!(p.on(E::Signal(libc::SIGTERM), t0), [A::Kill]);
    assert_eq!(
        p.on(E::Stopped { failure: None }, t0),
        [A::Finish(Verdict::Signaled(libc::SIGTERM))]
    );
    // Running: the signal is forwarded, then the agent ends with it.
    let (mut p, t0) = policy(1);
    running(&mut p, t0, 0);
    assert_eq!(
        p.on(E::Signal(libc::SIGINT), t0),
        [A::Stop {
            signal: libc::SIGINT
        }]
    );
    assert_eq!(p.on(E::Signal(libc::SIGINT), t0), [A::Kill]);
    assert_eq!(
        p.on(E::Stopped { failure: None }, t0),
        [A::Finish(Verdict::Signaled(libc::SIGINT))]
    );
}

#[test]
fn join_outcomes() {
    let (mut p, t0) = policy(0);
    assert_eq!(
        p.on(E::JoinFailed("timed out".into()), t0),
        [A::Finish(Verdict::JoinFailed("timed out".into()))]
    );
    // Closed with nothing published and never a member: not needed.
    let (mut p, t0) = policy(0);
    assert_eq!(p.on(E::JoinClosed, t0), [A::ReadVerdict]);
    assert_eq!(
        p.on(E::VerdictRead(None), t0),
        [A::Finish(Verdict::NotNeeded)]
    );
}

#[test]
fn stale_events_are_ignored() {
    let (mut p, t0) = policy(0);
    // A check result arriving after the agent left Running.
    assert_eq!(p.on(E::Checked(Observation::Healthy), t0), []);
    assert_eq!(p.on(E::Stopped { failure: None }, t0), []);
    assert_eq!(p.phase(), &Phase::Rendezvous);
}
