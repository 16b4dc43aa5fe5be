//! The `Running` phase: workers running, the rendezvous watched.

use std::time::Instant;

use super::action::Action;
use super::event::{Event, Observation};
use super::phase::{Phase, StopReason};
use super::stale;
use super::stopping::stop;
use super::Policy;
use crate::agent::run_store::Closed;

impl Policy {
    /// The workers' end, a check or a signal; other events are stale here.
    pub(super) fn on_running(
        &mut self,
        round: u64,
        closed: bool,
        unreachable_since: Option<Instant>,
        event: Event,
        now: Instant,
    ) -> (Phase, Vec<Action>) {
        match event {
            Event::WorkersSucceeded => (
                Phase::ExitBarrier {
                    round,
                    unreachable_since: None,
                },
                vec![Action::EnterBarrier { round }],
            ),
            Event::WorkerFailed => stop(round, StopReason::WorkerFailed, closed),
            Event::Checked(obs) => self.running_checked(round, closed, unreachable_since, obs, now),
            Event::Signal(s) => (
                Phase::Stopping {
                    round,
                    why: StopReason::Signal(s),
                    closed,
                },
                vec![Action::Stop { signal: s }],
            ),
            ev => stale::unhandled(
                Phase::Running {
                    round,
                    closed,
                    unreachable_since,
                },
                &ev,
            ),
        }
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
            // No more rounds once the run is closed: a dead member cannot be
            // replaced, and the job cannot complete.
            Observation::Changed { dead, .. } if closed && dead > 0 => {
                stop(round, StopReason::MemberLostAfterClose, closed)
            }
            // A fixed group (`static`) cannot replace a dead member: the job
            // fails now, not when a collective times out.
            Observation::Changed { dead, .. } if dead > 0 && !self.limits.reforms => {
                stop(round, StopReason::MemberLostFixedGroup, closed)
            }
            Observation::Changed {
                waiting,
                dead,
                finishing,
                lost,
            } if dead > 0 || (waiting > 0 && !finishing && !closed) => {
                let (p, mut a) = stop(round, StopReason::Reform, closed);
                a.insert(
                    0,
                    Action::NoteReform {
                        round,
                        waiting,
                        dead,
                        lost,
                    },
                );
                (p, a)
            }
            // Nodes waiting while a member already finished (or the run is
            // closed): the round is ending; they wait for a next round.
            Observation::Changed { .. } => (running(closed, None), vec![]),
            Observation::Closed(Closed::Succeeded) if closed => (running(true, None), vec![]),
            Observation::Closed(Closed::Succeeded) => (
                running(true, None),
                vec![Action::NoteClosedAfterSuccess { round }],
            ),
            Observation::Closed(Closed::Failed(r)) => {
                stop(round, StopReason::FailedElsewhere(r), closed)
            }
            Observation::Unreachable(error) => self.unreachable(
                unreachable_since,
                now,
                error,
                |since| running(closed, since),
                || stop(round, StopReason::LostRendezvous, closed),
            ),
        }
    }
}
