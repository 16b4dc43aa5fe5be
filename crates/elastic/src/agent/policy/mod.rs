//! The agent's decisions, without I/O: `(phase, event, now) -> actions`.
//!
//! The driver (`agent/mod.rs` and its per-phase files) performs every
//! [`Action`] (a store round trip, a start, a stop), reports what happened as
//! an [`Event`] with the time, and applies what [`Policy::on`] returns. Nothing here blocks, reads a clock or touches a store,
//! so every row of the table below is tested with simulated time, and the seeded
//! simulator (`agent::sim`) drives many agents' policies through random failure
//! orders.
//!
//! | phase | event | actions | next phase |
//! |---|---|---|---|
//! | `Rendezvous` | joined round r | start workers | `Starting` |
//! | `Rendezvous` | join ended: run closed, or spare not needed | read the verdict | `Ending(reading)` |
//! | `Rendezvous` | join failed (timeout, store gone) | finish (a host lingers first) | `Done` or `Ending(linger)` |
//! | `Starting` | started | | `Running` |
//! | `Starting` | start failed on the stores (a member lost) | join | `Rendezvous` |
//! | `Starting` | start failed on the stores, fixed group (`static`) | publish *failed* | `Ending` |
//! | `Starting` | start failed here (cannot spawn) | publish *failed* | `Ending` |
//! | `Starting` | check: members lost or waiting | join (re-form) | `Rendezvous` |
//! | `Starting` | check: a member lost in a fixed group (`static`) | publish *failed* | `Ending` |
//! | `Starting` | check: closed after a failure | publish nothing, close | `Ending` |
//! | `Starting` | check: unreachable for `lost_grace` | finish failed, outcome unknown (a host lingers first) | `Done` or `Ending(linger)` |
//! | `Running` | all workers succeeded | enter the exit barrier | `ExitBarrier` |
//! | `Running` | a worker failed | stop the rest (SIGTERM) | `Stopping(failure)` |
//! | `Running` | check: a member died, or nodes wait and no member finished | stop | `Stopping(re-form)` |
//! | `Running` | check: nodes wait but a member already finished | none (they wait for a next round) | `Running` |
//! | `Running` | check: run closed after a success elsewhere | none: the workers go on, no more rounds | `Running(closed)` |
//! | `Running(closed)` | check: a member died | stop | `Stopping(member lost)` |
//! | `Running` | check: a member died in a fixed group (`static`) | stop | `Stopping(member lost)` |
//! | `Running` | check: run closed after a failure elsewhere | stop (SIGTERM) | `Stopping(failed elsewhere)` |
//! | `Running` | check: unreachable for `lost_grace` | stop (SIGTERM) | `Stopping(lost)` |
//! | `Running` | signal N | stop with N | `Stopping(signal N)` |
//! | `Stopping(failure)` | stopped | record the failure | `RecordingFailure` |
//! | `Stopping(re-form)` | stopped | join | `Rendezvous` |
//! | `Stopping(other)` | stopped | end with that verdict (lost rendezvous: a host lingers first) | `Ending` |
//! | `Stopping(..)` | signal N | end as signalled once stopped; a second signal kills | `Stopping(signal N)` |
//! | `RecordingFailure` | recorded, a member finished, fixed group (`static`) | publish *failed* | `Ending` |
//! | `RecordingFailure` | recorded, budget left, run open | join | `Rendezvous` |
//! | `RecordingFailure` | recorded, budget spent or run closed | publish *failed* | `Ending` |
//! | `RecordingFailure` | not recorded, within `lost_grace` | record again | `RecordingFailure` |
//! | `RecordingFailure` | not recorded for `lost_grace` | finish failed, without closing (a host lingers first) | `Done` or `Ending(linger)` |
//! | `ExitBarrier` | passed | publish *succeeded* | `Ending` |
//! | `ExitBarrier` | failed: timed out, the run not failed | publish *succeeded* (noting the barrier) | `Ending` |
//! | `ExitBarrier` | failed: the run failed elsewhere | close | `Ending` |
//! | `ExitBarrier` | failed: store unreachable | finish failed, outcome unknown (a host lingers first) | `Done` or `Ending(linger)` |
//! | `ExitBarrier` | check: closed after a failure | close | `Ending` |
//! | `ExitBarrier` | check: unreachable for `lost_grace` | finish failed, outcome unknown (a host lingers first) | `Done` or `Ending(linger)` |
//! | `Ending(publish)` | published: the store holds *failed* | close (the verdict is the store's) | `Ending(close)` |
//! | `Ending(publish)` | published: *succeeded* | close | `Ending(close)` |
//! | `Ending(publish)` | not published | finish failed, without closing (a host lingers first) | `Done` or `Ending(linger)` |
//! | `Ending(read)` | verdict read | finish: failed if the run failed, else not needed | `Done` |
//! | `Ending(close)` | closed | leave the rendezvous (counted out of the run) | `Ending(mark)` |
//! | `Ending(mark)` | marked | linger if this node hosts a store others use | `Ending(linger)` or `Done` |
//! | `Ending(linger)` | every other node of the run left or dead (or the bound) | finish (failed if a failure was published meanwhile) | `Done` |
//! | `Ending(..)` | signal N | finish with the verdict decided | `Done` |
//!
//! Rules the table keeps:
//!
//! - A run is closed only once its verdict is in the run store (*failed* or
//!   *succeeded*, one key), so no node reads a close as a success that was not
//!   one; a verdict that cannot be published is never followed by a close.
//! - A closed run is never a reason by itself to stop healthy workers: only a
//!   published failure is (torchrun stops the workers of a node whose exit
//!   barrier ran out while another node closed the run after success).
//! - A worker failure after the run closed cannot be retried (no more rounds):
//!   it fails the job, and the failure is published.
//! - Every store that another node's workers may use outlives them: the job store
//!   and the rendezvous store stay up until every node of the round counted itself
//!   finished, left, or was found dead.
//! - A worker that exits while the group re-forms is part of the stop; the round
//!   is restarted whatever it returned.
//!
//! # Layout
//!
//! [`Policy::on`] first asks the one table of stale events (`stale.rs`)
//! whether the event concerns the phase at all; if it does, it hands it to
//! that phase's transition, one file per phase: `rendezvous.rs`,
//! `starting.rs`, `running.rs`, `stopping.rs`, `recording.rs`,
//! `exit_barrier.rs`, `ending.rs` (which also holds the ways into the end).
//! The vocabulary is apart: `phase.rs`, `event.rs`, `action.rs`, `verdict.rs`.

mod action;
mod ending;
mod event;
mod exit_barrier;
mod phase;
mod recording;
mod rendezvous;
mod running;
mod stale;
mod starting;
mod stopping;
mod verdict;

use std::time::{Duration, Instant};

#[cfg(test)]
use super::run_store::Closed;
use super::run_store::FailureRecord;
pub use super::run_store::Publish;
pub use action::Action;
pub use event::{Event, EventKind, Observation, StartError};
pub use phase::{EndStep, Membership, Phase, StopReason};
use stale::is_stale;
pub use verdict::{During, Failure, Verdict};

/// The agent's policy knobs.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_restarts: u32,
    /// How long the rendezvous may stay unreachable while workers run, and how
    /// long recording a failure is retried.
    pub lost_grace: Duration,
    /// This node serves the rendezvous store (every round's nodes use it).
    pub hosts_rendezvous: bool,
    /// How long a host lingers for the others after a failure (their stop).
    pub linger_after_failure: Duration,
    /// How long after a success; `None` where the rendezvous notices dead
    /// members, so the host waits exactly as long as some node still runs.
    pub linger_after_success: Option<Duration>,
    /// The group can re-form with other members; `false` for a fixed group
    /// (`static`), where a dead member fails the job.
    pub reforms: bool,
}

/// The policy of one agent.
#[derive(Debug, Clone)]
pub struct Policy {
    limits: Limits,
    phase: Phase,
    /// The round this node last joined.
    member: Option<Membership>,
    /// The first failure of this node's last failed round.
    local_failure: Option<Box<FailureRecord>>,
}

impl Policy {
    /// A policy that starts by joining; returns it and the first action.
    pub fn start(limits: Limits) -> (Policy, Action) {
        (
            Policy {
                limits,
                phase: Phase::Rendezvous,
                member: None,
                local_failure: None,
            },
            Action::Join,
        )
    }

    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// The round this node last joined.
    pub fn member(&self) -> Option<Membership> {
        self.member
    }

    /// The actions after `event`, observed at `now`.
    pub fn on(&mut self, event: Event, now: Instant) -> Vec<Action> {
        let phase = std::mem::replace(&mut self.phase, Phase::Rendezvous);
        let (next, actions) = self.transition(phase, event, now);
        self.phase = next;
        actions
    }

    /// One phase's transition; a stale event leaves the phase as it is.
    fn transition(&mut self, phase: Phase, event: Event, now: Instant) -> (Phase, Vec<Action>) {
        if is_stale(&phase, &event) {
            return (phase, vec![]);
        }
        match phase {
            Phase::Rendezvous => self.on_rendezvous(event),
            Phase::Starting {
                round,
                unreachable_since,
            } => self.on_starting(round, unreachable_since, event, now),
            Phase::Running {
                round,
                closed,
                unreachable_since,
            } => self.on_running(round, closed, unreachable_since, event, now),
            Phase::Stopping { round, why, closed } => {
                self.on_stopping(round, why, closed, event, now)
            }
            Phase::RecordingFailure {
                round,
                closed,
                since,
            } => self.on_recording_failure(round, closed, since, event, now),
            Phase::ExitBarrier {
                round,
                unreachable_since,
            } => self.on_exit_barrier(round, unreachable_since, event, now),
            Phase::Ending { verdict, step } => self.on_ending(verdict, step, event),
            // Every event is stale once done (the table says so above).
            done @ Phase::Done(_) => (done, vec![]),
        }
    }
}

/// Finishes with `v`.
fn finish(v: Verdict) -> (Phase, Vec<Action>) {
    (Phase::Done(v.clone()), vec![Action::Finish(v)])
}

impl Policy {
    /// A phase whose check found the store unreachable (`error`), unreachable
    /// since `since` if it was at the last check: the first finding is noted
    /// (and stays in the phase, `stay`, from `now`); once the store has been
    /// gone `lost_grace` the phase gives up (`give_up`); before that it stays.
    fn unreachable(
        &self,
        since: Option<Instant>,
        now: Instant,
        error: String,
        stay: impl FnOnce(Option<Instant>) -> Phase,
        give_up: impl FnOnce() -> (Phase, Vec<Action>),
    ) -> (Phase, Vec<Action>) {
        match since {
            None => (stay(Some(now)), vec![Action::NoteUnreachable { error }]),
            Some(s) if now.saturating_duration_since(s) >= self.limits.lost_grace => give_up(),
            Some(s) => (stay(Some(s)), vec![]),
        }
    }
}

#[cfg(test)]
mod tests;
