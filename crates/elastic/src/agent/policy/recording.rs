//! The `RecordingFailure` phase: the failed round is recorded in the run store
//! and counted against the restart budget, retried until `lost_grace`.

use std::time::Instant;

use super::action::Action;
use super::event::Event;
use super::phase::Phase;
use super::stale;
use super::verdict::{Failure, Verdict};
use super::{finish, Policy};

impl Policy {
    /// The record's outcome or a signal; other events are stale here.
    pub(super) fn on_recording_failure(
        &mut self,
        round: u64,
        closed: bool,
        since: Instant,
        event: Event,
        now: Instant,
    ) -> (Phase, Vec<Action>) {
        match event {
            Event::FailureRecorded {
                failed_rounds,
                finishing,
            } => {
                if closed {
                    self.end_publishing_failure(Failure::AfterClose)
                } else if finishing && !self.limits.reforms {
                    self.end_publishing_failure(Failure::FixedGroupFinished)
                } else if failed_rounds <= u64::from(self.limits.max_restarts) {
                    (
                        Phase::Rendezvous,
                        vec![Action::NoteRestart { failed_rounds }, Action::Join],
                    )
                } else {
                    self.end_publishing_failure(Failure::OutOfRestarts { failed_rounds })
                }
            }
            Event::FailureNotRecorded(error) => {
                if now.saturating_duration_since(since) < self.limits.lost_grace {
                    (
                        Phase::RecordingFailure {
                            round,
                            closed,
                            since,
                        },
                        vec![
                            Action::NoteRecordRetry { error },
                            Action::RecordFailure { round },
                        ],
                    )
                } else {
                    // Never closed without a verdict: the others notice this node
                    // gone (heartbeats) or fail on their own.
                    self.end_lingering_unpublished(Verdict::Failed {
                        why: Failure::Unrecorded,
                        root: self.local_failure.clone(),
                    })
                }
            }
            Event::Signal(s) => finish(Verdict::Signaled(s)),
            ev => stale::unhandled(
                Phase::RecordingFailure {
                    round,
                    closed,
                    since,
                },
                &ev,
            ),
        }
    }
}
