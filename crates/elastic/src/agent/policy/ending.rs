//! The `Ending` phase, and the ways into it: the verdict is decided; it is
//! published, the run closed, this node counted out, and a host lingers for
//! the others. Each step may be skipped (see [`EndStep`]).

use super::action::Action;
use super::event::Event;
use super::phase::{EndStep, Phase};
use super::stale;
use super::verdict::{Failure, Verdict};
use super::{finish, Policy, Publish};
use crate::agent::run_store::Closed;

impl Policy {
    /// The answer to the current step or a signal; other events (an answer
    /// to another step among them) are stale here.
    pub(super) fn on_ending(
        &mut self,
        verdict: Verdict,
        step: EndStep,
        event: Event,
    ) -> (Phase, Vec<Action>) {
        match (step, event) {
            (EndStep::Publish, Event::Published(closed)) => {
                let verdict = match (verdict, closed) {
                    // Someone published a failure first: the run failed.
                    (Verdict::Succeeded { .. }, Closed::Failed(root)) => Verdict::Failed {
                        why: Failure::Elsewhere,
                        root,
                    },
                    // The store's root cause is the run's, even none (a node
                    // lost): every node reports the same one.
                    (Verdict::Failed { why, .. }, Closed::Failed(published)) => Verdict::Failed {
                        why,
                        root: published,
                    },
                    (v, _) => v,
                };
                self.end_closing(verdict)
            }
            (EndStep::Publish | EndStep::ReadVerdict, Event::NotPublished(e)) => {
                self.end_lingering_unpublished(match verdict {
                    Verdict::Failed { why, root } => Verdict::Failed {
                        why,
                        root: root.or_else(|| self.local_failure.clone()),
                    },
                    // A success that cannot be published is not known to be one.
                    _ => Verdict::failed(Failure::Unpublished(e)),
                })
            }
            (EndStep::ReadVerdict, Event::VerdictRead(read)) => match read {
                Some(Closed::Failed(root)) => self.end_after_close(Verdict::Failed {
                    why: Failure::Elsewhere,
                    root,
                }),
                // Nothing failed: a node not needed (exits 0).
                Some(Closed::Succeeded) | None => self.end_after_close(verdict),
            },
            (EndStep::Close, Event::RendezvousClosed) => self.end_after_close(verdict),
            (EndStep::MarkFinished, Event::MarkedFinished) => self.end_lingering(verdict),
            (EndStep::Linger, Event::Lingered(seen)) => finish(match (verdict, seen) {
                (Verdict::Succeeded { .. } | Verdict::NotNeeded, Some(Closed::Failed(root))) => {
                    Verdict::Failed {
                        why: Failure::Elsewhere,
                        root,
                    }
                }
                // The run's root cause, as every node reports it.
                (Verdict::Failed { why, .. }, Some(Closed::Failed(root))) => {
                    Verdict::Failed { why, root }
                }
                (v, _) => v,
            }),
            (_, Event::Signal(_)) => finish(verdict),
            (step, ev) => stale::unhandled(Phase::Ending { verdict, step }, &ev),
        }
    }

    /// Ends with a failure this node publishes.
    pub(super) fn end_publishing_failure(&self, why: Failure) -> (Phase, Vec<Action>) {
        let local = self.local_failure.clone();
        self.end_publishing(
            Verdict::Failed {
                why,
                root: local.clone(),
            },
            Publish::Failed { local },
        )
    }

    pub(super) fn end_publishing(
        &self,
        verdict: Verdict,
        publish: Publish,
    ) -> (Phase, Vec<Action>) {
        (
            Phase::Ending {
                verdict,
                step: EndStep::Publish,
            },
            vec![Action::Publish(publish)],
        )
    }

    /// The verdict is in the store: close the rendezvous.
    pub(super) fn end_closing(&self, verdict: Verdict) -> (Phase, Vec<Action>) {
        (
            Phase::Ending {
                verdict,
                step: EndStep::Close,
            },
            vec![Action::CloseRendezvous],
        )
    }

    /// Closed: leave the rendezvous (counted out of the run), if this node
    /// was ever a member.
    fn end_after_close(&self, verdict: Verdict) -> (Phase, Vec<Action>) {
        match self.member {
            Some(m) => (
                Phase::Ending {
                    verdict,
                    step: EndStep::MarkFinished,
                },
                vec![Action::MarkFinished { round: m.round }],
            ),
            None => self.end_lingering(verdict),
        }
    }

    /// Left: linger if others use a store this node serves. The rendezvous
    /// store's host lingers even if it never was a member (a spare that came
    /// first): every node uses its store to the end. Also the way out when
    /// this node cannot reach the run store: for a host that is its own store
    /// stalled, which the others still need once it answers again.
    fn end_lingering(&self, verdict: Verdict) -> (Phase, Vec<Action>) {
        self.linger(verdict, true)
    }

    /// [`Self::end_lingering`] with a failure the others were not told of (the
    /// store did not answer): a host waits for them as after a success, since
    /// nothing tells them to stop.
    pub(super) fn end_lingering_unpublished(&self, verdict: Verdict) -> (Phase, Vec<Action>) {
        self.linger(verdict, false)
    }

    fn linger(&self, verdict: Verdict, published: bool) -> (Phase, Vec<Action>) {
        let job_store = self.member.is_some_and(|m| m.hosts && m.nodes > 1);
        if !(job_store || self.limits.hosts_rendezvous) {
            return finish(verdict);
        }
        let bound = match verdict {
            Verdict::Failed { .. } if published => Some(self.limits.linger_after_failure),
            // The exit barrier passed: every member's workers are done, and no
            // later round formed; the others only read how the run ended. A
            // node that vanished without leaving cannot hold the host then.
            Verdict::Succeeded { barrier: None, .. } => Some(self.limits.linger_after_failure),
            _ => self.limits.linger_after_success,
        };
        let (round, nodes) = self.member.map_or((0, 0), |m| (m.round, m.nodes));
        let after_barrier = matches!(verdict, Verdict::Succeeded { barrier: None, .. });
        (
            Phase::Ending {
                verdict,
                step: EndStep::Linger,
            },
            vec![Action::Linger {
                round,
                nodes,
                bound,
                after_barrier,
                serves: job_store,
            }],
        )
    }
}
