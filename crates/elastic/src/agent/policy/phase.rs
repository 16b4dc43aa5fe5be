//! Where the agent is: its [`Phase`]s (with the round and what the phase
//! waits on), why workers are stopped, and the steps of a run's end.

use std::time::Instant;

use super::verdict::Verdict;
use crate::agent::run_store::FailureRecord;
use crate::agent::state::AgentState;

/// Why the workers are being stopped.
#[derive(Debug, Clone, PartialEq)]
pub enum StopReason {
    /// A local worker failed; the rest go down with it (all or nothing).
    WorkerFailed,
    /// Nodes are waiting or a member died: the group re-forms.
    Reform,
    /// Another node published the run's failure.
    FailedElsewhere(Option<Box<FailureRecord>>),
    /// A member died after the run was closed: no round can replace it.
    MemberLostAfterClose,
    /// A member died and the group cannot re-form (`static`).
    MemberLostFixedGroup,
    /// The rendezvous store has been unreachable for the grace period.
    LostRendezvous,
    /// A trapped signal (forwarded to the workers).
    Signal(i32),
}

/// The round this node is (or was last) a member of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Membership {
    pub round: u64,
    /// Nodes in the round.
    pub nodes: usize,
    /// This node serves a store the round's other nodes use (the job store, or
    /// the rendezvous store).
    pub hosts: bool,
}

/// Where the agent is.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// Joining the next round.
    Rendezvous,
    /// Ranks, the job store, spawning; the rendezvous is watched meanwhile.
    Starting {
        round: u64,
        /// Since when the rendezvous cannot be read.
        unreachable_since: Option<Instant>,
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
        closed: bool,
    },
    /// Recording the failure in the run store and counting the round; retried
    /// until `lost_grace` after `since`.
    RecordingFailure {
        round: u64,
        closed: bool,
        since: Instant,
    },
    /// Local workers succeeded; waiting for every node.
    ExitBarrier {
        round: u64,
        /// Since when the rendezvous cannot be read.
        unreachable_since: Option<Instant>,
    },
    /// The verdict is decided; publishing it, closing the run, lingering.
    Ending {
        verdict: Verdict,
        step: EndStep,
    },
    Done(Verdict),
}

/// The steps of the end of a run, in order (each may be skipped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndStep {
    /// Writing the verdict to the run store.
    Publish,
    /// Reading the verdict (the run closed while this node joined).
    ReadVerdict,
    /// Closing the rendezvous (no more rounds).
    Close,
    /// Leaving the rendezvous: counted out of the run.
    MarkFinished,
    /// Keeping hosted stores up for the other nodes.
    Linger,
}

impl Phase {
    /// A short name, for status and events.
    pub fn name(&self) -> &'static str {
        self.state().name()
    }

    /// What the status endpoint shows.
    pub fn state(&self) -> AgentState {
        match self {
            Phase::Rendezvous => AgentState::Rendezvous,
            Phase::Starting { .. } => AgentState::Starting,
            Phase::Running { .. } => AgentState::Running,
            Phase::Stopping { .. } => AgentState::Stopping,
            Phase::RecordingFailure { .. } => AgentState::RecordingFailure,
            Phase::ExitBarrier { .. } => AgentState::ExitBarrier,
            Phase::Ending { .. } => AgentState::Ending,
            Phase::Done(v) => v.state(),
        }
    }
}
