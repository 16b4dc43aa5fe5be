//! Which events are stale in which phase: the one table every phase's
//! transition relies on.
//!
//! The driver reports whatever finished, and some answers arrive after the
//! phase that asked for them ended: a check that raced a phase change, a worker
//! exiting during a stop, the answer to another step of the end. Such an event
//! changes nothing. The table lists, for each phase, the events it acts on;
//! every other event is stale there, and [`Policy::on`](super::Policy::on)
//! drops it before the phase's own transition is called.

use super::action::Action;
use super::event::{Event, EventKind};
use super::phase::{EndStep, Phase};

/// The events `phase` acts on; every other event is stale there.
pub fn expected(phase: &Phase) -> &'static [EventKind] {
    use EventKind as K;
    match phase {
        Phase::Rendezvous => &[K::Joined, K::JoinClosed, K::JoinFailed, K::Signal],
        Phase::Starting { .. } => &[K::Started, K::StartFailed, K::Checked, K::Signal],
        Phase::Running { .. } => &[K::WorkersSucceeded, K::WorkerFailed, K::Checked, K::Signal],
        // Workers exiting while being stopped are part of the stop.
        Phase::Stopping { .. } => &[K::Stopped, K::Signal],
        Phase::RecordingFailure { .. } => &[K::FailureRecorded, K::FailureNotRecorded, K::Signal],
        Phase::ExitBarrier { .. } => &[K::BarrierPassed, K::BarrierFailed, K::Checked, K::Signal],
        // Each step of the end takes its own answer (an answer to another step
        // is stale); a verdict that cannot be read answers `NotPublished`.
        Phase::Ending { step, .. } => match step {
            EndStep::Publish => &[K::Published, K::NotPublished, K::Signal],
            EndStep::ReadVerdict => &[K::VerdictRead, K::NotPublished, K::Signal],
            EndStep::Close => &[K::RendezvousClosed, K::Signal],
            EndStep::MarkFinished => &[K::MarkedFinished, K::Signal],
            EndStep::Linger => &[K::Lingered, K::Signal],
        },
        // Finished: nothing concerns it any more, not even a signal.
        Phase::Done(_) => &[],
    }
}

/// `event` does not concern `phase`: it is ignored.
pub fn is_stale(phase: &Phase, event: &Event) -> bool {
    !expected(phase).contains(&event.kind())
}

/// The last arm of every phase's transition, for the events the table
/// drops before the phase is called: the phase stays as it is. Unreachable
/// while the table and the phases' arms agree; in debug builds (the tests
/// and the agent's simulator) an event the table expects but the phase has
/// no arm for panics, so a new event, or a kind added to [`expected`]
/// without its arm, cannot be dropped unseen. In release it is dropped, as
/// a stale event is.
pub(super) fn unhandled(phase: Phase, event: &Event) -> (Phase, Vec<Action>) {
    debug_assert!(
        is_stale(&phase, event),
        "{event:?} is expected in {phase:?} (stale.rs), but the phase has no arm for it"
    );
    (phase, vec![])
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::super::{Limits, Policy};
    use super::*;
    use crate::agent::policy::{Observation, StartError, StopReason, Verdict};
    use crate::agent::run_store::Closed;
    use EventKind as K;

    /// One event of each kind.
    fn events() -> Vec<Event> {
        vec![
            Event::Joined { round: 1, nodes: 2 },
            Event::JoinClosed,
            Event::JoinFailed("timeout".into()),
            Event::Started {
                hosts_job_store: false,
            },
            Event::StartFailed(StartError::Local("no such program".into())),
            Event::WorkersSucceeded,
            Event::WorkerFailed,
            Event::Checked(Observation::Healthy),
            Event::Stopped { failure: None },
            Event::FailureRecorded {
                failed_rounds: 1,
                finishing: false,
            },
            Event::FailureNotRecorded("gone".into()),
            Event::BarrierPassed,
            Event::BarrierFailed {
                error: "timeout".into(),
                timed_out: true,
                seen: Observation::Healthy,
            },
            Event::Published(Closed::Succeeded),
            Event::NotPublished("gone".into()),
            Event::VerdictRead(None),
            Event::RendezvousClosed,
            Event::MarkedFinished,
            Event::Lingered(None),
            Event::Signal(libc::SIGTERM),
        ]
    }

    fn ending(step: EndStep) -> Phase {
        Phase::Ending {
            verdict: Verdict::NotNeeded,
            step,
        }
    }

    /// One phase of each kind, every step of the end apart, with the events
    /// it acts on: the table, row by row.
    fn rows(t0: Instant) -> Vec<(Phase, Vec<EventKind>)> {
        vec![
            (
                Phase::Rendezvous,
                vec![K::Joined, K::JoinClosed, K::JoinFailed, K::Signal],
            ),
            (
                Phase::Starting {
                    round: 1,
                    unreachable_since: None,
                },
                vec![K::Started, K::StartFailed, K::Checked, K::Signal],
            ),
            (
                Phase::Running {
                    round: 1,
                    closed: false,
                    unreachable_since: None,
                },
                vec![K::WorkersSucceeded, K::WorkerFailed, K::Checked, K::Signal],
            ),
            (
                Phase::Stopping {
                    round: 1,
                    why: StopReason::Reform,
                    closed: false,
                },
                vec![K::Stopped, K::Signal],
            ),
            (
                Phase::RecordingFailure {
                    round: 1,
                    closed: false,
                    since: t0,
                },
                vec![K::FailureRecorded, K::FailureNotRecorded, K::Signal],
            ),
            (
                Phase::ExitBarrier {
                    round: 1,
                    unreachable_since: None,
                },
                vec![K::BarrierPassed, K::BarrierFailed, K::Checked, K::Signal],
            ),
            (
                ending(EndStep::Publish),
                vec![K::Published, K::NotPublished, K::Signal],
            ),
            (
                ending(EndStep::ReadVerdict),
                vec![K::VerdictRead, K::NotPublished, K::Signal],
            ),
            (ending(EndStep::Close), vec![K::RendezvousClosed, K::Signal]),
            (
                ending(EndStep::MarkFinished),
                vec![K::MarkedFinished, K::Signal],
            ),
            (ending(EndStep::Linger), vec![K::Lingered, K::Signal]),
            (Phase::Done(Verdict::NotNeeded), vec![]),
        ]
    }

    fn policy_in(phase: Phase) -> Policy {
        let limits = Limits {
            max_restarts: 1,
            lost_grace: Duration::from_secs(5),
            hosts_rendezvous: false,
            linger_after_failure: Duration::from_secs(7),
            linger_after_success: None,
            reforms: true,
        };
        Policy {
            limits,
            phase,
            member: None,
            local_failure: None,
        }
    }

    #[test]
    fn each_phase_acts_on_its_own_events_and_no_other() {
        for (phase, acts_on) in rows(Instant::now()) {
            for event in events() {
                assert_eq!(
                    is_stale(&phase, &event),
                    !acts_on.contains(&event.kind()),
                    "{phase:?} {event:?}"
                );
            }
        }
    }

    #[test]
    fn a_stale_event_changes_nothing() {
        let t0 = Instant::now();
        for (phase, _) in rows(t0) {
            for event in events().into_iter().filter(|e| is_stale(&phase, e)) {
                let mut p = policy_in(phase.clone());
                let actions = p.on(event.clone(), t0 + Duration::from_secs(60));
                assert_eq!((p.phase(), actions), (&phase, vec![]), "{event:?}");
            }
        }
    }

    #[test]
    fn an_event_a_phase_acts_on_changes_something() {
        // Checks that find nothing new leave a phase as it is; every other
        // event a phase acts on moves it or asks for something.
        let t0 = Instant::now();
        for (phase, _) in rows(t0) {
            for event in events().into_iter().filter(|e| !is_stale(&phase, e)) {
                if event == Event::Checked(Observation::Healthy) {
                    continue;
                }
                let mut p = policy_in(phase.clone());
                let actions = p.on(event.clone(), t0 + Duration::from_secs(60));
                assert!(
                    p.phase() != &phase || !actions.is_empty(),
                    "{phase:?} ignored {event:?}"
                );
            }
        }
    }

    #[test]
    fn a_signal_is_stale_only_once_done() {
        for (phase, acts_on) in rows(Instant::now()) {
            let done = matches!(phase, Phase::Done(_));
            assert_eq!(acts_on.contains(&K::Signal), !done, "{phase:?}");
        }
    }
}
