//! The agent's decisions, without I/O: `(phase, event, now) -> actions`.
//!
//! The driver in `mod.rs` performs every [`Action`] (a store round trip, a start,
//! a stop), reports what happened as an [`Event`] with the time, and applies what
//! [`Policy::on`] returns. Nothing here blocks, reads a clock or touches a store,
//! so every row of the table below is tested with simulated time.
//!
//! | phase | event | actions | next phase |
//! |---|---|---|---|
//! | `Rendezvous` | joined round r | start workers | `Starting` |
//! | `Rendezvous` | join failed: closed, spare not needed, error | finish | `Done` |
//! | `Starting` | started | | `Running` |
//! | `Starting` | start failed | finish (error) | `Done` |
//! | `Running` | all workers succeeded | enter the exit barrier | `ExitBarrier` |
//! | `Running` | a worker failed | stop the rest (SIGTERM) | `Stopping(failure)` |
//! | `Running` | nodes waiting, member dead | stop (SIGTERM) | `Stopping(re-form)` |
//! | `Running` | run closed after a success elsewhere | none: the workers go on, no more rounds | `Running` |
//! | `Running` | run closed after a failure elsewhere | stop (SIGTERM) | `Stopping(failed elsewhere)` |
//! | `Running` | rendezvous unreachable for `lost_grace` | stop (SIGTERM) | `Stopping(lost)` |
//! | `Running` | signal N | stop with N | `Stopping(signal N)` |
//! | `Stopping(failure)` | stopped | record the failure | `RecordingFailure` |
//! | `Stopping(re-form)` | stopped | join | `Rendezvous` |
//! | `Stopping(other)` | stopped | finish | `Done` |
//! | `Stopping(..)` | signal N | finish as signalled once stopped; a second signal kills | `Stopping(signal N)` |
//! | `RecordingFailure` | recorded, budget left | join | `Rendezvous` |
//! | `RecordingFailure` | recorded, budget spent; or the store is gone | close the run as failed, finish | `Done` |
//! | `ExitBarrier` | passed, or timed out with the store reachable | close the run as succeeded, finish | `Done` |
//! | `ExitBarrier` | rendezvous store lost | finish (failed: outcome unknown) | `Done` |
//! | `ExitBarrier` | run closed after a failure elsewhere | finish (failed) | `Done` |
//! | any but `Running`/`Stopping` | signal N | finish (signalled; nothing runs) | `Done` |
//!
//! A worker that exits while the group re-forms (`Stopping(re-form)`) is part of
//! the stop; the round is restarted whatever it returned. A closed run is never
//! a reason by itself to stop healthy workers: only a failure recorded by the node
//! that closed it is (torchrun stops the workers of a node whose exit barrier ran
//! out while another node closed the run after success).

use std::time::{Duration, Instant};

use super::FailureRecord;

/// Why the workers are being stopped.
#[derive(Debug, Clone, PartialEq)]
pub enum StopReason {
    /// A local worker failed; the rest go down with it (all or nothing).
    WorkerFailed,
    /// Nodes are waiting or a member died: the group re-forms.
    Reform,
    /// Another node closed the run after a failure.
    FailedElsewhere(Option<Box<FailureRecord>>),
    /// The rendezvous store has been unreachable for the grace period.
    LostRendezvous,
    /// A trapped signal (forwarded to the workers).
    Signal(i32),
}

/// Where the agent is.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// Joining the next round.
    Rendezvous,
    /// Ranks, the job store, spawning.
    Starting {
        round: u64,
    },
    /// Workers running. `closed` once another node closed the run after success
    /// (no more rounds); `unreachable_since` while the rendezvous cannot be read.
    Running {
        round: u64,
        closed: bool,
        unreachable_since: Option<Instant>,
    },
    Stopping {
        round: u64,
        why: StopReason,
    },
    /// Appending the failure to the run's log and counting the round.
    RecordingFailure {
        round: u64,
    },
    /// Local workers succeeded; waiting for every node.
    ExitBarrier {
        round: u64,
    },
    Done(Verdict),
}

impl Phase {
    /// A short name, for status and events.
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Rendezvous => "rendezvous",
            Phase::Starting { .. } => "starting",
            Phase::Running { .. } => "running",
            Phase::Stopping { .. } => "stopping",
            Phase::RecordingFailure { .. } => "recording_failure",
            Phase::ExitBarrier { .. } => "exit_barrier",
            Phase::Done(v) => v.name(),
        }
    }
}

/// How the run ended for this node, as the policy sees it (the driver adds what
/// it read from the stores).
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Succeeded {
        round: u64,
        /// Set when the exit barrier did not complete (with why).
        barrier: Option<String>,
    },
    /// Workers failed beyond the restart budget here.
    OutOfRestarts {
        failed_rounds: u64,
    },
    /// Workers failed and the failure could not be recorded (store gone).
    Unrecorded,
    FailedElsewhere(Option<Box<FailureRecord>>),
    /// The rendezvous store went away while the job ran.
    LostRendezvous {
        during: &'static str,
    },
    Signaled(i32),
    /// A spare, not needed.
    NotNeeded,
    /// The run was closed while joining.
    ClosedWhileJoining,
    /// The join failed (timeout, unreachable, ...).
    JoinFailed(String),
    /// Workers could not be started (or ranks not assigned).
    StartFailed(String),
}

impl Verdict {
    pub fn name(&self) -> &'static str {
        match self {
            Verdict::Succeeded { .. } => "succeeded",
            Verdict::NotNeeded => "not_needed",
            Verdict::Signaled(_) => "signaled",
            _ => "failed",
        }
    }
}

/// What the rendezvous looks like from a running node.
#[derive(Debug, Clone, PartialEq)]
pub enum Observation {
    Healthy,
    /// Nodes waiting to join, or members found dead.
    NodesWaiting(usize),
    ClosedAfterSuccess,
    ClosedAfterFailure(Option<Box<FailureRecord>>),
    /// A check failed or did not answer in time.
    Unreachable(String),
}

/// How the exit barrier ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Barrier {
    Passed,
    /// Some nodes did not arrive in time; the store was reachable.
    TimedOut(String),
    /// The store went away.
    Lost(String),
}

/// What the driver observed.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Joined { round: u64 },
    JoinClosed,
    JoinNotNeeded,
    JoinFailed(String),
    Started,
    StartFailed(String),
    WorkersSucceeded,
    WorkerFailed,
    Checked(Observation),
    Stopped,
    FailureRecorded { failed_rounds: u64 },
    FailureNotRecorded,
    Barrier(Barrier),
    Signal(i32),
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Join,
    Start {
        round: u64,
    },
    /// Signal every worker group, SIGKILL after the grace; answer [`Event::Stopped`].
    Stop {
        signal: i32,
    },
    /// SIGKILL whatever still runs now (a second signal while stopping).
    Kill,
    RecordFailure {
        round: u64,
    },
    EnterBarrier {
        round: u64,
    },
    /// Another node closed the run after success: no more rounds.
    NoteClosedAfterSuccess {
        round: u64,
    },
    /// The rendezvous stopped answering; say so once.
    NoteUnreachable {
        error: String,
    },
    /// Re-forming for nodes waiting or lost.
    NoteReform {
        round: u64,
        waiting: usize,
    },
    /// A failure within the budget: the group restarts.
    NoteRestart {
        failed_rounds: u64,
    },
    Finish(Verdict),
}

/// The agent's policy knobs.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_restarts: u32,
    /// How long the rendezvous may stay unreachable while workers run.
    pub lost_grace: Duration,
}

/// The policy of one agent.
#[derive(Debug, Clone)]
pub struct Policy {
    limits: Limits,
    phase: Phase,
}

impl Policy {
    /// A policy that starts by joining; returns it and the first action.
    pub fn start(limits: Limits) -> (Policy, Action) {
        (
            Policy {
                limits,
                phase: Phase::Rendezvous,
            },
            Action::Join,
        )
    }

    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// The actions after `event`, observed at `now`.
    pub fn on(&mut self, event: Event, now: Instant) -> Vec<Action> {
        use Action as A;
        use Event as E;
        let phase = std::mem::replace(&mut self.phase, Phase::Rendezvous);
        let (next, actions) = match (phase, event) {
            // A signal where no worker runs ends the agent at once.
            (
                Phase::Rendezvous
                | Phase::Starting { .. }
                | Phase::RecordingFailure { .. }
                | Phase::ExitBarrier { .. },
                E::Signal(s),
            ) => finish(Verdict::Signaled(s)),
            (Phase::Running { round, .. }, E::Signal(s)) => (
                Phase::Stopping {
                    round,
                    why: StopReason::Signal(s),
                },
                vec![A::Stop { signal: s }],
            ),
            // Already stopping: end as signalled; a second signal kills.
            (Phase::Stopping { round, why }, E::Signal(s)) => {
                let again = matches!(why, StopReason::Signal(_));
                (
                    Phase::Stopping {
                        round,
                        why: StopReason::Signal(s),
                    },
                    if again { vec![A::Kill] } else { vec![] },
                )
            }

            (Phase::Rendezvous, E::Joined { round }) => {
                (Phase::Starting { round }, vec![A::Start { round }])
            }
            (Phase::Rendezvous, E::JoinClosed) => finish(Verdict::ClosedWhileJoining),
            (Phase::Rendezvous, E::JoinNotNeeded) => finish(Verdict::NotNeeded),
            (Phase::Rendezvous, E::JoinFailed(e)) => finish(Verdict::JoinFailed(e)),

            (Phase::Starting { round }, E::Started) => (
                Phase::Running {
                    round,
                    closed: false,
                    unreachable_since: None,
                },
                vec![],
            ),
            (Phase::Starting { .. }, E::StartFailed(e)) => finish(Verdict::StartFailed(e)),

            (Phase::Running { round, .. }, E::WorkersSucceeded) => (
                Phase::ExitBarrier { round },
                vec![A::EnterBarrier { round }],
            ),
            (Phase::Running { round, .. }, E::WorkerFailed) => {
                stop(round, StopReason::WorkerFailed)
            }
            (
                Phase::Running {
                    round,
                    closed,
                    unreachable_since,
                },
                E::Checked(obs),
            ) => self.running_checked(round, closed, unreachable_since, obs, now),

            (Phase::Stopping { round, why }, E::Stopped) => match why {
                StopReason::WorkerFailed => (
                    Phase::RecordingFailure { round },
                    vec![A::RecordFailure { round }],
                ),
                StopReason::Reform => (Phase::Rendezvous, vec![A::Join]),
                StopReason::FailedElsewhere(r) => finish(Verdict::FailedElsewhere(r)),
                StopReason::LostRendezvous => finish(Verdict::LostRendezvous { during: "running" }),
                StopReason::Signal(s) => finish(Verdict::Signaled(s)),
            },
            // Workers exiting while being stopped are part of the stop.
            (p @ Phase::Stopping { .. }, E::WorkerFailed | E::WorkersSucceeded | E::Checked(_)) => {
                (p, vec![])
            }

            (Phase::RecordingFailure { .. }, E::FailureRecorded { failed_rounds })
                if failed_rounds <= u64::from(self.limits.max_restarts) =>
            {
                (
                    Phase::Rendezvous,
                    vec![A::NoteRestart { failed_rounds }, A::Join],
                )
            }
            (Phase::RecordingFailure { .. }, E::FailureRecorded { failed_rounds }) => {
                finish(Verdict::OutOfRestarts { failed_rounds })
            }
            (Phase::RecordingFailure { .. }, E::FailureNotRecorded) => finish(Verdict::Unrecorded),

            (Phase::ExitBarrier { round }, E::Barrier(Barrier::Passed)) => {
                finish(Verdict::Succeeded {
                    round,
                    barrier: None,
                })
            }
            (Phase::ExitBarrier { round }, E::Barrier(Barrier::TimedOut(why))) => {
                finish(Verdict::Succeeded {
                    round,
                    barrier: Some(why),
                })
            }
            (Phase::ExitBarrier { .. }, E::Barrier(Barrier::Lost(_))) => {
                finish(Verdict::LostRendezvous {
                    during: "the exit barrier",
                })
            }
            (Phase::ExitBarrier { .. }, E::Checked(Observation::ClosedAfterFailure(r))) => {
                finish(Verdict::FailedElsewhere(r))
            }
            // Membership changes after this node finished do not concern it; a
            // lost store shows in the barrier itself.
            (p @ Phase::ExitBarrier { .. }, E::Checked(_)) => (p, vec![]),

            // Anything else is stale (e.g. a check that raced a phase change).
            (p, _) => (p, vec![]),
        };
        self.phase = next;
        actions
    }

    fn running_checked(
        &self,
        round: u64,
        closed: bool,
        unreachable_since: Option<Instant>,
        obs: Observation,
        now: Instant,
    ) -> (Phase, Vec<Action>) {
        let running = |closed, unreachable_since| Phase::Running {
            round,
            closed,
            unreachable_since,
        };
        match obs {
            Observation::Healthy => (running(closed, None), vec![]),
            // No more rounds once the run is closed: nobody re-forms.
            Observation::NodesWaiting(_) if closed => (running(closed, None), vec![]),
            Observation::NodesWaiting(n) => {
                let (p, mut a) = stop(round, StopReason::Reform);
                a.insert(0, Action::NoteReform { round, waiting: n });
                (p, a)
            }
            Observation::ClosedAfterSuccess if closed => (running(true, None), vec![]),
            Observation::ClosedAfterSuccess => (
                running(true, None),
                vec![Action::NoteClosedAfterSuccess { round }],
            ),
            Observation::ClosedAfterFailure(r) => stop(round, StopReason::FailedElsewhere(r)),
            Observation::Unreachable(error) => match unreachable_since {
                None => (
                    running(closed, Some(now)),
                    vec![Action::NoteUnreachable { error }],
                ),
                Some(since) if now.duration_since(since) >= self.limits.lost_grace => {
                    stop(round, StopReason::LostRendezvous)
                }
                Some(since) => (running(closed, Some(since)), vec![]),
            },
        }
    }
}

fn finish(v: Verdict) -> (Phase, Vec<Action>) {
    (Phase::Done(v.clone()), vec![Action::Finish(v)])
}

fn stop(round: u64, why: StopReason) -> (Phase, Vec<Action>) {
    (
        Phase::Stopping { round, why },
        vec![Action::Stop {
            signal: libc::SIGTERM,
        }],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action as A;
    use Event as E;

    const GRACE: Duration = Duration::from_secs(5);

    fn policy(max_restarts: u32) -> (Policy, Instant) {
        let (p, first) = Policy::start(Limits {
            max_restarts,
            lost_grace: GRACE,
        });
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

    fn running(p: &mut Policy, t0: Instant, round: u64) {
        drive(p, t0, &[(0.0, E::Joined { round }), (0.0, E::Started)]);
        assert!(
            matches!(p.phase(), Phase::Running { .. }),
            "{:?}",
            p.phase()
        );
    }

    fn term() -> Action {
        A::Stop {
            signal: libc::SIGTERM,
        }
    }

    #[test]
    fn success_goes_through_the_exit_barrier() {
        let (mut p, t0) = policy(0);
        running(&mut p, t0, 0);
        let a = drive(
            &mut p,
            t0,
            &[
                (1.0, E::WorkersSucceeded),
                (2.0, E::Barrier(Barrier::Passed)),
            ],
        );
        assert_eq!(
            a,
            [
                A::EnterBarrier { round: 0 },
                A::Finish(Verdict::Succeeded {
                    round: 0,
                    barrier: None
                })
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
                (1.1, E::Stopped),
                (1.2, E::FailureRecorded { failed_rounds: 2 }),
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
    fn a_failure_beyond_the_budget_fails_the_job() {
        let (mut p, t0) = policy(2);
        running(&mut p, t0, 3);
        let a = drive(
            &mut p,
            t0,
            &[
                (1.0, E::WorkerFailed),
                (1.1, E::Stopped),
                (1.2, E::FailureRecorded { failed_rounds: 3 }),
            ],
        );
        assert_eq!(
            a.last(),
            Some(&A::Finish(Verdict::OutOfRestarts { failed_rounds: 3 }))
        );
    }

    #[test]
    fn a_failure_that_cannot_be_recorded_fails_the_job() {
        let (mut p, t0) = policy(5);
        running(&mut p, t0, 0);
        let a = drive(
            &mut p,
            t0,
            &[
                (1.0, E::WorkerFailed),
                (1.1, E::Stopped),
                (1.2, E::FailureNotRecorded),
            ],
        );
        assert_eq!(a.last(), Some(&A::Finish(Verdict::Unrecorded)));
    }

    #[test]
    fn nodes_waiting_or_a_dead_member_re_form_without_spending_the_budget() {
        let (mut p, t0) = policy(0);
        running(&mut p, t0, 0);
        let a = drive(
            &mut p,
            t0,
            &[
                (1.0, E::Checked(Observation::NodesWaiting(1))),
                // A worker exiting during the re-form is part of the stop.
                (1.1, E::WorkerFailed),
                (1.2, E::Stopped),
            ],
        );
        assert_eq!(
            a,
            [
                A::NoteReform {
                    round: 0,
                    waiting: 1
                },
                term(),
                A::Join
            ]
        );
    }

    #[test]
    fn a_run_closed_after_success_elsewhere_never_stops_healthy_workers() {
        let (mut p, t0) = policy(3);
        running(&mut p, t0, 0);
        let a = drive(
            &mut p,
            t0,
            &[
                (1.0, E::Checked(Observation::ClosedAfterSuccess)),
                (2.0, E::Checked(Observation::ClosedAfterSuccess)),
                // The node that finished stops heartbeating: not a re-form.
                (3.0, E::Checked(Observation::NodesWaiting(1))),
                // 300 s later our workers finish too.
                (300.0, E::WorkersSucceeded),
                (300.0, E::Barrier(Barrier::Passed)),
            ],
        );
        assert_eq!(
            a,
            [
                A::NoteClosedAfterSuccess { round: 0 },
                A::EnterBarrier { round: 0 },
                A::Finish(Verdict::Succeeded {
                    round: 0,
                    barrier: None
                })
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
                (1.0, E::Checked(Observation::ClosedAfterFailure(None))),
                (1.5, E::Stopped),
            ],
        );
        assert_eq!(a, [term(), A::Finish(Verdict::FailedElsewhere(None))]);
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
        let a = drive(&mut p, t0, &[(12.0, gone()), (12.5, E::Stopped)]);
        assert_eq!(
            a,
            [
                term(),
                A::Finish(Verdict::LostRendezvous { during: "running" })
            ]
        );
    }

    #[test]
    fn a_signal_in_each_phase() {
        let sig = libc::SIGINT;
        let cases: Vec<(&str, Vec<Event>, Vec<Action>)> = vec![
            (
                "rendezvous",
                vec![],
                vec![A::Finish(Verdict::Signaled(sig))],
            ),
            (
                "starting",
                vec![E::Joined { round: 0 }],
                vec![A::Finish(Verdict::Signaled(sig))],
            ),
            (
                "running",
                vec![E::Joined { round: 0 }, E::Started],
                vec![A::Stop { signal: sig }],
            ),
            (
                "recording a failure",
                vec![
                    E::Joined { round: 0 },
                    E::Started,
                    E::WorkerFailed,
                    E::Stopped,
                ],
                vec![A::Finish(Verdict::Signaled(sig))],
            ),
            (
                "exit barrier",
                vec![E::Joined { round: 0 }, E::Started, E::WorkersSucceeded],
                vec![A::Finish(Verdict::Signaled(sig))],
            ),
            (
                "stopping for a re-form",
                vec![
                    E::Joined { round: 0 },
                    E::Started,
                    E::Checked(Observation::NodesWaiting(1)),
                ],
                vec![],
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
        p.on(E::Checked(Observation::NodesWaiting(1)), t0);
        assert_eq!(p.on(E::Signal(libc::SIGTERM), t0), []);
        assert_eq!(p.on(E::Signal(libc::SIGTERM), t0), [A::Kill]);
        assert_eq!(
            p.on(E::Stopped, t0),
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
            p.on(E::Stopped, t0),
            [A::Finish(Verdict::Signaled(libc::SIGINT))]
        );
    }

    #[test]
    fn exit_barrier_outcomes() {
        for (barrier, verdict) in [
            (
                Barrier::TimedOut("node 1 never came".into()),
                Verdict::Succeeded {
                    round: 2,
                    barrier: Some("node 1 never came".into()),
                },
            ),
            (
                Barrier::Lost("refused".into()),
                Verdict::LostRendezvous {
                    during: "the exit barrier",
                },
            ),
        ] {
            let (mut p, t0) = policy(0);
            running(&mut p, t0, 2);
            p.on(E::WorkersSucceeded, t0);
            // Membership changes after we finished do not matter.
            assert_eq!(p.on(E::Checked(Observation::NodesWaiting(2)), t0), []);
            assert_eq!(p.on(E::Barrier(barrier), t0), [A::Finish(verdict)]);
        }
        // A failure elsewhere while we wait at the barrier fails the job.
        let (mut p, t0) = policy(0);
        running(&mut p, t0, 0);
        p.on(E::WorkersSucceeded, t0);
        assert_eq!(
            p.on(E::Checked(Observation::ClosedAfterFailure(None)), t0),
            [A::Finish(Verdict::FailedElsewhere(None))]
        );
    }

    #[test]
    fn join_outcomes() {
        for (event, verdict) in [
            (E::JoinClosed, Verdict::ClosedWhileJoining),
            (E::JoinNotNeeded, Verdict::NotNeeded),
            (
                E::JoinFailed("timed out".into()),
                Verdict::JoinFailed("timed out".into()),
            ),
        ] {
            let (mut p, t0) = policy(0);
            assert_eq!(p.on(event, t0), [A::Finish(verdict)]);
        }
        let (mut p, t0) = policy(0);
        p.on(E::Joined { round: 4 }, t0);
        assert_eq!(
            p.on(E::StartFailed("no such program".into()), t0),
            [A::Finish(Verdict::StartFailed("no such program".into()))]
        );
    }

    #[test]
    fn stale_events_are_ignored() {
        let (mut p, t0) = policy(0);
        // A check result arriving after the agent left Running.
        assert_eq!(p.on(E::Checked(Observation::Healthy), t0), []);
        assert_eq!(p.on(E::Stopped, t0), []);
        assert_eq!(p.phase(), &Phase::Rendezvous);
    }
}
