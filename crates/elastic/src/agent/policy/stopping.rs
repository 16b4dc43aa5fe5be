//! The `Stopping` phase: the workers are being stopped, and why decides what
//! follows.

use std::time::Instant;

use super::action::Action;
use super::event::Event;
use super::phase::{Phase, StopReason};
use super::stale;
use super::verdict::{During, Failure, Verdict};
use super::{finish, Policy};

impl Policy {
    /// The stop's end or a signal; other events are stale here (workers
    /// exiting while being stopped are part of the stop).
    pub(super) fn on_stopping(
        &mut self,
        round: u64,
        why: StopReason,
        closed: bool,
        event: Event,
        now: Instant,
    ) -> (Phase, Vec<Action>) {
        match event {
            Event::Stopped { failure } => {
                if failure.is_some() {
                    self.local_failure = failure;
                }
                self.stopped(round, why, closed, now)
            }
            // Already stopping: end as signalled; a second signal kills.
            Event::Signal(s) => {
                let again = matches!(why, StopReason::Signal(_));
                (
                    Phase::Stopping {
                        round,
                        why: StopReason::Signal(s),
                        closed,
                    },
                    if again { vec![Action::Kill] } else { vec![] },
                )
            }
            ev => stale::unhandled(Phase::Stopping { round, why, closed }, &ev),
        }
    }

    /// The workers stopped: what follows depends on why they were stopped.
    fn stopped(
        &self,
        round: u64,
        why: StopReason,
        closed: bool,
        now: Instant,
    ) -> (Phase, Vec<Action>) {
        match why {
            StopReason::WorkerFailed => (
                Phase::RecordingFailure {
                    round,
                    closed,
                    since: now,
                },
                vec![Action::RecordFailure { round }],
            ),
            StopReason::Reform => (Phase::Rendezvous, vec![Action::Join]),
            StopReason::FailedElsewhere(root) => self.end_closing(Verdict::Failed {
                why: Failure::Elsewhere,
                root,
            }),
            StopReason::MemberLostAfterClose => {
                self.end_publishing_failure(Failure::MemberLostAfterClose)
            }
            StopReason::MemberLostFixedGroup => {
                self.end_publishing_failure(Failure::MemberLostFixedGroup)
            }
            StopReason::LostRendezvous => self.end_lingering_unpublished(Verdict::Failed {
                why: Failure::LostRendezvous {
                    during: During::Running,
                },
                root: self.local_failure.clone(),
            }),
            StopReason::Signal(s) => finish(Verdict::Signaled(s)),
        }
    }
}

/// Stops the workers (SIGTERM) for `why`.
pub(super) fn stop(round: u64, why: StopReason, closed: bool) -> (Phase, Vec<Action>) {
    (
        Phase::Stopping { round, why, closed },
        vec![Action::Stop {
            signal: libc::SIGTERM,
        }],
    )
}
