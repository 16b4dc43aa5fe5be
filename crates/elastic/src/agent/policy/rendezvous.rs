//! The `Rendezvous` phase: joining the next round.

use super::action::Action;
use super::event::Event;
use super::phase::{EndStep, Membership, Phase};
use super::stale;
use super::verdict::Verdict;
use super::{finish, Policy};

impl Policy {
    /// A join's answer or a signal; other events are stale here.
    pub(super) fn on_rendezvous(&mut self, event: Event) -> (Phase, Vec<Action>) {
        match event {
            Event::Joined { round, nodes } => {
                self.member = Some(Membership {
                    round,
                    nodes,
                    hosts: self.limits.hosts_rendezvous,
                });
                (
                    Phase::Starting {
                        round,
                        unreachable_since: None,
                    },
                    vec![Action::Start { round }],
                )
            }
            Event::JoinClosed => (
                Phase::Ending {
                    verdict: Verdict::NotNeeded,
                    step: EndStep::ReadVerdict,
                },
                vec![Action::ReadVerdict],
            ),
            // A host whose own store stalls keeps it up for the others.
            Event::JoinFailed(e) => self.end_lingering_unpublished(Verdict::JoinFailed(e)),
            Event::Signal(s) => finish(Verdict::Signaled(s)),
            ev => stale::unhandled(Phase::Rendezvous, &ev),
        }
    }
}
