//! The `ExitBarrier` phase: this node's workers succeeded; it waits for every
//! node's, while the rendezvous is watched.

use std::time::Instant;

use super::action::Action;
use super::event::{Event, Observation};
use super::phase::Phase;
use super::stale;
use super::verdict::{During, Failure, Verdict};
use super::{finish, Policy, Publish};
use crate::agent::run_store::Closed;

impl Policy {
    /// The barrier's end, a check or a signal; other events are stale here.
    pub(super) fn on_exit_barrier(
        &mut self,
        round: u64,
        unreachable_since: Option<Instant>,
        event: Event,
        now: Instant,
    ) -> (Phase, Vec<Action>) {
        match event {
            Event::BarrierPassed => self.end_publishing(
                Verdict::Succeeded {
                    round,
                    barrier: None,
                },
                Publish::Succeeded,
            ),
            Event::BarrierFailed {
                error,
                timed_out,
                seen,
            } => self.barrier_failed(round, error, timed_out, seen),
            Event::Checked(obs) => self.barrier_checked(round, unreachable_since, obs, now),
            Event::Signal(s) => finish(Verdict::Signaled(s)),
            ev => stale::unhandled(
                Phase::ExitBarrier {
                    round,
                    unreachable_since,
                },
                &ev,
            ),
        }
    }

    /// The barrier ended in error; `seen` is the rendezvous looked at right
    /// after.
    fn barrier_failed(
        &self,
        round: u64,
        error: String,
        timed_out: bool,
        seen: Observation,
    ) -> (Phase, Vec<Action>) {
        let lost = || {
            Verdict::failed(Failure::LostRendezvous {
                during: During::ExitBarrier,
            })
        };
        match seen {
            Observation::Closed(Closed::Failed(root)) => self.end_closing(Verdict::Failed {
                why: Failure::Elsewhere,
                root,
            }),
            Observation::Unreachable(_) => self.end_lingering_unpublished(lost()),
            Observation::Healthy
            | Observation::Changed { .. }
            | Observation::Closed(Closed::Succeeded) => {
                if timed_out {
                    // torchrun's exit barrier: this node's workers succeeded;
                    // the publish re-reads the verdict, so a failure published
                    // meanwhile still wins.
                    self.end_publishing(
                        Verdict::Succeeded {
                            round,
                            barrier: Some(error),
                        },
                        Publish::Succeeded,
                    )
                } else {
                    self.end_lingering_unpublished(lost())
                }
            }
        }
    }

    fn barrier_checked(
        &self,
        round: u64,
        unreachable_since: Option<Instant>,
        obs: Observation,
        now: Instant,
    ) -> (Phase, Vec<Action>) {
        let waiting = |unreachable_since| Phase::ExitBarrier {
            round,
            unreachable_since,
        };
        match obs {
            Observation::Closed(Closed::Failed(root)) => self.end_closing(Verdict::Failed {
                why: Failure::Elsewhere,
                root,
            }),
            // A store gone for `lost_grace` ends the wait (the barrier's own
            // timeout may be far longer): the outcome is unknown.
            Observation::Unreachable(error) => {
                self.unreachable(unreachable_since, now, error, waiting, || {
                    self.end_lingering_unpublished(Verdict::failed(Failure::LostRendezvous {
                        during: During::ExitBarrier,
                    }))
                })
            }
            // Membership changes after this node finished do not concern it.
            Observation::Healthy
            | Observation::Changed { .. }
            | Observation::Closed(Closed::Succeeded) => (waiting(None), vec![]),
        }
    }
}
