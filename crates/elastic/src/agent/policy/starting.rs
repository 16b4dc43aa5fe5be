//! The `Starting` phase: ranks, the job store, spawning, while the rendezvous
//! is watched.

use std::time::Instant;

use super::action::Action;
use super::event::{Event, Observation, StartError};
use super::phase::Phase;
use super::stale;
use super::verdict::{During, Failure, Verdict};
use super::{finish, Policy};
use crate::agent::run_store::Closed;

impl Policy {
    /// The start's outcome, a check or a signal; other events are stale here.
    pub(super) fn on_starting(
        &mut self,
        round: u64,
        unreachable_since: Option<Instant>,
        event: Event,
        now: Instant,
    ) -> (Phase, Vec<Action>) {
        match event {
            Event::Started { hosts_job_store } => {
                if let Some(m) = &mut self.member {
                    m.hosts |= hosts_job_store;
                }
                (
                    Phase::Running {
                        round,
                        closed: false,
                        unreachable_since: None,
                    },
                    vec![],
                )
            }
            Event::StartFailed(StartError::Store(e)) if !self.limits.reforms => {
                self.end_publishing_failure(Failure::FixedGroupStart(e))
            }
            Event::StartFailed(StartError::Store(e)) => (
                Phase::Rendezvous,
                vec![
                    Action::NoteReform {
                        round,
                        waiting: 0,
                        dead: 0,
                        lost: Vec::new(),
                    },
                    Action::NoteUnreachable { error: e },
                    Action::Join,
                ],
            ),
            Event::StartFailed(StartError::Local(e)) => {
                self.end_publishing_failure(Failure::StartFailed(e))
            }
            Event::Checked(obs) => self.starting_checked(round, unreachable_since, obs, now),
            Event::Signal(s) => finish(Verdict::Signaled(s)),
            ev => stale::unhandled(
                Phase::Starting {
                    round,
                    unreachable_since,
                },
                &ev,
            ),
        }
    }

    fn starting_checked(
        &self,
        round: u64,
        unreachable_since: Option<Instant>,
        obs: Observation,
        now: Instant,
    ) -> (Phase, Vec<Action>) {
        let starting = |unreachable_since| Phase::Starting {
            round,
            unreachable_since,
        };
        match obs {
            Observation::Changed { dead, .. } if dead > 0 && !self.limits.reforms => {
                self.end_publishing_failure(Failure::MemberLostFixedGroup)
            }
            Observation::Changed {
                waiting,
                dead,
                lost,
                ..
            } if dead > 0 || waiting > 0 => (
                Phase::Rendezvous,
                vec![
                    Action::NoteReform {
                        round,
                        waiting,
                        dead,
                        lost,
                    },
                    Action::Join,
                ],
            ),
            Observation::Closed(Closed::Failed(root)) => self.end_closing(Verdict::Failed {
                why: Failure::Elsewhere,
                root,
            }),
            // The start's own store calls wait up to the store's timeout: a
            // store gone for `lost_grace` ends it sooner.
            Observation::Unreachable(error) => {
                self.unreachable(unreachable_since, now, error, starting, || {
                    self.end_lingering_unpublished(Verdict::failed(Failure::LostRendezvous {
                        during: During::Starting,
                    }))
                })
            }
            // A success closed elsewhere does not stop a start (the workers
            // will run to their end, as on a running node).
            Observation::Healthy
            | Observation::Changed { .. }
            | Observation::Closed(Closed::Succeeded) => (starting(None), vec![]),
        }
    }
}
